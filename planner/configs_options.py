"""Every option a framework configuration may hold, sorted by what meshplan does with it.

A reader in `configs` turns a torchtitan, Megatron-LM or DeepSpeed file into a `Parallel`,
engine options and a model. Every option the file states is one of four kinds:

- priced: the reader reads it (into the `Parallel`, the engine or the model; where it can
  only approximate, the reader says how in its own note), or it asks for exactly what
  meshplan prices (Megatron `--use-flash-attn`: meshplan prices FlashAttention-2).
- not priced: a real option of that framework that changes the step's time or memory in a
  way meshplan does not model. Listed, with how it is priced instead, unless its value is one
  that prices as meshplan prices (`NotPriced.fine`: `--cpu-offloading-num-layers 0` is no
  offloading).
- bookkeeping: cannot change the step's time or memory (paths, logging, checkpoint
  intervals, seeds, data, tokenizer files, optimizer hyperparameters). Silently accepted;
  each group of the tables says why.
- unknown: not an option of that framework that these tables know: listed with the nearest
  known name (`difflib`), because a typo (`--tensor-model-paralel-size`) leaves the user's
  run at the default the typo meant to change.

What a file leaves at the framework's default is not listed (the tables look at what the
file states, never at what it omits). `classify(OPTIONS[fmt], given)` does the sorting;
`configs.load` puts what it finds in `FrameworkConfig.unpriced` and `.unknown`.

Names are spelled as in the file: Megatron flags without the leading `--`, torchtitan
`section.field` (the TOML's tables, or the command line's `--section.field` overrides),
DeepSpeed `key.subkey`. A name covers everything under it (`deepspeed` `scheduler` covers
`scheduler.params.warmup_max_lr`), unless a longer name says otherwise.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class NotPriced:
    """A real option meshplan does not price: `why` says how the step is priced instead;
    a value in `fine` prices as meshplan prices it (the option is then silent)."""

    why: str
    fine: tuple[object, ...] = (False,)


@dataclass(frozen=True, slots=True)
class Options:
    """One configuration format's option names by kind (module docstring). `prefix`, `sep`
    and `section` spell a name as the file does: `--name value`, `name = value`, `[name]`."""

    framework: str
    priced: frozenset[str]
    not_priced: Mapping[str, NotPriced]
    bookkeeping: frozenset[str]
    prefix: str = ""
    sep: str = " = "
    section: str = "{}"

    def __post_init__(self) -> None:
        both = (
            (self.priced & self.bookkeeping)
            | (self.priced & set(self.not_priced))
            | (self.bookkeeping & set(self.not_priced))
        )
        if both:  # one kind per name, or the tables contradict each other
            raise ValueError(f"{self.framework}: names in two kinds: {sorted(both)}")

    @property
    def known(self) -> frozenset[str]:
        """Every name of the three tables."""
        return self.priced | self.bookkeeping | frozenset(self.not_priced)

    def show(self, name: str, value: object = True) -> str:
        """`name` (and its value, unless a bare flag or a table) as the file writes it."""
        if value is True or isinstance(value, dict):
            return f"{self.prefix}{name}"
        return f"{self.prefix}{name}{self.sep}{_text(value)}"


@dataclass(frozen=True, slots=True)
class Findings:
    """What `classify` found: `not_priced` (one entry per reason, naming the options) and
    `unknown` (each with its did-you-mean), in file order."""

    not_priced: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def classify(options: Options, given: Iterable[tuple[str, object]]) -> Findings:
    """Sort the options a file states (`(name, value)`, a nested dict value for a table of
    a TOML or JSON file) into not priced and unknown; priced and bookkeeping are silent."""
    known = options.known
    sections = _sections(known)
    reasons: dict[str, list[str]] = {}
    unknown: list[str] = []
    for name, value in _leaves(given, known, sections):
        entry = _entry(name, known)
        if entry is None:
            note = _unknown(options, name, isinstance(value, dict), known, sections)
            if note not in unknown:
                unknown.append(note)
        elif entry in options.not_priced:
            rule = options.not_priced[entry]
            if not _fine(value, rule.fine):
                shown = options.show(name, value)
                if shown not in reasons.setdefault(rule.why, []):
                    reasons[rule.why].append(shown)
    notes = tuple(f"{', '.join(names)}: {why}" for why, names in reasons.items())
    return Findings(notes, tuple(unknown))


def _leaves(
    given: Iterable[tuple[str, object]], known: frozenset[str], sections: frozenset[str]
) -> Iterator[tuple[str, object]]:
    """`(dotted name, value)` for every option stated, descending into tables except where a
    known name covers the whole table."""
    for name, value in given:
        if isinstance(value, dict) and (name in sections or name not in known):
            if not value and name not in sections:
                yield name, value  # an empty table of an unknown name is still unknown
            yield from _leaves(((f"{name}.{k}", v) for k, v in value.items()), known, sections)
        else:
            yield name, value


def _entry(name: str, known: frozenset[str]) -> str | None:
    """The longest known name that is `name` or a table holding it."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def _sections(known: frozenset[str]) -> frozenset[str]:
    """Every table that holds a known name (`parallelism`, `zero_optimization`, ...)."""
    out = set()
    for name in known:
        parts = name.split(".")
        out.update(".".join(parts[:n]) for n in range(1, len(parts)))
    return frozenset(out)


def _unknown(
    options: Options, name: str, table: bool, known: frozenset[str], sections: frozenset[str]
) -> str:
    """`name` as unknown: the shallowest part of it no table knows, and the nearest name
    known at that level."""
    parts = name.split(".")
    for n in range(1, len(parts) + 1):
        head = ".".join(parts[:n])
        if head not in sections and head not in known:
            break
    parent = ".".join(parts[: n - 1])
    level = {
        k.split(".")[n - 1]
        for k in known | sections
        if k.count(".") >= n - 1 and (not parent or k.startswith(parent + "."))
    }
    is_table = table or n < len(parts)
    shown = options.section.format(head) if is_table else f"{options.prefix}{head}"
    near = difflib.get_close_matches(parts[n - 1], sorted(level), n=1, cutoff=0.75)
    if not near:  # a name cut short (`--cpu-offloading`): the shortest that extends it
        near = sorted((k for k in level if k.startswith(parts[n - 1])), key=lambda k: (len(k), k))
    if not near:
        return shown
    guess = f"{parent}.{near[0]}" if parent else near[0]
    guess = options.section.format(guess) if is_table else f"{options.prefix}{guess}"
    return f"{shown} (did you mean {guess}?)"


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value) if isinstance(value, list) else str(value)


