"""Activation recomputation (checkpointing) where the plan asks for it.

- `full`: every repeated unit (transformer layer) keeps only its input and recomputes the
  rest in backward (Chen et al. 2016).
- `selective`: only the attention sub-module of each unit is recomputed (Korthikanti et al.
  2022 recompute the attention core; the sub-module is the finest grain torch can wrap
  without editing the user's forward). Found by name: the child whose name contains `attn`
  or `attention`; units without one fall back to full recomputation.

Non-reentrant checkpointing is used: it composes with DTensor, FSDP2 and pipelining.
"""

from __future__ import annotations

from meshplan.ir.parallel import Recompute
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)


def _wrap(parent: nn.Module, name: str) -> None:
    # getattr/setattr by child name work for plain modules, ModuleList and ModuleDict alike.
    child = getattr(parent, name)
    setattr(parent, name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def apply_recompute(model: nn.Module, plan: Plan, unit_paths: list[str]) -> int:
    """Wrap the units at `unit_paths` (paths inside `model`) per the plan; returns how many."""
    mode = plan.parallel.recompute
    if mode in (None, Recompute.NONE):
        return 0
    count = 0
    for path in unit_paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        unit = model.get_submodule(path)
        if mode == Recompute.SELECTIVE:
            attn = [n for n, _ in unit.named_children() if "attn" in n or "attention" in n.lower()]
            if attn:
                for n in attn:
                    _wrap(unit, n)
                count += 1
                continue
        _wrap(parent, name)
        count += 1
    return count
