"""Per-group precision: low-precision forward matmuls on some replicas, full-precision backward.

QSync (Zhao et al., "QSync: Quantization-Minimized Synchronous Distributed Training Across
Hybrid Devices", IPDPS 2024, arXiv 2407.02327) trains one synchronous data-parallel job over
fast and slow GPUs by giving the slow GPUs' replicas quantized operators, so that every
replica finishes its step at about the same time. Here a plan may give the replicas of a
slower device group a `mode` from `HYBRID_MODES` for the linear layers inside the repeated
transformer units; the runtime makes those linears compute

    y_mn = x_mk W_nk^T + b_n        (m tokens, k inputs, n outputs)

with a low-precision forward GEMM and the exact full-precision backward (a straight-through
estimator: the quantizers count as the identity):

    grad_x_mk = grad_y_mn W_nk      grad_W_nk = grad_y_mn^T x_mk      grad_b_n = sum_m grad_y_mn

computed from the unquantized x and W in their own dtype. Gradients therefore stay full
precision and data parallelism averages them as usual, so every replica keeps bit-identical
parameters; only the forward values of the quantized replicas differ (their loss, and the
activations their backward reads). QSync also quantizes backward operators; this module does not.

Modes:

    int8  per-token activations x per-output-channel weights, symmetric (the vector-wise
          scheme of LLM.int8(), Dettmers et al. 2022, and the token-wise activations of
          ZeroQuant, Yao et al. 2022):
              s_x[m] = max_k |x[m, k]| / 127       q_x = clamp(round(x / s_x), -127, 127)
              s_W[n] = max_k |W[n, k]| / 127       q_W = clamp(round(W / s_W), -127, 127)
              y[m, n] = (sum_k q_x[m, k] q_W[n, k]) s_x[m] s_W[n]  (+ b in x's dtype)
          The integer sum is exact (`int8_matmul`): `torch._int_mm` (int8 x int8 -> int32)
          where it applies, else float64 arithmetic on the integer values. float64 holds
          every partial sum exactly while it stays below 2^53, i.e. for k < 2^53 / 127^2
          (about 5.6e11); float32 is only sure to be exact up to k = 2^24 / 127^2 (about
          1040), which a hidden size of 4096 exceeds. The scaling runs in float32.
    fp8   tensorwise float8_e4m3fn, as torchao's tensorwise float8 recipe (the one
          torchtitan runs): scale = 448 / max |x| (max |x| floored at 1e-12), values
          saturated to +-448 and cast; likewise W with its own scale; the fp8 values are
          multiplied in float32 (each product of two e4m3 values is exact in float32) and the
          sum is divided by both scales, as `torch._scaled_mm` does.

Outputs are in x's dtype; an all-zero row (int8) or tensor (fp8) quantizes to zeros without
dividing by zero. Under `torch.autocast` the inputs are first cast to the autocast dtype, as
autocast casts `F.linear`'s.

What the planner prices for a replica given a mode: each such linear's forward GEMM
(2 m k n flops) at the device's int8 or fp8 peak instead of the training precision's, plus
the quantize work (reading x and W for their maxima and writing their low-precision copies,
scaling the m x n output); the backward GEMMs (4 m k n flops) and the memory held for backward
(the unquantized x and W) unchanged.

What is not done, honestly:

- int8 runs a real integer GEMM only through `torch._int_mm`: on CPU (the pinned torch's
  kernel accumulates in int32 for any shape; the tests hold it to an int64 product up to
  the largest k, `_INT32_MAX_K`), and on CUDA when the shapes pass cuBLAS's int8 rules (more
  than 16 rows, k and n non-zero multiples of 8, as torchao's `safe_int_mm` checks). The CUDA
  path has not been run here: tests/runtime/test_hybrid_precision.py has a `gpu` test that
  compares it with the emulation. Elsewhere the float64 emulation gives the same bits,
  slowly (inference GPUs run float64 at 1/32 to 1/64 of their float32 rate), so the
  planner's int8 price is only met where `_int_mm` runs.
- fp8 is emulated everywhere (cast to float8_e4m3fn, float32 GEMM): the numerics of a
  tensorwise fp8 GEMM, none of its speed. No `torch._scaled_mm` is wired.
- Linears under tensor parallelism (DTensor weights) are not supported: per-group precision
  is for data-parallel replicas; a DTensor weight is refused in one line.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from meshplan.ir.devices import HYBRID_MODES
from torch import nn

from .mesh import RankContext
from .steps import Chunks, Options

__all__ = [
    "FP8_MAX",
    "HYBRID_MODES",
    "INT8_MAX",
    "MODE_ATTR",
    "hybrid_linear",
    "int8_matmul",
    "int8_rows",
    "low_precision_linear",
    "quantize_linears",
]


INT8_MAX = 127  # symmetric: -128 is never used, so q and -q are both representable
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_FP8_AMAX_FLOOR = 1e-12  # torchao's EPS in `amax_to_scale`: an all-zero tensor gets a finite scale
# The largest k whose integer sums fit int32: k * 127^2 <= 2^31 - 1.
_INT32_MAX_K = (2**31 - 1) // INT8_MAX**2

MODE_ATTR = "meshplan_hybrid_precision"  # set on every linear `quantize_linears` changed


def _check_mode(mode: str) -> None:
    if mode not in HYBRID_MODES:
        raise ValueError(f"hybrid precision: mode must be one of {HYBRID_MODES}, got {mode!r}")


# -- int8 -----------------------------------------------------------------------------------


def int8_rows(t_rk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization of a 2-D tensor: (q_rk int8, s_r1 float32) with
    s = max_k |t[r, k]| / 127 and q = clamp(round(t / s), -127, 127) (ties to even); a row
    of zeros gets s = 0 and q = 0."""
    t = t_rk.float()
    s_r1 = t.abs().amax(dim=1, keepdim=True) / INT8_MAX
    q = (t / torch.where(s_r1 == 0, 1.0, s_r1)).round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), s_r1


