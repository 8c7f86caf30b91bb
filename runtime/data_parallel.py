"""Data parallelism by ZeRO stage: DDP or FSDP2 over the plan's dp axis.

How the plan's ZeRO stage maps onto torch (honestly: torch has no separate ZeRO-1/2):

    zero=0  DistributedDataParallel (gradients all-reduced in buckets). With tensor
            parallelism the parameters are DTensors, which DDP does not take; the FSDP2-based
            `replicate()` does the same all-reduce on the dp axis instead (also under the
            zero-bubble schedule, see `apply_data_parallel`).
    zero=1  FSDP2 `fully_shard(reshard_after_forward=False)`: parameters, gradients and
    zero=2  optimizer states are sharded between steps; the parameters stay gathered from
            forward to the end of backward, so per micro-batch there is one all-gather and
            one reduce-scatter, as ZeRO-2 has. ZeRO-1 (only optimizer states sharded) is
            approximated by the same: it holds less memory than the plan assumed, never more.
    zero=3  FSDP2 `fully_shard(reshard_after_forward=True)`: parameters re-gathered for
            backward (two all-gathers and one reduce-scatter per unit and micro-batch).

FSDP2 wraps each repeated unit (transformer layer) and then the root, so communication is
per layer and overlaps with compute.
"""

from __future__ import annotations

import contextlib
import inspect

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .mesh import RankContext

# torch 2.13 renamed `broadcast_buffers`; the new flag still syncs once at construction.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_data_parallel(
    module: nn.Module,
    ctx: RankContext,
    unit_paths: list[str],
    *,
    ignored: set[nn.Parameter] | None = None,
    split_backward: bool = False,
) -> nn.Module:
    """Wrap `module` for the plan's dp degree and ZeRO stage (see module docstring).

    `ignored` parameters (expert shards, reduced by expert parallelism over their own
    replicas) stay out of FSDP (`fully_shard(ignored_params=...)`); DDP is told by name
    beforehand (`ExpertParallel.ignore_in_ddp`). `split_backward` (zero-bubble schedules,
    which run the input and the weight gradients as separate passes) uses `replicate()` for
    zero=0: torch's pipeline stage drives FSDP2-style modules through split backwards, while
    its DDP path arms the reducer on the wrong pass (measured: gradients off by ~1e-2).
    """
    plan = ctx.plan
    if (plan.parallel.dp or 1) == 1:
        return module
    zero = plan.parallel.zero or 0
    dp_mesh = ctx.submesh("dp")
    if zero == 0:
        if has_dtensor_params(module) or split_backward:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            return replicate(module, mesh=dp_mesh)
        # Buffers are not re-broadcast every forward: they start equal (same seed on every
        # rank, as FSDP2 also assumes) and FSDP2 does not broadcast them either.
        return DistributedDataParallel(module, process_group=ctx.group("dp"), **_NO_BUFFER_SYNC)
    reshard = zero == 3
    ignored = set(ignored or ())
    for path in unit_paths:
        unit = module.get_submodule(path)
        mine = {p for p in unit.parameters() if p in ignored}
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=mine or None)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    return module


def gradient_sync(module: nn.Module, enabled: bool, *, keep_gathered: bool = False):
    """A context in which backward does (or skips) the dp gradient reduction.

    Used for gradient accumulation over micro-batches: only the last one reduces. With
    `keep_gathered` (ZeRO-1/2) FSDP also keeps the parameters gathered after a backward that
    does not reduce, so a step runs one all-gather and one reduce-scatter whatever its number
    of micro-batches (as ZeRO-1/2 are priced, and as replicas with uneven micro-batch shares
    need: their collectives must pair up).
    """
    if isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    if isinstance(module, FSDPModule) or hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(enabled)
        if keep_gathered and hasattr(module, "set_reshard_after_backward"):
            module.set_reshard_after_backward(enabled)
    return contextlib.nullcontext()
