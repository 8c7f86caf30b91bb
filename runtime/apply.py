"""`apply(model, plan, loss_fn, optimizer_factory) -> Runner`: run a plan on torch.distributed.

The order of the transformations is fixed, and matters (as in torchtitan's parallelize):

    0. mesh         the plan's DeviceMesh (pp, dp, cp, tp) and this rank's coordinates
    1. pipeline     keep only this rank's stage (units [first, last)): everything after sees
                    only the stage's modules and parameters
    1b. context p.  attention of the stage works on this rank's sequence share (forward
                    wrapped; K/V all-gather or ring); before TP/recompute so they wrap the
                    changed attention, and checkpointed regions re-run its collectives
    1c. expert p.   experts cut to this rank's shard, tokens all-to-all'd to their owners;
                    before TP (which refuses stacked experts) and before the optimizer and
                    DP, which must see the sharded expert parameters
    2. tensor par.  DTensor sharding of the stage's projections (+ sequence parallelism);
                    before recompute, so checkpointed regions re-run the sharded code
    3. recompute    checkpoint wrappers around units; before FSDP, so FSDP's per-unit
                    all-gathers happen inside the recomputed region's own forward
    4. compile      not applied (torch.compile costs minutes on small CPUs; plans carry no
                    compile decision yet)
    5. data par.    DDP / FSDP2 on the dp axis, last: it must see the final parameters
                    (DTensors from step 2) and wraps the checkpointed units from step 3.
                    With cp > 1 the axis is dp x cp (cp ranks hold different tokens of the
                    same sequences); expert parameters are left to EP's own reduction over
                    the ranks holding the same shard
    6. optimizer    built by the caller's factory over the final (sharded) parameters
    7. schedule     torch.distributed.pipelining around the wrapped stage

Semantics of `Runner.step(inputs, targets)`: `inputs`/`targets` hold the *global* batch
(`plan.global_batch` rows, the same on every rank) or this dp replica's share
(`global_batch / dp` rows); each dp replica takes its rows, splits them into the plan's
micro-batches, and the returned loss is the mean over the global batch, identical on every
rank. `loss_fn(outputs, targets)` must return the mean loss of one micro-batch.
With cp > 1 each cp rank takes its share of every sequence (inputs and targets alike,
`context_parallel.sequence_positions`), so `loss_fn` sees this rank's tokens only and the
cp ranks' losses are averaged (equal token counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.tensor import DTensor

from .context_parallel import ContextParallel, apply_context_parallel
from .data_parallel import apply_data_parallel, gradient_sync
from .errors import RuntimePlanError
from .expert_parallel import ExpertParallel, apply_expert_parallel
from .mesh import RankContext, build_mesh, data_parallel_context
from .pipeline_parallel import build_schedule, stage_module
from .recompute import apply_recompute
from .tensor_parallel import apply_tensor_parallel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

# Name pieces wrappers add, removed to give the user's parameter names back.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def check_model(model: nn.Module, plan: Plan) -> None:
    """Fail with one line when `model` is not the model the plan's units describe."""
    for stage in plan.stages:
        if len({n for _, n in stage.microbatches}) > 1:
            raise RuntimePlanError(
                f"runtime: stage {stage.index} gives device groups different micro-batch "
                f"counts ({dict(stage.microbatches)}); uneven data-parallel shares are planned "
                "but not executed yet: re-plan with one GPU type per stage or pin dp"
            )
    missing = []
    for unit in plan.model.units:
        if unit.startswith("<"):
            continue
        try:
            model.get_submodule(unit)
        except AttributeError:
            missing.append(unit)
    if missing:
        raise RuntimePlanError(
            f"runtime: the model has no module {missing[0]!r} ({len(missing)} plan units "
            f"missing); the plan was made for {plan.model.name!r}"
        )
    n = sum(p.numel() for p in model.parameters())
    if plan.model.num_params and n != plan.model.num_params:
        raise RuntimePlanError(
            f"runtime: the model has {n:,} parameters but the plan's model "
            f"{plan.model.name!r} has {plan.model.num_params:,}"
        )


def stage_unit_paths(plan: Plan, stage_index: int) -> list[str]:
    """Module paths of the repeated units that stage `stage_index` runs."""
    s = plan.stages[stage_index]
    return [u for u in plan.model.units[s.first_unit : s.last_unit] if not u.startswith("<")]


