"""The screen and the placement models share the budget: when the screen stops at its share
(two thirds of the work left) and its pairs' placement models leave work over, both go on
where they stopped (`solver._search`, `solver_screen._Screen.run`).

Oracle: the same solve with an ample budget. Sailor's 256 A100-40GB + 256 V100-16GB scenario
(benchmarks/vs_sailor.py, GPT-Neo-2.7B, 2048 sequences): proven optimal within 8.4 work
units, 21 placement models among them, while the screen alone needs more than two thirds of
the default budget of 10. Before the screen went on after the models, the default budget
returned the same plan as "feasible" with a 3.4% gap and 2.3 units unspent.
"""

from __future__ import annotations

import pytest

from tests.benchmark_module import benchmark_module


@pytest.fixture(scope="module")
def sailor_256():
    import meshplan

    vs = benchmark_module("vs_sailor")
    graph = meshplan.trace(*vs._flat(vs.gpt_neo_27b("bfloat16")))
    return vs, graph, vs.sailor_cluster(50.0, *vs.SCENARIOS["256+256"])


def test_the_default_budget_proves_what_an_ample_one_does(sailor_256):
    import meshplan

    vs, graph, cluster = sailor_256
    default = meshplan.plan(graph, cluster=cluster, global_batch=vs.GLOBAL_BATCH)
    assert default.solver.status == "optimal", default.solver
    assert default.solver.gap == 0.0
    ample = meshplan.plan(graph, cluster=cluster, global_batch=vs.GLOBAL_BATCH, time_limit_s=60)
    assert ample.solver.status == "optimal"
    assert default.to_json() == ample.to_json()  # the plan file records no budget
