"""Tensor parallelism (Megatron-LM) and sequence parallelism with DTensor.

The plan records a placement on the tp axis for every parameter (`passes.sharding`):
`"<block>:<param path inside the unit>"` for repeated layers, `"prologue:<path>"` /
`"epilogue:<path>"` for the rest. This module reads those placements off the user's modules
by path and chooses torch's parallel styles:

    nn.Linear    weight S(0) (output features)  -> ColwiseParallel
                 weight S(1) (input features)   -> RowwiseParallel
    nn.Embedding weight S(0) (vocabulary)       -> RowwiseParallel (vocab-parallel embedding)
    a module holding a row-parallel projection and column-parallel siblings (attention, MLP)
                                                -> its first input is made a Replicate DTensor
                                                   once (an all-gather under SP)
    leaf modules whose parameters are all R (norms), under sequence parallelism
                                                -> SequenceParallel

Why the region input is converted once: if each column-parallel projection converted its own
local input, backward would all-reduce the input gradient once per projection (three times
for q/k/v). Making the region's input a DTensor lets the partial gradients add up in DTensor
form and be reduced once, as Megatron does and as the cost model prices it.

Column-parallel projections hand local tensors to the module's own code, so the module sees
`heads / tp` heads; attributes that hold head counts (`heads`, `num_heads`, `kv_heads`, ...)
of a region are divided by tp. Code that infers head counts from shapes (`view(b, s, -1, d)`,
as HF Llama does) needs nothing.

The LM head's output is gathered to a Replicate tensor so any loss function works (one
all-gather of the logits per micro-batch, not priced by the cost model; see docs/runtime.md).
"""

from __future__ import annotations

import inspect

import torch
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .errors import RuntimePlanError

# Attribute names models use for head counts (ours, HF, torchtitan, nanoGPT, Megatron).
HEAD_COUNT_ATTRS = (
    "heads",
    "kv_heads",
    "n_heads",
    "n_kv_heads",
    "n_head",
    "num_heads",
    "num_kv_heads",
    "num_key_value_heads",
    "num_attention_heads",
    "n_local_heads",
    "n_local_kv_heads",
)


class RegionInput(ParallelStyle):
    """Make a module's first input a DTensor with `desired` placement (from `given`).

    Unlike `PrepareModuleInput` it needs no list of every input: the first positional
    argument, or the first keyword argument when the module is called by keywords, is the
    activation; everything else passes through.
    """

    def __init__(self, given: tuple, desired: tuple = (Replicate(),)) -> None:
        super().__init__()
        self.given, self.desired = given, desired

    def _convert(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.given, run_check=False)
        if x.placements != self.desired:
            x = x.redistribute(placements=self.desired)
        return x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = _first_param_name(module)

        def hook(_m, args, kwargs):
            if args and isinstance(args[0], torch.Tensor):
                return (self._convert(args[0], device_mesh), *args[1:]), kwargs
            if first in kwargs and isinstance(kwargs[first], torch.Tensor):
                kwargs = dict(kwargs)
                kwargs[first] = self._convert(kwargs[first], device_mesh)
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _first_param_name(module: nn.Module) -> str:
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return ""
    return params[0] if params else ""


def placement_of(name: str, plan: Plan, placements: dict[str, str] | None = None) -> str | None:
    """The plan's tp-axis placement of the parameter with full path `name`, or None."""
    placements = placements if placements is not None else dict(plan.placements)
    for unit in plan.model.units:
        if not unit.startswith("<") and name.startswith(unit + "."):
            rel = name[len(unit) + 1 :]
            found = {
                v
                for k, v in placements.items()
                if k.split(":", 1)[1] == rel and k.split(":", 1)[0] not in ("prologue", "epilogue")
            }
            if len(found) > 1:
                raise RuntimePlanError(
                    f"runtime: parameter {name!r} has conflicting placements {sorted(found)}"
                )
            return found.pop() if found else None
    return placements.get(f"prologue:{name}") or placements.get(f"epilogue:{name}")


