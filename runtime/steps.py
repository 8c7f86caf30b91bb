"""What every runtime step is given: this rank's model chunks, its context and the options.

`runtime.apply` prepares a model in a fixed order of steps, one per dimension, each
`apply_<dimension>(chunks, ctx, options)` in that dimension's module:

    chunks   `Chunks`: this rank's pipeline chunk-stages (the whole model without a pipeline),
             each with the plan units it holds; a step changes their modules in place
             (data parallelism, which wraps them, returns the wrapped chunks)
    ctx      `mesh.RankContext`: this rank's plan (its device group's view under per-group
             TP), coordinates, mesh and device
    options  `Options`: what the caller of `apply` chose, what was read off the whole model
             before the pipeline cut, and what an earlier step made that a later one needs

A step returns what the runner or a later step needs from it (a handle), or None. Adding a
dimension to the runtime is one module with one such step and one line in `apply`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# (names, pipeline ranks holding a copy) of one weight tied across pipeline stages
# (`pipeline_parallel.tied_across_stages`).
TiedWeight = tuple[tuple[str, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One model chunk this rank runs: a pipeline chunk-stage, or the whole model."""

    index: int  # its chunk-stage number in model order (0 without a pipeline)
    module: nn.Module
    units: tuple[str, ...]  # the plan's repeated units it holds, as paths inside `module`

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"Chunk: index must be >= 0, got {self.index}")
        if not isinstance(self.units, tuple):
            raise TypeError("Chunk: units must be a tuple")


# This rank's chunks, in the order it holds them (`pipeline_parallel.rank_chunks`).
Chunks = tuple[Chunk, ...]


class ExpertShards(Protocol):
    """What data parallelism asks of expert parallelism's handle
    (`expert_parallel.ExpertParallel`): the expert parameters are averaged over their own
    replicas, so DDP and the dense FSDP2 units leave them alone."""

    def owns(self, p: torch.Tensor) -> bool: ...

    def ignore_in_ddp(self, module: nn.Module) -> None: ...

    def shard_over_replicas(self, zero: int) -> None: ...

    def install_coding(self, gradients: tuple[str, int], weights: tuple[str, int]) -> None: ...


class AfterBackward(Protocol):
    """A gradient reduction the runner runs after backward, before the optimizer (coded
    averages, per-group TP's piece-wise average, tied weights' sums)."""

    def finish(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Options:
    """Everything a step reads besides its chunks and the rank's context."""

    # The caller's choices (`apply`'s keywords).
    cp_attention: str = "allgather"  # "allgather", "ring" or "heads" (`context_parallel`)
    ep_dispatch: str = "tokens"  # "tokens" or "slots" (`expert_parallel`)
    # Read off the whole model before the pipeline cut.
    vocab_parallel_loss: bool = False  # the loss runs on vocab-sharded logits (TP)
    reposition: bool = False  # HF decoders get their sequence's positions (SP, CP)
    ties: tuple[TiedWeight, ...] = ()  # weights tied across pipeline stages
    # Made by an earlier step.
    experts: ExpertShards | None = None  # expert parallelism's handle, for data parallelism


def whole_model(module: nn.Module, units: tuple[str, ...] = ()) -> Chunks:
    """`module` as this rank's only chunk (no pipeline), holding `units`."""
    return (Chunk(0, module, tuple(units)),)