def _norm(value: object) -> object:
    """A value comparable across file formats: "1", 1 and 1.0; "true" and True."""
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v) for v in value)
    if isinstance(value, bool):
        return value
    s = str(value).strip()
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    try:
        return float(s)
    except ValueError:
        return s


def _fine(value: object, fine: tuple[object, ...]) -> bool:
    """Whether `value` prices as meshplan prices it: a value in `fine`, DeepSpeed's "auto"
    (the framework picks its default), nothing at all, or a table switched off."""
    if value is None or value == "auto" or value == [] or value == "":
        return True
    if isinstance(value, dict):
        return not value or value.get("enabled") is False
    return _norm(value) in {_norm(f) for f in fine}


def _names(groups: Mapping[str, str]) -> frozenset[str]:
    """The names of a table written as {why: "name name ..."}: the key is the comment."""
    return frozenset(n for text in groups.values() for n in text.split())


def _each(why: str, names: str, fine: tuple[object, ...] = (False,)) -> dict[str, NotPriced]:
    """One `NotPriced` for several names that share a reason (listed together)."""
    return {n: NotPriced(why, fine) for n in names.split()}


def _in(section: str, names: str) -> str:
    """`names` prefixed with their table: _in("a", "x y") == "a.x a.y"."""
    return " ".join(f"{section}.{n}" for n in names.split())


# -- Megatron-LM ----------------------------------------------------------------------------------
# Names from Megatron-LM megatron/training/arguments.py at core_v0.16.1 (the flags
# `add_megatron_arguments` defines, including the ones generated from megatron-core's
# TransformerConfig). The table covers the flags of pretraining runs; inference, RL,
# vision, retrieval, Mamba/hybrid and fault-tolerance flags are not in it (they read as
# unknown).

_MEGATRON_PRICED = _names(
    {
        "read into the Parallel": """
            tensor-model-parallel-size pipeline-model-parallel-size context-parallel-size
            hierarchical-context-parallel-sizes
            expert-model-parallel-size micro-batch-size global-batch-size sequence-parallel
            use-distributed-optimizer use-torch-fsdp2 torch-fsdp2-no-reshard-after-forward
            use-megatron-fsdp data-parallel-sharding-strategy
            num-layers-per-virtual-pipeline-stage num-virtual-stages-per-pipeline-rank
            virtual-pipeline-model-parallel-size
            decoder-first-pipeline-num-layers decoder-last-pipeline-num-layers
            account-for-embedding-in-pipeline-split account-for-loss-in-pipeline-split
            recompute-activations recompute-granularity recompute-method recompute-num-layers
            recompute-modules""",
        # virtual-pipeline-model-parallel-size is NeMo / Megatron-Bridge's name
        # (`virtual_pipeline_model_parallel_size`), read as --num-virtual-stages-per-pipeline-rank
        "read into the model": """
            num-layers hidden-size ffn-hidden-size num-attention-heads group-query-attention
            num-query-groups vocab-size padded-vocab-size tokenizer-type swiglu normalization
            position-embedding-type use-rotary-position-embeddings
            untie-embeddings-and-output-weights num-experts moe-router-topk seq-length
            max-position-embeddings disable-bias-linear add-qkv-bias kv-channels""",
        # max-position-embeddings sizes a learned position table, priced at --seq-length;
        # the reader notes the bias flags where they disagree with the block style, and a
        # head dimension other than hidden / heads
        "read into the engine": """
            no-masked-softmax-fusion no-bias-gelu-fusion no-bias-swiglu-fusion
            no-bias-dropout-fusion fp8-format fp8-recipe fp8-param-gather tp-comm-overlap
            accumulate-allreduce-grads-in-fp32 grad-reduce-in-bf16 overlap-grad-reduce""",
        # what meshplan prices: bf16 mixed precision; with --overlap-grad-reduce, the
        # distributed optimizer's parameter gather under the next forward; FlashAttention-2;
        # TP traffic exposed unless --tp-comm-overlap (the async all-reduce flags switch
        # overlap off);
        # the fp32 main-grad add inside the weight-gradient time (not priced apart, and
        # Megatron-FSDP requires --no-gradient-accumulation-fusion); expert GEMMs as grouped
        # GEMMs; a balanced router (forced balancing is that); no garbage-collection pauses
        "what meshplan prices": """
            bf16 overlap-param-gather use-flash-attn use-mcore-models
            no-async-tensor-model-parallel-allreduce disable-async-tensor-model-parallel-allreduce
            no-gradient-accumulation-fusion moe-grouped-gemm moe-router-force-load-balancing
            manual-gc manual-gc-interval""",
    }
)

