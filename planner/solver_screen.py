"""Step 2 of the search (`meshplan.solver`): screen (bound, price, greedy warm start) before
building any model.

`_Screen` bounds every (c, l) without memory (`solver_bounds._memory_free_bound`: fastest
groups that can hold the replicas; with shares: the whole micro-batch count over the best
pipeline rate, `_share_rate_bound`), prices them in bound order (`plan_tables`; stages repeat,
so tables are built per distinct stage), drops those that fit in no group's memory, bounds again
with memory (`_lower_bound`, `_share_bound`) and places greedily (`_greedy_placements`, the
warm start, and `_share_placements`) until the bound passes the best plan: nothing left can
win. Megatron-style configurations (`_megatron_seeds`) are priced first, for an early
incumbent. The heap holds typed entries (`solver_queue`: `_Queued`, holding a `_Family`, an
`_Unsplit` candidate or a `_Pair`, ordered by bound, then enumeration index, then split); what
the screen computes once per key lives in `_ScreenMemo`, and `_price` prices one pair.

Uneven data-parallel batch shares and the greedy warm starts: `solver_placements`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from meshplan.cost_model.graph_costs import Composition
from meshplan.cost_model.memory import in_flight_microbatches
from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY, Pricer
from meshplan.cost_model.simulate import evaluate
from meshplan.cost_model.tables import (
    PlanTables,
    _dp_window,
    _rank_compositions,
    _rank_ranges,
    boundary_sends,
    hetero_tables,
    plan_tables,
)
from meshplan.ir import Graph, Recompute, Schedule, StageConfig
from meshplan.ir.parallel import chunks_of
from meshplan.passes.partition import replica_capacity, stages_of

from .solver_bounds import (
    _capacities,
    _cost_floor,
    _distinct_stage_times,
    _free_bound,
    _free_hosts,
    _free_terms,
    _free_value,
    _least_peak,
    _lock_extra,
    _lower_bound,
    _memory_free_bound,
    _multi_group_bound,
    _pipeline_bound,
    _share_bound,
    _share_extra,
    _share_hosts,
    _share_terms,
    _split_free_memory,
    _stage_memory,
)
from .solver_candidates import Candidate, Family, count, priced
from .solver_objective import Placement, _Scorer, _Work
from .solver_placements import _greedy_placements, _share_placements
from .solver_queue import _Family, _Pair, _Queued, _Unsplit
from .solver_splits import _splits

# The least work left (work units) for which the screen, past its share of the budget, goes on
# with two thirds of it: at once when no pair it priced needs a placement model, else after
# those models (`_Screen.run`, `solver._search`).
MIN_SCREEN_EXTENSION = 0.05


def _megatron_seeds(
    families: Sequence[Family],
    fits: Callable[[Candidate], bool],
    per_pp: int = 2,
    most: int = 8,
) -> list[tuple[int, Candidate]]:
    """Megatron-LM-style warm starts among the candidates, as (enumeration index, candidate):
    the widest TP, no CP, the most EP, micro-batch 1, ZeRO-1 (distributed optimizer), 1F1B,
    no or selective recompute, the largest dp for each of the smallest pipeline depths whose
    layers can fit (`fits`), `most` in all."""
    pool = [
        (i, c)
        for f in families
        if f.cp == 1 and not f.group_tp and f.micro_batch == 1 and f.recompute != Recompute.FULL
        for k, (i, zero, sched, _) in enumerate(f.variants)
        if zero in (0, 1) and sched == Schedule.ONE_F_ONE_B
        for c in [f.member(k)]
    ]
    if not pool:
        return []
    tp = max(c.tp for _, c in pool)
    ep = max(c.ep for _, c in pool if c.tp == tp)
    by_pp: dict[int, list[tuple[int, Candidate]]] = {}
    for i, c in pool:
        if c.tp == tp and c.ep == ep and (c.zero == 1 or c.dp == 1):
            by_pp.setdefault(c.pp, []).append((i, c))
    out: list[tuple[int, Candidate]] = []
    for pp in sorted(by_pp):
        top = max(c.dp for _, c in by_pp[pp])
        best = sorted((ic for ic in by_pp[pp] if ic[1].dp == top), key=lambda ic: ic[1].sort_key)
        out += [ic for ic in best if fits(ic[1])][:per_pp]
        if len(out) >= most:
            break
    return out[:most]


def _largest_stage(pricer: Pricer, c: Candidate, comps, global_batch: int) -> tuple[int, int]:
    """(peak bytes, stage) of the pipeline rank needing the most memory, without building
    tables: each rank's composition (`comps`, `_ScreenMemo.held`: its chunks under interleaved
    1F1B and ZB-V, as the tables price them) with the micro-batches its schedule holds."""
    m = global_batch // (c.dp * c.micro_batch)
    worst, seen = (0, 0), set()
    for s, comp in enumerate(comps):
        held = in_flight_microbatches(c.schedule, s, len(comps), m, c.chunks)
        if (comp, held) in seen:
            continue
        seen.add((comp, held))
        peak, _ = _stage_memory(pricer, comp, c).peak(held)
        worst = max(worst, (peak, s))
    return worst


@dataclass(slots=True)
class _Priced:
    cand: Candidate
    layers: tuple[int, ...]
    tables: PlanTables
    allowed: list[list[str]]  # [stage] groups whose memory fits and that can hold a replica
    lower: float  # score bound of every placement (lock-step or with shares)
    lock_lower: float  # score bound of lock-step placements
    share_open: float  # score bound of share placements not searched exactly (inf: none)
    greedy_placement: Placement | None  # best lock-step warm start
    greedy_score: float
    best: tuple[float, Placement, dict | None] | None = None  # (score, placement, shares)
    factor: float = 1.0


def _even_split(n_layers: int, pp: int) -> tuple[int, ...]:
    """n_layers over pp stages, the first n_layers mod pp stages one layer more."""
    base, extra = divmod(n_layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


def _beyond(lb: float, limit: float) -> bool:
    """Whether a step-time bound rules a candidate or pair out: infinite, or past `limit`."""
    return math.isinf(lb) or lb > limit * (1 + 1e-9)


def _smaller(smallest, need: tuple[int, int], c: Candidate):
    """(bytes, stage, candidate): `smallest`, or c's `need` where that is less memory."""
    if smallest is None or need[0] < smallest[0]:
        return (*need, c)
    return smallest


