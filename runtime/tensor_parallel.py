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
    the experts of an MoE of the zoo's shape (`is_zoo_moe`), stacked weights S(1)/S(2)
                                                -> left alone here: the MoE is one TP region
                                                   run by `expert_parallel` (expert TP)

Why the region input is converted once: if each column-parallel projection converted its own
local input, backward would all-reduce the input gradient once per projection (three times
for q/k/v). Making the region's input a DTensor lets the partial gradients add up in DTensor
form and be reduced once, as Megatron does and as the cost model prices it.

Column-parallel projections hand local tensors to the module's own code, so the module sees
`heads / tp` heads; attributes that hold head counts (`heads`, `num_heads`, `kv_heads`, ...)
of a region are divided by tp. Code that infers head counts from shapes (`view(b, s, -1, d)`,
as HF Llama does) needs nothing.

The loss (`vocab_parallel_loss`). When the user's loss is a cross entropy on the logits (a
probe of its aten ops on meta tensors, `is_cross_entropy`), the LM head's output stays sharded
on the vocabulary (a `Shard(-1)` DTensor) and the loss runs under torch's `loss_parallel`:
three all-reduces of one value per token instead of gathering the logits, as Megatron-LM's
`vocab_parallel_cross_entropy` and torchtitan do, and as the cost model prices it
(`cost_model.graph_costs.loss_collectives`). Any other loss function gets the whole logits (one
all-gather per micro-batch, which `loss_collectives(vocab_parallel=False)` prices).

Gradients of replicated parameters under sequence parallelism (norm weights), and of the
MoE router under any TP (`expert_parallel`), come out of backward as partial sums over tp
(`Partial` DTensors): FSDP2 and `replicate` reduce them
before their own reduction; without data parallelism `reduce_partial_gradients` does it once
per step before the optimizer (otherwise every optimizer read of the gradient would
all-reduce it again: three times per parameter with AdamW, measured).
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch
from meshplan.ir.facts import is_zoo_moe, tied_parameters
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import RuntimePlanError
from .mesh import RankContext
from .steps import Chunks, Options

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


class PositionsSequenceShard(ParallelStyle):
    """A table of learned positions under sequence parallelism: its weight replicated on the
    tp mesh, its output (positions x hidden, or batch x positions x hidden) cut to this tp
    rank's share of the sequence (dim -2), the share the vocab-parallel token embedding hands
    on (`Shard(1)`), so the two add as Megatron-LM adds them before scattering the sum. The
    cut is local; its backward all-gathers the output gradient, so every rank computes the
    table's whole gradient (no partial sums to reduce)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name, mod, mesh):
            for n, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def inputs(_mod, args, mesh):
            idx = args[0]
            if not isinstance(idx, DTensor):
                idx = DTensor.from_local(idx, mesh, [Replicate()], run_check=False)
            return (idx, *args[1:])

        def outputs(_mod, out, _mesh):
            return out.redistribute(placements=[Shard(out.ndim - 2)]).to_local()

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def _first_param_name(module: nn.Module) -> str:
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return ""
    return params[0] if params else ""


# Name pieces wrappers add, removed to give the user's parameter names back.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """The user's parameter name behind wrapper prefixes (DDP, checkpointing, compile)."""
    if name.startswith("module."):
        name = name[len("module.") :]
    for piece in _WRAPPER_PREFIXES:
        name = name.replace(piece, "")
    return name


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


