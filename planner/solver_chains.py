"""Step 2b, continued (`meshplan.solver_layouts`): pipelines through three device groups, each
run of stages on its group at its own TP degree (Metis's plan shape on three GPU types).

`solver_layouts` searches pipelines over a pair of groups (Sailor's shape, with a mixed
stage). On a cluster of three or more groups a peer may chain three: the first k_1 stages on
group g_1 at degree t_1, the next k_2 on g_2 at t_2, the last k_3 on g_3 at t_3. This module
adds that family to the same search: same sets, rules and pricing as the pair family's
(module docstring there), with

Sets
    (g_1, g_2, g_3)   an ordered triple of distinct device groups
    (t_1, t_2, t_3)   degrees dividing each group's NVLink domain and the heads, not all
                      equal (one degree everywhere is the placement models', steps 2-3)
    k_i >= 1          stages per run, pp = k_1 + k_2 + k_3 <= layers, t_i dp k_i <= N_i
    dp, mb, m, r      as in the pair family (every pipeline runs the same m)

No stage mixes groups here. Split: run i's n_i layers spread evenly over its stages
(`_even_counts`), (n_1, n_2) searched in the order of the slowest stage's least time, as
the pair family's split.

Bound, valid for every split (the pair family's, with three runs): with tau_i the marginal
time of one layer on a rank of g_i at t_i, the slowest stage U >= max(L / (k_1 / tau_1 +
k_2 / tau_2 + k_3 / tau_3), max tau_i) (every stage holds a layer), the stages' sum S >=
sum_i k_i tau_i + (L - pp) min tau_i, and `evaluate`'s hand-off term P is at least every
boundary's, so the step is at least (m - 1) U + S + (m + pp - 1) max(P_12, P_23), each P the
hand-off of every pipeline at once (`_Layouts.handoff`). A head (groups, degrees, dp,
micro-batch, recompute) is bounded first with U at its most stages per run and S and pp at
one stage per run, and its grid of (k_1, k_2, k_3) only when that is below the incumbent.
`lifted` takes whole layers per split (U from tau_i ceil(n_i / k_i), S >= sum_i n_i tau_i)
jointly with the exposed gradient traffic: the first stage's, as `_Layouts.lifted` does for
pairs, and (where every layer is the same block) (1 - OVERLAP_EFFICIENCY) of the ring of each
run's largest stage. A chain reaching
the top of the bound order prices only the splits whose slowest stage leaves room below the
best plan so far (`slowest_limit`).

On Sailor's and meshplan's two-group scenarios the family is empty and every plan is
byte-identical (`benchmarks/plan_bytes.py`). On three groups it costs time: GPT-Neo-2.7B on
4 A100 + 8 V100 + 8 T4 plans in 1.36 s instead of 1.0 s (same plan); on 128 of each, 6.4 s
instead of 6.1 s, for a plan 3.7% faster (a T4 tp 2 -> V100 tp 1 -> A100 tp 1 chain) and a
larger open gap (40% against 29%: the budget ends with chains still open, their bounds
lacking most of the exposed gradient traffic on 50 Gb/s Ethernet); Llama 3 8B on four groups
of 32, 4.36 s instead of 4.31 s (docs/planner.md).

Not searched: chains over four or more groups, a run revisiting a group, stages mixing
groups in a chain (all priced and run when given: `meshplan estimate --layout`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY
from meshplan.ir import Parallel, Recompute, Schedule
from meshplan.passes.partition import replica_capacity

from .solver_candidates import _divisors_upto, micro_batch_options
from .solver_pipelines import _degrees, _even_counts, _groups_of, _schedule, pins_allow


@dataclass(frozen=True)
class Chain:
    """One layout of the family: `parallel` (tp = t_1, pp = k_1 + k_2 + k_3) with `runs` of
    (group, degree, stages) in pipeline order."""

    parallel: Parallel
    runs: tuple[tuple[str, int, int], ...]
    mixed: int = 0  # `_Layouts` reads these: a chain has no stage mixing groups
    mixed_stage: None = None

    @property
    def a(self) -> str:  # the first run's group and degree (`_Layouts._first_exposures`)
        return self.runs[0][0]

    @property
    def t_a(self) -> int:
        return self.runs[0][1]

    @property
    def sort_key(self) -> tuple:
        p = self.parallel
        return (self.runs, p.dp, p.micro_batch, p.recompute.value)

    def counts(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Layer counts per stage: run i's `layers[i]` spread over its stages (`_even_counts`)."""
        return tuple(c for n, (_, _, k) in zip(layers, self.runs, strict=True)
                     for c in _even_counts(n, k))  # fmt: skip

    def on(self, s: int) -> tuple[tuple[str, int, int], ...]:
        """Stage s's (group, replicas, degree)."""
        for g, t, k in self.runs:
            if s < k:
                return ((g, self.parallel.dp, t),)
            s -= k
        raise IndexError(s)


