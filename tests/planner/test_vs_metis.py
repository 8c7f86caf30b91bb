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
