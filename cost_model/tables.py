"""The tables of one configuration: every (stage, group) and (boundary, group pair) priced
once, for the step formula (`simulate.evaluate`) and the placement model (`meshplan.solver`)
to read. `plan_tables` for the planner's own layouts (one tp for every replica), `hetero_tables`
for per-group TP, `layout_tables` for a stage list given by hand (per-stage TP degrees, stages
mixing GPU types: a peer planner's plan). What each table holds is `PlanTables`' docstring;
the step formula that reads them is `simulate`'s.

Moved from `simulate`, word for word.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from meshplan.ir import (
    Parallel,
    Schedule,
    StageConfig,
    StagePlacement,
)
from meshplan.ir.parallel import span_config
from meshplan.passes.partition import (
    rank_chunks,
    replica_capacity,
)

from .dp_traffic import CrossTraffic
from .ep_traffic import EpSpan
from .graph_costs import Composition
from .memory import (
    in_flight_microbatches,
)
from .pricer import Pricer, StageTime

# ---------------------------------------------------------------------------------------------
# Tables of one configuration
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
    # cp groups spanning device groups (`StagePlacement.cp_groups`, alike in every stage):
    # each cp rank's stages sit in one group, so `evaluate` prices hand-offs inside groups.
    cp_span: tuple[tuple[str, int], ...] = ()

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


def _dp_window(t: StageTime, zero: int, overlap: bool = True) -> float:
    """Compute that the stage's DP traffic overlaps with (one micro-batch): ZeRO-3 gathers and
    reduces around every micro-batch's forward and backward; ZeRO-0 reduces gradients during
    the last backward; ZeRO-1/2 reduce-scatter during the last backward and all-gather the
    updated weights under the next step's first forward (Megatron-LM `--overlap-param-gather`,
    FSDP/ZeRO prefetch). None below ZeRO-3 when the engine reduces after the backward
    (`Engine.dp_overlap` False)."""
    if zero == 3:
        return t.compute + t.recompute
    if not overlap:
        return 0.0
    if zero in (1, 2):
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
    cp_span: tuple[tuple[str, int], ...] = (),
) -> PlanTables:
    """Price every (stage, group) and (boundary, group pair) of a complete configuration.

    `cp_span` (stages whose replicas' cp groups span device groups alike,
    `StagePlacement.cp_groups`): a rank in group g is priced at the largest share of the cp
    ranks there (`StageConfig.cp_ranks`), its cp collectives on the spanning path
    (`StageConfig.cp_span`, tp x dp x pp such cp groups crossing at once); each stage runs at
    the slowest group's time (`evaluate`, the groups in lock-step). Each group's memory is its
    own ranks' largest share's (`group_memory`); the stages' hand-offs stay inside each group
    (cp rank r of every stage sits in the same one), at its ranks' largest share.

    `max_microbatches` (uneven DP shares: the largest per-replica share) sizes the in-flight
    activations of the memory check; default the configuration's num_microbatches. `chunks`
    (interleaved 1F1B, ZB-V): the unit ranges of each rank's model chunks
    (`StagePlacement.chunks`); empty: the chunk layout `partition.rank_chunks` (what the
    planner searches)."""
    p = parallel
    names = tuple(groups) if groups is not None else tuple(pricer.groups)
    tp, cp, ep, dp, mb = p.tp, p.cp, p.ep, p.dp, p.micro_batch
    zero = p.zero
    overlap = pricer.engine.dp_overlap
    quant = bool(p.quantize_activations)
    cfg = p.stage()
    plain = dataclasses.replace(cfg, quantize_activations=False)  # memory: quantized per stage
    spanned = dict(cp_span)

    m = p.global_batch // (dp * mb)
    pp = len(ranges)

    def cfg_of(g: str) -> StageConfig:
        """The configuration a rank of group g runs (its cp ranks' largest share)."""
        return span_config(cfg, cp_span, g, tp * dp * pp) if g in spanned else cfg

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
        traffic = pricer.dp_traffic(comp, cfg, dp=dp, zero=zero, first=first)
        edge = pricer.dp_edge(first, cfg, dp=dp) if first else None
        times = {g: pricer.stage_time(comp, g, cfg_of(g)) for g in names}
        if edge is not None:
            times = {
                g: dataclasses.replace(t, dp_edge=pricer.dp_single(edge, g, cfg))
                for g, t in times.items()
            }
        cross = {}
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                cross[(a, b)] = pricer.dp_cross(traffic, a, b, cfg)
        uniq[(comp, first)] = {
            "time": times,
            "window": {g: _dp_window(t, zero, overlap) for g, t in times.items()},
            # The optimizer update, and the step's exposed syncs around it (SP gradients of
            # the replicated parameters, the loss all-reduce).
            "opt": {
                g: pricer.optimizer_time(comp, g, cfg, dp=dp * cp, zero=zero)
                + pricer.weight_quantize_time(comp, g)
                + pricer.step_sync_time(
                    comp, g, cfg, world=world, groups=names, reductions=reductions
                )
                for g in names
            },
            "single": {g: pricer.dp_single(traffic, g, cfg) for g in names},
            "cross": cross,
            "mem": pricer.stage_memory(comp, plain, dp=dp, zero=zero),
        }
    capacity = {g: replica_capacity(pricer.groups[g], tp, cp) for g in names}
    if cp_span:  # every ep group lies in the group of its cp index: none spans groups
        capacity = {g: dp for g in names}
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
                        u["window"][g] = _dp_window(floor, zero, overlap)
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
    for bkey, size in boundary_sends(pricer, p, held_ranges):
        row = by_boundary.get(bkey)
        if row is None:
            if cp_span:
                # cp rank r of every stage sits in the same group: each group's hand-off at
                # the largest token share among its cp ranks, inside the group
                sizes = _span_token_fractions(p, cp_span)
                out_b = costs.facts[bkey].output_bytes * scale / tp
                row = {(a, b): math.inf for a in names for b in names}
                for g, frac in sizes.items():
                    row[(g, g)] = pricer.p2p(out_b * frac, g, g, streams)
                by_boundary[bkey] = row
            else:
                row = by_boundary[bkey] = {
                    (a, b): pricer.p2p(size, a, b, streams) for a in names for b in names
                }
        p2p.append(row)
    span_memory = _span_memory(pricer, p, comps, cp_span, cfg_of, m, max_microbatches)
    for s, row in enumerate(span_memory):  # each group at its own ranks' shares
        memory[s] = max(row.values(), key=lambda x: x[0])
        fits[s] = {
            g: row[g][0] <= pricer.groups[g].gpu.memory_bytes if g in row else fits[s][g]
            for g in names
        }
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
        group_memory=span_memory,
        cp_span=tuple(cp_span),
    )


