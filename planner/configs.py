"""Configurations of the frameworks people already train with: import, compare, export.

    cfg = meshplan.configs.load("megatron:args.txt", world_size=1024)
    cfg.parallel, cfg.engine, cfg.model, cfg.stage_layers, cfg.unpriced, cfg.unknown
    plan = meshplan.configs.estimate(cfg, cluster)          # predicted on your cluster
    text = meshplan.configs.export(plan, "torchtitan").text  # a job TOML torchtitan runs

Three readers turn a framework's own configuration into one `FrameworkConfig` (a
`Parallel`, the engine options meshplan prices, the model when the file states it, the
layers per pipeline stage of an uneven split, the list of what the file says that meshplan
cannot price, and the options it does not know); writers turn a `Plan` back into each
framework's form, or refuse with one line naming the feature it cannot express (`--closest`
writes the nearest plan it can, re-priced). `import(export(plan))` gives back the plan's
`Parallel`.

Formats and where their names come from (each reader cites the file it follows):
- `torchtitan`: the job TOML of torchtitan <= 0.2 (`torchtitan/config/job_config.py`:
  sections job, model, training, parallelism, activation_checkpoint, compile, float8).
- `torchtitan-cli`: torchtitan 0.3's command line, `--module <m> --config <fn>` plus tyro
  overrides `--parallelism.*`, `--training.*`, `--compile.*`, `activation_checkpoint:<mode>`
  (torchtitan 0.3.0 `torchtitan/config/manager.py`, `config/configs.py`), saved to a file.
- `megatron`: Megatron-LM / Megatron-Bridge pretraining arguments (Megatron-LM
  `megatron/training/arguments.py`, core_r0.16; model-parallel names as in megatron-core
  0.16.1 `megatron/core/model_parallel_config.py`), saved to a file.
- `deepspeed`: a DeepSpeed JSON config (deepspeed 0.19.8 `deepspeed/runtime/config.py`,
  `runtime/constants.py`, `runtime/zero/config.py`, `runtime/tensor_parallel/config.py`).

Every option a file states is priced, listed as not priced, silently accepted as
bookkeeping, or listed as unknown with the nearest known name (`configs_options`, which holds
each framework's option tables). Every mistake in a file is a one-line `ConfigError`:
`FILE: field F: what is wrong; what to do`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from meshplan.cost_model import predict
from meshplan.cost_model.engine import EAGER, Engine, EngineError, SelectivePolicy
from meshplan.ir import Cluster, Graph, Parallel, Recompute, Schedule
from meshplan.ir.plan import Plan, assign_ranks, write_text_file
from meshplan.models import PRESETS, TransformerConfig
from meshplan.passes.partition import place_stages

from .configs_options import OPTIONS, classify

FRAMEWORKS = ("torchtitan", "megatron", "deepspeed")
EXPORT_FORMATS = ("torchtitan", "torchtitan-cli", "megatron", "deepspeed")


class ConfigError(ValueError):
    """A framework configuration meshplan cannot read (one line: file, field, what to do)."""


# -- the imported configuration ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model a configuration trains: a meshplan preset, or the shape the file states
    (`config`), at the file's sequence length."""

    name: str
    config: TransformerConfig | None = None
    seq_len: int | None = None

    def build(self, micro_batch: int = 1):
        """`(model, example_inputs)` on the meta device."""
        from meshplan import models

        if self.config is not None:
            return models.build(self.config, seq_len=self.seq_len, micro_batch=micro_batch)
        return models.get(self.name, seq_len=self.seq_len, micro_batch=micro_batch)


@dataclass(frozen=True, slots=True)
class FrameworkConfig:
    """One framework configuration as meshplan reads it.

    `parallel` has dp and global_batch filled when the world size is known (given to
    `load`, or stated by the file); `stage_layers` lists the layers of each pipeline stage
    of an uneven split, under a schedule with several model chunks per rank (interleaved
    1F1B, ZB-V) of each of the pp * chunks chunks in model order (empty: even, or meshplan's
    chunk layout `partition.chunk_layers`); `unpriced` what the file asks for that meshplan does
    not price (each entry names the options and says how they are priced instead);
    `unknown` the options it states that are no option of that framework meshplan knows
    (each with the nearest known name: `--tensor-model-paralel-size (did you mean
    --tensor-model-parallel-size?)`)."""

    framework: str
    source: str
    parallel: Parallel
    engine: Engine = EAGER
    model: ModelSpec | None = None
    stage_layers: tuple[int, ...] = ()
    unpriced: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    def not_priced_line(self) -> str:
        """The one line `meshplan estimate --from` prints: what is not priced, then the
        unknown options; empty when there is neither."""
        items = [*self.unpriced, *(f"unknown {u}" for u in self.unknown)]
        return "not priced: " + "; ".join(items) if items else ""


class _Reader:
    """Collects a reader's fields, errors, unpriced notes and unknown options for one file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.unpriced: list[str] = []
        self.options: list[str] = []  # not-priced options, from `sort_options`
        self.unknown: list[str] = []

    def error(self, field: str, what: str) -> ConfigError:
        return ConfigError(f"{self.path}: field {field}: {what}")

    def positive(self, field: str, value: object, allow: tuple[int, ...] = ()) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or (value < 1 and value not in allow)
        ):
            extra = f" (or {', '.join(map(str, allow))})" if allow else ""
            raise self.error(field, f"must be a positive integer{extra}, got {value!r}")
        return value

    def note(self, text: str) -> None:
        if text not in self.unpriced:
            self.unpriced.append(text)

    def sort_options(self, fmt: str, given) -> None:
        """Sort `given` (the file's `(name, value)` options, spelt as `configs_options`
        spells them for `fmt`): what is not priced and what is unknown."""
        found = classify(OPTIONS[fmt], given)
        self.options += found.not_priced
        self.unknown += found.unknown

    def notes(self) -> tuple[str, ...]:
        """The reader's own notes, then the not-priced options."""
        return tuple(dict.fromkeys([*self.unpriced, *self.options]))


def _world_dp(r: _Reader, world_size: int | None, mp: int, field: str) -> int | None:
    """Data-parallel degree from the world size and the model-parallel GPUs per replica."""
    if world_size is None:
        return None
    if world_size % mp:
        raise r.error(
            field,
            f"the model-parallel degrees use {mp} GPUs per replica, which does not divide the "
            f"cluster's {world_size} GPUs; change the degrees or --gpus",
        )
    return world_size // mp


def _batches(
    r: _Reader, dp: int | None, micro: int, global_batch: int | None, per_step: int | None
) -> int | None:
    """Global batch from what the file states: itself, or `per_step` sequences per DP rank
    (one accumulation step) times dp."""
    if global_batch is not None:
        return global_batch
    if dp is not None and per_step is not None:
        return per_step * dp
    return None


# -- torchtitan ---------------------------------------------------------------------------------

# torchtitan model (name, flavor) <-> meshplan preset. torchtitan 0.3.0
# torchtitan/models/llama3/__init__.py registers flavors "debugmodel", "8B", "70B", "405B"
# (Llama 3.1 shapes, the same as meshplan's presets); config_registry.py names the 0.3
# config functions llama3_8b, llama3_70b, llama3_405b.
TORCHTITAN_MODELS: dict[tuple[str, str], str] = {
    ("llama3", "8B"): "llama3-8b",
    ("llama3", "70B"): "llama3-70b",
    ("llama3", "405B"): "llama3-405b",
}
_PRESET_TO_TITAN = {v: k for k, v in TORCHTITAN_MODELS.items()}

# torchtitan 0.3.0 torchtitan/models/llama3/config_registry.py: what each config function
# sets beyond the dataclass defaults (training, parallelism, activation_checkpoint, compile,
# converters). Keys are override names, as on the command line.
TORCHTITAN_CONFIGS: dict[str, dict[str, object]] = {
    "llama3_8b": {
        "model": ("llama3", "8B"),
        "training.local_batch_size": 1,
        "training.seq_len": 8192,
        "activation_checkpoint": "selective",
    },
    "llama3_70b": {
        "model": ("llama3", "70B"),
        "training.local_batch_size": 8,
        "training.seq_len": 8192,
        "parallelism.tensor_parallel_degree": 8,
        "activation_checkpoint": "full",
    },
    "llama3_405b": {
        "model": ("llama3", "405B"),
        "training.local_batch_size": 2,
        "training.seq_len": 8192,
        "parallelism.tensor_parallel_degree": 8,
        "activation_checkpoint": "full",
        "compile.enable": True,
        "compile.enable_async_tensor_parallel": True,
        "float8": True,  # Float8LinearConverter (tensorwise), lm_head filtered
    },
}

# Pipeline schedules: torchtitan passes the name to torch.distributed.pipelining's
# get_schedule_class (torch 2.13 schedules.py); the ones meshplan prices, and the rest priced
# as their nearest.
_TITAN_SCHEDULES = {
    "1F1B": Schedule.ONE_F_ONE_B,
    "GPipe": Schedule.GPIPE,
    "Interleaved1F1B": Schedule.INTERLEAVED_1F1B,
    "ZBVZeroBubble": Schedule.ZERO_BUBBLE,
}
_TITAN_NEAREST = {
    "LoopedBFS": Schedule.INTERLEAVED_1F1B,
    "InterleavedZeroBubble": Schedule.INTERLEAVED_1F1B,
    "DualPipeV": Schedule.ZERO_BUBBLE,
}
_SCHEDULE_TO_TITAN = {v: k for k, v in _TITAN_SCHEDULES.items()}
# Schedules that run several stages per rank (torch's PipelineScheduleMulti); the others one.
_MULTI_STAGE = {
    "Interleaved1F1B",
    "ZBVZeroBubble",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "DualPipeV",
}


