"""The device mesh of a plan, and where this process sits in it.

The plan lists every GPU of the cluster as `[rank, node, local_rank, group, pp, dp, cp, tp]`
(idle GPUs carry no coordinates). Only the active ranks are launched (`meshplan launch`
starts `plan.world_size` processes), so torch's global rank `i` plays the `i`-th active plan
rank in plan-rank order, which is node-major like torchrun's own numbering.

The mesh has the plan's axes, outermost first: `(pp, dp, cp, tp)`; TP is innermost so a TP
group is consecutive ranks of one node. Sub-meshes (`mesh["tp"]`, `mesh["dp"]`) give the
process groups each dimension communicates on.

Two derived groupings (no new plan axes):
- data parallelism with context parallelism reduces gradients over dp x cp together
  (Megatron-LM): `data_parallel_context` gives a view whose "dp" axis is dp x cp;
- expert parallelism reuses dp ranks: `ep` must divide dp, and an ep group is `ep`
  consecutive dp ranks with the same (pp, cp, tp) coordinates (dp coordinates
  `[j*ep, (j+1)*ep)`); its i-th member holds experts `[i*E/ep, (i+1)*E/ep)`. Expert
  parameters are replicated on the dp/ep ranks with the same dp coordinate mod ep (and on
  every cp rank), which reduce their gradients (under ZeRO > 0: shard them). These groups
  are the axes of the experts' own mesh `(pp, ep, replica, tp)` (`expert_groups`).

Per-group TP (`StagePlacement.group_tp`): the replicas of each device group use their own
tp, so the ranks do not form one mesh. Each group's pipelines are a homogeneous plan of
their own (`group_view`: that group's replicas, its tp, dp indices counted inside the group)
with its own DeviceMesh, and the rank's context is its group's view; `RankContext.whole` keeps
the plan as written, for what spans groups: the batch split, the loss average and the
gradient reduction (`data_parallel.HeteroGradients`). Where stages differ in degree or groups
(pipeline i is dp index i of every stage, its stages' replicas in whatever groups the
placement puts them), the view is per (stage, group) (`stage_group_view`), its mesh covers
that stage only, and the stages hand activations to each other through
`pipeline_handoff` instead of torch's pipelining.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import inspect
import os
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from meshplan.ir.parallel import Parallel, StagePlacement, group_pure
from meshplan.ir.plan import MESH_AXES, Plan, RankAssignment
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from . import watchdog
from .errors import RuntimePlanError

DEFAULT_TIMEOUT_S = 300.0  # a peer that never arrives fails the step instead of hanging


def active_ranks(plan: Plan) -> list[RankAssignment]:
    """The plan ranks that run (have coordinates), in plan-rank order = torch rank order."""
    return sorted((r for r in plan.ranks if r.coords is not None), key=lambda r: r.rank)


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> None:
    """Join the process group torchrun (or `run_local`) described in the environment.

    No-op when already initialised. gloo on CPU, NCCL when CUDA is present. The timeout
    bounds every collective and receive, on every process group made afterwards too
    (DeviceMesh's, `new_group`'s), and a heartbeat thread makes every rank leave within it
    when one stops or dies, naming that rank (`runtime/watchdog.py`).
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # torch's DistStoreError / gloo timeouts: say which rank and why
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise RuntimeError(
                f"rank {rank}: a peer never arrived: the process group of {world} ranks did "
                f"not form within {timeout_s:.0f} s ({first})"
            ) from e
        raise RuntimeError(f"rank {rank}: cannot join the process group: {first}") from e
    bound_process_groups(timeout_s)
    # Leave cleanly at interpreter exit too (after an uncaught exception: without waiting for
    # peers, which may be gone); a no-op once the script has shut down itself.
    atexit.register(lambda: shutdown_distributed(barrier=not hasattr(sys, "last_value")))


