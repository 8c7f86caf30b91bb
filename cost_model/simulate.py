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

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from meshplan.ir import (
    Cluster,
    GpuSpec,
    Graph,
    Parallel,
    Prediction,
    RankMemory,
    Schedule,
    StageConfig,
    StagePlacement,
    group_tp_problem,
)
from meshplan.ir.parallel import stage_tp_problem
from meshplan.ir.rules import (
    batch_split_problem,
    ep_dp_problem,
    ep_tp_problem,
    zero_bubble_problem,
)
from meshplan.passes.partition import (
    layer_counts,
    listed_chunks_problem,
    rank_chunks,
    rank_layers,
    replica_capacity,
    tp_domain_problem,
)

from .compression import (
    CommOptions,
)
from .dp_traffic import CrossTraffic
from .engine import EAGER, Engine
from .ep_traffic import EpSpan, ep_spans
from .graph_costs import Composition
from .memory import (
    in_flight_microbatches,
)
from .pricer import OVERLAP_EFFICIENCY, Pricer, StageTime, pricer_for

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
# Tables of one configuration, and the step-time formula over a placement
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PlanTables:
    """Every number of the step-time formula for one complete `Parallel` and stage split, per
    stage and device group (the groups in `groups`). Built by `plan_tables`; priced for a
    placement by `evaluate`. Times in seconds, memory in bytes."""

    parallel: Parallel
    ranges: tuple[tuple[int, int], ...]
    groups: tuple[str, ...]
    m: int
    rep: int  # how often the DP traffic occurs per step (m for ZeRO-3, else 1)
    time: list[dict[str, StageTime]]  # [stage][group]
    window: list[dict[str, float]]  # [stage][group] overlap window of the DP traffic
    optimizer: list[dict[str, float]]  # [stage][group]
    memory: list[tuple[int, tuple[tuple[str, int], ...]]]  # [stage] (peak, breakdown)
    fits: list[dict[str, bool]]  # [stage][group]
    replica_capacity: dict[str, int]  # replicas of tp*cp GPUs each group can hold
    dp_single: list[dict[str, float]]  # [stage][group]: all replicas in that group
    dp_cross: list[dict[tuple[str, str], CrossTraffic]]  # [stage][(a, b)], a before b
    p2p: list[dict[tuple[str, str], float]] = field(default_factory=list)  # [boundary][(a, b)]
    chunks: int = 1  # model chunks per pipeline rank (interleaved 1F1B, ZB-V), else 1
    zero_bubble: bool = False  # ZB-V: the fill is (pp - 1) Z, not (S - U) / v
    # Per-group TP (`hetero_tables`): each group's tp, and each stage's (peak, breakdown) per
    # group (`memory` then holds the larger of the groups' peaks per stage). Empty otherwise;
    # `layout_tables` (degrees per stage) fills only `group_memory`.
    group_tp: dict[str, int] = field(default_factory=dict)
    group_memory: list[dict[str, tuple[int, tuple[tuple[str, int], ...]]]] = field(
        default_factory=list
    )
    # EP on several groups: (stage, group, EpSpan) -> the StageTime of a rank of that group
    # whose ep group spans groups (`Pricer.stage_time` with `span`). None: no EP all-to-all or
    # one group. `time[s][g]` of a group that cannot hold a whole ep group already holds the
    # cheapest span (`_ep_floor`); `evaluate` prices the placement's own spans with this.
    ep_span: Callable[[int, str, EpSpan], StageTime] | None = None

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return len(self.ranges)

    @property
    def fill(self) -> float:
        """Coefficient of (S - U) in the pipeline term: 1 / v, or 0 under ZB-V."""
        return 0.0 if self.zero_bubble else 1.0 / self.chunks

    def bubble_unit(self, s: int, g: str) -> float:
        """ZB-V's z[s, g] (0 for other schedules): the fill is (pp - 1) max_s z[s, g]."""
        return self.time[s][g].zb_bubble if self.zero_bubble else 0.0


def _dp_window(t: StageTime, zero: int) -> float:
    """Compute that the stage's DP traffic overlaps with (one micro-batch): ZeRO-3 gathers and
    reduces around every micro-batch's forward and backward; ZeRO-0 reduces gradients during
    the last backward; ZeRO-1/2 reduce-scatter during the last backward and all-gather the
    updated weights under the next step's first forward (Megatron-LM `--overlap-param-gather`,
    FSDP/ZeRO prefetch)."""
    if zero == 3 or zero in (1, 2):
        return t.compute + t.recompute
    return t.backward + t.recompute


