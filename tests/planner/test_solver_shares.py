"""Uneven DP shares over three or more device groups (`solver_placements`: `_splits_over`,
`_support_shares`, `_support_placements`). Oracles: itertools enumeration of every split and
every integer share vector, and every group-pure placement of a configuration priced by
`evaluate` (tests/planner/test_solver.py's enumerator), independent of the bound order the
search visits them in."""

from __future__ import annotations

import itertools
import math
import random

import meshplan.solver_placements as placements_mod
import numpy as np
import pytest
from meshplan.cost_model import evaluate, plan_tables, pricer_for
from meshplan.ir import Parallel
from meshplan.passes.partition import replica_capacity, stages_of
from meshplan.solver import solve
from meshplan.solver_candidates import enumerate_candidates
from meshplan.solver_objective import Objective, _Scorer, _Work
from meshplan.solver_placements import (
    _integer_bounds,
    _share_placements,
    _split_count,
    _splits_over,
    _support_shares,
)
from meshplan.solver_screen import _ScreenMemo

from tests.planner.test_solver import _share_placements as every_share_placement
from tests.planner.test_solver_chains import _three_groups as chain_groups
from tests.synthetic import three_type_cluster, transformer_graph


def test_splits_are_every_composition_within_the_capacities():
    """`_split_count` and `_splits_over` against itertools on 300 random (dp, capacities, ep)
    over 3-5 groups, empty and single-split cases included."""
    rng = random.Random(5)
    for _ in range(300):
        k, ep = rng.choice([3, 3, 4, 5]), rng.choice([1, 1, 2, 3])
        caps = tuple(rng.randint(0, 12) for _ in range(k))
        dp = ep * rng.randint(1, 14)
        want = [n for n in itertools.product(*(range(ep, c + 1, ep) for c in caps)) if sum(n) == dp]
        assert _split_count(dp, caps, ep) == len(want), (dp, caps, ep)
        if want:  # lexicographic, as documented
            assert [tuple(r) for r in _splits_over(dp, caps, ep).tolist()] == want