_MEGATRON_NOT_PRICED: dict[str, NotPriced] = {
    # memory placement
    **_each(
        "activation/weight CPU offloading: priced without offload",
        "fine-grained-activation-offloading offload-modules",
    ),
    "cpu-offloading-num-layers": NotPriced(
        "activation/weight CPU offloading: priced without offload", (0,)
    ),
    **_each(
        "optimizer CPU offload: priced with the optimizer on the GPU",
        "optimizer-cpu-offload overlap-cpu-optimizer-d2h-h2d use-torch-optimizer-for-cpu-offload",
    ),
    "optimizer-offload-fraction": NotPriced(
        "optimizer CPU offload: priced with the optimizer on the GPU", (0,)
    ),
    "distribute-saved-activations": NotPriced(
        "saved activations split over TP ranks under full recomputation: priced unsplit"
    ),
    "moe-layer-recompute": NotPriced("MoE-layer recomputation: priced without it"),
    # precision
    "fp16": NotPriced("fp16 with loss scaling: priced as bf16"),
    **_each(
        "lower-precision optimizer states / main weights: priced as fp32 Adam states",
        "main-grads-dtype main-params-dtype exp-avg-dtype exp-avg-sq-dtype",
        ("fp32",),
    ),
    "use-precision-aware-optimizer": NotPriced(
        "lower-precision optimizer states / main weights: priced as fp32 Adam states"
    ),
    **_each(
        "layers kept in bf16 under FP8: priced with every block linear in FP8",
        "first-last-layers-bf16 num-layers-at-start-in-bf16 num-layers-at-end-in-bf16",
        (False, 0),
    ),
    **_each(
        "FP8 weight gradients in higher precision: priced as FP8",
        "no-fp8-wgrad disable-fp8-wgrad",
    ),
    "keep-fp8-transpose-cache": NotPriced("cached FP8 transposes: priced without the cache"),
    **_each("FP4 layers: priced in bf16", "fp4-format fp4-recipe fp4-param-gather", (None,)),
    "te-precision-config-file": NotPriced(
        "per-layer precision from a file: priced with one precision", ()
    ),
    # kernels
    "attention-backend": NotPriced(
        "unfused attention: priced as FlashAttention-2", ("auto", "flash", "fused")
    ),
    "transformer-impl": NotPriced(
        "non-Transformer-Engine layers: priced as Transformer Engine's", ("transformer_engine",)
    ),
    "no-rope-fusion": NotPriced("unfused RoPE: priced fused where the rest is"),
    "no-persist-layer-norm": NotPriced("non-persistent layer norm: priced as the fused norm"),
    **_each(
        "fused cross-entropy: priced as the unfused loss",
        "cross-entropy-loss-fusion cross-entropy-fusion-impl",
        (False, "native"),
    ),
    **_each(
        "CUDA graphs: priced with ordinary kernel launches",
        "enable-cuda-graph external-cuda-graph cuda-graph-scope",
    ),
    "cuda-graph-impl": NotPriced("CUDA graphs: priced with ordinary kernel launches", ("none",)),
    "deterministic-mode": NotPriced("deterministic kernels: priced with the default ones"),
    "empty-unused-memory-level": NotPriced("emptying the CUDA cache: not modelled", (0,)),
    # communication
    **_each(
        "parts of TP overlap switched off: priced with all of --tp-comm-overlap",
        "disable-tp-comm-overlap-ag disable-tp-comm-overlap-rs disable-tp-comm-bulk-dgrad "
        "disable-tp-comm-bulk-wgrad disable-tp-comm-split-ag disable-tp-comm-split-rs "
        "no-tp-comm-overlap-ag no-tp-comm-overlap-rs no-tp-comm-bulk-dgrad no-tp-comm-bulk-wgrad "
        "no-tp-comm-split-ag no-tp-comm-split-rs",
    ),
    "tp-comm-overlap-rs-dgrad": NotPriced("TP overlap variant: priced as --tp-comm-overlap"),
    "overlap-param-gather-with-optimizer-step": NotPriced(
        "parameter gather overlapped with the optimizer step: priced as --overlap-param-gather"
    ),
    **_each(
        "DP bucketing and collective tuning: priced by the ZeRO stage's traffic, not its buckets",
        "ddp-bucket-size ddp-num-buckets ddp-average-in-collective "
        "ddp-pad-buckets-for-high-nccl-busbw ddp-reduce-scatter-with-fp32-accumulation "
        "no-align-grad-reduce no-align-param-gather no-gradient-reduce-div-fusion "
        "suggested-communication-unit-size fsdp-double-buffer use-nccl-ub use-sharp "
        "create-all-gather-group",
        (None,),
    ),
    "num-distributed-optimizer-instances": NotPriced(
        "distributed optimizer sharded over part of the DP ranks: priced over all of them", (1,)
    ),
    "outer-dp-sharding-strategy": NotPriced(
        "hybrid (outer/inner) data-parallel sharding: priced over every DP rank", ("no_shard",)
    ),
    "enable-full-sharding-in-hsdp": NotPriced(
        "hybrid (outer/inner) data-parallel sharding: priced over every DP rank"
    ),
    "no-overlap-p2p-communication": NotPriced("PP transfers not overlapped: not modelled"),
    "overlap-p2p-communication-warmup-flush": NotPriced(
        "PP transfers overlapped in warm-up and flush: not modelled"
    ),
    "use-ring-exchange-p2p": NotPriced("ring-exchange PP transfers: not modelled"),
    "pipeline-model-parallel-comm-backend": NotPriced(
        "PP transfers over another backend: priced as NCCL", ("nccl",)
    ),
    "pipeline-model-parallel-layout": NotPriced(
        "explicit pipeline layer layout: priced with the split from the layer counts", ()
    ),
    "microbatch-group-size-per-virtual-pipeline-stage": NotPriced(
        "microbatch group size of the interleaved schedule: priced with Megatron's default", ()
    ),
    "use-tp-pp-dp-mapping": NotPriced("TP-PP-DP rank order: priced with meshplan's placement"),
    "cp-comm-type": NotPriced(
        "context-parallel exchange: p2p (ring) priced as K/V all-gather; a2a+p2p as usp, "
        "its outer p2p ring priced as an all-gather too",
        ("all_gather", "a2a"),
    ),
    # mixture of experts
    "expert-tensor-parallel-size": NotPriced(
        "expert tensor parallelism: priced with experts sharded by expert parallelism only", (1,)
    ),
    "moe-token-dispatcher-type": NotPriced(
        "MoE token dispatch: priced as all-to-all", ("alltoall",)
    ),
    **_each(
        "DeepEP / flex dispatch: priced as NCCL all-to-all",
        "moe-enable-deepep moe-flex-dispatcher-backend moe-deepep-num-sms moe-hybridep-num-sms",
        (False, None),
    ),
    **_each(
        "expert-parallel communication overlapped with compute: priced exposed",
        "overlap-moe-expert-parallel-comm moe-shared-expert-overlap delay-wgrad-compute "
        "ep-overlap-early-attn-memory-release",
    ),
    **_each(
        "router balancing: priced with a balanced router's bound",
        "moe-router-load-balancing-type moe-aux-loss-coeff moe-z-loss-coeff "
        "moe-router-score-function moe-router-pre-softmax moe-router-topk-scaling-factor "
        "moe-router-enable-expert-bias moe-router-bias-update-rate moe-router-group-topk "
        "moe-router-num-groups moe-input-jitter-eps moe-router-dtype",
        (False, None),
    ),
    **_each(
        "expert capacity and token dropping: priced without dropping",
        "moe-expert-capacity-factor moe-pad-expert-input-to-capacity moe-token-drop-policy",
        (False, None),
    ),
    **_each(
        "fused MoE permutation / router kernels: not modelled",
        "moe-permute-fusion moe-router-fusion moe-use-legacy-grouped-gemm",
    ),
    "moe-ffn-hidden-size": NotPriced("expert FFN width: priced at --ffn-hidden-size", ()),
    "moe-shared-expert-intermediate-size": NotPriced(
        "shared experts: priced without them", (None, 0)
    ),
    "moe-layer-freq": NotPriced("dense layers between MoE layers: priced all MoE", (1,)),
    # model shape meshplan's transformer does not have
    **_each(
        "multi-latent attention: priced as standard attention of --num-attention-heads",
        "multi-latent-attention q-lora-rank kv-lora-rank qk-head-dim qk-pos-emb-head-dim "
        "v-head-dim",
        (False, None),
    ),
    "mtp-num-layers": NotPriced("multi-token prediction layers: priced without them", (0,)),
    **_each("QK normalisation: priced without it", "qk-layernorm qk-l2-norm"),
    **_each(
        "activation function: priced as the block style's",
        "openai-gelu squared-relu quick-geglu",
    ),
    **_each("dropout: priced without dropout", "hidden-dropout attention-dropout", (0,)),
    "no-position-embedding": NotPriced("no position embedding: priced as the block style's"),
    **_each(
        "decoder / encoder layer counts: priced at --num-layers",
        "decoder-num-layers encoder-num-layers",
        (),
    ),
    **_each("window attention: priced as full causal attention", "window-size", (None,)),
    # batches and training schedule
    "rampup-batch-size": NotPriced("batch-size ramp-up: priced at the full global batch", ()),
    "optimizer": NotPriced("optimizer: priced as Adam (two fp32 states)", ("adam",)),
    # refused by Megatron-LM core_v0.16.1's validate_args (deprecated names)
    "batch-size": NotPriced("refused by Megatron-LM; use --micro-batch-size", ()),
    "warmup": NotPriced("refused by Megatron-LM; use --lr-warmup-fraction", ()),
    "model-parallel-size": NotPriced(
        "refused by Megatron-LM; use --tensor-model-parallel-size", ()
    ),
    "checkpoint-activations": NotPriced(
        "refused by Megatron-LM; use --recompute-activations or --recompute-granularity"
    ),
}

