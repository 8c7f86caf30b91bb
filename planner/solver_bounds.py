"""Lower bounds of the screen (step 2 of `meshplan.solver`, `solver_screen`): each holds for
every placement of a configuration c or a (configuration, split) pair (c, l), so the screen
can visit pairs in bound order and stop once the bound passes the best plan.

Before any table (memory ignored, the groups' replica capacity respected):
    `_split_free_bound`     c, every split: stage times add over units, so S >= S_min (every unit
                            on its fastest group) and U >= S / pp; with shares `_share_rate_bound`
    `_split_free_memory`    c, every split: the least memory of ceil(L / pp) consecutive layers
    `_memory_free_bound`    (c, l): (U, S) of `_stage_bound` for lock-step placements (fastest
                            groups that can hold the replicas) and (rate, fill) of
                            `_share_rate_bound` for uneven shares (the whole micro-batch count
                            over the best pipeline rate); `_pipeline_bound` combines U and S
After the pair's tables (`plan_tables`), memory respected:
    `_lower_bound`          lock-step placements: `_stage_bound` over the groups each stage fits
                            in, boundaries, DP traffic and optimizer at their cheapest allowed
                            group (pair) (`_exposed_and_optimizer`)
    `_share_bound`          group-pure placements with uneven shares (`solver_screen`): the share
                            rate bound over the host groups (`_share_terms`, `_share_cap`)

Structure exploited: stage times are priced per distinct stage composition; bounds are keyed
without ZeRO (it does not change stage times) and are linear in m; a homogeneous cluster's
bounds are exact, so no placement model is needed at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from meshplan.cost_model.memory import in_flight_microbatches
from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY, Pricer
from meshplan.cost_model.tables import PlanTables
from meshplan.passes.partition import replica_capacity

from .solver_candidates import Candidate, priced


def _stage_memory(pricer, comp, c):
    """Memory of one stage made of `comp` under candidate `c` (all of c's memory knobs)."""
    return pricer.stage_memory(comp, c.stage_of(), dp=c.dp, zero=c.zero)


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


def _split_free_bound(
    pricer: Pricer, c: Candidate, groups: Sequence[str], m: int, cache: dict
) -> float:
    """A step-time bound of c that holds for every split and placement (memory ignored):
    stage times add over units, so S >= S_min (every unit on its fastest group) and U >= S / pp
    for lock-step placements; with shares a group's pipelines need at least W_g / pp per
    micro-batch (W_g: the whole model on g), so `_share_rate_bound` applies with U_g = W_g / pp."""
    # c's priced stage configs are a function of these fields and the groups: keying on them
    # spares building and hashing the configs once per candidate (most of this bound's cost)
    raw = ("free-raw", c.tp, c.cp, c.ep, c.sequence_parallel, c.micro_batch, c.recompute,
           c.cp_mode, c.group_tp, tuple(groups))  # fmt: skip
    key = cache.get(raw)
    if key is None:
        key = cache[raw] = ("free", tuple(groups), tuple(priced(c, g) for g in groups))
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        counts: dict[str, int] = {}
        for k in costs.unit_keys:
            counts[k] = counts.get(k, 0) + 1
        per = {
            (k, g): pricer.stage_time(((k, 1),), g, cfg).total
            for k in counts
            for g, cfg in zip(groups, key[2])
        }
        s_min = sum(n * min(per[(k, g)] for g in groups) for k, n in counts.items())
        whole = {g: sum(n * per[(k, g)] for k, n in counts.items()) for g in groups}
        got = cache[key] = (s_min, whole)
    s_min, whole = got
    pp = c.pp
    # m U + fill (S - U) with U >= S / pp (increasing in U since m >= fill); per-group TP
    # has group-pure placements only (the share bound below)
    lock = math.inf if c.group_tp else m * s_min / pp + c.fill * s_min * (1 - 1 / pp)
    if c.zero > 2:
        return lock
    rkey = raw + (pp, c.dp)  # ZeRO, schedule and m do not change the rate: memoise it
    rate = cache.get(rkey)
    if rate is None:
        capacity = {g: replica_capacity(pricer.groups[g], c.tp_of(g), c.cp) for g in groups}
        per_group = {g: (w / pp, w / pp) for g, w in whole.items()}
        rate = cache[rkey] = _share_rate_bound(per_group, capacity, pp, c.dp)[0]
    return min(lock, c.dp * m / rate) if rate > 0 else lock


def _split_free_memory(pricer: Pricer, c: Candidate, n_layers: int, cache: dict) -> int:
    """A peak-memory bound of c that holds for every split: some stage holds at least
    ceil(L / pp) consecutive layers and at least one micro-batch in flight, so it needs at least
    the least memory of such a window (over every window of the layer units)."""
    key = ("mem", c.stage_of(), c.dp, c.zero, c.pp)
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        lookup = dict(costs.graph.blocks)
        layer_pos = [i for i, k in enumerate(costs.unit_keys) if lookup[k].kind == "layer"]
        width = -(-n_layers // c.pp)
        comps = {
            costs.composition(layer_pos[i], layer_pos[i + width - 1] + 1)
            for i in range(len(layer_pos) - width + 1)
            if width
        } or {costs.composition(0, len(costs.unit_keys))}  # no layers: the whole model
        got = cache[key] = min(_stage_memory(pricer, comp, c).peak(1)[0] for comp in comps)
    return got


def _distinct_stage_times(pricer: Pricer, cand: Candidate, ranges, groups, cache: dict):
    """(per distinct stage: {group: u}, how many stages each, {group: (U_g, S_g)}), memoised
    in `cache` (dp and ZeRO do not change stage times)."""
    configs = tuple(priced(cand, g) for g in groups)
    key = ("times", tuple(ranges), tuple(groups), configs)
    got = cache.get(key)
    if got is not None:
        return got
    costs = pricer.costs
    distinct: dict = {}
    for first, last in ranges:
        comp = costs.composition(first, last)
        distinct[comp] = distinct.get(comp, 0) + 1
    stage_times = [
        {g: pricer.stage_time(comp, g, cfg).total for g, cfg in zip(groups, configs)}
        for comp in distinct
    ]
    counts = list(distinct.values())
    per_group = {
        g: (max(st[g] for st in stage_times), sum(n * st[g] for st, n in zip(stage_times, counts)))
        for g in groups
    }
    got = cache[key] = (stage_times, counts, per_group)
    return got


def _memory_free_bound(
    pricer: Pricer, cand: Candidate, ranges, groups, cache: dict
) -> tuple[float, float, float, float]:
    """Lower-bound pieces of every placement before any table (memory ignored, capacity
    respected), over the distinct stages: (U, S) of `_stage_bound` for lock-step placements,
    and (rate, fill) of `_share_rate_bound` for group-pure pipelines with uneven shares."""
    stage_times, counts, per_group = _distinct_stage_times(pricer, cand, ranges, groups, cache)
    capacity = {g: replica_capacity(pricer.groups[g], cand.tp_of(g), cand.cp) for g in groups}
    big_u, total = _stage_bound(stage_times, counts, capacity, cand.dp)
    if cand.group_tp:  # group-pure placements only
        big_u = total = math.inf
    rate, fill = _share_rate_bound(per_group, capacity, cand.pp, cand.dp)
    return big_u, total, rate, fill


def _share_rate_bound(
    per_group: Mapping[str, tuple[float, float]],
    capacity: Mapping[str, int],
    pp: int,
    dp: int,
) -> tuple[float, float]:
    """(rate, fill) such that every group-pure placement with uneven shares has a pipeline term
    of at least M / rate + fill * c (M micro-batches in all, c the schedule's fill coefficient,
    `Candidate.fill`): a group's pipelines run at best one micro-batch per U_g (its slowest
    stage), so M <= T * sum_g n_g / U_g, and the best sum_g n_g / U_g over n_g <= R[g] // pp,
    sum_g n_g = dp fills the fastest groups first; every pipeline also pays at least the
    smallest fill (S_g - U_g) c. (0, inf) when the groups cannot hold dp pipelines or fewer
    than two groups can host one."""
    hosts = [g for g in per_group if capacity[g] >= pp and per_group[g][0] > 0]
    if len(hosts) < 2:
        return 0.0, math.inf
    rate, left = 0.0, dp
    for g in sorted(hosts, key=lambda g: (per_group[g][0], g)):
        take = min(left, capacity[g] // pp)
        rate += take / per_group[g][0]
        left -= take
        if not left:
            break
    if left:
        return 0.0, math.inf
    fill = min(per_group[g][1] - per_group[g][0] for g in hosts)
    return rate, fill


def _pipeline_bound(big_u: float, total: float, m: int, fill: float) -> float:
    """m U + fill (S - U) (fill = 1 / v, or 0 under ZB-V), increasing in U and S, so it bounds
    with lower bounds of both (infinite when the groups cannot hold the replicas)."""
    if math.isinf(big_u) or math.isinf(total):
        return math.inf
    return m * big_u + (total - big_u) * fill


def _exposed_and_optimizer(t: PlanTables, allowed: list[list[str]], crossing: int = 0) -> float:
    """Lower bound of rep * exposed DP traffic + optimizer: each at its cheapest allowed group
    (pair). `crossing` > 0: every stage's replicas span two groups, that many stages at once
    (group-pure pipelines in several groups), so only cross-group rings count."""
    dp, cap = t.parallel.dp, t.replica_capacity
    # Stages that must span groups: a group-pure stage needs dp replicas in one group, so at
    # most sum_g floor(R[g] / dp) stages are group-pure and the rest cross (their DP rings
    # share the links between groups: `CrossTraffic.time(k)` rises with k).
    forced = crossing or max(0, t.pp - sum(cap[g] // dp for g in t.groups))
    exposed = 0.0
    crossing_lb: list[float] = []
    for s in range(t.pp):
        window = max(t.window[s][g] for g in allowed[s])

        def expose(comm: float) -> float:
            return comm - OVERLAP_EFFICIENCY * min(comm, window)

        single = math.inf
        if not crossing:
            single = min((t.dp_single[s][g] for g in allowed[s] if cap[g] >= dp), default=math.inf)
        pairs = [(a, b) for a, b in t.dp_cross[s] if a in allowed[s] and b in allowed[s]]
        cross = min((t.dp_cross[s][k].time(max(1, forced)) for k in pairs), default=math.inf)
        comm = min(single, cross)
        if math.isinf(comm):
            return math.inf
        exposed = max(exposed, expose(comm))
        crossing_lb.append(expose(cross))
    if 0 < forced <= t.pp:  # the forced-th cheapest crossing stage is among those that cross
        exposed = max(exposed, sorted(crossing_lb)[forced - 1])
    opt = max(min(t.optimizer[s][g] for g in allowed[s]) for s in range(t.pp))
    return t.rep * exposed + opt


def _lower_bound(t: PlanTables, allowed: list[list[str]]) -> float:
    """A lower bound on `evaluate(t, placement)` over every lock-step placement that respects
    memory and capacity: stage times by `_stage_bound`, boundaries, DP traffic and optimizer
    at their cheapest allowed group (pair)."""
    pp, m, v = t.pp, t.m, t.chunks
    stage_times = [{g: t.time[s][g].total for g in allowed[s]} for s in range(pp)]
    big_u, total = _stage_bound(stage_times, [1] * pp, t.replica_capacity, t.parallel.dp)
    p2p = max(
        (min(t.p2p[s][(a, b)] for a in allowed[s] for b in allowed[s + 1]) for s in range(pp - 1)),
        default=0.0,
    )
    z = max(min(t.bubble_unit(s, g) for g in allowed[s]) for s in range(pp))
    return (
        _pipeline_bound(big_u, total, m, t.fill)
        + (pp - 1) * z
        + (m * v + pp - 1) * p2p
        + _exposed_and_optimizer(t, allowed)
    )


def _share_hosts(t: PlanTables, allowed: list[list[str]]) -> list[str]:
    """Groups that can host whole pipelines: every stage fits and pp replicas fit."""
    return [
        g
        for g in t.groups
        if all(g in allowed[s] for s in range(t.pp)) and t.replica_capacity[g] >= t.pp
    ]


def _share_cap(t: PlanTables) -> int:
    """The largest per-replica micro-batch count that keeps every stage's in-flight activations
    (hence `t.fits`) as they are: unbounded where the schedule's warm-up depth is saturated."""
    p, big = t.parallel, 1 << 30
    same = all(
        in_flight_microbatches(p.schedule, s, t.pp, big, t.chunks)
        == in_flight_microbatches(p.schedule, s, t.pp, t.m, t.chunks)
        for s in range(t.pp)
    )
    return big if same else t.m


def _share_terms(t: PlanTables, g: str) -> tuple[float, float]:
    """(slope, const) of group g's pipeline term f_g(m) = slope * m + const."""
    pp, v = t.pp, t.chunks
    us = [t.time[s][g].total for s in range(pp)]
    p2p = max((t.p2p[s][(g, g)] for s in range(pp - 1)), default=0.0)
    z = max(t.bubble_unit(s, g) for s in range(pp))
    big_u = max(us)
    return big_u + v * p2p, (sum(us) - big_u) * t.fill + (pp - 1) * (p2p + z)


def _share_bound(t: PlanTables, allowed: list[list[str]]) -> float:
    """A lower bound on `evaluate` over group-pure placements with uneven shares (infinite
    when there are none): `_share_rate_bound` over the host groups plus the DP and optimizer
    bounds."""
    if t.parallel.zero == 3 or (_share_cap(t) <= t.m and not t.group_tp):
        return math.inf
    hosts = _share_hosts(t, allowed)
    terms = {g: _share_terms(t, g) for g in hosts}
    per_group = {g: (a, b + a) for g, (a, b) in terms.items()}  # (U_g, S_g) with v = 1
    rate, _ = _share_rate_bound(per_group, t.replica_capacity, t.pp, t.parallel.dp)
    if rate <= 0:
        return math.inf
    fill = min(terms[g][1] for g in hosts)
    return t.parallel.dp * t.m / rate + fill + _exposed_and_optimizer(t, allowed, t.pp)
