"""meshplan.cost_model: analytic compute, collective and memory costs, and the step simulator.

`predict` is the public entry; the modules hold the pieces (compute.py: roofline per op and
block; collectives.py: alpha-beta per link tier; memory.py: model states and activations;
simulate.py: the step-time formula over a placement).
"""

from .simulate import (
    BREAKDOWN_PARTS,
    ModelCosts,
    PlanTables,
    Pricer,
    evaluate,
    hetero_tables,
    model_costs,
    plan_tables,
    predict,
    pricer_for,
)

__all__ = [
    "BREAKDOWN_PARTS",
    "ModelCosts",
    "PlanTables",
    "Pricer",
    "evaluate",
    "model_costs",
    "hetero_tables",
    "plan_tables",
    "predict",
    "pricer_for",
]
