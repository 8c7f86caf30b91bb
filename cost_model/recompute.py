"""Selective-recomputation policies: which outputs a transformer layer keeps for backward.

`Recompute.SELECTIVE` means different things in different training stacks. The cost model
prices three documented policies (none fitted to a run):

- `keep_linear` (the default; meshplan's runtime and Megatron-LM): keep each layer's input
  and the outputs of its linear layers, fused attention and experts; recompute the rest
  (norms, activations, RoPE, an unfused attention's scores/softmax/dropout). On an unfused
  attention this is Korthikanti et al.'s (2022) selective recomputation of the attention core.
  `meshplan.cost_model.compute.kept_by_selective` is this policy.
- `torchtitan_op` (torchtitan `activation_checkpoint.mode = "selective"`,
  `selective_ac_option = "op"`, its default; `torchtitan/models/llama3/parallelize.py`
  `_apply_ac_to_transformer_block`): torch's selective activation checkpointing with a policy
  that saves the outputs of the ops in `_save_list` (`aten.mm`, the SDPA kernels, and the
  TP reduce-scatter) *except every second `aten.mm`*: the counter restarts for each layer's
  forward (`context_fn` builds a fresh `meta` per call), so the 1st, 3rd, 5th ... linear
  layers of a layer are kept and the 2nd, 4th ... recomputed (Llama: wq, wv, w1, w2 kept;
  wk, wo, w3 recomputed). Everything else is recomputed in backward. Expert (grouped) GEMMs
  are kept, like attention (assumption: they are not `aten.mm`).
- `every_other_layer` (torchtitan `selective_ac_option = "2"`, "selective (layer)"): every
  second layer is checkpointed whole (keeps its input, recomputes its forward), the others
  keep everything: per layer on average half of full recomputation and half of none.

`kept_ops(block, policy)` gives the ops whose outputs a layer keeps; memory.py sums their
output bytes and `recompute_forward_time` prices the forward of the others.
"""

from __future__ import annotations

from meshplan.ir import Block, GpuSpec, Op, OpKind

from .compute import kept_by_selective, kernel_floor, roofline_time, splits_with_tp
from .engine import SelectivePolicy

DEFAULT_POLICY = SelectivePolicy.KEEP_LINEAR


def _is_linear(op: Op) -> bool:
    return op.kind == OpKind.MATMUL and bool(op.params)


def kept_ops(block: Block, policy: SelectivePolicy | str) -> frozenset[int]:
    """Indices into `block.ops` whose outputs the policy keeps (per-op policies only)."""
    policy = SelectivePolicy(policy)
    if policy == SelectivePolicy.KEEP_LINEAR:
        return frozenset(i for i, op in enumerate(block.ops) if kept_by_selective(op))
    if policy == SelectivePolicy.TORCHTITAN_OP:
        kept, mm = set(), 0
        for i, op in enumerate(block.ops):
            if _is_linear(op):
                mm += 1
                if mm % 2 == 1:  # torchtitan saves the odd-numbered mm of each layer
                    kept.add(i)
            elif op.kind in (OpKind.ATTENTION, OpKind.EXPERTS):
                kept.add(i)
        return frozenset(kept)
    raise ValueError(f"policy {policy.value!r} is layer-level: it keeps no per-op set")


def recompute_forward_time(
    block: Block,
    gpu: GpuSpec,
    dtype: str,
    policy: SelectivePolicy | str,
    *,
    tp: int,
    cp: int,
    sequence_parallel: bool,
    scale: float,
) -> float:
    """Seconds to recompute the ops a per-op policy does not keep, for one instance of
    `block` at `scale` times the traced micro-batch (the same roofline and sharding rules as
    `compute.BlockCompute.times`)."""
    keep = kept_ops(block, policy)
    r_tp = scale / (tp * cp)
    r_sp = scale / ((tp if sequence_parallel else 1) * cp)
    total = 0.0
    for i, op in enumerate(block.ops):
        if i in keep or not (op.fwd_flops or op.fwd_bytes):
            continue
        r = r_tp if splits_with_tp(op, block.kind) else r_sp
        total += r * roofline_time(op, gpu, dtype) + kernel_floor(op, gpu)
    return total