_MEGATRON_BOOKKEEPING = _names(
    {
        # data: where the tokens come from, how they are split and loaded (the loader runs
        # ahead of the step)
        "data": """
            data-path train-data-path valid-data-path test-data-path data-cache-path split
            mock-data num-workers dataloader-type data-args-path per-split-data-args-path
            num-dataset-builder-threads no-mmap-bin-files dataloader-fast-cache-load
            object-storage-cache-path no-create-attention-mask-in-dataloader eod-mask-loss
            reset-position-ids reset-attention-mask""",
        # tokenizer files; the vocabulary size the model gets is --vocab-size
        "tokenizer": """
            tokenizer-model vocab-file merge-file vocab-extra-ids tiktoken-pattern
            tiktoken-num-special-tokens tiktoken-special-tokens tokenizer-hf-use-fast
            tokenizer-hf-include-special-tokens tokenizer-special-tokens legacy-tokenizer
            make-vocab-size-divisible-by""",
        # (make-vocab-size-divisible-by pads the vocabulary to a multiple of it times TP: a
        # few rows of the embedding at most, below what the cost model resolves)
        # checkpoints: written between steps, not inside them
        "checkpoints": """
            save load save-interval ckpt-format ckpt-fully-parallel-save
            ckpt-fully-parallel-load no-ckpt-fully-parallel-save async-save use-dist-ckpt
            dist-ckpt-format dist-ckpt-strictness no-save-optim no-save-rng no-load-optim
            no-load-rng finetune pretrained-checkpoint use-checkpoint-args
            exit-on-missing-checkpoint ckpt-assume-constant-structure auto-detect-ckpt-format
            ckpt-step non-persistent-save-interval non-persistent-ckpt-type
            non-persistent-global-ckpt-dir non-persistent-local-ckpt-dir
            non-persistent-local-ckpt-algo use-persistent-ckpt-worker
            use-mp-args-from-checkpoint-args save-retain-interval""",
        # logging, profiling and evaluation: outside the steady training step
        "logging": """
            log-interval log-throughput log-timers-to-tensorboard log-memory-to-tensorboard
            log-validation-ppl-to-tensorboard log-world-size-to-tensorboard log-params-norm
            log-num-zeros-in-grad log-progress log-energy log-device-memory-used
            no-log-loss-scale-to-tensorboard disable-log-loss-scale-to-tensorboard
            tensorboard-dir tensorboard-log-interval tensorboard-queue-size timing-log-level
            timing-log-option wandb-project wandb-exp-name wandb-save-dir wandb-entity
            logging-level no-barrier-with-level-1-timing
            log-straggler profile profile-step-start profile-step-end profile-ranks
            use-pytorch-profiler record-memory-history memory-snapshot-path
            eval-interval eval-iters skip-train test-mode full-validation no-one-logger
            one-logger-project one-logger-run-name app-tag-run-name app-tag-run-version""",
        # how long the run lasts and how it is launched: the number of steps, not their time
        "run length and launch": """
            train-iters train-samples exit-interval exit-duration-in-mins exit-signal-handler
            distributed-backend distributed-timeout-minutes local-rank lazy-mpu-init
            adlr-autoresume adlr-autoresume-interval enable-ft-package
            no-check-for-nan-in-loss-and-grad
            check-for-spiky-loss check-for-large-grads rerun-mode""",
        # seeds and initialisation: before the first step
        "seeds and initialisation": """
            seed data-parallel-random-init init-method-std init-method-xavier-uniform
            embedding-init-method-std use-cpu-initialization init-model-with-meta-device""",
        # optimizer and schedule hyperparameters, loss scaling, RoPE and norm constants: the
        # same kernels run whatever their values (clipping runs at Megatron's default too)
        "hyperparameters": """
            lr min-lr lr-decay-style lr-decay-iters lr-decay-samples lr-warmup-iters
            lr-warmup-samples lr-warmup-fraction lr-warmup-init lr-wsd-decay-style
            lr-wsd-decay-iters lr-wsd-decay-samples decoupled-lr decoupled-min-lr
            override-opt_param-scheduler use-checkpoint-opt_param-scheduler
            weight-decay start-weight-decay end-weight-decay weight-decay-incr-style
            adam-beta1 adam-beta2 adam-eps sgd-momentum clip-grad loss-scale
            initial-loss-scale min-loss-scale loss-scale-window hysteresis
            fp8-margin fp8-interval fp8-amax-history-len fp8-amax-compute-algo
            rotary-base rotary-percent rotary-interleaved rotary-seq-len-interpolation-factor
            use-rope-scaling rope-scaling-factor no-rope-freq norm-epsilon apply-layernorm-1p
            apply-query-key-layer-scaling attention-softmax-in-fp32 calculate-per-token-loss""",
        # settings Megatron-LM only reads to configure Transformer Engine's overlap buffers
        "overlap set-up": "tp-comm-overlap-cfg tp-comm-bootstrap-backend",
    }
)