def titan_stage_split(stages: int, layers: int, first_less: int, last_less: int) -> tuple[int, ...]:
    """Layers of each (virtual) stage as torchtitan splits them: the embedding counts as
    `first_less` layers and the output as `last_less`, the effective layers are spread evenly
    with the first stages taking the remainder. torchtitan 0.3.0
    torchtitan/distributed/pipeline_parallel.py `_generate_llm_fqn_per_model_part`."""
    if stages == 1:
        return (layers,)
    effective = layers + first_less + last_less
    base, extra = divmod(effective, stages)
    if base == 0 or first_less > base or last_less > base:
        raise ValueError(
            f"{stages} stages of {layers} layers with first/last_stage_less_layers "
            f"{first_less}/{last_less} leaves a stage empty"
        )
    counts, left = [], layers
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        n -= first_less if s == 0 else last_less if s == stages - 1 else 0
        n = max(0, min(n, left)) if s < stages - 1 else left
        counts.append(n)
        left -= n
    return tuple(counts)


def _titan_stage_count(
    r: _Reader, schedule: str, pp: int, layers: int, per_stage: int | None, fl: int, ll: int
) -> int:
    """Virtual stages per pipeline rank (torchtitan 0.3.0 pipeline_parallel.py
    `_get_pipeline_metadata`): from layers_per_stage when given, else 1 for single-stage
    schedules and 2 for looped ones."""
    if per_stage is None:
        return 2 if schedule in _MULTI_STAGE else 1
    total = math.ceil((layers + fl + ll) / per_stage)
    if total % pp:
        raise r.error(
            "parallelism.pipeline_parallel_layers_per_stage",
            f"{per_stage} gives {total} stages, not a multiple of pipeline_parallel_degree {pp} "
            "(torchtitan refuses it); pick a value that does",
        )
    return total // pp


def _read_torchtitan(
    r: _Reader,
    sections: dict[str, dict],
    model_name: tuple[str, str] | None,
    world_size: int | None,
    ac_mode: str | None,
    ac_option: str,
    model: str | None,
) -> FrameworkConfig:
    """The torchtitan fields shared by the TOML and the 0.3 command line."""
    par, train = sections.get("parallelism", {}), sections.get("training", {})
    comp, f8 = sections.get("compile", {}), sections.get("float8", {})

    def deg(name: str, allow: tuple[int, ...] = ()) -> int:
        return r.positive(f"parallelism.{name}", par.get(name, 1), allow)

    tp, pp, cp = (
        deg("tensor_parallel_degree"),
        deg("pipeline_parallel_degree"),
        deg("context_parallel_degree"),
    )
    ep = deg("expert_parallel_degree")
    replicate = deg("data_parallel_replicate_degree")
    shard = r.positive(
        "parallelism.data_parallel_shard_degree", par.get("data_parallel_shard_degree", -1), (-1,)
    )
    if shard == -1:
        left = _world_dp(r, world_size, tp * pp * cp * replicate, "parallelism")
        shard = left if left is not None else -1
    dp = replicate * shard if shard != -1 else None
    if shard == -1 or shard > 1:
        reshard = par.get("fsdp_reshard_after_forward", "default")
        zero = 2 if reshard == "never" else 3
    else:
        zero = 0
    if replicate > 1 and shard != 1:
        r.note(
            f"HSDP (replicated {replicate}x, sharded within each replica group): priced as "
            "FSDP over every data-parallel rank"
        )
    if not par.get("enable_sequence_parallel", True) and tp > 1:
        sp = False
    else:
        sp = tp > 1
    # model and its layer count (for the stage split)
    spec: ModelSpec | None = None
    seq = r.positive("training.seq_len", train.get("seq_len", 2048))
    if model is None and model_name is not None:
        preset = TORCHTITAN_MODELS.get(model_name)
        if preset is None:
            known = ", ".join(f"{n} {f}" for n, f in TORCHTITAN_MODELS)
            raise r.error(
                "model",
                f"{model_name[0]} {model_name[1]} is not a model meshplan knows (it knows "
                f"{known}); give --model NAME or path/to/file.py:factory",
            )
        spec = ModelSpec(preset, seq_len=seq)
    elif model is not None:
        spec = ModelSpec(model, seq_len=seq)
    layers = _layers_of(spec)

    # pipeline: schedule, virtual stages, stage split
    name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    schedule, virtual, stage_layers = None, None, ()
    if pp > 1:
        if name in _TITAN_SCHEDULES:
            schedule = _TITAN_SCHEDULES[name]
        elif name in _TITAN_NEAREST:
            schedule = _TITAN_NEAREST[name]
            r.note(f"pipeline schedule {name}: priced as {schedule}")
        else:
            known = ", ".join([*_TITAN_SCHEDULES, *_TITAN_NEAREST])
            raise r.error(
                "parallelism.pipeline_parallel_schedule",
                f"unknown schedule {name!r}; torchtitan's are {known}",
            )
        if par.get("pipeline_parallel_split_points") or par.get("module_fqns_per_model_part"):
            r.note("explicit pipeline split points: priced with the split from the layer counts")
        fl = r.positive(
            "parallelism.pipeline_parallel_first_stage_less_layers",
            par.get("pipeline_parallel_first_stage_less_layers", 1),
            (0,),
        )
        ll = r.positive(
            "parallelism.pipeline_parallel_last_stage_less_layers",
            par.get("pipeline_parallel_last_stage_less_layers", 1),
            (0,),
        )
        per_stage = par.get("pipeline_parallel_layers_per_stage")
        if per_stage is not None:
            r.positive("parallelism.pipeline_parallel_layers_per_stage", per_stage)
        if layers:
            chunks = _titan_stage_count(r, name, pp, layers, per_stage, fl, ll)
            try:
                split = titan_stage_split(pp * chunks, layers, fl, ll)
            except ValueError as e:
                raise r.error("parallelism.pipeline_parallel_layers_per_stage", str(e)) from None
            if schedule == Schedule.INTERLEAVED_1F1B:
                virtual = chunks
            # the model chunks a rank runs as meshplan prices the schedule
            runs = {Schedule.INTERLEAVED_1F1B: chunks, Schedule.ZERO_BUBBLE: 2}.get(schedule, 1)
            if len(set(split)) > 1 and runs == chunks:
                # priced as read: one stage per rank, or pp * chunks model chunks in model
                # order (`meshplan.estimate_plan(split=...)`)
                stage_layers = split
            elif len(set(split)) > 1:
                r.note(
                    f"{chunks} stages per rank split {split}: {name} is priced with {runs} "
                    "per rank and meshplan's split"
                )
        elif schedule == Schedule.INTERLEAVED_1F1B:
            virtual = 2
        if schedule == Schedule.ZERO_BUBBLE:
            virtual = None
    # batches: local_batch_size per DP rank per accumulation step (split into PP micro-batches)
    local = r.positive("training.local_batch_size", train.get("local_batch_size", 8))
    micro = local
    if pp > 1:
        micro = r.positive(
            "parallelism.pipeline_parallel_microbatch_size",
            par.get("pipeline_parallel_microbatch_size", 1),
        )
        if local % micro:
            raise r.error(
                "parallelism.pipeline_parallel_microbatch_size",
                f"{micro} does not divide training.local_batch_size {local}",
            )
    gb = train.get("global_batch_size", -1)
    gb = None if gb == -1 else r.positive("training.global_batch_size", gb, (-1,))
    global_batch = _batches(r, dp, micro, gb, local)

    # recomputation
    selective = None
    if ac_mode in (None, "none"):
        recompute = Recompute.NONE
    elif ac_mode == "full":
        recompute = Recompute.FULL
    elif ac_mode == "selective":
        recompute = Recompute.SELECTIVE
        # torchtitan's two selective policies (`cost_model.recompute`): "op" saves every
        # other matmul of a layer; "2" checkpoints every second layer whole
        if ac_option in ("op", ""):
            selective = SelectivePolicy.TORCHTITAN_OP
        else:
            selective = SelectivePolicy.EVERY_OTHER_LAYER
            if ac_option != "2":
                r.note(
                    f"selective_ac_option {ac_option!r} (full checkpointing of every "
                    f"{ac_option}th layer): priced as every second layer checkpointed"
                )
    elif ac_mode == "memory-budget":
        recompute = Recompute.SELECTIVE
        r.note("memory-budget activation checkpointing: priced as selective")
    else:
        raise r.error(
            "activation_checkpoint.mode",
            f"unknown mode {ac_mode!r}; torchtitan's are none, selective, full",
        )

    # engine
    compiled = bool(comp.get("enable", train.get("compile", False)))
    async_tp = bool(
        comp.get("enable_async_tensor_parallel", par.get("enable_async_tensor_parallel", False))
    )
    float8 = None
    if f8.get("enabled"):
        recipe = f8.get("recipe_name") or "tensorwise"
        if recipe == "tensorwise":
            float8 = "tensorwise"
        else:
            r.note(f"float8 recipe {recipe}: priced in bf16 (its kernels are not modelled)")
    if f8.get("mx"):
        r.note("MXFP8 linears: priced in bf16 (their kernels are not modelled)")
    gather = bool(f8.get("enable_fsdp_float8_all_gather", False)) and float8 is not None
    if train.get("enable_cpu_offload"):
        r.note("CPU offload of FSDP states: priced without offload")
    if train.get("dtype") == "bfloat16" and "dtype" in train:
        r.note("pure bf16 training (no fp32 master weights): priced with mixed precision")
    # FSDP2's gradient reduction dtype; torchtitan's default is float32
    reduce = str(train.get("mixed_precision_reduce", "float32"))
    if reduce not in ("float32", "bfloat16"):
        raise r.error(
            "training.mixed_precision_reduce", f"must be float32 or bfloat16, got {reduce!r}"
        )
    return _assembled(
        r, "torchtitan", "parallelism", spec, stage_layers,
        dict(fused=compiled, float8=float8, float8_all_gather=gather, tp_overlap=async_tp,
             reduce_fp32=reduce == "float32", selective=selective),
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=micro, global_batch=global_batch,
        recompute=recompute, zero=zero, schedule=schedule or Schedule.ONE_F_ONE_B,
        sequence_parallel=sp, virtual_stages=virtual,
    )  # fmt: skip