def bound_process_groups(timeout_s: float | None = None) -> None:
    """Bound every process group made from now on by `timeout_s` (default: the default
    group's timeout) and start this rank's watchdog (once). `init_distributed` and
    `run_local` call it; `build_mesh` too, for a process group a script made itself."""
    if timeout_s is None:
        timeout_s = _default_group_timeout_s()
        if timeout_s is None:
            return
    watchdog.bound_new_groups(timedelta(seconds=timeout_s))
    watchdog.start_watchdog(timeout_s)


def _default_group_timeout_s() -> float | None:
    """The default process group's timeout in seconds (None when torch does not say)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:
        return None


def shutdown_distributed(barrier: bool = True) -> None:
    """Leave torch.distributed so that no communication thread outlives this call.

    `destroy_process_group` alone only deregisters the groups: a group stays alive, with its
    gloo worker and socket threads, while anything references it, and DTensor's
    sharding-propagation caches (the Python LRU caches and the C++ fast-path cache) keep the
    DeviceMeshes of every DTensor ever dispatched, hence their groups (FSDP2 under ZeRO 1-3,
    TP; measured: 8 gloo worker threads left on each rank of a 2-rank ZeRO-3 run, none with
    DDP). Those threads are then torn down by interpreter finalization, in no fixed order
    with the interpreter and C++ statics, which can abort a rank after training finished
    ("terminate called without an active exception"). Here, in order: wait for
    every rank (`barrier`: none closes its connections while a peer is still in a
    collective; skip it when leaving on an error, peers may be gone), destroy the groups,
    clear the caches, and collect the garbage, which runs the groups' destructors (they join
    their threads) while the interpreter is whole. Safe to call more than once."""
    if dist.is_initialized():
        if barrier:
            try:
                dist.barrier()
            except Exception:  # a peer that failed reports itself; leave anyway
                pass
        watchdog.stop_watchdog()  # peers stop expecting this rank's beat
        dist.destroy_process_group()
    watchdog.stop_watchdog()
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """Empty the caches of torch 2.13's DTensor that hold DeviceMeshes (and so their process
    groups) for the life of the process. Private torch names, each skipped if it is gone:
    `tests/runtime/test_launch.py` counts the gloo threads left and fails if one is missed."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, debug

    propagator = type(DTensor._op_dispatcher.sharding_propagator)
    clears = (
        lambda: debug._clear_sharding_prop_cache(),  # op sharding: Python LRU, C++ fast path
        lambda: propagator._propagate_tensor_meta_cached.cache_clear(),
        lambda: _redistribute._gen_transform_infos.cache_clear(),
        lambda: _redistribute.clear_redistribute_planner_cache(),
        lambda: _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear(),
    )
    for clear in clears:
        try:
            clear()
        except AttributeError:
            pass


