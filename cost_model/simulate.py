"""Step-time simulator: prices a placed parallel configuration (`predict`).

The step of one optimizer update of `global_batch` sequences, for a configuration with
pipeline depth pp, m = global_batch / (dp * micro_batch) micro-batches per pipeline, is

    step = (m - 1) * U + sum_s u_s + (m + pp - 1) * P      pipeline (1F1B or GPipe)
         + rep * max_s (C_s - eta * min(C_s, W_s))          exposed data-parallel traffic
         + O                                                optimizer update

- u_s: forward + backward time of one micro-batch on stage s (compute, recomputation, TP, CP
  and EP communication, which sit on the critical path), the maximum over the device groups
  that hold replicas of s (replicas of one stage run in lock-step). U = max_s u_s. With equal
  stages the pipeline term is (m + pp - 1) * (U + P): the classic 1F1B/GPipe bubble of
  (pp - 1) stage times (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21); with unequal stages the fill and drain pass every stage
  once, so the bubble is sum_s u_s - U + (pp - 1) * P.
- EP across device groups: an expert-parallel group is ep consecutive dp ranks, so where a
  stage's replicas are split over groups (dp indices in placement order) an ep group can
  hold ranks of several groups; its all-to-alls then send the share of their bytes that goes
  to the other groups over those groups' path (NICs, and a shared GroupLink such as a WAN),
  not over the group's own (`Pricer.ep_span_all_to_all`). `evaluate` prices the spanning
  ep groups of the placement it is given; the per-(stage, group) tables, which the CP-SAT
  model reads, hold for a group too small for a whole ep group the cheapest such span.
- P: the point-to-point time of one micro-batch's boundary activation (forward send plus
  backward send) over the slowest stage boundary, on the link between the two stages' groups;
  each TP rank sends 1/tp of it (Megatron's scatter/gather, Narayanan et al. sec. 4.1).
- Interleaved 1F1B with v model chunks per rank (`Parallel.virtual_stages`): the fill and
  drain shrink by v, so the bubble
  is (sum_s u_s - U) / v + (pp - 1) * P, a fraction (p - 1) / (v m + p - 1) for equal stages,
  and every chunk boundary sends, so the p2p term is m * v * P.
- Which chunks a rank runs (interleaved 1F1B, ZB-V): the stages' own (`StagePlacement.chunks`,
  e.g. a framework's uneven virtual stages: torchtitan's first/last_stage_less_layers over
  pp * v stages, Megatron's first/last-stage layers split over v chunks) when they list them,
  else the layout the planner searches (`partition.rank_chunks`: equal chunks, or Megatron's
  with the embedding and the loss counted as a layer). u_s is then the sum over rank s's
  chunks of their blocks' times, as is its memory and its DP traffic. The formulas above are
  unchanged with chunks of unequal size: each rank still sends at m * v chunk boundaries per
  direction, and P is the slowest boundary crossing between ranks s and s + 1 in either
  direction (the output of every chunk that hands off to the other rank; the wrap from the
  last rank to the first is not priced on its own link); the fill and drain are priced at
  each rank's mean chunk, (sum_s u_s - U) / v, exact when a rank's chunks are equal (under
  ZB-V, Z takes each chunk as half its rank's time likewise).
- Zero bubble (`Schedule.ZERO_BUBBLE`): ZB-V (Qi et al., "Pipeline Parallelism with
  Controllable Memory", 2024; torch's `ScheduleZBVZeroBubble`, what the runtime runs). Each rank
  holds two chunks in a V; backward is split into B (input gradient) and W (weight gradient),
  and W fills the bubbles. With per-chunk times f, b, w (half the stage's forward,
  backward-for-inputs incl. recomputation, weight gradient; communication split evenly between
  forward and backward) the pipeline term is m U + (pp - 1) Z + (2 m + pp - 1) P with
  Z = max_s max(f_s, b_s, 2 (b_s - w_s)). The form was fitted to an event simulation of torch's
  own ZB-V action order (tests/cost_model/test_zero_bubble.py): exact for f = b = w, within 4%
  of the pipeline time for b / f in 0.8-2.5 and w / f in 0.1-1.2 (transformer layers: w ~ f,
  b >= f); it under-prices W much larger than B, which layers do not have. W is the weight-gradient
  share of backward: dW costs the forward FLOPs of every op with parameters (`BlockFacts`).
- Uneven DP batch shares across GPU types (`StagePlacement.microbatches`): the pipelines are
  group-pure (every stage has the same replicas per group) and each replica in group g runs
  m_g micro-batches, sum_g n_g m_g = dp * m. The pipeline term is then the maximum over the
  groups of the formula above with m_g and group g's own stage times and boundaries (HetPipe /
  Whale-style load balancing); ZeRO-3 is excluded (its per-micro-batch gathers are lock-step).
- Per-stage TP layouts (`StagePlacement.group_tp` on any stage, stages free to differ: a
  pipeline whose stages run at different degrees on different GPU types, stages mixing
  groups, as Sailor, Metis and AMP plan; `layout_tables`). Stage s's replicas in group g run
  at their own degree t_sg (sequence parallelism where t_sg > 1 and the configuration asks
  for it), and the formula above holds with
  - u_sg: the stage's time at t_sg (`Pricer.stage_time`); u_s = max_g u_sg over the groups
    holding replicas of s (lock-step, as above);
  - P: the slowest hand-off a pipeline makes (pipeline i is dp index i of every stage,
    `handoff_pairs`). From stage s on (a, t_a) to s + 1 on (b, t_b) the boundary activation
    A (bytes per micro-batch and replica) crosses once, cut into pieces: every sender holds
    it whole (its 1/t_a sequence shard under SP) and every receiver needs it whole (its
    1/t_b shard), so a rank on the side with fewer ranks moves A / (cp min(t_a, t_b)),
    forward and again backward, on the path between a and b (their own link when a = b,
    else the cross-group path, a shared GroupLink divided among n_ab cp min(t_a, t_b)
    streams, n_ab the pipelines making that hand-off; `Pricer.handoff`). Equal degrees give
    the A / (cp tp) above; the all-gather that re-replicates the pieces inside a receiving
    TP group without SP stays on its node's link and is not priced, as for equal degrees;
  - C_s: a stage inside one group reduces as below at its degree; a stage whose replicas
    sit in several groups reduces piece-wise (`Pricer.hetero_dp_traffic`: each TP-sharded
    parameter cut into L = lcm of the stage's degrees, a rank at degree t running L / t
    all-reduces over the dp * cp ranks holding a piece), priced across each pair of its
    groups (`Pricer.dp_cross_hetero`, raw: the runtime does not code it), the slowest pair;
    W_s = max_g of the windows at t_sg;
  - O: the largest over (s, g) of the update and syncs at t_sg, plus, across groups, the
    loss all-reduce's hop up and down the slowest link; memory per (s, g) at t_sg.
  ZeRO-0 and ep = 1 only, interleaved 1F1B only on group-pure pipelines
  (`ir.parallel.stage_tp_problem`). On group-pure pipelines with uneven shares (what the
  planner searches, `hetero_tables`) this is the shares formula above at each group's own
  degree.
- C_s: the data-parallel traffic of stage s, W_s: the compute it overlaps with. ZeRO 0-2
  reduce gradients once per step (all-reduce, or reduce-scatter + all-gather), overlapped with
  the last micro-batch's forward + backward (rep = 1; ZeRO-0 only its backward: the gradient
  all-reduce; ZeRO-1/2 also all-gather the updated weights under the next step's first
  forward, Megatron-LM `--overlap-param-gather`). ZeRO-3 all-gathers the weights in forward and in
  backward and reduce-scatters gradients for every micro-batch, overlapped with that
  micro-batch's forward + backward (rep = m). eta = `OVERLAP_EFFICIENCY`: overlap hides at
  most that fraction of the traffic, and only as much as fits in the window; the rest is
  exposed, i.e. C - eta * min(C, W) = max(C - eta * W, (1 - eta) * C). Echo (Feng et al.,
  "Echo: Simulating Distributed Training At Scale", arXiv 2412.12487, 2024) and dPRO (Hu et
  al., "dPRO: A Generic Performance Diagnosis and Optimization Toolkit for Expediting
  Distributed DNN Training", MLSys'22) find that the hard part of simulating training is
  precisely that overlap is neither free nor fully exposed (communication slows the compute it
  overlaps with), so even fully overlapped traffic costs (1 - eta) of itself here.
- O: the Adam update, memory-bound (`OPTIMIZER_BYTES_PER_PARAM`), slowest rank, plus the
  once-per-step synchronisations that run exposed around it (`Pricer.step_sync_time`): under
  sequence parallelism the all-reduce over tp of each norm weight's gradient, and the scalar
  loss all-reduce over all ranks. The breakdown reports them under "optimizer".

The traced graph's costs are for `graph.info.micro_batch` sequences; a configuration's
micro-batch scales every compute and activation cost linearly (compute.py, memory.py).

`PlanTables` holds, for one configuration and stage split, every number above per (stage,
group) or (boundary, group pair), so that `evaluate` prices any placement with a handful of
max/sum operations; the CP-SAT planner (`meshplan.planner.solver`) encodes exactly the same
formula over the same tables, so that a plan and its `predict` agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshplan.ir import (
    Cluster,
    GpuSpec,
    Graph,
    Parallel,
    Prediction,
    RankMemory,
    Schedule,
    StagePlacement,
    group_tp_problem,
)
from meshplan.ir.devices import matmul_dtype
from meshplan.ir.parallel import cp_span_problem, stage_tp_problem
from meshplan.ir.rules import (
    batch_split_problem,
    cp_split_problem,
    ep_dp_problem,
    ep_tp_problem,
    zero_bubble_problem,
)
from meshplan.passes.partition import (
    layer_counts,
    listed_chunks_problem,
    rank_layers,
    tp_domain_problem,
)

from .compression import (
    CommOptions,
)
from .engine import EAGER, Engine
from .ep_traffic import EpSpan, ep_spans
from .pricer import OVERLAP_EFFICIENCY, StageTime, pricer_for
from .tables import PlanTables, layout_tables, plan_tables

# Schedules the planner searches (the CP-SAT model encodes their step formula) and `predict`
# prices.
SUPPORTED_SCHEDULES = (
    Schedule.ONE_F_ONE_B,
    Schedule.GPIPE,
    Schedule.INTERLEAVED_1F1B,
    Schedule.ZERO_BUBBLE,
)
PRICED_SCHEDULES = SUPPORTED_SCHEDULES

BREAKDOWN_PARTS = (
    "compute",
    "host",
    "recompute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pp_p2p",
    "pp_bubble",
    "dp_comm_exposed",
    "optimizer",
)


# ---------------------------------------------------------------------------------------------
# The step-time formula over a placement
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The step time of one placement and its breakdown (seconds)."""

    step_time_s: float
    breakdown: tuple[tuple[str, float], ...]
    bottleneck_stage: int
    bottleneck_group: str


