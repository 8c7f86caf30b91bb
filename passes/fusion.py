"""Fusion regions of a layer: the chains of memory-bound ops one fused kernel runs.

Pass: `fusion_regions(block) -> tuple[FusedRegion, ...]`
Requires: a Block in execution order (the tracer's op order).
Ensures: every op of a *layer* block whose kind is fusable (`FUSABLE_KINDS`) belongs to exactly
  one region, a maximal run of consecutive fusable ops; GEMMs, attention, experts, embeddings,
  losses and MoE routing end a region and are never in one. Prologue and epilogue blocks get
  no regions (torchtitan compiles each transformer block, not the embedding or the loss).

What fusion changes is memory traffic: a compiled chain (torch.compile's Inductor, or
Megatron-LM's hand-fused layer-norm, bias-GeLU, scale-mask-softmax and bias-dropout-add
kernels) reads the tensors entering the chain and writes the tensors leaving it once, instead
of every op reading and writing its own operands. So a region's forward bytes are its
external inputs plus its final outputs. Data flow is not in the IR (ops list tensor shapes,
not producers), so an input counts as internal when an earlier op of the region produced a
tensor of the same shape and dtype (documented approximation: a residual stream re-entering a
chain whose intermediate has the hidden-state shape is taken as internal).

Backward of a region: the compiled backward reads the gradient of the region's output and the
region's inputs (AOTAutograd's partitioner saves the inputs and recomputes the cheap
intermediates) and writes the inputs' gradients: output + 2 x inputs bytes (assumption of the
same kind as the forward's).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.ir.graph import Block, Op, OpKind

# Kinds a fusing compiler merges into one kernel per chain.
FUSABLE_KINDS = frozenset(
    {OpKind.NORM, OpKind.SOFTMAX, OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.DATA_MOVEMENT}
)


@dataclass(frozen=True, slots=True)
class FusedRegion:
    """One chain of fusable ops (`ops` are indices into the block's op list) and the bytes
    its fused forward and backward kernels move."""

    ops: tuple[int, ...]
    fwd_bytes: int
    bwd_bytes: int


def _key(t) -> tuple:
    return (t.shape, t.dtype)


def _region(block: Block, idx: list[int]) -> FusedRegion:
    produced: set[tuple] = set()
    external = 0
    for i in idx:
        op: Op = block.ops[i]
        for t in op.inputs:
            if _key(t) not in produced:
                external += t.nbytes
        produced.update(_key(t) for t in op.outputs)
    last = block.ops[idx[-1]]
    out = sum(t.nbytes for t in last.outputs)
    has_bwd = any(block.ops[i].bwd_flops or block.ops[i].bwd_bytes for i in idx)
    return FusedRegion(tuple(idx), external + out, (out + 2 * external) if has_bwd else 0)


def fusion_regions(block: Block) -> tuple[FusedRegion, ...]:
    """The fused regions of `block` (module docstring); empty for a prologue / epilogue."""
    if block.kind != "layer":
        return ()
    regions: list[FusedRegion] = []
    run: list[int] = []
    for i, op in enumerate(block.ops):
        if op.kind in FUSABLE_KINDS and (op.fwd_bytes or op.fwd_flops):
            run.append(i)
            continue
        if op.kind in FUSABLE_KINDS:  # a view: no kernel, does not break the chain
            continue
        if run:
            regions.append(_region(block, run))
            run = []
    if run:
        regions.append(_region(block, run))
    return tuple(regions)


__all__ = ["FUSABLE_KINDS", "FusedRegion", "fusion_regions"]
