"""Step 2b of the search (`meshplan.solver`): pipelines that change device group and TP degree
between stages, the plan shape of Sailor (SOSP'25) and Metis (ATC'24).

The placement models of steps 2-3 run every replica of a configuration at one TP degree (or,
per group, in group-pure pipelines: `Candidate.group_tp`). This step searches the family
those cannot express: one pipeline whose first stages run on device group a at degree t_a and
whose last stages run on group b at degree t_b, activations handed over between the two TP
groups at the boundary (`Pricer.handoff`, run by `runtime.pipeline_handoff`).

Sets
    (a, b)          an ordered pair of distinct device groups; the pipeline's first k_a stages
                    run on a, the next k_b on b
    t_a != t_b      each group's TP degree: divides its NVLink domain's GPUs and the heads
                    (`tp_domain_problem`, `tp_heads_problem`); equal degrees are steps 2-3's
    k_a, k_b >= 1   stages per group
    x               0, or the replicas of a in one stage that mixes both groups: x replicas
                    of a at t_a and dp - x of b at t_b, 1 <= x <= dp - 1; last (Sailor's
                    shape), first, or between the two runs (`MIXED_PLACES`);
                    pp = k_a + k_b + [x > 0] <= layers
    dp              replicas of every stage (one per pipeline), t_a (dp k_a + x) <= N_a and
                    t_b (dp k_b + dp - x) <= N_b (`replica_capacity`)
    mb, m           micro-batch and micro-batches per pipeline, dp mb m = B: every replica runs
                    the same m (a pipeline crossing groups has no one group's share)
    r               recomputation (the options of step 1)

Fixed by what the runtime runs (`ir.parallel.group_tp_problem`): ZeRO-0, no EP, no CP, 1F1B
(GPipe where torch's 1F1B refuses m < pp, as in step 1), sequence parallelism on the stages
whose degree is > 1 unless pinned off (`Parallel.stage`).

Split. Each group's layers spread evenly over its stages, the surplus on the stages furthest
from the embedding and the head; the count n_a on group a is searched over every
k_a <= n_a <= L - k_b, and with a mixed stage its count n_x too (n_b = L - n_a - n_x >= k_b).
A split is kept when every stage fits in the memory of every group it runs on (1F1B's
in-flight micro-batches, `in_flight_microbatches`), the one with the smallest slowest stage
(then the smallest sum) is priced. A mixed stage runs at the slower of its groups' times
whatever x is (its replicas run in lock-step), so of the x the capacity allows only the
fewest and the most are priced (x changes the stage's gradient ring and hand-offs only).

Bound, valid for every split: with tau_g the marginal time of one layer on a rank of g at t_g
(`Pricer.stage_time` of two layers less one), the slowest stage U >= u* = L / (k_a / tau_a +
k_b / tau_b + [x > 0] / max(tau_a, tau_b)) (the continuous minimax; a mixed stage's layer
takes at least the slower group's tau) and the stages' sum S >= L min(tau_a, tau_b), so the
step `simulate.evaluate` prices (m U + (S - U) + non-negative hand-off, gradient and optimizer
terms) is at least (m - 1) u* + L min(tau_a, tau_b) + (m + pp - 1) x the a -> b hand-off
of every pipeline (of one pipeline where the mixed stage sits between the runs: then x
pipelines cross at one boundary and dp - x at the other; `Pricer.handoff` does not fall as
more pipelines share the links).

When a layout reaches the top of the bound order it is bounded again over every split of the
family (`_Layouts.lifted`): the slowest stage at whole layers, jointly with the first stage's
exposed gradient traffic at that split (the step carries the largest stage's).

Search (`layout_search`): bound every layout, then price them in bound order with the pricing
`predict` uses (`tables.layout_tables`, `simulate.evaluate`) until the bound reaches the best
plan so far (the incumbent from steps 2-3 included): nothing left can win. A layout whose
lifted bound reaches it is passed over unpriced. Work is charged as
in steps 2-3 (a bound per layout, a cell per priced stage, a placement per evaluation); what
the budget leaves unpriced counts as an open bound in the plan's gap.

Pipelines through three groups, each at its own degree, are the same search's second family
(`solver_chains`), merged into the bound order. Not searched: pipelines over four or more
groups, more than one mixed stage (priced and run when given, `meshplan estimate --layout`),
uneven splits within one group's run of stages.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from meshplan.cost_model.memory import holds_states, in_flight_microbatches, summed_states
from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY, Pricer
from meshplan.cost_model.simulate import evaluate, predict
from meshplan.cost_model.tables import _dp_window, layout_tables
from meshplan.ir import (
    Graph,
    Parallel,
    Recompute,
    Schedule,
    StageConfig,
    StagePlacement,
)
from meshplan.ir.facts import blocked_dimension, without_blocked
from meshplan.passes.partition import replica_capacity, stages_of

from .solver_candidates import _divisors_upto, micro_batch_options
from .solver_chains import Chain, chains
from .solver_chains import lifted as chain_lifted
from .solver_chains import slowest_limit as chain_limit
from .solver_chains import split as chain_split
from .solver_objective import SolveResult, _Work
from .solver_pipelines import _degrees, _even_counts, _groups_of, _schedule, pins_allow

# Where a layout's mixed stage sits (`Layout.mixed_at`): after both runs (Sailor's), before
# them, or between the run on a and the run on b.
MIXED_PLACES = ("last", "first", "between")


@dataclass(frozen=True)
class Layout:
    """One layout of the family: `parallel` (tp = t_a, pp = k_a + k_b + [mixed > 0]) with a run
    of `k_a` stages on group `a` at `t_a` followed by a run of `k_b` on `b` at `t_b`, and, when
    `mixed` > 0, one stage of `mixed` replicas on a and dp - `mixed` on b, placed
    `mixed_at` (`MIXED_PLACES`): after both runs, before them or between them."""

    parallel: Parallel
    a: str
    t_a: int
    k_a: int
    b: str
    t_b: int
    k_b: int
    mixed: int = 0
    mixed_at: str = "last"

    @property
    def sort_key(self) -> tuple:
        p = self.parallel
        return (self.a, self.t_a, self.k_a, self.b, self.t_b, self.k_b, self.mixed,
                MIXED_PLACES.index(self.mixed_at), p.dp, p.micro_batch,
                p.recompute.value)  # fmt: skip

    @property
    def mixed_stage(self) -> int | None:
        """The index of the mixed stage, None without one."""
        if not self.mixed:
            return None
        return {"first": 0, "between": self.k_a, "last": self.k_a + self.k_b}[self.mixed_at]

    def counts(self, n_a: int, n_x: int, n_b: int) -> tuple[int, ...]:
        """Layer counts per stage: n_a over the run on a, n_b over the run on b (`_even`),
        n_x on the mixed stage."""
        runs, x = _even_counts(n_a, self.k_a) + _even_counts(n_b, self.k_b), self.mixed_stage
        return runs if x is None else (*runs[:x], n_x, *runs[x:])

    def on(self, s: int) -> tuple[tuple[str, int, int], ...]:
        """Stage s's (group, replicas, degree), in the layout's group order (a, then b)."""
        dp, x = self.parallel.dp, self.mixed_stage
        if x is not None and s == x:
            return ((self.a, self.mixed, self.t_a), (self.b, dp - self.mixed, self.t_b))
        r = s - (x is not None and s > x)  # its place among the runs' stages
        if r < self.k_a:
            return ((self.a, dp, self.t_a),)
        return ((self.b, dp, self.t_b),)


@dataclass(frozen=True)
class LayoutResult:
    """What `layout_search` found: the best layout's (step, parallel, stages), or None, and the
    smallest bound it left unpriced (inf: the family was searched to the end)."""

    best: tuple[float, Parallel, tuple[StagePlacement, ...]] | None
    lowest_open: float
    bounded: int
    priced: int


def _even(n: int, k: int) -> list[int]:
    """n layers over k stages, the surplus on the middle stages (away from both ends)."""
    return list(_even_counts(n, k))


def layouts(
    costs: _Layouts,
    pinned: Parallel,
    global_batch: int,
    recomputes: Sequence[Recompute],
    sp: bool,
    below: float = math.inf,
) -> list[tuple[float, tuple, Layout]]:
    """(bound, sort key, layout) for every layout of the module docstring's sets that step 1's
    pins allow and whose bound is below `below`, in bound order ([] when a pin rules the family
    out: tp, ZeRO > 0, ep or cp > 1, a schedule other than 1F1B / GPipe)."""
    return list(_bounded(costs, pinned, global_batch, recomputes, sp, below))


def _bounded(
    costs: _Layouts,
    pinned: Parallel,
    global_batch: int,
    recomputes: Sequence[Recompute],
    sp: bool,
    below: float,
) -> Iterator[tuple[float, tuple, Layout]]:
    """`layouts`, built as they are consumed: the bounds of each (groups, degrees, dp,
    micro-batch, recompute) over its whole (k_a, k_b) grid at once (numpy), the layouts
    themselves only when reached in bound order."""
    p = pinned
    if not pins_allow(p):
        return iter(())
    graph, n = costs.graph, costs.n_layers
    groups = costs.pricer.cluster.groups
    heads: list[tuple] = []  # per (groups, degrees, dp, mb, r): what its layouts share
    bounds, owner, kas, kbs = [], [], [], []
    for ga, gb in ((x, y) for x in groups for y in groups if x is not y):
        for ta, tb in ((x, y) for x in _degrees(ga, graph) for y in _degrees(gb, graph) if x != y):
            cap_a, cap_b = replica_capacity(ga, ta), replica_capacity(gb, tb)
            most = min(cap_a, cap_b)
            dps = [p.dp] if p.dp is not None else _divisors_upto(global_batch, most)
            for dp in dps:
                if dp > most or global_batch % dp:
                    continue
                ka_max, kb_max = min(cap_a // dp, n - 1), min(cap_b // dp, n - 1)
                if not ka_max or not kb_max:
                    continue
                mbs = (
                    [p.micro_batch]
                    if p.micro_batch is not None
                    else micro_batch_options(global_batch // dp, 2)
                )
                for mb, rc in itertools.product(mbs, recomputes):
                    if global_batch % (dp * mb):
                        continue
                    m = global_batch // (dp * mb)
                    base = Parallel(
                        dp=dp, tp=ta, pp=2, cp=1, ep=1, micro_batch=mb,
                        global_batch=global_batch, recompute=rc, zero=0,
                        schedule=Schedule.ONE_F_ONE_B, sequence_parallel=sp,
                    )  # fmt: skip
                    tau_a = costs.per_layer(ga.name, base.stage(ta))
                    tau_b = costs.per_layer(gb.name, base.stage(tb))
                    cross = costs.handoff(ga.name, ta, gb.name, tb, dp, mb)
                    # between the runs: x pipelines cross at one boundary, dp - x at the other
                    single = costs.handoff(ga.name, ta, gb.name, tb, 1, mb)
                    ka = np.arange(1, ka_max + 1, dtype=np.float64)[:, None]
                    kb = np.arange(1, kb_max + 1, dtype=np.float64)[None, :]
                    # without, then with a mixed stage (x replicas of a, dp - x of b) in each
                    # place; one between the runs leaves no boundary that every pipeline
                    # crosses from a to b, so its bound counts one pipeline's hand-off
                    for where in (None, *MIXED_PLACES) if dp > 1 else (None,):
                        mixed = where is not None
                        pp = ka + kb + mixed
                        with np.errstate(divide="ignore"):
                            rate = ka / tau_a + kb / tau_b + mixed / max(tau_a, tau_b)
                        hand_off = single if where == "between" else cross
                        bound = (m - 1) * n / rate + n * min(tau_a, tau_b) + (m + pp - 1) * hand_off
                        ok = pp <= n if p.pp is None else pp == p.pp
                        if mixed:  # some 1 <= x <= dp - 1 fits both groups' capacity
                            x_lo, x_hi = _mixed_range(dp, ka, kb, cap_a, cap_b)
                            ok = ok & (x_lo <= x_hi)
                        costs.bounded += int(ok.sum())
                        ia, ib = np.nonzero(ok & (bound < below))
                        if len(ia):
                            bounds.append(bound[ia, ib])
                            owner.append(np.full(len(ia), len(heads)))
                            kas.append(ia + 1)
                            kbs.append(ib + 1)
                            heads.append((base, ga.name, ta, gb.name, tb, m, where, cap_a, cap_b))
    if not heads:
        return iter(())
    bound_all = np.concatenate(bounds)
    own, ka_all, kb_all = np.concatenate(owner), np.concatenate(kas), np.concatenate(kbs)
    order = np.lexsort((kb_all, ka_all, own, bound_all))  # ties in enumeration order

    def made() -> Iterator[tuple[float, tuple, Layout]]:
        for i in order:
            base, a, ta, b, tb, m, where, cap_a, cap_b = heads[own[i]]
            mixed = where is not None
            ka, kb, dp = int(ka_all[i]), int(kb_all[i]), base.dp
            sched = _schedule(p.schedule, ka + kb + mixed, m)
            if sched is None:
                continue
            par = dataclasses.replace(base, pp=ka + kb + mixed, schedule=sched)
            if not mixed:
                xs: list[int] = [0]
            else:  # the fewest and the most replicas of a (the module docstring's split)
                xs = sorted({int(x) for x in _mixed_range(dp, ka, kb, cap_a, cap_b)})
            for x in xs:
                lay = Layout(par, a, ta, ka, b, tb, kb, x, where or "last")
                yield float(bound_all[i]), lay.sort_key, lay

    return made()


def _mixed_range(dp: int, ka, kb, cap_a: int, cap_b: int):
    """(fewest, most) replicas x of group a a mixed stage may hold: 1 <= x <= dp - 1,
    the a-stages' dp k_a replicas plus x within a's capacity, the b-stages' dp k_b plus
    dp - x within b's (empty when fewest > most); `ka`, `kb` ints or numpy arrays."""
    return np.maximum(1, dp - (cap_b - dp * kb)), np.minimum(dp - 1, cap_a - dp * ka)