class _ScreenMemo:
    """The screen's inputs and what it computes once per key: the groups that can hold a
    candidate's replicas, its score factor, a split's stage ranges, a candidate's splits, the
    memory-free bound terms of a split, and the per-unit costs the bounds share (`cache`). Each
    key names the knobs its value depends on."""

    def __init__(
        self,
        pricer: Pricer,
        graph: Graph,
        global_batch: int,
        work: _Work,
        scorer: _Scorer,
        limit: float,
        single_floor: float = 0.0,
        states_check: bool = True,
    ) -> None:
        self.pricer = pricer
        self.graph = graph
        self.global_batch = global_batch
        self.work = work
        self.scorer = scorer
        self.limit = limit
        self.single_floor = single_floor
        # `fits_nowhere` asked before the per-stage memory checks, and whether it turned a
        # configuration away: a search that ends in a refusal then runs again without it,
        # to name the least need `_split_free_memory` finds (`solver._solve_in_groups`)
        self.states_check = states_check
        self.turned_away = False
        self.order = [g.name for g in pricer.cluster.groups]
        self.n_layers = len(graph.layer_units)
        self.cache: dict = {}
        self._groups: dict[tuple, tuple[str, ...]] = {}
        self._factors: dict[tuple, float] = {}
        self._ranges: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
        self._splits: dict[tuple, list[tuple[int, ...]]] = {}
        self._split_terms: dict[tuple, tuple[float, float, float, float]] = {}
        # (lock-step, shares, whole, the `enough` a partial one was priced for)
        self._traffic_floors: dict[tuple, tuple[float, float, bool, float]] = {}
        self._dp_comms: dict[tuple, float] = {}
        self._p2ps: dict[tuple, float] = {}
        self._held: dict[tuple, tuple[list, list]] = {}
        self._sends: dict[tuple, list[tuple[str, float]]] = {}

    def microbatches(self, c: Candidate | Family) -> int:
        """m = global batch / (dp x micro-batch): micro-batches per pipeline."""
        return self.global_batch // (c.dp * c.micro_batch)

    def groups(self, c: Candidate | Family) -> tuple[str, ...]:
        """The groups, in cluster order, that can hold a replica of c (of tp x cp GPUs); under
        per-group TP, only the groups it names."""
        key = (c.tp, c.cp, c.group_tp)
        got = self._groups.get(key)
        if got is None:
            named = dict(c.group_tp)
            got = self._groups[key] = tuple(
                g
                for g in self.order
                if (not named or g in named)
                and replica_capacity(self.pricer.groups[g], c.tp_of(g), c.cp)
            )
        return got

    def capacity(self, c: Candidate | Family) -> dict[str, int]:
        """Replicas of c each of its groups holds (`solver_bounds._capacities`)."""
        return _capacities(self.pricer, c, self.groups(c), self.cache)

    def factor(self, c: Candidate | Family) -> float:
        """`_Scorer.factor` of c (it reads the degrees and the replica capacities only)."""
        key = (c.tp, c.cp, c.pp, c.dp, c.group_tp)
        got = self._factors.get(key)
        if got is None:
            got = self._factors[key] = self.scorer.factor(c, self.capacity(c))
        return got

    def ranges(self, split: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """Each stage's (first, last) unit under the per-stage layer counts `split`."""
        got = self._ranges.get(split)
        if got is None:
            got = self._ranges[split] = stages_of(self.graph, split)
        return got

    def held(self, c: Candidate, split: tuple[int, ...]) -> tuple[list, list]:
        """(each pipeline rank's unit ranges, its composition) of c under `split`
        (`tables._rank_ranges`, `tables._rank_compositions`): the chunk layout under
        interleaved 1F1B / ZB-V, which does not depend on the split, else the split's."""
        key = (split, c.pp, c.chunks, c.schedule == Schedule.ZERO_BUBBLE)
        got = self._held.get(key)
        if got is None:
            p, ranges = c.parallel(), self.ranges(split)
            got = self._held[key] = (
                _rank_ranges(self.pricer, p, ranges),
                _rank_compositions(self.pricer, p, ranges),
            )
        return got

    def family_bound(
        self, f: Family, knobs: tuple[float, int] | None = None
    ) -> tuple[float, float] | None:
        """(split-free bound x factor, factor) of the member of f with these
        (`Candidate.fill`, ZeRO stage), without building it (None: its loosest member,
        `Family.loosest`), or None when it cannot win (`limit`): `_split_free_bound` of that
        member."""
        self.work.charge("bound")
        fill, zero = f.loosest_knobs if knobs is None else knobs
        lb = _free_bound(
            self.pricer, f, fill, zero, self.groups(f), self.microbatches(f), self.cache
        )
        if _beyond(lb, self.limit):
            return None
        factor = self.factor(f)
        return max(lb * factor, self.cost_floor(f)), factor

    def cost_lock_floor(self, c: Candidate, t: PlanTables, allowed: list[list[str]]) -> float:
        """Objective "cost": a score bound of the pair's lock-step placements (0 for other
        objectives). Every GPU of the plan is held for the whole step, and a lock-step step
        is at least m U + fill (S - U) + `_lock_extra` with U the slowest stage (`_lower_bound`;
        S - U at least S_min - U, S_min the stages at their fastest). With U the time of one
        (stage, group) cell, every stage runs on groups no slower than U, so its dp replicas
        cost at least dp times the cheapest such group's rate (a replica-stage's GPUs' price
        per second): the least of (m U + fill max(0, S_min - U) + extra) dp sum_s rate_s(U)
        over every cell's U bounds every lock-step placement."""
        if not self.scorer.cost:
            return 0.0
        self.work.charge("bound")
        times, rates = self._cost_cells(c, t, allowed)
        fastest = times.min(axis=1)
        cuts = np.unique(times[np.isfinite(times)])
        cuts = cuts[cuts >= fastest.max()]  # every stage has some group at most this slow
        cheapest = np.where(times[None] <= cuts[:, None, None], rates, np.inf).min(axis=2)
        spent = c.dp * cheapest.sum(axis=1)
        m, fill, more = self.microbatches(c), c.fill, _lock_extra(t, allowed)
        steps = m * cuts + fill * np.maximum(0.0, fastest.sum() - cuts) + more
        return float((steps * spent).min())

    def cost_share_floor(self, c: Candidate, t: PlanTables, allowed: list[list[str]]) -> float:
        """Objective "cost": a score bound of the pair's group-pure share placements (0 for
        other objectives). A pipeline wholly in group g running m_j micro-batches takes at
        least f_g(m_j) = slope_g m_j + const_g (`_share_terms`) plus `_share_extra` of the step,
        and holds pp replica-stages of g for all of it; the m_j sum to dp m, so the score is at
        least dp m min_g (pp rate_g slope_g) + dp min_g (pp rate_g (const_g + extra)) over the
        host groups."""
        if not self.scorer.cost:
            return 0.0
        self.work.charge("bound")
        hosts = _share_hosts(t, allowed)
        if not hosts:
            return math.inf
        price, pp, more = self.scorer.price, t.pp, _share_extra(t, allowed)
        rate = {g: pp * price[g] * c.tp_of(g) * c.cp for g in hosts}
        terms = {g: _share_terms(t, g) for g in hosts}
        m = self.microbatches(c)
        return c.dp * (
            m * min(rate[g] * terms[g][0] for g in hosts)
            + min(rate[g] * (terms[g][1] + more) for g in hosts)
        )

    def cost_pair_floor(self, c: Candidate, split: tuple[int, ...]) -> float:
        """Objective "cost": `cost_lock_floor` and `cost_share_floor` before the pair's tables
        (0 for other objectives): over its distinct stages' times on every group c may use
        (`_distinct_stage_times`, memory ignored), without the hand-offs, DP traffic and
        optimizer; the lesser of the two kinds."""
        if not self.scorer.cost:
            return 0.0
        # the value reads c's fill and whether shares apply, which `_split_key` leaves out
        key = ("cost-pair", *self._split_key(c), split, c.fill, c.zero <= 2)
        got = self._split_terms.get(key)
        if got is not None:
            return got
        self.work.charge("bound")
        groups = self.groups(c)
        stage_times, counts, per_group = _distinct_stage_times(
            self.pricer, c, self.held(c, split)[1], groups, self.cache
        )
        price, m = self.scorer.price, self.microbatches(c)
        rates = np.array([price[g] * c.tp_of(g) * c.cp for g in groups])
        lock = math.inf
        if not c.group_tp:
            times = np.array([[st.get(g, np.inf) for g in groups] for st in stage_times])
            weights = np.array(counts, dtype=float)
            fastest = times.min(axis=1)
            cuts = np.unique(times[np.isfinite(times)])
            cuts = cuts[cuts >= fastest.max()]
            cheapest = np.where(times[None] <= cuts[:, None, None], rates, np.inf).min(axis=2)
            steps = m * cuts + c.fill * np.maximum(0.0, weights @ fastest - cuts)
            lock = float((steps * c.dp * (cheapest @ weights)).min())
        share = math.inf
        if c.zero <= 2:
            pp_rates = {g: c.pp * r for g, r in zip(groups, rates.tolist(), strict=True)}
            share = c.dp * (
                m * min(pp_rates[g] * u for g, (u, _) in per_group.items())
                + c.fill * min(pp_rates[g] * (s - u) for g, (u, s) in per_group.items())
            )
        got = self._split_terms[key] = min(lock, share)
        return got

    def _cost_cells(self, c: Candidate, t: PlanTables, allowed: list[list[str]]):
        """(stage x group times, infinite where the stage does not fit; each group's rate)."""
        price, groups = self.scorer.price, list(t.groups)
        times = np.array(
            [[t.time[s][g].total if g in allowed[s] else np.inf for g in groups]
             for s in range(t.pp)]
        )  # fmt: skip
        rates = np.array([price[g] * c.tp_of(g) * c.cp for g in groups])
        return times, rates

    def cost_floor(self, c: Candidate | Family) -> float:
        """Objective "cost": `_cost_floor` of c (a score, not a step time); 0 otherwise."""
        if not self.scorer.cost:
            return 0.0
        return _cost_floor(
            self.pricer, c, self.groups(c), self.microbatches(c), self.scorer.price, self.cache
        )

    def family_bounds(self, families: Sequence[Family]) -> list[tuple[float, Family]]:
        """(bound x factor, family) of every family whose loosest member may win, in order:
        `family_bound` of each (the same charges, terms and values), with the terms it looks
        up per family fetched once per stage fields (and pp) (~1e5 families per screen)."""
        out = []
        charge, limit, gb, cache = self.work.charge, self.limit, self.global_batch, self.cache
        terms: dict[tuple, tuple] = {}  # stage fields -> (groups, raw key, S_min, W)
        hosts_of: dict[tuple, list] = {}  # (stage fields, pp) -> `_free_hosts`
        for f in families:
            charge("bound")
            fill, zero = f.loosest_knobs
            skey = (f.tp, f.cp, f.ep, f.sequence_parallel, f.micro_batch, f.recompute,
                    f.cp_mode, f.cp_head_degree, f.group_tp)  # fmt: skip
            t = terms.get(skey)
            if t is None:
                groups = self.groups(f)
                t = terms[skey] = (groups, *_free_terms(self.pricer, f, groups, cache))
            groups, raw, s_min, whole = t
            pp = f.pp
            hosts = ()
            if zero <= 2:
                hosts = hosts_of.get((skey, pp))
                if hosts is None:
                    hosts = hosts_of[(skey, pp)] = _free_hosts(
                        self.pricer, f, groups, raw, whole, pp, cache
                    )
            m = gb // (f.dp * f.micro_batch)
            lb = _free_value(s_min, hosts, pp, f.dp, m, fill, zero, bool(f.group_tp))
            if _beyond(lb, limit):
                continue
            out.append((max(lb * self.factor(f), self.cost_floor(f)), f))
        return out

    def refined(self, family: _Family, bound: float, best: float) -> float:
        """A bound of every member of `family` (queued under `bound`) at least as large:
        `bound`, or `_multi_group_bound` where every placement that could beat it uses two or
        more groups: always under per-group TP (its pipelines sit in two groups), else when no
        placement inside one group goes below `single_floor` (the best plan of each group,
        `_single_group_seed`) and that is above `bound`. Below `best`, the members whose
        schedule and ZeRO stage fit in no GPU drop out first (infinite when none is left)."""
        single = math.inf if family.family.group_tp else self.single_floor
        if single <= bound * (1 + 1e-9):
            return bound
        c = family.family.member(0)
        factor = self.factor(c)
        enough = best * (1 + 1e-9) / factor if factor > 0 else math.inf

        def multi_of(knobs: Sequence[tuple[float, int]]) -> float:
            """`_multi_group_bound` over members of these (`Candidate.fill`, ZeRO stage)."""
            self.work.charge("refine")
            return factor * _multi_group_bound(
                self.pricer,
                c,
                self.groups(c),
                self.microbatches(c),
                self.cache,
                fill=min(fill for fill, _ in knobs),
                zeros=sorted({zero for _, zero in knobs}),
                enough=enough,
            )

        multi = multi_of(family.family.knobs)
        if min(single, multi) > best * (1 + 1e-9):
            return max(bound, min(single, multi))
        # Short of the best plan: members that fit nowhere drop out, which may lift it (with
        # none left, the family is gone): `_split_free_memory` with the micro-batches every
        # stage of the member's schedule holds (one under 1F1B, all m under GPipe). That
        # depends on the member only through its ZeRO stage and that count, so a member is
        # built once per distinct pair.
        fam = family.family
        m = self.microbatches(c)
        fits = []
        verdicts: dict[tuple[int, float], bool] = {}
        # By ZeRO stage: the model's states alone fit nowhere (`fits_nowhere`).
        surely: dict[int, bool] = {}
        for k, (_, _, zero, sched, v) in enumerate(fam.template):
            if zero not in surely and self.states_check:
                self.work.charge("aggregate")
                surely[zero] = self.fits_nowhere(fam.member(k))
            if surely.get(zero):
                self.turned_away = True
                continue
            self.work.charge("memory")  # one per (zero, schedule, v): each member once
            held = min(
                in_flight_microbatches(sched.value, s, fam.pp, m, chunks_of(sched, v))
                for s in range(fam.pp)
            )
            key = (zero, held)
            if key not in verdicts:
                verdicts[key] = (
                    self.too_big(
                        fam.member(k), lambda x: (self.split_free_memory(x, held), x.pp - 1)
                    )
                    is None
                )
            if verdicts[key]:
                fits.append(k)
        if not fits:
            return math.inf
        if len(fits) < len(fam.template):
            knobs = fam.knobs
            multi = multi_of([knobs[k] for k in fits])
        return max(bound, min(single, multi))

    def split_free_memory(self, c: Candidate, in_flight: float = 1) -> int:
        """Bytes at least of the stage holding ceil(L / pp) layers of c with `in_flight`
        micro-batches (`_split_free_memory`)."""
        return _split_free_memory(self.pricer, c, self.n_layers, self.cache, in_flight)

    def fits_nowhere(self, c: Candidate) -> bool:
        """Whether c's model states alone pass every GPU c may use, whatever its split
        (`_least_peak`; per-group TP: some group's view against that group's GPUs)."""
        if not c.group_tp:
            top = max(self.pricer.groups[g].gpu.memory_bytes for g in self.groups(c))
            return _least_peak(self.pricer, c) > top
        return any(
            _least_peak(self.pricer, c, t) > self.pricer.groups[g].gpu.memory_bytes
            for g, t in c.group_tp
        )

    def too_big(self, c: Candidate, need_of: Callable[[Candidate], tuple[int, int]]):
        """(bytes, stage) that c needs where it fits on no GPU it may use, else None;
        `need_of(candidate)` gives a homogeneous candidate's need (per-group TP: each group's
        at its own tp, and both must host pipelines)."""
        if not c.group_tp:
            need = need_of(c)
            top = max(self.pricer.groups[g].gpu.memory_bytes for g in self.groups(c))
            return need if need[0] > top else None
        for g, _ in c.group_tp:
            need = need_of(c.view(g))
            if need[0] > self.pricer.groups[g].gpu.memory_bytes:
                return need
        return None

    def _split_key(self, c: Candidate) -> tuple:
        """The knobs c's splits depend on: all but ZeRO stage and quantization, and the
        schedule with its v only where it is chunked (its split is its chunk layout's)."""
        key = (priced(c), c.pp, c.dp, c.group_tp)
        chunked = c.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)
        return key + ((c.schedule, c.virtual_stages) if chunked else None,)

    def splits(self, c: Candidate) -> list[tuple[int, ...]]:
        """The layer splits L(c) (`_splits`)."""
        key = self._split_key(c)
        got = self._splits.get(key)
        if got is None:
            got = self._splits[key] = _splits(
                self.pricer, c, self.groups(c), self.n_layers, self.cache
            )
        return got

    def _pair_parts(self, c: Candidate, split: tuple[int, ...]) -> tuple[float, float]:
        """(lock-step, shares) parts of `pair_bound` (infinite shares where they do not
        apply)."""
        # zero does not change stage times, and the bound is linear in m; a chunked schedule's
        # ranks hold its chunk layout (`held`), which the key's schedule and v name
        key = (*self._split_key(c), split)
        terms = self._split_terms.get(key)
        if terms is None:
            self.work.charge("split")
            terms = self._split_terms[key] = _memory_free_bound(
                self.pricer, c, self.held(c, split)[1], self.groups(c), self.cache
            )
        big_u, total, rate, fill = terms
        m = self.microbatches(c)
        lock = _pipeline_bound(big_u, total, m, c.fill)
        share = c.dp * m / rate + fill * c.fill if c.zero <= 2 and rate > 0 else math.inf
        return lock, share

    def pair_bound(self, c: Candidate, split: tuple[int, ...]) -> float:
        """Step-time bound of (c, split) without memory: the pipeline bound
        (`_pipeline_bound`: m U + (S - U) fill) over the memory-free terms
        (U, S, rate, share fill) of `_memory_free_bound`, or with shares (ZeRO <= 2)
        dp m / rate + share fill x fill when that is less."""
        return min(self._pair_parts(c, split))

    def pair_bound_with_traffic(
        self, c: Candidate, split: tuple[int, ...], enough: float = math.inf
    ) -> float:
        """`pair_bound` with what the traffic adds at least (`traffic_floor`): tighter, and
        dearer, so the screen asks for it only when the pair reaches the top of its heap.
        `enough`: a bound at least this large settles the pair (it cannot beat the best plan,
        which only improves); the hand-offs are priced first, and when they reach it the
        data-parallel traffic is not priced (the bound is then that far only)."""
        lock, share = self._pair_parts(c, split)
        lock_extra, share_extra = self.traffic_floor(c, split, lock, share, enough)
        return min(lock + lock_extra, share + share_extra)

    def _least_dp_comm(
        self,
        comp: Composition,
        cfg: StageConfig,
        dp: int,
        zero: int,
        groups: tuple[str, ...],
        first: str | None = None,
    ) -> float:
        """A rank's DP traffic at its cheapest group or pair of groups (`traffic_floor`); cfg
        enters through its tp, cp and ep (`DataParallelTraffic.dp_traffic`). `first`: ZeRO-3's
        edge block, left out of the traffic as `plan_tables` leaves it out."""
        key = (comp, cfg.tp, cfg.cp, cfg.ep, dp, zero, groups, first)
        got = self._dp_comms.get(key)
        if got is None:
            pricer = self.pricer
            traffic = pricer.dp_traffic(comp, cfg, dp=dp, zero=zero, first=first)
            got = min(pricer.dp_single(traffic, g, cfg) for g in groups)
            for i, a in enumerate(groups):
                for b in groups[i + 1 :]:
                    got = min(got, pricer.dp_cross(traffic, a, b, cfg).time(1))
            self._dp_comms[key] = got
        return got

    def _least_p2p(self, size: float, streams: int, groups: tuple[str, ...]) -> float:
        """A boundary's hand-off at its cheapest pair of groups (`traffic_floor`)."""
        key = (size, streams, groups)
        got = self._p2ps.get(key)
        if got is None:
            got = self._p2ps[key] = min(
                self.pricer.p2p(size, a, b, streams) for a in groups for b in groups
            )
        return got

    def traffic_floor(
        self,
        c: Candidate,
        split: tuple[int, ...],
        lock: float = 0.0,
        share: float = 0.0,
        enough: float = math.inf,
    ) -> tuple[float, float]:
        """What (c, split) adds at least to the memory-free pipeline bounds of `pair_bound`,
        from the traffic every placement's step carries (`evaluate`): (lock-step, shares).
        Both hold the least exposed data-parallel traffic: over the ranks, the largest
        C - OVERLAP_EFFICIENCY min(C, W), C the rank's traffic at its cheapest group or pair
        of groups (a ring in one group, or one crossing between two at `CrossTraffic.time(1)`,
        the least of any number of stages crossing), W its widest window over the groups
        (`tables._dp_window`; exposure falls with W and rises with C). Lock-step placements
        add (m v + pp - 1) hand-offs at the cheapest pair of groups of the costliest
        boundary, group-pure pipelines with shares the (pp - 1) of their fill. The tables
        price the same traffic the same way (`plan_tables`), so the bounds hold. (0, 0) under
        per-group TP, and the windows are dropped under EP on several groups (their stage
        times may be the spanning floor's, `tables._ep_floor`).

        ZeRO-3 (lock-step only: shares need ZeRO <= 2) reduces and gathers every micro-batch:
        the exposed traffic counts m times (`PlanTables.rep`), each rank's C without its first
        unit's collectives, which run unoverlapped inside its stage time instead
        (`StageTime.dp_edge`, which the memory-free bound leaves out): the slowest stage holds
        at least the least of them, m times.

        `lock`, `share`, `enough` (`pair_bound_with_traffic`): the hand-offs are priced first,
        and where min(lock + their lock-step part, share + their shares part) reaches
        `enough` the data-parallel part is left out (a lower floor, enough for a caller whose
        `enough` only falls; one asking for more gets the whole floor)."""
        if c.group_tp:
            return 0.0, 0.0
        p = c.parallel()
        cfg, groups = p.stage(), self.groups(c)  # quantization included: it widens windows
        # ZeRO-1 and -2 move the same traffic (`dp_traffic`) in the same window (`_dp_window`)
        zero = 1 if c.zero == 2 else c.zero
        key = (cfg, groups, c.pp, c.dp, zero, c.schedule, c.virtual_stages, split)
        got = self._traffic_floors.get(key)
        if got is not None and (got[2] or got[3] >= enough):
            return got[:2]
        self.work.charge("memory")
        pricer = self.pricer
        m = self.microbatches(c)
        p2p = 0.0
        if c.pp > 1:
            streams = c.tp * c.cp * c.dp
            sends_key = (split, c.pp, c.chunks, c.schedule, c.micro_batch, c.cp, c.tp)
            sends = self._sends.get(sends_key)
            if sends is None:
                sends = self._sends[sends_key] = boundary_sends(pricer, p, self.held(c, split)[0])
            for _, size in sends:
                p2p = max(p2p, self._least_p2p(size, streams, groups))
        hand_offs = ((m * c.chunks + c.pp - 1) * p2p, (c.pp - 1) * p2p)
        if min(lock + hand_offs[0], share + hand_offs[1]) >= enough:
            self._traffic_floors[key] = (*hand_offs, False, enough)
            return hand_offs
        exposed = edge = 0.0
        if c.dp * c.cp > 1:
            windows = c.ep == 1 or len(groups) == 1
            held, comps = self.held(c, split)
            edged = c.zero == 3
            firsts = [pricer.costs.unit_keys[h[0][0]] if edged else None for h in held]
            edges = []
            for comp, first in zip(comps, firsts, strict=True):
                comm = self._least_dp_comm(comp, cfg, c.dp, zero, groups, first)
                window = (
                    max(_dp_window(pricer.stage_time(comp, g, cfg), c.zero) for g in groups)
                    if windows
                    else math.inf
                )
                exposed = max(exposed, comm - OVERLAP_EFFICIENCY * min(comm, window))
                if first is not None:
                    unit = pricer.dp_edge(first, cfg, dp=c.dp)
                    edges.append(min(pricer.dp_single(unit, g, cfg) for g in groups))
            if edged:
                exposed, edge = m * exposed, m * min(edges)
        got = (exposed + edge + hand_offs[0], exposed + hand_offs[1])
        self._traffic_floors[key] = (*got, True, math.inf)
        return got


