"""The Python API: `plan`, `estimate` and the helpers they share.

    import meshplan
    model, inputs = meshplan.models.get("llama3-70b", seq_len=8192)
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=256)
    plan = meshplan.plan(model, inputs, cluster, global_batch=512)
    print(plan.explain())
    plan.to_json("plan.json")

    est = meshplan.estimate(model, inputs, cluster,
                            parallel=meshplan.Parallel(tp=8, pp=4, micro_batch=1, global_batch=512))
    est.step_time_s, est.mfu, est.peak_memory_bytes, est.fits

`model` may also be an already traced `meshplan.ir.Graph` (tracing is the slow part; trace
once, then plan many clusters).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from meshplan.cost_model import predict, pricer_for
from meshplan.cost_model.compression import (
    QUANT_MODES,
    CodecSpeed,
    CommOptions,
    plan_decisions,
    quantization_plan,
)
from meshplan.cost_model.compute import is_float8_linear, linear_role, lowered
from meshplan.cost_model.engine import EAGER, Engine
from meshplan.cost_model.host import MAX_HOST_US
from meshplan.cost_model.pricer import compute_dtype
from meshplan.ir import (
    Cluster,
    Graph,
    Parallel,
    Prediction,
    Recompute,
    Schedule,
    StagePlacement,
)
from meshplan.ir.devices import (
    HYBRID_PEAKS,
    PRECISION_DTYPE,
    default_precision,
    matmul_dtype,
    precision_problem,
)
from meshplan.ir.facts import DIMENSIONS, Dataflow, blocked_dimension
from meshplan.ir.plan import (
    CompressionPlan,
    ModelRef,
    Plan,
    QuantizationPlan,
    SolverInfo,
    assign_ranks,
    group_tp_degree,
)
from meshplan.ir.rules import (
    batch_split_problem,
    cp_head_degree_problem,
    cp_heads_problem,
    cp_sequence_problem,
    cp_split_problem,
    ep_dp_problem,
    ep_experts_problem,
    ep_tp_problem,
    microbatch_problem,
    pp_layers_problem,
    schedule_problem,
    tp_heads_problem,
    usp_degree,
    zero_bubble_problem,
)
from meshplan.ir.trace import trace as trace_ir
from meshplan.passes.partition import (
    chunk_layout_problem,
    even_stages,
    place_stages,
    rank_chunks,
    rank_layers,
    stages_of,
)
from meshplan.passes.sharding import tp_param_placements

from .layout import layout_parallel, stages_from_layout
from .models import SkipInitOnMeta
from .rehearse import rehearse_pipeline_cut, rehearse_tensor_parallel
from .solver import InfeasibleError, Objective, SolveResult, solve

# Tokens per optimizer step when the user gives no global batch, by model size: published
# pre-training batches. GPT-3 (Brown et al. 2020, Table 2.1): 0.5M tokens for 125M-760M
# parameters, 1M for 1.3B-2.7B, 2M for 6.7B-13B, 3.2M for 175B; Llama 3 405B (Dubey et al.
# 2024, Sec. 3.4.1) started at 4M (and grew to 16M). (parameters, tokens): the row of the
# largest model not larger than the one planned.
PUBLISHED_BATCH_TOKENS: tuple[tuple[float, int], ...] = (
    (0, 2**19),  # GPT-3 Small .. Large: 0.5M
    (1.3e9, 2**20),  # GPT-3 XL, 2.7B: 1M
    (6.7e9, 2**21),  # GPT-3 6.7B, 13B: 2M
    (175e9, 3_200_000),  # GPT-3 175B: 3.2M
    (405e9, 2**22),  # Llama 3 405B: 4M
)
# At most this many sequences per device by default, so a small cluster gets a batch it steps
# through quickly instead of a large cluster's. Megatron-LM's weak-scaling runs (Narayanan et
# al. 2021, Table 1: GPT 1.7B-1T on 32-3072 A100s, sequence 2048) used 1 to 16 sequences per
# GPU, 4 at 7.5B-18B. Llama 3 8B on 64 H100 gets min(2M tokens / 8192, 64 x 4) = 256
# sequences, the 2M of the table; the CPU example (4 ranks, sequence 32) gets 16.
MAX_SEQUENCES_PER_DEVICE = 4

Progress = Callable[[str], None] | None


class ModelLoadError(ValueError):
    """A `path/to/file.py:factory` model spec that cannot be loaded (one-line message)."""


def default_global_batch(
    seq_len: int,
    cluster: Cluster | None = None,
    *,
    params: int | None = None,
    per_step: int = 1,
) -> int:
    """Sequences per optimizer step when the user gives none, from the model and cluster.

    The published batch of a model of `params` parameters (`PUBLISHED_BATCH_TOKENS`; 2M
    tokens when unknown) in sequences of `seq_len`, at most MAX_SEQUENCES_PER_DEVICE per
    device of `cluster`, rounded down to a power of two, then up to a multiple of `per_step`
    (dp x micro-batch, when known: every replica gets whole micro-batches)."""
    n = params if params is not None else PUBLISHED_BATCH_TOKENS[2][0]
    tokens = max(t for p, t in PUBLISHED_BATCH_TOKENS if p <= n)
    target = max(1, tokens // max(1, seq_len))
    if cluster is not None:
        target = min(target, MAX_SEQUENCES_PER_DEVICE * cluster.world_size)
    target = 1 << (target.bit_length() - 1)
    return per_step * -(-target // per_step)


def as_cluster(cluster: Cluster | str | Path | None) -> Cluster:
    """`cluster` as a Cluster: None is the default preset; a string or path is a YAML/JSON
    cluster file (by its suffix) or a preset name / GPU type, as `--cluster` reads it."""
    if cluster is None:
        return Cluster.preset("default")
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str | Path):
        return Cluster.named(cluster)
    raise TypeError(
        f"cluster must be a meshplan Cluster, a preset name or a cluster file, got "
        f"{type(cluster).__name__}"
    )


def as_graph(
    model: torch.nn.Module | Graph | str,
    example_inputs: tuple | torch.Tensor | None = (),
    *,
    name: str | None = None,
    progress: Progress = None,
) -> Graph:
    """Trace `model` unless it already is a Graph (a string: the preset or model file the
    CLI's --model takes, `load_model`). A Cluster given as the second argument
    (where the example inputs go) is refused: it would be ignored for a Graph and planned on
    the default cluster."""
    if isinstance(example_inputs, Cluster):
        raise ValueError(
            "the second argument is the model's example inputs; pass the cluster as "
            "cluster=... (e.g. meshplan.plan(graph, cluster=cluster))"
        )
    if isinstance(model, Graph):
        return model
    if isinstance(model, str) and not example_inputs:  # a preset name or file.py:factory
        model, example_inputs = load_model(model)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (with its example inputs), a traced meshplan "
            f"Graph, or a preset name / path/to/file.py:factory, got {type(model).__name__}"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return trace(model, *(example_inputs or ()), name=name, progress=progress)


def trace(
    model: torch.nn.Module,
    *example_inputs: object,
    kwargs: dict[str, object] | None = None,
    name: str | None = None,
    progress: Progress = None,
) -> Graph:
    """`meshplan.ir.trace.trace` (one training step on fake tensors -> the operator IR), then
    one tensor-parallel rank rehearsed on the model's own code (`rehearse`): the graph's
    `ModelInfo.blockers` name every parallel dimension the runtime cannot run on it; a model
    the runtime cuts from its exported graph is cut once (`rehearse_pipeline_cut`)."""
    flows: list[Dataflow] = []
    graph = trace_ir(
        model, *example_inputs, kwargs=kwargs, name=name, progress=progress, flow_out=flows
    )
    graph = rehearse_tensor_parallel(model, graph, example_inputs, kwargs, flows[0])
    return rehearse_pipeline_cut(model, graph, example_inputs)


def _model_ref(graph: Graph) -> ModelRef:
    dtype = graph.params[0].dtype if graph.params else "bfloat16"
    return ModelRef(
        name=graph.name,
        fingerprint=graph.fingerprint(),
        num_params=graph.num_params(),
        units=tuple(u.name for u in graph.units),
        seq_len=graph.info.seq_len or 1,
        dtype=dtype,
        blockers=tuple(sorted((d, w) for d in DIMENSIONS if (w := graph.info.blocker(d)))),
        positions=graph.info.position_tables,
        input=(graph.inputs[0].dtype, graph.inputs[0].shape[1:]) if graph.inputs else None,
    )


def _placements(
    graph: Graph, parallel: Parallel, stages: tuple[StagePlacement, ...] = ()
) -> tuple[tuple[str, str], ...]:
    """Parameter placements on the tp axis (recorded only when TP is used: by every
    replica, or under per-group TP by some group)."""
    tps = [parallel.tp or 1] + [t for st in stages[:1] for _, t in st.group_tp]
    return tp_param_placements(graph) if max(tps) > 1 else ()


def complete_parallel(graph: Graph, cluster: Cluster, parallel: Parallel) -> Parallel:
    """Fill the fields a hand-written configuration left out with the obvious choice.

    tp, pp, cp, ep default to 1; dp to every GPU left (world / (tp*pp*cp)); micro_batch to 1;
    global_batch to `default_global_batch` (the published batch of a model of this size, at
    most MAX_SEQUENCES_PER_DEVICE sequences per device, a multiple of dp*micro_batch);
    recompute none; ZeRO 0; 1F1B, or GPipe where the pipeline gets fewer micro-batches than
    stages (torch's 1F1B refuses that, `microbatch_problem`; with m < pp both take the same
    time); sequence parallel when tp > 1 (and the model can run on sequence shards:
    `ModelInfo.no_sequence_sharding`).
    """
    p = parallel
    tp, pp, cp, ep = p.tp or 1, p.pp or 1, p.cp or 1, p.ep or 1
    dp = p.dp or max(1, cluster.world_size // (tp * pp * cp))
    micro_batch = p.micro_batch or 1
    per_step = dp * micro_batch
    global_batch = p.global_batch or default_global_batch(
        graph.info.seq_len or 1, cluster, params=graph.num_params(), per_step=per_step
    )
    schedule = p.schedule or Schedule.ONE_F_ONE_B
    m = global_batch // per_step
    if p.schedule is None and m >= 1 and microbatch_problem(schedule, pp, m):
        schedule = Schedule.GPIPE
    return Parallel(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        micro_batch=micro_batch,
        global_batch=global_batch,
        recompute=p.recompute or Recompute.NONE,
        zero=p.zero if p.zero is not None else 0,
        schedule=schedule,
        sequence_parallel=(
            p.sequence_parallel
            if p.sequence_parallel is not None
            else tp > 1 and not graph.info.blocker("sp")
        ),
        virtual_stages=p.virtual_stages,
        quantize_activations=p.quantize_activations,
        # complete: the mode stated (a head-parallel degree given alone means "usp")
        cp_mode=p.cp_mode or ("usp" if p.cp_head_degree else "allgather" if cp > 1 else None),
        cp_shares=p.cp_shares,
        cp_head_shares=p.cp_head_shares,
        cp_head_degree=(
            p.cp_head_degree or usp_degree(graph.info.heads // tp, cp)
            if p.cp_mode == "usp" and cp > 1 and graph.info.heads
            else p.cp_head_degree
        ),
    )


def _cp_mode_problem(p: Parallel, heads: int) -> str | None:
    """Head-parallel CP (`cp_mode` "heads") needs cp to divide each tp rank's query heads."""
    if p.cp_mode != "heads" or (p.cp or 1) == 1 or not heads:
        return None
    return cp_heads_problem(heads // (p.tp or 1), p.cp)  # type: ignore[arg-type]


def check_config(
    graph: Graph,
    cluster: Cluster,
    p: Parallel,
    pinned: Parallel | None = None,
    split: Sequence[int] = (),
) -> None:
    """One-line ValueError for a configuration that cannot run on this model and cluster.

    `pinned` is what the user wrote before `complete_parallel`: when it fixes dp, tp, pp and cp
    all four, their product must be the cluster's GPU count. `split`: the layers per stage or
    per model chunk the stages will hold (`estimate_plan`), checked instead of the default
    chunk layout."""
    info = graph.info
    n_layers = len(graph.layer_units) or info.layers
    rules = (
        lambda: pp_layers_problem(p.pp, n_layers),
        lambda: schedule_problem(p),
        lambda: tp_heads_problem(p.tp, info.heads, info.kv_heads),
        lambda: ep_experts_problem(p.ep, info.experts),
        lambda: cp_sequence_problem(p.cp, info.seq_len),
        lambda: _cp_mode_problem(p, info.heads),
        lambda: cp_split_problem(p, info.seq_len, info.heads),
        lambda: cp_head_degree_problem(p, info.heads),
        lambda: ep_dp_problem(p.ep, p.dp),
        lambda: ep_tp_problem(p.ep, p.tp, p.sequence_parallel),
        lambda: blocked_dimension(info, p),  # the runtime cannot run it (`ir.facts`)
    )
    for rule in rules:
        if why := rule():
            raise ValueError(why)
    if n_layers and ((p.pp or 1) > 1 and p.chunks > 1 or split):
        v_shape = p.schedule == Schedule.ZERO_BUBBLE
        chunks = p.chunks if (p.pp or 1) > 1 else 1
        if why := chunk_layout_problem(n_layers, p.pp or 1, chunks, v_shape, split):
            raise ValueError(why)

    used = p.dp * p.tp * p.pp * p.cp  # type: ignore[operator]
    q = pinned
    if q is not None and None not in (q.dp, q.tp, q.pp, q.cp) and used != cluster.world_size:
        raise ValueError(
            f"dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {used} must equal the GPU count "
            f"({cluster.world_size} in cluster {cluster.name})"
        )
    if used > cluster.world_size:
        raise ValueError(
            f"dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {used} GPUs but cluster "
            f"{cluster.name} has {cluster.world_size}"
        )
    m = p.num_microbatches
    rules = (
        lambda: batch_split_problem(p.global_batch, p.dp, p.micro_batch),
        lambda: microbatch_problem(p.schedule, p.pp, m),
        lambda: zero_bubble_problem(p.schedule, p.pp, m),
    )
    for rule in rules:
        if why := rule():
            raise ValueError(why)


def estimate(
    model: torch.nn.Module | Graph,
    example_inputs: tuple | torch.Tensor | None = (),
    cluster: Cluster | str | None = None,
    parallel: Parallel | None = None,
    *,
    progress: Progress = None,
    engine: Engine = EAGER,
    precision: str | None = None,
    layout: Sequence[Mapping] | None = None,
) -> Prediction:
    """Predicted step time, tokens/s, MFU, peak memory per rank and `fits` of a hand-chosen
    configuration (missing fields filled as in `complete_parallel`). `engine`
    (`meshplan.cost_model.engine.Engine`): price the step as another stack runs it (fused
    kernels, Float8 linears, TP overlap); the default is meshplan's own eager runtime.
    `precision`: fp32, tf32, bf16, fp16 or fp8 (`resolve_precision`). `layout`: price a
    stage list instead of placing `parallel` (`estimate_plan`)."""
    return estimate_plan(
        model,
        example_inputs,
        cluster,
        parallel,
        progress=progress,
        engine=engine,
        precision=precision,
        layout=layout,
    ).predicted


def resolve_precision(
    graph: Graph, cluster: Cluster, precision: str | None, engine: Engine
) -> tuple[str, str, Engine, str]:
    """(precision, the dtype the cost model prices it in, engine, note) for a plan.

    `precision` None: the model's own dtype (`ir.cluster.default_precision`: a bf16 model on
    parts without bf16 trains in fp16, said in the note). A precision some GPU type of the
    cluster lacks is refused in one line (`ir.cluster.precision_problem`). fp8 is bf16 mixed
    precision with float8 linear layers (the engine's tensorwise recipe, torchao's)."""
    gpus = [g.gpu for g in cluster.groups]
    note = ""
    if precision is None:
        precision, note = default_precision(compute_dtype(graph), gpus)
    elif why := precision_problem(precision, gpus):
        raise ValueError(why)
    if precision == "tf32" and (fp32 := sorted({g.name for g in gpus if not g.supports("tf32")})):
        note = (
            f"precision tf32: no TF32 units on {' and '.join(fp32)}, whose matmuls run in fp32 "
            "on CUDA cores (PyTorch's allow_tf32 does nothing there)"
        )
    if precision == "fp8" and engine.float8 is None:
        engine = dataclasses.replace(engine, float8="tensorwise")
    if engine.float8 is not None and (lacking := [g.name for g in gpus if not g.supports("fp8")]):
        raise ValueError(
            f"{', '.join(sorted(set(lacking)))} has no FP8 tensor cores (float8 linears); "
            "price it without --float8"
        )
    return precision, PRECISION_DTYPE[precision], engine, note


def _noted(prediction: Prediction, note: str) -> Prediction:
    if not note:
        return prediction
    return dataclasses.replace(prediction, notes=(*prediction.notes, note))


def default_stages(
    graph: Graph, p: Parallel, split: Sequence[int] = ()
) -> tuple[tuple[int, int], ...]:
    """The unit ranges of each pipeline rank when the user names only the degrees: the even
    split, or under a schedule with several chunks per rank the layers its chunk layout gives
    each rank (`partition.rank_layers`). `split` (layers per stage, or per model chunk in
    model order under several chunks per rank; `chunk_layout_problem` checks it): the ranks
    hold those instead."""
    pp = p.pp or 1
    chunks = p.chunks if pp > 1 else 1
    if split or chunks > 1:
        v_shape = p.schedule == Schedule.ZERO_BUBBLE
        per_rank = rank_layers(len(graph.layer_units), pp, chunks, v_shape, split)
        return stages_of(graph, per_rank)
    return even_stages(graph, pp)


def with_chunks(
    graph: Graph, p: Parallel, stages: tuple[StagePlacement, ...], split: Sequence[int] = ()
) -> tuple[StagePlacement, ...]:
    """Record on each stage the chunk ranges its rank runs when the schedule has several chunks
    per rank (interleaved 1F1B, ZB-V), so the runtime reads them from the plan and the cost
    model prices them: the chunk layout, or chunks of `split` layers (model order)."""
    if p.pp is None or p.pp < 2 or p.chunks < 2:
        return stages
    v_shape = p.schedule == Schedule.ZERO_BUBBLE
    per_rank = rank_chunks(graph, p.pp, p.chunks, v_shape, split)
    return tuple(dataclasses.replace(st, chunks=per_rank[st.index]) for st in stages)


def estimate_plan(
    model: torch.nn.Module | Graph,
    example_inputs: tuple | torch.Tensor | None = (),
    cluster: Cluster | str | None = None,
    parallel: Parallel | None = None,
    *,
    progress: Progress = None,
    engine: Engine = EAGER,
    precision: str | None = None,
    layout: Sequence[Mapping] | None = None,
    split: Sequence[int] = (),
    balance_cp: bool = False,
) -> Plan:
    """Like `estimate`, but returns the whole fixed Plan (for `explain()` and JSON).

    `balance_cp`: where the placement's cp groups span device groups (`StagePlacement.
    cp_groups`, HexiSeq's setting), give each cp rank the share of the sequence (and under
    "heads" of the heads) that equalises their times (`planner.cp_shares`); refused
    elsewhere, and with shares given.

    `layout` (`meshplan.layout`): the pipeline stages as a list of {layers, replicas, tp}
    mappings, e.g. another planner's plan with stages at their own TP degree and GPU types;
    it sets pp, dp, tp and ZeRO-0, `parallel` gives the rest (batches, recompute, schedule).
    `split`: the layers of each pipeline stage, or under interleaved 1F1B / ZB-V of each of
    the pp * chunks model chunks in model order (a framework's uneven split, as
    `meshplan.configs` reads it); () = the even split or the default chunk layout."""
    cluster = as_cluster(cluster)
    graph = as_graph(model, example_inputs, progress=progress)
    precision, dtype, engine, note = resolve_precision(graph, cluster, precision, engine)
    if engine.hybrid:  # each group named exists and has that precision's tensor cores
        hybrid_options(cluster, dict(engine.hybrid), dtype)
    if engine.hybrid_linears:
        if not engine.hybrid:
            raise ValueError("hybrid_linears needs per-group precision (hybrid) to lower them")
        check_linears("hybrid_linears", engine.hybrid_linears, linear_flops(graph))
    if layout is not None:
        if split:
            raise ValueError("give the stages' layers in the layout, not as a split")
        fields, stages = stages_from_layout(graph, cluster, layout)
        p = complete_parallel(graph, cluster, layout_parallel(parallel or Parallel(), fields))
    else:
        p = complete_parallel(graph, cluster, parallel or Parallel())
        check_config(graph, cluster, p, parallel, split)
        stages = place_stages(cluster, p, default_stages(graph, p, split))
        stages = with_chunks(graph, p, stages, split)
    if balance_cp:
        if p.cp_shares or p.cp_head_shares:
            raise ValueError("give cp shares or ask for balanced ones (auto), not both")
        if not stages[0].cp_groups:
            raise ValueError(
                "balanced cp shares (auto) need cp groups that span device groups: a cp "
                "degree whose replicas fit no single group"
            )
        from .cp_shares import balanced_cp_shares

        p = balanced_cp_shares(graph, cluster, p, stages[0], dtype=dtype, engine=engine)
    if engine.hybrid and (why := hybrid_problem_of(cluster, p, stages, engine.hybrid)):
        raise ValueError(why)
    prediction = _noted(predict(graph, cluster, p, stages, dtype=dtype, engine=engine), note)
    # Priced with quantized activations: record the widths the runtime then applies.
    quant = quantization_plan(p, stages, "activations") if p.quantize_activations else None
    return Plan(
        model=_model_ref(graph),
        cluster=cluster,
        parallel=p,
        stages=stages,
        ranks=assign_ranks(cluster, p, stages),
        predicted=prediction,
        solver=SolverInfo(status="fixed", gap=0.0, candidates=1),
        placements=_placements(graph, p, stages),
        quantization=quant or QuantizationPlan(),
        precision=precision,
        hybrid_precision=engine.hybrid,
        hybrid_linears=engine.hybrid_linears if engine.hybrid else (),
    )


# Per-group precision (`plan(hybrid_precision=...)`): the largest share of a step's FLOPs the
# planner may move to int8 / FP8 GEMMs unless told otherwise. A user's accuracy budget, not a
# measured constant: QSync bounds its quantized operators by a sensitivity indicator instead
# (Zhao et al., IPDPS'24), which meshplan does not compute yet (docs/hybrid_precision.md).
DEFAULT_MAX_QUANTIZED_FRACTION = 0.25
# With a measured per-linear sensitivity (`measure.sensitivity`): the largest summed relative
# loss increase of the linears the planner may lower, unless told otherwise. A user's accuracy
# budget, not a measured constant.
DEFAULT_MAX_LOSS_INCREASE = 0.01
# Up to this many distinct linears per layer `chosen_linears` tries every subset (2^16 sums);
# beyond, it adds them by FLOPs per unit of loss increase.
EXACT_LINEARS = 16
# Per-group precision changes numerics, so "auto" keeps it only when it makes the step at
# least this much faster than the best plan without it (a choice, not a measured constant).
HYBRID_MIN_GAIN = 0.01


def hybrid_options(
    cluster: Cluster, hybrid: str | Mapping[str, str], dtype: str
) -> list[tuple[tuple[str, str], ...]]:
    """The per-group precisions to plan with, `()` (none) first. "off": [()]. A mapping pins
    one (each group named must exist and have that mode's tensor cores). "auto": none, each
    device group slower than the fastest (by the training dtype's peak) in FP8 where its GPU
    has FP8 tensor cores and in int8 where it has INT8 ones (the faster one is kept), and every
    such group at once in its first mode."""
    groups = {g.name: g for g in cluster.groups}
    if isinstance(hybrid, Mapping):
        pins = []
        for g, mode in sorted(hybrid.items()):
            if g not in groups:
                raise ValueError(
                    f"hybrid_precision: no device group {g!r} in cluster {cluster.name} "
                    f"(groups: {', '.join(groups)})"
                )
            if mode not in HYBRID_PEAKS:
                raise ValueError(f"hybrid_precision.{g}: {mode!r} is not int8 or fp8")
            if HYBRID_PEAKS[mode] not in dict(groups[g].gpu.peak_flops):
                raise ValueError(
                    f"hybrid_precision.{g}: {groups[g].gpu.name} has no {mode} tensor cores"
                )
            pins.append((g, mode))
        return [tuple(pins)]
    if hybrid == "off":
        return [()]
    if hybrid != "auto":
        raise ValueError(
            f"hybrid_precision must be off, auto or a mapping of groups to int8/fp8, got {hybrid!r}"
        )
    fastest = max(g.gpu.peak(matmul_dtype(g.gpu, dtype)) for g in cluster.groups)
    options: list[tuple[tuple[str, str], ...]] = [()]
    first = []
    for g in cluster.groups:
        if g.gpu.peak(matmul_dtype(g.gpu, dtype)) >= fastest:
            continue
        peaks = dict(g.gpu.peak_flops)
        modes = [m for m in ("fp8", "int8") if HYBRID_PEAKS[m] in peaks]
        options += [((g.name, m),) for m in modes]
        first += [(g.name, m) for m in modes[:1]]
    if len(first) > 1:
        options.append(tuple(first))
    return options


def hybrid_problem_of(
    cluster: Cluster,
    p: Parallel,
    stages: Sequence[StagePlacement],
    hybrid: Sequence[tuple[str, str]],
) -> str | None:
    """`ir.plan.hybrid_problem` of a configuration before it is a Plan: a quantized group
    whose replicas run tp > 1."""
    for group, _ in hybrid:
        if (tp := group_tp_degree(p, stages, group)) > 1:
            return (
                f"hybrid_precision.{group}: the group's replicas run tp={tp}; per-group "
                "precision runs with tp 1 on that group only (pin --tp 1)"
            )
    return None


def linear_flops(graph: Graph) -> dict[str, float]:
    """Forward FLOPs per micro-batch of each linear of the repeated units, summed over the units
    and keyed by its path inside the unit (`linear_role`: "mlp.up_proj"), in model order."""
    blocks = dict(graph.blocks)
    out: dict[str, float] = {}
    for u in graph.units:
        b = blocks[u.block]
        for op in b.ops:
            if is_float8_linear(op, b):
                role = linear_role(op)
                out[role] = out.get(role, 0.0) + op.fwd_flops
    return out


def check_linears(where: str, names: Sequence[str], known: Mapping[str, float]) -> None:
    """One-line ValueError, prefixed `where`, naming those of `names` (linear paths inside a
    layer) that are no linear of the model's layers (`known`: `linear_flops`)."""
    unknown = [r for r in names if r not in known]
    if unknown:
        raise ValueError(
            f"{where}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} no linear "
            f"of the model's layers (its linears: {', '.join(known) or 'none'})"
        )


def chosen_linears(
    graph: Graph, sensitivity: Mapping[str, float], max_loss_increase: float
) -> tuple[str, ...]:
    """The linears per-group precision lowers, from a measured per-linear sensitivity (the
    relative loss increase with that linear lowered in every layer, `measure.sensitivity`):
    the set with the most forward FLOPs (`linear_flops`) whose summed sensitivity (an additive
    approximation; negative values count 0) is at most `max_loss_increase`. Exact over every
    subset up to EXACT_LINEARS linears (a knapsack: taking the best FLOPs per unit of loss
    first can miss it), greedy by that ratio beyond; ties go to the smaller summed
    sensitivity, then to model order. A linear the measurement leaves out is not lowered;
    one it names that the layers lack is refused in one line."""
    flops = linear_flops(graph)
    check_linears("sensitivity", sorted(sensitivity), flops)
    if not max_loss_increase >= 0:
        raise ValueError(f"max_loss_increase must be at least 0, got {max_loss_increase!r}")
    roles = [r for r in flops if r in sensitivity]
    # negative (noise that helped) counts 0; a loss that became nan or inf never fits
    cost = {
        r: max(0.0, float(sensitivity[r])) if math.isfinite(sensitivity[r]) else math.inf
        for r in roles
    }
    limit = max_loss_increase * (1 + 1e-12)
    if len(roles) <= EXACT_LINEARS:
        best: tuple[float, float, tuple[int, ...]] = (0.0, 0.0, ())
        for mask in range(1, 1 << len(roles)):
            take = tuple(i for i in range(len(roles)) if mask >> i & 1)
            c = sum(cost[roles[i]] for i in take)
            if c > limit:
                continue
            f = sum(flops[roles[i]] for i in take)
            # most FLOPs, then least loss, then the earliest linears in model order
            if (f, -c, [-i for i in take]) > (best[0], -best[1], [-i for i in best[2]]):
                best = (f, c, take)
        return tuple(roles[i] for i in best[2])
    order = sorted(
        roles, key=lambda r: (cost[r] / flops[r] if flops[r] else math.inf, roles.index(r))
    )
    out, used = [], 0.0
    for r in order:
        if used + cost[r] <= limit:
            out.append(r)
            used += cost[r]
    return tuple(r for r in roles if r in out)


def quantized_fraction(
    graph: Graph,
    p: Parallel,
    stages: Sequence[StagePlacement],
    hybrid: Sequence[tuple[str, str]],
    linears: Sequence[str] = (),
) -> float:
    """The share of a step's training FLOPs (`Graph.total_flops`, recomputation excluded) that
    `hybrid` runs in low precision: per stage and hybrid group, its replicas x their
    micro-batches x the forward FLOPs of the stage's transformer-block linears (those
    `linears` names, every one when empty; the backward stays in the training dtype,
    `runtime.hybrid_precision`)."""
    if not hybrid:
        return 0.0
    modes = dict(hybrid)
    blocks = dict(graph.blocks)
    per_unit = []
    for u in graph.units:
        b = blocks[u.block]
        linears_ = [op for op in b.ops if is_float8_linear(op, b) and lowered(op, tuple(linears))]
        per_unit.append(sum(op.fwd_flops for op in linears_))
    quantized = 0.0
    for st in stages:
        fwd = sum(per_unit[st.first_unit : st.last_unit])
        shares = st.shares
        for g, n in st.replicas:
            if g in modes:
                m = shares[g] if shares else p.num_microbatches
                quantized += n * m * fwd
    traced = graph.info.micro_batch or 1
    total = graph.total_flops(training=True) * p.global_batch / traced
    return quantized * p.micro_batch / traced / total if total else 0.0


def _hybrid_search(
    graph: Graph,
    options: list[tuple[tuple[str, str], ...]],
    solved,
    engine: Engine,
    budget: float,
    *,
    pinned: bool,
    say,
) -> tuple[SolveResult, Engine]:
    """Plan with each per-group precision of `options` and keep the fastest that runs within
    `budget` (the quantized share of the step's FLOPs); per-group precision must be at least
    HYBRID_MIN_GAIN faster than the plans without it. The
    runtime's quantized linears take whole weights (`ir.plan.hybrid_problem`): a plan with
    tp > 1 on a quantized group is planned again with tp pinned to 1. `pinned`: the one
    option must hold, else a one-line ValueError."""
    best: tuple[float, int, SolveResult, Engine] | None = None
    last_error: Exception | None = None
    for i, hybrid in enumerate(options):
        # the chosen linears only with a precision to lower them (the plain engine otherwise,
        # which prices with the learned latency model where it covers the GPU)
        lin = engine.hybrid_linears if hybrid else ()
        eng = dataclasses.replace(engine, hybrid=hybrid, hybrid_linears=lin)
        try:
            r = solved(eng)
        except InfeasibleError as e:
            last_error = e
            continue
        if hybrid:

            def widest(r: SolveResult) -> int:
                return max(group_tp_degree(r.parallel, r.stages, g) for g, _ in hybrid)

            if widest(r) > 1:  # the quantized linears take whole weights: plan with tp 1
                try:
                    r = solved(eng, tp_one=True)
                except (InfeasibleError, ValueError) as e:
                    last_error = e
                    if pinned:
                        raise
                    continue
            tps = {widest(r)}
            frac = quantized_fraction(graph, r.parallel, r.stages, hybrid, eng.hybrid_linears)
            why = ""
            if tps == {0}:
                why = "its plan does not use the group"
            elif any(t > 1 for t in tps):
                why = f"its plan runs tp={max(tps)} there (per-group precision needs tp 1)"
            elif frac > budget * (1 + 1e-9):
                why = f"{frac:.1%} of the step's FLOPs quantized, over the {budget:.0%} budget"
            label = ", ".join(f"{g} {m}" for g, m in hybrid)
            if why:
                if pinned:
                    raise ValueError(f"hybrid_precision {label}: {why}")
                say(f"per-group precision {label}: not kept, {why}")
                continue
            say(
                f"per-group precision {label}: {r.prediction.step_time_s:.3f} s/step, "
                f"{frac:.1%} of the FLOPs quantized"
            )
            note = (
                f"per-group precision {label}: {frac:.1%} of the step's FLOPs in low precision "
                f"(budget {budget:.0%})"
            )
            r = dataclasses.replace(
                r, prediction=dataclasses.replace(r.prediction, notes=(*r.prediction.notes, note))
            )
        key = (r.prediction.step_time_s * (1 + HYBRID_MIN_GAIN if hybrid else 1.0), i)
        if best is None or key < best[:2]:
            best = (*key, r, eng)
    if best is None:
        raise last_error or InfeasibleError("no plan fits")
    return best[2], best[3]


def plan(
    model: torch.nn.Module | Graph,
    example_inputs: tuple | torch.Tensor | None = (),
    cluster: Cluster | str | None = None,
    *,
    global_batch: int | None = None,
    parallel: Parallel | None = None,
    time_limit_s: float = 10.0,
    progress: Progress = None,
    objective: str = "throughput",
    target_tokens_per_s: float | None = None,
    prices: dict[str, float] | None = None,
    compress: str = "auto",
    quantize: str = "off",
    codec: CodecSpeed | None = None,
    per_group_tp: bool = True,
    precision: str | None = None,
    equal_shares: bool = False,
    hybrid_precision: str | Mapping[str, str] = "off",
    max_quantized_fraction: float = DEFAULT_MAX_QUANTIZED_FRACTION,
    sensitivity: Mapping[str, float] | None = None,
    max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE,
    host_us: float | None = None,
) -> Plan:
    """The fastest plan for `model` on `cluster` that fits in memory.

    `parallel` pins any subset of the choices (e.g. `Parallel(tp=8)`); the solver fills the
    rest. `global_batch` (sequences per optimizer step) may also be given inside `parallel`;
    without either it is `default_global_batch` for this model and cluster (shown by
    `plan.explain()` and in the plan JSON). `time_limit_s` is the solver's deterministic work
    budget in seconds of the reference machine (`meshplan.solver.solve`).
    `objective`: "throughput" (default), "cost" (least dollars per token; prices from the
    groups' `price_per_gpu_hour` or `prices`, $ per GPU-hour by group or GPU type name) or
    "min_gpus" (fewest GPUs reaching `target_tokens_per_s`).
    `compress`: "auto" (default) codes a collective losslessly (ZipCCL-style, bit-exact)
    wherever the cost model says it is faster, "off" never. `quantize` (changes numerics, so
    "off" by default): "activations" lets the search store saved activations at AGoQ widths
    (4/8 bits by layer kind and stage) where that gives a faster plan or one that fits,
    "gradients" lets data-parallel gradient reductions run int8 where faster, "auto" both.
    `codec`: the codec speed to assume (`meshplan.cost_model.compression.measure_codec_speed`
    or `CPU_CODEC`); default the per-GPU estimate. The decisions and why are in
    `plan.compression` / `plan.quantization`, the plan JSON and `plan.explain()`.
    `per_group_tp`: on clusters of several device groups, also consider pipelines that run
    each group at its own TP degree (`StagePlacement.group_tp`; ZeRO-0, no EP): group-pure, and
    (throughput objective) one pipeline whose stages change group and degree once
    (`meshplan.solver_layouts`).
    `equal_shares`: every replica runs the same number of micro-batches (no uneven DP shares
    across GPU types), as planners without them assume (Sailor); throughput and cost only.
    `precision`: fp32, tf32, bf16, fp16 or fp8 mixed precision (`resolve_precision`; default
    the model's own dtype), recorded in the plan and applied by the runtime.
    `hybrid_precision` (per-group precision, QSync; changes numerics, so "off" by default):
    "auto" also plans with the transformer blocks' linears of each slower device group in FP8
    (where its GPU has it) or int8 forward GEMMs (`hybrid_options`), keeping the fastest plan
    whose quantized share of the step's FLOPs (`quantized_fraction`) is at most
    `max_quantized_fraction`; a mapping {group: "int8" | "fp8"} pins it.
    `sensitivity` ({linear path inside a layer: relative loss increase}, as
    `meshplan.measure.linear_sensitivity` measures it on the user's model and data): lower
    only the linears `chosen_linears` picks within `max_loss_increase` (their summed
    sensitivity), recorded in the plan (`hybrid_linears`); None lowers every linear of the
    layers.
    `host_us`: the host's microseconds per traced op of an eager forward + backward
    (`meshplan.cost_model.host`; default `MESHPLAN_HOST_US` or `HOST_NODE_S`, 50, measured
    on a GPU machine's host; 0: the host never holds the GPU up).
    Raises `InfeasibleError` with the binding constraint when no plan fits.
    """
    comm, quant_acts = comm_options(compress, quantize, codec)
    cluster = as_cluster(cluster)
    if host_us is not None and not 0.0 <= host_us < MAX_HOST_US:
        raise ValueError(
            f"host_us is microseconds per traced op, from 0 to under {MAX_HOST_US:g}; "
            f"got {host_us!r}"
        )
    graph = as_graph(model, example_inputs, progress=progress)
    engine = EAGER if host_us is None else Engine(host_node_s=host_us * 1e-6)
    precision, dtype, engine, note = resolve_precision(graph, cluster, precision, engine)
    pinned = parallel or Parallel()
    if pinned.quantize_activations and not quant_acts:
        raise ValueError(
            "parallel.quantize_activations=True changes numerics: pass quantize='activations' "
            f"or 'auto' (got quantize={quantize!r})"
        )
    if global_batch is not None and pinned.global_batch not in (None, global_batch):
        raise ValueError(
            f"global_batch={global_batch} conflicts with parallel.global_batch="
            f"{pinned.global_batch}"
        )
    gb = global_batch or pinned.global_batch
    if not gb:
        per_step = (pinned.dp or 1) * (pinned.micro_batch or 1)
        gb = default_global_batch(
            graph.info.seq_len or 1, cluster, params=graph.num_params(), per_step=per_step
        )
    pinned = dataclasses.replace(pinned, global_batch=gb)
    degrees = [(k, getattr(pinned, k)) for k in ("dp", "tp", "pp", "cp")]
    given = [(k, v) for k, v in degrees if v is not None]
    if math.prod(v for _, v in given) > cluster.world_size:  # the user's own numbers, first
        product = "*".join(k for k, _ in given)
        raise InfeasibleError(
            f"no plan: {product} = {'*'.join(str(v) for _, v in given)} = "
            f"{math.prod(v for _, v in given)} GPUs pinned, but cluster {cluster.name} has "
            f"{cluster.world_size}"
        )
    if progress:
        progress(f"solving for {cluster.world_size} GPUs")
    goal = Objective(objective, target_tokens_per_s, tuple(sorted((prices or {}).items())))

    def solved(eng: Engine, tp_one: bool = False) -> SolveResult:
        if tp_one and pinned.tp not in (None, 1):
            raise ValueError(
                f"per-group precision runs its groups at tp 1, but tp={pinned.tp} is pinned"
            )
        return solve(
            graph,
            cluster,
            dataclasses.replace(pinned, tp=1) if tp_one else pinned,
            global_batch=gb,
            time_limit_s=time_limit_s,
            progress=progress,
            objective=goal,
            comm=comm,
            quantize=quant_acts,
            per_group_tp=per_group_tp,
            equal_shares=equal_shares,
            dtype=dtype,
            engine=eng,
        )

    options = hybrid_options(cluster, hybrid_precision, dtype)
    if sensitivity is not None and options == [()]:
        raise ValueError(
            "sensitivity chooses the linears per-group precision lowers: pass "
            "hybrid_precision='auto' or a mapping of groups to int8/fp8"
        )
    if options != [()] and sensitivity is not None:
        linears = chosen_linears(graph, sensitivity, max_loss_increase)
        say = progress or (lambda _m: None)
        if not linears:
            say(
                f"per-group precision: no linear within the {max_loss_increase:.2%} loss budget; "
                "planned without it"
            )
            options = [()]
        else:
            say(f"per-group precision on {', '.join(linears)} (within {max_loss_increase:.2%})")
            engine = dataclasses.replace(engine, hybrid_linears=linears)
    if options == [()]:
        result = solved(engine)
    else:
        result, engine = _hybrid_search(
            graph, options, solved, engine, max_quantized_fraction, pinned=options[0] != (),
            say=progress or (lambda _m: None),
        )  # fmt: skip
    decisions = ()
    if comm is not None:
        pricer = pricer_for(graph, cluster, dtype, comm, engine=engine)
        decisions = plan_decisions(pricer, result.parallel, result.stages)
    source = ""
    if comm is not None and comm.lossless:
        source = comm.codec.source if comm.codec else "per-GPU estimate (compression.py)"
    return Plan(
        model=_model_ref(graph),
        cluster=cluster,
        parallel=result.parallel,
        stages=with_chunks(graph, result.parallel, result.stages),
        ranks=assign_ranks(cluster, result.parallel, result.stages),
        predicted=_noted(result.prediction, note),
        solver=SolverInfo(
            status=result.status,
            gap=result.gap,
            candidates=result.candidates,
            objective=result.objective,
        ),
        placements=_placements(graph, result.parallel, result.stages),
        compression=CompressionPlan(compress, source, decisions),
        hybrid_precision=engine.hybrid,
        hybrid_linears=engine.hybrid_linears if engine.hybrid else (),
        quantization=quantization_plan(result.parallel, result.stages, quantize, decisions),
        precision=precision,
    )


COMPRESS_MODES = ("auto", "off")


def comm_options(
    compress: str, quantize: str, codec: CodecSpeed | None = None
) -> tuple[CommOptions | None, bool]:
    """(traffic options for the pricer, whether activation quantization is a search knob)
    from `plan`'s `compress` and `quantize` arguments; one-line ValueError on a bad value."""
    if compress not in COMPRESS_MODES:
        raise ValueError(f"compress must be one of {', '.join(COMPRESS_MODES)}, got {compress!r}")
    if quantize not in QUANT_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANT_MODES)}, got {quantize!r}")
    lossless = compress == "auto"
    int8 = quantize in ("auto", "gradients")
    comm = CommOptions(lossless, int8, codec) if lossless or int8 else None
    return comm, quantize in ("auto", "activations")


