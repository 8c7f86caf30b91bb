"""Metis's printed plan (benchmarks/vs_metis.py) inside meshplan's plan space.

Oracle: Metis's rank-1 plan for its own worked case (4 T4 + 12 A100-80GB, GPT hidden 4096, 8
blocks, global batch 128: two TP-2 stages, the first mixing T4 and A100 replicas), priced by
`predict`. Under Metis's runtime assumptions it is one of the solver's lock-step placements,
so the solver's plan can be no slower.
"""

from __future__ import annotations

import pytest

from tests.benchmark_module import benchmark_module


@pytest.fixture(scope="module")
def vs():
    """benchmarks/vs_metis.py as a module (benchmarks/ is not a package)."""
    return benchmark_module("vs_metis")


def test_metis_plan_is_priced_and_meshplan_is_never_slower_under_its_assumptions(vs):
    import meshplan
    from meshplan.cost_model import predict
    from meshplan.ir import Parallel

    model, inputs = vs.metis_gpt("bfloat16")
    graph = meshplan.trace(model, *inputs)
    cluster = vs.metis_cluster()
    parallel, stages = vs.metis_parallel(), vs.metis_stages(graph)
    # the printed plan as Metis states it: 16 GPUs, stage 0 mixes T4 and A100 replicas
    assert sum(n * parallel.tp for st in stages for _, n in st.replicas) == 16
    assert {g for g, _ in stages[0].replicas} == {"t4", "a100"}
    assert [st.last_unit - st.first_unit for st in stages] == [4, 6]  # [0, 4, 10]
    metis = predict(graph, cluster, parallel, stages, dtype="float16")
    assert metis.fits
    plan = meshplan.plan(
        graph,
        cluster=cluster,
        global_batch=vs.GLOBAL_BATCH,
        parallel=Parallel(zero=0, sequence_parallel=False, recompute="none"),
        equal_shares=True,
    )
    assert plan.predicted.step_time_s <= metis.step_time_s * (1 + 1e-9)


def test_the_best_three_type_pipeline_is_never_faster_under_metis_runtime(vs):
    """`--three-types`: the worked case's cluster with 8 V100 added. The best pipeline through
    the three GPU types (Metis's per-stage type and degree, `solver_chains`' family searched to
    the end) is in meshplan's search space under Metis's runtime, so meshplan's plan is no
    slower."""
    import meshplan
    from meshplan.ir import Parallel

    model, inputs = vs.metis_gpt("bfloat16")
    graph = meshplan.trace(model, *inputs)
    cluster = vs.three_type_cluster()
    assert [g.name for g in cluster.groups] == ["t4", "a100", "v100"]
    pins = Parallel(zero=0, sequence_parallel=False, recompute="none")
    shaped = vs.metis_shaped(graph, cluster, pins, "float16")
    assert shaped is not None
    parallel, stages, pred = shaped
    assert {g for st in stages for g, _ in st.replicas} == {"t4", "a100", "v100"}
    plan = meshplan.plan(
        graph, cluster=cluster, global_batch=vs.GLOBAL_BATCH, parallel=pins, equal_shares=True
    )
    assert plan.predicted.step_time_s <= pred.step_time_s * (1 + 1e-9)
