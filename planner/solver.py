"""The planner's optimisation model: choose a parallel configuration and place it (OR-Tools CP-SAT).

Sets
    c in C      candidate global configurations (tp, pp, dp, cp, ep, micro_batch, ZeRO stage,
                recomputation, schedule, sequence parallel), `enumerate_candidates`
    s < pp_c    pipeline stages of c (`meshplan.passes.partition.even_stages`)
    g in G      device groups of the cluster

Data (seconds and bytes, from `meshplan.cost_model.plan_tables`, integerised by `_Scale`)
    u[c,s,g]    one micro-batch (fwd + bwd + recompute + TP/CP/EP traffic) of stage s on g
    w[c,s,g]    compute that overlaps the stage's data-parallel traffic
    o[c,s,g]    optimizer update;   mem[c,s] <= cap(g) decides whether s may use g at all
    q[c,s,a,b]  boundary send s -> s+1 between groups a and b (fwd + bwd)
    d[c,s,g]    DP traffic when all of stage s sits in g;  e[c,s,a,b](k) when it spans a and b
                and k stages cross between groups (a shared GroupLink divides by k)
    m_c, pp_c, rep_c (m_c for ZeRO-3, else 1), R[c,g] replicas of tp*cp GPUs g can hold

Variables
    x[c]        bool, configuration c is chosen (exactly one)
    n[c,s,g]    int, replicas of stage s in group g;  b[c,s,g] = (n[c,s,g] >= 1)
    cross[c,s]  bool, stage s spans several groups;  k[c] = sum_s cross[c,s]
    us[c,s], U[c], P[c], comm[c,s], W[c,s], E[c], O[c], T

Constraints (each family added by the named method of `_PlacementModel`)
    replicas            sum_g n[c,s,g] = dp_c * x[c];  b <= n <= min(dp_c, R[c,g]) * b
    memory              n[c,s,g] = 0 unless mem[c,s] <= cap(g)  (no variable is created)
    capacity            sum_s tp_c * cp_c * n[c,s,g] <= gpus(g)   (TP inside a node: no
                        variables where tp_c does not divide gpus_per_node(g))
    stage_times         us[c,s] >= u[c,s,g] * b[c,s,g];  U[c] >= us[c,s]
    boundaries          P[c] >= q[c,s,a,b] * (b[c,s,a] + b[c,s+1,b] - 1)
    data_parallel       cross and k as above; comm[c,s] >= d[c,s,g] * (b[c,s,g] - cross[c,s]),
                        comm[c,s] >= e[c,s,a,b](k[c]) when both a and b are used (big-M);
                        W[c,s] = max_g w[c,s,g] * b[c,s,g];
                        E[c] >= comm[c,s] - eta * W[c,s],  E[c] >= (1 - eta) * comm[c,s]
    optimizer           O[c] >= o[c,s,g] * b[c,s,g]
    step_time           x[c] => T >= (m_c - 1) U[c] + sum_s us[c,s] + (m_c + pp_c - 1) P[c]
                                     + rep_c E[c] + O[c]

Objective: minimise T, the step time of `meshplan.cost_model.simulate` (the same formula over the
same tables, so the decoded plan re-priced by `predict` agrees with the objective up to the
integer rounding of `_Scale`).

How it is solved (`solve`). Exactly one x[c] is 1 and, once it is fixed, no two candidates
share a variable; so instead of one model holding every candidate (measured: with 48
candidates of up to 80 stages on 512 GPUs CP-SAT's presolve alone outran a 10 s budget) the
search branches on x in lower-bound order and solves the restriction x[c] = 1, a small
placement model, with the best step time so far as a cutoff:

1. enumerate candidates (`enumerate_candidates`);
2. bound every candidate without memory (`_memory_free_bound`: fastest groups that can hold
   the replicas), price them in bound order (`plan_tables`; stages repeat, so tables are built
   per distinct stage), drop those that fit in no group's memory, bound again with memory
   (`_lower_bound`) and place greedily (`_greedy_placements`, the warm start) until the bound
   passes the best greedy step time: nothing left can win (`_screen`);
3. for each surviving candidate whose greedy placement does not already meet its bound,
   build the placement model (`_PlacementModel`: variables -> constraints -> objective),
   hint the greedy placement (`AddHint`), cut off at the incumbent, solve;
4. decode the best placement into `Parallel` + `StagePlacement`s and re-price it with
   `predict`. The plan is "optimal" when every candidate was either bounded out or solved to
   optimality, else "feasible" with the relative gap to the smallest open bound.

For a homogeneous cluster the bounds are exact, so no placement model is needed at all.
Determinism: one search worker and a fixed seed (CP-SAT is then deterministic unless a time
limit cuts it); candidates are enumerated and sorted in a fixed order.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from meshplan.cost_model.memory import in_flight_microbatches
from meshplan.cost_model.simulate import (
    OVERLAP_EFFICIENCY,
    SUPPORTED_SCHEDULES,
    PlanTables,
    Pricer,
    evaluate,
    plan_tables,
    predict,
    pricer_for,
)
from meshplan.ir import (
    Cluster,
    Graph,
    Parallel,
    Prediction,
    Recompute,
    Schedule,
    StagePlacement,
)
from meshplan.passes.partition import even_stages, replica_capacity
from ortools.sat.python import cp_model

# Largest micro-batch the planner tries unless pinned. Assumption: costs scale linearly with
# the micro-batch (cost_model), so past a few sequences a larger one only saves kernel floors
# while it lengthens the pipeline fill and raises activation memory.
MAX_MICRO_BATCH = 16

# Integer time unit: the best greedy step time is represented by about this many units, so
# rounding each table entry to a unit costs at most ~1e-7 of the step per term.
UNITS_PER_STEP = 10_000_000

GiB = 2**30

Progress = Callable[[str], None] | None


class InfeasibleError(ValueError):
    """No configuration fits; the message names the binding constraint and its numbers."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One global configuration c (everything but the placement)."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    micro_batch: int
    zero: int
    recompute: Recompute
    schedule: Schedule
    sequence_parallel: bool

    def parallel(self, global_batch: int) -> Parallel:
        """The complete `Parallel` of this candidate."""
        return Parallel(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            micro_batch=self.micro_batch,
            global_batch=global_batch,
            recompute=self.recompute,
            zero=self.zero,
            schedule=self.schedule,
            sequence_parallel=self.sequence_parallel,
        )

    def describe(self) -> str:
        """One line for messages: `tp=8, pp=4, dp=2, micro_batch=1, full recompute, ZeRO-3`."""
        rc = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}[
            self.recompute.value
        ]
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += [f"micro_batch={self.micro_batch}", rc, f"ZeRO-{self.zero}"]
        return ", ".join(parts)

    @property
    def sort_key(self) -> tuple:
        """A total order for deterministic tie-breaking."""
        return (
            self.tp,
            self.pp,
            self.dp,
            self.cp,
            self.ep,
            self.micro_batch,
            self.zero,
            self.recompute.value,
            self.schedule.value,
            self.sequence_parallel,
        )