def _every_share(terms, ns, total, cap, runs):
    """min over every integer share vector of max_i s_i m_i + c_i (inf when none)."""
    best = math.inf
    for head in itertools.product(range(1, min(cap, total) + 1), repeat=len(ns) - 1):
        rest = total - sum(n * m for n, m in zip(ns, head))
        if rest < ns[-1] or rest % ns[-1]:
            continue
        ms = (*head, rest // ns[-1])
        if max(ms) > cap or not all(runs(m) for m in ms):
            continue
        best = min(best, max(s * m + c for (s, c), m in zip(terms, ms)))
    return best


def test_support_shares_are_the_best_integer_shares():
    """Random slopes, constants, splits, totals, caps and schedules' rules (any count, counts
    from 2, even counts): `_support_shares` returns a share vector that adds up, runs and
    scores exactly the enumerated minimum, or None exactly when there is none below `best`."""
    rng = random.Random(31)
    rules = [lambda m: True, lambda m: m >= 2, lambda m: m % 2 == 0]
    checked = 0
    for _ in range(400):
        k = rng.choice([3, 3, 4, 5])
        if rng.random() < 0.3:  # integer terms: ties between share vectors
            terms = [(rng.randint(1, 3), rng.randint(0, 4)) for _ in range(k)]
        else:
            terms = [(rng.uniform(0.1, 3.0), rng.uniform(0.0, 5.0)) for _ in range(k)]
        ns = [rng.randint(1, 4) for _ in range(k)]
        # five groups: small totals, the oracle enumerates total^4 vectors
        total = sum(ns) * rng.randint(1, 6 if k < 5 else 2) + rng.randint(0, 5)
        cap = rng.choice([1 << 30, 3, 8])
        runs = rng.choice(rules)
        want = _every_share(terms, ns, total, cap, runs)
        finite = math.isfinite(want)
        best = rng.choice([math.inf, want * rng.uniform(0.9, 1.1) if finite else 5.0, want])
        got = _support_shares(terms, ns, total, cap, runs, best)
        if want >= best:
            assert got is None
            continue
        checked += 1
        pipe, ms = got
        assert sum(n * m for n, m in zip(ns, ms)) == total
        assert all(runs(m) and 1 <= m <= cap for m in ms)
        assert pipe == max(s * m + c for (s, c), m in zip(terms, ms))
        assert pipe == pytest.approx(want, rel=1e-12)
    assert checked > 100


def test_integer_bounds_are_below_the_best_integer_shares():
    """`_integer_bounds` (the order the splits are visited in, and where the visit stops) is
    at most the enumerated optimum of every split, on 300 random instances whose total is dp
    m (the search's: equal shares of m are feasible), and above the continuous crossing."""
    rng = random.Random(7)
    lifted = 0
    for _ in range(300):
        k = rng.choice([3, 3, 4])
        terms = [(rng.uniform(0.1, 3.0), rng.uniform(0.0, 5.0)) for _ in range(k)]
        ns = [rng.randint(1, 4) for _ in range(k)]
        m = rng.randint(1, 5)
        total, cap = sum(ns) * m, rng.choice([1 << 30, m, m + 2])
        want = _every_share(terms, ns, total, cap, lambda _: True)
        slopes, consts = np.array([s for s, _ in terms]), np.array([c for _, c in terms])
        got = _integer_bounds(np.array([ns]), slopes, consts, total, cap, m)[0]
        assert got <= want
        crossing = (total + sum(n * c / s for (s, c), n in zip(terms, ns))) / sum(
            n / s for (s, _), n in zip(terms, ns)
        )
        lifted += got > crossing * (1 + 1e-6)
    assert lifted > 150  # the integer bound is tighter than the crossing for most


def _three_type_screen(per_node: int, global_batch: int):
    """(graph, cluster, pricer, screen memo) of a small model on H100 + A100-80GB + A40 nodes
    of `per_node` GPUs (`three_type_cluster`)."""
    graph = transformer_graph(4, 1024, 8, 8, 4096, 8000, 1024, 1)
    cluster = three_type_cluster(gpus_per_node=per_node)
    pricer = pricer_for(graph, cluster)
    memo = _ScreenMemo(
        pricer, graph, global_batch, _Work.starting_now(1e3), _Scorer(Objective(), cluster),
        math.inf,
    )  # fmt: skip
    return graph, cluster, pricer, memo


@pytest.mark.parametrize(
    "per_node, global_batch, least_dp, searched",
    [
        (2, 48, 3, 0),  # pairs of GPUs: two groups hold at most 4 pipelines
        (4, 72, 5, 50),  # four a group: several splits per support, visited in bound order
    ],
)
def test_share_placements_over_three_groups_find_the_best(
    per_node, global_batch, least_dp, searched
):
    """For every configuration of a small H100 + A100-80GB + A40 cluster with room for
    shares, the best of `_share_placements`' options prices exactly as the best of every
    group-pure placement (pairs and triples of groups), and the search says it is exact."""
    graph, cluster, pricer, memo = _three_type_screen(per_node, global_batch)
    checked = triples = several = 0
    for c in enumerate_candidates(graph, cluster, Parallel(), global_batch):
        if c.group_tp or c.dp < least_dp:
            continue  # three groups need three pipelines
        for split in memo.splits(c)[:2]:
            t = plan_tables(pricer, c.parallel(), stages_of(graph, split), memo.groups(c))
            cap = {g: replica_capacity(pricer.groups[g], c.tp, c.cp) for g in t.groups}
            every = list(every_share_placement(t, cap))
            if not every:
                continue
            allowed = [[g for g in t.groups if t.fits[s][g]] for s in range(t.pp)]
            options, exact, listed, _ = _share_placements(t, allowed)
            assert exact
            want = min(evaluate(t, pl, sh).step_time_s for pl, sh in every)
            got = min(evaluate(t, pl, sh).step_time_s for pl, sh in options)
            assert got == pytest.approx(want, rel=1e-12), (c.describe(), split)
            checked += 1
            several += listed > 1
            best = min(every, key=lambda o: evaluate(t, o[0], o[1]).step_time_s)
            triples += len(best[1]) == 3
    assert checked > 20
    assert triples > 3  # all three groups win somewhere: the search is not only pairs'
    assert several >= searched


@pytest.mark.parametrize(
    "per_node, global_batch", [(2, 48), pytest.param(4, 72, marks=pytest.mark.slow)]
)
def test_cost_share_placements_find_the_cheapest(per_node, global_batch):
    """Objective "cost" (`rates`: each group's price per second of a replica-stage's GPUs):
    the cheapest of `_share_placements`' options (every support's (pipeline term, price)
    frontier) scores exactly as the cheapest of every group-pure placement, over pairs and
    triples of groups, at prices where the fastest group is dearest per token and where it is
    cheapest."""
    graph, cluster, pricer, memo = _three_type_screen(per_node, global_batch)
    checked = wider = 0
    for prices in ({"h100": 9.0, "a100": 2.0, "a40": 0.6}, {"h100": 2.0, "a100": 1.9, "a40": 1.6}):
        for c in enumerate_candidates(graph, cluster, Parallel(), global_batch):
            if c.group_tp or c.dp < 3:
                continue
            rates = {g: prices[g] * c.tp * c.cp for g in prices}
            for split in memo.splits(c)[:1]:
                t = plan_tables(pricer, c.parallel(), stages_of(graph, split), memo.groups(c))
                cap = {g: replica_capacity(pricer.groups[g], c.tp, c.cp) for g in t.groups}
                every = list(every_share_placement(t, cap))
                if not every:
                    continue

                def score(option):
                    pl, sh = option
                    price = sum(rates[g] * n for reps in pl for g, n in reps)
                    return evaluate(t, pl, sh).step_time_s * price

                allowed = [[g for g in t.groups if t.fits[s][g]] for s in range(t.pp)]
                options, exact, _, _ = _share_placements(t, allowed, rates)
                assert exact
                want = min(every, key=score)
                assert min(map(score, options)) == pytest.approx(score(want), rel=1e-12)
                checked += 1
                wider += len(want[1]) == 3
    assert checked > 20
    assert wider > 0  # a triple of groups is cheapest somewhere


def test_solve_is_optimal_on_three_groups_and_uses_all_three(monkeypatch):
    """The whole search on 4 A100 + 8 V100 + 8 T4 in fp16 (tests/planner/test_solver_chains.py's
    cluster): the plan runs group-pure pipelines in all three groups with three micro-batch
    counts, and it is proven optimal; without the supports of three groups the plan is slower
    and the search leaves their bound open ("feasible")."""
    graph, cluster = chain_groups()
    got = solve(graph, cluster, Parallel(), global_batch=32, dtype="float16")
    assert got.status == "optimal", got.gap
    used = {g for st in got.stages for g, _ in st.replicas}
    assert used == {"a100", "v100", "t4"} and got.stages[0].microbatches
    shares = dict(got.stages[0].microbatches)
    assert shares["a100"] > shares["v100"] > shares["t4"]  # the fastest group the most

    monkeypatch.setattr(placements_mod, "_support_placements", lambda *a: ([], False, 0, 0))
    without = solve(graph, cluster, Parallel(), global_batch=32, dtype="float16")
    assert without.status == "feasible"
    assert got.prediction.step_time_s < without.prediction.step_time_s * 0.97