MEGATRON = Options(
    "megatron",
    _MEGATRON_PRICED,
    MappingProxyType(_MEGATRON_NOT_PRICED),
    _MEGATRON_BOOKKEEPING,
    prefix="--",
    sep=" ",
    section="--{}",
)


# -- torchtitan ------------------------------------------------------------------------------------
# The job TOML of torchtitan 0.1.0 to 0.2.2: the JobConfig dataclasses of
# torchtitan/config_manager.py (0.1) and torchtitan/config/job_config.py (0.2), one table
# per section, names as their fields. Names only one of those releases has are kept: a TOML
# of either reads.

# Float8 and MX: the reader reads recipe_name and the FP8 all-gather from [float8] (0.1) or
# [quantize.linear.float8] (0.2); the MX tables configure what `model.converters` switched on,
# which the reader notes.
_FLOAT8 = ("float8", "quantize.linear.float8")

_TITAN_READ = " ".join(
    [
        _in("model", "name flavor converters"),
        _in(
            "training",
            "local_batch_size global_batch_size seq_len enable_cpu_offload dtype "
            "mixed_precision_reduce",
        ),
        _in(
            "parallelism",
            "data_parallel_replicate_degree data_parallel_shard_degree "
            "fsdp_reshard_after_forward tensor_parallel_degree enable_sequence_parallel "
            "pipeline_parallel_degree pipeline_parallel_split_points module_fqns_per_model_part "
            "pipeline_parallel_first_stage_less_layers pipeline_parallel_last_stage_less_layers "
            "pipeline_parallel_layers_per_stage pipeline_parallel_schedule "
            "pipeline_parallel_microbatch_size context_parallel_degree expert_parallel_degree",
        ),
        _in("activation_checkpoint", "mode selective_ac_option memory_budget"),
        _in("compile", "enable enable_async_tensor_parallel"),
        *(
            _in(
                f8,
                "recipe_name enable_fsdp_float8_all_gather "
                "precompute_float8_dynamic_scale_for_fsdp",
            )
            for f8 in _FLOAT8
        ),
        _in("mx", "use_fp8_dim1_cast_triton_kernel recipe_name filter_fqns"),
        _in("quantize.linear.mx", "mxfp8_dim1_cast_kernel_choice recipe_name filter_fqns"),
        # what meshplan prices: compile in [training] and async TP in [parallelism] (both
        # 0.1's places), a balanced MoE router (torchtitan's forced balancing is that)
        "training.compile parallelism.enable_async_tensor_parallel debug.moe_force_load_balance",
    ]
)