@dataclass(frozen=True)
class RankContext:
    """This process's place in the plan: its plan rank, mesh coordinates and the mesh."""

    plan: Plan
    rank: int  # torch global rank
    assignment: RankAssignment
    mesh: DeviceMesh  # axes (pp, dp, cp, tp)
    device: torch.device
    # Per-group TP: the plan as written and this rank's place in it (`plan`, `assignment`
    # and `mesh` are then the rank's device-group view, `group_view`); None otherwise.
    whole: Plan | None = None
    whole_assignment: RankAssignment | None = None

    @property
    def whole_plan(self) -> Plan:
        """The plan as written (the same as `plan` unless per-group TP gives views)."""
        return self.whole or self.plan

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica index over the whole plan (all groups)."""
        a = self.whole_assignment or self.assignment
        assert a.coords is not None
        return a.coords[MESH_AXES.index("dp")]

    @property
    def coords(self) -> tuple[int, int, int, int]:
        assert self.assignment.coords is not None
        return self.assignment.coords

    def coord(self, axis: str) -> int:
        return self.coords[MESH_AXES.index(axis)]

    def size(self, axis: str) -> int:
        return self.plan.mesh_shape[MESH_AXES.index(axis)]

    @property
    def stage_index(self) -> int:
        return self.coord("pp")

    @property
    def num_stages(self) -> int:
        return self.size("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def submesh(self, axis: str) -> DeviceMesh:
        return self.mesh[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)


def plan_device(plan: Plan, local_rank: int) -> torch.device:
    """CPU plans run on the host; GPU plans on `cuda:<local_rank>`."""
    if torch.cuda.is_available() and not _is_cpu_plan(plan):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _is_cpu_plan(plan: Plan) -> bool:
    return all(g.gpu.name.upper() == "CPU" for g in plan.cluster.groups)


def check_stage_widths(plan: Plan) -> None:
    """Refuse stages whose data-parallel widths differ (one line)."""
    for s in plan.stages:
        if s.dp != plan.parallel.dp:
            raise RuntimePlanError(
                f"runtime: stage {s.index} has {s.dp} replicas but dp={plan.parallel.dp}; "
                "stages with different data-parallel widths are not supported yet"
            )


def build_mesh(plan: Plan, device: torch.device | None = None) -> RankContext:
    """The plan's DeviceMesh and this rank's coordinates.

    Raises `RuntimePlanError` when the process group does not match the plan (world size,
    non-uniform stages) so that a wrong launch fails at once with a one-line reason.
    """
    if not dist.is_initialized():
        raise RuntimePlanError(
            "runtime: torch.distributed is not initialised; run under `meshplan launch` / "
            "torchrun, or call meshplan.runtime.init_distributed() first"
        )
    ranks = active_ranks(plan)
    world = dist.get_world_size()
    if world != len(ranks):
        raise RuntimePlanError(
            f"runtime: the plan runs on {len(ranks)} ranks but the process group has {world}; "
            f"launch with `meshplan launch` (or torchrun --nproc-per-node {len(ranks)})"
        )
    check_stage_widths(plan)
    if watchdog.active() is None:  # a process group the script made itself: bound it too
        bound_process_groups()
    if any(st.group_tp for st in plan.stages):
        if group_pure(plan.stages):
            return _build_group_meshes(plan, ranks, device)
        return _build_stage_meshes(plan, ranks, device)
    shape = plan.mesh_shape
    grid = torch.full(shape, -1, dtype=torch.int)
    for torch_rank, r in enumerate(ranks):
        assert r.coords is not None
        if grid[r.coords] != -1:
            raise RuntimePlanError(f"runtime: plan gives two ranks the coordinates {r.coords}")
        grid[r.coords] = torch_rank
    if (grid < 0).any():
        raise RuntimePlanError(
            f"runtime: plan ranks do not fill the mesh {dict(zip(MESH_AXES, shape))}"
        )
    me = ranks[dist.get_rank()]
    if device is None:
        device = plan_device(plan, int(os.environ.get("LOCAL_RANK", me.local_rank)))
    mesh = DeviceMesh(device.type, grid, mesh_dim_names=MESH_AXES)
    return RankContext(plan=plan, rank=dist.get_rank(), assignment=me, mesh=mesh, device=device)


def _group_slice(plan: Plan, st: StagePlacement, group: str) -> tuple[int, int, Parallel]:
    """(the replicas stage `st` holds in `group`, the dp index of the first of them, the
    homogeneous `Parallel` they run: dp those replicas, their tp, sequence parallelism where
    that tp > 1)."""
    n = dict(st.replicas)[group]
    tp = st.tp_of(group, plan.parallel.tp)
    offset = 0
    for g, k in st.replicas:
        if g == group:
            break
        offset += k
    p = dataclasses.replace(
        plan.parallel,
        dp=n,
        tp=tp,
        sequence_parallel=bool(plan.parallel.sequence_parallel) and tp > 1,
    )
    return n, offset, p


def group_view(plan: Plan, group: str) -> Plan:
    """The homogeneous plan `group`'s pipelines run under per-group TP: only its replicas, its
    tp (sequence parallelism where that tp > 1), dp indices counted inside the group, the
    other groups' ranks idle. Raw traffic: the cross-group reduction is not coded."""
    n, offset, p = _group_slice(plan, plan.stages[0], group)
    stages = tuple(
        dataclasses.replace(
            st,
            replicas=((group, n),),
            microbatches=((group, st.shares[group]),) if st.microbatches else (),
            group_tp=(),
        )
        for st in plan.stages
    )
    ranks = tuple(
        dataclasses.replace(
            r,
            coords=(r.coords[0], r.coords[1] - offset, r.coords[2], r.coords[3])
            if r.coords is not None and r.group == group
            else None,
        )
        for r in plan.ranks
    )
    return _view(plan, p, stages, ranks)


