"""A per-stage TP layout (stages at different TP degrees, a stage mixing groups: Sailor's
plan shape) is priced by the cost model (tests/cost_model/test_stage_tp_layouts.py) and
accepted by the runtime's `check_plan` under 1F1B (the hand-off between degrees,
`runtime.pipeline_handoff`; parity in tests/runtime/test_parity_stage_tp.py); what it still
cannot run (an interleaved schedule across degrees) is refused in one line before any
process starts."""

from __future__ import annotations

from meshplan.api import _model_ref
from meshplan.cost_model import predict
from meshplan.ir.plan import Plan, SolverInfo, assign_ranks
from meshplan.runtime import check_plan

from tests.cost_model.test_stage_tp_layouts import _sailor_like


def test_runtime_accepts_the_layout_and_refuses_interleaving_across_degrees():
    import dataclasses

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
    check_plan(plan)  # runs as it is
    gpipe = dataclasses.replace(plan, parallel=dataclasses.replace(p, schedule="gpipe"))
    check_plan(gpipe)
    from meshplan.ir import group_tp_problem

    inter = dataclasses.replace(p, schedule="interleaved_1f1b", virtual_stages=2)
    why = group_tp_problem(inter, stages)
    assert why is not None and "\n" not in why