# -- user models ----------------------------------------------------------------------------


def load_model(
    spec: str, *, seq_len: int | None = None, micro_batch: int = 1
) -> tuple[torch.nn.Module, tuple]:
    """A preset name (`llama3-8b`) or `path/to/file.py:factory`.

    The factory is called with `seq_len=` and `micro_batch=` if it accepts them and must return
    `(model, example_inputs)`; build the model under `torch.device("meta")` for big configs.
    """
    from meshplan import models

    if ":" not in spec or spec.lower() in models.PRESETS:
        return models.get(spec, seq_len=seq_len, micro_batch=micro_batch)
    path_text, _, factory_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ModelLoadError(
            f"model file {path_text!r} not found (expected path/to/file.py:factory)"
        )
    module_name = f"meshplan_user_model_{abs(hash(str(path.resolve())))}"
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        assert module_spec and module_spec.loader
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file failed to import: say where, not a traceback
        raise ModelLoadError(f"{path}: failed to import ({type(e).__name__}: {e})") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelLoadError(f"{path}: no callable {factory_name!r} in the file")
    kwargs: dict[str, int] = {}
    params = inspect.signature(factory).parameters
    if seq_len is not None and "seq_len" in params:
        kwargs["seq_len"] = seq_len
    if "micro_batch" in params:
        kwargs["micro_batch"] = micro_batch
    try:
        with SkipInitOnMeta():  # a model built on meta has nothing to initialise
            result = factory(**kwargs)
    except Exception as e:
        raise ModelLoadError(f"{path}:{factory_name}() raised {type(e).__name__}: {e}") from None
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not isinstance(result[0], torch.nn.Module)
    ):
        raise ModelLoadError(
            f"{path}:{factory_name}() must return (model, example_inputs), got "
            f"{type(result).__name__}"
        )
    model, inputs = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return model, tuple(inputs)