_TITAN_NOT_PRICED: dict[str, NotPriced] = {
    "optimizer.name": NotPriced("optimizer: priced as AdamW (two fp32 states)", ("AdamW", "Adam")),
    "optimizer.implementation": NotPriced(
        "for-loop optimizer step: priced as the fused AdamW", ("fused", "foreach")
    ),
    "optimizer.early_step_in_backward": NotPriced(
        "optimizer step inside backward: priced after backward"
    ),
    "training.mixed_precision_param": NotPriced(
        "fp32 parameters in FSDP's compute: priced in bf16", ("bfloat16",)
    ),
    "training.gc_debug": NotPriced("garbage collection every step: not modelled"),
    "parallelism.disable_loss_parallel": NotPriced(
        "loss parallelism off: priced with vocabulary-sharded logits"
    ),
    "parallelism.enable_compiled_autograd": NotPriced("compiled autograd: not modelled"),
    "parallelism.pipeline_parallel_schedule_csv": NotPriced(
        "pipeline schedule from a CSV file: priced as pipeline_parallel_schedule", ("",)
    ),
    "parallelism.pipeline_parallel_expert_parallel_overlap": NotPriced(
        "expert all-to-all overlapped across pipeline micro-batches: priced exposed"
    ),
    "parallelism.context_parallel_rotate_method": NotPriced(
        "context-parallel KV exchange: priced as KV all-gather", ("allgather",)
    ),
    "parallelism.context_parallel_load_balancer": NotPriced(
        "context-parallel load balancing: priced balanced", ("headtail", "ptrr")
    ),
    "parallelism.expert_tensor_parallel_degree": NotPriced(
        "expert tensor parallelism: priced with experts sharded by expert parallelism only", (1,)
    ),
    "parallelism.expert_parallel_comm_backend": NotPriced(
        "DeepEP dispatch: priced as NCCL all-to-all", ("standard",)
    ),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": NotPriced(
        "matmuls forced into recomputation: priced with the mode's policy", ()
    ),
    "activation_checkpoint.early_stop": NotPriced(
        "early-stopped recomputation: priced with the whole layer recomputed"
    ),
    "compile.components": NotPriced(
        "compiled components: priced with the transformer blocks compiled",
        (("model", "loss"), ("loss", "model"), ("model",)),
    ),
    "compile.backend": NotPriced("torch.compile backend: priced as inductor's", ("inductor",)),
    **_each(
        "deterministic kernels: priced with the default ones",
        "training.deterministic debug.deterministic",
    ),
    "fault_tolerance.enable": NotPriced("torchft replica groups: not modelled"),
    "fault_tolerance.semi_sync_method": NotPriced(
        "semi-synchronous training (local SGD, DiLoCo): priced with a gradient sync every step",
        ("",),
    ),
    **_each(
        "linears kept in bf16: priced with every block linear in FP8",
        " ".join(f"{f8}.filter_fqns" for f8 in _FLOAT8),
        (("output",),),
    ),
    **_each("emulated FP8: priced as FP8 kernels", " ".join(f"{f8}.emulate" for f8 in _FLOAT8)),
    "float8.force_recompute_fp8_weight_in_bwd": NotPriced(
        "FP8 weights recomputed in backward: not modelled"
    ),
    "float8.moe_fqns_prototype": NotPriced("FP8 / MX expert GEMMs: priced in bf16", ()),
    **_each(
        "FP8 / MX expert GEMMs: priced in bf16",
        _in("quantize.grouped_mm.float8", "fqns")
        + " "
        + _in("quantize.grouped_mm.mx", "recipe_name fqns"),
        (),
    ),
}

_TITAN_BOOKKEEPING = _names(
    {
        # the job's name, output folder and config handling
        "job": _in(
            "job",
            "config_file dump_folder description use_for_integration_test print_args "
            "print_config save_config_file custom_config_module",
        )
        + " "
        + _in("experimental", "custom_import custom_args_module"),
        # profiling, metrics and validation: outside the steady training step
        "observing": _in(
            "profiling",
            "enable_profiling save_traces_folder profile_freq profiler_active profiler_warmup "
            "enable_memory_snapshot save_memory_snapshot_folder",
        )
        + " "
        + _in(
            "metrics",
            "log_freq enable_tensorboard disable_color_printing save_tb_folder "
            "save_for_all_ranks enable_wandb",
        )
        + " "
        + _in(
            "validation",
            "enable enabled dataset dataset_path local_batch_size seq_len freq steps dataloader",
        )
        + " "
        + _in("memory_estimation", "enable enabled disable_fake_mode")
        + " "
        + _in(
            "comm",
            "init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder "
            "save_traces_file_prefix mode",
        ),
        # tokenizer and data: files and the loader, which runs ahead of the step
        "data": _in("model", "hf_assets_path tokenizer_path print_after_conversion")
        + " "
        + _in("training", "dataset dataset_path")
        + " "
        + _in("training.dataloader", "num_workers persistent_workers pin_memory prefetch_factor"),
        # checkpoints: written between steps
        "checkpoints": _in(
            "checkpoint",
            "enable enable_checkpoint enable_ft_dataloader_checkpoints folder interval "
            "initial_load_path initial_load_model_only initial_load_model_weights_only "
            "initial_load_in_hf initial_load_in_hf_quantized last_save_model_only "
            "last_save_model_weights_only last_save_in_hf export_dtype async_mode keep_latest_k "
            "load_step exclude_from_loading enable_first_step_checkpoint create_seed_checkpoint "
            "load_only",
        ),
        # run length, seeds, hyperparameters (clipping runs at torchtitan's default too), and
        # how often Python collects garbage: the same kernels run whatever their values
        "run and hyperparameters": _in("training", "steps max_norm gc_freq seed")
        + " "
        + _in("debug", "seed deterministic_warn_only")
        + " "
        + _in("optimizer", "lr beta1 beta2 eps weight_decay")
        + " "
        + _in(
            "lr_scheduler", "warmup_steps total_steps decay_ratio decay_type min_lr_factor lr_min"
        )
        + " "
        + _in(
            "activation_checkpoint",
            "visualize_memory_budget_pareto preserve_rng_state determinism_check debug",
        )
        + " "
        + _in(
            "fault_tolerance",
            "process_group process_group_timeout_ms replica_id group_size min_replica_size "
            "sync_steps should_quantize fragment_sync_delay fragment_update_alpha",
        ),
    }
)
TORCHTITAN_TOML = Options(
    "torchtitan",
    frozenset(_TITAN_READ.split()),
    MappingProxyType(_TITAN_NOT_PRICED),
    _TITAN_BOOKKEEPING,
    section="[{}]",
)

