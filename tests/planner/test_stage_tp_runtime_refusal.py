"""A per-stage TP layout (stages at different TP degrees, a stage mixing groups: Sailor's
plan shape) is priced by the cost model (tests/cost_model/test_stage_tp_layouts.py) but not
run: the runtime cannot yet hand activations between TP groups of different degrees, and its
`check_plan` refuses such a plan in one line before any process starts."""

from __future__ import annotations

import pytest
from meshplan.api import _model_ref
from meshplan.cost_model import predict
from meshplan.ir.plan import Plan, SolverInfo, assign_ranks
from meshplan.runtime import RuntimePlanError, check_plan

from tests.cost_model.test_stage_tp_layouts import _sailor_like


def test_runtime_refuses_a_layout_whose_stages_change_tp():
    graph, cluster, p, stages = _sailor_like()
    plan = Plan(
        model=_model_ref(graph),
        cluster=cluster,
        parallel=p,
        stages=stages,
        ranks=assign_ranks(cluster, p, stages),
        predicted=predict(graph, cluster, p, stages, dtype="float16"),
        solver=SolverInfo("fixed", 0.0, 1),
    )
    with pytest.raises(RuntimePlanError) as e:
        check_plan(plan)
    why = str(e.value)
    assert why.startswith("runtime: per-group tp runs only in group-pure pipelines")
    assert "\n" not in why
