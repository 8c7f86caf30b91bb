"""How much each linear of a model's layers can bear lower precision: a per-linear sensitivity
measured by a short calibration pass on the user's own model and data.

QSync (Zhao et al., "QSync: Quantization-Minimized Synchronous Distributed Training Across
Hybrid Devices", IPDPS 2024) lowers chosen operators on the weaker devices, chosen by a
sensitivity indicator so that accuracy suffers least. Its indicator is derived from the
variance that quantization adds to the gradients. This one measures the effect on the user's
loss directly, which needs nothing but the model, a few batches and its loss:

- a linear is named by its path inside the repeated unit ("attn.q_proj", "mlp.down_proj"),
  the same in every layer (`cost_model.compute.linear_role`, the name the planner and the
  runtime use: `Plan.hybrid_linears`);
- for each such linear, its forward in every layer is lowered to `mode` (int8 per token x per
  output channel, or fp8 tensorwise: the runtime's own kernels, `runtime.hybrid_precision`),
  the mean loss over the calibration batches measured, and the linear restored;
- its sensitivity is the relative increase of that loss over full precision,
  (L_lowered - L) / L. Negative values (quantization noise that happened to help) are kept
  as measured; the planner counts them as 0.

Cost: one forward pass per batch for the baseline and one per linear (7 for a Llama-style
layer), in `torch.no_grad` and eval mode (dropout off); the model's training flag is put back.
`meshplan.plan(..., hybrid_precision="auto", sensitivity=...)` then lowers the linears with
the most FLOPs whose summed sensitivity stays within `max_loss_increase`
(`planner.api.chosen_linears`).

    values = meshplan.measure.linear_sensitivity(model, batches, loss_fn)
    meshplan.measure.save_sensitivity(values, "sens.json")   # meshplan plan --sensitivity sens.json
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from meshplan.runtime.hybrid_precision import MODE_ATTR, quantize_linears
from torch import nn

# Format of the file `save_sensitivity` writes (`--sensitivity`).
SENSITIVITY_FORMAT = "meshplan-linear-sensitivity/1"


def unit_linears(model: nn.Module, units: Sequence[str]) -> list[str]:
    """The paths inside a unit of every `nn.Linear` in the `units` (module paths of the
    repeated layers), in model order, each once."""
    out: list[str] = []
    for unit in units:
        root = model.get_submodule(unit)
        for path, m in root.named_modules():
            if path and isinstance(m, nn.Linear) and path not in out:
                out.append(path)
    return out


def _restore(model: nn.Module) -> None:
    """Undo `quantize_linears`: drop the instance forward and the mode attribute."""
    for m in model.modules():
        if isinstance(m, nn.Linear) and hasattr(m, MODE_ATTR):
            delattr(m, MODE_ATTR)
            m.__dict__.pop("forward", None)


def _mean_loss(model: nn.Module, batches: Sequence, loss_fn: Callable) -> float:
    total = 0.0
    for inputs, targets in batches:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        total += float(loss_fn(model(*args), targets))
    return total / len(batches)


def linear_sensitivity(
    model: nn.Module,
    batches: Iterable[tuple[object, object]],
    loss_fn: Callable[[object, object], torch.Tensor],
    *,
    mode: str = "int8",
    units: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """{linear path inside a layer: relative loss increase with it lowered to `mode` in every
    layer} over `batches` ((inputs, targets) pairs; inputs a tensor or a tuple of the model's
    positional arguments) and `loss_fn(output, targets)`. `units`: the repeated layers'
    module paths; None: those `meshplan.trace` finds on the first batch."""
    batches = list(batches)
    if not batches:
        raise ValueError("linear_sensitivity: give at least one calibration batch")
    if units is None:
        from meshplan.ir.trace import trace

        first = batches[0][0]
        graph = trace(model, *(first if isinstance(first, tuple) else (first,)))
        units = [u.name for u in graph.layer_units]
    if not units:
        raise ValueError(
            "linear_sensitivity: the model has no repeated layers to lower; give units="
        )
    linears = unit_linears(model, units)
    if not linears:
        raise ValueError(f"linear_sensitivity: no nn.Linear inside the layers {list(units)[:3]}")
    was_training = model.training
    model.eval()
    _restore(model)
    out: dict[str, float] = {}
    try:
        with torch.no_grad():
            base = _mean_loss(model, batches, loss_fn)
            if not math.isfinite(base) or base == 0:
                raise ValueError(
                    f"linear_sensitivity: the full-precision loss is {base!r}; a relative "
                    "increase needs a finite, non-zero loss"
                )
            for i, role in enumerate(linears):
                if progress:
                    progress(f"sensitivity {i + 1}/{len(linears)}: {role}")
                quantize_linears(model, mode, list(units), (role,))
                try:
                    out[role] = (_mean_loss(model, batches, loss_fn) - base) / abs(base)
                finally:
                    _restore(model)
    finally:
        model.train(was_training)
    return out


def save_sensitivity(values: dict[str, float], path: str | Path, *, mode: str = "int8") -> None:
    """Write `values` as the JSON `--sensitivity` reads."""
    data = {"format": SENSITIVITY_FORMAT, "mode": mode, "relative_loss_increase": values}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_sensitivity(path: str | Path) -> dict[str, float]:
    """Read a `save_sensitivity` file; one-line ValueError naming the file and the field."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict) or data.get("format") != SENSITIVITY_FORMAT:
        raise ValueError(
            f"{where}: field format: not a {SENSITIVITY_FORMAT} file; write it with "
            "meshplan.measure.save_sensitivity"
        )
    values = data.get("relative_loss_increase")
    if not isinstance(values, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in values.items()
    ):
        raise ValueError(
            f"{where}: field relative_loss_increase: give {{linear path: number}}, got {values!r}"
        )
    return {k: float(v) for k, v in values.items()}