class Runner:
    """A model prepared for one plan on this rank; `step` trains one global batch."""

    def __init__(
        self,
        ctx: RankContext,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        schedule=None,
        cp: ContextParallel | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        self.ctx, self.module, self.optimizer, self.loss_fn = ctx, module, optimizer, loss_fn
        self.schedule = schedule
        self.cp, self.ep = cp, ep
        p = ctx.plan.parallel
        self.dp, self.dp_rank = ctx.size("dp"), ctx.coord("dp")
        self.n_microbatches = p.num_microbatches
        self.global_batch = p.global_batch

    # -- one step -------------------------------------------------------------------------
    def _local(self, x: torch.Tensor, what: str) -> torch.Tensor:
        rows = x.shape[0]
        share = self.global_batch // self.dp
        if rows == self.global_batch:
            x = x[self.dp_rank * share : (self.dp_rank + 1) * share]
        elif rows != share:
            raise RuntimePlanError(
                f"runtime: {what} has {rows} rows; the plan's global batch is "
                f"{self.global_batch} ({share} per dp replica)"
            )
        if self.cp is not None:
            x = self.cp.shard(x, dim=1)
        return x.to(self.ctx.device)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and optimizer step on one global batch; the global mean loss."""
        x, y = self._local(inputs, "inputs"), self._local(targets, "targets")
        if self.schedule is None:
            local = self._accumulate(x, y)
        else:
            local = self._pipeline(x, y)
        if self.ep is not None:
            self.ep.finish_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._global_mean(local)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        n = self.n_microbatches
        if x.shape[0] % n:
            raise RuntimePlanError(
                f"runtime: {x.shape[0]} rows do not split into {n} micro-batches"
            )
        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(n), y.chunk(n))):
            with gradient_sync(self.module, enabled=i == n - 1):
                loss = self.loss_fn(self.module(xi), yi) / n
                loss.backward()
            total += float(_local_value(loss))
        return total

    def _pipeline(self, x: torch.Tensor, y: torch.Tensor) -> float:
        ctx = self.ctx
        losses: list[torch.Tensor] = []
        args = (x,) if ctx.is_first_stage else ()
        target = y if ctx.is_last_stage else None
        self.schedule.step(*args, target=target, losses=losses)
        if not ctx.is_last_stage:
            return 0.0
        return float(sum(float(_local_value(v)) for v in losses) / len(losses))

    def _global_mean(self, local: float) -> float:
        """Every dp replica's last stage contributes its loss once (tp peers hold copies; cp
        peers each hold the mean over their share of the tokens)."""
        ctx = self.ctx
        contributes = ctx.is_last_stage and ctx.coord("tp") == 0
        t = torch.tensor([local if contributes else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / (self.dp * ctx.size("cp"))

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the user's names, on rank 0 (others get `{}`).

        Every rank must call it (it gathers DTensor shards and pipeline stages).
        """
        ctx = self.ctx
        mine: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters():
            if self.ep is not None and self.ep.owns(p):
                t = self.ep.full_tensor(p)  # expert shards gathered over the ep group
            else:
                t = p.full_tensor() if isinstance(p, DTensor) else p
            mine[clean_name(name)] = t.detach().cpu().clone()
        holder = ctx.coord("dp") == 0 and ctx.coord("tp") == 0 and ctx.coord("cp") == 0
        gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine if holder else None, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}
        out: dict[str, torch.Tensor] = {}
        for part in gathered or []:
            if part:
                out.update(part)
        return dict(sorted(out.items()))


def clean_name(name: str) -> str:
    """The user's parameter name behind wrapper prefixes (DDP, checkpointing, compile)."""
    if name.startswith("module."):
        name = name[len("module.") :]
    for piece in _WRAPPER_PREFIXES:
        name = name.replace(piece, "")
    return name


def _local_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()


def apply(
    model: nn.Module,
    plan: Plan,
    loss_fn: LossFn,
    optimizer_factory: OptimizerFactory,
    *,
    device: torch.device | None = None,
    cp_attention: str = "allgather",
    ep_dispatch: str = "tokens",
) -> Runner:
    """Prepare `model` to train under `plan` on this rank (see the module docstring).

    Call inside an initialised process group (`meshplan launch`, torchrun or
    `meshplan.runtime.run_local`) with the same model (same seed) on every rank. The model is
    changed in place (sharded, wrapped); use the returned Runner from then on.
    `cp_attention` ("allgather" or "ring") and `ep_dispatch` ("tokens" or "slots") choose
    how context and expert parallelism communicate (`context_parallel`, `expert_parallel`).
    """
    ctx = build_mesh(plan, device)  # 0
    check_model(model, plan)
    p = plan.parallel
    module = model
    units = stage_unit_paths(plan, ctx.stage_index)
    if ctx.num_stages > 1:  # 1
        module = stage_module(model, plan, ctx.stage_index)
    module.to(ctx.device)
    cp = apply_context_parallel(module, ctx, cp_attention)  # 1b (None when cp == 1)
    ep = apply_expert_parallel(module, ctx, ep_dispatch)  # 1c (None when ep == 1)
    if (p.tp or 1) > 1:  # 2
        apply_tensor_parallel(module, plan, ctx.submesh("tp"))
    apply_recompute(module, plan, units)  # 3
    if ep is not None:
        ep.ignore_in_ddp(module)  # names as DDP will see them (after recompute wrappers)
    module = apply_data_parallel(module, data_parallel_context(ctx), units)  # 5
    optimizer = optimizer_factory(module.parameters())  # 6
    schedule = None
    if ctx.num_stages > 1:  # 7
        schedule = build_schedule(module, ctx, loss_fn, p.num_microbatches)
    return Runner(ctx, module, optimizer, loss_fn, schedule, cp=cp, ep=ep)