def tp_styles(
    model: nn.Module, plan: Plan, *, vocab_parallel_loss: bool = False
) -> tuple[dict[str, ParallelStyle], dict[str, int]]:
    """The parallel style of every module path, and the head-count modules to localise.

    Pure: reads module types and the plan's placements, changes nothing. Module paths are
    those of `model` (the whole model or a pipeline stage keeping the model's names).
    `vocab_parallel_loss`: the LM head (the epilogue's column-parallel projection) hands its
    logits on sharded on the vocabulary, for a loss run under `loss_parallel`.
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
    # Experts of zoo-shaped MoEs: tensor-parallel through `expert_parallel` (one region).
    experts = [
        f"{p}.experts" if p else "experts" for p, m in model.named_modules() if is_zoo_moe(m)
    ]
    # A weight tied to another (an LM head sharing the embedding's) is placed under the name
    # the trace keeps, the first (`named_parameters` drops the repeats).
    canonical = {n: names[0] for names in tied_parameters(model) for n in names[1:]}
    for path, mod in model.named_modules():
        if any(path == e or path.startswith(e + ".") for e in experts):
            continue
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            weight = f"{path}.weight"
            p = placement_of(canonical.get(weight, weight), plan, placements)
            inside = _in_unit(path, plan)
            if isinstance(mod, nn.Embedding) and p == "R" and sp and not inside:
                # A table of learned positions (`passes.sharding` replicates those): its
                # output is added to the sequence-sharded token embedding.
                styles[path] = PositionsSequenceShard()
                continue
            if p is None or p == "R":
                continue
            if isinstance(mod, nn.Embedding):
                if p != "S(0)":
                    raise RuntimePlanError(f"runtime: embedding {path!r} placement {p} unsupported")
                styles[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq[0])
                kinds[path] = "embed"
            elif p == "S(0)":
                kinds[path] = "col"
                head = f"epilogue:{path}.weight" in placements
                if inside:  # input arrives as a Replicate DTensor (RegionInput)
                    styles[path] = ColwiseParallel()
                elif head and vocab_parallel_loss:  # logits stay vocab-sharded DTensors
                    styles[path] = ColwiseParallel(
                        input_layouts=seq[0], output_layouts=Shard(-1), use_local_output=False
                    )
                else:
                    styles[path] = ColwiseParallel(input_layouts=seq[0], output_layouts=Replicate())
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
                        f"runtime: {path}.{n} is a parameter of {type(mod).__name__} with tp "
                        f"placement {p}; the runtime shards only nn.Linear, nn.Embedding and "
                        "the zoo's MoE experts: re-plan with tp=1 (meshplan plans refuse it: "
                        "`ModelInfo.blockers`)"
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


def apply_tensor_parallel(chunks: Chunks, ctx: RankContext, options: Options) -> None:
    """Shard every chunk in place over the tp mesh following the plan's placements, the LM
    head for a vocab-parallel loss where `options.vocab_parallel_loss` (see `tp_styles`);
    nothing when tp == 1. Expert layers are left to expert parallelism, which runs first."""
    if (ctx.plan.parallel.tp or 1) == 1:
        return None
    for chunk in chunks:
        shard_module(
            chunk.module,
            ctx.plan,
            ctx.submesh("tp"),
            vocab_parallel_loss=options.vocab_parallel_loss,
        )
    return None


def shard_module(
    model: nn.Module, plan: Plan, tp_mesh: DeviceMesh, *, vocab_parallel_loss: bool = False
) -> nn.Module:
    """Shard `model` in place over `tp_mesh` following the plan's placements
    (`vocab_parallel_loss`: see `tp_styles`)."""
    styles, heads = tp_styles(model, plan, vocab_parallel_loss=vocab_parallel_loss)
    if not styles:
        raise RuntimePlanError(
            "runtime: tp > 1 but no module of the model matches the plan's placements "
            f"(units {plan.model.units[:3]}...); is this the model the plan was made for?"
        )
    ties = tied_parameters(model)
    parallelize_module(model, tp_mesh, styles)
    _retie(model, ties)
    localise_head_counts(model, heads)
    return model


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Make tied parameters one tensor again after `parallelize_module`, which distributes
    each module's parameter on its own (so a tied embedding and LM head would train as two).
    The vocab-parallel embedding and the column-parallel LM head shard the same (vocab,
    hidden) weight the same way (`Shard(0)`), as Megatron-LM ties them under TP."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            if other is first:
                continue
            same = type(first) is type(other) and first.shape == other.shape
            if isinstance(first, DTensor) and isinstance(other, DTensor):
                same = same and first.placements == other.placements
            if not same:
                raise RuntimePlanError(
                    f"runtime: {names[0]} and {name} are one tensor in the model but the plan "
                    "shards them differently under tp; re-plan with tp=1"
                )
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)


# -- the loss, and gradients left partial by sequence parallelism ------------------------------

# aten ops (overload packets) a loss may run for `loss_parallel` to take it: views, casts and
# scalar arithmetic (on the loss), the log-softmax and the NLL loss. DTensor computes each of
# them correctly on vocab-sharded logits; anything else (label smoothing's sum over the
# vocabulary, z-loss, masks) makes `is_cross_entropy` say no and the logits are gathered.
_CROSS_ENTROPY_OPS = frozenset(
    {
        "_to_copy",
        "view",
        "_unsafe_view",
        "reshape",
        "clone",
        "detach",
        "alias",
        "lift_fresh",
        "_log_softmax",
        "nll_loss_forward",
        "mul",
        "div",
        "mean",
    }
)


class _LossProbe(TorchDispatchMode):
    """Records the aten ops of one loss call and whether it is a cross entropy that
    `loss_parallel` computes correctly: a log-softmax over the vocabulary (the last dim, of
    size `vocab`) whose output feeds only an NLL loss on (tokens, vocab) or (vocab,) input
    (torch's `loss_parallel` skips the log-softmax backward and computes the fused softmax -
    one-hot gradient in the NLL backward, so no other op may read the log-probabilities)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.ok = True
        self.log_softmax = 0
        self.nll = 0
        self._logprobs: list[torch.Tensor] = []  # kept alive so ids stay unique

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        reads_logprobs = any(
            a is t for a in args if isinstance(a, torch.Tensor) for t in self._logprobs
        )
        if name not in _CROSS_ENTROPY_OPS:
            self.ok = False
        elif name == "_log_softmax":
            x, dim = args[0], args[1]
            if x.shape[-1] != self.vocab or dim % x.dim() != x.dim() - 1:
                self.ok = False
            self.log_softmax += 1
            self._logprobs.append(out)
        elif name == "nll_loss_forward":
            if not reads_logprobs or args[0].dim() > 2:
                self.ok = False
            self.nll += 1
        elif reads_logprobs and name not in ("detach", "alias"):  # autograd saving it is fine
            self.ok = False
        return out