def _price(memo: _ScreenMemo, pair: _Pair, best: float) -> _Priced | None:
    """(c, l) priced in full: its tables, the groups each stage fits in, its bounds with memory
    (lock-step `_lower_bound`, shares `_share_bound`) and its warm starts (lock-step
    `_greedy_placements`, then `_share_placements` where shares may beat them). None when some
    stage fits in no group or the bound passes `best`."""
    c, split, factor = pair.cand, pair.split, pair.factor
    pricer, work, scorer = memo.pricer, memo.work, memo.scorer
    groups = memo.groups(c)
    ranges = memo.ranges(split)
    if c.group_tp:
        t = hetero_tables(pricer, c.parallel(), ranges, dict(c.group_tp))
    else:
        t = plan_tables(pricer, c.parallel(), ranges, groups)
    work.charge("cell", t.pp * len(groups))
    allowed = [[g for g in groups if t.fits[s][g]] for s in range(t.pp)]
    if any(not a for a in allowed):
        return None
    # per-group TP: group-pure pipelines only (no lock-step placement)
    lock_lower = share_lower = math.inf
    if not c.group_tp:
        lock_lower = max(_lower_bound(t, allowed) * factor, pair.floor)
        lock_lower = max(lock_lower, memo.cost_lock_floor(c, t, allowed))
    share = _share_bound(t, allowed)
    if math.isfinite(share):
        share_lower = max(share * factor, pair.floor, memo.cost_share_floor(c, t, allowed))
    lower = min(lock_lower, share_lower)
    if lower > best * (1 + 1e-9):
        return None
    pr = _Priced(c, split, t, allowed, lower, lock_lower, math.inf, None, math.inf)
    pr.factor = factor
    for pl in [] if c.group_tp else _greedy_placements(t, allowed, memo.order):
        work.charge("placement")
        sc = scorer.score(c, evaluate(t, pl).step_time_s, pl)
        if sc < pr.greedy_score:
            pr.greedy_placement, pr.greedy_score = pl, sc
    if pr.greedy_placement is not None:
        pr.best = (pr.greedy_score, pr.greedy_placement, None)
    if share_lower < (pr.best[0] if pr.best else math.inf) * (1 - 1e-9):
        rates = None  # cost: what a replica-stage's GPUs cost per second on each group
        if scorer.cost:
            rates = {g: scorer.price[g] * c.tp_of(g) * c.cp for g in t.groups}
        options, exact, listed, visited = _share_placements(
            t, allowed, rates, equal=scorer.equal_shares
        )
        work.charge("placement", len(options))
        if listed:
            work.charge("share_listed", listed)
            work.charge("share_split", visited)
        for pl, shares in options:
            sc = scorer.score(c, evaluate(t, pl, shares).step_time_s, pl)
            if pr.best is None or sc < pr.best[0] * (1 - 1e-12):
                pr.best = (sc, pl, shares)
        if not exact:
            pr.share_open = share_lower
    return pr


