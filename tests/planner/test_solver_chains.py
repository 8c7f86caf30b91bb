"""Step 2b's chains (`meshplan.solver_chains`): one pipeline through three device groups, each
run of stages at its own TP degree (Metis's plan shape on three GPU types). Oracles: the exact
price of every chain (`layout_tables` + `evaluate`, what `predict` runs) enumerated without
pruning, every split of a sample priced, and the solver with the family switched off."""

from __future__ import annotations

import itertools
import math

import meshplan.solver_layouts as layouts_mod
import pytest
from meshplan.cost_model import predict, pricer_for
from meshplan.cost_model.simulate import evaluate
from meshplan.cost_model.tables import layout_tables
from meshplan.ir import Cluster, DeviceGroup, Parallel, Recompute
from meshplan.ir.hardware import gpu_spec
from meshplan.ir.parallel import group_tp_problem
from meshplan.solver import solve
from meshplan.solver_chains import _grid, all_heads, chains, lifted, split
from meshplan.solver_layouts import _Layouts, layout_search, layouts
from meshplan.solver_objective import _Work

from tests.cost_model.test_stage_tp_layouts import NVLINK2, V100_16
from tests.planner.test_solver_layouts import GLOBAL_BATCH, PINS
from tests.planner.test_solver_layouts import _scenario as two_groups
from tests.synthetic import A100_40, IB_HDR, NVLINK3, transformer_graph

GPUS = {"a100": 4, "v100": 8, "t4": 8}


def _three_groups():
    """Sailor's runtime at GPT-Neo-2.7B's width, 12 layers, on one 4 x A100-40GB node, two
    4 x V100-16GB nodes and two 4 x T4 nodes (NVLink2 standing in for the T4s' PCIe), one
    HDR NIC per node."""
    graph = transformer_graph(12, 2560, 20, 20, 4 * 2560, 50257, 2048, 1)
    cluster = Cluster(
        name="a100x4+v100x8+t4x8",
        groups=(
            DeviceGroup("a100", A100_40, 1, 4, "nvlink3", "ib-hdr", nics_per_node=1),
            DeviceGroup("v100", V100_16, 2, 4, "nvlink2", "ib-hdr", nics_per_node=1),
            DeviceGroup("t4", gpu_spec("T4"), 2, 4, "nvlink2", "ib-hdr", nics_per_node=1),
        ),
        links=(NVLINK3, NVLINK2, IB_HDR),
    )
    return graph, cluster


@pytest.fixture(scope="module")
def family():
    graph, cluster = _three_groups()
    pricer = pricer_for(graph, cluster, "float32")
    cache = _Layouts(graph, pricer)
    every = list(chains(cache, PINS, GLOBAL_BATCH, [Recompute.NONE], False, math.inf))
    return graph, cluster, pricer, cache, every


def _price(pricer, cache, chain, counts):
    stages = cache.stages(chain, counts)
    tables = layout_tables(pricer, chain.parallel, stages)
    if not all(tables.fits[s][g] for s, st in enumerate(stages) for g, _ in st.replicas):
        return None
    return evaluate(tables, [st.replicas for st in stages]).step_time_s


def test_the_family_holds_every_order_of_three_groups_and_their_degrees(family):
    *_, every = family
    assert every == sorted(every, key=lambda item: (item[0], item[1]))
    orders = {tuple(g for g, _, _ in ch.runs) for _, _, ch in every}
    assert len(orders) == 6  # every order of the three groups
    for _, _, ch in every:
        p = ch.parallel
        assert len({t for _, t, _ in ch.runs}) > 1  # one degree everywhere: steps 2-3's
        for g, t, k in ch.runs:  # t dp k GPUs of each group, at most the group's
            assert k >= 1 and t * p.dp * k <= GPUS[g]
        assert p.pp == sum(k for *_, k in ch.runs) <= 12
        assert GLOBAL_BATCH % (p.dp * p.micro_batch) == 0
        groups = [ch.on(s)[0][0] for s in range(p.pp)]
        assert groups == [g for g, _, k in ch.runs for _ in range(k)]


def test_chains_come_lazily_in_the_order_of_every_chain_sorted(family):
    """`chains` expands a head's grid only when the search reaches its least bound and
    merges the grids: the order is that of every head's grid built and sorted up front (the
    code before session 31), and a search that takes only the first chains bounds a fraction
    of the grids."""
    graph, _, pricer, _, every = family
    eager = _Layouts(graph, pricer)
    assert every == sorted(every, key=lambda item: (item[0], item[1]))
    # the same chains as every head's grid built at once and sorted (the code before)
    heads = all_heads(eager, PINS, GLOBAL_BATCH, [Recompute.NONE], False, math.inf)
    built = sorted(
        (item for _, _, args in heads for item in _grid(eager, PINS, *args, math.inf)),
        key=lambda item: (item[0], item[1]),
    )
    assert [(b, k) for b, k, _ in built] == [(b, k) for b, k, _ in every]
    # a search that stops after 50 chains bounds a fraction of the grids
    lazy = _Layouts(graph, pricer)
    first = list(itertools.islice(
        chains(lazy, PINS, GLOBAL_BATCH, [Recompute.NONE], False, math.inf), 50
    ))  # fmt: skip
    assert first == every[:50]
    assert lazy.bounded < eager.bounded / 2, (lazy.bounded, eager.bounded)


