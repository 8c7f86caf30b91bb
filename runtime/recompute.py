"""Activation recomputation (checkpointing) where the plan asks for it.

- `full`: every repeated unit (transformer layer) keeps only its input and recomputes the
  rest in backward (Chen et al. 2016).
- `selective`: op-level selective activation checkpointing of every unit (torch's
  `create_selective_checkpoint_contexts`, as torchtitan's `selective_ac_option="op"`), with
  the policy the cost model prices (`meshplan.cost_model.compute.kept_by_selective`): the
  outputs of linear layers (2-D `mm` / `addmm`), of batched matmuls with a parameter operand
  (stacked MoE experts) and of fused attention are kept; everything else (norms,
  activations, RoPE, softmax, an unfused attention's score matmuls) is recomputed in
  backward. Korthikanti et al. (2022) keep the same tensors on a GPT layer and recompute
  the attention core. Collective outputs (DTensor's TP / SP traffic) are kept too, so
  recomputation never repeats communication.

Non-reentrant checkpointing is used: it composes with DTensor, FSDP2 and pipelining. Full
recomputation replays the whole forward, collectives included (`early_stop=False`), as the
cost model prices it and as Megatron-LM's reentrant checkpoint does: torch's default early stop
ends the replay once backward's saved tensors are back, which skips the layer's last
row-parallel reduction (one all-reduce, or reduce-scatter under SP, per layer and micro-batch;
measured in tests/runtime/test_parity_group_tp.py before this was set). Selective
recomputation saves every collective output, so it replays none.
"""

from __future__ import annotations

import functools

import torch
from meshplan.ir.parallel import Recompute
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .mesh import RankContext
from .steps import Chunks, Options

_aten = torch.ops.aten
# 2-D matmuls: in a transformer these are the linear layers (F.linear lowers to mm / addmm);
# attention's score and context matmuls are batched (bmm) or fused.
_LINEAR_OPS = frozenset({_aten.mm.default, _aten.addmm.default})
_BATCHED_OPS = frozenset({_aten.bmm.default, _aten.baddbmm.default})
_FUSED_ATTENTION_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)


def _is_parameter(t: object) -> bool:
    """A leaf tensor that requires grad (a parameter), or a view of one."""
    while isinstance(t, torch.Tensor):
        if t.is_leaf and t.requires_grad:
            return True
        t = t._base
    return False


def keep_linear_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy of `Recompute.SELECTIVE`: save linear, expert and fused
    attention outputs, recompute the rest (module docstring)."""
    if op in _LINEAR_OPS or op in _FUSED_ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    if getattr(op, "namespace", "") == "_c10d_functional":
        # Never repeat communication in backward (DTensor's TP/SP collectives): the cost
        # model prices selective recomputation without traffic, as torchtitan's SAC saves
        # its reduce-scatters.
        return CheckpointPolicy.MUST_SAVE
    if op in _BATCHED_OPS and any(_is_parameter(a) for a in args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(parent: nn.Module, name: str, selective: bool = False) -> None:
    # getattr/setattr by child name work for plain modules, ModuleList and ModuleDict alike.
    child = getattr(parent, name)
    kwargs: dict = {"early_stop": False}  # replay the whole forward (module docstring)
    if selective:
        kwargs["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, keep_linear_policy
        )
    setattr(
        parent,
        name,
        checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs),
    )


def apply_checkpointing(chunks: Chunks, ctx: RankContext, options: Options) -> None:
    """Wrap every chunk's units for recomputation in backward as the plan asks (nothing
    without recomputation). After tensor parallelism, so checkpointed regions re-run the
    sharded code; before data parallelism, so FSDP2's per-unit all-gathers happen inside the
    recomputed region's own forward."""
    for chunk in chunks:
        apply_recompute(chunk.module, ctx.plan, list(chunk.units))
    return None


def apply_recompute(model: nn.Module, plan: Plan, unit_paths: list[str]) -> int:
    """Wrap the units at `unit_paths` (paths inside `model`, one module) per the plan; returns
    how many. The runtime's step over a rank's chunks is `apply_checkpointing`."""
    mode = plan.parallel.recompute
    if mode in (None, Recompute.NONE):
        return 0
    count = 0
    for path in unit_paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        _wrap(parent, name, selective=mode == Recompute.SELECTIVE)
        count += 1
    return count