def _assembled(
    r, framework: str, field: str, spec, stage_layers, engine: dict | None, **parallel
) -> FrameworkConfig:
    """The `FrameworkConfig` of a read file: `Engine(**engine)` (None: eager) and
    `Parallel(**parallel)`; a value either refuses is one error naming `field` of the file."""
    if (parallel.get("cp") or 1) > 1 and parallel.get("cp_mode") is None:
        # torchtitan's CP all-gathers K/V (context_parallel_rotate_method's default,
        # "allgather"); DeepSpeed has none of its own: the mode meshplan prices by default
        parallel["cp_mode"] = "allgather"
    try:
        built = Engine(**engine) if engine is not None else EAGER
        par = Parallel(**parallel)
    except (ValueError, EngineError) as e:
        raise r.error(field, str(e)) from None
    return FrameworkConfig(
        framework, r.path, par, built, spec, stage_layers, r.notes(), tuple(r.unknown)
    )


def _layers_of(spec: ModelSpec | None) -> int:
    if spec is None:
        return 0
    if spec.config is not None:
        return spec.config.layers
    return PRESETS[spec.name.lower()][0].layers if spec.name.lower() in PRESETS else 0


def _load_torchtitan_toml(
    path: str, text: str, world_size: int | None, model: str | None
) -> FrameworkConfig:
    r = _Reader(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e}); fix the file") from None
    for name, value in data.items():
        if not isinstance(value, dict):
            raise r.error(name, "a torchtitan job file has only [sections] at the top level")
    m = data.get("model", {})
    model_name = (str(m.get("name", "llama3")), str(m.get("flavor", "debugmodel")))
    converters = [str(c) for c in m.get("converters", [])]
    f8 = dict(data.get("float8", {}))
    qf8 = data.get("quantize", {}).get("linear", {}).get("float8")
    if qf8 is not None:  # torchtitan 0.2: [quantize.linear.float8]
        f8.update(qf8)
    if any(c in ("float8", "quantize.linear.float8") for c in converters):
        f8["enabled"] = True
    if any("mx" in c for c in converters):
        f8["mx"] = True
    ac = data.get("activation_checkpoint", {})
    r.sort_options("torchtitan", data.items())
    sections = {
        "parallelism": data.get("parallelism", {}),
        "training": data.get("training", {}),
        "compile": data.get("compile", {}),
        "float8": f8,
    }
    return _read_torchtitan(
        r,
        sections,
        model_name,
        world_size,
        str(ac.get("mode", "selective")).replace("_", "-"),  # 0.2 spells it memory_budget
        str(ac.get("selective_ac_option", "2")),
        model,
    )


def _cli_tokens(r: _Reader, text: str) -> list[str]:
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    body = " ".join(ln.rstrip("\\") for ln in lines)
    try:
        return shlex.split(body)
    except ValueError as e:
        raise ConfigError(
            f"{r.path}: cannot split the command line ({e}); fix its quoting"
        ) from None


def _program_args(tokens: list[str]) -> list[str]:
    """The program's own arguments: what follows the program (`pretrain_gpt.py`, or the module
    after `-m`) when the file holds the launcher's command line too (`torchrun
    --nproc_per_node 8 pretrain_gpt.py ...`, whose options are not the program's); all of
    it when the file holds the arguments alone."""
    for i, t in enumerate(tokens):
        if t.endswith(".py") or (i and tokens[i - 1] == "-m"):
            return tokens[i + 1 :]
    return tokens


# Command-line options that take several values (Megatron-LM's argparse nargs="+").
_LIST_OPTIONS = frozenset({"hierarchical-context-parallel-sizes"})


def _cli_options(r: _Reader, tokens: list[str]) -> tuple[dict[str, object], list[str]]:
    """`--name value`, `--name=value` and bare `--flag` (True) / `--no-flag` options; the rest
    (a program, `torchrun` options before it, tyro subcommands) returned as positional."""
    opts: dict[str, object] = {}
    rest: list[str] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("--") and len(t) > 2:
            name, eq, value = t[2:].partition("=")
            if eq:
                opts[name] = value
            elif name in _LIST_OPTIONS:  # every value up to the next option
                values = []
                while i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                    values.append(tokens[i + 1])
                    i += 1
                opts[name] = values
            elif (
                i + 1 < len(tokens)
                and not tokens[i + 1].startswith("--")
                and ":" not in tokens[i + 1]
            ):
                opts[name] = tokens[i + 1]
                i += 1
            else:
                opts[name] = True
        else:
            rest.append(t)
        i += 1
    return opts, rest


def _cli_value(r: _Reader, field: str, raw: object) -> object:
    """A command-line value as TOML would type it: int, bool, or the string."""
    if isinstance(raw, bool):
        return raw
    s = str(raw)
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    try:
        return int(s)
    except ValueError:
        return s


def _load_torchtitan_cli(
    path: str, text: str, world_size: int | None, model: str | None
) -> FrameworkConfig:
    """torchtitan 0.3: `--module llama3 --config llama3_8b` + overrides (tyro accepts
    `--section.field value` and `--section.field=value`; booleans as bare flags and
    `--section.no-field`; the activation-checkpoint policy as subcommand
    `activation_checkpoint:full|selective|memory-budget|none`)."""
    r = _Reader(path)
    opts, rest = _cli_options(r, _program_args(_cli_tokens(r, text)))
    module, fn = opts.pop("module", None), opts.pop("config", None)
    if not isinstance(module, str) or not isinstance(fn, str):
        raise r.error(
            "--module/--config",
            "a torchtitan 0.3 command line names both, e.g. --module llama3 --config llama3_8b",
        )
    if fn not in TORCHTITAN_CONFIGS:
        raise r.error(
            "--config",
            f"{fn!r} is not a torchtitan config meshplan knows ({', '.join(TORCHTITAN_CONFIGS)}); "
            "save the run as a job TOML (torchtitan:job.toml) or give every override",
        )
    base = dict(TORCHTITAN_CONFIGS[fn])
    model_name = base.pop("model")
    if module != model_name[0]:  # type: ignore[index]
        raise r.error("--module", f"{module!r} but config {fn} is a {model_name[0]} config")  # type: ignore[index]
    ac_mode = str(base.pop("activation_checkpoint", "selective"))
    float8 = bool(base.pop("float8", False))
    for t in rest:
        key = t.replace("-", "_")
        if key.startswith("activation_checkpoint:"):
            ac_mode = t.split(":", 1)[1].replace("_", "-")
    sections: dict[str, dict] = {"parallelism": {}, "training": {}, "compile": {}, "float8": {}}
    for key, value in base.items():
        sec, _, field = key.partition(".")
        sections[sec][field] = value
    given: list[tuple[str, object]] = []  # the file's overrides, for `sort_options`
    for name, raw in opts.items():
        key = name.replace("-", "_")
        sec, dot, field = key.partition(".")
        if not dot:
            given.append((key, raw))  # Trainer.Config's own fields (--dump_folder ...)
            continue
        negated = field.startswith("no_")
        if negated:
            field = field[3:]
        value = _cli_value(r, f"--{name}", raw)
        if negated:
            value = not value if isinstance(value, bool) else False
        given.append((f"{sec}.{field}", value))
        if sec in ("parallelism", "training", "compile"):
            sections[sec][field] = value
        elif sec == "activation_checkpoint" and field == "mode":
            ac_mode = str(value)
    r.sort_options("torchtitan-cli", given)
    sections["float8"] = {"enabled": float8}
    return _read_torchtitan(
        r,
        sections,
        model_name,
        world_size,
        ac_mode,
        "op",
        model,  # type: ignore[arg-type]
    )


# -- Megatron-LM ---------------------------------------------------------------------------------

# Flags that switch off one of Megatron's fused elementwise kernels (Megatron-LM arguments.py);
# with none of them the step runs fused, which the `fused` engine prices.
# `--no-gradient-accumulation-fusion` is not among them: it fuses the fp32 main-grad add into
# the weight-gradient GEMM, which meshplan does not price apart, and Megatron-FSDP requires it
# (Megatron-LM core_v0.16.1 docs/discussions/megatron-fsdp-user-guide, "Required Configurations").
_MEGATRON_NO_FUSION = (
    "no-masked-softmax-fusion",
    "no-bias-gelu-fusion",
    "no-bias-swiglu-fusion",
    "no-bias-dropout-fusion",
)
# Data-parallel sharding: Megatron-LM core_v0.16.1 arguments.py `--data-parallel-sharding-strategy`
# choices (default no_shard) and megatron-core 0.16.1 DistributedDataParallelConfig: optim is
# ZeRO-1, optim_grads ZeRO-2, optim_grads_params ZeRO-3 (Megatron-LM
# docs/user-guide/parallelism-guide.md, "Sharding strategies").
_MEGATRON_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
_ZERO_TO_MEGATRON_SHARDING = {v: k for k, v in _MEGATRON_SHARDING.items()}
# What Megatron-FSDP needs besides the strategy (the same user guide's required flags).
_MEGATRON_FSDP_FLAGS = (
    "--use-megatron-fsdp",
    "--no-gradient-accumulation-fusion",
    "--use-distributed-optimizer",
    "--ckpt-format fsdp_dtensor",
)