def _int_mm_applies(qa_mk: torch.Tensor, qb_nk: torch.Tensor) -> bool:
    """Whether `torch._int_mm` computes this product exactly here (module docstring)."""
    m, k = qa_mk.shape
    n = qb_nk.shape[0]
    if k > _INT32_MAX_K or m == 0 or n == 0 or k == 0:
        return False
    if qa_mk.device.type == "cpu":
        return True
    if qa_mk.device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0
    return False


def int8_matmul(
    qa_mk: torch.Tensor, qb_nk: torch.Tensor, *, kernel: bool | None = None
) -> torch.Tensor:
    """The exact integer product sum_k qa[m, k] qb[n, k] of two int8 matrices, as int32 from
    `torch._int_mm` (`kernel=True`, or None where it applies) or as float64 from the
    emulation (`kernel=False`); both hold every sum exactly (module docstring)."""
    if kernel is None:
        kernel = _int_mm_applies(qa_mk, qb_nk)
    if kernel:
        return torch._int_mm(qa_mk.contiguous(), qb_nk.contiguous().t())
    return qa_mk.double() @ qb_nk.double().t()


# The weights' low-precision copies, made once per optimizer step and shared by its
# micro-batches (the weights do not change between them), as the planner prices it
# (`cost_model.compute.weight_quantize_time`, once per step). A copy is made again when the
# weight tensor changes in place (its version counter: an optimizer step), when another tensor
# or storage holds it, and at every `Runner.step` (`new_step`): FSDP2 refills its unsharded
# parameters without bumping their version counter.
_STEP = [0]  # bumped by `new_step`; part of every cached copy's key
_CACHE_ATTR = "_meshplan_low_precision"  # the copy, kept on the weight tensor itself


def new_step() -> None:
    """Forget every cached low-precision weight (a new optimizer step begins). The runtime's
    `Runner.step` calls it at every step; copies are cached only in a process that calls it
    (a training loop of one's own, which may not, quantizes the weights at every call: FSDP2
    can refill a parameter's storage without bumping its version counter)."""
    _STEP[0] += 1


def _cached_weight(w_nk: torch.Tensor, mode: str, quantize):
    if not _STEP[0]:
        return quantize(w_nk)
    key = (_STEP[0], w_nk._version, w_nk.data_ptr(), w_nk.dtype, tuple(w_nk.shape), mode)
    hit = getattr(w_nk, _CACHE_ATTR, None)
    if hit is not None and hit[0] == key:
        return hit[1]
    got = quantize(w_nk)
    setattr(w_nk, _CACHE_ATTR, (key, got))
    return got


def _int8_linear(x_mk: torch.Tensor, w_nk: torch.Tensor) -> torch.Tensor:
    qx, sx_m1 = int8_rows(x_mk)
    qw, sw_n1 = _cached_weight(w_nk, "int8", int8_rows)
    # int32 and float64 hold the same integers, so both paths round alike to float32
    return int8_matmul(qx, qw).float() * sx_m1 * sw_n1.view(1, -1)


# -- fp8 ------------------------------------------------------------------------------------