def _view(plan: Plan, p, stages, ranks) -> Plan:
    """`plan` narrowed to one homogeneous part (`group_view`, `stage_group_view`): its
    degrees, stages and ranks, and no coded traffic (the whole plan's decisions span parts)."""
    return dataclasses.replace(
        plan,
        parallel=p,
        stages=stages,
        ranks=ranks,
        compression=dataclasses.replace(plan.compression, mode="off", decisions=()),
    )


def _build_group_meshes(plan: Plan, ranks: list[RankAssignment], device) -> RankContext:
    """Per-group TP: one DeviceMesh per device group over its view's ranks (every rank builds
    every group's mesh, in the plan's group order: creating a mesh's process groups is
    collective), and this rank's view."""
    me = ranks[dist.get_rank()]
    if device is None:
        device = plan_device(plan, int(os.environ.get("LOCAL_RANK", me.local_rank)))
    torch_rank = {r.rank: i for i, r in enumerate(ranks)}
    mine = None
    for group, _ in plan.stages[0].replicas:
        view = group_view(plan, group)
        grid = torch.full(view.mesh_shape, -1, dtype=torch.int)
        for r in view.ranks:
            if r.coords is not None:
                grid[r.coords] = torch_rank[r.rank]
        if (grid < 0).any():
            raise RuntimePlanError(
                f"runtime: group {group}'s ranks do not fill its mesh "
                f"{dict(zip(MESH_AXES, view.mesh_shape))}"
            )
        mesh = DeviceMesh(device.type, grid, mesh_dim_names=MESH_AXES)
        if group == me.group:
            mine = (view, mesh)
    assert mine is not None
    view, mesh = mine
    local = next(r for r in view.ranks if r.rank == me.rank)
    return RankContext(
        plan=view,
        rank=dist.get_rank(),
        assignment=local,
        mesh=mesh,
        device=device,
        whole=plan,
        whole_assignment=me,
    )


def stage_group_view(plan: Plan, stage: int, group: str) -> Plan:
    """The homogeneous plan the replicas of pipeline stage `stage` in device group `group`
    run under, when stages differ in degree or groups (not group-pure): those replicas only
    (dp indices counted among them), their tp (sequence parallelism where it is > 1), every
    stage's unit range kept, every other rank idle. Its mesh covers that one stage
    (`_build_stage_meshes`); the hand-offs between stages and the gradient average read the
    whole plan (`pipeline_handoff`, `data_parallel.HeteroGradients`)."""
    n, offset, p = _group_slice(plan, plan.stages[stage], group)
    stages = tuple(
        dataclasses.replace(s, replicas=((group, n),), microbatches=(), group_tp=())
        for s in plan.stages
    )
    ranks = tuple(
        dataclasses.replace(
            r,
            coords=(stage, r.coords[1] - offset, r.coords[2], r.coords[3])
            if r.coords is not None and r.group == group and r.coords[0] == stage
            else None,
        )
        for r in plan.ranks
    )
    return _view(plan, p, stages, ranks)


