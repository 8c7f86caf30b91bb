"""Step 2b of the search (`meshplan.solver_layouts`): pipelines that change device group and TP
degree between stages (Sailor's plan shape). Oracles: the exact price of every layout of the
family (`layout_tables` + `evaluate`, what `predict` runs) enumerated without pruning, and the
solver with the family switched off."""

from __future__ import annotations

import dataclasses
import math

import meshplan.solver_layouts as layouts_mod
import pytest
from meshplan.cost_model import predict, pricer_for
from meshplan.cost_model.simulate import evaluate
from meshplan.cost_model.tables import layout_tables
from meshplan.ir import Cluster, DeviceGroup, Parallel, Recompute
from meshplan.ir.parallel import group_tp_problem
from meshplan.solver import solve
from meshplan.solver_layouts import LayoutResult, _Layouts, layout_search, layouts
from meshplan.solver_objective import _Work

from tests.cost_model.test_stage_tp_layouts import NVLINK2, V100_16
from tests.synthetic import A100_40, IB_HDR, NVLINK3, transformer_graph

# Sailor's runtime (fp32, ZeRO-0, no SP or recompute) at GPT-Neo-2.7B's width, 12 layers, on
# one 4 x A100-40GB node and four 4 x V100-16GB nodes, one HDR NIC each.
PINS = Parallel(zero=0, sequence_parallel=False, recompute="none", micro_batch=1)
GLOBAL_BATCH = 32


def _scenario():
    graph = transformer_graph(12, 2560, 20, 20, 4 * 2560, 50257, 2048, 1)
    cluster = Cluster(
        name="a100x4+v100x16",
        groups=(
            DeviceGroup("a100", A100_40, 1, 4, "nvlink3", "ib-hdr", nics_per_node=1),
            DeviceGroup("v100", V100_16, 4, 4, "nvlink2", "ib-hdr", nics_per_node=1),
        ),
        links=(NVLINK3, NVLINK2, IB_HDR),
    )
    return graph, cluster


def _exact(pricer, cache, lay):
    """The family's split of `lay` priced as `predict` prices it; None when nothing fits."""
    counts = cache.split(lay)
    if counts is None:
        return None
    stages = cache.stages(lay, counts)
    tables = layout_tables(pricer, lay.parallel, stages)
    if not all(tables.fits[s][g] for s, st in enumerate(stages) for g, _ in st.replicas):
        return None
    return evaluate(tables, [st.replicas for st in stages]).step_time_s


@pytest.fixture(scope="module")
def family():
    graph, cluster = _scenario()
    pricer = pricer_for(graph, cluster, "float32")
    cache = _Layouts(graph, pricer)
    every = layouts(cache, PINS, GLOBAL_BATCH, [Recompute.NONE], sp=False)
    return graph, cluster, pricer, cache, every


def test_the_family_holds_both_group_orders_and_every_pair_of_degrees(family):
    *_, every = family
    shapes = {(lay.a, lay.t_a, lay.b, lay.t_b) for _, _, lay in every}
    # a100 and v100 both run tp 1, 2 or 4 (20 heads; 4 GPUs per node); equal degrees are
    # the placement models' (steps 2-3)
    assert len(shapes) == 2 * 6
    assert all(lay.t_a != lay.t_b for _, _, lay in every)
    for _, _, lay in every:  # GPU counts: dp t k <= GPUs of the group
        p = lay.parallel
        gpus = {"a100": 4, "v100": 16}
        assert p.dp * lay.t_a * lay.k_a <= gpus[lay.a] and p.dp * lay.t_b * lay.k_b <= gpus[lay.b]
        assert p.pp == lay.k_a + lay.k_b and GLOBAL_BATCH % (p.dp * p.micro_batch) == 0


def test_the_bound_never_exceeds_the_exact_price(family):
    _, _, pricer, cache, every = family
    checked = 0
    for bound, _, lay in every:
        exact = _exact(pricer, cache, lay)
        if exact is not None:
            assert bound <= exact * (1 + 1e-9), (lay, bound, exact)
            checked += 1
    assert checked > 20


def test_the_search_finds_the_exhaustive_best(family):
    graph, _, pricer, cache, every = family
    exact = [(_exact(pricer, cache, lay), lay.sort_key) for _, _, lay in every]
    best = min((e, k) for e, k in exact if e is not None)
    work = _Work.starting_now(100.0, None)
    got = layout_search(graph, pricer, PINS, GLOBAL_BATCH, work, math.inf, [Recompute.NONE])
    assert got.best is not None and got.lowest_open == math.inf
    assert got.best[0] == pytest.approx(best[0], rel=1e-12)
    assert got.priced < len(every)  # the bound pruned some


def test_solve_returns_a_pipeline_changing_group_and_degree_where_it_wins(monkeypatch):
    graph, cluster = _scenario()
    got = solve(graph, cluster, PINS, global_batch=GLOBAL_BATCH, dtype="float32")
    degrees = [dict(st.group_tp) for st in got.stages]
    assert len(got.stages) >= 2 and all(len(d) == 1 for d in degrees)
    assert len({(g, t) for d in degrees for g, t in d.items()}) == 2  # two groups, two degrees
    assert group_tp_problem(got.parallel, got.stages) is None  # the runtime runs it
    again = predict(graph, cluster, got.parallel, got.stages, dtype="float32")
    assert got.prediction.step_time_s == pytest.approx(again.step_time_s, rel=1e-12)
    assert got.status == "optimal"

    nothing = LayoutResult(None, math.inf, 0, 0)
    monkeypatch.setattr(layouts_mod, "layout_search", lambda *a, **k: nothing)
    without = solve(graph, cluster, PINS, global_batch=GLOBAL_BATCH, dtype="float32")
    assert got.prediction.step_time_s < without.prediction.step_time_s * 0.97


def test_pins_the_runtime_cannot_run_leave_the_family_empty(family):
    _, _, _, cache, _ = family
    for pins in (
        Parallel(zero=1),
        Parallel(tp=2),
        Parallel(cp=2),
        Parallel(schedule="zero_bubble"),
    ):
        assert layouts(cache, pins, GLOBAL_BATCH, [Recompute.NONE], sp=False) == []


def test_a_model_the_runtime_cannot_pipeline_or_shard_gets_no_such_layout():
    # Oracle: `ir.facts.blocked_dimension`, what step 1 asks. The family needs pp > 1 and
    # tp > 1 on one group; with either blocked it is empty, and with SP blocked no layout
    # turns sequence parallelism on.
    graph, cluster = _scenario()
    pricer = pricer_for(graph, cluster, "float32")
    work = _Work.starting_now(100.0, None)
    free = dataclasses.replace(PINS, sequence_parallel=None)
    for dim in ("tp", "pp"):
        info = dataclasses.replace(graph.info, blockers=((dim, "test"),))
        blocked = dataclasses.replace(graph, info=info)
        got = layout_search(blocked, pricer, free, GLOBAL_BATCH, work, math.inf, [Recompute.NONE])
        assert got.best is None and got.bounded == 0
    info = dataclasses.replace(graph.info, blockers=(("sp", "test"),))
    blocked = dataclasses.replace(graph, info=info)
    got = layout_search(blocked, pricer, free, GLOBAL_BATCH, work, math.inf, [Recompute.NONE])
    assert got.best is not None and not got.best[1].sequence_parallel