def plan_tables(
    pricer: Pricer,
    parallel: Parallel,
    ranges: Sequence[tuple[int, int]],
    groups: Sequence[str] | None = None,
    *,
    max_microbatches: int | None = None,
    chunks: Sequence[Sequence[tuple[int, int]]] = (),
) -> PlanTables:
    """Price every (stage, group) and (boundary, group pair) of a complete configuration.

    `max_microbatches` (uneven DP shares: the largest per-replica share) sizes the in-flight
    activations of the memory check; default the configuration's num_microbatches. `chunks`
    (interleaved 1F1B, ZB-V): the unit ranges of each rank's model chunks
    (`StagePlacement.chunks`); empty: the chunk layout `partition.rank_chunks` (what the
    planner searches)."""
    p = parallel
    names = tuple(groups) if groups is not None else tuple(pricer.groups)
    tp, cp, ep, dp, mb = p.tp, p.cp, p.ep, p.dp, p.micro_batch
    sp, zero = bool(p.sequence_parallel), p.zero
    quant = bool(p.quantize_activations)
    cfg = p.stage()
    plain = dataclasses.replace(cfg, quantize_activations=False)  # memory: quantized per stage
    m = p.global_batch // (dp * mb)
    pp = len(ranges)
    world = pp * dp * cp * tp
    rep = m if zero == 3 else 1  # gradient reductions (and ZeRO-3 gathers) per step
    reductions = rep if dp * cp > 1 else 1  # of the SP norm gradients (`sp_grad_sync`)
    costs = pricer.costs
    held_ranges = _rank_ranges(pricer, p, ranges, chunks)  # each rank's chunks, in model order
    comps = _rank_compositions(pricer, p, ranges, chunks)
    starts = [held[0][0] for held in held_ranges]
    # ZeRO-3: the block of each stage's first unit, whose gather and reduce-scatter nothing
    # overlaps (`DataParallelTraffic.dp_edge`); None otherwise.
    edged = zero == 3 and dp * cp > 1
    firsts = [costs.unit_keys[a] if edged else None for a in starts]
    uniq: dict[tuple[Composition, str | None], dict] = {}
    for comp, first in zip(comps, firsts, strict=True):
        if (comp, first) in uniq:
            continue
        traffic = pricer.dp_traffic(comp, tp=tp, ep=ep, dp=dp, zero=zero, cp=cp, first=first)
        edge = pricer.dp_edge(first, tp=tp, ep=ep, dp=dp, cp=cp) if first else None
        times = {g: pricer.stage_time(comp, g, cfg) for g in names}
        if edge is not None:
            times = {
                g: dataclasses.replace(t, dp_edge=pricer.dp_single(edge, g, tp=tp, cp=cp))
                for g, t in times.items()
            }
        cross = {}
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                cross[(a, b)] = pricer.dp_cross(traffic, a, b, tp=tp, cp=cp)
        uniq[(comp, first)] = {
            "time": times,
            "window": {g: _dp_window(t, zero) for g, t in times.items()},
            # The optimizer update, and the step's exposed syncs around it (SP gradients of
            # the replicated parameters, the loss all-reduce).
            "opt": {
                g: pricer.optimizer_time(comp, g, tp=tp, ep=ep, dp=dp * cp, zero=zero)
                + pricer.step_sync_time(
                    comp, g, tp=tp, sp=sp, world=world, groups=names, reductions=reductions
                )
                for g in names
            },
            "single": {g: pricer.dp_single(traffic, g, tp=tp, cp=cp) for g in names},
            "cross": cross,
            "mem": pricer.stage_memory(comp, plain, dp=dp, zero=zero),
        }
    capacity = {g: replica_capacity(pricer.groups[g], tp, cp) for g in names}
    ep_span = None
    moe = any(costs.facts[k].a2a_bytes for comp in comps for k, _ in comp)
    if ep > 1 and len(names) > 1 and moe:

        def ep_span(s: int, g: str, span: EpSpan) -> StageTime:
            t = pricer.stage_time(comps[s], g, cfg, span)
            return dataclasses.replace(t, dp_edge=time[s][g].dp_edge)

        for (comp, _), u in uniq.items():
            for g in names:
                if capacity[g] < ep:  # every ep group with ranks here spans groups
                    floor = _ep_floor(pricer, comp, g, names, capacity, cfg)
                    if floor is not None:
                        floor = dataclasses.replace(floor, dp_edge=u["time"][g].dp_edge)
                        u["time"][g] = floor
                        u["window"][g] = _dp_window(floor, zero)
    time, window, opt, memory, fits, single, cross = [], [], [], [], [], [], []
    peaks: dict[tuple, tuple] = {}
    for s, comp in enumerate(comps):
        u = uniq[(comp, firsts[s])]
        held = in_flight_microbatches(p.schedule, s, pp, max_microbatches or m, p.chunks)
        # Quantized activations: the AGoQ widths depend on the stage (early: attention 4 bits).
        early = quant and 2 * (pp - s) > pp
        got = peaks.get((comp, held, early))
        if got is None:
            mem = u["mem"]
            if quant:
                mem = pricer.stage_memory(comp, cfg, dp=dp, zero=zero, stage=s, num_stages=pp)
            peak = mem.peak(held)
            fit = {g: peak[0] <= pricer.groups[g].gpu.memory_bytes for g in names}
            got = peaks[(comp, held, early)] = (peak, fit)
        time.append(u["time"])
        window.append(u["window"])
        opt.append(u["opt"])
        memory.append(got[0])
        fits.append(got[1])
        single.append(u["single"])
        cross.append(u["cross"])
    scale = mb / costs.traced_micro_batch
    streams = tp * cp * dp
    by_boundary: dict[str, dict[tuple[str, str], float]] = {}
    p2p = []
    for bkey in _boundary_keys(pricer, held_ranges):
        row = by_boundary.get(bkey)
        if row is None:
            # Megatron's scatter/gather optimisation (Narayanan et al. SC'21, sec. 4.1; also what
            # a sequence-parallel boundary sends): each TP rank sends 1/tp of the activation.
            size = costs.facts[bkey].output_bytes * scale / (cp * tp)
            row = by_boundary[bkey] = {
                (a, b): pricer.p2p(size, a, b, streams) for a in names for b in names
            }
        p2p.append(row)
    return PlanTables(
        parallel=p,
        ranges=tuple(ranges),
        groups=names,
        m=m,
        rep=rep,
        time=time,
        window=window,
        optimizer=opt,
        memory=memory,
        fits=fits,
        replica_capacity=capacity,
        dp_single=single,
        dp_cross=cross,
        p2p=p2p,
        chunks=p.chunks if pp > 1 else 1,
        zero_bubble=p.schedule == Schedule.ZERO_BUBBLE and pp > 1,
        ep_span=ep_span,
    )