# torchtitan 0.3's command line: `--section.field` overrides of Trainer.Config
# (torchtitan/trainer.py; TrainingConfig, ParallelismConfig, CompileConfig, CommConfig,
# DebugConfig in torchtitan/config/configs.py). The components' own sections (profiler,
# metrics, tokenizer, dataloader, optimizer, lr_scheduler, checkpoint, validator, loss,
# override) are each component's Config class; they are bookkeeping as whole tables, and
# torchtitan's tyro parser refuses a misspelt field in them itself.
_CLI_READ = (
    "module config "
    + _in(
        "training",
        "local_batch_size global_batch_size seq_len enable_cpu_offload dtype "
        "mixed_precision_reduce",
    )
    + " "
    + " ".join(n for n in TORCHTITAN_TOML.priced if n.startswith("parallelism."))
    + " "
    + _in("activation_checkpoint", "mode memory_budget")
    + " "
    + _in("compile", "enable enable_async_tensor_parallel")
    + " debug.moe_force_load_balance"
)
_CLI_NOT_PRICED: dict[str, NotPriced] = {
    name: _TITAN_NOT_PRICED[name]
    for name in (
        "training.mixed_precision_param training.gc_debug "
        "parallelism.pipeline_parallel_schedule_csv parallelism.context_parallel_load_balancer "
        "compile.components compile.backend debug.deterministic optimizer.implementation"
    ).split()
} | {
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": NotPriced(
        "matmuls forced into recomputation: priced with the mode's policy", ()
    ),
    "training.disable_cuda_graphs": NotPriced(
        "CUDA graphs: priced with ordinary kernel launches", (True,)
    ),
    "parallelism.enable_fsdp_symm_mem": NotPriced(
        "symmetric-memory FSDP collectives: priced as NCCL's"
    ),
    "debug.detect_anomaly": NotPriced("autograd anomaly detection: not modelled"),
    "debug.batch_invariant": NotPriced("batch-invariant kernels: priced with the default ones"),
    "loss.num_chunks": NotPriced("chunked loss: priced unchunked", (1,)),
}
_CLI_BOOKKEEPING = _names(
    {
        # output folders and the components' own tables (see above)
        "components": "hf_assets_path dump_folder profiler metrics tokenizer dataloader "
        "optimizer lr_scheduler checkpoint validator loss override",
        # run length, seeds, hyperparameters, logging, timeouts: as in the TOML
        "run": _in("training", "steps max_norm gc_freq")
        + " "
        + _in(
            "debug",
            "seed deterministic_warn_only spmd_typechecking print_config save_config_file "
            "enable_structured_logging",
        )
        + " "
        + _in(
            "comm",
            "init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder "
            "save_traces_file_prefix mode",
        )
        + " "
        + _in(
            "activation_checkpoint",
            "preserve_rng_state determinism_check debug visualize_memory_budget_pareto",
        )
        # how the sharding is written in code (DTensor or spmd_types): the same collectives run
        + " "
        + _in("parallelism", "spmd_backend context_parallel_ptrr_mask_key"),
    }
)

TORCHTITAN_CLI = Options(
    "torchtitan",
    frozenset(_CLI_READ.split()),
    MappingProxyType(_CLI_NOT_PRICED),
    _CLI_BOOKKEEPING,
    prefix="--",
    sep=" ",
    section="--{}.*",
)


# -- DeepSpeed -------------------------------------------------------------------------------------
# The keys of a DeepSpeed config: the DeepSpeed docs' "DeepSpeed Configuration JSON" page
# (docs/_pages/config-json.md) and what deepspeed 0.19 reads (runtime/config.py
# `DeepSpeedConfig._initialize_params`; the pydantic models of runtime/zero/config.py,
# runtime/zero/offload_config.py, runtime/precision_config.py,
# runtime/tensor_parallel/config.py; `deepspeed.initialize` reads sequence_parallel_size
# and data_parallel_size). DeepSpeed ignores an unknown top-level key without a word.

_DS_READ = (
    "train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps "
    "sequence_parallel_size activation_checkpointing compression_training optimizer.type "
    "fp16.enabled bf16.enabled bfloat16.enabled tensor_parallel.autotp_size pipeline.stages "
    + _in(
        "zero_optimization",
        "stage overlap_comm offload_optimizer offload_param zero_quantized_weights "
        "zero_quantized_gradients zero_hpz_partition_size",
    )
)