Placement = Sequence[Sequence[tuple[str, int]]]  # [stage] -> ((group, replicas), ...)


def _pipeline(
    tables: PlanTables, stage_u: list[float], m: int, p2p: float, z: float = 0.0
) -> float:
    """m U + (sum_s u_s - U) / v + (pp - 1) Z + (m v + pp - 1) P: the pipeline term of one
    pipeline (Z, ZB-V's bubble unit, is 0 for the other schedules and 1/v is then 0)."""
    v, big_u = tables.chunks, max(stage_u)
    fill = (sum(stage_u) - big_u) * tables.fill + (tables.pp - 1) * z
    return m * big_u + fill + (m * v + tables.pp - 1) * p2p


def evaluate(
    tables: PlanTables, placement: Placement, shares: Mapping[str, int] | None = None
) -> Evaluation:
    """Price `placement` with the step-time formula of the module docstring.

    `shares` (group -> micro-batches per replica, uneven DP batch shares) prices group-pure
    pipelines: each group's pipelines run the formula with their own m_g over their own stage
    times, and the slowest group sets the pipeline term; DP traffic and the optimizer are as
    without shares (all replicas reduce together once their micro-batches are done)."""
    pp = tables.pp
    used = [[g for g, n in reps if n > 0] for reps in placement]
    if len(used) != pp or any(not u for u in used):
        raise ValueError("placement must give every stage at least one replica")
    if shares:
        # Group-pure pipelines: the slowest group's pipeline (with its own m_g) is the step's.
        def group_term(g: str) -> float:
            us = [tables.time[s][g].total for s in range(pp)]
            p = max((tables.p2p[s][(g, g)] for s in range(pp - 1)), default=0.0)
            z = max(tables.bubble_unit(s, g) for s in range(pp))
            return _pipeline(tables, us, shares[g], p, z)

        slow = max(sorted(shares), key=group_term)
        m = shares[slow]
        used_pipe = [[slow] for _ in range(pp)]
    else:
        m = tables.m
        used_pipe = used
    times = tables.time if shares else _span_times(tables, placement)
    stage_u, stage_g = [], []
    for s in range(pp):
        g = max(used_pipe[s], key=lambda x: times[s][x].total)
        stage_g.append(g)
        stage_u.append(times[s][g].total)
    s_star = max(range(pp), key=lambda s: stage_u[s])
    big_u = stage_u[s_star]
    # Layout tables (`layout_tables`) hold only the hand-offs the placement's pipelines make;
    # under spanning cp groups each cp rank's hand-off stays inside its group.
    p2p = max(
        (
            tables.p2p[s].get((a, b), 0.0)
            for s in range(pp - 1)
            for a in used_pipe[s]
            for b in used_pipe[s + 1]
            if not tables.cp_span or a == b
        ),
        default=0.0,
    )
    crossing = sum(1 for u in used if len(u) > 1)
    exposed = 0.0
    for s in range(pp):
        if len(used[s]) == 1:
            comm = tables.dp_single[s][used[s][0]]
        else:
            order = [g for g in tables.groups if g in used[s]]
            comm = max(
                tables.dp_cross[s][(a, b)].time(crossing)
                for i, a in enumerate(order)
                for b in order[i + 1 :]
            )
        window = max(tables.window[s][g] for g in used[s])
        exposed = max(exposed, comm - OVERLAP_EFFICIENCY * min(comm, window))
    optimizer = max(tables.optimizer[s][g] for s in range(pp) for g in used[s])
    t = times[s_star][stage_g[s_star]]
    v = tables.chunks
    z = max(
        times[s][g].zb_bubble if tables.zero_bubble else 0.0
        for s in range(pp)
        for g in used_pipe[s]
    )
    parts = {
        "compute": m * (t.compute - t.host),
        # the GPU waiting for the host to issue the kernels (`cost_model.host`)
        "host": m * t.host,
        "recompute": m * t.recompute,
        "tp_comm": m * t.tp_comm,
        "cp_comm": m * t.cp_comm,
        "ep_comm": m * t.ep_comm,
        "pp_p2p": m * v * p2p,
        "pp_bubble": (sum(stage_u) - big_u) * tables.fill + (pp - 1) * (z + p2p),
        # ZeRO-3's unoverlapped first gather and last reduce-scatter of each micro-batch
        # (`StageTime.dp_edge`, inside U) count as exposed data-parallel traffic.
        "dp_comm_exposed": tables.rep * exposed + m * t.dp_edge,
        "optimizer": optimizer,
    }
    breakdown = tuple((k, parts[k]) for k in BREAKDOWN_PARTS)
    return Evaluation(sum(parts.values()), breakdown, s_star, stage_g[s_star])


