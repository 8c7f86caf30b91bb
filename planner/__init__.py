"""meshplan: auto-parallelization planner for training on heterogeneous GPU clusters.

The public API:

- `meshplan.trace(model, *example_inputs)` -> `Graph` (the operator IR, with the parallel
  dimensions the runtime cannot run on this model: `ModelInfo.blockers`)
- `meshplan.plan(model, example_inputs, cluster, global_batch=..., parallel=...)` -> `Plan`
- `meshplan.estimate(model, example_inputs, cluster, parallel=...)` -> `Prediction`
- `meshplan.Cluster.load(path)`, `meshplan.Cluster.preset(name, gpus=N)`
- `meshplan.Parallel(dp=, tp=, pp=, cp=, ep=, micro_batch=, global_batch=, recompute=, zero=)`
- `meshplan.Plan.from_json(path)`, `plan.to_json(path)`, `plan.explain()`
- `meshplan.models.get(name)`, `meshplan.models.transformer(...)`
- `meshplan.verify(model_fn, plan)` -> `VerifyReport` (the plan's layout on CPU ranks vs one
  process)
- `meshplan.configs.load("megatron:args.txt")` -> `FrameworkConfig` (torchtitan, Megatron-LM
  and DeepSpeed configurations in; `configs.export(plan, "torchtitan")` out)
"""

import gc

# No garbage collection while torch and the planner are imported: they allocate about a
# million long-lived objects, and the full collections that triggers walk all of them for
# nothing (0.2-0.4 s of every `meshplan` command on the development machine, docs/planner.md).
# The caller's setting is restored afterwards.
_collecting = gc.isenabled()
gc.disable()
try:
    from meshplan import models
    from meshplan.ir import Cluster, Graph, Parallel, Prediction, Recompute, Schedule
    from meshplan.ir.plan import Plan, PlanError
    from meshplan.ir.trace import TraceError

    from . import configs
    from .api import estimate, estimate_plan, load_model, plan, trace
    from .solver import InfeasibleError
    from .verify import VerifyReport, verify
    from .version import __version__ as __version__
    from .whatif import whatif
finally:
    if _collecting:
        gc.enable()
    del _collecting

__all__ = [
    "Cluster",
    "Graph",
    "InfeasibleError",
    "Parallel",
    "Plan",
    "PlanError",
    "Prediction",
    "Recompute",
    "Schedule",
    "TraceError",
    "VerifyReport",
    "configs",
    "estimate",
    "estimate_plan",
    "load_model",
    "models",
    "plan",
    "trace",
    "verify",
    "whatif",
]
