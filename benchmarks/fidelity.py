"""Fidelity of `meshplan.estimate` against published training runs (docs/fidelity.md).

For every row of the table of published runs (a CSV, one run per row: source, model shape,
GPU type and count, parallel configuration, batch, recompute, measured metric; `--csv`,
default `DEFAULT_CSV`) this script builds the row's model with the zoo, a cluster matching
the row's hardware and the row's parallel configuration, runs `meshplan.estimate`, converts
the row's measured metric to a step time with the row's own FLOP convention, and prints
predicted vs measured step time (and peak memory where the row gives it), then the median and
p90 absolute errors.

    python benchmarks/fidelity.py                 # table + summary
    python benchmarks/fidelity.py --json out.json # also write every row as JSON
    python benchmarks/fidelity.py --cache /tmp/mp # keep traced graphs between runs
    python benchmarks/fidelity.py --quick         # shipped constants only (no refits)

How each source's rows are read (see also docs/fidelity.md):

- **Korthikanti et al. 2022, Table 5** (Selene, A100-80GB, 8 GPUs/node, 8 x HDR IB):
  `iteration_time_s` is the step. GPT style, vocab 51200 (the Megatron GPT-2 BPE padded to
  51200, as calculon's validation configs use), tied embeddings, bf16, ZeRO-0 (dp=1).
  "full" -> full recompute, no sequence parallel; "selective+sequence_parallel" ->
  selective recompute + SP. "virtual pipeline stages=3" -> interleaved 1F1B with v=3.
- **Megatron-LM README (2020)** (DGX-2 V100: 16 GPUs/node on NVSwitch; DGX A100):
  `iteration_time_ms` is the step. vocab 51200, fp16, tied embeddings. The micro-batch is the
  whole per-replica batch (2020 Megatron had no pipeline), and recompute is *full*: the
  README's TFLOP/s per GPU equal 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) / t, the
  with-recomputation formula of Narayanan et al. (SC'21, eq. 3); the script checks that.
- **Megatron-Core r0.8.0 README table** (H100 SXM, DGX H100: 8 x NDR 400 Gb/s per node):
  `model_tflops_per_gpu` -> step = F / (value * gpus) with Megatron's model FLOPs
  F = 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (Narayanan et al., eq. 3 without recompute;
  Megatron's `num_floating_point_operations` for ffn = 4h, no GQA), V = 131072. Not stated
  by the row, assumed: micro-batch 1, no recompute, distributed optimizer (ZeRO-1), sequence
  parallel with TP, plain 1F1B (no virtual stages: Megatron's default). Untied embeddings
  (the table's parameter counts; `interpret`). Checked against Megatron-LM core_r0.8.0
  (baf94af3c6): the README's flags (`--overlap-grad-reduce --overlap-param-gather
  --tp-comm-overlap`, vocab 131072, sequence 4096, end-to-end timing), the FLOP formula
  (`training.py` `num_floating_point_operations`), fp32 gradient reduce-scatter and bf16
  parameter all-gather (`arguments.py` forces `accumulate_allreduce_grads_in_fp32` under
  --bf16; no bf16 reduction flag before 2025). The rows' notes
  name `--tp-comm-overlap` -> the `tp_overlap` engine where tp > 1.
- **torchtitan** (Grand Teton H100 96GB HBM2e @500W, 8/node, 400 Gb/s RDMA per GPU; A100
  rows: DGX A100): `tokens_per_sec_per_gpu` -> step = global_batch * seq / (tps * gpus).
  Llama 3.1 presets. FSDP -> ZeRO-3; 2D -> TP (with sequence parallel) x FSDP. The micro-batch
  column is torchtitan's local batch (no gradient accumulation). torchtitan "selective" and
  "selective (op)" (its default op-level SAC: saves every other matmul of a layer) are priced
  with the `torchtitan_op` policy, "selective (layer)" (every second layer checkpointed) with
  `every_other_layer` (`meshplan.cost_model.recompute`). `peak_mem_GiB` is torch's max
  *reserved* memory, which excludes the CUDA context: it is compared with the predicted peak
  minus `CONTEXT_BYTES`.

- **llm-foundry** (MosaicML platform, A100 80GB and 40GB SXM, 8/node on NVLink3, "1600 Gbps
  node-node interconnect (RoCE)" = 8 x 200 Gb/s per node): `tokens_per_sec_per_gpu` -> step =
  global_batch * seq / (tps * gpus). Composer with FSDP FULL_SHARD -> ZeRO-3 (one all-gather
  in forward, one in backward and a reduce-scatter per micro-batch); the micro-batch column is
  `device_train_microbatch_size` (grad_accum = global_batch / (gpus * micro_batch), exact on
  every row); recompute "full" = FSDP activation checkpointing of every block; bf16 with
  MPT's `attn_impl: triton` (the benchmark script's default when the A100 tables were run):
  flash-attn's Triton FlashAttention, "slightly slower" than FlashAttention 1.x by its own
  docstring, priced at FlashAttention 1.x's published throughput (the `flash1` attention
  engine, `cost_model.compute.ATTENTION_TFLOPS`), and flash-attn's fused cross entropy (the
  `fused_loss` engine); eager kernels (no torch.compile, no fused norms); amp_bf16 rows
  reduce-scatter gradients in fp32 (Composer's FSDP mixed precision DEFAULT, the
  `reduce_fp32` engine), bf16 rows in bf16 (PURE). The model is
  MPT as the benchmark yamls build it: `MPTConfig` defaults, so learned positions (no ALiBi)
  and biases, LayerNorm, GELU MLP of 4h, tied embeddings, vocab 50368 = the zoo's GPT style:
  its parameter count equals the README's `NumParams` to the parameter on every size and
  sequence length (the count grows with the sequence by (s - 2048) * h: the position table),
  and the script excludes a row where it differs by more than 0.5%. Gradient clipping is
  priced with the optimizer step (`pricer.GRAD_CLIP_BYTES_PER_PARAM`); Composer's speed
  monitor and other callbacks are not.

Excluded (listed with the reason in the output): rows without a parallel configuration,
Float8 rowwise rows (not modelled) and interleaved PP with unstated split points.

Validation (docs/fidelity.md): besides the error with the shipped constants
(`cost_model/compute.KERNEL_EFFICIENCY`), every counted row is predicted

- **refit**: with the kernel efficiencies `--fit` fits, refitted on all counted rows (in
  sample: the most flattering number);
- **LOSO** (leave one source out): with those efficiencies refitted on the rows of every other
  source (`source_of`: the publisher and its stack), so nothing the fit saw came from the
  row's own source; a GPU type whose only rows are held out falls back as an uncalibrated one
  would (`efficiency_table`);
- **constant-MFU baseline**: step = 6 N tokens / (gpus x MFU x peak) with N the source's
  parameter count and the dense bf16 (fp16) peak, at MFU = 0.5 and with the MFU fitted leave
  one source out (the median achieved MFU of the other sources' rows, zero median signed
  error, the fit's own criterion);

and the median and p90 absolute error, the signed median (bias) and the count are reported
per source, per GPU type and overall, with the targets (`TARGET_MEDIAN`, `TARGET_P90`,
`TARGET_BASELINE_RATIO`) checked on the LOSO column.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import hashlib
import json
import math
import os
import pickle
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "reference" / "published_runs_calibration.csv"
GiB = 2**30


# ---------------------------------------------------------------------------------------------
# Row interpretation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """A zoo transformer: `meshplan.models.transformer` arguments or a preset name."""

    preset: str | None = None
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    ffn: int = 0
    vocab: int = 0
    style: str = "gpt"
    attention: str = "flash"  # "flash" (fused SDPA) or "math" (materialised scores)
    tied: bool = True  # input embedding and output head share one weight

    def key(self, seq_len: int) -> str:
        if self.preset:
            return f"{self.preset}-s{seq_len}-{self.attention}"
        return (
            f"{self.style}-l{self.layers}-h{self.hidden}-a{self.heads}-f{self.ffn}"
            f"-v{self.vocab}-s{seq_len}-{self.attention}" + ("" if self.tied else "-untied")
        )


@dataclass
class Case:
    """One CSV row, interpreted."""

    row: int  # 1-based data row of the CSV
    source: str
    model: str
    metric: str
    value: float
    gpus: int
    gpu_type: str
    params: float = math.nan  # the source's parameter count (csv params_b), for the baseline
    arch: Arch | None = None
    seq_len: int = 0
    cluster: str = ""  # key of CLUSTERS
    parallel: dict = field(default_factory=dict)
    dtype: str = "bfloat16"
    selective_policy: str = "keep_linear"  # meshplan.cost_model.recompute.SelectivePolicy
    engine: dict = field(default_factory=dict)  # meshplan.cost_model.engine.Engine fields
    measured_step_s: float = math.nan
    conversion: str = ""
    measured_mem_gib: float | None = None
    status: str = "counted"  # counted | side (torch.compile) | excluded
    reason: str = ""
    # filled by the run
    predicted_step_s: float = math.nan
    predicted_mem_gib: float | None = None
    predicted_fits: bool | None = None  # the predicted peak fits the GPU's memory
    breakdown: dict = field(default_factory=dict)
    # filled by `validate`: the step time under each validation method (module docstring)
    refit_step_s: float = math.nan
    loso_step_s: float = math.nan
    mfu_step_s: float = math.nan  # 6N tokens / (gpus x 0.5 x peak)
    mfu_loso_step_s: float = math.nan  # the same at the MFU fitted without the row's source

    @property
    def step_error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1

    def error_of(self, attr: str) -> float:
        """Signed relative error of the step time in `attr` (a `METHODS` attribute)."""
        return getattr(self, attr) / self.measured_step_s - 1

    @property
    def mem_error(self) -> float | None:
        if self.measured_mem_gib is None or self.predicted_mem_gib is None:
            return None
        return self.predicted_mem_gib / self.measured_mem_gib - 1


def _selective(policy: str) -> dict:
    """The engine field for a row's selective-recomputation policy: none for meshplan's own
    keep-every-linear (the eager engine), else `Engine.selective`."""
    return {} if policy == "keep_linear" else {"selective": policy}


def _int(x: str) -> int | None:
    x = (x or "").strip()
    return int(float(x)) if x else None


def megatron_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron-LM model FLOPs per step (Narayanan et al. SC'21 eq. 3 without recompute):
    72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))


def megatron_hw_flops_with_recompute(
    batch: int, seq: int, layers: int, hidden: int, vocab: int
) -> float:
    """The same with full recomputation (eq. 3 as printed): 96 B s l h^2 (1 + s/(6h) + V/(16lh))."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