def is_cross_entropy(loss_fn, vocab: int) -> bool:
    """True when `loss_fn(logits, targets)` is a cross entropy over the last (vocabulary) dim
    that torch's `loss_parallel` computes exactly on vocab-sharded logits (see `_LossProbe`).

    Probed once on meta tensors (logits (2, 3, vocab), long targets (2, 3)): no data, no
    side effects on the model. A loss that reads `outputs.logits` (HuggingFace model outputs)
    is probed with an object holding the logits. Anything it cannot run, or any op beyond
    views, casts, log-softmax, NLL and scalar arithmetic, gives False."""
    logits = torch.empty(2, 3, vocab, device="meta", requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long, device="meta")
    for outputs in (logits, types.SimpleNamespace(logits=logits)):
        probe = _LossProbe(vocab)
        try:
            with probe:
                loss_fn(outputs, targets)
        except Exception:
            continue
        return probe.ok and probe.log_softmax == 1 and probe.nll == 1
    return False


def loss_context(enabled: bool):
    """The context forward, loss and backward run in: `loss_parallel()` when the loss runs
    vocab-parallel (its backward must run inside it too), else nothing."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def reduce_partial_gradients(modules) -> None:
    """Make every gradient that is a partial sum over a mesh dim (a `Partial` DTensor: norm
    weights under sequence parallelism, MoE routers under TP) whole, one all-reduce per
    parameter, before the optimizer reads it. FSDP2 and `replicate` do this themselves during
    their reduction, so with data parallelism there is nothing left here (but for expert
    parameters, which stay out of them under EP)."""
    for module in modules:
        for p in module.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(isinstance(x, Partial) for x in g.placements):
                whole = [Replicate() if isinstance(x, Partial) else x for x in g.placements]
                p.grad = g.redistribute(placements=whole)