def _load_megatron(
    path: str, text: str, world_size: int | None, model: str | None
) -> FrameworkConfig:
    r = _Reader(path)
    opts, _ = _cli_options(r, _program_args(_cli_tokens(r, text)))
    if not opts:  # a wrong file, not a run with every default: Megatron needs its sizes
        raise ConfigError(
            f"{path}: no Megatron-LM arguments (--name value) found; give the arguments of "
            "pretrain_gpt.py (or its command line), e.g. --tensor-model-parallel-size 8"
        )
    r.sort_options("megatron", opts.items())

    def num(name: str, default: int | None = None) -> int | None:
        if name not in opts:
            return default
        raw = opts[name]
        try:
            value = int(str(raw))
        except ValueError:
            raise r.error(f"--{name}", f"must be an integer, got {raw!r}") from None
        return r.positive(f"--{name}", value)

    tp = num("tensor-model-parallel-size", 1)
    pp = num("pipeline-model-parallel-size", 1)
    cp = num("context-parallel-size", 1)
    ep = num("expert-model-parallel-size", 1)
    assert tp and pp and cp and ep
    dp = _world_dp(r, world_size, tp * pp * cp, "--tensor/pipeline/context-parallel-size")
    micro = num("micro-batch-size", 1)
    global_batch = num("global-batch-size")
    if global_batch is None and dp is not None:
        global_batch = micro * dp  # type: ignore[operator]
    zero = 1 if opts.get("use-distributed-optimizer") else 0
    if opts.get("use-torch-fsdp2"):
        # torch FSDP2 shards everything; `--torch-fsdp2-no-reshard-after-forward` keeps the
        # gathered parameters from forward to backward (ZeRO-2)
        zero = 2 if opts.get("torch-fsdp2-no-reshard-after-forward") else 3
    elif opts.get("use-megatron-fsdp"):
        strategy = opts.get("data-parallel-sharding-strategy", "no_shard")
        if strategy not in _MEGATRON_SHARDING:
            raise r.error(
                "--data-parallel-sharding-strategy",
                f"must be one of {', '.join(_MEGATRON_SHARDING)}, got {strategy!r}",
            )
        zero = max(zero, _MEGATRON_SHARDING[strategy])  # type: ignore[index]
    sp = bool(opts.get("sequence-parallel")) and tp > 1

    # model shape (when the file states it; --model wins)
    spec = _megatron_model(r, opts, num, model)
    layers = _layers_of(spec)

    # pipeline
    schedule, virtual, stage_layers = None, None, ()
    if pp > 1:
        schedule = Schedule.ONE_F_ONE_B
        per_virtual = num("num-layers-per-virtual-pipeline-stage")
        v = num("num-virtual-stages-per-pipeline-rank") or num(
            "virtual-pipeline-model-parallel-size"
        )
        first, last = (
            num("decoder-first-pipeline-num-layers"),
            num("decoder-last-pipeline-num-layers"),
        )
        emb = bool(opts.get("account-for-embedding-in-pipeline-split"))
        loss = bool(opts.get("account-for-loss-in-pipeline-split"))
        if per_virtual is not None:
            if first is not None or last is not None:
                raise r.error(
                    "--num-layers-per-virtual-pipeline-stage",
                    "Megatron-LM refuses it with uneven first/last stages; use "
                    "--num-virtual-stages-per-pipeline-rank",
                )
            if not layers:
                raise r.error(
                    "--num-layers-per-virtual-pipeline-stage",
                    "needs the layer count: add --num-layers or give --model",
                )
            # Megatron-LM arguments.py: the embedding and the loss count as a layer each here
            counted = layers + emb + loss
            if counted % (pp * per_virtual):
                raise r.error(
                    "--num-layers-per-virtual-pipeline-stage",
                    f"{per_virtual} does not divide {counted} layers over pp={pp}",
                )
            v = counted // (pp * per_virtual)
        if v is not None and v > 1:
            schedule, virtual = Schedule.INTERLEAVED_1F1B, v
        if first is not None or last is not None or emb or loss:
            # layers per stage, or with virtual stages per model chunk (pp * v, model order):
            # priced as read (`meshplan.estimate_plan(split=...)`)
            chunks = megatron_chunk_layers(layers, pp, virtual or 1, first, last, emb, loss, r)
            stage_layers = chunks if len(set(chunks)) > 1 else ()
    # recomputation: granularity selective (core attention, Korthikanti et al.) or full
    # (method uniform/block over recompute-num-layers layers)
    recompute = Recompute.NONE
    if opts.get("recompute-activations"):
        recompute = Recompute.SELECTIVE
    gran = opts.get("recompute-granularity")
    if gran is not None:
        if gran == "selective":
            recompute = Recompute.SELECTIVE
            modules = opts.get("recompute-modules")
            if isinstance(modules, str) and modules != "core_attn":
                r.note(f"--recompute-modules {modules}: priced as core-attention recompute")
        elif gran == "full":
            recompute = Recompute.FULL
            method = opts.get("recompute-method", "uniform")
            n = num("recompute-num-layers", 1)
            if method == "block" or n != 1:
                r.note(
                    f"--recompute-method {method} --recompute-num-layers {n}: priced as full "
                    "recomputation of every layer"
                )
        else:
            raise r.error("--recompute-granularity", f"must be full or selective, got {gran!r}")

    # engine
    fused = not any(opts.get(f) for f in _MEGATRON_NO_FUSION)
    float8 = None
    if opts.get("fp8-format"):
        recipe = opts.get("fp8-recipe", "delayed")
        if recipe in ("delayed", "tensorwise"):
            float8 = "tensorwise"
            if recipe == "delayed":
                r.note("FP8 delayed scaling: priced as tensorwise (the same per-tensor GEMMs)")
        else:
            r.note(f"FP8 recipe {recipe}: priced in bf16 (its kernels are not modelled)")
    gather = bool(opts.get("fp8-param-gather")) and float8 is not None and zero >= 1
    # Gradients are accumulated and reduced in fp32 unless fp16 (or --grad-reduce-in-bf16):
    # Megatron-LM's arguments.py sets accumulate_allreduce_grads_in_fp32 under --bf16, and an
    # fp32 run's gradients are fp32.
    reduce_fp32 = bool(opts.get("accumulate-allreduce-grads-in-fp32")) or not (
        opts.get("fp16") or opts.get("grad-reduce-in-bf16")
    )
    # Gradients are reduced under the backward only with --overlap-grad-reduce (Megatron-LM's
    # default is off: finalize_model_grads reduces them after it); ZeRO-3 gathers and reduces
    # around every micro-batch either way.
    dp_overlap = bool(opts.get("overlap-grad-reduce")) or zero == 3
    return _assembled(
        r, "megatron", "arguments", spec, stage_layers,
        dict(fused=fused, float8=float8, float8_all_gather=gather,
             tp_overlap=bool(opts.get("tp-comm-overlap")), reduce_fp32=reduce_fp32,
             dp_overlap=dp_overlap),
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=micro, global_batch=global_batch,
        recompute=recompute, zero=zero, schedule=schedule or Schedule.ONE_F_ONE_B,
        sequence_parallel=sp, virtual_stages=virtual,
        **_megatron_cp(r, opts, cp),
    )  # fmt: skip


# Megatron-LM's --cp-comm-type (default p2p) as meshplan's CP attention modes
# (`ir.parallel.CP_MODES`): p2p is ring attention, a2a DeepSpeed-Ulysses head-parallel
# attention, a2a+p2p the two-level split ("usp": a2a inside the first level of
# --hierarchical-context-parallel-sizes, p2p across the second; its ring priced as an
# all-gather, as p2p's is; configs_options).
_MEGATRON_CP_MODES = {"p2p": "ring", "all_gather": "allgather", "a2a": "heads", "a2a+p2p": "usp"}
_CP_MODE_TO_MEGATRON = {"ring": "p2p", "allgather": "all_gather", "heads": "a2a", "usp": "a2a+p2p"}


def _megatron_cp(r: _Reader, opts: dict[str, object], cp: int) -> dict[str, object]:
    """`cp_mode` (and under a2a+p2p `cp_head_degree`) from Megatron-LM's --cp-comm-type and
    --hierarchical-context-parallel-sizes (Megatron-LM arguments.py: "every two adjacent gpus
    forms the first level of cp groups" for sizes 2 4, the a2a level; its product is cp)."""
    if cp <= 1:
        return {"cp_mode": None}
    kind = str(opts.get("cp-comm-type", "p2p"))
    mode = _MEGATRON_CP_MODES.get(kind)
    if mode != "usp":
        return {"cp_mode": mode}
    raw = opts.get("hierarchical-context-parallel-sizes")
    sizes = raw if isinstance(raw, list) else str(raw or "").split()
    try:
        levels = [int(x) for x in sizes]
    except ValueError:
        levels = []
    if len(levels) != 2 or levels[0] * levels[1] != cp:
        raise r.error(
            "hierarchical-context-parallel-sizes",
            "--cp-comm-type a2a+p2p needs two levels A P with A x P = --context-parallel-size "
            f"({cp}), got {' '.join(map(str, sizes)) or 'none'}",
        )
    return {"cp_mode": "usp", "cp_head_degree": levels[0]}