def _build_stage_meshes(plan: Plan, ranks: list[RankAssignment], device) -> RankContext:
    """Stages at different degrees or in different groups: one DeviceMesh (1, n, cp, tp) per
    (stage, group) pair over the ranks of that stage's replicas in that group (every rank
    builds every mesh, in stage then placement order: creating process groups is
    collective), and this rank's `stage_group_view`. Its "pp" axis has one rank: stages
    talk through `pipeline_handoff`, not torch's pipelining."""
    me = ranks[dist.get_rank()]
    if device is None:
        device = plan_device(plan, int(os.environ.get("LOCAL_RANK", me.local_rank)))
    torch_rank = {r.rank: i for i, r in enumerate(ranks)}
    mine = None
    for st in plan.stages:
        for group, _ in st.replicas:
            view = stage_group_view(plan, st.index, group)
            _, dp, cp, tp = view.mesh_shape
            grid = torch.full((1, dp, cp, tp), -1, dtype=torch.int)
            for r in view.ranks:
                if r.coords is not None:
                    grid[(0, *r.coords[1:])] = torch_rank[r.rank]
            if (grid < 0).any():
                raise RuntimePlanError(
                    f"runtime: stage {st.index}'s ranks in group {group} do not fill its mesh "
                    f"(dp {dp}, cp {cp}, tp {tp})"
                )
            mesh = DeviceMesh(device.type, grid, mesh_dim_names=MESH_AXES)
            if me.coords is not None and (st.index, group) == (me.coords[0], me.group):
                mine = (view, mesh)
    assert mine is not None
    view, mesh = mine
    local = next(r for r in view.ranks if r.rank == me.rank)
    return RankContext(
        plan=view,
        rank=dist.get_rank(),
        assignment=local,
        mesh=mesh,
        device=device,
        whole=plan,
        whole_assignment=me,
    )


def data_parallel_context(ctx: RankContext) -> RankContext:
    """The context data parallelism runs on: with cp > 1, dp and cp merged into one "dp" axis
    of dp*cp ranks (cp ranks hold different tokens of the same sequences, so their gradients
    are reduced together, as Megatron-LM does); `ctx` itself when cp == 1.

    Only for `data_parallel.apply_data_parallel` (it reads `plan.parallel.dp`/`zero`,
    `submesh("dp")` and `group("dp")`): batch splitting and the loss keep the real context.
    Every rank must call it (it creates the merged groups)."""
    pp, dp, cp, tp = ctx.plan.mesh_shape
    if cp == 1:
        return ctx
    grid = ctx.mesh.mesh.reshape(pp, dp * cp, 1, tp)
    mesh = DeviceMesh(ctx.device.type, grid, mesh_dim_names=MESH_AXES)
    p = ctx.plan.parallel
    plan = dataclasses.replace(ctx.plan, parallel=dataclasses.replace(p, dp=dp * cp, cp=1))
    c = ctx.coords
    me = dataclasses.replace(ctx.assignment, coords=(c[0], c[1] * cp + c[2], 0, c[3]))
    return RankContext(plan=plan, rank=ctx.rank, assignment=me, mesh=mesh, device=ctx.device)


