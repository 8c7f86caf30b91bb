"""The plan's training precision, applied (`Plan.precision`; `ir.cluster.PRECISIONS`).

The planner priced the step in one precision; the runtime makes the ranks train in it or
refuses in one line before any collective:

    fp32   float32 parameters; matmuls and convolutions with TF32 off
           (`torch.backends.cuda.matmul.allow_tf32 = False`, PyTorch's default for matmuls;
           `torch.backends.cudnn.allow_tf32` too, whose default is on)
    tf32   float32 parameters; TF32 on for both
    bf16   bfloat16 parameters (the zoo and HF models built in bf16)
    fp16   float16 parameters
    fp8    bfloat16 parameters and float8 linear layers: torchao's `convert_to_float8_training`
           (tensorwise scaling, as torchtitan runs it), on CUDA only

The model's parameters must already be in the precision's dtype (build it so, or
`model.to(dtype)`): converting them here would hand the optimizer other tensors than the
user's. Plans written before precision was recorded ("") are run as the model is.

bf16, fp16 and fp8 are mixed precision, as the planner prices them (`cost_model.memory.MIXED`:
2 + 2 + 12 bytes a parameter) and as the published stacks train: the optimizer steps fp32
master copies of the 16-bit parameters (`with_master_weights`; Micikevicius et al. 2018, "Mixed
Precision Training", section 3.1). Without them `torch.optim.AdamW` would keep its states in
bf16 and drop updates smaller than a bf16 ulp of the weight; meshplan's first H100 / H200
steps (session 22, docs/op_latency.md) ran that way and held 8 bytes a parameter where the
plan priced 16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import RuntimePlanError

_DTYPE = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}


def precision_problem(model: nn.Module, plan: Plan, device: torch.device) -> str:
    """Why this rank cannot train `model` in the plan's precision, or ""."""
    precision = plan.precision
    if not precision:
        return ""
    want = _DTYPE[precision]
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if floats and floats != {want}:
        have = ", ".join(sorted(str(d).removeprefix("torch.") for d in floats))
        return (
            f"the plan trains in {precision} but the model's parameters are {have}: build the "
            f"model in {str(want).removeprefix('torch.')} (model.to({want})) or plan with "
            f"--precision matching it"
        )
    if precision == "fp8":
        if device.type != "cuda":
            return "the plan trains in fp8 (float8 linears), which needs CUDA GPUs; plan with bf16"
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            return "the plan trains in fp8: install torchao (float8 training), or plan with bf16"
    return ""


def apply_precision(model: nn.Module, plan: Plan, device: torch.device) -> None:
    """Set this rank up for the plan's precision (module docstring), or refuse in one line."""
    if why := precision_problem(model, plan, device):
        raise RuntimePlanError(f"runtime: {why}")
    if plan.precision in ("fp32", "tf32"):
        on = plan.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
    elif plan.precision == "fp8":  # pragma: no cover - CUDA and torchao only
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)


# Plan precisions whose 16-bit parameters the optimizer steps through fp32 masters.
MIXED_PRECISIONS = frozenset({"bf16", "fp16", "fp8"})


def with_master_weights(
    params: Iterable[nn.Parameter],
    factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    """The caller's optimizer, built over fp32 master copies of `params`, with two step hooks:
    before its step every parameter's gradient is cast into its master's `.grad` (and the
    16-bit gradient freed), after it every parameter is set to its master rounded to the
    parameter's dtype. What is returned is the caller's own optimizer (LR schedulers, hooks and
    `state_dict` work as usual); `optimizer.meshplan_masters` holds the (parameter, master)
    pairs. A master has its parameter's layout (a DTensor's placements included: FSDP2 / TP
    shards keep their shards), so the masters and the optimizer states are sharded wherever
    the parameters are. During the step the fp32 gradients replace the 16-bit ones: 2 bytes a
    parameter above the 2 + 2 + 12 the plan prices, for the step's duration."""
    unique: dict[int, nn.Parameter] = {}  # a tied parameter listed twice gets one master
    for p in params:
        if p.requires_grad:
            unique.setdefault(id(p), p)
    params = list(unique.values())
    masters = [nn.Parameter(p.detach().to(torch.float32), requires_grad=True) for p in params]
    optimizer = factory(by_kind(masters))
    given = {id(q) for group in optimizer.param_groups for q in group["params"]}
    if given != {id(m) for m in masters}:
        raise RuntimePlanError(
            "runtime: the optimizer factory must build its optimizer over the parameters it is "
            "given (fp32 master copies under the plan's mixed precision), not the model's; or "
            "pass apply(..., master_weights=False) to step the 16-bit parameters themselves"
        )
    pairs = tuple(zip(params, masters))

    @torch.no_grad()
    def cast_in(_optimizer, _args, _kwargs) -> None:
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def copy_out(_optimizer, _args, _kwargs) -> None:
        for p, m in pairs:
            p.copy_(m)
            m.grad = None

    optimizer.register_step_pre_hook(cast_in)
    optimizer.register_step_post_hook(copy_out)
    optimizer.meshplan_masters = pairs
    return optimizer


def make_optimizer(
    params: list[nn.Parameter],
    factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    plan: Plan,
    master_weights: bool | None = None,
) -> torch.optim.Optimizer:
    """The optimizer the runner steps: the caller's over fp32 masters (`with_master_weights`)
    when the plan trains in mixed precision and some parameter is 16-bit (`master_weights`:
    None decides so, False keeps the caller's optimizer over the parameters as they are)."""
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if master_weights is None:
        master_weights = plan.precision in MIXED_PRECISIONS and low
    return with_master_weights(params, factory) if master_weights else factory(by_kind(params))


def by_kind(params: list[nn.Parameter]) -> list[nn.Parameter] | list[dict]:
    """`params` as given, or, where DTensors (TP / FSDP2 shards) and plain tensors (what TP
    leaves replicated) are mixed, as two parameter groups of one kind each: a foreach or
    fused optimizer step (the CUDA default of SGD, Adam and AdamW) refuses a list that mixes
    them ("got mixed torch.Tensor and DTensor"), and it runs once per group."""
    dt = [p for p in params if isinstance(p, DTensor)]
    if not dt or len(dt) == len(params):
        return params
    return [{"params": dt}, {"params": [p for p in params if not isinstance(p, DTensor)]}]