def _span_times(tables: PlanTables, placement: Placement) -> list[dict[str, StageTime]]:
    """Per (stage, group) the StageTime a rank there takes under `placement`: the table's,
    but where the stage's ep groups span device groups (`ep_spans`), the slowest of the
    spanning ep groups the group takes part in, priced with every spanning ep group of the
    step crossing at once (tp * cp per spanning chunk, over all stages)."""
    ep = tables.parallel.ep or 1
    if ep <= 1 or tables.ep_span is None:
        return tables.time
    per_stage = [ep_spans([(g, n) for g, n in reps if n > 0], ep) for reps in placement]
    chunks = sum(len(spanning) for spanning, _ in per_stage)
    if not chunks:
        return tables.time
    streams = chunks * (tables.parallel.tp or 1) * (tables.parallel.cp or 1)
    out = []
    for s, (spanning, whole) in enumerate(per_stage):
        row = dict(tables.time[s])
        priced: set[str] = set(whole)  # groups whose row already holds a time that applies
        for members in spanning:
            span = EpSpan(members, streams)
            for g, _ in members:
                t = tables.ep_span(s, g, span)
                # without a whole ep group in g, the table's time (in-group EP) does not apply
                if g not in priced or t.total > row[g].total:
                    row[g] = t
                priced.add(g)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# Public entry