def test_no_chain_on_fewer_than_three_groups():
    graph, cluster = two_groups()
    cache = _Layouts(graph, pricer_for(graph, cluster, "float32"))
    assert not list(chains(cache, PINS, GLOBAL_BATCH, [Recompute.NONE], False, math.inf))


def test_the_bounds_never_exceed_the_exact_price(family):
    _, _, pricer, cache, every = family
    checked = raised = 0
    for bound, _, ch in every:
        counts = split(cache, ch)
        exact = None if counts is None else _price(pricer, cache, ch, counts)
        if exact is None:
            continue
        up = lifted(cache, ch, bound)
        assert bound <= up <= exact * (1 + 1e-9), (ch, bound, up, exact)
        checked += 1
        raised += up > bound * (1 + 1e-6)
    assert checked > 1000 and raised > checked // 8, (checked, raised)


def test_the_lifted_bound_and_the_split_hold_against_every_split(family):
    """`lifted` bounds every split (n_1, n_2, n_3), not only the one priced, and `split`
    returns the split of least slowest stage then least sum: both against every split of a
    sample of chains, priced exactly."""
    _, _, pricer, cache, every = family
    n, checked = cache.n_layers, 0
    for bound, _, ch in every[::37]:
        up = lifted(cache, ch, bound)
        (_, _, k1), (_, _, k2), (_, _, k3) = ch.runs
        splits = []
        for n1 in range(k1, n - k2 - k3 + 1):
            for n2 in range(k2, n - n1 - k3 + 1):
                counts = ch.counts((n1, n2, n - n1 - n2))
                stages = cache.stages(ch, counts)
                tables = layout_tables(pricer, ch.parallel, stages)
                step = evaluate(tables, [st.replicas for st in stages]).step_time_s
                assert up <= step * (1 + 1e-9), (ch, counts, up, step)
                checked += 1
                got = cache._price_split(ch, counts, math.inf)
                if got is not None:
                    splits.append((*got, counts))
        chosen = split(cache, ch)
        if splits:
            worst, total, _ = min(splits)
            assert cache._price_split(ch, chosen, math.inf)[:2] == pytest.approx((worst, total))
        else:
            assert chosen is None
    assert checked > 500, checked


def test_the_search_finds_the_exhaustive_best_of_both_families(family):
    graph, _, pricer, cache, every = family
    best = math.inf
    for _, _, ch in every:
        counts = split(cache, ch)
        exact = None if counts is None else _price(pricer, cache, ch, counts)
        best = min(best, exact if exact is not None else math.inf)
    pairs = layouts(_Layouts(graph, pricer), PINS, GLOBAL_BATCH, [Recompute.NONE], sp=False)
    fresh = _Layouts(graph, pricer)
    for _, _, lay in pairs:  # the pair family priced the same way (its own split)
        counts = fresh.split(lay)
        if counts is not None:
            stages = fresh.stages(lay, counts)
            tables = layout_tables(pricer, lay.parallel, stages)
            if all(tables.fits[s][g] for s, st in enumerate(stages) for g, _ in st.replicas):
                step = evaluate(tables, [st.replicas for st in stages]).step_time_s
                best = min(best, step)
    work = _Work.starting_now(100.0, None)
    got = layout_search(graph, pricer, PINS, GLOBAL_BATCH, work, math.inf, [Recompute.NONE])
    assert got.best is not None and got.lowest_open == math.inf
    assert got.best[0] == pytest.approx(best, rel=1e-12)
    assert got.priced < len(every) // 10  # the bounds pruned most


def test_solve_returns_a_chain_through_three_groups_where_it_wins(monkeypatch):
    graph, cluster = _three_groups()
    got = solve(graph, cluster, PINS, global_batch=GLOBAL_BATCH, dtype="float32")
    runs = [(g, t) for st in got.stages for g, t in st.group_tp]
    assert len(got.stages) >= 3 and len({g for g, _ in runs}) == 3
    assert len({t for _, t in runs}) > 1
    assert group_tp_problem(got.parallel, got.stages) is None  # the runtime runs it
    again = predict(graph, cluster, got.parallel, got.stages, dtype="float32")
    assert got.prediction.step_time_s == pytest.approx(again.step_time_s, rel=1e-12)

    monkeypatch.setattr(layouts_mod, "chains", lambda *a, **k: iter(()))
    without = solve(graph, cluster, PINS, global_batch=GLOBAL_BATCH, dtype="float32")
    # 1.07x: the best plan without chains runs tp-4 pipelines in all three groups at 11 / 9 / 3
    # micro-batches (uneven shares over three groups, session 31; 1.19x before them)
    assert got.prediction.step_time_s < without.prediction.step_time_s * 0.95


def test_pins_the_runtime_cannot_run_leave_the_chains_empty(family):
    _, _, _, cache, _ = family
    for pins in (
        Parallel(tp=2),
        Parallel(zero=1),
        Parallel(cp=2),
        Parallel(schedule="zero_bubble"),
    ):
        assert not list(chains(cache, pins, GLOBAL_BATCH, [Recompute.NONE], False, math.inf))