def _ep_floor(
    pricer: Pricer,
    comp: Composition,
    g: str,
    names: Sequence[str],
    capacity: Mapping[str, int],
    cfg: StageConfig,
) -> StageTime | None:
    """A rank of group g whose ep group cannot fit in g (capacity[g] < ep replicas): the
    cheapest `EpSpan` it can be part of, over a partner group h and g's share c of the ep
    ranks (c <= capacity[g], ep - c <= capacity[h]), with the fewest streams (tp * cp: one
    spanning chunk). A lower bound on what `evaluate` charges any placement (exact for two
    groups split at one chunk); None when no partner can hold the rest."""
    ep, lanes = cfg.ep, cfg.tp * cfg.cp
    best: StageTime | None = None
    for h in names:
        if h == g:
            continue
        for c in range(max(1, ep - capacity[h]), min(capacity[g], ep - 1) + 1):
            span = EpSpan(((g, c), (h, ep - c)), streams=lanes)
            t = pricer.stage_time(comp, g, cfg, span)
            if best is None or t.total < best.total:
                best = t
    return best


def hetero_tables(
    pricer: Pricer,
    parallel: Parallel,
    ranges: Sequence[tuple[int, int]],
    group_tp: Mapping[str, int],
    *,
    max_microbatches: int | None = None,
) -> PlanTables:
    """`plan_tables` of a configuration whose device groups use their own TP degrees
    (`StagePlacement.group_tp`: group-pure pipelines, ZeRO-0), before placement: what the
    planner searches. `layout_tables` prices a placed layout whose stages may differ.

    Each group's entries (stage times, overlap windows, optimizer, memory, fits, replica
    capacity, boundaries inside the group) come from `plan_tables` at that group's tp
    (sequence parallelism where its tp > 1); the DP traffic of every stage spans the groups
    and is `Pricer.dp_cross_hetero`. Boundaries between different groups are infinite: a
    pipeline never leaves its group. `evaluate` prices these tables as any other."""
    names = tuple(group_tp)
    per = {
        g: _at_tp(pricer, parallel, ranges, g, tp, max_microbatches) for g, tp in group_tp.items()
    }
    first = per[names[0]]
    pp = first.pp
    comps = _rank_compositions(pricer, parallel, ranges)
    cross: list[dict[tuple[str, str], CrossTraffic]] = []
    made: dict[Composition, dict] = {}
    for comp in comps:
        row = made.get(comp)
        if row is None:
            row = made[comp] = {
                (a, b): pricer.dp_cross_hetero(
                    comp, a, b, group_tp, dp=parallel.dp, cp=parallel.cp or 1
                )
                for i, a in enumerate(names)
                for b in names[i + 1 :]
            }
        cross.append(row)
    group_memory = [{g: per[g].memory[s] for g in names} for s in range(pp)]
    hop = _loss_hops(pricer, names)
    p2p = [
        {(a, b): (per[a].p2p[s][(a, a)] if a == b else math.inf) for a in names for b in names}
        for s in range(pp - 1)
    ]
    return PlanTables(
        parallel=parallel,
        ranges=tuple(ranges),
        groups=names,
        m=first.m,
        rep=first.rep,
        time=[{g: per[g].time[s][g] for g in names} for s in range(pp)],
        window=[{g: per[g].window[s][g] for g in names} for s in range(pp)],
        optimizer=[{g: per[g].optimizer[s][g] + hop[g] for g in names} for s in range(pp)],
        memory=[max(row.values(), key=lambda x: x[0]) for row in group_memory],
        fits=[{g: per[g].fits[s][g] for g in names} for s in range(pp)],
        replica_capacity={g: per[g].replica_capacity[g] for g in names},
        dp_single=[{g: math.inf for g in names} for _ in range(pp)],
        dp_cross=cross,
        p2p=p2p,
        chunks=first.chunks,
        zero_bubble=first.zero_bubble,
        group_tp=dict(group_tp),
        group_memory=group_memory,
    )