# llm-foundry's MPT: the GPT-NeoX tokenizer padded to a multiple of 64 (the yamls' vocab_size).
MPT_VOCAB = 50368


def mpt_params(layers: int, hidden: int, heads: int, seq: int) -> int:
    """Parameters of llm-foundry's benchmark MPT as the zoo builds it (GPT style, tied
    embeddings, learned positions of the run's max_seq_len, biases, ffn 4h)."""
    from meshplan.models.transformer import TransformerConfig

    cfg = TransformerConfig(
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=MPT_VOCAB,
        ffn=4 * hidden,
        seq_len=seq,
        style="gpt",
        tie_embeddings=True,
    )
    return cfg.num_params()


def _notes_float(notes: str, key: str) -> float | None:
    m = re.search(re.escape(key) + r"\s*=\s*([0-9.]+)", notes)
    return float(m.group(1)) if m else None


def interpret(i: int, r: dict[str, str]) -> Case:
    """Turn one CSV row into a Case (or an excluded one, with the reason)."""
    src, notes = r["source"], r["notes"]
    gpus = _int(r["gpus"]) or 0
    case = Case(
        row=i,
        source=src,
        model=r["model"],
        metric=r["measured_metric"],
        value=float(r["measured_value"]),
        gpus=gpus,
        gpu_type=r["gpu_type"],
        params=float(r["params_b"]) * 1e9 if r["params_b"].strip() else math.nan,
    )
    tp, pp, dp, cp = (_int(r[k]) for k in ("tp", "pp", "dp", "cp"))
    if tp is None or pp is None or dp is None:
        case.status, case.reason = "excluded", "parallel configuration not stated by the source"
        return case
    low = notes.lower().replace("float8 mfu not comparable", "")
    if "rowwise" in low:
        case.status, case.reason = "excluded", "Float8 rowwise scaling (its kernels not modelled)"
        return case
    engine: dict = {}
    if "float8" in low:  # torchao's tensorwise recipe, the default of these runs
        engine["float8"] = "tensorwise"
        engine["float8_all_gather"] = "float8 all-gather" in low
    if "asynctp" in low or "async tp" in low or ("tp-comm-overlap" in low and (tp or 1) > 1):
        engine["tp_overlap"] = True
    eager_stack = src.startswith(("pytorch/torchtitan", "mosaicml/llm-foundry"))
    if "torch.compile" in low or not eager_stack:
        engine["fused"] = True  # torch.compile, or Megatron-LM's fused kernels
    case.engine = engine
    seq = _int(r["seq_len"]) or 0
    layers, hidden, heads = _int(r["layers"]), _int(r["hidden"]), _int(r["heads"])
    gb = _int(r["global_batch"])
    mb = _int(r["micro_batch"])
    rc_raw = r["recompute"].strip().lower()
    case.seq_len = seq
    case.measured_mem_gib = _notes_float(notes, "peak_mem_GiB")
    cp = cp or 1
    par: dict = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": 1, "global_batch": gb}

    if src.startswith("Korthikanti") and r["measured_metric"] == "iteration_time_s":
        case.arch = Arch(None, layers, hidden, heads, 4 * hidden, 51200, "gpt", "math")
        case.cluster = "dgx-a100"
        full = rc_raw.startswith("full")
        par |= {
            "micro_batch": mb,
            "recompute": "full" if full else "selective",
            "sequence_parallel": not full,
            "zero": 0,
        }
        v = _notes_float(notes, "virtual pipeline stages")
        if v and v > 1:
            par |= {"schedule": "interleaved_1f1b", "virtual_stages": int(v)}
        case.measured_step_s = case.value
        case.conversion = "iteration time"
    elif "Megatron-LM README (2020" in src:
        vocab = 51200
        case.arch = Arch(None, layers, hidden, heads, 4 * hidden, vocab, "gpt", "math")
        case.cluster = "dgx2-v100" if "V100" in r["gpu_type"] else "dgx-a100"
        case.dtype = "float16"
        par |= {"micro_batch": gb // dp, "recompute": "full", "zero": 0}
        case.measured_step_s = case.value / 1000
        tflops = _notes_float(notes, "TFLOP/s per GPU")
        hw = megatron_hw_flops_with_recompute(gb, seq, layers, hidden, vocab)
        implied = hw / (case.measured_step_s * gpus) / 1e12
        case.conversion = (
            f"iteration time; stated {tflops} TFLOP/s/GPU vs {implied:.1f} from the "
            "recompute formula"
        )
    elif src.startswith("NVIDIA/Megatron-LM README 'Performance Benchmarking'"):
        vocab = 131072
        # Untied: the table's sizes are 12lh^2 + 13lh + 2Vh + sh (1.75, 7.13, 16.1, 31.5, 69.8,
        # 118.5, 177.2, 313.6, 461.5 B); with one shared V x h weight they would not round to
        # them (1.49 for "1.7B", 459.1 for "462B"), and the README calls 177B "slightly more
        # than 175 billion ... due to larger vocabulary".
        case.arch = Arch(None, layers, hidden, heads, 4 * hidden, vocab, "gpt", tied=False)
        case.cluster = "dgx-h100"
        par |= {"micro_batch": 1, "recompute": "none", "zero": 1}
        # bf16 Megatron-LM accumulates and reduces gradients in fp32 (arguments.py sets
        # `accumulate_allreduce_grads_in_fp32` under --bf16).
        case.engine = engine | {"reduce_fp32": True}
        flops = megatron_model_flops(gb, seq, layers, hidden, vocab)
        case.measured_step_s = flops / (case.value * 1e12 * gpus)
        case.conversion = "72Bslh^2(1+s/6h+V/12lh) / (TFLOP/s * gpus)"
    elif src.startswith("pytorch/torchtitan"):
        size = r["model"].split()[-1].lower()  # 8B / 70B / 405B
        case.arch = Arch(f"llama3-{size}")
        gt = r["gpu_type"]
        case.cluster = "dgx-a100" if "A100" in gt else "h200" if "H200" in gt else "grand-teton"
        rc = "full" if rc_raw.startswith("full") else "selective"
        # torchtitan's selective AC: "op" (its default) saves every other mm; "layer"
        # checkpoints every second layer (meshplan.cost_model.recompute).
        if rc == "selective":
            case.selective_policy = "every_other_layer" if "layer" in rc_raw else "torchtitan_op"
        par |= {"micro_batch": mb or gb // dp, "recompute": rc, "zero": 3}
        if pp > 1 and not mb:
            # torchtitan (2024) splits the local batch into as many micro-batches as there are
            # pipeline stages unless told otherwise (`pipeline_parallel_microbatches`: "the
            # default value will be the number of pipeline stages").
            par["micro_batch"] = max(1, gb // dp // pp)
            # ... and FSDP under PP does not reshard after forward (torchtitan's default
            # `reshard_after_forward` policy with PP): weights stay gathered and gradients
            # accumulate unsharded across the micro-batches, reduce-scattered once a step:
            # ZeRO-1's memory with one all-gather and one reduce-scatter per step.
            par["zero"] = 1
            if "interleaved" in low:
                case.status = "excluded"
                case.reason = "interleaved 1F1B with unstated split points (126 layers / pp 8)"
                return case
        # FSDP2 reduces gradients in fp32 (`training.mixed_precision_reduce`'s default).
        case.engine = engine | {"reduce_fp32": True}
        case.measured_step_s = gb * seq / (case.value * gpus)
        case.conversion = "global_batch * seq / (tokens/s/GPU * gpus)"
    elif src.startswith("mosaicml/llm-foundry"):
        assert layers and hidden and heads and gb and mb
        case.arch = Arch(None, layers, hidden, heads, 4 * hidden, MPT_VOCAB, "gpt")
        case.cluster = "mosaic-a100-40" if "40GB" in r["gpu_type"] else "mosaic-a100-80"
        full = rc_raw.startswith("full")
        par |= {"micro_batch": mb, "recompute": "full" if full else "none", "zero": 3}
        # The A100 tables were run with `scripts/train/benchmarking/submit_benchmarks.py`,
        # whose `--attn_impl` default was "triton" until 2024-03 (the 40GB table: llm-foundry
        # commit ef350d9e6, 2023-07; the 80GB one: b2a43a147, 2023-10; sweep.sh does not
        # override it): MPT's copy of flash-attn's `flash_attn_triton.py`, "slightly slower"
        # than FlashAttention 1.x by its docstring, so priced as "flash1". Its loss is
        # flash-attn's fused cross entropy (MPT's `loss_fn` default "fused_crossentropy" in
        # llm-foundry's `ComposerMPTCausalLM` at both commits).
        case.engine = engine | {"attention": "flash1", "fused_loss": True}
        if "precision=amp_bf16" in notes:
            # Composer's FSDP mixed precision DEFAULT under amp_bf16: reduce_dtype fp32.
            case.engine["reduce_fp32"] = True
        case.measured_step_s = gb * seq / (case.value * gpus)
        n = mpt_params(layers, hidden, heads, seq)
        # The README's MFU: (6 N + 12 l h s) FLOPs per token (attention's full square) over
        # the A100's 312 TFLOP/s, N its logged n_params.
        implied = (6 * n + 12 * layers * hidden * seq) * case.value / 312e12
        case.conversion = (
            f"global_batch * seq / (tokens/s/GPU * gpus); stated MFU "
            f"{_notes_float(notes, 'MFU')}% vs {implied:.2%} from (6N + 12lhs) tokens/s, "
            f"N = {n} (zoo) vs {case.params:.4g} (source)"
        )
        if abs(n / case.params - 1) > 0.005:
            case.status = "excluded"
            case.reason = f"MPT parameter count {n} differs from the source's {case.params:.4g}"
            return case
    else:
        case.status, case.reason = "excluded", "no recipe for this source"
        return case
    if par.get("micro_batch") is None:
        case.status, case.reason = "excluded", "micro-batch not stated"
        return case
    case.parallel = par
    return case


# ---------------------------------------------------------------------------------------------
# Clusters
# ---------------------------------------------------------------------------------------------


def build_cluster(kind: str, gpus: int):
    """The row's hardware as a meshplan Cluster."""
    from meshplan.ir import Cluster, DeviceGroup
    from meshplan.ir.hardware import H100_96GB_500W, LINK_TIERS, gpu_spec

    if kind == "dgx-a100":  # Selene / DGX A100: 8 x A100-80GB, NVLink3, 8 x HDR 200 Gb/s
        gpu, per_node, intra, inter, nics = "A100-80GB", 8, "nvlink3", "ib-hdr", 8
    elif kind == "dgx-h100":  # DGX H100 (Eos): 8 x H100 SXM, NVLink4, 8 x NDR 400 Gb/s
        gpu, per_node, intra, inter, nics = "H100", 8, "nvlink4", "ib-ndr", 8
    elif kind == "grand-teton":  # Meta Grand Teton: 8 x H100 96GB @500W, 400 Gb/s RDMA per GPU
        gpu, per_node, intra, inter, nics = "H100-96GB-500W", 8, "nvlink4", "roce-400g", 8
    elif kind == "h200":  # H200 SXM, 8/node on NVLink4, one 400 Gb/s ConnectX-7 per GPU
        gpu, per_node, intra, inter, nics = "H200", 8, "nvlink4", "ib-ndr", 8
    elif kind == "dgx2-v100":  # DGX-2: 16 x V100 32GB on NVSwitch, 8 x EDR 100 Gb/s
        gpu, per_node, intra, inter, nics = "V100", 16, "nvlink2", "ib-edr", 8
    elif kind in ("mosaic-a100-80", "mosaic-a100-40"):
        # MosaicML platform (llm-foundry's tables): 8 x A100 SXM on NVLink3, "1600 Gbps
        # node-node interconnect (RoCE)": 8 x 200 Gb/s per node.
        gpu = "A100-80GB" if kind.endswith("80") else "A100-40GB"
        per_node, intra, inter, nics = 8, "nvlink3", "roce-200g", 8
    else:
        raise ValueError(kind)
    nodes = max(1, gpus // per_node)
    per_node = min(per_node, gpus)
    spec = H100_96GB_500W if gpu == H100_96GB_500W.name else gpu_spec(gpu)
    group = DeviceGroup(
        name="g",
        gpu=spec,
        nodes=nodes,
        gpus_per_node=per_node,
        intra_link=intra,
        inter_link=inter if nodes > 1 else "",
        nics_per_node=nics,
    )
    links = tuple(LINK_TIERS[n] for n in ([intra, inter] if nodes > 1 else [intra]))
    return Cluster(f"{kind}-{gpus}", (group,), links)


# ---------------------------------------------------------------------------------------------
# Tracing (cached per architecture and sequence length)
# ---------------------------------------------------------------------------------------------

_GRAPHS: dict[str, object] = {}


def graph_for(arch: Arch, seq_len: int, cache_dir: Path | None):
    """The traced graph of `arch` at `seq_len` (micro-batch 1), memoised and optionally kept
    on disk (keyed by the architecture, torch version and tracer source)."""
    import torch
    from meshplan import models
    from meshplan.ir import trace

    key = arch.key(seq_len)
    if key in _GRAPHS:
        return _GRAPHS[key]
    path = None
    if cache_dir is not None:
        import importlib

        h = hashlib.sha256(torch.__version__.encode())
        for name in ("meshplan.ir.trace", "meshplan.ir.lower", "meshplan.ir.flops"):
            h.update(Path(importlib.import_module(name).__file__).read_bytes())
        path = cache_dir / f"{key}-{h.hexdigest()[:12]}.pkl"
        if path.exists():
            _GRAPHS[key] = pickle.loads(path.read_bytes())
            return _GRAPHS[key]
    if arch.preset:
        model, inputs = models.get(arch.preset, seq_len=seq_len)
    else:
        model, inputs = models.transformer(
            layers=arch.layers,
            hidden=arch.hidden,
            heads=arch.heads,
            ffn=arch.ffn,
            vocab=arch.vocab,
            seq_len=seq_len,
            style=arch.style,
            tie_embeddings=arch.tied,
        )
    if arch.attention == "math":  # unfused attention: scores and softmax materialised
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            graph = trace(model, *inputs, name=key)
    else:
        graph = trace(model, *inputs, name=key)
    _GRAPHS[key] = graph
    if path is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(graph))
        os.replace(tmp, path)
    return graph


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


def run_case(case: Case, cache_dir: Path | None) -> None:
    """Estimate one counted/side case in place."""
    from meshplan.cost_model.memory import CONTEXT_BYTES
    from meshplan.cost_model.simulate import predict
    from meshplan.ir import Parallel
    from meshplan.passes.partition import place_stages

    assert case.arch is not None
    graph = graph_for(case.arch, case.seq_len, cache_dir)
    cluster = build_cluster(case.cluster, case.gpus)
    par = Parallel(**case.parallel)
    from meshplan.api import check_config, complete_parallel, default_stages
    from meshplan.cost_model.engine import Engine

    p = complete_parallel(graph, cluster, par)
    check_config(graph, cluster, p, par)
    # the layout the schedule runs (interleaved chunks: `partition.chunk_layers`)
    stages = place_stages(cluster, p, default_stages(graph, p))
    pred = predict(
        graph,
        cluster,
        p,
        stages,
        dtype=case.dtype,
        # the row's selective policy is the stack's, set on the engine (a policy the row's
        # own engine names wins); meshplan's keep-every-linear is the eager default
        engine=Engine(**{**_selective(case.selective_policy), **case.engine}),
    )
    case.predicted_step_s = pred.step_time_s
    case.predicted_fits = pred.fits
    case.breakdown = {k: round(v, 6) for k, v in pred.breakdown}
    if case.measured_mem_gib is not None:
        case.predicted_mem_gib = (pred.peak_memory_bytes - CONTEXT_BYTES) / GiB


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of `xs`, q in [0, 100]."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _gpu_of(case: Case) -> str:
    return {
        "dgx-a100": "A100-80GB",
        "dgx-h100": "H100",
        "grand-teton": "H100-96GB-500W",
        "dgx2-v100": "V100",
        "h200": "H200",
        "mosaic-a100-80": "A100-80GB",
        "mosaic-a100-40": "A100-40GB",
    }[case.cluster]


def source_of(case: Case) -> str:
    """The source a row comes from, the unit that leave-one-source-out holds out: a publisher
    and its software stack, whatever table or date within it. torchtitan's December 2024
    tables, performance.md, the async-TP and the H200 pages are one source (one stack, mostly
    one cluster); so are llm-foundry's A100 80GB and 40GB tables. Holding out one table of a
    source while fitting on its sibling tables would flatter."""
    s = case.source
    if s.startswith("Korthikanti"):
        return "Korthikanti 2022"
    if "Megatron-LM README (2020" in s:
        return "Megatron-LM 2020"
    if s.startswith("NVIDIA/Megatron-LM"):
        return "Megatron-Core r0.8"
    if s.startswith("pytorch/torchtitan"):
        return "torchtitan"
    if s.startswith("mosaicml/llm-foundry"):
        return "llm-foundry"
    return s[:24]


# ---------------------------------------------------------------------------------------------
# Fitting the kernel efficiencies (--fit) and leaving sources out
# ---------------------------------------------------------------------------------------------

# GPU types fitted as one: `cost_model/compute.KERNEL_EFFICIENCY` gives the members the
# leader's values ("as A100-80GB", "as H100"), so their rows fit one set and every member gets it.
FIT_GROUPS: dict[str, tuple[str, ...]] = {
    "V100": ("V100", "V100-16GB"),
    "A100-80GB": ("A100-80GB", "A100-40GB", "A100-PCIe"),
    "H100": ("H100", "H200", "H100-PCIe"),
    "H100-96GB-500W": ("H100-96GB-500W",),
}
# The nearest calibrated group of a group: where its published attention fractions come from
# (the power-capped H100's shipped ones are themselves fitted) and whose fitted values it takes
# when none of its own rows is in the fit (its only source left out).
NEAREST_GROUP = {"H100-96GB-500W": "H100"}
# Groups without FP8 rows take this group's fitted FP8/bf16 ratio times their own bf16 GEMM
# efficiency (compute.py: "Hopper types without FP8 rows take the 500 W part's ratio").
FP8_RATIO_FROM: dict[str, str] = {}  # H100's FP8 is measured on kernels since session 22
# Fit groups whose bf16 GEMM efficiency is measured on GPU kernels, not fitted on step times:
# the fit keeps the shipped value and leave-one-source-out never refits it, because no
# published run set it. A100: 0.723 zeroes the median signed error of Vidur's 36,516 A100 80GB
# fp16 GEMM kernels priced as the planner prices them (`benchmarks/gpu_op_latency.py`,
# docs/op_latency.md; compute.py's comment above KERNEL_EFFICIENCY).
# H100 (session 22): 0.784 (FP8 0.692) zeroes it on meshplan's own H200 kernels of the same
# GH100 die (`benchmarks/collect_gpu_ops.py`); its FP8 value is kept too (not the 500 W
# part's ratio, `FP8_RATIO_FROM`).
KERNEL_MEASURED_GEMM = frozenset({"A100-80GB", "H100"})
# A field needs this many rows of its kind to be fitted.
MIN_FIT_ROWS = 3
# Bounds of a fitted GEMM efficiency: hardware.md's "70-90% of peak for large GEMMs" at the
# top (a fit that wants more is absorbing a modelling error elsewhere), 0.3 at the bottom.
FIT_RANGE = (0.3, 0.9)


def fit_group(gpu: str) -> str:
    """The fit group (`FIT_GROUPS` key) of GPU type `gpu`."""
    return next((g for g, members in FIT_GROUPS.items() if gpu in members), gpu)


@dataclass(frozen=True)
class FitField:
    """One fitted efficiency: `name` (a KernelEfficiency field, or "attention": both attention
    fractions scaled together from the published ones), the rows it is fitted on, and the
    bisection bracket."""

    name: str
    picks: Callable[[Case], bool]
    bracket: tuple[float, float]


# Coordinate-descent order. Attention is fitted on long-sequence rows, where it is most of the step.
FIT_FIELDS = (
    FitField("attention", lambda c: c.seq_len >= 32768, (0.3, 1.5)),
    FitField("gemm", lambda c: not c.engine.get("float8"), FIT_RANGE),
    FitField("gemm_fp8", lambda c: bool(c.engine.get("float8")), FIT_RANGE),
)


@functools.cache
def _shipped() -> dict:
    """`compute.KERNEL_EFFICIENCY` as shipped (taken before any fit replaces entries)."""
    from meshplan.cost_model import compute

    return dict(compute.KERNEL_EFFICIENCY)


def prior_efficiency(group: str):
    """Where a group's fit starts, and what it keeps for a field with too few rows: the
    published fused-attention fractions (of `NEAREST_GROUP` where the shipped ones are fitted),
    `DEFAULT_EFFICIENCY`'s GEMM (what an uncalibrated GPU type gets), no separate FP8 value.
    Nothing in it comes from a published run (a `KERNEL_MEASURED_GEMM` group's GEMM comes
    from kernel measurements)."""
    from meshplan.cost_model.compute import DEFAULT_EFFICIENCY

    base = _shipped().get(NEAREST_GROUP.get(group, group), DEFAULT_EFFICIENCY)
    measured = group in KERNEL_MEASURED_GEMM
    gemm = base.gemm if measured else DEFAULT_EFFICIENCY.gemm
    fp8 = base.gemm_fp8 if measured else None
    int8 = base.gemm_int8 if measured else None
    return dataclasses.replace(
        base, gemm=gemm, gemm_fp8=fp8, gemm_int8=int8, source=f"prior ({group})"
    )


def _with(eff, name: str, value: float, base):
    """`eff` with field `name` set to `value` (attention: `base`'s fractions times `value`)."""
    if name == "attention":
        return dataclasses.replace(
            eff,
            attention_fwd=min(FIT_RANGE[1], base.attention_fwd * value),
            attention_bwd=min(FIT_RANGE[1], base.attention_bwd * value),
        )
    return dataclasses.replace(eff, **{name: value})


@dataclass(frozen=True)
class FieldFit:
    """One fitted field: its value (attention: the scale of the published fractions) and the
    rows that set it."""

    name: str
    value: float
    rows: tuple[int, ...]


@dataclass(frozen=True)
class GroupFit:
    """A fit group's efficiencies as fitted on `rows`; `fields` lists the fields that had
    enough rows (the others kept the prior)."""

    group: str
    efficiency: object  # meshplan.cost_model.compute.KernelEfficiency
    fields: tuple[FieldFit, ...]
    rows: tuple[int, ...]

    def field(self, name: str) -> FieldFit | None:
        return next((f for f in self.fields if f.name == name), None)


# Predicts the step time of each case (by row) with the efficiency table's entries in place of
# the shipped ones; `cost_model_predictor` is the real one, tests pass their own.
Predictor = Callable[[Sequence[Case], Mapping[str, object]], dict[int, float]]


@contextlib.contextmanager
def efficiencies(table: Mapping[str, object]):
    """`compute.KERNEL_EFFICIENCY` with `table`'s entries replaced, restored on exit (the
    simulator's caches are dropped both ways: its prices depend on the efficiencies)."""
    from meshplan.cost_model import compute, graph_costs, pricer

    _shipped()
    saved = dict(compute.KERNEL_EFFICIENCY)

    def clear() -> None:
        graph_costs._MODEL_CACHE.clear()
        pricer._PRICER_CACHE.clear()

    compute.KERNEL_EFFICIENCY.update(table)
    clear()
    try:
        yield
    finally:
        compute.KERNEL_EFFICIENCY.clear()
        compute.KERNEL_EFFICIENCY.update(saved)
        clear()


def cost_model_predictor(cache_dir: Path | None) -> Predictor:
    """The cost model (`run_case`) as a `Predictor`; the cases themselves are not changed."""

    def predict(cases: Sequence[Case], table: Mapping[str, object]) -> dict[int, float]:
        out = {}
        with efficiencies(table):
            for c in cases:
                tmp = dataclasses.replace(c)
                run_case(tmp, cache_dir)
                out[c.row] = tmp.predicted_step_s
        return out

    return predict


def _members(group: str, eff) -> dict[str, object]:
    return {gpu: eff for gpu in FIT_GROUPS.get(group, (group,))}


def fit_group_efficiency(
    group: str,
    rows: Sequence[Case],
    predict: Predictor,
    *,
    passes: int = 4,
    iterations: int = 14,
    tolerance: float = 1e-3,
) -> GroupFit:
    """The efficiencies of fit group `group` that zero the median signed step-time error of
    `rows` (its counted rows), as `--fit` has always fitted them: from `prior_efficiency`,
    coordinate descent over `FIT_FIELDS` (up to `passes` rounds, stopping once no field moves
    more than `tolerance`), each field by bisection within its bracket on its own rows (the
    error falls as an efficiency rises); a field needs `MIN_FIT_ROWS` rows. Uses nothing but
    `rows`."""
    base = prior_efficiency(group)
    eff = base
    fitted: dict[str, FieldFit] = {}
    for _ in range(passes):
        moved = 0.0
        for f in FIT_FIELDS:
            if f.name == "gemm" and group in KERNEL_MEASURED_GEMM:
                continue  # measured on kernels (`KERNEL_MEASURED_GEMM`), not fitted here
            picked = [c for c in rows if f.picks(c)]
            if len(picked) < MIN_FIT_ROWS:
                continue
            lo, hi = f.bracket
            for _ in range(iterations):
                mid = (lo + hi) / 2
                steps = predict(picked, _members(group, _with(eff, f.name, mid, base)))
                med = statistics.median(steps[c.row] / c.measured_step_s - 1 for c in picked)
                lo, hi = (mid, hi) if med > 0 else (lo, mid)
            value = (lo + hi) / 2
            old = fitted.get(f.name)
            moved = max(moved, math.inf if old is None else abs(value - old.value))
            fitted[f.name] = FieldFit(f.name, value, tuple(c.row for c in picked))
            eff = _with(eff, f.name, value, base)
        if moved <= tolerance:
            break
    eff = dataclasses.replace(eff, source=f"fit on rows {_row_ranges(c.row for c in rows)}")
    fields = tuple(fitted[f.name] for f in FIT_FIELDS if f.name in fitted)
    return GroupFit(group, eff, fields, tuple(c.row for c in rows))


def fit_constants(
    rows: Sequence[Case], predict: Predictor, memo: dict | None = None
) -> dict[str, GroupFit]:
    """Every fit group's `fit_group_efficiency` on its share of `rows` (memoised in `memo` by
    group and rows: leaving out a source refits only the groups it has rows in)."""
    memo = {} if memo is None else memo
    fits = {}
    for group in sorted({fit_group(_gpu_of(c)) for c in rows}):
        mine = [c for c in rows if fit_group(_gpu_of(c)) == group]
        key = (group, tuple(c.row for c in mine))
        if key not in memo:
            memo[key] = fit_group_efficiency(group, mine, predict)
        fits[group] = memo[key]
    return fits


def efficiency_table(
    fits: Mapping[str, GroupFit], *, shared_attention: bool = False
) -> dict[str, object]:
    """The efficiency of every GPU type of `FIT_GROUPS` under `fits`: its group's fitted one;
    for a group with no fitted field (no rows, or too few), its `NEAREST_GROUP`'s when that
    was fitted, else its prior (an uncalibrated type); FP8 by `FP8_RATIO_FROM` where the group
    had no FP8 rows.

    `shared_attention` (a what-if, not what `--fit` ships): a group without long-sequence rows
    of its own takes its published attention fractions times the median attention scale the
    other groups in `fits` were fitted to, i.e. "training stacks reach this fraction of the
    published kernel numbers" transfers across GPU types. Under leave-one-source-out `fits`
    holds no group fitted on the held-out source, so neither does the shared scale."""
    scales = [f.field("attention").value for f in fits.values() if f.field("attention")]
    effs = {}
    for group in FIT_GROUPS:
        fit = fits.get(group)
        near = fits.get(NEAREST_GROUP.get(group, ""))
        if fit is not None and fit.fields:
            eff = fit.efficiency
        elif near is not None and near.fields:
            eff = dataclasses.replace(near.efficiency, source=f"as {near.group} (no own rows)")
        else:
            eff = prior_efficiency(group)
        ratio_from = fits.get(FP8_RATIO_FROM.get(group, ""))
        own_fp8 = fit is not None and fit.field("gemm_fp8") is not None
        if not own_fp8 and ratio_from and ratio_from.field("gemm_fp8") and ratio_from.field("gemm"):
            r = ratio_from.efficiency
            eff = dataclasses.replace(eff, gemm_fp8=eff.gemm * r.fp8 / r.gemm)
        own_attention = fit is not None and fit.field("attention") is not None
        if shared_attention and scales and not own_attention:
            eff = _with(eff, "attention", statistics.median(scales), prior_efficiency(group))
        effs[group] = eff
    return {gpu: effs[g] for g, members in FIT_GROUPS.items() for gpu in members}


def leave_out(
    cases: Sequence[Case],
    key: Callable[[Case], object],
    predict: Predictor,
    memo: dict | None = None,
    *,
    shared_attention: bool = False,
) -> tuple[dict[int, float], dict[object, dict[str, GroupFit]]]:
    """Each counted case predicted with every fitted constant refitted on the counted cases of
    the other `key`s (key = `source_of`: leave one source out; `shared_attention`: see
    `efficiency_table`). Returns the predicted step per row and the fits used for each
    held-out key."""
    counted = [c for c in cases if c.status == "counted"]
    memo = {} if memo is None else memo
    steps: dict[int, float] = {}
    fits_by_key = {}
    for held in sorted({key(c) for c in counted}, key=str):
        train = [c for c in counted if key(c) != held]
        test = [c for c in counted if key(c) == held]
        fits = fit_constants(train, predict, memo)
        steps |= predict(test, efficiency_table(fits, shared_attention=shared_attention))
        fits_by_key[held] = fits
    return steps, fits_by_key


def _row_ranges(rows) -> str:
    """'1-8, 11, 22-33' for the sorted row numbers."""
    rs = sorted(rows)
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(f"{rs[i]}-{rs[j]}" if j > i else f"{rs[i]}")
        i = j + 1
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------
# The constant-MFU baseline
# ---------------------------------------------------------------------------------------------

# The fixed baseline: 6 N tokens / (0.5 x peak).
BASELINE_MFU = 0.5


def peak_flops(case: Case) -> float:
    """The dense peak of the row's GPU in its training dtype (bf16; fp16 on the 2020 V100 rows),
    also for Float8 rows (MFU is conventionally quoted against the bf16 peak)."""
    from meshplan.ir.hardware import H100_96GB_500W, gpu_spec

    gpu = _gpu_of(case)
    spec = H100_96GB_500W if gpu == H100_96GB_500W.name else gpu_spec(gpu)
    return spec.peak(case.dtype)


def baseline_step(case: Case, mfu: float) -> float:
    """6 N tokens / (gpus x mfu x peak): N the source's parameter count, tokens per step
    global_batch x seq."""
    tokens = case.parallel["global_batch"] * case.seq_len
    return 6 * case.params * tokens / (case.gpus * mfu * peak_flops(case))


def fit_mfu(cases: Sequence[Case]) -> float:
    """The MFU whose baseline has zero median signed error on `cases`: the median of their
    achieved 6N MFUs (the error of a row is achieved / mfu - 1)."""
    return statistics.median(baseline_step(c, 1.0) / c.measured_step_s for c in cases)


def mfu_leave_out(cases: Sequence[Case], key: Callable[[Case], object]) -> dict[object, float]:
    """Per held-out key, the baseline MFU fitted on the counted cases of the other keys."""
    counted = [c for c in cases if c.status == "counted"]
    return {
        held: fit_mfu([c for c in counted if key(c) != held])
        for held in sorted({key(c) for c in counted}, key=str)
    }


# ---------------------------------------------------------------------------------------------
# Validation: refit, leave-one-source-out, baseline; statistics
# ---------------------------------------------------------------------------------------------

# (column, Case attribute) of every method the report compares.
METHODS = (
    ("shipped", "predicted_step_s"),
    ("refit", "refit_step_s"),
    ("LOSO", "loso_step_s"),
    ("6N@0.5", "mfu_step_s"),
    ("6N LOSO", "mfu_loso_step_s"),
)


@dataclass
class Validation:
    """What `validate` fitted: the in-sample fits, the fits without each source, and the
    baseline MFUs."""

    refit: dict[str, GroupFit]
    loso: dict[object, dict[str, GroupFit]]
    mfu_all: float
    mfu_loso: dict[object, float]
    seconds: float
    shared_attention: bool = False


def validate(
    cases: Sequence[Case], predict: Predictor, *, shared_attention: bool = False
) -> Validation:
    """Fill every counted case's refit, LOSO and baseline step times (see the module
    docstring; `shared_attention`: see `efficiency_table`)."""
    t0 = time.perf_counter()
    counted = [c for c in cases if c.status == "counted"]
    by_row = {c.row: c for c in counted}
    memo: dict = {}
    refit = fit_constants(counted, predict, memo)
    table = efficiency_table(refit, shared_attention=shared_attention)
    for row, step in predict(counted, table).items():
        by_row[row].refit_step_s = step
    loso_steps, loso_fits = leave_out(
        counted, source_of, predict, memo, shared_attention=shared_attention
    )
    mfu_loso = mfu_leave_out(counted, source_of)
    for c in counted:
        c.loso_step_s = loso_steps[c.row]
        c.mfu_step_s = baseline_step(c, BASELINE_MFU)
        c.mfu_loso_step_s = baseline_step(c, mfu_loso[source_of(c)])
    seconds = time.perf_counter() - t0
    return Validation(refit, loso_fits, fit_mfu(counted), mfu_loso, seconds, shared_attention)


@dataclass(frozen=True)
class ErrorStats:
    """Absolute relative step-time errors: median and p90, the signed median (bias), count."""

    count: int
    median: float
    p90: float
    bias: float

    def __str__(self) -> str:
        return f"{self.median:6.1%} {self.p90:6.1%} {self.bias:+7.1%}"


def error_stats(errors: Sequence[float]) -> ErrorStats:
    errors = [e for e in errors if not math.isnan(e)]
    if not errors:
        return ErrorStats(0, math.nan, math.nan, math.nan)
    absolute = [abs(e) for e in errors]
    return ErrorStats(
        len(errors),
        statistics.median(absolute),
        percentile(absolute, 90),
        statistics.median(errors),
    )


def grouped_stats(
    cases: Sequence[Case], key: Callable[[Case], str]
) -> dict[str, dict[str, ErrorStats]]:
    """Per value of `key` (and "all"), each method's `ErrorStats` over the counted cases."""
    counted = [c for c in cases if c.status == "counted"]
    groups = sorted({key(c) for c in counted}) + ["all"]
    return {
        g: {
            name: error_stats([c.error_of(attr) for c in counted if g == "all" or key(c) == g])
            for name, attr in METHODS
        }
        for g in groups
    }


# The targets, on the leave-one-source-out errors over all counted rows.
TARGET_MEDIAN, TARGET_P90, TARGET_BASELINE_RATIO = 0.10, 0.25, 0.5


def targets(cases: Sequence[Case]) -> dict:
    """Which targets hold: LOSO median <= 10% and p90 <= 25% over all counted rows, and per
    source a LOSO median at most half the baseline's (at 0.5 and fitted leave-one-out)."""
    by = grouped_stats(cases, source_of)
    loso = by["all"]["LOSO"]
    per_source = {
        s: {
            "loso_median": v["LOSO"].median,
            "half_baseline_0.5": v["LOSO"].median <= TARGET_BASELINE_RATIO * v["6N@0.5"].median,
            "half_baseline_loso": v["LOSO"].median <= TARGET_BASELINE_RATIO * v["6N LOSO"].median,
        }
        for s, v in by.items()
        if s != "all"
    }
    return {
        "loso_median": loso.median,
        "loso_median_met": loso.median <= TARGET_MEDIAN,
        "loso_p90": loso.p90,
        "loso_p90_met": loso.p90 <= TARGET_P90,
        "per_source": per_source,
        "half_baseline_every_source_0.5": all(v["half_baseline_0.5"] for v in per_source.values()),
        "half_baseline_every_source_loso": all(
            v["half_baseline_loso"] for v in per_source.values()
        ),
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def summarize(cases: list[Case]) -> dict:
    counted = [c for c in cases if c.status == "counted"]
    step = [abs(c.step_error) for c in counted]
    mem = [abs(c.mem_error) for c in counted if c.mem_error is not None]
    return {
        "rows": len(cases),
        "counted": len(counted),
        "side": sum(c.status == "side" for c in cases),
        "excluded": sum(c.status == "excluded" for c in cases),
        "step_median_abs_error": statistics.median(step) if step else math.nan,
        "step_p90_abs_error": percentile(step, 90),
        "memory_rows": len(mem),
        "memory_median_abs_error": statistics.median(mem) if mem else math.nan,
        # Every counted row ran, so a predicted peak over the GPU's memory is an error too.
        "predicted_over_memory": sum(c.predicted_fits is False for c in counted),
    }


def _short_source(src: str) -> str:
    if src.startswith("Korthikanti") and "Table 5" in src:
        return "Korthikanti T5"
    if src.startswith("Korthikanti"):
        return "Korthikanti abstract"
    if src.startswith("mosaicml/llm-foundry"):
        return "llm-foundry 40GB" if "40GB" in src else "llm-foundry 80GB"
    if "2020" in src:
        return "Megatron 2020"
    if "Strong Scaling" in src:
        return "Megatron strong"
    if "Megatron-LM README" in src:
        return "Megatron-Core"
    if "performance.md" in src:
        return "torchtitan perf.md"
    if "asyncTP" in src:
        return "torchtitan asyncTP"
    if "h200" in src.lower():
        return "torchtitan H200"
    m = re.search(r"Table (\d+)", src)
    return f"torchtitan T{m.group(1)}" if m else src[:20]


def _config_str(c: Case) -> str:
    p = c.parallel
    s = f"tp{p['tp']} pp{p['pp']} dp{p['dp']}"
    if p.get("cp", 1) > 1:
        s += f" cp{p['cp']}"
    if p.get("virtual_stages"):
        s += f" v{p['virtual_stages']}"
    return s + f" mb{p['micro_batch']} gb{p['global_batch']} {p['recompute']} z{p['zero']}"


def _err(x: float, width: int = 7) -> str:
    return " " * width if math.isnan(x) else f"{x:+{width}.1%}"


def print_report(cases: list[Case], out=sys.stdout) -> None:
    w = out.write
    hdr = (
        f"{'row':>3} {'source':<19} {'model':<18} {'gpus':>5} {'config':<40} "
        f"{'meas s':>8} {'pred s':>8} {'err':>7} {'LOSO':>7} {'6N LOSO':>7} "
        f"{'mem meas':>8} {'pred':>6} {'err':>6}\n"
    )
    for status, title in (
        ("counted", "Counted rows (err: shipped constants)"),
        ("side", "Rows with unmodelled features (not counted)"),
    ):
        rows = [c for c in cases if c.status == status]
        if not rows:
            continue
        w(f"\n{title}\n" + hdr)
        for c in rows:
            mm = f"{c.measured_mem_gib:8.1f}" if c.measured_mem_gib is not None else " " * 8
            pm = f"{c.predicted_mem_gib:6.1f}" if c.predicted_mem_gib is not None else " " * 6
            me = f"{c.mem_error:+6.1%}" if c.mem_error is not None else " " * 6
            w(
                f"{c.row:>3} {_short_source(c.source):<19} {c.model[:18]:<18} {c.gpus:>5} "
                f"{_config_str(c):<40} {c.measured_step_s:8.3f} {c.predicted_step_s:8.3f} "
                f"{c.step_error:+7.1%} {_err(c.error_of('loso_step_s'))} "
                f"{_err(c.error_of('mfu_loso_step_s'))} {mm} {pm} {me}\n"
            )
    ex = [c for c in cases if c.status == "excluded"]
    if ex:
        w("\nExcluded rows\n")
        for c in ex:
            w(f"{c.row:>3} {_short_source(c.source):<19} {c.model[:24]:<24} {c.reason}\n")
    s = summarize(cases)
    w(
        f"\n{s['counted']} rows counted, {s['side']} rows with unmodelled features shown apart, "
        f"{s['excluded']} excluded\n"
        f"step time (shipped constants): median |error| {s['step_median_abs_error']:.1%}, "
        f"p90 {s['step_p90_abs_error']:.1%}\n"
        f"peak memory: median |error| {s['memory_median_abs_error']:.1%} "
        f"over {s['memory_rows']} rows; {s['predicted_over_memory']} of {s['counted']} rows "
        "(all of which ran) predicted over their GPU's memory\n"
    )


def print_validation(cases: list[Case], v: Validation, out=sys.stdout) -> None:
    """The per-source and per-GPU tables of every method, the fitted constants and the targets."""
    w = out.write
    names = [name for name, _ in METHODS]
    for title, key in (("source", source_of), ("GPU type", _gpu_of)):
        w(f"\nStep-time error by {title}: median |err|, p90 |err|, signed median\n")
        w(f"{title:<20} {'rows':>4}" + "".join(f" | {n:^21}" for n in names) + "\n")
        for g, stats in grouped_stats(cases, key).items():
            n = stats["shipped"].count
            w(f"{g:<20} {n:>4}" + "".join(f" | {stats[m]}" for m in names) + "\n")
    what_if = " (what-if: attention scale shared across GPU types)" if v.shared_attention else ""
    w(f"\nFitted constants{what_if}\n")
    for label, fits in [("all counted rows", v.refit)] + [
        (f"without {k}", f) for k, f in v.loso.items()
    ]:
        table = efficiency_table(fits, shared_attention=v.shared_attention)
        parts = []
        for group in FIT_GROUPS:
            e = table[group]
            parts.append(
                f"{group} gemm {e.gemm:.3f} fp8 {e.fp8:.3f} attn {e.attention_fwd:.3f}/"
                f"{e.attention_bwd:.3f}"
            )
        w(f"  {label:<28} " + "; ".join(parts) + "\n")
    w(
        f"\nbaseline MFU: fixed {BASELINE_MFU}; fitted on all rows {v.mfu_all:.3f}; "
        "without each source: " + ", ".join(f"{k} {m:.3f}" for k, m in v.mfu_loso.items()) + "\n"
    )
    t = targets(cases)
    w(
        f"targets (LOSO, all counted rows): median {t['loso_median']:.1%} <= 10%: "
        f"{'met' if t['loso_median_met'] else 'NOT met'}; p90 {t['loso_p90']:.1%} <= 25%: "
        f"{'met' if t['loso_p90_met'] else 'NOT met'}\n"
    )
    for s, d in t["per_source"].items():
        w(
            f"  {s:<20} LOSO median {d['loso_median']:.1%} at most half the baseline's: "
            f"vs 0.5 {'yes' if d['half_baseline_0.5'] else 'no'}, vs fitted "
            f"{'yes' if d['half_baseline_loso'] else 'no'}\n"
        )
    w(f"(refit + leave-one-source-out + baseline: {v.seconds:.1f} s)\n")


def print_fit(fits: Mapping[str, GroupFit], out=sys.stdout) -> None:
    """The fitted efficiencies, one line per fitted field, as `compute.KERNEL_EFFICIENCY`
    would take them."""
    for group, fit in fits.items():
        e = fit.efficiency
        for f in fit.fields:
            detail = (
                f"x{f.value:.3f}: fwd {e.attention_fwd:.3f}, bwd {e.attention_bwd:.3f}"
                if f.name == "attention"
                else f"{f.value:.3f}"
            )
            out.write(
                f"{group:<16} {f.name:<9} {detail}  ({len(f.rows)} rows: {_row_ranges(f.rows)})\n"
            )


def markdown_rows(cases: list[Case]) -> str:
    """The per-row table of docs/fidelity.md (counted rows, then the excluded ones)."""
    lines = [
        "| row | source | model | GPUs | configuration | engine | measured s | predicted s "
        "| error | LOSO | 6N LOSO | memory GiB (measured / predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    from meshplan.cost_model.engine import Engine

    for c in cases:
        if c.status == "excluded":
            continue
        mem = ""
        if c.mem_error is not None:
            mem = f"{c.measured_mem_gib:.1f} / {c.predicted_mem_gib:.1f} ({c.mem_error:+.1%})"
        lines.append(
            f"| {c.row} | {_short_source(c.source)} | {c.model} | {c.gpus} | {_config_str(c)} "
            f"| {Engine(**c.engine).describe()} | {c.measured_step_s:.3f} "
            f"| {c.predicted_step_s:.3f} | {c.step_error:+.1%} "
            f"| {_err(c.error_of('loso_step_s'), 0)} | {_err(c.error_of('mfu_loso_step_s'), 0)} "
            f"| {mem} |"
        )
    ex = [c for c in cases if c.status == "excluded"]
    if ex:
        lines.append("")
        lines.append("Excluded: " + "; ".join(f"row {c.row} ({c.reason})" for c in ex) + ".")
    return "\n".join(lines) + "\n"


def markdown_stats(cases: list[Case], key: Callable[[Case], str], title: str) -> str:
    """A per-`key` table of every method: median / p90 / signed median, and the count."""
    names = [name for name, _ in METHODS]
    lines = [
        f"| {title} | rows | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for g, stats in grouped_stats(cases, key).items():
        cells = [f"{s.median:.1%} / {s.p90:.1%} / {s.bias:+.1%}" for s in (stats[n] for n in names)]
        label = f"**{g}**" if g == "all" else g
        lines.append(f"| {label} | {stats['shipped'].count} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _stats_json(by: dict[str, dict[str, ErrorStats]]) -> dict:
    return {g: {m: asdict(s) for m, s in methods.items()} for g, methods in by.items()}


def _fits_json(fits: Mapping[str, GroupFit], shared_attention: bool) -> dict:
    table = efficiency_table(fits, shared_attention=shared_attention)
    return {gpu: asdict(e) for gpu, e in table.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--json", type=Path, help="write per-row results and the summary here")
    ap.add_argument("--cache", type=Path, help="directory to keep traced graphs in")
    ap.add_argument("--rows", help="comma-separated row numbers to run (default: all)")
    ap.add_argument(
        "--fit",
        action="store_true",
        help="print the per-GPU-type efficiencies that zero each type's median error",
    )
    ap.add_argument(
        "--loo",
        action="store_true",
        help="leave-one-row-out: refit every constant without each row, then predict it (slow)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="shipped constants only: no refit, LOSO, baseline"
    )
    ap.add_argument(
        "--shared-attention",
        action="store_true",
        help="what-if: a GPU type without long-sequence rows takes the other types' fitted "
        "attention scale (not what --fit ships)",
    )
    ap.add_argument("--markdown", action="store_true", help="print the docs tables as markdown")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    cases = [interpret(i + 1, r) for i, r in enumerate(rows)]
    if args.rows:
        keep = {int(x) for x in args.rows.split(",")}
        cases = [c for c in cases if c.row in keep]
    t0 = time.perf_counter()
    for c in cases:
        if c.status != "excluded":
            run_case(c, args.cache)
    predict = cost_model_predictor(args.cache)
    counted = [c for c in cases if c.status == "counted"]
    if args.fit:
        print_fit(fit_constants(counted, predict))
        return 0
    if args.loo:
        steps, _ = leave_out(counted, lambda c: c.row, predict)
        errors = [steps[c.row] / c.measured_step_s - 1 for c in counted]
        for c, e in zip(counted, errors):
            print(f"{c.row:>3} {c.step_error:+9.1%} {e:+9.1%}")
        s = error_stats(errors)
        print(f"leave-one-row-out over {s.count} rows: median {s.median:.1%}, p90 {s.p90:.1%}")
        return 0
    validation = (
        None if args.quick else validate(cases, predict, shared_attention=args.shared_attention)
    )
    if args.markdown:
        sys.stdout.write(markdown_rows(cases))
        if validation is not None:
            sys.stdout.write("\n" + markdown_stats(cases, source_of, "source"))
            sys.stdout.write("\n" + markdown_stats(cases, _gpu_of, "GPU type"))
        return 0
    print_report(cases)
    if validation is not None:
        print_validation(cases, validation)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        data: dict = {"summary": summarize(cases)}
        if validation is not None:
            by_source = _stats_json(grouped_stats(cases, source_of))
            data["summary"]["methods"] = by_source["all"]  # every method over all counted rows
            data |= {
                "by_source": by_source,
                "by_gpu": _stats_json(grouped_stats(cases, _gpu_of)),
                "targets": targets(cases),
                "constants": {
                    "refit": _fits_json(validation.refit, validation.shared_attention),
                    "loso": {
                        str(k): _fits_json(f, validation.shared_attention)
                        for k, f in validation.loso.items()
                    },
                },
                "baseline_mfu": {
                    "fixed": BASELINE_MFU,
                    "all_rows": validation.mfu_all,
                    "loso": {str(k): m for k, m in validation.mfu_loso.items()},
                },
                "validation_seconds": validation.seconds,
                "shared_attention": validation.shared_attention,
            }
        data["rows"] = [
            asdict(c)
            | {
                "source_group": source_of(c),
                "step_error": c.step_error if c.status != "excluded" else None,
            }
            | (
                {name: c.error_of(attr) for name, attr in METHODS}
                if c.status == "counted" and validation is not None
                else {}
            )
            for c in cases
        ]
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