EXPERT_MESH_AXES = ("pp", "ep", "replica", "tp")


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel groups (see the module docstring)."""

    ep_group: dist.ProcessGroup  # the ep ranks that exchange tokens
    ep_rank: int  # rank inside ep_group = which expert shard this rank holds
    ep: int
    replica_group: dist.ProcessGroup | None  # ranks holding the same shard (None: only me)
    replicas: int
    # The experts' own mesh, axes ("pp", "ep", "replica", "tp"): the ep and replica groups
    # above are its "ep" and "replica" axes; expert DTensors live on its "tp" axis, so that
    # FSDP2 can shard them over "replica" (its 2-D (replica, tp) mesh needs both to be axes
    # of one mesh).
    mesh: DeviceMesh


def expert_groups(ctx: RankContext, ep: int) -> ExpertGroups:
    """Create the experts' mesh and its ep and expert-replica groups (every rank must call
    it, in the same order: creating a mesh's process groups is collective)."""
    pp, dp, cp, tp = ctx.plan.mesh_shape
    if ep < 1 or dp % ep:
        raise RuntimePlanError(
            f"runtime: ep={ep} must divide dp={dp} (expert ranks reuse data-parallel ranks)"
        )
    replicas = (dp // ep) * cp
    grid = ctx.mesh.mesh.reshape(pp, dp // ep, ep, cp, tp)
    # ep groups vary the ep index and fix (pp, dp block, cp, tp); replica groups vary
    # (dp block, cp), in that order, and fix (pp, ep index, tp).
    grid = grid.permute(0, 2, 1, 3, 4).reshape(pp, ep, replicas, tp)
    mesh = DeviceMesh(ctx.device.type, grid, mesh_dim_names=EXPERT_MESH_AXES)
    # The shard index is the rank inside the group (all-to-all split j goes to group rank j).
    return ExpertGroups(
        ep_group=mesh.get_group("ep"),
        ep_rank=mesh.get_local_rank("ep"),
        ep=ep,
        replica_group=mesh.get_group("replica") if replicas > 1 else None,
        replicas=replicas,
        mesh=mesh,
    )


USP_MESH_AXES = ("pp", "dp", "ring", "heads", "tp")


@dataclass(frozen=True)
class UspGroups:
    """This rank's two groups under the two-level context attention "usp"
    (`runtime.context_parallel`): cp rank c = j * u + i is rank i of the head-parallel
    group j (u consecutive cp ranks, all-to-alls) and rank j of the all-gather group i (the
    cp / u ranks holding the same heads)."""

    heads_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup


def usp_groups(ctx: RankContext, degree: int) -> UspGroups:
    """Create the "usp" groups of the plan's cp axis split into (cp / degree, degree) (every
    rank must call it, in the same order: creating a mesh's process groups is collective).
    Refused where the rank's mesh is one device group's or one stage's view (per-group or
    per-stage TP): their cp groups are not all in one mesh here."""
    pp, dp, cp, tp = ctx.plan.mesh_shape
    if ctx.whole is not None or ctx.mesh.mesh.numel() != pp * dp * cp * tp:
        raise RuntimePlanError(
            "runtime: cp attention 'usp' with per-group or per-stage TP degrees is not run; "
            "plan cp attention 'allgather' or 'heads'"
        )
    if degree < 2 or cp % degree:
        raise RuntimePlanError(f"runtime: cp_head_degree={degree} must divide cp={cp}")
    grid = ctx.mesh.mesh.reshape(pp, dp, cp // degree, degree, tp)
    mesh = DeviceMesh(ctx.device.type, grid, mesh_dim_names=USP_MESH_AXES)
    return UspGroups(heads_group=mesh.get_group("heads"), ring_group=mesh.get_group("ring"))


# -- counting collectives -----------------------------------------------------------------------

# Dispatcher op name -> collective kind. Functional collectives (DTensor, TP) and the c10d
# ops behind torch.distributed's Python API (DDP's reducer, FSDP2, pipelining) both appear.
_KINDS = {
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective as run: kind, elements of the full (unsharded) tensor, its group
    (size and name; `RankContext.group(axis).group_name` tells which mesh axis it is)."""

    kind: str
    numel: int
    group_size: int
    group: str = ""


# Python-level functional collectives (DTensor's redistributions go through these, explicit
# ones from parallel-style hooks and implicit ones from sharding propagation alike).
_FUNCOL = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_single_autograd": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_autograd": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
    "broadcast": "broadcast",
}


def _replaying_saved_ops() -> bool:
    """True inside the recomputation of a selective activation checkpoint, where torch
    returns the saved outputs of saved ops instead of running them."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachedTorchDispatchMode

    return any(isinstance(m, _CachedTorchDispatchMode) for m in _get_current_dispatch_mode_stack())


class CollectiveCounter(TorchDispatchMode):
    """Records every collective this rank runs while active (`with CollectiveCounter() as c`).

    Two taps, because collectives reach gloo two ways:
    - the c10d ops behind torch.distributed's Python API and DDP's C++ reducer (FSDP2,
      pipelining, DDP) are seen by this TorchDispatchMode;
    - DTensor's functional collectives are seen by wrapping the functions of
      `torch.distributed._functional_collectives` while active: DTensor issues its implicit
      redistributions from inside its own op dispatch, where a dispatch mode is not active.

    `numel` is the size of the whole tensor the collective works on: the input of an
    all-reduce or reduce-scatter, the output of an all-gather. Collectives on one-rank groups
    are recorded too (they move nothing; `counts()` leaves them out by default).
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []
        self._saved: dict[str, object] = {}
        self._depth = threading.local()

    def __enter__(self):
        from torch.distributed import _functional_collectives as funcol

        for name, kind in _FUNCOL.items():
            orig = getattr(funcol, name, None)
            if orig is not None:
                self._saved[name] = orig
                setattr(funcol, name, self._wrap(orig, kind, name))
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.distributed import _functional_collectives as funcol

        for name, orig in self._saved.items():
            setattr(funcol, name, orig)
        self._saved.clear()
        return super().__exit__(*exc)

    def _wrap(self, orig, kind: str, name: str):
        signature = inspect.signature(orig)

        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            # only the outermost call (wrappers call each other), and not a replay: inside a
            # selective-checkpoint recomputation the collective's saved output is returned
            # and nothing is sent (`runtime.recompute.keep_linear_policy` saves them)
            if depth == 0 and not _replaying_saved_ops():
                bound = signature.bind(*args, **kwargs)
                tensor, group = (
                    args[0] if args else bound.arguments.get("self"),
                    bound.arguments.get("group"),
                )
                size, gname = _funcol_group(group)
                numel = _numel(tensor) * (size if kind == "all_gather" else 1)
                self.records.append(CollectiveRecord(kind, numel, size, gname))
            self._depth.n = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and getattr(self._depth, "n", 0) == 0:
            kind = _KINDS.get(func._opname)
            if kind is not None:
                self.records.append(_record(kind, func._opname, args))
        return func(*args, **kwargs)

    def counts(self, min_group: int = 2) -> dict[str, int]:
        """Collectives by kind, leaving out groups smaller than `min_group`."""
        out: dict[str, int] = {}
        for r in self.records:
            if r.group_size >= min_group:
                out[r.kind] = out.get(r.kind, 0) + 1
        return out


def _funcol_group(group) -> tuple[int, str]:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    try:
        name = funcol._resolve_group_name(group)
        return _get_group_size_by_name(name), str(name)
    except Exception:
        return 0, ""


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(t) for t in x)
    return 0


def _group_of(args) -> tuple[int, str]:
    for a in args:
        pg = None
        if isinstance(a, dist.ProcessGroup):
            pg = a
        elif isinstance(a, torch.ScriptObject):  # c10d ops carry the group as a ScriptObject
            try:
                pg = dist.ProcessGroup.unbox(a)
            except Exception:
                continue
        if pg is not None:
            return pg.size(), str(pg.group_name)
    return 0, ""


def _record(kind: str, opname: str, args) -> CollectiveRecord:
    size, name = _group_of(args)
    if opname == "all_gather_into_tensor":  # functional: (input, group_size, group_name)
        numel = _numel(args[0]) * size
    elif opname in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input, pg, ...)
        numel = max(_numel(args[0]), _numel(args[1]))
    elif opname in ("allgather_", "reduce_scatter_"):  # (outputs, inputs, pg, ...)
        numel = max(_numel(args[0]), _numel(args[1]))
    else:
        numel = _numel(args[0])
    return CollectiveRecord(kind, numel, size, name)