@dataclass(frozen=True)
class SolveResult:
    """The chosen plan and how the search went."""

    parallel: Parallel
    stages: tuple[StagePlacement, ...]
    prediction: Prediction
    status: str  # "optimal" or "feasible"
    gap: float  # (objective - best bound) / objective
    wall_s: float
    candidates: int  # configurations enumerated and bounded
    explored: int  # configurations priced in full (tables, bounds, greedy placements)
    placement_models: int  # CP-SAT placement models solved


# ---------------------------------------------------------------------------------------------
# Step 1: enumerate candidates
# ---------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def enumerate_candidates(
    graph: Graph, cluster: Cluster, pinned: Parallel, global_batch: int
) -> list[Candidate]:
    """Every configuration the planner considers, honouring each pinned field of `pinned`.

    tp divides heads and kv_heads (0 = unknown) and the GPUs per node of some group; cp (1
    unless pinned) divides the sequence; ep (1 unless pinned) divides the experts and dp;
    pp <= layer units; dp * micro_batch divides global_batch (micro_batch <= MAX_MICRO_BATCH
    unless pinned); the groups hold pp * dp replicas of tp * cp GPUs (not every GPU must be
    used: the objective prefers configurations that use them). ZeRO 1-3 only with dp > 1 (they
    equal ZeRO-0 otherwise), schedule 1F1B, sequence parallel when tp > 1. Raises
    InfeasibleError naming the first constraint that leaves nothing.
    """
    info = graph.info
    p = pinned
    if p.global_batch is not None and p.global_batch != global_batch:
        raise ValueError(
            f"global_batch={global_batch} conflicts with pinned global_batch={p.global_batch}"
        )
    schedule = p.schedule or Schedule.ONE_F_ONE_B
    if schedule not in SUPPORTED_SCHEDULES:
        raise InfeasibleError(
            f"no plan: schedule {schedule.value!r} is not modelled yet (use 1f1b or gpipe)"
        )
    gpn = sorted({g.gpus_per_node for g in cluster.groups})
    n_layers = len(graph.layer_units)

    def tp_ok(t: int) -> str | None:
        for what, n in (("heads", info.heads), ("kv_heads", info.kv_heads)):
            if n and n % t:
                return f"tp={t} does not divide the model's {what} ({n})"
        if not any(n % t == 0 for n in gpn):
            return f"tp={t} does not divide the GPUs per node ({', '.join(map(str, gpn))})"
        return None

    if p.tp is not None:
        if (why := tp_ok(p.tp)) is not None:
            raise InfeasibleError(f"no plan: {why}")
        tps = [p.tp]
    else:
        tps = [t for t in _divisors(max(gpn)) if tp_ok(t) is None]
    cps = [p.cp or 1]
    if info.seq_len and info.seq_len % cps[0]:
        raise InfeasibleError(f"no plan: cp={cps[0]} does not divide seq_len={info.seq_len}")
    eps = [p.ep or 1]
    if eps[0] > 1 and not info.experts:
        raise InfeasibleError(f"no plan: ep={eps[0]} but the model has no experts")
    if info.experts and info.experts % eps[0]:
        raise InfeasibleError(f"no plan: ep={eps[0]} does not divide experts={info.experts}")
    if p.pp is not None and not 1 <= p.pp <= n_layers:
        raise InfeasibleError(f"no plan: pp={p.pp} but the model has {n_layers} layers")
    pps = [p.pp] if p.pp is not None else list(range(1, n_layers + 1))
    pinned_rows = [("dp", p.dp), ("micro_batch", p.micro_batch)]
    if p.dp is not None and p.micro_batch is not None:
        pinned_rows.append(("dp*micro_batch", p.dp * p.micro_batch))
    for what, n in pinned_rows:
        if n is not None and global_batch % n:
            shown = f"{p.dp}*{p.micro_batch}={n}" if what == "dp*micro_batch" else str(n)
            raise InfeasibleError(
                f"no plan: global_batch={global_batch} is not divisible by {what}={shown}"
            )
    rcs = [Recompute(p.recompute)] if p.recompute is not None else list(Recompute)
    out: list[Candidate] = []
    why_none = "no configuration fits the cluster's GPU count"
    for tp, cp, ep, pp in itertools.product(tps, cps, eps, pps):
        sp = p.sequence_parallel if p.sequence_parallel is not None else tp > 1
        max_dp = sum(replica_capacity(g, tp, cp) for g in cluster.groups) // pp
        if p.dp is not None and p.dp > max_dp:
            why_none = (
                f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{p.dp} = {tp * pp * cp * p.dp} GPUs in whole "
                f"TP groups, but the cluster holds {max_dp * pp * tp * cp} of them"
            )
            continue
        dps = [p.dp] if p.dp is not None else _divisors_upto(global_batch, max_dp)
        for dp in dps:
            if dp % ep:
                why_none = f"ep={ep} does not divide dp={dp}"
                continue
            mbs = (
                [p.micro_batch]
                if p.micro_batch is not None
                else _divisors_upto(global_batch // dp, MAX_MICRO_BATCH)
            )
            zeros = [p.zero] if p.zero is not None else ([0, 1, 2, 3] if dp > 1 else [0])
            for mb, zero, rc in itertools.product(mbs, zeros, rcs):
                if global_batch % (dp * mb):  # a pinned micro-batch against a free dp
                    why_none = (
                        f"global_batch={global_batch} is not divisible by "
                        f"dp*micro_batch={dp}*{mb}={dp * mb} for any dp that fits"
                    )
                    continue
                out.append(Candidate(tp, pp, dp, cp, ep, mb, zero, rc, schedule, sp))
    if not out:
        raise InfeasibleError(f"no plan: {why_none}")
    return out


# ---------------------------------------------------------------------------------------------
# Step 2: screen (bound, price, greedy warm start) before building any model
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Priced:
    cand: Candidate
    tables: PlanTables
    allowed: list[list[str]]  # [stage] groups whose memory fits and that can hold a replica
    lower: float  # lower bound on the step time of any placement
    greedy_placement: list[list[tuple[str, int]]] | None  # best warm-start placement
    greedy_time: float


def _prefix_time(times: dict[str, float], capacity: dict[str, int], need: int) -> float:
    """The least possible max-time of `need` replicas spread over groups with these per-group
    times and capacities: fill the fastest groups first; the last group touched sets the time."""
    acc = 0
    for g in sorted(times, key=lambda g: (times[g], g)):
        acc += capacity[g]
        if acc >= need:
            return times[g]
    return math.inf


def _stage_bound(
    stage_times: Sequence[dict[str, float]],
    counts: Sequence[int],
    capacity: dict[str, int],
    dp: int,
) -> tuple[float, float]:
    """(U, S): lower bounds on max_s u_s and sum_s u_s over every placement that respects the
    groups' replica capacity, for stages with these per-group times (`stage_times` has one
    entry per distinct stage, `counts` stages each; a group missing from an entry is not
    allowed to that stage).

    Each stage alone: its dp replicas at best fill its fastest groups (`_prefix_time`). All
    stages together: if a set F of the fastest groups holds fewer than the pp * dp replicas,
    at least k = ceil((pp * dp - cap(F)) / dp) stages have a replica outside F, so U is at
    least the k-th smallest outside-F stage time, and S at least the per-stage bounds plus the
    k smallest excesses of outside-F time over them. Infinite when the groups cannot hold it.
    """
    per = [_prefix_time(st, capacity, dp) for st in stage_times]
    big_u = max(per)
    base = sum(n * u for n, u in zip(counts, per))
    total = base
    need = dp * sum(counts)
    speed: dict[str, float] = {}
    for st in stage_times:
        for g, v in st.items():
            speed[g] = min(speed.get(g, math.inf), v)
    held, inside = 0, set()
    for g in sorted(speed, key=lambda g: (speed[g], g)) + [None]:
        if held < need and inside:
            k = -(-(need - held) // dp)
            outside = sorted(
                (min((v for h, v in st.items() if h not in inside), default=math.inf), n, u)
                for st, n, u in zip(stage_times, counts, per)
            )
            seen = 0
            for v, n, _ in outside:
                seen += n
                if seen >= k:
                    big_u = max(big_u, v)
                    break
            excess = sorted((max(0.0, v - u), n) for v, n, u in outside)
            extra, left = 0.0, k
            for e, n in excess:
                take = min(n, left)
                extra += take * e
                left -= take
                if not left:
                    break
            total = max(total, base + extra)
        if g is None:
            break
        held += capacity[g]
        inside.add(g)
    if held < need:
        return math.inf, math.inf
    return big_u, total


def _memory_free_bound(pricer: Pricer, cand: Candidate, ranges, groups) -> tuple[float, float]:
    """A lower bound on the step time of every placement, before any table (memory ignored,
    capacity respected): (m - 1) * U + S of `_stage_bound` over the distinct stages."""
    costs = pricer.costs
    distinct: dict = {}
    for first, last in ranges:
        comp = costs.composition(first, last)
        distinct[comp] = distinct.get(comp, 0) + 1
    stage_times = [
        {
            g: pricer.stage_time(
                comp,
                g,
                tp=cand.tp,
                cp=cand.cp,
                ep=cand.ep,
                sp=cand.sequence_parallel,
                micro_batch=cand.micro_batch,
                recompute=cand.recompute,
            ).total
            for g in groups
        }
        for comp in distinct
    ]
    capacity = {g: replica_capacity(pricer.groups[g], cand.tp, cand.cp) for g in groups}
    return _stage_bound(stage_times, list(distinct.values()), capacity, cand.dp)


def _lower_bound(t: PlanTables, allowed: list[list[str]]) -> float:
    """A lower bound on `evaluate(t, placement)` over every placement that respects memory and
    capacity: stage times by `_stage_bound`, boundaries, DP traffic and optimizer at their
    cheapest allowed group (pair)."""
    pp, m = t.pp, t.m
    stage_times = [{g: t.time[s][g].total for g in allowed[s]} for s in range(pp)]
    big_u, total = _stage_bound(stage_times, [1] * pp, t.replica_capacity, t.parallel.dp)
    p2p = max(
        (min(t.p2p[s][(a, b)] for a in allowed[s] for b in allowed[s + 1]) for s in range(pp - 1)),
        default=0.0,
    )
    exposed = 0.0
    for s in range(pp):
        comm = min(t.dp_single[s][g] for g in allowed[s])
        pairs = [(a, b) for a, b in t.dp_cross[s] if a in allowed[s] and b in allowed[s]]
        if pairs:
            comm = min(comm, min(t.dp_cross[s][k].time(1) for k in pairs))
        window = max(t.window[s][g] for g in allowed[s])
        exposed = max(exposed, comm - OVERLAP_EFFICIENCY * min(comm, window))
    opt = max(min(t.optimizer[s][g] for g in allowed[s]) for s in range(pp))
    return (m - 1) * big_u + total + (m + pp - 1) * p2p + t.rep * exposed + opt


def _largest_stage(pricer: Pricer, c: Candidate, ranges, global_batch: int) -> tuple[int, int]:
    """(peak bytes, stage) of the stage needing the most memory, without building tables: per
    distinct stage composition, its first stage holds the most micro-batches."""
    m = global_batch // (c.dp * c.micro_batch)
    worst, seen = (0, 0), set()
    for s, (first, last) in enumerate(ranges):
        comp = pricer.costs.composition(first, last)
        if comp in seen:
            continue
        seen.add(comp)
        mem = pricer.stage_memory(
            comp,
            tp=c.tp,
            cp=c.cp,
            ep=c.ep,
            dp=c.dp,
            zero=c.zero,
            recompute=c.recompute,
            sp=c.sequence_parallel,
            micro_batch=c.micro_batch,
        )
        peak, _ = mem.peak(in_flight_microbatches(c.schedule, s, len(ranges), m))
        worst = max(worst, (peak, s))
    return worst


def _greedy_placements(t: PlanTables, allowed: list[list[str]], order: Sequence[str]):
    """Warm-start placements: (1) rank order, as `place_stages` fills GPUs; (2) heaviest stage
    first, each into its fastest group that can hold all its replicas, else split fastest
    first; (3) everything in one group when that group holds it all."""
    dp, pp = t.parallel.dp, t.pp

    def fill(stage_order, group_order_of):
        free = dict(t.replica_capacity)
        out: list[list[tuple[str, int]] | None] = [None] * pp
        for s in stage_order:
            groups = [g for g in group_order_of(s) if g in allowed[s]]
            whole = [g for g in groups if free[g] >= dp]
            if whole:
                out[s] = [(whole[0], dp)]
                free[whole[0]] -= dp
                continue
            want, reps = dp, []
            for g in groups:
                take = min(want, free[g])
                if take:
                    reps.append((g, take))
                    free[g] -= take
                    want -= take
                if not want:
                    break
            if want:
                return None
            out[s] = reps
        return out

    tries = [fill(range(pp), lambda s: order)]
    heavy = sorted(range(pp), key=lambda s: -max(t.time[s][g].total for g in allowed[s]))
    tries.append(fill(heavy, lambda s: sorted(order, key=lambda g: t.time[s][g].total)))
    for g in order:
        tries.append(fill(range(pp), lambda s, g=g: [g]))
    return [p for p in tries if p is not None]


def _screen(
    pricer: Pricer, graph: Graph, cands: list[Candidate], global_batch: int, deadline: float, say
) -> tuple[list[_Priced], int, str | None, float]:
    """Price candidates in lower-bound order until the bound passes the best greedy plan.

    Returns (priced candidates that may still win, how many were priced in full, the memory
    message if none fits, the bound of the first candidate left unpriced when the deadline
    cut the screen short, else infinity)."""
    cluster = pricer.cluster
    order = [g.name for g in cluster.groups]
    ranges_of: dict[int, tuple[tuple[int, int], ...]] = {}
    bound_of: dict[tuple, tuple[float, float]] = {}
    keyed = []
    for c in cands:
        ranges = ranges_of.get(c.pp)
        if ranges is None:
            ranges = ranges_of[c.pp] = even_stages(graph, c.pp)
        # zero does not change stage times, and the bound is linear in m: key without both
        bkey = (c.tp, c.cp, c.ep, c.sequence_parallel, c.pp, c.dp, c.micro_batch, c.recompute)
        ab = bound_of.get(bkey)
        if ab is None:
            groups = [g for g in order if replica_capacity(pricer.groups[g], c.tp, c.cp)]
            ab = bound_of[bkey] = _memory_free_bound(pricer, c, ranges, groups)
        if math.isinf(ab[0]):
            continue  # the groups cannot hold pp * dp replicas of tp * cp GPUs
        m = global_batch // (c.dp * c.micro_batch)
        keyed.append(((m - 1) * ab[0] + ab[1], c.sort_key, c))
    keyed.sort(key=lambda k: (k[0], k[1]))
    say(f"bounded {len(cands)} configurations; pricing in bound order")

    best = math.inf
    kept: list[_Priced] = []
    priced = 0
    smallest: tuple[float, int, Candidate] | None = None  # (bytes, stage, candidate)
    cut = math.inf
    for lb0, _, c in keyed:
        if lb0 > best * (1 + 1e-9):
            break
        # Past the deadline, stop once there is a plan to return. Without one, go on: the
        # memory check below makes pricing a candidate that fits nowhere cheap.
        if math.isfinite(best) and time.perf_counter() > deadline:
            cut = lb0
            break
        groups = [g for g in order if replica_capacity(pricer.groups[g], c.tp, c.cp)]
        need, stage = _largest_stage(pricer, c, ranges_of[c.pp], global_batch)
        if need > max(pricer.groups[g].gpu.memory_bytes for g in groups):
            if smallest is None or need < smallest[0]:
                smallest = (need, stage, c)
            continue  # some stage fits on no GPU: no tables needed to know
        priced += 1
        t = plan_tables(pricer, c.parallel(global_batch), ranges_of[c.pp], groups)
        allowed = [[g for g in groups if t.fits[s][g]] for s in range(t.pp)]
        lower = _lower_bound(t, allowed)
        if lower > best * (1 + 1e-9):
            continue
        g_best, g_time = None, math.inf
        for pl in _greedy_placements(t, allowed, order):
            ev = evaluate(t, pl)
            if ev.step_time_s < g_time:
                g_best, g_time = pl, ev.step_time_s
        best = min(best, g_time)
        kept.append(_Priced(c, t, allowed, lower, g_best, g_time))
    kept = [k for k in kept if k.lower <= best * (1 + 1e-9)]
    kept.sort(key=lambda k: (k.lower, k.greedy_time, k.cand.sort_key))
    message = None
    if not kept and smallest is not None:
        need, stage, c = smallest
        biggest = max(cluster.groups, key=lambda g: g.gpu.memory_bytes)
        # GiB, the unit meshplan.ir.hardware stores a datasheet's "80 GB" in, so the capacity
        # shows as the number users know.
        message = (
            f"no plan fits: the smallest configuration needs {need / GiB:.1f} GiB per GPU on "
            f"stage {stage} ({c.describe()}) and the largest GPU, {biggest.gpu.name}, has "
            f"{biggest.gpu.memory_bytes / GiB:.1f} GiB; add GPUs or use a larger-memory GPU type"
        )
    return kept, priced, message, cut


# ---------------------------------------------------------------------------------------------
# Steps 3-5: variables, constraints, objective
# ---------------------------------------------------------------------------------------------


class _Scale:
    """Seconds -> integer time units (`UNITS_PER_STEP` units for the reference step time)."""

    def __init__(self, reference_s: float) -> None:
        self.unit = max(reference_s, 1e-12) / UNITS_PER_STEP

    def __call__(self, seconds: float) -> int:
        return max(0, round(seconds / self.unit))


class _PlacementModel:
    """The model of the module docstring restricted to x[c] = 1 for one candidate c."""

    def __init__(self, pr: _Priced, cluster: Cluster, scale: _Scale, cutoff_s: float) -> None:
        self.m = cp_model.CpModel()
        self.pr, self.t, self.cluster, self.q = pr, pr.tables, cluster, scale
        eta = Fraction(OVERLAP_EFFICIENCY).limit_denominator(1000)
        self.eta_num, self.eta_den = eta.numerator, eta.denominator
        self.hi = self._upper()
        self.variables()
        self.replicas()
        self.capacity()
        step = (
            (self.t.m - 1) * self.stage_times()
            + sum(self.us)
            + (self.t.m + self.t.pp - 1) * self.boundaries()
            + self.t.rep * self.data_parallel()
            + self.optimizer()
        )
        self.step_time(step, cutoff_s)
        self.m.Minimize(self.T)

    def _upper(self) -> int:
        """An upper bound on the step time in units (variable domains)."""
        t, q = self.t, self.q
        big_u = max(max(x.total for x in row.values()) for row in t.time)
        p2p = max((max(row.values()) for row in t.p2p), default=0.0)
        comm = 0.0
        for s in range(t.pp):
            comm = max(comm, max(t.dp_single[s].values(), default=0.0))
            comm = max([comm] + [ct.time(t.pp) for ct in t.dp_cross[s].values()])
        opt = max(max(row.values()) for row in t.optimizer)
        return q((t.m - 1 + t.pp) * big_u + (t.m + t.pp - 1) * p2p + t.rep * comm + opt) + 1

    def variables(self) -> None:
        """n[s,g], b[s,g] only where stage s fits in g's memory (the memory family), T."""
        self.n: list[dict[str, cp_model.IntVar]] = []
        self.b: list[dict[str, cp_model.IntVar]] = []
        dp = self.pr.cand.dp
        for s in range(self.t.pp):
            self.n.append(
                {
                    g: self.m.NewIntVar(0, min(dp, self.t.replica_capacity[g]), f"n[{s},{g}]")
                    for g in self.pr.allowed[s]
                }
            )
            self.b.append({g: self.m.NewBoolVar(f"b[{s},{g}]") for g in self.pr.allowed[s]})
        self.T = self.m.NewIntVar(0, self.hi, "T")

    def replicas(self) -> None:
        """sum_g n[s,g] = dp;  b = (n >= 1)."""
        dp = self.pr.cand.dp
        for s, n_s in enumerate(self.n):
            self.m.Add(sum(n_s.values()) == dp).WithName(f"replicas[{s}]")
            for g, n in n_s.items():
                self.m.Add(n >= self.b[s][g])
                self.m.Add(n <= min(dp, self.t.replica_capacity[g]) * self.b[s][g])

    def capacity(self) -> None:
        """sum_s tp * cp * n[s,g] <= GPUs of g."""
        per = self.pr.cand.tp * self.pr.cand.cp
        for g in self.cluster.groups:
            terms = [per * n_s[g.name] for n_s in self.n if g.name in n_s]
            if terms:
                self.m.Add(sum(terms) <= g.num_gpus).WithName(f"capacity[{g.name}]")

    def stage_times(self) -> cp_model.IntVar:
        """us[s] >= u[s,g] * b[s,g];  U >= us[s]. Returns U."""
        t, q, m = self.t, self.q, self.m
        self.us = [m.NewIntVar(0, self.hi, f"us[{s}]") for s in range(t.pp)]
        big_u = m.NewIntVar(0, self.hi, "U")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                m.Add(self.us[s] >= q(t.time[s][g].total) * bv).WithName(f"stage_time[{s},{g}]")
            m.Add(big_u >= self.us[s])
        return big_u

    def boundaries(self) -> cp_model.IntVar:
        """P >= q[s,a,b] * (b[s,a] + b[s+1,b] - 1). Returns P."""
        t, q, m = self.t, self.q, self.m
        p2p = m.NewIntVar(0, self.hi, "P")
        for s in range(t.pp - 1):
            for a, ba in self.b[s].items():
                for c, bc in self.b[s + 1].items():
                    v = q(t.p2p[s][(a, c)])
                    if v:
                        m.Add(p2p >= v * (ba + bc - 1)).WithName(f"boundary[{s},{a},{c}]")
        return p2p

    def data_parallel(self) -> cp_model.IntVar:
        """cross, k, comm, W and E >= comm - eta * min(comm, W) (see the docstring). Returns E."""
        t, q, m, b = self.t, self.q, self.m, self.b
        cross: list[cp_model.IntVar | None] = []
        for s, b_s in enumerate(b):
            if len(b_s) < 2:
                cross.append(None)
                continue
            cv = m.NewBoolVar(f"cross[{s}]")
            m.Add(cv <= sum(b_s.values()) - 1)
            gs = list(b_s)
            for j, a in enumerate(gs):
                for c in gs[j + 1 :]:
                    m.Add(cv >= b_s[a] + b_s[c] - 1)
            cross.append(cv)
        k = m.NewIntVar(0, t.pp, "k")
        m.Add(k == sum(cv for cv in cross if cv is not None))
        exposed = m.NewIntVar(0, self.hi, "E")
        for s, b_s in enumerate(b):
            comm = m.NewIntVar(0, self.hi, f"comm[{s}]")
            for g, bv in b_s.items():
                v = q(t.dp_single[s][g])
                if v:
                    expr = v * bv - (v * cross[s] if cross[s] is not None else 0)
                    m.Add(comm >= expr).WithName(f"dp_single[{s},{g}]")
            order = [g for g in t.groups if g in b_s]
            for j, a in enumerate(order):
                for c in order[j + 1 :]:
                    ct = t.dp_cross[s][(a, c)]
                    both = b_s[a] + b_s[c] - 1
                    m.Add(comm >= q(ct.unshared) * both).WithName(f"dp_cross[{s},{a},{c}]")
                    if ct.per_stage is not None:
                        lat, per = q(ct.latency), q(ct.per_stage)
                        big_m = lat + per * t.pp
                        m.Add(comm >= lat + per * k - big_m * (1 - both))
            window = m.NewIntVar(0, self.hi, f"W[{s}]")
            m.AddMaxEquality(window, [q(t.window[s][g]) * bv for g, bv in b_s.items()])
            # E >= comm - eta * min(comm, W) = max(comm - eta * W, (1 - eta) * comm)
            m.Add(self.eta_den * exposed >= self.eta_den * comm - self.eta_num * window)
            m.Add(self.eta_den * exposed >= (self.eta_den - self.eta_num) * comm)
        return exposed

    def optimizer(self) -> cp_model.IntVar:
        """O >= o[s,g] * b[s,g]. Returns O."""
        opt = self.m.NewIntVar(0, self.hi, "O")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                self.m.Add(opt >= self.q(self.t.optimizer[s][g]) * bv)
        return opt

    def step_time(self, step, cutoff_s: float) -> None:
        """T >= step time; T <= the incumbent (a placement that cannot beat it is useless)."""
        self.m.Add(self.T >= step).WithName("step_time")
        if math.isfinite(cutoff_s):
            self.m.Add(self.T <= self.q(cutoff_s) + 1).WithName("cutoff")

    def hint(self, placement: list[list[tuple[str, int]]]) -> None:
        """Warm start from a greedy placement."""
        for s, n_s in enumerate(self.n):
            chosen = dict(placement[s])
            for g, nv in n_s.items():
                self.m.AddHint(nv, chosen.get(g, 0))
                self.m.AddHint(self.b[s][g], 1 if chosen.get(g, 0) else 0)

    def solve(self, time_limit_s: float):
        """(status, placement or None, lower bound in seconds)."""
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1  # determinism: one worker, fixed seed
        solver.parameters.random_seed = 0
        solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
        status = solver.Solve(self.m)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            placement = [
                [(g, solver.Value(nv)) for g, nv in n_s.items() if solver.Value(nv)]
                for n_s in self.n
            ]
            return status, placement, solver.BestObjectiveBound() * self.q.unit
        return status, None, solver.BestObjectiveBound() * self.q.unit


# ---------------------------------------------------------------------------------------------
# Steps 3-4: solve the placement models, decode
# ---------------------------------------------------------------------------------------------


def solve(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    *,
    global_batch: int,
    time_limit_s: float = 10.0,
    progress: Progress = None,
    dtype: str = "bfloat16",
    export_model: str | None = None,
) -> SolveResult:
    """The fastest configuration and placement that fits, honouring the fields of `pinned`.

    Returns the plan re-priced by `predict`. `time_limit_s` bounds the search once some plan is
    known (the first one is always looked for to the end); when it runs out the best plan so
    far comes back with status "feasible" and its relative gap.
    `export_model` writes the winning candidate's placement model (CP-SAT text proto) for
    debugging. Raises InfeasibleError with the binding constraint when nothing fits.
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    say = progress or (lambda _msg: None)
    pricer = pricer_for(graph, cluster, dtype)
    cands = enumerate_candidates(graph, cluster, pinned, global_batch)
    say(f"enumerated {len(cands)} candidate configurations")
    # The screen gets two thirds of the budget and the placement models the rest; but the
    # screen goes on until it has found some plan (or shown that none fits).
    kept, priced, message, cut = _screen(
        pricer, graph, cands, global_batch, start + time_limit_s * 2 / 3, say
    )
    if not kept:
        if message:
            raise InfeasibleError(message)
        raise InfeasibleError(
            "no plan fits: no candidate configuration could be placed on the device groups' "
            f"GPUs ({_capacity_summary(cluster)})"
        )
    best: tuple[float, _Priced, list] | None = None

    def better(step: float, pr: _Priced) -> bool:
        """Faster, or as fast (to 1e-9) with less memory (e.g. ZeRO-2 over ZeRO-1)."""
        if best is None or step < best[0] * (1 - 1e-9):
            return True
        return step <= best[0] * (1 + 1e-9) and _peak(pr) < _peak(best[1])

    for pr in kept:
        if pr.greedy_placement is not None and better(pr.greedy_time, pr):
            best = (pr.greedy_time, pr, pr.greedy_placement)
    open_bounds: list[float] = []
    models = 0
    for i, pr in enumerate(kept):
        incumbent = best[0] if best else math.inf
        if pr.lower >= incumbent * (1 - 1e-9):
            break  # sorted by bound: nothing further can win
        if pr.greedy_placement is not None and pr.greedy_time <= pr.lower * (1 + 1e-9):
            continue  # the warm start already meets this candidate's bound
        left = deadline - time.perf_counter()
        if left <= 0:
            open_bounds += [k.lower for k in kept[i:] if k.lower < incumbent]
            break
        reference = pr.greedy_time if pr.greedy_placement is not None else incumbent
        if not math.isfinite(reference):
            reference = 2 * pr.lower
        sub = _PlacementModel(pr, cluster, _Scale(reference), incumbent)
        if pr.greedy_placement is not None:
            sub.hint(pr.greedy_placement)
        status, placement, bound = sub.solve(left / 2)
        models += 1
        if placement is not None:
            step = evaluate(pr.tables, placement).step_time_s
            if better(step, pr):
                best = (step, pr, placement)
        if status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
            open_bounds.append(max(pr.lower, bound))
    if best is None:
        raise InfeasibleError(_placement_message(kept, cluster))
    step_s, pr, placement = best
    say(f"priced {priced} configurations, solved {models} placement models")

    order = [g.name for g in cluster.groups]
    stages = tuple(
        StagePlacement(
            index=s,
            first_unit=a,
            last_unit=b,
            replicas=tuple(sorted(placement[s], key=lambda gn: order.index(gn[0]))),
        )
        for s, (a, b) in enumerate(pr.tables.ranges)
    )
    parallel = pr.cand.parallel(global_batch)
    prediction = predict(graph, cluster, parallel, stages, dtype=dtype)
    assert prediction.fits, "solver placed a stage where it does not fit"
    if export_model:
        _PlacementModel(pr, cluster, _Scale(step_s), math.inf).m.ExportToFile(export_model)

    lowest_open = min([cut, *open_bounds])  # the best any unfinished candidate could do
    optimal = lowest_open >= step_s * (1 - 1e-9)
    gap = 0.0 if optimal else (step_s - min(lowest_open, step_s)) / step_s
    wall = time.perf_counter() - start
    say(
        f"{'optimal' if optimal else 'feasible'} plan in {wall:.2f} s: {pr.cand.describe()}, "
        f"{prediction.step_time_s:.3f} s/step"
    )
    return SolveResult(
        parallel=parallel,
        stages=stages,
        prediction=prediction,
        status="optimal" if optimal else "feasible",
        gap=gap,
        wall_s=wall,
        candidates=len(cands),
        explored=priced,
        placement_models=models,
    )


def _peak(pr: _Priced) -> int:
    return max(peak for peak, _ in pr.tables.memory)


def _placement_message(kept: list[_Priced], cluster: Cluster) -> str:
    """Why configurations that fit in memory could not be placed: the one needing the least
    memory still needs more large-enough GPUs than the cluster has."""
    pr = min(kept, key=lambda k: (_peak(k), k.cand.sort_key))
    need = _peak(pr)
    big = [g for g in cluster.groups if g.gpu.memory_bytes >= need]
    c = pr.cand
    return (
        f"no plan fits: the smallest configuration that fits in memory ({c.describe()}) needs "
        f"{c.pp * c.dp * c.tp * c.cp} GPUs with {need / GiB:.1f} GiB, and the cluster has "
        f"{sum(g.num_gpus for g in big)} such GPUs ({_capacity_summary(cluster)}); add GPUs "
        f"or use a larger-memory GPU type"
    )


def _capacity_summary(cluster: Cluster) -> str:
    return ", ".join(f"{g.name}: {g.num_gpus} x {g.gpu.name}" for g in cluster.groups)
