"""Step 1 of the search (`meshplan.solver`), second half: the layer splits L(c) of a
candidate configuration c (`solver_candidates`).

Sets
    l in L(c)   per-stage layer counts of c (uneven splits), `_splits`: every split when there
                are at most EXHAUSTIVE_SPLITS, else the even split, one balanced split per device
                group (stages holding the embedding / LM head take fewer layers,
                `passes.partition.balanced_counts`) and, on mixed clusters, splits balanced
                for the groups the stages fill fastest-first and slowest-first (more layers
                on faster GPUs); interleaved 1F1B and ZB-V use the even split only

Moved from `solver_candidates`, word for word.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from meshplan.cost_model.pricer import Pricer
from meshplan.ir import Schedule
from meshplan.passes.partition import (
    balanced_counts,
    compositions,
    count_compositions,
    rank_layers,
    replica_capacity,
)

from .solver_candidates import Candidate, priced

# Up to this many splits of the layers over pp stages are searched exhaustively; beyond, the
# structured family of `_splits`.
EXHAUSTIVE_SPLITS = 16


def _unit_costs(
    pricer: Pricer, c: Candidate, group: str, cache: dict
) -> tuple[float, float, float]:
    """(mean layer time, time of the units before the first layer, after the last layer) of
    one micro-batch on one rank of `group` under c's degrees (memoised in `cache`)."""
    key = ("unit", group, priced(c, group))
    got = cache.get(key)
    if got is None:
        got = cache[key] = _unit_costs_uncached(pricer, c, group)
    return got


def _unit_costs_uncached(pricer: Pricer, c: Candidate, group: str) -> tuple[float, float, float]:
    costs, graph = pricer.costs, pricer.costs.graph
    lookup = dict(graph.blocks)
    kinds = [lookup[k].kind for k in costs.unit_keys]
    layer_pos = [i for i, k in enumerate(kinds) if k == "layer"]

    @functools.cache
    def t(key: str) -> float:
        return pricer.stage_time(((key, 1),), group, priced(c, group)).total

    layer = sum(t(costs.unit_keys[i]) for i in layer_pos) / len(layer_pos)
    head = sum(t(costs.unit_keys[i]) for i in range(layer_pos[0]))
    tail = sum(t(costs.unit_keys[i]) for i in range(layer_pos[-1] + 1, len(kinds)))
    return layer, head, tail


def _take_replicas(
    free: dict[str, int], groups: Sequence[str], want: int
) -> list[tuple[str, int]] | None:
    """`want` replicas taken from `groups` in order, as many from each as it has `free`
    (decremented): [(group, replicas), ...], or None when they run out."""
    reps = []
    for g in groups:
        take = min(want, free[g])
        if take:
            reps.append((g, take))
            free[g] -= take
            want -= take
        if not want:
            break
    return None if want else reps


def _fill(capacity: dict[str, int], order: Sequence[str], pp: int, dp: int):
    """The groups each stage's replicas land on when stages fill `order` in rank order."""
    free = dict(capacity)
    out = []
    for _ in range(pp):
        reps = _take_replicas(free, order, dp)
        if reps is None:
            return None
        out.append([g for g, _ in reps])
    return out


def _splits(
    pricer: Pricer, c: Candidate, groups: Sequence[str], n_layers: int, cache: dict
) -> list[tuple[int, ...]]:
    """The layer splits searched for c (module docstring, set L(c)); the even split first.
    `cache` memoises per-unit costs and balanced splits within one search."""
    pp = c.pp
    base, extra = divmod(n_layers, pp)
    even = tuple(base + (1 if s < extra else 0) for s in range(pp))
    if pp == 1:
        return [even]
    if c.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE) and c.chunks > 1:
        # the chunk layout fixes each rank's layers (`chunk_layers`: equal chunks, or the
        # embedding and the loss counted as a layer each)
        v_shape = c.schedule == Schedule.ZERO_BUBBLE
        return [rank_layers(n_layers, pp, c.chunks, v_shape)]
    if c.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE):
        return [even]
    if count_compositions(n_layers, pp) <= EXHAUSTIVE_SPLITS:
        return [even] + [x for x in compositions(n_layers, pp) if x != even]
    out = [even]
    per = {g: _unit_costs(pricer, c, g, cache) for g in groups}

    def balanced(stage_groups: Sequence[Sequence[str]]) -> tuple[int, ...]:
        key = ("split", pp, tuple(tuple(gs) for gs in stage_groups), *(per[g] for g in groups))
        got = cache.get(key)
        if got is None:
            layer = [max(per[g][0] for g in gs) for gs in stage_groups]
            fixed = [0.0] * pp
            fixed[0] += max(per[g][1] for g in stage_groups[0])
            fixed[-1] += max(per[g][2] for g in stage_groups[-1])
            got = cache[key] = balanced_counts(n_layers, layer, fixed)
        return got

    for g in groups:
        out.append(balanced([[g]] * pp))
    if len(groups) > 1 and not c.group_tp:  # lock-step fills (per-group TP is group-pure)
        capacity = {g: replica_capacity(pricer.groups[g], c.tp, c.cp) for g in groups}
        fast = sorted(groups, key=lambda g: (per[g][0], g))
        for order in (fast, fast[::-1]):
            filled = _fill(capacity, order, pp, c.dp)
            if filled is not None:
                out.append(balanced(filled))
    return list(dict.fromkeys(out))