def _at_tp(
    pricer: Pricer,
    parallel: Parallel,
    ranges: Sequence[tuple[int, int]],
    group: str,
    tp: int,
    max_microbatches: int | None,
    chunks: Sequence[Sequence[tuple[int, int]]] = (),
) -> PlanTables:
    """`plan_tables` of `group` alone at degree `tp` (sequence parallelism where tp > 1 and
    the configuration asks for it)."""
    p = dataclasses.replace(
        parallel, tp=tp, sequence_parallel=bool(parallel.sequence_parallel) and tp > 1
    )
    return plan_tables(
        pricer, p, ranges, (group,), max_microbatches=max_microbatches, chunks=chunks
    )


def _rank_ranges(
    pricer: Pricer,
    parallel: Parallel,
    ranges: Sequence[tuple[int, int]],
    chunks: Sequence[Sequence[tuple[int, int]]] = (),
) -> list[tuple[tuple[int, int], ...]]:
    """The unit ranges each pipeline rank runs, in model order: under interleaved 1F1B or
    ZB-V its model chunks (`chunks`, the stages' own, else the layout `rank_chunks`), else
    its one range."""
    pp = len(ranges)
    if pp > 1 and parallel.chunks > 1:
        if chunks:
            return [tuple(held) for held in chunks]
        v_shape = parallel.schedule == Schedule.ZERO_BUBBLE
        return list(rank_chunks(pricer.costs.graph, pp, parallel.chunks, v_shape))
    return [((a, b),) for a, b in ranges]


def _rank_compositions(
    pricer: Pricer,
    parallel: Parallel,
    ranges: Sequence[tuple[int, int]],
    chunks: Sequence[Sequence[tuple[int, int]]] = (),
) -> list[Composition]:
    """What each pipeline rank runs: the blocks of all its chunks under interleaved 1F1B or
    ZB-V (`_rank_ranges`), else of its range."""
    pp, costs = len(ranges), pricer.costs
    if pp > 1 and parallel.chunks > 1:
        if not chunks:  # the layout the planner searches (cached)
            v_shape = parallel.schedule == Schedule.ZERO_BUBBLE
            return list(costs.chunked_compositions(pp, parallel.chunks, v_shape))
        out = []
        for held in _rank_ranges(pricer, parallel, ranges, chunks):
            counts: dict[str, int] = {}
            for a, b in held:
                for k, n in costs.composition(a, b):
                    counts[k] = counts.get(k, 0) + n
            out.append(tuple(sorted(counts.items())))
        return out
    return [costs.composition(a, b) for a, b in ranges]