def _span_token_fractions(p: Parallel, cp_span) -> dict[str, float]:
    """Per group a spanning cp group takes part in: the largest fraction of a sequence's
    tokens one of its cp ranks holds (`Parallel.cp_shares`; 1/cp under equal shares)."""
    out, at = {}, 0
    for g, c in cp_span:
        ranks = range(at, at + c)
        if p.cp_shares:
            out[g] = max(p.cp_shares[r] for r in ranks) / sum(p.cp_shares)
        else:
            out[g] = 1 / p.cp
        at += c
    return out


def _span_memory(pricer, p, comps, cp_span, cfg_of, m, max_microbatches) -> list:
    """Per (stage, group) memory of a stage whose cp groups span device groups: each group's
    ranks at their own largest share (`StageConfig.cp_ranks`); [] without a span (the
    stage's one row holds)."""
    if not cp_span:
        return []
    rows = []
    pp = len(comps)
    for s, comp in enumerate(comps):
        held = in_flight_microbatches(p.schedule, s, pp, max_microbatches or m, p.chunks)
        row = {}
        for g, _ in cp_span:
            cfg = cfg_of(g)
            if not cfg.quantize_activations:
                cfg = dataclasses.replace(cfg, quantize_activations=False)
            mem = pricer.stage_memory(comp, cfg, dp=p.dp, zero=p.zero, stage=s, num_stages=pp)
            row[g] = mem.peak(held)
        rows.append(row)
    return rows


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
                (a, b): pricer.dp_cross_hetero(comp, a, b, parallel, group_tp)
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


def boundary_sends(
    pricer: Pricer, parallel: Parallel, held: Sequence[Sequence[tuple[int, int]]]
) -> list[tuple[str, float]]:
    """Per pipeline boundary of the ranks' chunks `held` (`_rank_ranges`), the block whose
    output crosses it (`_boundary_keys`) and the bytes each TP rank sends of it at
    `parallel`'s micro-batch: Megatron's scatter/gather optimisation (Narayanan et al. SC'21,
    sec. 4.1; also what a sequence-parallel boundary sends), each TP rank 1/tp of the
    activation of its cp share. What `plan_tables` prices the hand-offs at, and what the
    screen's bound (`solver_screen._ScreenMemo.traffic_floor`) reads."""
    costs, p = pricer.costs, parallel
    scale = p.micro_batch / costs.traced_micro_batch
    return [
        (bkey, costs.facts[bkey].output_bytes * scale / (p.cp * p.tp))
        for bkey in _boundary_keys(pricer, held)
    ]


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
                (a, b): pricer.dp_cross_hetero(comp, a, b, p, degrees[s])
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