# ---------------------------------------------------------------------------------------------


def check_parallel(
    graph: Graph, cluster: Cluster, parallel: Parallel, stages: Sequence[StagePlacement]
) -> None:
    """Raise ValueError (one line) when `parallel` and `stages` do not describe a valid step."""
    p = parallel
    if not p.is_complete:
        missing = [
            k
            for k in Parallel.__dataclass_fields__
            if getattr(p, k) is None and k != "virtual_stages"
        ]
        raise ValueError(f"predict needs a complete Parallel; missing {', '.join(missing)}")
    if p.schedule not in PRICED_SCHEDULES:
        raise ValueError(
            f"schedule {p.schedule.value!r} is not modelled yet; use "
            + " or ".join(repr(s.value) for s in PRICED_SCHEDULES)
        )
    rules = (
        lambda: batch_split_problem(p.global_batch, p.dp, p.micro_batch),
        lambda: ep_dp_problem(p.ep, p.dp),
        lambda: ep_tp_problem(p.ep, p.tp, p.sequence_parallel),
        lambda: zero_bubble_problem(p.schedule, p.pp, p.num_microbatches),
        lambda: cp_split_problem(p, graph.info.seq_len, graph.info.heads),
    )
    for rule in rules:
        if why := rule():
            raise ValueError(why)
    if len(stages) != p.pp:
        raise ValueError(f"pp={p.pp} but {len(stages)} stage placements were given")
    shares = stages[0].microbatches if stages else ()
    if shares or any(st.microbatches for st in stages):
        if any(
            (st.replicas, dict(st.microbatches)) != (stages[0].replicas, dict(shares))
            for st in stages
        ):
            raise ValueError(
                "uneven micro-batch shares need group-pure pipelines: every stage must have "
                "the same replicas and shares"
            )
        if p.zero == 3:
            raise ValueError(
                "uneven micro-batch shares need ZeRO <= 2 (ZeRO-3 gathers weights in lock-step "
                "for every micro-batch)"
            )
        total = sum(n * dict(shares)[g] for g, n in stages[0].replicas)
        if total != p.dp * p.num_microbatches:
            raise ValueError(
                f"micro-batch shares add up to {total} micro-batches, but dp * num_microbatches "
                f"= {p.dp}*{p.num_microbatches} = {p.dp * p.num_microbatches}"
            )
    if any(st.group_tp for st in stages) and (why := stage_tp_problem(p, tuple(stages))):
        raise ValueError(why)
    v_shape = p.schedule == Schedule.ZERO_BUBBLE
    if any(st.chunks for st in stages):
        if why := listed_chunks_problem(graph, stages, p.chunks if p.pp > 1 else 1, v_shape):
            raise ValueError(why)
    elif p.pp > 1 and p.chunks > 1:
        counts = layer_counts(graph, [(st.first_unit, st.last_unit) for st in stages])
        want = rank_layers(sum(counts), p.pp, p.chunks, v_shape)
        if counts != want:
            raise ValueError(
                f"schedule {p.schedule.value!r} runs {p.chunks} chunks per rank: its chunk "
                f"layout (`partition.chunk_layers`) gives the ranks {list(want)} layers, but "
                f"the stages hold {list(counts)}"
            )
    expect = 0
    for i, st in enumerate(stages):
        if st.index != i or st.first_unit != expect:
            raise ValueError(f"stage {i} must start at unit {expect}, got {st.first_unit}")
        if st.dp != p.dp:
            raise ValueError(f"stage {i} has {st.dp} replicas but dp={p.dp}")
        expect = st.last_unit
    if expect != len(graph.units):
        raise ValueError(f"stages cover units [0, {expect}) of {len(graph.units)}")
    used: dict[str, dict[int, int]] = {}  # group -> {tp: replicas over all stages}
    known = {g.name: g for g in cluster.groups}
    if why := cp_span_problem(p, tuple(stages)):
        raise ValueError(why)
    spanned: dict[str, int] = {}  # GPUs the spanning stages take from each group
    for st in stages:
        if st.cp_groups:  # every stage alike (`cp_span_problem`): its cp ranks group by group
            for g, n in st.gpus(p.tp, p.cp).items():
                spanned[g] = spanned.get(g, 0) + n
            for g, need in spanned.items():
                if g not in known:
                    raise ValueError(f"stage {st.index}: unknown device group {g!r}")
                if (why := tp_domain_problem((known[g],), p.tp)) is not None:
                    raise ValueError(why)
                if need > known[g].num_gpus:
                    raise ValueError(
                        f"group {g}: {st.index + 1} stage(s) of {st.dp} replicas of "
                        f"{dict(st.cp_groups)[g]} cp ranks x tp={p.tp} need {need} GPUs, it "
                        f"has {known[g].num_gpus}"
                    )
            continue
        for g, n in st.replicas:
            if g not in known:
                raise ValueError(f"stage {st.index}: unknown device group {g!r}")
            by_tp = used.setdefault(g, {})
            tp = st.tp_of(g, p.tp)
            by_tp[tp] = by_tp.get(tp, 0) + n
    for g, by_tp in used.items():
        for tp in by_tp:
            if (why := tp_domain_problem((known[g],), tp)) is not None:
                raise ValueError(why)
        need = sum(n * tp * p.cp for tp, n in by_tp.items())
        if len(by_tp) == 1 and need > known[g].num_gpus:
            ((tp, n),) = by_tp.items()
            raise ValueError(
                f"group {g}: {n} replicas of tp*cp={tp * p.cp} GPUs need "
                f"{n * tp * p.cp} GPUs, it has {known[g].num_gpus}"
            )
        if need > known[g].num_gpus:
            parts = " + ".join(f"{n} of tp*cp={tp * p.cp}" for tp, n in sorted(by_tp.items()))
            raise ValueError(
                f"group {g}: its replicas ({parts} GPUs) need {need} GPUs, "
                f"it has {known[g].num_gpus}"
            )