def _fp8_tensorwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in float8_e4m3fn after scaling, the scale 448 / max|t|), as torchao's tensorwise
    recipe: the scale computed in float64 then stored in float32, values saturated."""
    amax = t.float().abs().amax().double().clamp(min=_FP8_AMAX_FLOOR)
    scale = (FP8_MAX / amax).float()
    t8 = (t.float() * scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return t8, scale


def _fp8_linear(x_mk: torch.Tensor, w_nk: torch.Tensor) -> torch.Tensor:
    x8, sx = _fp8_tensorwise(x_mk)
    w8, sw = _cached_weight(w_nk, "fp8", _fp8_tensorwise)
    return (x8.float() @ w8.float().t()) * (sx.reciprocal() * sw.reciprocal())


_LINEARS = {"int8": _int8_linear, "fp8": _fp8_linear}


# -- the linear op --------------------------------------------------------------------------


def low_precision_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: str
) -> torch.Tensor:
    """The forward values of `hybrid_linear`: x W^T + b with the GEMM in `mode` (module
    docstring), in x's dtype and of shape (*x.shape[:-1], W.shape[0]). Not differentiable
    by itself (use `hybrid_linear`)."""
    _check_mode(mode)
    if hasattr(weight, "_local_tensor"):
        raise TypeError("hybrid precision: the weight is a DTensor (tensor parallelism)")
    if x.dtype != weight.dtype:
        raise TypeError(f"hybrid precision: input is {x.dtype} but the weight is {weight.dtype}")
    n, k = weight.shape
    with torch.autocast(x.device.type, enabled=False):  # float32 GEMMs stay float32
        y = _LINEARS[mode](x.reshape(-1, k), weight).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


class _HybridLinear(torch.autograd.Function):
    """y = x W^T + b: low-precision forward, F.linear's full-precision backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, mode):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return low_precision_linear(x, weight, bias, mode)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g_mn = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        # The same mm calls, in the same order of operands, as F.linear's own backward, so
        # the gradients are bit-identical to it.
        if ctx.needs_input_grad[0]:
            grad_x = g_mn.mm(weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = x.reshape(-1, x.shape[-1]).t().mm(g_mn).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g_mn.sum(0)
        return grad_x, grad_w, grad_b, None


def hybrid_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: str
) -> torch.Tensor:
    """F.linear with its forward GEMM in `mode` ("int8" or "fp8") and its exact backward
    (straight-through: the gradients F.linear gives for the same x, W and grad_y)."""
    _check_mode(mode)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # autocast runs F.linear in its lower dtype
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return _HybridLinear.apply(x, weight, bias, mode)


# -- installing it on a model's linears -----------------------------------------------------


def _hybrid_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # Reads the parameters at call time: FSDP2 swaps in the unsharded ones before forward.
    return hybrid_linear(x, self.weight, self.bias, getattr(self, MODE_ATTR))


def _under(path: str, prefix: str) -> bool:
    """Whether module path `path` is `prefix` or inside it ("layers.1" holds "layers.1.mlp",
    not "layers.10"); "" holds everything."""
    return not prefix or path == prefix or path.startswith(prefix + ".")


def quantize_linears(
    module: nn.Module, mode: str, prefixes: Sequence[str], roles: Sequence[str] = ()
) -> int:
    """Make every `nn.Linear` inside `module` whose path (as in `module.named_modules()`) is
    under one of `prefixes` compute its forward with `hybrid_linear` in `mode`; returns how
    many it changed.

    Give the repeated units' paths (a plan's units without `<prologue>`/`<epilogue>`, e.g.
    "layers.3"), never the embedding's or the LM head's. The linears keep their Parameter
    objects, names and state: only an instance `forward` is set (with the mode in the
    `meshplan_hybrid_precision` attribute), so DDP and FSDP2 wrappers applied before or
    after, optimizers and checkpoints see no change. Linear subclasses that define their own
    forward are left alone, and so are linears their parent never calls (the `out_proj` of
    `nn.MultiheadAttention`, whose weights it reads directly, would count but not change).
    Calling it again sets the new mode. `roles` (`Plan.hybrid_linears`): only the linears
    whose path inside their unit (after "<prefix>.") it names; () = every one."""
    _check_mode(mode)
    if isinstance(prefixes, str):
        raise TypeError("quantize_linears: prefixes must be a sequence of module paths, not a str")
    changed = 0
    for path, m in module.named_modules():
        if not isinstance(m, nn.Linear) or type(m).forward is not nn.Linear.forward:
            continue
        unit = next((p for p in prefixes if _under(path, p)), None)
        if unit is None:
            continue
        if roles and (path[len(unit) + 1 :] if unit else path) not in roles:
            continue
        setattr(m, MODE_ATTR, mode)
        m.forward = types.MethodType(_hybrid_forward, m)
        changed += 1
    return changed


def apply_hybrid_precision(chunks: Chunks, ctx: RankContext, options: Options) -> int:
    """Per-group precision as the plan says (`Plan.hybrid_precision`): when this rank's device
    group has a mode, every linear inside the plan's repeated units of its chunks runs its
    forward in that mode (`quantize_linears`); the others train as they are. Runs after
    tensor parallelism, which a quantized group's replicas do not use (tp 1,
    `ir.plan.hybrid_problem`), and before data parallelism wraps the chunks. Returns how many
    linears it changed on this rank."""
    plan = ctx.whole_plan
    if not plan.hybrid_precision:
        return 0
    group = (ctx.whole_assignment or ctx.assignment).group
    mode = dict(plan.hybrid_precision).get(group)
    if mode is None:
        return 0
    return sum(quantize_linears(c.module, mode, c.units, plan.hybrid_linears) for c in chunks)