def _boundary_keys(pricer: Pricer, held: Sequence[Sequence[tuple[int, int]]]) -> list[str]:
    """Per boundary s (between pipeline ranks s and s + 1), the block whose output is the
    largest activation crossing it: the output of every chunk that hands off to the other
    rank, in either direction (ZB-V's V sends back). With one chunk per rank that is the
    output of the last unit of stage s. Interleaved 1F1B's wrap from the last rank to the
    first is no boundary of its own (its activations are the same size)."""
    costs = pricer.costs
    owner = sorted((a, b, r) for r, ranges in enumerate(held) for a, b in ranges)
    pp = len(held)
    found: list[str | None] = [None] * max(0, pp - 1)
    for (_, end, r), (_, _, nxt) in zip(owner, owner[1:]):
        if abs(r - nxt) != 1:
            continue
        s, key = min(r, nxt), costs.boundary_key(end)
        old = found[s]
        if old is None or costs.facts[key].output_bytes > costs.facts[old].output_bytes:
            found[s] = key
    if any(k is None for k in found):  # pragma: no cover - ranks hand off in every layout
        raise ValueError("a pipeline boundary no chunk crosses")
    return [k for k in found if k is not None]


def _loss_hops(pricer: Pricer, names: Sequence[str]) -> dict[str, float]:
    """The step's scalar loss all-reduce crossing between the groups: up and down the slowest
    link from each group (added to that group's optimizer term)."""
    return {
        g: 2 * max((pricer.cross_path(g, o, 1, 1).latency for o in names if o != g), default=0.0)
        for g in names
    }


def handoff_pairs(
    before: Sequence[tuple[str, int]], after: Sequence[tuple[str, int]]
) -> dict[tuple[str, str], int]:
    """(group of stage s, group of stage s + 1) -> how many pipelines hand off between them,
    from the two stages' replicas. Pipeline i is dp index i of every stage, and dp indices
    are numbered across the groups in placement order (`meshplan.ir.plan.assign_ranks`)."""
    out: dict[tuple[str, str], int] = {}
    left = [g for g, n in before for _ in range(n)]
    right = [g for g, n in after for _ in range(n)]
    for pair in zip(left, right, strict=True):
        out[pair] = out.get(pair, 0) + 1
    return out


