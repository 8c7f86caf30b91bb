"""Warm-start placements of the screen (step 2 of `meshplan.solver`, `solver_screen`): the
greedy lock-step ones (`_greedy_placements`) and group-pure pipelines with uneven shares
(`_share_placements`), priced by `cost_model.simulate.evaluate` where the screen calls them.

Uneven data-parallel batch shares (`_share_placements`): besides lock-step placements (every
replica runs m micro-batches, the model of `solver_model`), a configuration with ZeRO <= 2 may
run group-pure pipelines, n_g pipelines wholly inside group g, each running m_g micro-batches,
sum_g n_g m_g = dp m (`StagePlacement.microbatches`). Each group's pipeline term is
f_g(m_g) = m_g (U_g + v P_g) + (S_g - U_g) / v + (pp - 1) P_g and the step takes the max over
groups (`cost_model.simulate.evaluate`). For every pair of host groups and every split
n_a + n_b = dp (a window around the fastest-first split when dp > SHARE_EXHAUSTIVE_DP) the
best integer shares are found exactly: f_a rises and f_b falls with m_a, so the optimum is the
feasible m_a nearest the crossing point on either side. The shares never raise a stage's
in-flight activations (m_g stays where the schedule's warm-up depth is already saturated).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from meshplan.cost_model.tables import PlanTables
from meshplan.ir import microbatch_problem

from .solver_bounds import _share_cap, _share_hosts, _share_terms
from .solver_splits import _take_replicas

# Uneven DP shares: every split of dp pipelines over two groups is tried up to this dp, a
# window of SHARE_WINDOW splits around the fastest-first one beyond it.
SHARE_EXHAUSTIVE_DP = 64
SHARE_WINDOW = 8


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


def _share_placements(t: PlanTables, allowed: list[list[str]], prune: bool = True):
    """Group-pure placements with uneven shares: ([(placement, shares)], exact).

    For every pair of host groups (a, b) and n_a + n_b = dp pipelines, the best shares come
    from `_pair_shares` (counts the schedule runs only). With `prune` (objectives that rank
    by step time) the n_a are visited in order of their continuous bound
    T(n_a) = (M + sum_g n_g c_g / s_g) / (sum_g n_g / s_g)
    and the visit stops once T(n_a) reaches the best integer pipeline term found: exact for
    every pair. Without it (cost: the group mix changes the price) every n_a is tried up to
    dp = SHARE_EXHAUSTIVE_DP, a window around the fastest-first split beyond. `exact` says that
    every group-pure placement was covered (at most two host groups, no window)."""
    if t.parallel.zero == 3:
        return [], True
    cap = _share_cap(t)
    if cap <= t.m and not t.group_tp:  # per-group TP: equal shares (cap = m) still count
        return [], True
    hosts = _share_hosts(t, allowed)
    if len(hosts) < 2:
        return [], True
    dp, pp, total = t.parallel.dp, t.pp, t.parallel.dp * t.m
    terms = {g: _share_terms(t, g) for g in hosts}
    schedule = t.parallel.schedule

    def runs(m: int) -> bool:
        return microbatch_problem(schedule, pp, m) is None

    out = []
    exact = len(hosts) == 2 and (prune or dp <= SHARE_EXHAUSTIVE_DP)
    ep = t.parallel.ep or 1
    for a, b in itertools.combinations(hosts, 2):
        (sa, ca), (sb, cb) = terms[a], terms[b]
        ra, rb = t.replica_capacity[a] // pp, t.replica_capacity[b] // pp
        lo, hi = max(1, dp - rb), min(dp - 1, ra)
        if lo > hi:
            continue
        if prune:
            order = sorted(
                range(lo, hi + 1),
                key=lambda na: (
                    (total + na * ca / sa + (dp - na) * cb / sb) / (na / sa + (dp - na) / sb),
                    na,
                ),
            )
        elif dp <= SHARE_EXHAUSTIVE_DP:
            order = list(range(lo, hi + 1))
        else:
            centre = hi if sa <= sb else lo
            order = list(range(max(lo, centre - SHARE_WINDOW), min(hi, centre + SHARE_WINDOW) + 1))
        best_pipe = math.inf
        for na in order:
            nb = dp - na
            if na % ep:  # an ep group's all-to-alls need one share: inside one group
                continue
            if prune:
                bound = (total + na * ca / sa + nb * cb / sb) / (na / sa + nb / sb)
                if bound >= best_pipe * (1 - 1e-12):
                    break
            got = _pair_shares(terms[a], terms[b], na, nb, total, cap, runs)
            if got is None:
                continue
            pipe = max(sa * got[0] + ca, sb * got[1] + cb)
            if prune and pipe >= best_pipe:
                continue
            best_pipe = min(best_pipe, pipe)
            placement = [[(a, na), (b, nb)] for _ in range(pp)]
            out.append((placement, {a: got[0], b: got[1]}))
    return out, exact


def _greedy_placements(t: PlanTables, allowed: list[list[str]], order: Sequence[str]):
    """Warm-start placements: (1) rank order over the groups as listed, fastest first and
    slowest first (as the splits of `_splits` assume); (2) heaviest stage first, each into its
    fastest group that can hold all its replicas, else split fastest first; (3) everything in
    one group when that group holds it all."""
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