def chains(
    costs, pinned: Parallel, global_batch: int, recomputes: Sequence[Recompute], sp: bool,
    below: float,
) -> Iterator[tuple[float, tuple, Chain]]:  # fmt: skip
    """(bound, sort key, chain) of every chain of the module docstring's sets whose bound is
    below `below`, in bound order (nothing on a cluster of fewer than three groups, or where
    step 1's pins rule the family out: `solver_pipelines.pins_allow`); `costs` is the pair
    family's `_Layouts` (per-layer times, hand-offs, the bounded count). Per (dp,
    micro-batch, recompute) the heads' least bounds are computed for every triple of (group,
    degree) options at once (numpy); a head's (k_1, k_2, k_3) grid is bounded only when the
    search reaches its least bound (`_in_order`), and its chains are built as they are
    consumed, so a search that stops early (a plan in hand, or its budget spent) never
    builds the rest. (Until session 31 every chain below `below` was built up front: with a
    poor incumbent, Llama 3 70B on 32 A100 + 32 V100 + 32 T4 spent minutes there, outside
    the work budget.)"""
    return _in_order(
        costs, pinned, all_heads(costs, pinned, global_batch, recomputes, sp, below), below
    )


def all_heads(
    costs, pinned: Parallel, global_batch: int, recomputes: Sequence[Recompute], sp: bool,
    below: float,
) -> list[tuple]:  # fmt: skip
    """Every head of `chains` whose least bound is below `below`, as (least bound, order,
    arguments of `_grid`), unsorted (none where `chains` has none)."""
    p, graph, n = pinned, costs.graph, costs.n_layers
    groups = costs.pricer.cluster.groups
    if len(groups) < 3 or n < 3 or not pins_allow(p):
        return []
    every = [(g, t) for g in groups for t in _degrees(g, graph)]
    most = max(replica_capacity(g, t) for g, t in every)
    out: list[tuple] = []
    for dp in [p.dp] if p.dp is not None else _divisors_upto(global_batch, most):
        if global_batch % dp:
            continue
        # (group, degree, most stages) that hold at least one stage of dp replicas
        options = [(g, t, min(replica_capacity(g, t) // dp, n - 2)) for g, t in every]
        options = [o for o in options if o[2] >= 1]
        if len({g.name for g, _, _ in options}) < 3:
            continue
        mbs = (
            [p.micro_batch]
            if p.micro_batch is not None
            else micro_batch_options(global_batch // dp, 2)
        )
        for mb in mbs:
            if global_batch % (dp * mb):
                continue
            hand = np.array([[costs.handoff(a.name, ta, b.name, tb, dp, mb) if a is not b else 0.0
                              for b, tb, _ in options] for a, ta, _ in options])  # fmt: skip
            for rc in recomputes:
                out += _heads(costs, p, options, hand, dp, mb, rc, global_batch, sp, below)
    return out


def _in_order(costs, p, todo, below) -> Iterator[tuple[float, tuple, Chain]]:
    """The chains of `todo` ((least bound, order, arguments of `_grid`)) in (bound, sort key)
    order: a head's grid is expanded once its least bound is at most the smallest bound
    waiting (every chain of a head bounds at least its head's least), and each grid yields
    its chains one at a time (a k-way merge)."""
    heapq.heapify(todo)
    waiting: list[tuple[float, tuple, int, Chain, Iterator]] = []
    while todo or waiting:
        # (a head's least bound sums differently from its grid's: the slack keeps ties in order)
        while todo and (not waiting or todo[0][0] <= waiting[0][0] * (1 + 1e-12)):
            _, order, args = heapq.heappop(todo)
            grid = _grid(costs, p, *args, below)
            first = next(grid, None)
            if first is not None:
                heapq.heappush(waiting, (first[0], first[1], order, first[2], grid))
        if not waiting:
            return
        bound, key, order, chain, grid = heapq.heappop(waiting)
        yield bound, key, chain
        after = next(grid, None)
        if after is not None:
            heapq.heappush(waiting, (after[0], after[1], order, after[2], grid))


def _heads(costs, p, options, hand, dp, mb, rc, global_batch, sp, below):
    """The heads at (dp, mb, rc) whose least bound is below `below`, as (least bound, order,
    arguments of `_grid`): the least bounds over all triples of `options` at once (U at each
    run's most stages, S and pp at one stage per run)."""
    n, m = costs.n_layers, global_batch // (dp * mb)
    base = Parallel(
        dp=dp, tp=1, pp=3, cp=1, ep=1, micro_batch=mb, global_batch=global_batch,
        recompute=rc, zero=0, schedule=Schedule.ONE_F_ONE_B, sequence_parallel=sp,
    )  # fmt: skip
    tau = np.array([costs.per_layer(g.name, base.stage(t)) for g, t, _ in options])
    kmax = np.array([k for *_, k in options], dtype=np.float64)
    group = np.array([costs.pricer.cluster.groups.index(g) for g, _, _ in options])
    degree = np.array([t for _, t, _ in options])
    i, j, k = np.meshgrid(*(np.arange(len(options)),) * 3, indexing="ij")
    valid = (group[i] != group[j]) & (group[j] != group[k]) & (group[i] != group[k])
    valid &= ~((degree[i] == degree[j]) & (degree[j] == degree[k]))  # steps 2-3's
    slow = np.maximum(np.maximum(tau[i], tau[j]), tau[k])
    fast = np.minimum(np.minimum(tau[i], tau[j]), tau[k])
    slowest = np.maximum(n / (kmax[i] / tau[i] + kmax[j] / tau[j] + kmax[k] / tau[k]), slow)
    cross = np.maximum(hand[i, j], hand[j, k])
    least = (m - 1) * slowest + tau[i] + tau[j] + tau[k] + (n - 3) * fast + (m + 2) * cross
    near = valid & (least < below)
    costs.bounded += int((valid & ~near).sum())  # each bounded once, as a whole
    out = []
    for a, b, c in zip(*np.nonzero(near), strict=True):
        trio = (options[a], options[b], options[c])
        args = (base, trio, tau[[a, b, c]], float(cross[a, b, c]), m)
        out.append((float(least[a, b, c]), (dp, mb, rc.value, int(a), int(b), int(c)), args))
    return out


def _grid(costs, p, base, trio, taus, cross, m, below) -> Iterator[tuple[float, tuple, Chain]]:
    """The chains of one head (`trio`: each run's (group, degree, most stages)) whose bound
    over its (k_1, k_2, k_3) grid is below `below`, in (bound, sort key) order; the grid is
    bounded (and counted) when first asked."""
    n = costs.n_layers
    k1, k2, k3 = np.meshgrid(*(np.arange(1, k + 1, dtype=np.float64) for *_, k in trio),
                             indexing="ij")  # fmt: skip
    pp = k1 + k2 + k3
    with np.errstate(divide="ignore"):
        rate = k1 / taus[0] + k2 / taus[1] + k3 / taus[2]
    # every stage holds a layer: U >= the slowest run's tau, and the sum is at least each
    # run's stages at its tau plus the other layers at the fastest tau
    total = k1 * taus[0] + k2 * taus[1] + k3 * taus[2] + (n - pp) * taus.min()
    bound = (m - 1) * np.maximum(n / rate, taus.max()) + total + (m + pp - 1) * cross
    ok = pp <= n if p.pp is None else pp == p.pp
    costs.bounded += int(ok.sum())
    i, j, k = np.nonzero(ok & (bound < below))
    # the sort key's order within a head: its runs, so (k_1, k_2, k_3)
    for x in np.lexsort((k, j, i, bound[i, j, k])).tolist():
        runs = tuple(
            (g.name, t, int(c) + 1) for (g, t, _), c in zip(trio, (i[x], j[x], k[x]), strict=True)
        )
        stages = sum(c for *_, c in runs)
        sched = _schedule(p.schedule, stages, m)
        if sched is None:
            continue
        par = dataclasses.replace(base, tp=runs[0][1], pp=stages, schedule=sched)
        chain = Chain(par, runs)
        yield float(bound[i[x], j[x], k[x]]), chain.sort_key, chain


def lifted(costs, chain: Chain, bound: float) -> float:
    """A bound of `chain`'s step at least `bound`, over every split: the slowest stage at
    whole layers (run i holds at least tau_i ceil(n_i / k_i)) and the stages' sum (at least
    n_i tau_i per run) jointly with the exposed gradient traffic `evaluate` charges (its
    largest stage's): at least the first stage's (`_Layouts._first_exposures`) and, where
    every layer is the same block, at least (1 - OVERLAP_EFFICIENCY) of the ring of each run's
    largest stage (`_layer_comms`, priced on the first layers)."""
    p, n = chain.parallel, costs.n_layers
    (g1, t1, k1), (g2, t2, k2), (g3, t3, k3) = chain.runs
    tau = [costs.per_layer(g, p.stage(t)) for g, t, _ in chain.runs]
    m = p.num_microbatches
    n1 = np.arange(k1, n - k2 - k3 + 1)
    firsts = np.array([_even_counts(int(x), k1)[0] for x in n1])
    exposure = np.array(costs._first_exposures(chain, int(firsts.max())))[firsts - 1]
    n2 = np.arange(k2, n - k1 - k3 + 1)[None, :]
    n3 = n - n1[:, None] - n2
    u = np.maximum(np.maximum(tau[0] * -(-n1[:, None] // k1), tau[1] * -(-n2 // k2)),
                   tau[2] * -(-n3 // k3))  # fmt: skip
    total = tau[0] * n1[:, None] + tau[1] * n2 + tau[2] * n3  # the stages' sum, >= layers x tau
    # every stage exposes at least (1 - OVERLAP_EFFICIENCY) of its gradient ring, which is at
    # least that of its layers alone; run i's largest stage holds ceil(n_i / k_i) of them.
    # Priced on the model's first layers, so only where every layer is the same block.
    exposed = exposure[:, None]
    if len(costs.layer_blocks) == 1:
        rest = 1.0 - OVERLAP_EFFICIENCY
        rings = [np.array([0.0, *_layer_comms(costs, g, p.stage(t), p.dp, n - 2)])
                 for g, t, _ in chain.runs]  # fmt: skip
        widest = [-(-n1[:, None] // k1), -(-n2 // k2), np.clip(-(-n3 // k3), 0, n - 2)]
        largest = functools.reduce(np.maximum, [r[c] for r, c in zip(rings, widest, strict=True)])
        exposed = np.maximum(exposed, rest * largest)
    step = np.where(n3 >= k3, (m - 1) * u + total + exposed, np.inf).min()
    cross = max(
        costs.handoff(a, ta, b, tb, p.dp, p.micro_batch)
        for (a, ta, _), (b, tb, _) in zip(chain.runs, chain.runs[1:])
    )
    return max(bound, (m + p.pp - 1) * cross + float(step))


def _layer_comms(costs, group: str, cfg, dp: int, most: int) -> list[float]:
    """The DP ring time (`Pricer.dp_single`) of a stage of 1 .. `most` layers alone (no
    prologue or epilogue) on `group` under `cfg`, cached on `costs` (`_Layouts.layer_comms`)
    and charged as exposures are (`priced_exposures`)."""
    store = costs.layer_comms.setdefault((group, cfg, dp), [])
    pricer = costs.pricer
    while len(store) < most:
        c = len(store) + 1
        first, last = costs._ranges((1, c, costs.n_layers - 1 - c))[1]
        comp = pricer.costs.composition(first, last)
        store.append(pricer.dp_single(pricer.dp_traffic(comp, cfg, dp=dp, zero=0), group, cfg))
        costs.priced_exposures += 1
    return store


def slowest_limit(costs, chain: Chain, cut: float) -> float:
    """The slowest stage a split of `chain` may have and still price below `cut`: the step is
    at least (m - 1) U + S + (m + pp - 1) P with S >= sum_i k_i tau_i + (L - pp) min tau_i
    (module docstring), so U < (cut - that S - (m + pp - 1) P) / (m - 1); infinite for one
    micro-batch or no cut."""
    p = chain.parallel
    m = p.num_microbatches
    if m <= 1 or math.isinf(cut):
        return math.inf
    tau = [costs.per_layer(g, p.stage(t)) for g, t, _ in chain.runs]
    total = sum(k * x for (*_, k), x in zip(chain.runs, tau)) + (costs.n_layers - p.pp) * min(tau)
    cross = max(
        costs.handoff(a, ta, b, tb, p.dp, p.micro_batch)
        for (a, ta, _), (b, tb, _) in zip(chain.runs, chain.runs[1:])
    )
    return (cut - total - (m + p.pp - 1) * cross) / (m - 1)


def split(costs, chain: Chain, most: float = math.inf) -> tuple[int, ...] | None:
    """The layer counts per stage of the module docstring's split (the least slowest stage,
    then the least sum, ties to the first (n_1, n_2) in increasing order), None when no
    split fits or none has its slowest stage within `most` (the search's: a slower stage
    cannot beat the plan in hand). Cached on `costs` by chain when `most` is infinite."""
    if chain in costs.splits:
        return costs.splits[chain]
    p, n = chain.parallel, costs.n_layers
    (_, _, k1), (_, _, k2), (_, _, k3) = chain.runs
    tau = [costs.per_layer(g, p.stage(t)) for g, t, _ in chain.runs]
    # every (n_1, n_2) in increasing order, n_3 = L - n_1 - n_2 >= k_3, by least time
    n1, n2 = np.meshgrid(np.arange(k1, n + 1), np.arange(k2, n + 1), indexing="ij")
    n1, n2 = n1.ravel(), n2.ravel()
    n3 = n - n1 - n2
    keep = n3 >= k3
    n1, n2, n3 = n1[keep], n2[keep], n3[keep]
    least = np.maximum(np.maximum(tau[0] * -(-n1 // k1), tau[1] * -(-n2 // k2)),
                       tau[2] * -(-n3 // k3))  # fmt: skip
    order = np.lexsort((np.arange(len(least)), least))
    order = order[least[order] <= most * (1 + 1e-12)]
    best = None
    ons, seen = _groups_of(chain), {}
    for i in order:
        limit = best[0] if best is not None else most
        if least[i] > limit * (1 + 1e-12):  # see `_Layouts._split`
            break
        counts = chain.counts((int(n1[i]), int(n2[i]), int(n3[i])))
        got = costs._price_split(chain, counts, limit, ons, seen)
        if got is not None and (best is None or (*got, i) < best[:3]):
            best = (*got, i, counts)
    found = None if best is None else best[3]
    if math.isinf(most):
        costs.splits[chain] = found
    return found


__all__ = ["Chain", "all_heads", "chains", "lifted", "slowest_limit", "split"]