_DS_NOT_PRICED: dict[str, NotPriced] = {
    **_each(
        "ZeRO bucket, prefetch and persistence sizes: priced by the ZeRO stage's traffic, "
        "not its buckets",
        _in(
            "zero_optimization",
            "reduce_bucket_size allgather_bucket_size prefetch_bucket_size "
            "stage3_prefetch_bucket_size param_persistence_threshold "
            "stage3_param_persistence_threshold model_persistence_threshold "
            "stage3_model_persistence_threshold max_live_parameters stage3_max_live_parameters "
            "max_reuse_distance stage3_max_reuse_distance sub_group_size "
            "module_granularity_threshold stage3_module_granularity_threshold "
            "use_multi_rank_bucket_allreduce",
        ),
        (),
    ),
    **_each(
        "ZeRO collectives replaced: priced as reduce-scatter and all-gather",
        _in(
            "zero_optimization",
            "reduce_scatter allgather_partitions use_all_reduce_for_fetch_params "
            "stage3_use_all_reduce_for_fetch_params allgather_sequential "
            "stage3_allgather_sequential",
        ),
        (True,),
    ),
    "zero_optimization.contiguous_gradients": NotPriced(
        "non-contiguous gradient buffers: not modelled", (True,)
    ),
    **_each(
        "ZeRO optimizer offload (cpu_offload): priced with the states on the GPU",
        _in("zero_optimization", "cpu_offload cpu_offload_param round_robin_gradients zenflow"),
    ),
    # MiCS (mics_shard_size, mics_hierarchical_params_gather) and LoCo-ZeRO++
    # (zeropp_loco_param) were removed in deepspeed 0.19, which refuses those keys: the reader
    # refuses them too (`configs.DEEPSPEED_REMOVED`).
    **_each(
        "ZeRO++ quantization: priced without it",
        _in("zero_optimization", "zero_quantized_nontrainable_weights"),
    ),
    "zero_optimization.memory_efficient_linear": NotPriced(
        "ZeRO-3 linear without memory-efficient autograd: not modelled", (True,)
    ),
    "zero_optimization.leaf_module": NotPriced(
        "ZeRO-3 leaf modules (fetched whole): priced per layer", ()
    ),
    "zero_optimization.legacy_stage1": NotPriced("legacy ZeRO-1: priced as ZeRO-1"),
    "zero_optimization.enable_sanity_checks": NotPriced("ZeRO sanity checks: not modelled"),
    # precision
    "fp16.auto_cast": NotPriced("fp16 autocast: priced as bf16 mixed precision"),
    "fp16.fp16_master_weights_and_grads": NotPriced(
        "fp16 master weights and gradients: priced with fp32 ones"
    ),
    **_each(
        "bf16 master weights / optimizer states: priced with fp32 ones",
        _in("bf16", "bf16_master_weights_and_grads bf16_optimizer_states")
        + " "
        + _in("bfloat16", "bf16_master_weights_and_grads bf16_optimizer_states"),
    ),
    **_each(
        "bf16 gradient update details: not modelled",
        _in("bf16", "immediate_grad_update") + " " + _in("bfloat16", "immediate_grad_update"),
    ),
    **_each(
        "bf16 overflow check skipped: not modelled",
        _in("bf16", "check_grad_overflow") + " " + _in("bfloat16", "check_grad_overflow"),
        (True,),
    ),
    "amp": NotPriced("apex AMP: priced as bf16 mixed precision", ()),
    "torch_autocast": NotPriced(
        "torch.autocast with fp32 weights: priced as bf16 mixed precision", ()
    ),
    "data_types": NotPriced(
        "gradient accumulation / parameter dtypes: priced as bf16 gradients, fp32 states", ()
    ),
    "communication_data_type": NotPriced(
        "gradient communication dtype: priced as bf16 gradients", ("bf16", "bfloat16")
    ),
    "seq_parallel_communication_data_type": NotPriced(
        "sequence-parallel communication dtype: priced in bf16", ("bf16", "bfloat16")
    ),
    # parallelism meshplan reads elsewhere or not at all
    "data_parallel_size": NotPriced(
        "data-parallel size: taken from the GPUs left after TP, PP and sequence parallelism", ()
    ),
    "tensor_parallel.tp_overlap_comm": NotPriced(
        "AutoTP all-reduce overlapped with compute: priced exposed"
    ),
    **_each(
        "AutoTP layer specs: priced as column/row splits of the traced model",
        _in("tensor_parallel", "partition_config preset_model injection_policy_tuple"),
        (),
    ),
    "pipeline.partition": NotPriced(
        "DeepSpeed's pipeline partition method: priced with an even split", ("uniform",)
    ),
    "pipeline.activation_checkpoint_interval": NotPriced(
        "pipeline activation checkpointing: priced by the activation_checkpointing section", (0,)
    ),
    **_each(
        "activations across stages not partitioned over TP: not modelled",
        _in("pipeline", "pipe_partitioned grad_partitioned"),
        (True,),
    ),
    "expert_parallel": NotPriced("AutoEP expert parallelism: priced without experts split", ()),
    "use_data_before_expert_parallelism": NotPriced("expert/data rank order: not modelled"),
    # training changes outside the model's step
    "sparse_attention": NotPriced("sparse attention: priced dense", ()),
    "progressive_layer_drop": NotPriced("progressive layer drop: priced with every layer", ()),
    **_each(
        "curriculum / data efficiency (shorter sequences, dropped tokens): priced at full length",
        "curriculum_learning data_efficiency",
        (),
    ),
    "eigenvalue": NotPriced("eigenvalue computation: not modelled", ()),
    "hybrid_engine": NotPriced("RLHF hybrid engine: not modelled", ()),
    **_each("quantized weights: priced in bf16", "weight_quantization quantize_training", ()),
    "compile": NotPriced("DeepCompile: not modelled", ()),
    "graph_harvesting": NotPriced("CUDA-graph harvesting: priced with ordinary launches"),
    "sparse_gradients": NotPriced("sparse embedding gradients: priced dense"),
    "disable_allgather": NotPriced("ZeRO-1/2 weight broadcast instead of all-gather: not modelled"),
    "managed_gradient_accumulation": NotPriced("managed gradient accumulation: not modelled"),
    "memory_breakdown": NotPriced("per-step memory report (synchronises): not modelled"),
}

_DS_BOOKKEEPING = _names(
    {
        # logging and monitoring: outside the steady training step
        "logging": "steps_per_print wall_clock_breakdown dump_state log_level tensorboard wandb "
        "comet csv_monitor comms_logger flops_profiler timers",
        # checkpoints, their storage back-ends and restart elasticity: between steps
        "checkpoints": "checkpoint nebula datastates_ckpt elasticity "
        + _in(
            "zero_optimization",
            "load_from_fp32_weights elastic_checkpoint gather_16bit_weights_on_model_save "
            "stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save "
            "pipeline_loading_checkpoint save_muon_momentum_buffer_in_memory "
            "log_trace_cache_warnings ignore_unused_parameters override_module_apply",
        ),
        # the NVMe offload's I/O settings: the offload itself is listed (offload_param,
        # offload_optimizer)
        "offload tuning": "aio " + _in("zero_optimization", "cpu_offload_use_pin_memory"),
        # optimizer and scheduler hyperparameters, clipping, loss-scaling constants: the same
        # kernels run whatever their values
        "hyperparameters": "optimizer.params scheduler gradient_clipping prescale_gradients "
        "gradient_predivide_factor vocabulary_size "
        + _in(
            "fp16",
            "loss_scale initial_scale_power loss_scale_window hysteresis consecutive_hysteresis "
            "min_loss_scale",
        ),
        # checks at start-up, the autotuner (a separate launcher), the data loader, inference
        # settings and AutoTP's initialisation
        "start-up": "zero_allow_untested_optimizer zero_force_ds_cpu_optimizer autotuning "
        "dataloader_drop_last optimizer.legacy_fusion "
        + _in(
            "tensor_parallel",
            "dtype keep_module_on_host tp tensor_parallel replace_with_kernel_inject kernel_inject",
        )
        + " "
        + _in("pipeline", "seed_layers use_reentrant"),
    }
)

DEEPSPEED = Options(
    "deepspeed",
    frozenset(_DS_READ.split()),
    MappingProxyType(_DS_NOT_PRICED),
    _DS_BOOKKEEPING,
    sep=": ",
)

OPTIONS = {
    "megatron": MEGATRON,
    "torchtitan": TORCHTITAN_TOML,
    "torchtitan-cli": TORCHTITAN_CLI,
    "deepspeed": DEEPSPEED,
}
