"""meshplan.runtime: execute a Plan on torch.distributed and launch it from plan JSON.

    import meshplan.runtime as rt
    rt.init_distributed()                       # inside torchrun / `meshplan launch`
    plan = meshplan.Plan.from_json(os.environ["MESHPLAN_PLAN"])
    runner = rt.apply(model, plan, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    loss = runner.step(tokens, targets)         # global mean loss, same on every rank
    state = runner.full_state_dict()            # unsharded, on rank 0

One module per dimension (`data_parallel`, `tensor_parallel`, `pipeline_parallel`,
`context_parallel`, `expert_parallel`, `recompute`), each with one step of the signature
`steps` describes, `mesh` for the DeviceMesh, `apply` fixing their order, `launch` for
torchrun commands and the local fork launcher. The runtime reads a Plan (`meshplan.ir`) and
never imports the planner or the solver.
"""

from .apply import Runner, apply, check_model, check_plan
from .context_parallel import ContextParallel, sequence_positions
from .errors import RankFailure, RuntimePlanError
from .expert_parallel import ExpertParallel
from .launch import check_machine, launch, run_local, torchrun_commands
from .mesh import (
    CollectiveCounter,
    CollectiveRecord,
    RankContext,
    build_mesh,
    init_distributed,
    shutdown_distributed,
)
from .tensor_parallel import clean_name

__all__ = [
    "CollectiveCounter",
    "CollectiveRecord",
    "ContextParallel",
    "ExpertParallel",
    "RankContext",
    "RankFailure",
    "Runner",
    "RuntimePlanError",
    "apply",
    "build_mesh",
    "check_machine",
    "check_model",
    "check_plan",
    "clean_name",
    "init_distributed",
    "launch",
    "run_local",
    "sequence_positions",
    "shutdown_distributed",
    "torchrun_commands",
]