def megatron_chunk_layers(
    layers: int,
    pp: int,
    v: int,
    first: int | None = None,
    last: int | None = None,
    emb: bool = False,
    loss: bool = False,
    r: _Reader | None = None,
) -> tuple[int, ...]:
    """Layers of each of the pp * v model chunks in model order (chunk k on rank k % pp), as
    Megatron builds them (megatron-core 0.16.1 `transformer_block.get_num_layers_to_build`,
    `transformer_layer.get_transformer_layer_offset`): with `--decoder-first/last-pipeline-
    num-layers` the named ranks hold those layers and the others share the rest evenly, each
    rank's layers split evenly over its v chunks; with `--account-for-embedding/loss-in-
    pipeline-split` the embedding and the loss count as a layer each, so the first and the
    last chunk hold one layer fewer (the layout `partition.chunk_layers` prices). Raises
    ConfigError where Megatron refuses the split."""
    r = r or _Reader("megatron")
    field = "--decoder-first-pipeline-num-layers"
    if not layers:
        raise r.error(
            field, "an uneven split needs the layer count: add --num-layers or give --model"
        )
    if (first is not None or last is not None) and (emb or loss):
        raise r.error(
            field,
            "megatron-core refuses uneven first/last stages with "
            "--account-for-embedding/loss-in-pipeline-split; use one or the other",
        )
    if first is not None or last is not None:
        rest = layers - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        if rest < 0 or (middle and (rest < middle or rest % middle)) or (not middle and rest):
            raise r.error(
                field,
                f"first {first} and last {last} leave {rest} layers that the other {middle} "
                f"stages of pp={pp} cannot share evenly; change first/last",
            )
        m = rest // middle if middle else 0
        ranks = [m] * pp
        if first is not None:
            ranks[0] = first
        if last is not None:
            ranks[-1] = last
        if any(n % v for n in ranks):
            raise r.error(
                field,
                f"the stages' layers {tuple(ranks)} must each divide by the {v} virtual stages",
            )
        return tuple(ranks[k % pp] // v for k in range(pp * v))
    counted = layers + emb + loss
    if counted % (pp * v):
        raise r.error(
            "--account-for-embedding/loss-in-pipeline-split",
            f"{layers} layers + {emb + loss} do not divide into {pp * v} chunks (pp={pp} x {v})",
        )
    c = counted // (pp * v)
    chunks = [c] * (pp * v)
    chunks[0] -= emb
    chunks[-1] -= loss
    return tuple(chunks)


def _megatron_model(r: _Reader, opts: dict, num, model: str | None) -> ModelSpec | None:
    """The model shape the arguments state, as a meshplan preset when it is one."""
    seq = num("seq-length")
    if model is not None:
        return ModelSpec(model, seq_len=seq)
    if "num-layers" not in opts:
        return None
    for need in ("hidden-size", "num-attention-heads"):
        if need not in opts:
            raise r.error(f"--{need}", "missing: the model shape needs it (or give --model)")
    hidden, heads = num("hidden-size"), num("num-attention-heads")
    swiglu = bool(opts.get("swiglu"))
    ffn = num("ffn-hidden-size") or (int(8 * hidden / 3) if swiglu else 4 * hidden)  # type: ignore[operator]
    kv = num("num-query-groups") if opts.get("group-query-attention") else None
    vocab = num("vocab-size") or num("padded-vocab-size")
    if vocab is None:
        if opts.get("tokenizer-type") == "GPT2BPETokenizer":
            vocab = 50257  # the GPT-2 BPE vocabulary Megatron's GPT examples use
        else:
            raise r.error(
                "--vocab-size",
                "missing: Megatron reads it from the tokenizer; add --vocab-size N or give --model",
            )
    style = "llama" if swiglu else "gpt"
    rms = opts.get("normalization") == "RMSNorm"
    rope = opts.get("position-embedding-type") == "rope" or bool(
        opts.get("use-rotary-position-embeddings")  # the older spelling of the same
    )
    if (style == "llama") != rms or (style == "llama") != rope:
        r.note(
            f"{'SwiGLU' if swiglu else 'GeLU'} MLP with "
            f"{'RMSNorm' if rms else 'LayerNorm'} and {'RoPE' if rope else 'learned positions'}: "
            f"priced as a {'Llama' if swiglu else 'GPT'}-style block"
        )
    # meshplan's GPT-style block has biases, its Llama-style block none
    if style == "gpt" and opts.get("disable-bias-linear"):
        r.note("--disable-bias-linear: priced with the GPT-style block's biases")
    if style == "llama" and opts.get("add-qkv-bias"):
        r.note("--add-qkv-bias: priced without biases (Llama-style block)")
    head_dim = num("kv-channels")
    if head_dim is not None and head_dim * heads != hidden:  # type: ignore[operator]
        r.note(f"--kv-channels {head_dim}: priced with head dimension hidden / heads")
    experts = num("num-experts") or 0
    try:
        cfg = TransformerConfig(
            layers=num("num-layers"),
            hidden=hidden,
            heads=heads,
            vocab=vocab,
            ffn=ffn,  # type: ignore[arg-type]
            kv_heads=kv,
            seq_len=seq or 2048,
            experts=experts,
            top_k=(num("moe-router-topk", 2) if experts else 0),  # type: ignore[arg-type]
            style=style,
            tie_embeddings=not opts.get("untie-embeddings-and-output-weights"),
        )
    except ValueError as e:
        raise r.error("--num-layers/--hidden-size/...", str(e)) from None
    for name, (preset, _) in PRESETS.items():
        if dataclasses.replace(preset, seq_len=cfg.seq_len, rope_theta=cfg.rope_theta) == cfg:
            return ModelSpec(name, seq_len=cfg.seq_len)
    return ModelSpec(f"megatron:{Path(r.path).name}", config=cfg, seq_len=cfg.seq_len)


# -- DeepSpeed -----------------------------------------------------------------------------------

# The keys `_load_deepspeed` reads are deepspeed 0.19.8's (runtime/config.py); what each of
# the others does to the price is in `configs_options.DEEPSPEED`.


# ZeRO keys deepspeed 0.19.8 refuses (runtime/config.py `_REMOVED_ZERO_CONFIG_KEYS`).
DEEPSPEED_REMOVED = {
    "mics_shard_size": "MiCS ZeRO-3 sharding",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding",
    "zeropp_loco_param": "LoCo-ZeRO++",
}


def _load_deepspeed(
    path: str, text: str, world_size: int | None, model: str | None
) -> FrameworkConfig:
    r = _Reader(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{path}: not valid JSON (line {e.lineno}: {e.msg}); fix the file"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object")

    def get(key: str, default=None):
        v = data.get(key, default)
        return None if v == "auto" else v

    tp_cfg = data.get("tensor_parallel", {}) or {}
    tp = r.positive("tensor_parallel.autotp_size", tp_cfg.get("autotp_size") or 1)
    pipe = data.get("pipeline", {}) or {}
    stages = pipe.get("stages", "auto")
    pp = 1 if stages == "auto" else r.positive("pipeline.stages", stages)
    sp = get("sequence_parallel_size")
    cp = 1 if sp is None else r.positive("sequence_parallel_size", sp)
    if cp > 1:
        r.note(
            "Ulysses sequence parallelism: priced as head-parallel context parallelism "
            "(cp_mode heads)"
        )
    dp = _world_dp(r, world_size, tp * pp * cp, "tensor_parallel/pipeline/sequence_parallel_size")
    micro, gas, tbs = (
        get("train_micro_batch_size_per_gpu"),
        get("gradient_accumulation_steps"),
        get("train_batch_size"),
    )
    for key, v in (
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", gas),
        ("train_batch_size", tbs),
    ):
        if v is not None:
            r.positive(key, v)
    # deepspeed 0.19.8 DeepSpeedConfig._configure_train_batch_size: any two give the third.
    if micro is None and gas is None and tbs is None:
        raise r.error(
            "train_batch_size",
            "none of train_batch_size, train_micro_batch_size_per_gpu, "
            "gradient_accumulation_steps is set; set two of them",
        )
    if dp is not None:
        if micro is None:
            gas = gas or 1
            if tbs is None or tbs % (gas * dp):
                raise r.error(
                    "train_micro_batch_size_per_gpu",
                    f"not set and train_batch_size {tbs} is "
                    f"not divisible by gradient_accumulation_steps {gas} x dp {dp}; set it",
                )
            micro = tbs // (gas * dp)
        if tbs is None:
            tbs = micro * (gas or 1) * dp
        elif gas is not None and tbs != micro * gas * dp:
            raise r.error(
                "train_batch_size",
                f"{tbs} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                f"{gas} x dp {dp} (DeepSpeed refuses it); fix one of them or --gpus",
            )
    elif micro is None:
        raise r.error("train_micro_batch_size_per_gpu", "not set; set it (or give the GPU count)")
    zero_cfg = data.get("zero_optimization", {}) or {}
    for key, what in DEEPSPEED_REMOVED.items():
        if key in zero_cfg:
            raise r.error(
                f"zero_optimization.{key}",
                f"{what} was removed in DeepSpeed 0.19, which refuses this key; remove it",
            )
    zero = zero_cfg.get("stage", 0)
    if zero not in (0, 1, 2, 3):
        raise r.error("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {zero!r}")
    for key, why in (
        ("offload_optimizer", "optimizer offload"),
        ("offload_param", "parameter offload"),
    ):
        device = (zero_cfg.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            r.note(f"ZeRO {why} to {device}: priced with the states on the GPU")
    for key, why in (
        ("zero_quantized_weights", "ZeRO++ quantized weights"),
        ("zero_quantized_gradients", "ZeRO++ quantized gradients"),
        ("zero_hpz_partition_size", "ZeRO++ hierarchical partitioning"),
    ):
        if zero_cfg.get(key) not in (None, False, 0, 1) or zero_cfg.get(key) is True:
            r.note(f"{why}: priced without it")
    if (data.get("fp16", {}) or {}).get("enabled"):
        r.note("fp16 with loss scaling: priced as bf16")
    if data.get("activation_checkpointing"):
        recompute = Recompute.FULL
        r.note("activation checkpointing as the model code calls it: priced as full, every layer")
        if data["activation_checkpointing"].get("cpu_checkpointing"):
            r.note("checkpoints offloaded to the CPU: priced on the GPU")
    else:
        recompute = Recompute.NONE
    if data.get("compression_training"):
        r.note("compression_training: priced without it")
    opt = (data.get("optimizer", {}) or {}).get("type")
    if opt and str(opt).lower() not in ("adam", "adamw", "fusedadam"):
        r.note(f"optimizer {opt}: priced as Adam (two fp32 states)")
    # When the gradients are reduced: under ZeRO-1/2 with `overlap_comm` during the backward
    # (its default is stage == 3: deepspeed/runtime/zero/config.py `overlap_comm_valid`);
    # otherwise, and always in the pipeline engine (its TrainSchedule runs ReduceGrads after
    # the last BackwardPass: deepspeed/runtime/pipe/schedule.py), after it, exposed.
    overlap = zero_cfg.get("overlap_comm")
    overlap = zero == 3 if overlap is None else bool(overlap)
    engine = {"dp_overlap": False} if zero != 3 and (pp > 1 or not overlap) else None
    r.sort_options("deepspeed", data.items())
    spec = ModelSpec(model) if model is not None else None
    return _assembled(
        r, "deepspeed", "config", spec, (), engine,
        dp=dp, tp=tp, pp=pp, cp=cp, ep=1, micro_batch=micro, global_batch=tbs,
        recompute=recompute, zero=zero, schedule=Schedule.ONE_F_ONE_B, sequence_parallel=False,
        cp_mode="heads" if cp > 1 else None,  # DeepSpeed-Ulysses' all-to-alls over the heads
    )  # fmt: skip


# -- load ----------------------------------------------------------------------------------------


def parse_spec(spec: str) -> tuple[str, str]:
    """`framework:path` -> (framework, path); one-line ConfigError naming the framework."""
    framework, sep, path = spec.partition(":")
    if not sep or framework not in FRAMEWORKS:
        raise ConfigError(
            f"{spec!r}: write FRAMEWORK:FILE with FRAMEWORK one of {', '.join(FRAMEWORKS)} "
            "(e.g. torchtitan:job.toml, megatron:args.txt, deepspeed:ds_config.json)"
        )
    if not path:
        raise ConfigError(f"{spec!r}: no file after '{framework}:'")
    return framework, path


def load(
    spec: str | Path,
    *,
    framework: str | None = None,
    world_size: int | None = None,
    model: str | None = None,
) -> FrameworkConfig:
    """Read a framework configuration: `spec` is `framework:path`, or a path with
    `framework=`. `world_size` (the cluster's GPUs) fills the data-parallel degree and the
    global batch where the file leaves them to the launcher; `model` (a preset or
    path/to/file.py:factory) replaces the model the file names or states (DeepSpeed configs
    name none). torchtitan files ending in .toml are job TOMLs, any other a saved 0.3
    command line."""
    if framework is None:
        framework, path = parse_spec(str(spec))
    else:
        if framework not in FRAMEWORKS:
            raise ConfigError(
                f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}"
            )
        path = str(spec)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if framework == "torchtitan":
        reader = _load_torchtitan_toml if path.endswith(".toml") else _load_torchtitan_cli
    else:
        reader = _load_megatron if framework == "megatron" else _load_deepspeed
    return reader(path, text, world_size, model)


# -- price a configuration, compare it with a plan -------------------------------------------


def trace_model(cfg: FrameworkConfig, progress=None) -> Graph:
    """The operator IR of the configuration's model (one-line ConfigError when it has none)."""
    from .api import trace

    if cfg.model is None:
        raise ConfigError(
            f"{cfg.source}: field model: a {cfg.framework} config does not name the model; "
            "give --model NAME or path/to/file.py:factory"
        )
    if cfg.model.config is None:
        from .api import load_model

        m, inputs = load_model(cfg.model.name, seq_len=cfg.model.seq_len)
    else:
        m, inputs = cfg.model.build()
    return trace(m, *inputs, name=cfg.model.name, progress=progress)


def with_stage_layers(
    plan: Plan, graph: Graph, stage_layers: tuple[int, ...], engine: Engine = EAGER
) -> Plan:
    """`plan` with the pipeline split into `stage_layers` layers per stage, or under a
    schedule with several chunks per rank per model chunk (pp * chunks of them, model order;
    the stages then list those chunks), re-placed and re-priced."""
    from .api import check_config, default_stages, with_chunks

    p = plan.parallel
    check_config(graph, plan.cluster, p, split=stage_layers)
    stages = place_stages(plan.cluster, p, default_stages(graph, p, stage_layers))
    stages = with_chunks(graph, p, stages, stage_layers)
    return dataclasses.replace(
        plan,
        stages=stages,
        ranks=assign_ranks(plan.cluster, p, stages),
        predicted=predict(graph, plan.cluster, p, stages, engine=engine),
    )


def estimate(cfg: FrameworkConfig, cluster: Cluster, graph: Graph | None = None) -> Plan:
    """The configuration priced on `cluster` as the framework runs it (its engine options and
    stage split, model chunks included), through `meshplan.estimate_plan`."""
    from .api import estimate_plan

    graph = graph if graph is not None else trace_model(cfg)
    try:
        return estimate_plan(
            graph,
            cluster=cluster,
            parallel=cfg.parallel,
            engine=cfg.engine,
            split=cfg.stage_layers,
        )
    except ValueError as e:
        raise ConfigError(f"{cfg.source}: {e}") from None


def stage_layer_counts(plan: Plan) -> tuple[int, ...]:
    """Layers each pipeline stage holds (units named `<...>` are the prologue, epilogue and
    other non-layer code)."""
    units = plan.model.units
    return tuple(
        sum(1 for u in units[s.first_unit : s.last_unit] if not u.startswith("<"))
        for s in plan.stages
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """The user's configuration against meshplan's plan, both priced the same way."""

    baseline: Plan
    ours: Plan
    engine: Engine
    rows: tuple[tuple[str, str, str, str], ...]  # (metric, baseline, meshplan, ratio)
    reasons: tuple[str, ...]

    @property
    def speedup(self) -> float:
        """Baseline step time over meshplan's."""
        return self.baseline.predicted.step_time_s / (self.ours.predicted.step_time_s or 1.0)


_COMPARED = (
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
    "micro_batch",
    "zero",
    "recompute",
    "schedule",
    "virtual_stages",
    "sequence_parallel",
)


def compare(baseline: Plan, ours: Plan, engine: Engine = EAGER) -> Comparison:
    """Side by side: step time, tokens/s, MFU, memory per rank, with the ratio (meshplan
    over baseline), and the main reasons: which dimensions changed and which parts of the
    step time moved most."""
    b, o = baseline.predicted, ours.predicted
    gib = 2**30

    def ratio(x: float, y: float) -> str:
        return f"{y / x:.2f}x" if x else "-"

    rows = (
        (
            "step time (s)",
            f"{b.step_time_s:.3f}",
            f"{o.step_time_s:.3f}",
            ratio(b.step_time_s, o.step_time_s),
        ),
        (
            "tokens/s",
            f"{b.tokens_per_s:,.0f}",
            f"{o.tokens_per_s:,.0f}",
            ratio(b.tokens_per_s, o.tokens_per_s),
        ),
        ("MFU", f"{b.mfu * 100:.1f}%", f"{o.mfu * 100:.1f}%", ratio(b.mfu, o.mfu)),
        (
            "peak memory / rank (GiB)",
            f"{b.peak_memory_bytes / gib:.1f}",
            f"{o.peak_memory_bytes / gib:.1f}",
            ratio(b.peak_memory_bytes, o.peak_memory_bytes),
        ),
        ("fits", "yes" if b.fits else "NO", "yes" if o.fits else "NO", ""),
    )
    reasons = []
    bp, op = baseline.parallel, ours.parallel
    changed = [
        f"{k.replace('_', '-')} {getattr(bp, k)} -> {getattr(op, k)}"
        for k in _COMPARED
        if getattr(bp, k) != getattr(op, k)
    ]
    if ours.stages and ours.stages[0].group_tp:
        changed.append(
            "tp per device group " + ", ".join(f"{g} {t}" for g, t in ours.stages[0].group_tp)
        )
    if stage_layer_counts(baseline) != stage_layer_counts(ours) and op.pp == bp.pp:
        changed.append(f"stage split {stage_layer_counts(baseline)} -> {stage_layer_counts(ours)}")
    if changed:
        reasons.append("changed: " + ", ".join(changed))
    else:
        reasons.append("same configuration")
    bb, ob = b.breakdown_dict(), o.breakdown_dict()
    moved = sorted(
        ((ob.get(k, 0.0) - bb.get(k, 0.0), k) for k in {*bb, *ob}), key=lambda t: -abs(t[0])
    )
    parts = [f"{k} {d:+.3f} s" for d, k in moved[:3] if abs(d) > 1e-4]
    if parts:
        reasons.append("step time moved most in: " + ", ".join(parts))
    if not b.fits and o.fits:
        reasons.append("the baseline does not fit in memory; the plan does")
    return Comparison(baseline, ours, engine, rows, tuple(reasons))


def reprice(plan: Plan, graph: Graph, engine: Engine) -> Plan:
    """`plan` priced as `engine` runs it (its stages and placement kept; collectives raw, as
    the frameworks run them)."""
    if engine == EAGER and not _compressed(plan):
        return plan
    pr = predict(graph, plan.cluster, plan.parallel, plan.stages, engine=engine)
    return dataclasses.replace(plan, predicted=pr)


def _compressed(plan: Plan) -> list[str]:
    return sorted(
        {f"{d.method} {d.collective}" for d in plan.compression.decisions if d.method != "raw"}
    )


# -- export --------------------------------------------------------------------------------------


class ExportError(ValueError):
    """A plan the framework cannot express (one line naming the feature)."""


@dataclass(frozen=True, slots=True)
class Export:
    """A written configuration: `text` in the framework's form, the `plan` it expresses (under
    `closest`, the nearest expressible plan, re-priced) and what `closest` changed."""

    fmt: str
    text: str
    plan: Plan
    changes: tuple[str, ...] = ()

    def write(self, path: str | Path) -> None:
        write_text_file(path, self.text)


@dataclass(frozen=True, slots=True)
class _Problem:
    """A feature `fmt` cannot express, and the nearest plan it can: `changes` to the
    Parallel, `split` the layers per stage to use instead (() = the framework's even split)."""

    feature: str
    changes: tuple[tuple[str, object], ...] = ()
    split: tuple[int, ...] | None = None


def _layers(plan: Plan) -> int:
    return sum(1 for u in plan.model.units if not u.startswith("<"))


def _virtual_split(plan: Plan) -> tuple[int, ...]:
    """Layers of each virtual stage in torchtitan's stage order (stage s on rank s % pp for
    looped schedules; ZB-V: rank r holds stages r and 2 pp - 1 - r)."""
    p, units = plan.parallel, plan.model.units

    def count(a: int, b: int) -> int:
        return sum(1 for u in units[a:b] if not u.startswith("<"))

    chunks = [s.chunks or ((s.first_unit, s.last_unit),) for s in plan.stages]
    pp, v = p.pp or 1, len(chunks[0])
    order = [0] * (pp * v)
    for r, ranks in enumerate(chunks):
        for c, (a, b) in enumerate(ranks):
            if p.schedule == Schedule.ZERO_BUBBLE:
                idx = r if c == 0 else 2 * pp - 1 - r
            else:
                idx = c * pp + r
            order[idx] = count(a, b)
    return tuple(order)


def titan_split_options(plan: Plan) -> tuple[int, int, int | None] | None:
    """(first_stage_less_layers, last_stage_less_layers, layers_per_stage or None) that make
    torchtitan split the layers as `plan` does (`titan_stage_split`, `_titan_stage_count`),
    or None when none does. Tries no weights first, then torchtitan's defaults (1, 1)."""
    p = plan.parallel
    target, layers, pp = _virtual_split(plan), _layers(plan), p.pp or 1
    n = len(target)
    default_stages = pp * (2 if p.chunks > 1 else 1)
    weights = [(0, 0), (1, 1)] + [
        (a, b)
        for a in range(layers + 1)
        for b in range(layers + 1)
        if (a, b) not in ((0, 0), (1, 1))
    ]
    for fl, ll in weights:
        try:
            if titan_stage_split(n, layers, fl, ll) != target:
                continue
        except ValueError:
            continue
        if n == default_stages:
            return fl, ll, None
        effective = layers + fl + ll
        for per in range(1, effective + 1):
            if math.ceil(effective / per) == n:
                return fl, ll, per
    return None


def _megatron_split_flags(counts: tuple[int, ...]) -> tuple[int | None, int | None] | None:
    """(first, last) layer counts that make Megatron split as `counts`, (None, None) for its
    even split, or None when the middle stages differ."""
    if len(set(counts)) == 1:
        return None, None
    if len(counts) == 2:
        return counts[0], counts[1]
    middle = counts[1:-1]
    if len(set(middle)) != 1:
        return None
    m = middle[0]
    return (counts[0] if counts[0] != m else None), (counts[-1] if counts[-1] != m else None)


def _problems(plan: Plan, fmt: str) -> list[_Problem]:
    """What `fmt` cannot express in `plan`, each with its nearest expressible change."""
    p, st = plan.parallel, plan.stages[0]
    out: list[_Problem] = []
    if st.group_tp:
        tps = ", ".join(f"{g} {t}" for g, t in st.group_tp)
        out.append(_Problem(f"per-group TP on mixed GPUs ({tps})", (("_placement", True),)))
    elif st.microbatches:
        shares = ", ".join(f"{g} {n}" for g, n in st.microbatches)
        out.append(
            _Problem(
                f"uneven DP shares ({shares} micro-batches per replica)", (("_placement", True),)
            )
        )
    if comp := _compressed(plan):
        out.append(_Problem(f"compressed collectives ({', '.join(comp)})", (("_placement", True),)))
    if p.quantize_activations:
        out.append(_Problem("quantized activations (AGoQ)", (("quantize_activations", None),)))
    if p.cp_shares or p.cp_head_shares:  # none gives cp ranks their own share of a sequence
        out.append(
            _Problem(
                "asymmetric cp shares (tokens / heads per cp rank, HexiSeq)",
                (("cp_shares", None), ("cp_head_shares", None)),
            )
        )
    if plan.hybrid_precision:  # none of the three runs one group's linears in another precision
        modes = ", ".join(f"{g} {m}" for g, m in plan.hybrid_precision)
        out.append(_Problem(f"per-group precision ({modes}); plan with --hybrid-precision off"))
    counts = stage_layer_counts(plan)
    even = len(set(counts)) == 1
    pp = p.pp or 1
    if fmt in ("torchtitan", "torchtitan-cli"):
        if plan.model.name.lower() not in _PRESET_TO_TITAN:
            known = ", ".join(_PRESET_TO_TITAN)
            out.append(_Problem(f"model {plan.model.name!r} (torchtitan runs {known})"))
        if p.zero == 1 and (p.dp or 1) > 1:
            out.append(_Problem("ZeRO-1 (torchtitan's FSDP2 shards gradients too)", (("zero", 2),)))
        if pp > 1 and titan_split_options(plan) is None:
            out.append(_Problem(f"pipeline split {_virtual_split(plan)}", split=()))
    elif fmt == "megatron":
        if pp > 1 and p.schedule in (Schedule.GPIPE, Schedule.ZERO_BUBBLE):
            out.append(
                _Problem(
                    f"pipeline schedule {p.schedule}",
                    (("schedule", Schedule.ONE_F_ONE_B), ("virtual_stages", None)),
                )
            )
        if p.chunks > 1 and len(set(_virtual_split(plan))) > 1 and not _embedding_and_loss(plan):
            out.append(_Problem(f"uneven virtual stages {_virtual_split(plan)}", split=()))
        if pp > 1 and p.chunks == 1 and not even and _megatron_split_flags(counts) is None:
            out.append(_Problem(f"pipeline split {counts}", split=_megatron_nearest(counts)))
    elif fmt == "deepspeed":
        if (p.cp or 1) > 1:
            out.append(
                _Problem(
                    f"context parallelism cp={p.cp}", (("cp", 1), ("dp", (p.dp or 1) * (p.cp or 1)))
                )
            )
        if (p.ep or 1) > 1:
            out.append(
                _Problem(
                    f"expert parallelism ep={p.ep} (set in DeepSpeed's MoE layer code)",
                    (("ep", 1),),
                )
            )
        if p.recompute == Recompute.SELECTIVE:
            out.append(_Problem("selective recomputation", (("recompute", Recompute.FULL),)))
        if (p.tp or 1) > 1 and p.sequence_parallel:
            out.append(
                _Problem(
                    "sequence parallelism with TP (AutoTP has none)",
                    (("sequence_parallel", False),),
                )
            )
        if pp > 1 and p.schedule != Schedule.ONE_F_ONE_B:
            out.append(
                _Problem(
                    f"pipeline schedule {p.schedule}",
                    (("schedule", Schedule.ONE_F_ONE_B), ("virtual_stages", None)),
                )
            )
        if pp > 1 and (p.zero or 0) >= 2:
            out.append(_Problem(f"ZeRO-{p.zero} with pipeline parallelism", (("zero", 1),)))
        if pp > 1 and not even:
            out.append(_Problem(f"pipeline split {counts}", split=()))
    return out


def _embedding_and_loss(plan: Plan) -> bool:
    """Whether the plan's model chunks are Megatron's layout with the embedding and the loss
    counted as a layer each (`partition.chunk_layers`' second layout, written as
    `--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`)."""
    split = _virtual_split(plan)
    c = split[1] if len(split) > 2 else split[0] + 1
    return len(split) >= 2 and split == (c - 1, *[c] * (len(split) - 2), c - 1)


def _megatron_nearest(counts: tuple[int, ...]) -> tuple[int, ...]:
    total, pp = sum(counts), len(counts)
    m = total // pp
    return (total - m * (pp - 1), *[m] * (pp - 1))


def export(
    plan: Plan,
    fmt: str,
    *,
    closest: bool = False,
    graph: Graph | None = None,
    engine: Engine = EAGER,
) -> Export:
    """`plan` as framework configuration `fmt` (EXPORT_FORMATS). A feature the framework
    cannot express raises ExportError naming it, unless `closest`: then the nearest plan it
    can express is priced (needs `graph`) and written, its changes listed. `engine`: the
    engine options to write (torch.compile, Float8, TP overlap)."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"--export must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
    changes: list[str] = []
    for _ in range(4):
        problems = _problems(plan, fmt)
        if not problems:
            break
        fixable = [x for x in problems if x.changes or x.split is not None]
        if not closest or len(fixable) < len(problems):
            first = next((x for x in problems if x not in fixable), problems[0])
            hint = "; --closest writes the nearest plan it can" if first in fixable else ""
            raise ExportError(f"{fmt} cannot express {first.feature}{hint}")
        if graph is None:
            raise ExportError("--closest needs the model's graph to price the nearest plan")
        plan = _nearest(plan, problems, graph, engine)
        changes += [x.feature for x in problems]
    else:  # pragma: no cover - each round removes the problems it fixes
        raise ExportError(f"{fmt} cannot express this plan")
    writer = {
        "torchtitan": _write_titan_toml,
        "torchtitan-cli": _write_titan_cli,
        "megatron": _write_megatron,
        "deepspeed": _write_deepspeed,
    }[fmt]
    return Export(fmt, writer(plan, engine), plan, tuple(changes))


def _nearest(plan: Plan, problems: list[_Problem], graph: Graph, engine: Engine) -> Plan:
    """The plan with every problem's change applied, placed by default and priced."""
    from .api import estimate_plan

    fields: dict[str, object] = {}
    split: tuple[int, ...] | None = None
    for x in problems:
        fields.update({k: v for k, v in x.changes if not k.startswith("_")})
        if x.split is not None:
            split = x.split
    p, q = dataclasses.replace(plan.parallel, **fields), plan.parallel
    counts = stage_layer_counts(plan)
    if split is None and len(counts) == (p.pp or 1):
        # keep the plan's own split (per stage, or per model chunk) where it was not the problem
        same_chunks = p.chunks == q.chunks and p.schedule == q.schedule
        own = counts if p.chunks == 1 else _virtual_split(plan) if same_chunks else ()
        split = own if len(set(own)) > 1 else None
    return estimate_plan(graph, cluster=plan.cluster, parallel=p, engine=engine, split=split or ())


def _header(plan: Plan, fmt: str, comment: str) -> list[str]:
    pr = plan.predicted
    return [
        f"{comment} meshplan plan for {plan.model.name} on {plan.cluster.name} "
        f"({plan.world_size} GPUs), written as {fmt}",
        f"{comment} predicted: step {pr.step_time_s:.3f} s, {pr.tokens_per_s:,.0f} tokens/s, "
        f"MFU {pr.mfu * 100:.1f}%, peak {pr.peak_memory_bytes / 2**30:.1f} GiB per rank",
    ]


def _titan_values(plan: Plan, engine: Engine) -> dict[str, dict[str, object]]:
    """The torchtitan fields (section -> field -> value) expressing `plan`."""
    p = plan.parallel
    dp, pp = p.dp or 1, p.pp or 1
    sharded = (p.zero or 0) >= 2 and dp > 1
    par: dict[str, object] = {
        "data_parallel_replicate_degree": 1 if sharded else dp,
        "data_parallel_shard_degree": dp if sharded else 1,
        "fsdp_reshard_after_forward": "never" if p.zero == 2 else "default",
        "tensor_parallel_degree": p.tp or 1,
        "enable_sequence_parallel": bool(p.sequence_parallel) or (p.tp or 1) == 1,
        "pipeline_parallel_degree": pp,
        "context_parallel_degree": p.cp or 1,
        "expert_parallel_degree": p.ep or 1,
    }
    local = p.micro_batch
    if pp > 1:
        fl, ll, per = titan_split_options(plan)  # type: ignore[misc]
        par["pipeline_parallel_schedule"] = _SCHEDULE_TO_TITAN[p.schedule]  # type: ignore[index]
        par["pipeline_parallel_microbatch_size"] = p.micro_batch
        par["pipeline_parallel_first_stage_less_layers"] = fl
        par["pipeline_parallel_last_stage_less_layers"] = ll
        if per is not None:
            par["pipeline_parallel_layers_per_stage"] = per
        local = p.micro_batch * p.num_microbatches  # type: ignore[operator]
    training = {
        "local_batch_size": local,
        "global_batch_size": p.global_batch,
        "seq_len": plan.model.seq_len,
        # FSDP2's gradient reduction dtype: torchtitan 0.3.0 accepts only float32
        # (`TrainingConfig.mixed_precision_reduce: Literal["float32"]`, config/configs.py)
        "mixed_precision_reduce": "float32",
    }
    ac = {"mode": str(p.recompute)}
    if p.recompute == Recompute.SELECTIVE:
        # every second layer checkpointed when the plan was priced so, else the per-op policy
        layers = engine.selective == SelectivePolicy.EVERY_OTHER_LAYER
        ac["selective_ac_option"] = "2" if layers else "op"
    return {
        "training": training,
        "parallelism": par,
        "activation_checkpoint": ac,
        "compile": {"enable": engine.fused, "enable_async_tensor_parallel": engine.tp_overlap},
    }


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def _write_titan_toml(plan: Plan, engine: Engine) -> str:
    name, flavor = _PRESET_TO_TITAN[plan.model.name.lower()]
    values = _titan_values(plan, engine)
    lines = _header(plan, "torchtitan job TOML", "#")
    lines += ["# run: CONFIG_FILE=this.toml NGPU=<gpus per node> ./run_train.sh"]
    if not engine.reduce_fp32:
        lines.append(
            "# gradients are reduced in float32, torchtitan's only choice; the plan was priced "
            "reducing them in bf16"
        )
    lines.append("")
    lines += ["[model]", f'name = "{name}"', f'flavor = "{flavor}"']
    if engine.float8:
        lines.append('converters = ["float8"]')
    for section in ("training", "parallelism", "activation_checkpoint", "compile"):
        lines += ["", f"[{section}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in values[section].items()]
    if engine.float8:
        lines += [
            "",
            "[float8]",
            'recipe_name = "tensorwise"',
            f"enable_fsdp_float8_all_gather = {_toml_value(engine.float8_all_gather)}",
        ]
    return "\n".join(lines) + "\n"


def _write_titan_cli(plan: Plan, engine: Engine) -> str:
    name, _ = _PRESET_TO_TITAN[plan.model.name.lower()]
    fn = f"llama3_{plan.model.name.lower().split('-')[-1]}"
    values = _titan_values(plan, engine)
    args = [f"--module {name}", f"--config {fn}"]
    for section in ("parallelism", "training", "compile"):
        for k, v in values[section].items():
            if isinstance(v, bool):
                args.append(f"--{section}.{k}" if v else f"--{section}.no-{k}")
            else:
                args.append(f"--{section}.{k} {v}")
    args.append(f"activation_checkpoint:{values['activation_checkpoint']['mode']}")
    lines = _header(plan, "torchtitan 0.3 command line", "#")
    lines.append(
        "# run: torchrun --nproc_per_node=<gpus per node> -m torchtitan.train "
        "$(grep -v '^#' this.txt)"
    )
    if engine.float8:
        lines.append("# float8: torchtitan 0.3 sets converters in the config function")
    return "\n".join(lines) + "\n" + " \\\n".join(args) + "\n"


def _write_megatron(plan: Plan, engine: Engine) -> str:
    p = plan.parallel
    args: list[str] = []
    preset = PRESETS.get(plan.model.name.lower())
    if preset is not None:
        c = preset[0]
        args += [
            f"--num-layers {c.layers}",
            f"--hidden-size {c.hidden}",
            f"--ffn-hidden-size {c.ffn}",
            f"--num-attention-heads {c.heads}",
        ]
        if c.kv_heads and c.kv_heads != c.heads:
            args += ["--group-query-attention", f"--num-query-groups {c.kv_heads}"]
        args.append(f"--vocab-size {c.vocab}")
        if c.style == "llama":
            args += ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope"]
        if not c.tie_embeddings:
            args.append("--untie-embeddings-and-output-weights")
        if c.experts:
            args += [f"--num-experts {c.experts}", f"--moe-router-topk {c.top_k}"]
    seq = plan.model.seq_len
    args += [f"--seq-length {seq}", f"--max-position-embeddings {seq}"]
    args += [f"--tensor-model-parallel-size {p.tp}", f"--pipeline-model-parallel-size {p.pp}"]
    if p.schedule == Schedule.INTERLEAVED_1F1B and (p.virtual_stages or 1) > 1:
        args.append(f"--num-virtual-stages-per-pipeline-rank {p.virtual_stages}")
        if _embedding_and_loss(plan):
            args += [
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split",
            ]
    if (p.pp or 1) > 1 and p.chunks == 1:
        flags = _megatron_split_flags(stage_layer_counts(plan))
        first, last = flags if flags else (None, None)
        if first is not None:
            args.append(f"--decoder-first-pipeline-num-layers {first}")
        if last is not None:
            args.append(f"--decoder-last-pipeline-num-layers {last}")
    if p.sequence_parallel and (p.tp or 1) > 1:
        args.append("--sequence-parallel")
    args += [f"--context-parallel-size {p.cp}", f"--expert-model-parallel-size {p.ep}"]
    if (p.cp or 1) > 1:
        args.append(f"--cp-comm-type {_CP_MODE_TO_MEGATRON[p.cp_mode or 'allgather']}")
        if p.cp_mode == "usp" and p.cp_head_degree:
            u = p.cp_head_degree
            args.append(f"--hierarchical-context-parallel-sizes {u} {p.cp // u}")
    if p.zero == 1:
        args.append("--use-distributed-optimizer")
    elif p.zero in (2, 3):
        # Megatron-FSDP; Megatron-LM's validate_args refuses --use-torch-fsdp2 with pp or ep > 1
        args += [
            *_MEGATRON_FSDP_FLAGS,
            f"--data-parallel-sharding-strategy {_ZERO_TO_MEGATRON_SHARDING[p.zero]}",
        ]
    args += [f"--micro-batch-size {p.micro_batch}", f"--global-batch-size {p.global_batch}"]
    if p.recompute == Recompute.SELECTIVE:
        args.append("--recompute-granularity selective")
    elif p.recompute == Recompute.FULL:
        args += [
            "--recompute-granularity full",
            "--recompute-method uniform",
            "--recompute-num-layers 1",
        ]
    if engine.dp_overlap and p.zero < 3:  # as priced: reduced under the backward
        args.append("--overlap-grad-reduce")
        if p.zero == 1:  # the distributed optimizer's gather under the next forward
            args.append("--overlap-param-gather")
    args.append("--bf16")
    if not engine.reduce_fp32:  # as priced: bf16 gradient reduction (Megatron's is fp32)
        args.append("--grad-reduce-in-bf16")
    if engine.float8:
        args += ["--fp8-format hybrid", "--fp8-recipe tensorwise"]
        if engine.float8_all_gather:
            args.append("--fp8-param-gather")
    if engine.tp_overlap and (p.tp or 1) > 1 and p.sequence_parallel:
        args.append("--tp-comm-overlap")  # Megatron-LM validate_args: needs TP with SP
    lines = _header(plan, "Megatron-LM arguments", "#")
    if preset is None:
        lines.append(f"# model {plan.model.name}: add its shape (--num-layers, --hidden-size, ...)")
    lines.append("# run: torchrun ... pretrain_gpt.py $(grep -v '^#' this.txt) <data, tokenizer>")
    return "\n".join(lines) + "\n" + " \\\n".join(args) + "\n"


def _write_deepspeed(plan: Plan, engine: Engine) -> str:
    p = plan.parallel
    cfg: dict[str, object] = {
        "train_batch_size": p.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.num_microbatches,
        "zero_optimization": {"stage": p.zero},
        "bf16": {"enabled": True},
    }
    if p.zero in (1, 2) and engine.dp_overlap:  # reduce under the backward, as priced
        cfg["zero_optimization"] = {"stage": p.zero, "overlap_comm": True}
    if (p.tp or 1) > 1:
        cfg["tensor_parallel"] = {"autotp_size": p.tp}
    if (p.pp or 1) > 1:
        cfg["pipeline"] = {"stages": p.pp, "partition": "uniform"}
    if p.recompute == Recompute.FULL:
        cfg["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    return json.dumps(cfg, indent=2) + "\n"