def _needs_model(pr: _Priced, incumbent: float) -> bool:
    """Whether `_search` solves a placement model for `pr` against `incumbent`: its bound is
    below it, lock-step placements may win, and the warm start does not meet the bound."""
    if pr.lower >= incumbent * (1 - 1e-9) or pr.lock_lower >= incumbent * (1 - 1e-9):
        return False
    greedy = pr.greedy_placement is not None
    return not (greedy and pr.greedy_score <= pr.lock_lower * (1 + 1e-9))


class _Screen:
    """The screen of step 2, resumable: price (candidate, split) pairs in bound order until the
    bound passes the best plan, a share of the budget at a time (`run`).

    Every step is charged to `work`. Pairs whose bound exceeds `limit` are dropped (min_gpus:
    the target step time). `single_floor`: no placement inside one device group scores below
    it (`_ScreenMemo.refined`). `incumbent`: the score of a plan known from elsewhere.
    Accounting over every run: `pairs` (bounded), `priced` (priced in full), `smallest` (the
    smallest memory need (bytes, stage, candidate) when nothing fits)."""

    def __init__(
        self,
        pricer: Pricer,
        graph: Graph,
        families: Sequence[Family],
        global_batch: int,
        work: _Work,
        scorer: _Scorer,
        limit: float,
        say,
        incumbent: float = math.inf,
        single_floor: float = 0.0,
        states_check: bool = True,
    ) -> None:
        self.pricer, self.global_batch, self.work, self.limit = pricer, global_batch, work, limit
        memo = _ScreenMemo(
            pricer, graph, global_batch, work, scorer, limit, single_floor, states_check
        )

        queue = [
            _Queued(b, f.first, (), _Family(f, floor=memo.cost_floor(f)))
            for b, f in memo.family_bounds(families)
        ]
        # Megatron-style warm starts go first (bound -1): a strong incumbent early prunes the
        # rest.
        top_memory = max(g.gpu.memory_bytes for g in pricer.cluster.groups)
        for i, c in _megatron_seeds(families, lambda c: memo.split_free_memory(c) <= top_memory):
            even = _even_split(memo.n_layers, c.pp)
            queue.append(_Queued(-1.0, i, even, _Pair(c, even, memo.factor(c))))
        heapq.heapify(queue)
        say(
            f"bounded {count(families)} configurations in {len(families)} families; pricing in "
            "bound order"
        )
        self.memo, self.queue = memo, queue
        self.done: set[tuple[Candidate, tuple[int, ...]]] = set()
        self.best = incumbent
        self.pairs = self.priced = 0
        self.smallest: tuple[int, int, Candidate] | None = None  # (bytes, stage, candidate)

    def run(self, until: float, best: float = math.inf) -> tuple[list[_Priced], float]:
        """Go on pricing until the bound passes the best plan (`best`: also a plan found since
        the last run, by a placement model) or, once some plan is known, `until` work units
        are spent (or the safety net has passed). Returns (the pairs priced in this run that
        may still win, by bound; the bound of the first pair left unpriced when the budget cut
        the run short, else infinity). A run cut short keeps that pair queued for the next."""
        memo, queue, work, pricer = self.memo, self.queue, self.work, self.pricer
        self.best = min(self.best, best)
        kept: list[_Priced] = []
        cut = math.inf
        while queue:
            entry = heapq.heappop(queue)
            if entry.bound > self.best * (1 + 1e-9):
                queue.clear()  # the best plan only improves: nothing left can win
                break
            # Past the budget, stop once there is a plan to return. Without one, go on: the
            # memory check below makes pricing a candidate that fits nowhere cheap. While no
            # pair priced in this run needs a placement model, the work kept back for the
            # models is the screen's: it goes on with two thirds of what is left.
            if entry.bound >= 0 and math.isfinite(self.best) and work.exhausted(until):
                spare = work.left() > MIN_SCREEN_EXTENSION and not work.past_deadline()
                if spare and not any(_needs_model(k, self.best) for k in kept):
                    until = work.spent + work.left() * 2 / 3
                else:
                    cut = entry.bound
                    heapq.heappush(queue, entry)
                    break
            match entry.item:
                case _Family() as family:  # bound and queue its members
                    if not family.refined:
                        again = memo.refined(family, entry.bound, self.best)
                        if again > entry.bound * (1 + 1e-9):  # queue it again under that bound
                            family = dataclasses.replace(family, refined=True, floor=again)
                            heapq.heappush(queue, _Queued(again, entry.index, (), family))
                            continue
                    fam = family.family
                    for k, ((i, *_), knobs) in enumerate(zip(fam.variants, fam.knobs, strict=True)):
                        got = memo.family_bound(fam, knobs)
                        if got is not None:
                            unsplit = _Unsplit(fam, k, got[1], family.floor)
                            heapq.heappush(
                                queue, _Queued(max(got[0], family.floor), i, (), unsplit)
                            )
                case _Unsplit(cand=c, factor=factor, floor=floor):  # expand into its splits
                    if memo.states_check:
                        work.charge("aggregate")
                        if memo.fits_nowhere(c):
                            memo.turned_away = True
                            continue  # no split fits
                    work.charge("memory")
                    need = memo.too_big(c, lambda x: (memo.split_free_memory(x), x.pp - 1))
                    if need is not None:
                        self.smallest = _smaller(self.smallest, need, c)
                        continue  # no split fits: some stage holds ceil(L / pp) layers
                    for split in memo.splits(c):
                        lb = memo.pair_bound(c, split)
                        if _beyond(lb, self.limit):
                            continue
                        self.pairs += 1
                        pair = _Pair(c, split, factor, floor)
                        bound = max(lb * factor, floor, memo.cost_pair_floor(c, split))
                        heapq.heappush(queue, _Queued(bound, entry.index, split, pair))
                case _Pair(cand=c, split=split) as pair:  # price it
                    if (c, split) in self.done:
                        continue  # a warm start priced already
                    if not pair.refined and entry.bound >= 0:
                        # bound it again with its traffic; queue it again under that bound
                        enough = (
                            self.best * (1 + 1e-9) / pair.factor if pair.factor > 0 else math.inf
                        )
                        lb = memo.pair_bound_with_traffic(c, split, enough)
                        if _beyond(lb, self.limit):
                            continue  # min_gpus: past the target step time
                        again = max(lb * pair.factor, pair.floor, memo.cost_pair_floor(c, split))
                        if again > entry.bound * (1 + 1e-9):
                            pair = dataclasses.replace(pair, refined=True)
                            heapq.heappush(queue, _Queued(again, entry.index, split, pair))
                            continue
                    self.done.add((c, split))
                    comps = memo.held(c, split)[1]
                    work.charge("memory")
                    need = memo.too_big(
                        c, lambda x: _largest_stage(pricer, x, comps, self.global_batch)
                    )
                    if need is not None:
                        self.smallest = _smaller(self.smallest, need, c)
                        continue  # some stage fits on no GPU: no tables needed to know
                    self.priced += 1
                    pr = _price(memo, pair, self.best)
                    if pr is None:
                        continue
                    if pr.best is not None:
                        self.best = min(self.best, pr.best[0])
                    kept.append(pr)
        kept = [k for k in kept if k.lower <= self.best * (1 + 1e-9)]
        kept.sort(key=lambda k: (k.lower, k.best[0] if k.best else math.inf, k.cand.sort_key))
        return kept, cut
