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
"""

from __future__ import annotations

import torch
from meshplan.ir.plan import Plan
from torch import nn

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
