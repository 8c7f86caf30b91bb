"""meshplan.cost_model: analytic compute, collective and memory costs, and the step simulator.

`predict` is the public entry; the modules hold the pieces (compute.py: roofline per op and
block; collectives.py: alpha-beta per link tier; memory.py: model states and activations;
graph_costs.py: per-graph facts; pricer.py: per-stage times and memory on a cluster, with
each dimension's traffic in tp_traffic.py, cp_traffic.py, ep_traffic.py, pp_traffic.py and
dp_traffic.py; simulate.py: the step-time formula over a placement).
"""

from .graph_costs import ModelCosts, model_costs
from .pricer import Pricer, pricer_for
from .simulate import BREAKDOWN_PARTS, evaluate, predict
from .tables import PlanTables, hetero_tables, plan_tables

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