def layout_tables(
    pricer: Pricer,
    parallel: Parallel,
    stages: Sequence[StagePlacement],
    *,
    max_microbatches: int | None = None,
) -> PlanTables:
    """The tables of a per-group TP layout (`StagePlacement.group_tp` on any stage: each
    stage's groups at their own degrees, stages free to differ), for this placement: the
    module docstring's "per-stage TP layouts". ZeRO-0, no EP (`ir.parallel.stage_tp_problem`).

    Entry [s][g] (stage time, overlap window, optimizer, memory, fits) is `plan_tables`' for
    group g alone at stage s's degree for g (sequence parallelism where that degree > 1),
    the optimizer with the loss all-reduce's hop between the groups; `p2p[s]` holds the
    hand-offs the placement's pipelines make across boundary s (`Pricer.handoff`), and only
    those; a stage's DP traffic is `dp_single` at its degree when its replicas sit in one
    group, else `Pricer.dp_cross_hetero` over each pair of its groups at the stage's degrees.
    `group_tp` stays empty (the degrees are per stage); `replica_capacity` counts replicas
    at the widest degree a group runs. On group-pure pipelines every entry `evaluate` reads
    equals `hetero_tables`'."""
    p = parallel
    ranges = [(st.first_unit, st.last_unit) for st in stages]
    chunks = [st.chunks for st in stages] if any(st.chunks for st in stages) else []
    pp = len(stages)
    order = [g.name for g in pricer.cluster.groups]
    names = tuple(g for g in order if any(g == r for st in stages for r, _ in st.replicas))
    degrees = [{g: st.tp_of(g, p.tp) for g, _ in st.replicas} for st in stages]
    per: dict[tuple[str, int], PlanTables] = {}
    for row in degrees:
        for g, t in row.items():
            if (g, t) not in per:
                per[(g, t)] = _at_tp(pricer, p, ranges, g, t, max_microbatches, chunks)
    rows = [{g: per[(g, t)] for g, t in row.items()} for row in degrees]
    hop = _loss_hops(pricer, names)
    comps = _rank_compositions(pricer, p, ranges, chunks)
    single: list[dict[str, float]] = []
    cross: list[dict[tuple[str, str], CrossTraffic]] = []
    for s, comp in enumerate(comps):
        groups = [g for g in names if g in degrees[s]]
        if len(groups) == 1:
            single.append({groups[0]: rows[s][groups[0]].dp_single[s][groups[0]]})
        else:
            single.append({})
        cross.append(
            {
                (a, b): pricer.dp_cross_hetero(comp, a, b, degrees[s], dp=p.dp, cp=p.cp)
                for i, a in enumerate(groups)
                for b in groups[i + 1 :]
            }
        )
    scale = p.micro_batch / pricer.costs.traced_micro_batch
    p2p = []
    keys = _boundary_keys(pricer, _rank_ranges(pricer, p, ranges, chunks))
    for s, bkey in enumerate(keys):
        activation = pricer.costs.facts[bkey].output_bytes * scale
        pairs = handoff_pairs(stages[s].replicas, stages[s + 1].replicas)
        p2p.append(
            {
                (a, b): pricer.handoff(
                    activation, a, degrees[s][a], b, degrees[s + 1][b], pipelines=n, cp=p.cp
                )
                for (a, b), n in pairs.items()
            }
        )
    group_memory = [{g: t.memory[s] for g, t in rows[s].items()} for s in range(pp)]
    capacity: dict[str, int] = {}
    for (g, _), t in per.items():
        capacity[g] = min(capacity.get(g, t.replica_capacity[g]), t.replica_capacity[g])
    first = next(iter(per.values()))  # m, rep, chunks and the schedule are the same in all
    return PlanTables(
        parallel=p,
        ranges=tuple(ranges),
        groups=names,
        m=first.m,
        rep=first.rep,
        time=[{g: t.time[s][g] for g, t in rows[s].items()} for s in range(pp)],
        window=[{g: t.window[s][g] for g, t in rows[s].items()} for s in range(pp)],
        optimizer=[{g: t.optimizer[s][g] + hop[g] for g, t in rows[s].items()} for s in range(pp)],
        memory=[max(row.values(), key=lambda x: x[0]) for row in group_memory],
        fits=[{g: t.fits[s][g] for g, t in rows[s].items()} for s in range(pp)],
        replica_capacity=capacity,
        dp_single=single,
        dp_cross=cross,
        p2p=p2p,
        chunks=first.chunks,
        zero_bubble=first.zero_bubble,
        group_memory=group_memory,
    )


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
    # Layout tables (`layout_tables`) hold only the hand-offs the placement's pipelines make.
    p2p = max(
        (
            tables.p2p[s].get((a, b), 0.0)
            for s in range(pp - 1)
            for a in used_pipe[s]
            for b in used_pipe[s + 1]
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
        "compute": m * t.compute,
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
    for st in stages:
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
    selective_policy: str = "keep_linear",
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
    `selective_policy` (`meshplan.cost_model.recompute.SelectivePolicy`): how selective
    recomputation keeps outputs; the default is meshplan's (keep every linear). `engine`
    (`cost_model.engine.Engine`): fused kernels, Float8 and TP overlap as other stacks run
    them; the default is meshplan's eager runtime.
    """
    check_parallel(graph, cluster, parallel, stages)
    p = parallel
    pricer = pricer_for(graph, cluster, dtype, comm, selective_policy, engine)
    dtype = pricer.dtype
    ranges = [(st.first_unit, st.last_unit) for st in stages]
    names = tuple(
        g.name for g in cluster.groups if any(g.name == r for st in stages for r, _ in st.replicas)
    )
    shares = stages[0].shares
    most = max(shares.values()) if shares else None
    layout = any(st.group_tp for st in stages)
    if layout:
        tables = layout_tables(pricer, p, stages, max_microbatches=most)
    else:
        # the stages' own model chunks (interleaved 1F1B, ZB-V) when they list them
        chunks = [st.chunks for st in stages] if any(st.chunks for st in stages) else []
        tables = plan_tables(pricer, p, ranges, names, max_microbatches=most, chunks=chunks)
    placement = [st.replicas for st in stages]
    ev = evaluate(tables, placement, shares or None)

    traced_mb = pricer.costs.traced_micro_batch
    model_flops = graph.total_flops(training=True) * p.global_batch / traced_mb
    peak_flops = sum(
        n * st.tp_of(g, p.tp) * p.cp * pricer.groups[g].gpu.peak(dtype)
        for st in stages
        for g, n in st.replicas
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
        for g, _ in st.replicas
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