class _Layouts:
    """Per-layer times, hand-offs and per-stage cost and memory of the family, cached."""

    def __init__(self, graph: Graph, pricer: Pricer):
        self.graph, self.pricer = graph, pricer
        self.n_layers = len(graph.layer_units)
        self.ranges: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
        self.tau: dict[tuple, float] = {}
        self.stage_cache: dict[tuple, tuple[float, bool]] = {}  # `_stage`, by what prices it
        self.splits: dict[Layout, tuple[int, ...] | None] = {}  # `split`, by all but x
        # `lifted`: per (group a, its stage configuration, dp), the exposure of a first stage
        # of 1, 2, ... layers
        self.exposures: dict[tuple, list[float]] = {}
        # `solver_chains.lifted`: per (group, its stage configuration, dp), the DP ring time
        # of a stage of 1, 2, ... layers alone
        self.layer_comms: dict[tuple, list[float]] = {}
        self.priced_exposures = 0  # work charged as "cell"
        self.bounded = 0  # layouts bounded (work charged as "bound")
        self.capacity = {g.name: g.gpu.memory_bytes for g in pricer.cluster.groups}
        kinds = dict(graph.blocks)
        costs = pricer.costs
        self.layer_blocks = sorted({u.block for u in graph.layer_units})
        # The smallest activation a layer hands on (the a -> b boundary follows some layer).
        self.activation = min(
            costs.facts[costs.boundary_key(i + 1)].output_bytes
            for i, u in enumerate(graph.units)
            if kinds[u.block].kind == "layer"
        )

    def may_hold(self, lay: Layout | Chain) -> bool:
        """Whether `lay`'s ranks, each at its GPU's capacity, can hold the model's states
        between them at all (`memory.holds_states`; ZeRO-0, as the family runs). When not, no
        split of it fits and it is not searched."""
        p, pricer = lay.parallel, self.pricer
        dense, expert = pricer.model_params()
        states = summed_states(
            dense, expert, shards=p.dp * p.cp, ep=p.ep, zero=0, precision=pricer.precision
        )
        ranks = [
            (reps * t * p.cp, self.capacity[g]) for s in range(p.pp) for g, reps, t in lay.on(s)
        ]
        return holds_states(states, ranks)

    def per_layer(self, group: str, cfg: StageConfig) -> float:
        """tau: the least time of one layer (any layer block) on a rank of `group` under
        `cfg`; a stage's time is the sum of its blocks' (`Pricer.stage_time`), so k layers
        take at least k tau."""
        key = (group, cfg)
        got = self.tau.get(key)
        if got is None:
            got = self.tau[key] = min(
                self.pricer.block_time(b, group, cfg).total for b in self.layer_blocks
            )
        return got

    def taus(self, lay: Layout) -> tuple[float, float]:
        """(tau_a, tau_b): `per_layer` of a rank of each of `lay`'s groups at its degree."""
        p = lay.parallel
        return self.per_layer(lay.a, p.stage(lay.t_a)), self.per_layer(lay.b, p.stage(lay.t_b))

    def handoff(self, a: str, ta: int, b: str, tb: int, dp: int, mb: int) -> float:
        """The a -> b hand-off of one micro-batch (`Pricer.handoff`), every pipeline at once."""
        scale = mb / self.pricer.costs.traced_micro_batch
        return self.pricer.handoff(self.activation * scale, a, ta, b, tb, pipelines=dp, cp=1)

    def lifted(self, lay: Layout, bound: float) -> float:
        """A bound of `lay`'s step at least `bound` (`layouts`'), over every split of the
        family: its first stage's exposed gradient traffic added, and the slowest stage
        taken at whole layers. For layer counts (n_a, n_x, n_b = L - n_a - n_x) the slowest
        stage holds at least tau_a ceil(n_a / k_a), tau_b ceil(n_b / k_b) and
        max(tau_a, tau_b) n_x (`per_layer`; `_even` spreads a group's layers), and the first
        stage, group a at t_a with the prologue and `_even(n_a, k_a)[0]` layers, exposes
        E = C - OVERLAP_EFFICIENCY min(C, W) of its `dp_single` ring C behind its backward
        window W (its replicas sit in a alone: `layout_tables`, as `plan_tables` of a at t_a
        prices it); `evaluate` charges the largest stage's exposure. So the step is at least
        min over (n_a, n_x) of (m - 1) U(n_a, n_x) + E(n_a), plus L min(tau_a, tau_b) and
        (m + pp - 1) a -> b hand-offs, as in `layouts` (with the mixed stage between the runs,
        the larger of x and dp - x pipelines' hand-off). A mixed first stage's exposure is not
        counted (its ring spans both groups)."""
        p, n = lay.parallel, self.n_layers
        mixed = 1 if lay.mixed else 0
        tau_a, tau_b = self.taus(lay)
        m = p.num_microbatches
        n_a = np.arange(lay.k_a, n - lay.k_b - mixed + 1)
        if lay.mixed_stage == 0:
            exposure = np.zeros(len(n_a))
        else:
            firsts = np.array([_even_counts(int(x), lay.k_a)[0] for x in n_a])
            exposure = np.array(self._first_exposures(lay, int(firsts.max())))[firsts - 1]
        u_a = tau_a * -(-n_a // lay.k_a)
        if mixed:
            n_x = np.arange(1, n - lay.k_a - lay.k_b + 1)[None, :]
            n_b = n - n_a[:, None] - n_x
            u = np.maximum(np.maximum(u_a[:, None], tau_b * -(-n_b // lay.k_b)),
                           max(tau_a, tau_b) * n_x)  # fmt: skip
            u = np.where(n_b >= lay.k_b, u, np.inf).min(axis=1)
        else:
            u = np.maximum(u_a, tau_b * -(-(n - n_a) // lay.k_b))
        if mixed and lay.mixed_at == "between":  # x cross at one boundary, dp - x at the other
            cross = max(
                self.handoff(lay.a, lay.t_a, lay.b, lay.t_b, k, p.micro_batch)
                for k in (lay.mixed, p.dp - lay.mixed)
            )
        else:
            cross = self.handoff(lay.a, lay.t_a, lay.b, lay.t_b, p.dp, p.micro_batch)
        fixed = n * min(tau_a, tau_b) + (m + p.pp - 1) * cross
        return max(bound, fixed + float(((m - 1) * u + exposure).min()))

    def _first_exposures(self, lay: Layout, most: int) -> list[float]:
        """The exposure E of a first stage on group a at t_a holding the prologue and 1 ..
        `most` layers (`lifted`), cached per (group, stage configuration, dp)."""
        p = lay.parallel
        cfg = p.stage(lay.t_a)
        exposures = self.exposures.setdefault((lay.a, cfg, p.dp), [])
        pricer = self.pricer
        while len(exposures) < most:
            k = len(exposures) + 1
            first, last = self._ranges((k, self.n_layers - k))[0]
            comp = pricer.costs.composition(first, last)
            comm = pricer.dp_single(pricer.dp_traffic(comp, cfg, dp=p.dp, zero=0), lay.a, cfg)
            window = _dp_window(pricer.stage_time(comp, lay.a, cfg), 0)
            exposures.append(comm - OVERLAP_EFFICIENCY * min(comm, window))
            self.priced_exposures += 1
        return exposures

    def _ranges(self, counts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        got = self.ranges.get(counts)
        if got is None:
            got = self.ranges[counts] = stages_of(self.graph, counts)
        return got

    def _stage(
        self, p: Parallel, s: int, first: int, last: int, on: tuple[tuple[str, int], ...]
    ) -> tuple[float, bool]:
        """(time, fits) of stage s of a layout of `p` over units [first, last) on the groups
        and degrees `on` (`_groups_of`): the slowest of its groups (lock-step replicas),
        fitting when it fits in every one of them."""
        key = (p, s, first, last, on)
        got = self.stage_cache.get(key)
        if got is None:
            got = self.stage_cache[key] = self._stage_priced(p, s, first, last, on)
        return got

    def _stage_priced(
        self, p: Parallel, s: int, first: int, last: int, on: tuple[tuple[str, int], ...]
    ) -> tuple[float, bool]:
        comp = self.pricer.costs.composition(first, last)
        held = in_flight_microbatches(p.schedule, s, p.pp, p.num_microbatches)
        u = 0.0
        for g, t in on:
            cfg = p.stage(t)
            mem = self.pricer.stage_memory(comp, cfg, dp=p.dp, zero=0).peak(held)[0]
            if mem > self.capacity[g]:
                return math.inf, False
            u = max(u, self.pricer.stage_time(comp, g, cfg).total)
        return u, True

    def _price_split(self, lay: Layout, counts: tuple[int, ...], cut: float, ons=None, seen=None):
        """(slowest stage, sum) of `lay` under `counts`, None when a stage does not fit or
        the slowest passes `cut` (it cannot beat the split in hand). `ons`: `_groups_of(lay)`
        when the caller has it; `seen`: the caller's memo of `_stage` for this layout, by
        (stage, first unit, last unit)."""
        ons = ons or _groups_of(lay)
        seen = {} if seen is None else seen
        worst, total = 0.0, 0.0
        for s, (first, last) in enumerate(self._ranges(counts)):
            got = seen.get((s, first, last))
            if got is None:
                got = seen[(s, first, last)] = self._stage(lay.parallel, s, first, last, ons[s])
            u, fits = got
            if not fits or u > cut:
                return None
            worst, total = max(worst, u), total + u
        return worst, total

    def split(self, lay: Layout) -> tuple[int, ...] | None:
        """The layer counts of the module docstring's split, or None when no split fits. The
        mixed stage's replica counts do not enter a stage's time or memory, so the split is
        searched once for every x (`splits`)."""
        key = dataclasses.replace(lay, mixed=min(lay.mixed, 1))
        if key not in self.splits:
            self.splits[key] = self._split(lay)
        return self.splits[key]

    def _split(self, lay: Layout) -> tuple[int, ...] | None:
        """`split`: the least (slowest stage, sum), ties to the first of (n_a, n_x) in
        increasing order. The counts are tried by their slowest stage's least time (each
        stage holds at least its layers x tau, `per_layer`; a mixed stage's x the slower
        group's), so once that passes the best split's slowest stage (beyond rounding)
        nothing left can win."""
        n, mixed = self.n_layers, 1 if lay.mixed else 0
        tau_a, tau_b = self.taus(lay)
        tries = []
        for n_a in range(lay.k_a, n - lay.k_b - mixed + 1):
            for n_x in range(mixed, n - n_a - lay.k_b + 1) if mixed else (0,):
                n_b = n - n_a - n_x
                least = max(
                    tau_a * -(-n_a // lay.k_a), tau_b * -(-n_b // lay.k_b), max(tau_a, tau_b) * n_x
                )
                tries.append((least, len(tries), n_a, n_x))
        tries.sort()
        best: tuple[float, float, int, tuple[int, ...]] | None = None
        ons, seen = _groups_of(lay), {}
        for least, i, n_a, n_x in tries:
            # `least` sums differently from `Pricer.stage_time` and may lie an ulp above a
            # stage time it bounds: the slack keeps ties (same slowest stage, smaller sum)
            if best is not None and least > best[0] * (1 + 1e-12):
                break
            counts = lay.counts(n_a, n_x, n - n_a - n_x)
            if min(counts) < 1:
                continue
            got = self._price_split(lay, counts, best[0] if best else math.inf, ons, seen)
            if got is not None and (best is None or (*got, i) < best[:3]):
                best = (*got, i, counts)
        return None if best is None else best[3]

    def stages(self, lay: Layout, counts: tuple[int, ...]) -> tuple[StagePlacement, ...]:
        order = [g.name for g in self.pricer.cluster.groups]
        out = []
        for s, (first, last) in enumerate(self._ranges(counts)):
            on = sorted(lay.on(s), key=lambda gnt: order.index(gnt[0]))
            reps, tps = tuple((g, k) for g, k, _ in on), tuple((g, t) for g, _, t in on)
            out.append(StagePlacement(s, first, last, reps, group_tp=tps))
        return tuple(out)


def layout_step(pricer: Pricer, parallel: Parallel, stages) -> float | None:
    """The step time of a layout as `predict` prices it (`layout_tables` + `evaluate`), None
    when a stage does not fit on a group it runs on."""
    tables = layout_tables(pricer, parallel, stages)
    if not all(tables.fits[s][g] for s, st in enumerate(stages) for g, _ in st.replicas):
        return None
    return evaluate(tables, [st.replicas for st in stages]).step_time_s


def layout_search(
    graph: Graph,
    pricer: Pricer,
    pinned: Parallel,
    global_batch: int,
    work: _Work,
    incumbent: float,
    recomputes=(Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL),
    say=lambda _msg: None,
) -> LayoutResult:
    """The best layout of the module docstring's family faster than `incumbent`, in bound
    order, within `work`."""
    if len(pricer.cluster.groups) < 2:
        return LayoutResult(None, math.inf, 0, 0)
    # What the runtime cannot run on this model (`ir.facts`, as step 1 asks): the family
    # needs a pipeline and a TP degree > 1 on one of its groups; SP off where it is blocked.
    pinned = without_blocked(graph.info, pinned)
    if blocked_dimension(graph.info, Parallel(pp=2, tp=2)):
        return LayoutResult(None, math.inf, 0, 0)
    sp = pinned.sequence_parallel if pinned.sequence_parallel is not None else True
    cache = _Layouts(graph, pricer)
    bounded = heapq.merge(  # pairs of groups, then (on three or more) chains of three
        _bounded(cache, pinned, global_batch, recomputes, sp, below=incumbent),
        chains(cache, pinned, global_batch, recomputes, sp, below=incumbent),
        key=lambda item: item[0],
    )  # fmt: skip
    work.charge("layout", cache.bounded)
    charged = cache.bounded  # chains' grids are bounded as the merge reaches them
    best: tuple[float, Parallel, tuple[StagePlacement, ...]] | None = None
    lowest_open, priced = math.inf, 0
    for bound, _, lay in bounded:
        work.charge("layout", cache.bounded - charged)
        charged = cache.bounded
        cut = min(incumbent, best[0] if best else math.inf)
        if bound >= cut * (1 - 1e-9):
            break
        if work.exhausted():
            lowest_open = bound
            break
        work.charge("aggregate", lay.parallel.pp / 4)
        if not cache.may_hold(lay):
            continue  # no split fits
        # Every split's step also carries its first stage's exposed gradient traffic, and its
        # slowest stage holds whole layers.
        chain = isinstance(lay, Chain)
        before = cache.priced_exposures
        lifted = chain_lifted(cache, lay, bound) if chain else cache.lifted(lay, bound)
        work.charge("cell", cache.priced_exposures - before)
        if lifted >= cut * (1 - 1e-9):
            continue
        if chain:  # splits whose slowest stage leaves no step below the cut are not priced
            counts = chain_split(cache, lay, chain_limit(cache, lay, cut) * (1 + 1e-9))
        else:
            counts = cache.split(lay)
        work.charge("memory", lay.parallel.pp)
        if counts is None:
            continue
        stages = cache.stages(lay, counts)
        step = layout_step(pricer, lay.parallel, stages)
        work.charge("cell", lay.parallel.pp)
        work.charge("placement")
        priced += 1
        if step is not None and step < cut * (1 - 1e-9):
            best = (step, lay.parallel, stages)
    work.charge("layout", cache.bounded - charged)
    if best is not None:
        say(
            f"pipelines changing group and tp: {cache.bounded} layouts bounded, {priced} priced, "
            f"best {best[0]:.3f} s/step"
        )
    return LayoutResult(best, lowest_open, cache.bounded, priced)


def layout_plan(
    graph: Graph,
    pricer: Pricer,
    pinned: Parallel,
    global_batch: int,
    work: _Work,
    incumbent: float,
    lowest_open: float,
    say=lambda _msg: None,
) -> tuple[float, SolveResult | None]:
    """Step 2b as the solver runs it: (the smallest open bound, steps 2-3's `lowest_open` and
    the family's unpriced ones; the plan when the family's best beats `incumbent`, re-priced
    by `predict`, else None). The plan's search counts are the family's own."""
    work.at_least(0.5)  # the family is bounded whatever steps 2-3 took
    recomputes = [Recompute(pinned.recompute)] if pinned.recompute is not None else list(Recompute)
    found = layout_search(graph, pricer, pinned, global_batch, work, incumbent, recomputes, say)
    lowest_open = min(lowest_open, found.lowest_open)
    if found.best is None:
        return lowest_open, None
    step, parallel, stages = found.best
    prediction = predict(
        graph, pricer.cluster, parallel, stages, dtype=pricer.dtype, comm=pricer.comm,
        engine=pricer.engine,
    )  # fmt: skip
    optimal = lowest_open >= step * (1 - 1e-9)
    gap = 0.0 if optimal else (step - min(lowest_open, step)) / step
    say(
        f"{'optimal' if optimal else 'feasible'} plan: a pipeline changing group and tp, "
        f"{prediction.step_time_s:.3f} s/step"
    )
    return lowest_open, SolveResult(
        parallel=parallel,
        stages=stages,
        prediction=prediction,
        status="optimal" if optimal else "feasible",
        gap=gap,
        bound=min(lowest_open, step),
        wall_s=0.0,
        candidates=0,
        explored=found.priced,
        placement_models=0,
        objective="throughput",
        objective_value=prediction.step_time_s,
        splits=0,
        work=work.spent,
        wall_clock_hit=work.wall_hit,
    )


__all__ = ["Layout", "LayoutResult", "layout_plan", "layout_search", "layout_step", "layouts"]
