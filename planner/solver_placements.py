"""Warm-start placements of the screen (step 2 of `meshplan.solver`, `solver_screen`): the
greedy lock-step ones (`_greedy_placements`) and group-pure pipelines with uneven shares
(`_share_placements`), priced by `cost_model.simulate.evaluate` where the screen calls them.

Uneven data-parallel batch shares (`_share_placements`): besides lock-step placements (every
replica runs m micro-batches, the model of `solver_model`), a configuration with ZeRO <= 2 may
run group-pure pipelines, n_g pipelines wholly inside group g, each running m_g micro-batches,
sum_g n_g m_g = dp m (`StagePlacement.microbatches`). Each group's pipeline term is
f_g(m_g) = m_g (U_g + v P_g) + (S_g - U_g) / v + (pp - 1) P_g and the step takes the max over
groups (`cost_model.simulate.evaluate`). For every pair of host groups and every split
n_a + n_b = dp the best integer shares are found exactly: f_a rises and f_b falls with m_a,
so the optimum is the feasible m_a nearest the crossing point on either side. The shares
never raise a stage's in-flight activations (m_g stays where the schedule's warm-up depth
is already saturated).

Three or more host groups at once (session 31): for every set of at least three host groups
(a support) and every split of dp over it (`_splits_over`: each group at least one pipeline),
visited in order of the split's continuous bound, the best integer shares come from
`_support_shares` (the first group's count enumerated outward from the crossing point, the
rest solved the same way down to a pair). Within a support the DP traffic and the optimizer
are the same for every split (every stage's replicas span the support's groups), so the
pipeline term alone ranks them and the visit stops once the bound reaches the best found:
exact for every support while its splits number at most SHARE_SPLITS_LIMIT.

Objective "cost" (session 32): the group mix changes the price, so every support of two or
more host groups gives its (pipeline term, price) frontier (`_support_placements` with
rates); before, pairs were tried up to dp 64 (a window beyond) and larger supports not at
all.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from meshplan.cost_model.tables import PlanTables
from meshplan.ir import microbatch_problem

from .solver_bounds import _share_cap, _share_hosts, _share_terms
from .solver_splits import _take_replicas

# Shares over three or more groups: the splits of dp over all supports of one configuration
# are enumerated up to this many (numpy, a few ms); past it the rest count as open. Sailor-sized
# three-type clusters (128 GPUs of each type, pp 1) have at most 12,288 (at dp 192).
SHARE_SPLITS_LIMIT = 200_000
# Equal shares (`_equal_share_placements`) are searched over every support of two or more host
# groups up to this many host groups (2^6 - 7 = 57 supports), over pairs beyond.
EQUAL_SHARE_HOSTS = 6


def _pair_shares(
    fa: tuple[float, float],
    fb: tuple[float, float],
    na: int,
    nb: int,
    total: int,
    cap: int,
    runs: Callable[[int], bool] = lambda m: True,
) -> tuple[int, int] | None:
    """Integer (m_a, m_b) >= 1, <= cap, both counts the schedule runs (`runs`,
    `ir.microbatch_problem`), with na m_a + nb m_b = total minimising max(fa(m_a), fb(m_b))
    for increasing linear fa, fb: the feasible m_a nearest the crossing point on either side
    (divisibility alone repeats every nb / gcd(na, nb); `runs` may skip further)."""
    (sa, ca), (sb, cb) = fa, fb
    lo = max(1, -(-(total - nb * cap) // na))
    hi = min(cap, (total - nb) // na)
    if lo > hi:
        return None
    x = (sb * total / nb + cb - ca) / (sa + sb * na / nb)

    def feasible(ma: int) -> bool:
        rest = total - na * ma
        return rest % nb == 0 and runs(ma) and runs(rest // nb)

    picks = []
    down = min(hi, max(lo, math.floor(x)))
    picks += [next((ma for ma in range(down, lo - 1, -1) if feasible(ma)), None)]
    up = max(lo, min(hi, math.ceil(x)))
    picks += [next((ma for ma in range(up, hi + 1) if feasible(ma)), None)]
    picks = [ma for ma in picks if ma is not None]
    if not picks:
        return None
    ma = min(picks, key=lambda a: (max(sa * a + ca, sb * ((total - na * a) // nb) + cb), a))
    return ma, (total - na * ma) // nb


def _split_count(dp: int, caps: tuple[int, ...], ep: int) -> float:
    """How many splits `_splits_over` would list (float: exact below 2^53, enough for a
    limit): the coefficient of x^(dp / ep) in prod_i (x + ... + x^(caps[i] // ep))."""
    top = dp // ep
    poly = np.zeros(top + 1)
    poly[0] = 1.0
    for cap in caps:
        part = np.zeros(min(cap // ep, top) + 1)
        part[1:] = 1.0
        poly = np.convolve(poly, part)[: top + 1]
    return float(poly[top])


@functools.lru_cache(maxsize=16)  # at most 16 x 200k splits x groups x 8 bytes
def _splits_over(dp: int, caps: tuple[int, ...], ep: int) -> np.ndarray:
    """Every split of dp pipelines over len(caps) groups, n_i a multiple of ep in
    [ep, caps[i]], as the rows of a read-only int64 array in lexicographic order. Each group's
    value is drawn only where the groups after it can still take the rest, so no partial row
    is wasted (ask `_split_count` first: the array has that many rows)."""
    top, c = dp // ep, [cap // ep for cap in caps]
    after = np.cumsum([0, *c[::-1]])[::-1]  # after[i]: the most groups i.. can take
    rows = np.zeros((1, 0), dtype=np.int64)
    for i in range(len(c) - 1):
        used = rows.sum(axis=1)
        lo = np.maximum(1, top - used - after[i + 1])
        hi = np.minimum(c[i], top - used - (len(c) - 1 - i))
        n = np.maximum(hi - lo + 1, 0)
        offsets = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        rows = np.column_stack([np.repeat(rows, n, axis=0), np.repeat(lo, n) + offsets])
    rows = np.column_stack([rows, top - rows.sum(axis=1)]) * ep
    rows.setflags(write=False)
    return rows


def _support_shares(
    terms: Sequence[tuple[float, float]],
    ns: Sequence[int],
    total: int,
    cap: int,
    runs: Callable[[int], bool],
    best: float,
) -> tuple[float, tuple[int, ...]] | None:
    """(pipeline term, m) over integer m_i in [1, cap] that the schedule `runs`, with
    sum_i n_i m_i = total, minimising max_i (s_i m_i + c_i) for terms[i] = (s_i, c_i); None
    unless some m scores below `best`. Two groups: `_pair_shares`. More: with the groups in
    decreasing n_i, m_0 rises from the continuous crossing point while f_0 stays below the best
    found, and falls from it while the continuous bound of the others (their shares of the
    rest) does; the others are solved the same way for each m_0."""
    if len(ns) == 2:
        got = _pair_shares(terms[0], terms[1], ns[0], ns[1], total, cap, runs)
        if got is None:
            return None
        pipe = max(s * m + c for (s, c), m in zip(terms, got))
        return (pipe, got) if pipe < best else None
    if any(a < b for a, b in zip(ns, ns[1:])):
        # the group with the most pipelines first: each step of its count moves the others'
        # share most, so both loops below stop soonest
        order = sorted(range(len(ns)), key=lambda i: (-ns[i], i))
        got = _support_shares([terms[i] for i in order], [ns[i] for i in order], total, cap,
                              runs, best)  # fmt: skip
        if got is None:
            return None
        ms = [0] * len(ns)
        for i, m in zip(order, got[1]):
            ms[i] = m
        return got[0], tuple(ms)
    (s0, c0), n0 = terms[0], ns[0]
    rest_terms, rest_ns = terms[1:], ns[1:]
    lo = max(1, -(-(total - sum(rest_ns) * cap) // n0))
    hi = min(cap, (total - sum(rest_ns)) // n0)
    if lo > hi:
        return None
    rate = sum(n / s for (s, _), n in zip(rest_terms, rest_ns))
    lift = sum(n * c / s for (s, c), n in zip(rest_terms, rest_ns))
    crossing = (total + n0 * c0 / s0 + lift) / (n0 / s0 + rate)
    start = min(hi, max(lo, math.ceil((crossing - c0) / s0)))
    out = None

    def one(m0: int) -> None:
        nonlocal best, out
        if not runs(m0) or s0 * m0 + c0 >= best:
            return
        sub = _support_shares(rest_terms, rest_ns, total - n0 * m0, cap, runs, best)
        if sub is not None:
            pipe = max(s0 * m0 + c0, sub[0])
            if pipe < best:
                best, out = pipe, (pipe, (m0, *sub[1]))

    for m0 in range(start, hi + 1):  # f_0 rises with m_0
        if s0 * m0 + c0 >= best:
            break
        one(m0)
    for m0 in range(start - 1, lo - 1, -1):  # the others' continuous bound rises as m_0 falls
        if (total - n0 * m0 + lift) / rate >= best:
            break
        one(m0)
    return out


def _integer_bounds(
    splits: np.ndarray, slopes: np.ndarray, consts: np.ndarray, total: int, cap: int, m: int
) -> np.ndarray:
    """Per split (row of n_g), a lower bound on its least pipeline term max_g (s_g m_g + c_g)
    over integer 1 <= m_g <= cap with sum_g n_g m_g = total: below the least T at which the
    counts each group can run within T, min(cap, floor((T - c_g) / s_g)), reach `total`
    (integer, so above the continuous crossing). Bisection between that crossing (or
    max_g s_g + c_g, every group at least one) and the equal shares' value (m each, feasible),
    30 halvings for every split at once; the lower end, less a rounding margin, is returned."""
    lo = (total + splits @ (consts / slopes)) / (splits @ (1.0 / slopes))
    lo = np.maximum(lo, (slopes + consts).max())
    hi = np.full(len(splits), (slopes * m + consts).max())
    lo = np.minimum(lo, hi)
    for _ in range(30):
        mid = (lo + hi) / 2
        counts = np.clip(np.floor((mid[:, None] - consts) / slopes), 0, cap)
        enough = ((splits * counts).sum(axis=1) >= total) & (counts.min(axis=1) >= 1)
        hi = np.where(enough, mid, hi)
        lo = np.where(enough, lo, mid)
    return lo * (1 - 1e-12)


def _listed_supports(t: PlanTables, hosts: list[str], terms, cap: int, smallest: int):
    """([(support, its splits, their `_integer_bounds`)], exact, splits listed) for every
    support of at least `smallest` host groups in size order (`_splits_over`), skipping those
    whose splits would take the count past SHARE_SPLITS_LIMIT (then not exact)."""
    dp, pp, total = t.parallel.dp, t.pp, t.parallel.dp * t.m
    ep = t.parallel.ep or 1
    out, exact, listed = [], True, 0
    for size in range(smallest, len(hosts) + 1):
        for support in itertools.combinations(hosts, size):
            caps = tuple(t.replica_capacity[g] // pp for g in support)
            count = _split_count(dp, caps, ep)
            if not count:
                continue
            if listed + count > SHARE_SPLITS_LIMIT:
                exact = False
                continue
            splits = _splits_over(dp, caps, ep)
            listed += len(splits)
            slopes = np.array([terms[g][0] for g in support])
            consts = np.array([terms[g][1] for g in support])
            out.append((support, splits, _integer_bounds(splits, slopes, consts, total, cap, t.m)))
    return out, exact, listed


def _support_placements(
    t: PlanTables, hosts: list[str], terms, cap: int, runs, rates: Mapping[str, float] | None = None
):
    """Group-pure share placements over every support of host groups, each support's splits
    visited in order and solved exactly (`_support_shares`) only where their integer bound is
    below the least pipeline term found before them; each that lowers it is kept: ([(placement,
    shares)], exact, splits enumerated, splits visited). Not exact once the supports' splits
    would pass SHARE_SPLITS_LIMIT (those supports are skipped).

    Throughput (`rates` None): supports of three or more groups (pairs are `_share_placements`'
    own), visited in bound order, so the first split skipped ends the support's visit (module
    docstring). Objective "cost" (`rates`: each group's price per second of a replica-stage's
    GPUs): supports of two or more groups, visited by price (then bound), which keeps each
    support's (pipeline term, price) frontier. A plan's score is its step time times its
    GPUs' price, and within a support the step is the pipeline term plus the same DP traffic
    and optimizer for every split (module docstring), while the price is sum_g n_g rates[g]
    (per stage); so the cheapest split is on that frontier: no split at most as expensive has a
    smaller pipeline term."""
    pp, total = t.pp, t.parallel.dp * t.m
    supports, exact, listed = _listed_supports(t, hosts, terms, cap, 3 if rates is None else 2)
    out, visited = [], 0
    for support, splits, bounds in supports:
        keys = (*splits.T[::-1], bounds)  # then the split: deterministic
        if rates is not None:
            keys = (*keys, splits @ np.array([rates[g] for g in support]))
        order = np.lexsort(keys)
        sterms = [terms[g] for g in support]
        best_pipe = math.inf
        for i, bound in zip(order.tolist(), bounds[order].tolist(), strict=True):
            if bound >= best_pipe * (1 - 1e-12):
                if rates is None:
                    break  # bound order: every later split's bound is at least this one's
                continue  # a split no dearer is at least as fast
            visited += 1
            ns = splits[i].tolist()
            got = _support_shares(sterms, ns, total, cap, runs, best_pipe)
            if got is None:
                continue
            best_pipe = got[0]
            placement = [list(zip(support, ns)) for _ in range(pp)]
            out.append((placement, dict(zip(support, got[1]))))
    return out, exact, listed, visited


def _equal_share_placements(
    t: PlanTables, hosts: list[str], rates: Mapping[str, float] | None = None
):
    """Group-pure placements whose replicas all run m micro-batches (`equal_shares`: Sailor's
    and Metis's runtimes): ([(placement, shares)], exact). With equal counts a support's
    pipeline term is its slowest group's f_g(m) whatever the split, and its DP traffic and
    optimizer are the same for every split too (module docstring), so one split per support
    of two or more host groups covers them all (each group ep pipelines, the rest filled in
    the cluster's order; with `rates`, objective "cost", cheapest group first, which makes
    that split the support's cheapest). Exact up to EQUAL_SHARE_HOSTS host groups; beyond,
    pairs only."""
    dp, pp, m = t.parallel.dp, t.pp, t.m
    ep = t.parallel.ep or 1
    exact = len(hosts) <= EQUAL_SHARE_HOSTS
    out = []
    for size in range(2, len(hosts) + 1 if exact else 3):
        for support in itertools.combinations(hosts, size):
            caps = [t.replica_capacity[g] // pp // ep * ep for g in support]
            if size * ep > dp or min(caps) < ep or sum(caps) < dp:
                continue
            ns, left = [ep] * size, dp - size * ep
            fill = range(size)
            if rates is not None:  # the same pipeline term for every split: the cheapest
                fill = sorted(fill, key=lambda i: (rates[support[i]], i))
            for i in fill:
                take = min(left, caps[i] - ep)
                ns[i] += take
                left -= take
            out.append(([list(zip(support, ns)) for _ in range(pp)], {g: m for g in support}))
    return out, exact


def _share_placements(
    t: PlanTables,
    allowed: list[list[str]],
    rates: Mapping[str, float] | None = None,
    equal: bool = False,
):
    """Group-pure placements with uneven shares: ([(placement, shares)], exact, listed,
    visited).

    For every pair of host groups (a, b) and n_a + n_b = dp pipelines, the best shares come
    from `_pair_shares` (counts the schedule runs only), the n_a visited in order of their
    continuous bound T(n_a) = (M + sum_g n_g c_g / s_g) / (sum_g n_g / s_g); the visit stops
    once T(n_a) reaches the best integer pipeline term found: exact for every pair. Supports
    of three or more host groups follow (`_support_placements`; `listed` and `visited`: the
    splits it enumerated and priced, the screen's work). `exact` says that every group-pure
    placement was covered (over three or more host groups, within SHARE_SPLITS_LIMIT).
    `rates` (objective "cost": the price per second of a replica-stage's GPUs on each group):
    the group mix changes the price, so every support's (pipeline term, price) frontier
    instead (`_support_placements` with `rates`). `equal`: only shares of m micro-batches each
    (`_equal_share_placements`)."""
    if t.parallel.zero == 3:
        return [], True, 0, 0
    cap = _share_cap(t)
    if cap <= t.m and not t.group_tp:  # per-group TP: equal shares (cap = m) still count
        return [], True, 0, 0
    hosts = _share_hosts(t, allowed)
    if len(hosts) < 2:
        return [], True, 0, 0
    if equal:
        return (*_equal_share_placements(t, hosts, rates), 0, 0)
    dp, pp, total = t.parallel.dp, t.pp, t.parallel.dp * t.m
    terms = {g: _share_terms(t, g) for g in hosts}
    schedule = t.parallel.schedule

    def runs(m: int) -> bool:
        return microbatch_problem(schedule, pp, m) is None

    if rates is not None:
        return _support_placements(t, hosts, terms, cap, runs, rates)
    out = []
    ep = t.parallel.ep or 1
    for a, b in itertools.combinations(hosts, 2):
        (sa, ca), (sb, cb) = terms[a], terms[b]
        ra, rb = t.replica_capacity[a] // pp, t.replica_capacity[b] // pp
        lo, hi = max(1, dp - rb), min(dp - 1, ra)
        if lo > hi:
            continue
        order = sorted(
            range(lo, hi + 1),
            key=lambda na: (
                (total + na * ca / sa + (dp - na) * cb / sb) / (na / sa + (dp - na) / sb),
                na,
            ),
        )
        best_pipe = math.inf
        for na in order:
            nb = dp - na
            if na % ep:  # an ep group's all-to-alls need one share: inside one group
                continue
            bound = (total + na * ca / sa + nb * cb / sb) / (na / sa + nb / sb)
            if bound >= best_pipe * (1 - 1e-12):
                break
            got = _pair_shares(terms[a], terms[b], na, nb, total, cap, runs)
            if got is None:
                continue
            pipe = max(sa * got[0] + ca, sb * got[1] + cb)
            if pipe >= best_pipe:
                continue
            best_pipe = pipe
            placement = [[(a, na), (b, nb)] for _ in range(pp)]
            out.append((placement, {a: got[0], b: got[1]}))
    exact, listed, visited = True, 0, 0
    if len(hosts) >= 3:
        more, exact, listed, visited = _support_placements(t, hosts, terms, cap, runs)
        out += more
    return out, exact, listed, visited


def _greedy_placements(t: PlanTables, allowed: list[list[str]], order: Sequence[str]):
    """Warm-start placements: (1) rank order over the groups as listed, fastest first and
    slowest first (as the splits of `_splits` assume); (2) heaviest stage first, each into its
    fastest group that can hold all its replicas, else split fastest first; (3) everything in
    one group when that group holds it all. `order`: the cluster's groups; those the tables
    do not price (too small for a replica of tp x cp GPUs) are left out."""
    dp, pp = t.parallel.dp, t.pp
    order = [g for g in order if g in t.groups]

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
            reps = _take_replicas(free, groups, dp)
            if reps is None:
                return None
            out[s] = reps
        return out

    speed = sorted(order, key=lambda g: (sum(t.time[s][g].total for s in range(pp)), g))
    tries = [fill(range(pp), lambda s, o=o: o) for o in (list(order), speed, speed[::-1])]
    heavy = sorted(range(pp), key=lambda s: -max(t.time[s][g].total for g in allowed[s]))
    tries.append(fill(heavy, lambda s: sorted(order, key=lambda g: t.time[s][g].total)))
    for g in order:
        tries.append(fill(range(pp), lambda s, g=g: [g]))
    out = []
    for p in tries:
        if p is not None and p not in out:
            out.append(p)
    return out