def predict(
    graph: Graph,
    cluster: Cluster,
    parallel: Parallel,
    stages: Sequence[StagePlacement],
    *,
    dtype: str | None = None,
    comm: CommOptions | None = None,
    engine: Engine = EAGER,
) -> Prediction:
    """Predict step time, throughput, MFU and per-(stage, group) peak memory of a placed config.

    `parallel` must be complete; `stages` give each pipeline stage's unit range and replicas
    per device group (`meshplan.passes.partition.place_stages` makes the default one). The
    graph's costs are for `graph.info.micro_batch` sequences of `graph.info.seq_len` tokens;
    `parallel.micro_batch` scales them linearly. MFU counts the model's FLOPs
    (`graph.total_flops(training=True)`, scaled to the global batch, recomputation excluded)
    over the dense peak of every GPU the plan uses, in `dtype` (None: the model's own,
    `compute_dtype`: a bf16 model trains in bf16 mixed precision, an fp32 one in fp32).
    `comm` (compression.CommOptions): what
    may be done to traffic (lossless coding, int8 gradients), each collective at its fastest
    allowed method; None prices raw collectives (what published runs did).
    `engine` (`cost_model.engine.Engine`): fused kernels, Float8, TP overlap and the
    selective-recomputation policy as other stacks run them; the default is meshplan's eager
    runtime (selective recomputation keeps every linear).
    """
    check_parallel(graph, cluster, parallel, stages)
    p = parallel
    pricer = pricer_for(graph, cluster, dtype, comm, engine)
    dtype = pricer.dtype
    ranges = [(st.first_unit, st.last_unit) for st in stages]
    names = tuple(g.name for g in cluster.groups if any(g.name in st.groups for st in stages))
    span = stages[0].cp_groups  # cp groups spanning device groups (alike in every stage)
    shares = stages[0].shares
    most = max(shares.values()) if shares else None
    layout = any(st.group_tp for st in stages)
    if layout:
        tables = layout_tables(pricer, p, stages, max_microbatches=most)
    else:
        # the stages' own model chunks (interleaved 1F1B, ZB-V) when they list them
        chunks = [st.chunks for st in stages] if any(st.chunks for st in stages) else []
        tables = plan_tables(
            pricer, p, ranges, names, max_microbatches=most, chunks=chunks, cp_span=span
        )
    # a spanning stage's ranks are in every group it spans, in lock-step
    placement = [tuple((g, st.dp) for g in st.groups) if span else st.replicas for st in stages]
    ev = evaluate(tables, placement, shares or None)

    traced_mb = pricer.costs.traced_micro_batch
    model_flops = graph.total_flops(training=True) * p.global_batch / traced_mb
    peak_flops = sum(
        n * pricer.groups[g].gpu.peak(matmul_dtype(pricer.groups[g].gpu, dtype))
        for st in stages
        for g, n in st.gpus(p.tp, p.cp).items()
    )
    tokens = p.global_batch * (graph.info.seq_len or 1)

    def stage_memory_of(s: int, g: str) -> tuple[int, tuple[tuple[str, int], ...]]:
        return tables.group_memory[s][g] if tables.group_memory else tables.memory[s]

    memory = tuple(
        RankMemory(
            stage=st.index,
            group=g,
            peak_bytes=stage_memory_of(st.index, g)[0],
            capacity_bytes=pricer.groups[g].gpu.memory_bytes,
            breakdown=stage_memory_of(st.index, g)[1],
        )
        for st in stages
        for g in st.groups
    )
    notes = []
    if not graph.info.micro_batch:
        notes.append("graph.info.micro_batch is unknown: costs taken as one sequence")
    elif p.micro_batch != traced_mb:
        notes.append(
            f"costs scaled linearly from the traced micro-batch {traced_mb} to {p.micro_batch}"
        )
    if not graph.info.seq_len:
        notes.append("graph.info.seq_len is unknown: tokens/s counts sequences")
    notes += graph.info.assumptions  # what the trace assumed about the data (`ir.trace`)
    for st in stages if p.ep > 1 else ():
        for members in ep_spans(st.replicas, p.ep)[0]:
            split = " | ".join(f"{n} in {g}" for g, n in members)
            notes.append(
                f"stage {st.index}: an ep group spans device groups ({split}): its "
                "all-to-alls cross between the groups"
            )
    refused = group_tp_problem(p, tuple(stages)) if layout else None
    if refused is not None:
        notes.append(f"priced, but the runtime cannot run this layout: {refused}")
    edge = tables.time[ev.bottleneck_stage][ev.bottleneck_group].dp_edge
    if edge > 0:
        notes.append(
            f"ZeRO-3: each micro-batch's first-unit all-gather and last reduce-scatter run "
            f"exposed ({edge * 1e3:.2f} ms, in dp_comm_exposed); the other units' gathers and "
            "reduce-scatters overlap with compute"
        )
    bottleneck = f"bottleneck: stage {ev.bottleneck_stage} on {ev.bottleneck_group}"
    notes.append(bottleneck)
    waited = dict(ev.breakdown).get("host", 0.0)
    if waited > 0:
        node_s = pricer.host_default() if engine.host_node_s is None else engine.host_node_s
        notes.append(
            f"host: the GPU waits {waited * 1e3:.1f} ms a step for Python to issue its kernels "
            f"(eager PyTorch at {node_s * 1e6:g} us a traced op; --host-us or "
            "MESHPLAN_HOST_US set your host's figure, cost_model/host.py)"
        )
    latency = _latency_sources([pricer.groups[g].gpu for g in names])
    if not engine.is_eager:
        latency = f"analytic roofline, engine {engine.describe()}"
    notes.append(f"op latency: {latency}")
    step = ev.step_time_s
    return Prediction(
        step_time_s=step,
        tokens_per_s=tokens / step if step > 0 else math.inf,
        mfu=model_flops / (step * peak_flops) if step > 0 and peak_flops > 0 else 0.0,
        model_flops_per_step=float(model_flops),
        peak_memory_bytes=max(r.peak_bytes for r in memory),
        fits=all(r.fits for r in memory),
        breakdown=ev.breakdown,
        memory=memory,
        notes=tuple(notes),
        latency_source=latency,
    )


def _latency_sources(gpus: Sequence[GpuSpec]) -> str:
    """The op-latency model of each GPU type used (one text when they all agree)."""
    from .compute import latency_source

    by_type = {g.name: latency_source(g) for g in gpus}
    if len(set(by_type.values())) == 1:
        return next(iter(by_type.values()))
    return "; ".join(f"{name}: {src}" for name, src in sorted(by_type.items()))
