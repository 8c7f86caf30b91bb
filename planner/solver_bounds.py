"""Lower bounds of the screen (step 2 of `meshplan.solver`, `solver_screen`): each holds for
every placement of a configuration c or a (configuration, split) pair (c, l), so the screen
can visit pairs in bound order and stop once the bound passes the best plan.

Memory, before any stage is built:
    `_least_peak`           c, every split and placement: the model's states over c's ranks,
                            averaged (`memory.least_peak`); passing the largest GPU c may use,
                            c fits nowhere, and the per-stage check below is not needed
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

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshplan.cost_model.compression import MEASURED_RATIO, CommOptions, int8_gradient_ratio
from meshplan.cost_model.dp_traffic import CrossTraffic
from meshplan.cost_model.memory import in_flight_microbatches, least_peak, summed_states
from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY, Pricer
from meshplan.cost_model.tables import PlanTables
from meshplan.passes.partition import replica_capacity

from .solver_candidates import Candidate, Family, _tp_of, priced


def _stage_memory(pricer, comp, c):
    """Memory of one stage made of `comp` under candidate `c` (all of c's memory knobs)."""
    return pricer.stage_memory(comp, c.stage_of(), dp=c.dp, zero=c.zero)


def _least_peak(pricer: Pricer, c: Candidate, tp: int | None = None) -> float:
    """A lower bound on the peak memory of c's fullest rank over every split and placement
    (`memory.least_peak` of the whole model's states over c's dp cp tp pp ranks; `tp`: a
    group's own degree under per-group TP); a few multiplications, no stage built."""
    dense, expert = pricer.model_params()
    shards = c.dp * c.cp
    states = summed_states(
        dense, expert, shards=shards, ep=c.ep, zero=c.zero, precision=pricer.precision
    )
    return least_peak(states, shards * (tp or c.tp) * c.pp)


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
    return _free_bound(pricer, c, c.fill, c.zero, groups, m, cache)


def _free_bound(
    pricer: Pricer,
    c: Candidate | Family,
    fill: float,
    zero: int,
    groups: Sequence[str],
    m: int,
    cache: dict,
) -> float:
    """`_split_free_bound` of a candidate with c's fields, schedule fill `fill` and ZeRO stage
    `zero`: c is that candidate, or a `Family` of candidates that share every other field it
    reads (its member is built only to price a stage config not seen before)."""
    raw, s_min, whole = _free_terms(pricer, c, groups, cache)
    hosts = () if zero > 2 else _free_hosts(pricer, c, groups, raw, whole, c.pp, cache)
    return _free_value(s_min, hosts, c.pp, c.dp, m, fill, zero, bool(c.group_tp))


def _free_terms(
    pricer: Pricer, c: Candidate | Family, groups: Sequence[str], cache: dict
) -> tuple[tuple, float, dict[str, float]]:
    """(its cache key, S_min, {group: W_g}) of `_split_free_bound`: S_min the sum over units
    of each unit's time on its fastest group, W_g the whole model's time on group g."""
    # c's priced stage configs are a function of these fields and the groups: keying on them
    # spares building and hashing the configs once per candidate (most of this bound's cost)
    raw = ("free-raw", c.tp, c.cp, c.ep, c.sequence_parallel, c.micro_batch, c.recompute,
           c.cp_mode, c.cp_head_degree, c.group_tp, tuple(groups))  # fmt: skip
    got = cache.get(raw)
    if got is None:
        member = c.loosest() if isinstance(c, Family) else c
        key = ("free", tuple(groups), tuple(priced(member, g) for g in groups))
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
            got = cache[key] = (s_min, whole, per, counts)  # the last two: `_cost_floor`
        cache[raw] = got
    return raw, got[0], got[1]


def _cost_floor(
    pricer: Pricer,
    c: Candidate | Family,
    groups: Sequence[str],
    m: int,
    price: Mapping[str, float],
    cache: dict,
) -> float:
    """Objective "cost": a score bound of c (a candidate, or a family: its members share what
    this reads) over every split and placement, memory ignored. A plan costs its step time
    times the price of the GPUs it holds (`_Scorer.score`), and every rank of a stage is busy
    for each micro-batch its replica runs, so a replica running m_j micro-batches keeps its
    stage's ranks for at least m_j u_s of the step; the m_j of a stage's replicas sum to dp m
    (equal or uneven shares alike), and a stage's time adds over its units. So the score is
    at least dp m sum over units of min_g (price_g tp_g cp t_g(unit)): every unit on the group
    where its work is cheapest (`price` per GPU-second). The step-time bound times the
    cheapest price (`_Scorer.factor`) pairs the fastest group's time with the cheapest
    group's price, which differ on a mixed cluster; this one does not."""
    raw, _, _ = _free_terms(pricer, c, groups, cache)
    key = ("cost-floor", raw, c.dp, m)
    got = cache.get(key)
    if got is None:
        per, counts = cache[raw][2:]
        rate = {g: price[g] * _tp_of(c.tp, c.group_tp, g) * c.cp for g in groups}
        cheapest = sum(n * min(rate[g] * per[(k, g)] for g in groups) for k, n in counts.items())
        got = cache[key] = c.dp * m * cheapest
    return got


def _free_hosts(
    pricer: Pricer,
    c: Candidate | Family,
    groups: Sequence[str],
    raw: tuple,
    whole: Mapping[str, float],
    pp: int,
    cache: dict,
) -> list[tuple[float, int]]:
    """`_share_rate_bound`'s hosts with U_g = W_g / pp, fastest first: (U_g, pipelines g
    holds); empty when fewer than two groups host one. Once per (`raw`, pp): ZeRO, schedule,
    dp and m do not change them."""
    hkey = raw + (pp,)
    hosts = cache.get(hkey)
    if hosts is None:
        capacity = _capacities(pricer, c, groups, cache)
        per_group = {g: w / pp for g, w in whole.items()}
        ok = [g for g in per_group if capacity[g] >= pp and per_group[g] > 0]
        hosts = cache[hkey] = [
            (per_group[g], capacity[g] // pp)
            for g in sorted(ok, key=lambda g: (per_group[g], g))
        ] if len(ok) >= 2 else []  # fmt: skip
    return hosts


def _free_value(
    s_min: float,
    hosts: Sequence[tuple[float, int]],
    pp: int,
    dp: int,
    m: int,
    fill: float,
    zero: int,
    group_tp: bool,
) -> float:
    """`_split_free_bound` from its terms: m U + fill (S - U) with U >= S / pp (increasing in
    U since m >= fill), lock-step placements only without per-group TP; with ZeRO <= 2 also
    the share bound dp m / rate over `hosts` (`_share_rate_bound`), whichever is less."""
    lock = math.inf if group_tp else m * s_min / pp + fill * s_min * (1 - 1 / pp)
    if zero > 2:
        return lock
    rate, left = 0.0, dp
    for u, held in hosts:
        take = min(left, held)
        rate += take / u
        left -= take
        if not left:
            break
    if left or rate <= 0:
        return lock
    return min(lock, dp * m / rate)


def _capacities(
    pricer: Pricer, c: Candidate | Family, groups: Sequence[str], cache: dict
) -> dict[str, int]:
    """Replicas of c (tp x cp GPUs, per-group TP honoured) each of `groups` holds, cached."""
    key = ("capacity", c.tp, c.cp, c.group_tp, tuple(groups))
    got = cache.get(key)
    if got is None:
        got = cache[key] = {g: replica_capacity(pricer.groups[g], c.tp_of(g), c.cp) for g in groups}
    return got


@dataclass(frozen=True, slots=True)
class _ConfigTerms:
    """What `_multi_group_bound` reads of one stage config per group (`configs`, in `groups`
    order), all from one instance of each unit on each group: computed once per config."""

    s_min: float  # sum over units of each unit's time on its fastest group
    whole: dict[str, float]  # the whole model's time on each group
    window: float  # the whole model's compute + recompute of one micro-batch, slowest group
    unit_windows: float  # sum over units of that on each unit's slowest group
    layers_best: float  # the layer units' time on their fastest groups
    rho: dict[str, float]  # a group's least ratio of a layer unit's time to its fastest


def _config_terms(pricer: Pricer, groups: Sequence[str], configs: tuple, cache: dict):
    """`_ConfigTerms` of `configs` on `groups`, cached."""
    key = ("terms", tuple(groups), configs)
    got = cache.get(key)
    if got is not None:
        return got
    counts: dict[str, int] = {}
    for k in pricer.costs.unit_keys:
        counts[k] = counts.get(k, 0) + 1
    per = {
        (k, g): pricer.stage_time(((k, 1),), g, cfg)
        for k in counts
        for g, cfg in zip(groups, configs)
    }
    lookup = dict(pricer.costs.graph.blocks)
    fastest = {k: min(per[(k, g)].total for g in groups) for k in counts}
    layers = [k for k in counts if lookup[k].kind == "layer"]

    def window(k: str, g: str) -> float:
        return per[(k, g)].compute + per[(k, g)].recompute

    got = cache[key] = _ConfigTerms(
        s_min=sum(n * fastest[k] for k, n in counts.items()),
        whole={g: sum(n * per[(k, g)].total for k, n in counts.items()) for g in groups},
        window=max(sum(n * window(k, g) for k, n in counts.items()) for g in groups),
        unit_windows=sum(n * max(window(k, g) for g in groups) for k, n in counts.items()),
        layers_best=sum(counts[k] * fastest[k] for k in layers),
        rho={
            g: min(
                (per[(k, g)].total / fastest[k] if fastest[k] > 0 else 1.0 for k in layers),
                default=1.0,
            )
            for g in groups
        },
    )
    return got


def _layer_windows(pricer: Pricer, width: int, cache: dict) -> set:
    """The compositions of every run of `width` consecutive layer units (`_split_free_memory`'s
    windows): some stage of a pipeline of pp stages holds one of width ceil(L / pp)."""
    key = ("windows", width)
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        lookup = dict(costs.graph.blocks)
        pos = [i for i, k in enumerate(costs.unit_keys) if lookup[k].kind == "layer"]
        got = cache[key] = {
            costs.composition(pos[i], pos[i + width - 1] + 1)
            for i in range(len(pos) - width + 1)
            if width
        }
    return got


def _capacity_rate_bound(
    terms: _ConfigTerms, capacity: Mapping[str, int], pp: int, dp: int
) -> float:
    """A lower bound on max_s u_s of every lock-step placement from the groups' replica
    capacity: at most floor(R(F) / dp) stages have all their replicas in a set F of groups. A
    stage with a replica on group g takes at least rho_g times the time of its layer units on
    their fastest groups (`_ConfigTerms.rho`), so with B the layers' best total,
    max_s u_s >= B / sum_s 1 / rho_(s), and the sum is largest when the stages fill the groups
    of smallest rho first. Infinite when the groups cannot hold pp * dp replicas."""
    rho = terms.rho
    inv, left, held, placed = 0.0, pp, 0, 0
    for g in sorted(rho, key=lambda g: (rho[g], g)):
        held += capacity[g]
        n = min(left, held // dp - placed)
        placed += n
        left -= n
        inv += n / rho[g]
        if not left:
            break
    if left:
        return math.inf
    return terms.layers_best / inv


def _multi_group_bound(
    pricer: Pricer,
    c: Candidate,
    groups: Sequence[str],
    m: int,
    cache: dict,
    *,
    fill: float,
    zeros: Sequence[int],
    enough: float = math.inf,
) -> float:
    """A step-time bound of c over the placements that use two or more device groups, valid
    for every member of c's family (its ZeRO stages `zeros`, a schedule fill of at least
    `fill`; `_split_free_bound`'s conventions otherwise). Such a placement pays for crossing
    between the groups, which the bounds valid for every placement cannot charge (a placement
    in one group does not cross); the solver applies this one where the best plan inside one
    group is known (`_single_group_seed`). Dense models (ep 1) only: an expert-parallel stage
    is priced from floors that need its placement.

    Lock-step placements (`cost_model.simulate.evaluate` without shares), not under per-group TP:
      - stages: U >= max(S_min / pp, `_capacity_rate_bound`), S >= max(S_min, U), so the
        pipeline term is at least (m - fill) U + fill S;
      - pp >= 2: some stage boundary joins replicas of two different groups (a stage that spans
        groups meets a neighbour; group-pure stages of different groups meet somewhere), and
        `evaluate` charges the largest hand-off over the boundaries' group pairs, (m v + pp - 1)
        times: at least (m + pp - 1) x the cheapest cross-group hand-off of any boundary; and
        the stage holding ceil(L / pp) layers exposes at least (1 - OE) of its DP traffic
        (`_window_dp`, rep times);
      - pp = 1: the stage's DP ring crosses (one stage crossing); exposed at least
        rep (C - OVERLAP_EFFICIENCY min(C, W)), W the whole model's compute and recompute of
        one micro-batch on its slowest group (every DP overlap window is at most that).
    Group-pure pipelines with uneven shares (ZeRO <= 2, dp >= 2): the split-free share bound
    dp m / rate with each group's pipeline rate counting its cheapest in-group hand-off per
    micro-batch, plus (pp - 1) of the cheapest hand-off, plus the exposed DP traffic with every
    stage's ring crossing (pp crossing at once): max_s (c_s - OE min(c_s, w_s)) >= (1 - OE)
    c_max, c_max >= the crossing time of the least traffic of ceil(L / pp) consecutive layers
    (some stage holds them); and on a shared GroupLink, >= the mean over stages,
    (pp per_whole - OE sum_u w_u) / pp (per-stage link times add over stages; the windows
    add over units; with coding allowed, per_whole is the raw one over the largest ratio a
    method may shrink bytes by, `_best_ratio`).
    Infinite when no such placement exists (e.g. dp 1 and pp 1 with one replica). `enough`:
    the terms that cost most to price (the DP traffic) are left out of a part already above
    it, so the bound may be smaller than it could be, never above what it states."""
    if c.ep > 1:
        return 0.0
    configs = tuple(priced(c, g) for g in groups)
    terms = _config_terms(pricer, groups, configs, cache)
    pp, dp = c.pp, c.dp
    capacity = _capacities(pricer, c, groups, cache)
    pairs = list(itertools.combinations(groups, 2))
    handoffs = _handoffs(pricer, c, groups, cache) if pp >= 2 else {}
    lock = math.inf
    if not c.group_tp and pairs:
        big_u = max(terms.s_min / pp, _capacity_rate_bound(terms, capacity, pp, dp))
        pipe = (m - fill) * big_u + fill * max(terms.s_min, big_u)
        if pp >= 2:
            cross = min(v for (a, b), v in handoffs.items() if a != b)
            lock = pipe + (m + pp - 1) * cross
            if lock <= enough:
                lock += min(
                    (m if z == 3 else 1)
                    * (1 - OVERLAP_EFFICIENCY)
                    * _window_dp(pricer, c, configs[0], groups, capacity, pairs, z, cache)
                    for z in zeros
                )
        else:
            lock = pipe + min(
                (m if z == 3 else 1) * _cross_exposed(v, terms.window)
                for z in zeros
                for v in [_whole_cross(pricer, c, configs[0], pairs, z, cache)]
            )
    share = math.inf
    low = [z for z in zeros if z <= 2]
    if dp >= 2 and pairs and (low or c.group_tp):
        # a group's pipelines take at least W_g / pp + its hand-off per micro-batch, and
        # (pp - 1) hand-offs more to fill
        own = {g: handoffs.get((g, g), 0.0) for g in groups}
        per_group = {g: (w / pp + own[g], w / pp + own[g]) for g, w in terms.whole.items()}
        rate = _share_rate_bound(per_group, capacity, pp, dp)[0]
        if rate > 0:
            share = dp * m / rate + (pp - 1) * min(own.values())
        if rate > 0 and share <= enough:
            exposed = math.inf
            for z in low or [0]:
                c_max, per_whole = _share_cross(pricer, c, configs[0], pairs, z, cache)
                least = (1 - OVERLAP_EFFICIENCY) * c_max
                if per_whole is not None:
                    mean = (pp * per_whole - OVERLAP_EFFICIENCY * terms.unit_windows) / pp
                    least = max(least, mean)
                exposed = min(exposed, least)
            share += exposed
    return min(lock, share)


def _cross_exposed(comm: float, window: float) -> float:
    """`evaluate`'s exposed part of DP traffic `comm` overlapping at most `window` compute."""
    return comm - OVERLAP_EFFICIENCY * min(comm, window)


def _whole_cross(
    pricer: Pricer, c: Candidate, cfg, pairs: list[tuple[str, str]], zero: int, cache: dict
) -> float:
    """The least time of the whole model's DP ring crossing between two groups, one stage
    crossing, at ZeRO `zero` (its first unit's ZeRO-3 collectives left out as `plan_tables`
    does), per occurrence."""
    key = ("whole-cross", c.tp, c.cp, c.ep, c.dp, zero, tuple(pairs))
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        whole = costs.composition(0, len(costs.unit_keys))
        first = costs.unit_keys[0] if zero == 3 else None
        traffic = pricer.dp_traffic(whole, cfg, dp=c.dp, zero=zero, first=first)
        got = cache[key] = min(pricer.dp_cross(traffic, a, b, cfg).time(1) for a, b in pairs)
    return got


def _share_cross(
    pricer: Pricer, c: Candidate, cfg, pairs: list[tuple[str, str]], zero: int, cache: dict
) -> tuple[float, float | None]:
    """(c_max, per_whole) of `_multi_group_bound`'s share part at ZeRO `zero`, every stage's
    ring crossing (pp at once): the least crossing time of ceil(L / pp) consecutive layers'
    DP traffic, and the whole model's time per crossing stage on a shared GroupLink (None
    without one, or when the traffic may be coded: `CommOptions.active`)."""
    pp = c.pp
    key = ("share-cross", c.tp, c.cp, c.ep, c.group_tp, c.dp, pp, zero, tuple(pairs))
    got = cache.get(key)
    if got is not None:
        return got

    def cross(comp, a: str, b: str) -> CrossTraffic:
        if c.group_tp:
            tps = {g: c.tp_of(g) for g in (a, b)}
            return pricer.dp_cross_hetero(comp, a, b, c.parallel(), tps)
        traffic = pricer.dp_traffic(comp, cfg, dp=c.dp, zero=zero)
        return pricer.dp_cross(traffic, a, b, cfg)

    costs = pricer.costs
    windows = _layer_windows(pricer, -(-len(costs.graph.layer_units) // pp), cache)
    c_max = min((cross(w, a, b).time(pp) for w in windows for a, b in pairs), default=0.0)
    whole = costs.composition(0, len(costs.unit_keys))
    per_whole = min(
        (t.per_stage for a, b in pairs if (t := cross(whole, a, b)).per_stage is not None),
        default=None,
    )
    if per_whole is not None and pricer.comm is not None and pricer.comm.active:
        # Coded traffic (`compression.coded_cross`): a collective's bytes on the shared link
        # shrink by its method's ratio, at most `_best_ratio`, so each stage's per-stage time
        # is at least its raw one over that, and so is the sum over stages.
        per_whole /= _best_ratio(pricer.comm)
    got = cache[key] = (c_max, per_whole)
    return got


def _best_ratio(comm: CommOptions) -> float:
    """The largest factor by which a coding method `comm` allows shrinks a collective's
    bytes (`compression.coded_cross`: a lossless ratio of `MEASURED_RATIO`, whatever the
    dtype and tensor, or int8 gradients' wire ratio), at least 1."""
    ratios = [1.0, *MEASURED_RATIO.values()] if comm.lossless else [1.0]
    if comm.int8_gradients:
        ratios.append(int8_gradient_ratio())
    return max(ratios)


def _window_dp(
    pricer: Pricer,
    c: Candidate,
    cfg,
    groups: Sequence[str],
    capacity: Mapping[str, int],
    pairs: list[tuple[str, str]],
    zero: int,
    cache: dict,
) -> float:
    """The least DP traffic time, per occurrence, of a stage holding ceil(L / pp) consecutive
    layers (some stage does) at ZeRO `zero`: its replicas inside one group that holds dp of
    them, or spanning two (one stage crossing, the least `CrossTraffic.time` takes)."""
    key = ("window-dp", c.tp, c.cp, c.ep, c.dp, c.pp, zero, tuple(groups))
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        least = math.inf
        for w in _layer_windows(pricer, -(-len(costs.graph.layer_units) // c.pp), cache):
            first = w[0][0] if zero == 3 else None
            traffic = pricer.dp_traffic(w, cfg, dp=c.dp, zero=zero, first=first)
            for g in groups:
                if capacity[g] >= c.dp:
                    least = min(least, pricer.dp_single(traffic, g, cfg))
            for a, b in pairs:
                least = min(least, pricer.dp_cross(traffic, a, b, cfg).time(1))
        got = cache[key] = 0.0 if math.isinf(least) else least
    return got


def _handoffs(pricer: Pricer, c: Candidate, groups: Sequence[str], cache: dict) -> dict:
    """{(a, b): the cheapest forward + backward hand-off of one micro-batch from a stage on
    group a to the next on group b}, over every boundary a stage can end at
    (`tables.plan_tables`' p2p entries: each TP rank sends 1 / (cp tp) of the boundary
    activation, tp cp dp streams)."""
    key = ("handoff", c.tp, c.cp, c.dp, c.micro_batch, tuple(groups))
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        scale = c.micro_batch / costs.traced_micro_batch
        sizes = {costs.facts[k].output_bytes for k in costs.unit_keys[:-1]}
        streams = c.tp * c.cp * c.dp
        got = cache[key] = {
            (a, b): min(
                (pricer.p2p(size * scale / (c.cp * c.tp), a, b, streams) for size in sizes),
                default=0.0,
            )
            for a in groups
            for b in groups
        }
    return got


def _split_free_memory(
    pricer: Pricer, c: Candidate, n_layers: int, cache: dict, in_flight: float = 1
) -> int:
    """A peak-memory bound of c that holds for every split: some stage holds at least
    ceil(L / pp) consecutive layers and at least `in_flight` micro-batches (every stage holds one;
    `in_flight`: what every stage of c's schedule holds), so it needs at least the least memory
    of such a window (over every window of the layer units)."""
    key = ("mem", c.stage_of(), c.dp, c.zero, c.pp) + ((in_flight,) if in_flight != 1 else ())
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        comps = _layer_windows(pricer, -(-n_layers // c.pp), cache) or {
            costs.composition(0, len(costs.unit_keys))  # no layers: the whole model
        }
        got = cache[key] = min(_stage_memory(pricer, comp, c).peak(in_flight)[0] for comp in comps)
    return got


def _distinct_stage_times(pricer: Pricer, cand: Candidate, comps, groups, cache: dict):
    """(per distinct stage: {group: u}, how many stages each, {group: (U_g, S_g)}) of the
    pipeline ranks' compositions `comps` (`_ScreenMemo.held`: each rank's chunks under
    interleaved 1F1B and ZB-V, as the tables price them), memoised in `cache` (dp and ZeRO do
    not change stage times)."""
    configs = tuple(priced(cand, g) for g in groups)
    key = ("times", tuple(comps), tuple(groups), configs)
    got = cache.get(key)
    if got is not None:
        return got
    distinct: dict = {}
    for comp in comps:
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
    pricer: Pricer, cand: Candidate, comps, groups, cache: dict
) -> tuple[float, float, float, float]:
    """Lower-bound pieces of every placement before any table (memory ignored, capacity
    respected), over the distinct stages (`comps`: each pipeline rank's composition): (U, S)
    of `_stage_bound` for lock-step placements, and (rate, fill) of `_share_rate_bound` for
    group-pure pipelines with uneven shares."""
    stage_times, counts, per_group = _distinct_stage_times(pricer, cand, comps, groups, cache)
    capacity = _capacities(pricer, cand, groups, cache)
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
    pp, m = t.pp, t.m
    stage_times = [{g: t.time[s][g].total for g in allowed[s]} for s in range(pp)]
    big_u, total = _stage_bound(stage_times, [1] * pp, t.replica_capacity, t.parallel.dp)
    return _pipeline_bound(big_u, total, m, t.fill) + _lock_extra(t, allowed)


def _lock_extra(t: PlanTables, allowed: list[list[str]]) -> float:
    """What `_lower_bound` adds to the pipeline term of every lock-step placement: the bubble
    units, the hand-offs, DP traffic and optimizer at their cheapest allowed group (pair)."""
    pp, m, v = t.pp, t.m, t.chunks
    p2p = max(
        (min(t.p2p[s][(a, b)] for a in allowed[s] for b in allowed[s + 1]) for s in range(pp - 1)),
        default=0.0,
    )
    z = max(min(t.bubble_unit(s, g) for g in allowed[s]) for s in range(pp))
    return (pp - 1) * z + (m * v + pp - 1) * p2p + _exposed_and_optimizer(t, allowed)


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
    return t.parallel.dp * t.m / rate + fill + _share_extra(t, allowed)


def _share_extra(t: PlanTables, allowed: list[list[str]]) -> float:
    """What `_share_bound` adds to the pipeline term of every group-pure placement: DP traffic
    and optimizer, every stage's replicas spanning the groups."""
    return _exposed_and_optimizer(t, allowed, t.pp)