def _in_unit(name: str, plan: Plan) -> bool:
    return any(
        not u.startswith("<") and (name == u or name.startswith(u + ".")) for u in plan.model.units
    )


def tp_styles(model: nn.Module, plan: Plan) -> tuple[dict[str, ParallelStyle], dict[str, int]]:
    """The parallel style of every module path, and the head-count modules to localise.

    Pure: reads module types and the plan's placements, changes nothing. Module paths are
    those of `model` (the whole model or a pipeline stage keeping the model's names).
    """
    sp = bool(plan.parallel.sequence_parallel)
    tp = plan.parallel.tp or 1
    seq = (Shard(1),) if sp else (Replicate(),)
    placements = dict(plan.placements)
    if not placements:
        raise RuntimePlanError(
            f"runtime: the plan has tp={tp} but records no parameter placements; re-plan"
        )
    styles: dict[str, ParallelStyle] = {}
    kinds: dict[str, str] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            p = placement_of(f"{path}.weight", plan, placements)
            if p is None or p == "R":
                continue
            inside = _in_unit(path, plan)
            if isinstance(mod, nn.Embedding):
                if p != "S(0)":
                    raise RuntimePlanError(f"runtime: embedding {path!r} placement {p} unsupported")
                styles[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq[0])
                kinds[path] = "embed"
            elif p == "S(0)":
                kinds[path] = "col"
                styles[path] = (
                    ColwiseParallel()  # input arrives as a Replicate DTensor (RegionInput)
                    if inside
                    else ColwiseParallel(input_layouts=seq[0], output_layouts=Replicate())
                )
            elif p == "S(1)":
                kinds[path] = "row"
                styles[path] = RowwiseParallel(output_layouts=seq[0])
            else:
                raise RuntimePlanError(f"runtime: placement {p} of {path}.weight unsupported")
        elif not isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            own = [(n, p) for n, p in mod.named_parameters(recurse=False)]
            for n, _ in own:
                p = placement_of(f"{path}.{n}" if path else n, plan, placements)
                if p not in (None, "R"):
                    raise RuntimePlanError(
                        f"runtime: tensor parallelism of {type(mod).__name__} parameter "
                        f"{path}.{n} ({p}) is not supported (e.g. stacked expert weights: "
                        "use expert parallelism)"
                    )
            children_have_params = any(any(True for _ in c.parameters()) for c in mod.children())
            if sp and own and not children_have_params and all(p.dim() == 1 for _, p in own):
                styles[path] = SequenceParallel()
    # Regions: parents of a row-parallel projection that also hold column-parallel ones.
    heads: dict[str, int] = {}
    for path, kind in list(kinds.items()):
        if kind != "row" or "." not in path:
            continue
        parent = path.rsplit(".", 1)[0]
        siblings = [p for p, k in kinds.items() if k == "col" and p.rsplit(".", 1)[0] == parent]
        if not siblings:
            continue
        styles[parent] = RegionInput(seq)
        heads[parent] = tp
    return styles, heads


def localise_head_counts(model: nn.Module, modules: dict[str, int]) -> None:
    """Divide head-count attributes of the given modules by tp (see module docstring)."""
    for path, tp in modules.items():
        mod = model.get_submodule(path)
        for attr in HEAD_COUNT_ATTRS:
            v = getattr(mod, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                if v % tp:
                    raise RuntimePlanError(
                        f"runtime: {path}.{attr}={v} is not divisible by tp={tp}"
                    )
                setattr(mod, attr, v // tp)


def apply_tensor_parallel(model: nn.Module, plan: Plan, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` in place over `tp_mesh` following the plan's placements."""
    styles, heads = tp_styles(model, plan)
    if not styles:
        raise RuntimePlanError(
            "runtime: tp > 1 but no module of the model matches the plan's placements "
            f"(units {plan.model.units[:3]}...); is this the model the plan was made for?"
        )
    parallelize_module(model, tp_mesh, styles)
    localise_head_counts(model, heads)
    return model
