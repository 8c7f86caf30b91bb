"""Per-aten-op cost facts for the tracer: FLOPs, bytes moved, and which ops are metadata only.

FLOP convention (the one `meshplan.ir.trace` writes into `Op.fwd_flops` / `Op.bwd_flops`):
exactly what `torch.utils.flop_counter.FlopCounterMode` would count, i.e. only matmul-class
ops (mm, addmm, bmm, baddbmm, convolution, the fused attention kernels) at 2 FLOPs per
multiply-add. Elementwise ops, norms, softmax and reductions count zero FLOPs; their cost is
memory traffic, which `op_bytes` measures. The convention is kept strict so that the traced
totals can be checked against FlopCounterMode and so that MFU computed from them matches the
usual "model FLOPs" bookkeeping.

Three kernels that FlopCounterMode does not know get formulas here, in its own convention:

- `aten._scaled_dot_product_flash_attention_for_cpu` (+ backward): the attention op a CPU-only
  torch dispatches to (and so the one fake CPU tensors record). Forward uses flop_counter's
  `sdpa_flop_count` (2 bmm: QK^T and PV), backward its `sdpa_backward_flop_count` (5 bmm:
  flash attention recomputes QK^T, so backward = 2.5x forward). Causal attention is *not*
  halved, as in flop_counter; the tracer records `("causal", True)` so a cost model can.
- `aten._grouped_mm`: the grouped GEMM of MoE experts (each row meets exactly one expert).

Bytes are an HBM-traffic proxy: the sum of the sizes of every tensor an op reads and writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import torch
from torch.utils import flop_counter

aten = torch.ops.aten

# Ops that only create a new view / alias / query of existing tensor metadata. Views are found
# from the schema (a returned alias that is not written); these are the ones the schema does
# not flag. They move no bytes and do no FLOPs, so the tracer folds them into neighbours.
_EXTRA_METADATA_OPS: frozenset[str] = frozenset(
    {
        "prim.device",
        "prim.layout",
        "aten._unsafe_view",  # a view whose result does not alias in the schema
        "aten.lift_fresh",
        "aten.empty",  # allocation without a write: no traffic
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.resolve_conj",
        "aten.resolve_neg",
        "aten.sym_size",
        "aten.sym_stride",
        "aten.sym_numel",
        "aten.sym_storage_offset",
        "aten.size",
        "aten.stride",
        "aten.numel",
        "aten.dim",
        "aten.is_contiguous",
        "aten.is_same_size",
        "aten.is_non_overlapping_and_dense",
        "aten.storage_offset",
        "aten._has_compatible_shallow_copy_type",
    }
)

# The fused attention kernels. The CPU one is what fake CPU tensors dispatch to.
ATTENTION_TARGETS: frozenset[str] = frozenset(
    {
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
        "aten.scaled_dot_product_attention",
    }
)


def packet_name(func: torch._ops.OpOverload) -> str:
    """The overload packet of an aten op as a string, e.g. `aten.mm` for `aten.mm.default`."""
    return str(func._overloadpacket)


@cache
def is_metadata_op(func: torch._ops.OpOverload) -> bool:
    """True for ops that only alias or query tensor metadata (views, detach, prim.device, ...).

    Cached per overload: the tracer asks this for every dispatched op.
    """
    if packet_name(func) in _EXTRA_METADATA_OPS:
        return True
    schema = func._schema
    if not schema.returns:
        return False
    for ret in schema.returns:
        info = ret.alias_info
        # A returned alias that is written to is an in-place op (add_): real traffic.
        if info is None or info.is_write:
            return False
    return True


def iter_tensors(obj: object) -> Iterator[torch.Tensor]:
    """The tensors in an op's args/kwargs/outputs (tuples, lists and dicts, one level deep each)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (tuple, list)):
                for y in x:
                    if isinstance(y, torch.Tensor):
                        yield y
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x)


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor addresses (not of its whole storage)."""
    return t.numel() * t.element_size()


def op_bytes(args: tuple, kwargs: dict, out: object) -> int:
    """HBM-traffic proxy of one op: bytes of every tensor input plus every tensor output."""
    total = 0
    for t in iter_tensors(args):
        total += tensor_nbytes(t)
    for t in iter_tensors(kwargs):
        total += tensor_nbytes(t)
    for t in iter_tensors(out):
        total += tensor_nbytes(t)
    return total


# -- FLOP formulas flop_counter lacks (same convention) -------------------------------------
def _cpu_flash_fwd_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_bwd_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(
        grad_out.shape, query.shape, key.shape, value.shape
    )


def _grouped_mm_flops(self, mat2, *args, out_val=None, **kwargs) -> int:
    # Every output element is one K-long dot product. The 2-D x 2-D form (weight gradients)
    # returns one (M, N) matrix per group whose contractions split K between groups, so
    # divide the group count back out.
    k = self.shape[-1]
    n_out = out_val.numel()
    if self.dim() == 2 and mat2.dim() == 2:
        n_out //= max(out_val.shape[0], 1)
    return 2 * n_out * k


_EXTRA_FLOPS = {
    "aten._scaled_dot_product_flash_attention_for_cpu": _cpu_flash_fwd_flops,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": _cpu_flash_bwd_flops,
    "aten._grouped_mm": _grouped_mm_flops,
}


@cache
def _flop_formula(func: torch._ops.OpOverload):
    packet = func._overloadpacket
    if packet in flop_counter.flop_registry:
        return flop_counter.flop_registry[packet]
    return _EXTRA_FLOPS.get(str(packet))


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """FLOPs of one aten op in FlopCounterMode's convention (0 for non-matmul-class ops)."""
    formula = _flop_formula(func)
    if formula is None:
        return 0
    # Registry formulas are wrapped by flop_counter.shape_wrapper and ours read `.shape`
    # themselves, so both take the op's own arguments.
    return int(formula(*args, **kwargs, out_val=out))
