"""`meshplan verify`: run a plan's layout at CPU size and compare it with one process.

A plan that runs and gives wrong numbers is a planner's worst failure; this is the check
that catches it before any GPU hour is spent. Given the user's own model code (built small)
and a plan (made for the full model on the full cluster):

    1. trace the small model (`meshplan.trace`): its head, expert and layer counts bound the
       degrees it can run;
    2. `reduce_layout`: the plan's layout at CPU size: every degree > 1 becomes the smallest
       degree >= 2 the small model allows, degrees of 1 stay 1, the other choices (schedule,
       virtual stages, ZeRO, recompute, sequence parallelism, quantized activations) are
       kept, and at most `max_ranks` ranks are used (which dimension was dropped is said);
    3. the reduced plan: `estimate_plan` of that layout on a CPU cluster, carrying the plan's
       own TP placements (they name parameters by path inside a unit, so they hold at any
       size); `runtime.check_plan` refuses what the runtime cannot run, in one line;
    4. `steps` SGD steps of the plan on forked CPU gloo ranks (`runtime.run_local`,
       `runtime.apply`) against one process training the same model (same seed) on the same
       batches, micro-batch by micro-batch;
    5. compare, step by step: the loss on every rank, then rank 0's unsharded parameters
       (`Runner.full_state_dict`) and the gradients recovered from the SGD update
       (g = (p_before - p_after) / LR); the first loss or parameter out of tolerance is the
       divergence;
    6. localise it (`localize`): every module's input and output in that step's forward,
       recorded by hooks on the ranks (`ModuleOutputs`, pieces rebuilt over tp) and in the
       single process, name the first module whose output differs, and whether from the
       same input (its own computation) or not (its parent's code between sub-modules).

What the reduction cannot keep is said in the report's notes: per-group TP degrees and uneven
batch shares run as one homogeneous layout; the plan's coded collectives run raw (lossless
coding is bit-exact and tested on its own; int8 gradients change numerics by design); uneven
stage cuts are cut evenly for the small model. With quantized activations the comparison is
approximate (the single process quantizes the same modules at the same widths, but TP shards
the quantization blocks differently): losses within 0.1 %, gradients within 50 % relative L2,
enough to catch a wrong layout, not a subtle one.

The model must be deterministic given the torch seed (no dropout), take one input tensor
(`model(inputs)`, the first example input) and return logits (or an object with `.logits`)
unless `loss_fn` reads something else.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from meshplan import models
from meshplan.ir import Cluster, Graph, Parallel, Recompute, Schedule
from meshplan.ir.plan import Plan
from meshplan.ir.rules import cp_heads_problem, cp_usp_problem, usp_degree
from meshplan.passes.sharding import tp_param_placements
from torch import nn

from .api import complete_parallel, estimate_plan, trace

# Every model is built right after `torch.manual_seed(SEED)`, in the single process and in
# every rank, so all start from the same weights.
SEED = 0
# SGD's step size: large enough that the recovered gradient (p_before - p_after) / LR keeps
# its digits in fp32 (harness-proven on the runtime's parity tests).
LR = 0.5
MAX_RANKS = 8
# fp32 on CPU: parameters within atol + rtol * max|p|; gradients within 4 atol + 10 rtol *
# max|g| (the recovered gradient loses a few bits to the subtraction). The runtime's parity
# tests pass at these over 3 steps of every layout they cover.
ATOL, RTOL = 2e-5, 1e-4
GRAD_ATOL_FACTOR, GRAD_RTOL_FACTOR = 4.0, 10.0
# With AGoQ-quantized activations (see the module docstring).
QUANT_LOSS_RTOL, QUANT_GRAD_REL_L2 = 1e-3, 0.5
# The zoo presets at verify size: a model of the same family (style, GQA or not, MoE shape).
TINY_HIDDEN, TINY_HEADS, TINY_FFN, TINY_VOCAB, TINY_SEQ = 32, 4, 64, 128, 16
TINY_EXPERTS = 4

Batch = tuple[torch.Tensor, torch.Tensor]
Piece = tuple[torch.Tensor, tuple]  # a rank's local part of a tensor, and its layout
ModelFn = Callable[[], "nn.Module | tuple[nn.Module, Sequence[torch.Tensor]]"]
LossFn = Callable[[object, torch.Tensor], torch.Tensor]
InputsFn = Callable[[int, int], Batch]


# -- the layout at CPU size -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReducedLayout:
    """The plan's layout at CPU size (`parallel`, complete) and what the reduction changed
    beyond shrinking degrees (`notes`, one sentence each)."""

    parallel: Parallel
    notes: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        p = self.parallel
        return p.dp * p.tp * p.pp * p.cp  # type: ignore[operator]


def _smallest(allowed: Callable[[int], bool], limit: int = 64) -> int | None:
    """The smallest degree d in [2, limit] with allowed(d), or None."""
    return next((d for d in range(2, limit + 1) if allowed(d)), None)


def _divides(n: int) -> Callable[[int], bool]:
    """d divides n; n == 0 (the tracer found no such count) allows any d."""
    return lambda d: n == 0 or n % d == 0


def layout_text(p: Parallel) -> str:
    """One line naming a complete layout's degrees and choices (degrees of 1 left out)."""
    degrees = [f"{a}={getattr(p, a)}" for a in ("dp", "tp", "pp", "cp", "ep") if getattr(p, a) > 1]
    parts = [" x ".join(degrees) or "one rank"]
    if p.pp > 1:  # type: ignore[operator]
        v = f" v={p.virtual_stages}" if p.schedule == Schedule.INTERLEAVED_1F1B else ""
        parts.append(f"schedule {p.schedule}{v}")
    if p.zero:
        parts.append(f"zero={p.zero}")
    if p.recompute != Recompute.NONE:
        parts.append(f"recompute {p.recompute}")
    if p.tp > 1:  # type: ignore[operator]
        parts.append(f"SP {'on' if p.sequence_parallel else 'off'}")
    if p.quantize_activations:
        parts.append("quantized activations")
    m = p.num_microbatches
    parts.append(f"micro-batch {p.micro_batch}, global batch {p.global_batch} ({m} per replica)")
    world = p.dp * p.tp * p.pp * p.cp  # type: ignore[operator]
    return f"{', '.join(parts)}; {world} rank{'s' if world > 1 else ''}"


def reduce_layout(
    plan_or_parallel: Plan | Parallel, graph: Graph, *, max_ranks: int = MAX_RANKS
) -> ReducedLayout:
    """The layout of `plan_or_parallel` (a Plan, or a complete Parallel) at CPU size for the
    small model `graph`.

    Degrees: every degree > 1 becomes the smallest degree >= 2 the model allows (tp divides
    heads and kv_heads, cp the sequence, ep the experts; dp a multiple of ep, 2 ep when the
    plan has several replicas of each expert shard; pp = 2, within the layer count the
    schedule needs); degrees of 1 stay 1. Schedule, virtual stages, ZeRO, recompute,
    sequence parallelism and quantized activations are kept. Batch: micro-batch 1; each
    replica runs pp micro-batches under a pipeline (one whole round for interleaved 1F1B,
    2 pp under ZB-V), else 2 when the plan accumulates gradients over several
    micro-batches, else 1.
    At most `max_ranks` ranks (dp*tp*pp*cp): over it, dimensions are dropped to 1 in the
    order expert replicas, dp, pp, cp, tp, ep (the best-tested first), each with a note.
    Raises ValueError (one line) when the small model cannot hold a degree the plan uses.
    """
    if max_ranks < 1:
        raise ValueError(f"max_ranks must be >= 1, got {max_ranks}")
    plan = plan_or_parallel if isinstance(plan_or_parallel, Plan) else None
    p = plan.parallel if plan is not None else plan_or_parallel
    if not p.is_complete:
        raise ValueError(f"verify needs a complete layout, got {p}")
    info, notes = graph.info, []
    group_tp = plan.stages[0].group_tp if plan is not None else ()
    tp_in = max([p.tp, *(t for _, t in group_tp)])  # type: ignore[type-var]
    if group_tp:
        text = " / ".join(f"{g} {t}" for g, t in group_tp)
        notes.append(f"per-group TP ({text}) verified as one homogeneous layout")
    if plan is not None:
        notes += _plan_notes(plan)

    def need(what: str, value: int | None, why: str) -> int:
        if value is None:
            raise ValueError(f"verify: the model cannot run {what} > 1 ({why}); build it larger")
        return value

    tp = cp = ep = pp = 1
    if tp_in > 1:
        ok = lambda d: _divides(info.heads)(d) and _divides(info.kv_heads)(d)  # noqa: E731
        tp = need("tp", _smallest(ok), f"heads {info.heads}, kv_heads {info.kv_heads}")
    if p.cp > 1:  # type: ignore[operator]
        cp = need("cp", _smallest(_divides(info.seq_len)), f"sequence {info.seq_len}")
    if p.ep > 1:  # type: ignore[operator]
        if not info.experts:
            raise ValueError(f"verify: the plan has ep={p.ep} but the model has no experts")
        ep = need("ep", _smallest(_divides(info.experts)), f"{info.experts} experts")
    dp = 1
    if p.dp > 1:  # type: ignore[operator]
        replicas = p.ep > 1 and p.dp > p.ep  # type: ignore[operator]
        dp = 2 * ep if replicas else max(2, ep)
    schedule, virtual = p.schedule, p.virtual_stages
    layers = len(graph.layer_units) or info.layers
    if p.pp > 1:  # type: ignore[operator]
        pp = 2
        chunks = p.chunks  # 2 under ZB-V
        if layers < pp * chunks:
            raise ValueError(
                f"verify: pp={pp} under {schedule} ({chunks} chunk(s) per rank) needs "
                f"{pp * chunks} layers; the model has {layers}: build it with more layers"
            )

    def world() -> int:
        return dp * tp * pp * cp

    over = world()
    for dim in ("replicas", "dp", "pp", "cp", "tp", "ep", "dp"):
        if world() <= max_ranks:
            break
        if dim == "replicas" and dp > ep > 1:
            dp = ep
        elif dim == "dp" and dp > 1 and ep == 1:
            dp = 1
        elif dim == "pp" and pp > 1:
            pp, schedule, virtual = 1, Schedule.ONE_F_ONE_B, None
        elif dim == "cp" and cp > 1:
            cp = 1
        elif dim == "tp" and tp > 1:
            tp = 1
        elif dim == "ep" and ep > 1:
            ep = 1
        else:
            continue
        label = "expert replicas (dp -> ep)" if dim == "replicas" else dim
        notes.append(f"{label} dropped to fit {max_ranks} ranks (the layout needs {over})")
    if world() > max_ranks:
        raise ValueError(f"verify: cannot fit the layout in {max_ranks} ranks")

    if pp > 1:
        # at least pp micro-batches per pipeline, one whole round for interleaved 1F1B; ZB-V
        # is priced from 2 pp - 1 (`cost_model.simulate`): 2 pp, as its parity tests run it
        m = 2 * pp if schedule == Schedule.ZERO_BUBBLE else pp
    elif p.num_microbatches > 1:
        m = 2  # gradient accumulation (and ZeRO's per-micro-batch paths) exercised
    else:
        m = 1
    reduced = Parallel(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        micro_batch=1,
        global_batch=dp * m,
        recompute=p.recompute,
        zero=p.zero,
        schedule=schedule,
        sequence_parallel=bool(p.sequence_parallel) and tp > 1,
        virtual_stages=virtual if pp > 1 else None,
        quantize_activations=p.quantize_activations,
        **_reduced_cp(p, cp, tp, info, notes),
    )
    return ReducedLayout(reduced, tuple(notes))


def _reduced_cp(p: Parallel, cp: int, tp: int, info, notes: list[str]) -> dict:
    """The plan's cp mode and asymmetric split at the reduced cp (fields of `Parallel`).

    The mode is kept where the small model runs it ("heads": cp divides a tp rank's heads).
    Asymmetric shares (`cp_shares`, `cp_head_shares`; HexiSeq) become cp = 2 shares in the
    ratio of the plan's largest share to its smallest, rounded to what the small model's
    sequence and heads allow (even tokens, at least 2 and 1 a rank); a note says so."""
    if cp == 1 or (p.cp or 1) == 1:
        return {}
    mode = p.cp_mode or "allgather"
    if mode == "heads" and cp_heads_problem(info.heads // tp, cp):
        notes.append(f"cp attention 'heads' verified as 'allgather' (heads {info.heads}, cp {cp})")
        mode = "allgather"
    out: dict = {"cp_mode": mode}
    if mode == "usp":
        heads = info.heads // tp if info.heads else 0
        degree = next(
            (
                u
                for u in (p.cp_head_degree, usp_degree(heads, cp))
                if not cp_usp_problem(heads, cp, u)
            ),
            None,
        )
        if degree is None:
            notes.append(
                f"cp attention 'usp' verified as 'allgather' (heads {info.heads}, cp {cp})"
            )
            return {"cp_mode": "allgather"}
        if degree != p.cp_head_degree:
            notes.append(f"cp attention 'usp' verified with heads over {degree} ranks")
        return {"cp_mode": "usp", "cp_head_degree": degree}
    if cp != 2:
        return out

    def pair(shares, total: int, step: int) -> tuple[int, int] | None:
        big, small = max(shares), min(shares)
        first = round(total * big / (big + small) / step) * step
        first = min(max(first, step), total - step)
        return (first, total - first) if total >= 2 * step else None

    if p.cp_shares and info.seq_len and mode != "ring":
        split = pair(p.cp_shares, info.seq_len, 2)
        if split is not None:
            out["cp_shares"] = split
            notes.append(
                f"asymmetric cp shares verified as {split[0]} + {split[1]} of {info.seq_len} "
                "tokens (the plan's largest : smallest share)"
            )
    if p.cp_head_shares and mode == "heads" and info.heads:
        split = pair(p.cp_head_shares, info.heads // tp, 1)
        if split is not None:
            out["cp_head_shares"] = split
            notes.append(f"asymmetric head shares verified as {split[0]} + {split[1]}")
    return out


def _plan_notes(plan: Plan) -> list[str]:
    """What of `plan` the reduced layout does not run as written (beyond per-group TP)."""
    notes = []
    if plan.stages[0].microbatches:
        notes.append("uneven batch shares verified as even shares")
    layers = [
        sum(not u.startswith("<") for u in plan.model.units[s.first_unit : s.last_unit])
        for s in plan.stages
    ]
    if max(layers) - min(layers) > 1:
        notes.append(f"uneven stage cuts ({'/'.join(map(str, layers))} layers) cut evenly")
    coded = [d.method for d in plan.compression.decisions if d.method != "raw"]
    if coded:
        counts = ", ".join(f"{coded.count(m)} {m}" for m in sorted(set(coded)))
        notes.append(f"the plan's coded collectives ({counts}) run raw")
    return notes


def complete_layout(pins: Parallel, graph: Graph) -> Parallel:
    """A partial layout made complete as `estimate` does (`complete_parallel`), dp 1 and pp
    micro-batches per replica unless pinned."""
    world = math.prod(getattr(pins, a) or 1 for a in ("dp", "tp", "pp", "cp"))
    per_step = (pins.dp or 1) * (pins.micro_batch or 1)
    gb = pins.global_batch or per_step * (pins.pp or 1)  # a pipeline gets pp micro-batches
    pins = dataclasses.replace(pins, dp=pins.dp or 1, global_batch=gb)
    return complete_parallel(graph, Cluster.preset("cpu", gpus=world), pins)


def reduced_parallel(
    plan_or_parallel: Plan | Parallel, graph: Graph, *, max_ranks: int = MAX_RANKS
) -> Parallel:
    """The layout of `plan_or_parallel` at CPU size for `graph` (`reduce_layout`)."""
    return reduce_layout(plan_or_parallel, graph, max_ranks=max_ranks).parallel


def _unit_pattern(units: Sequence[str]) -> set[str]:
    """Unit names with layer numbers blanked (`model.layers.#`): a model family's shape."""
    return {re.sub(r"\d+", "#", u) for u in units}


def check_same_model(plan: Plan, graph: Graph) -> None:
    """One-line ValueError when `plan` was made for another model than `graph` (at another
    size is fine): its units or its TP placements name modules the model does not have."""
    want, have = _unit_pattern(plan.model.units), _unit_pattern(u.name for u in graph.units)
    if want != have:
        raise ValueError(
            f"verify: the plan's units ({', '.join(sorted(want))}) are not the model's "
            f"({', '.join(sorted(have))}); the plan was made for {plan.model.name!r}"
        )
    if plan.placements:
        planned = {k for k, _ in plan.placements}
        derived = {k for k, _ in tp_param_placements(graph)}
        if planned != derived:
            odd = sorted(planned - derived) or sorted(derived - planned)
            where = "the plan but not the model" if planned - derived else "the model, not the plan"
            raise ValueError(
                f"verify: the plan's TP placements do not match the model: {odd[0]!r} is in "
                f"{where} (the plan was made for {plan.model.name!r})"
            )


def reduced_plan(plan_or_parallel: Plan | Parallel, graph: Graph, layout: ReducedLayout) -> Plan:
    """The plan the ranks run: `layout` placed on a CPU cluster for `graph`, with the original
    plan's TP placements (when it is a Plan)."""
    cluster = Cluster.preset("cpu", gpus=layout.world)
    small = estimate_plan(graph, cluster=cluster, parallel=layout.parallel)
    if isinstance(plan_or_parallel, Plan) and layout.parallel.tp > 1:  # type: ignore[operator]
        small = dataclasses.replace(small, placements=plan_or_parallel.placements)
    return small


# -- models and batches -----------------------------------------------------------------------


def preset_model_fn(name: str, parallel: Parallel, *, seq_len: int | None = None) -> ModelFn:
    """A builder of zoo preset `name` at verify size: the same family (style, GQA, MoE
    shape, tied embeddings) with hidden 32, 4 heads (2 kv heads under GQA), ffn 64, vocab
    128, 4 experts of an MoE (capacity never dropping tokens: drops depend on how tokens are
    split over ranks; one dense layer first where the preset has some), and enough layers
    for the pipeline `parallel` runs (2 per chunk); real fp32 weights on CPU."""
    cfg = models.config(name)
    pp = parallel.pp or 1
    layers = max(2, 2 * parallel.chunks) if pp > 1 else 2  # 2 layers per chunk of a rank
    experts = TINY_EXPERTS if cfg.experts else 0
    top_k = min(cfg.top_k, 2) if experts else 0
    dense = min(cfg.dense_layers, 1)
    if dense:  # the tracer finds the layers by repetition: two MoE layers after the dense one
        layers = max(layers, dense + 2)
    tiny = dataclasses.replace(
        cfg,
        layers=layers,
        hidden=TINY_HIDDEN,
        heads=TINY_HEADS,
        kv_heads=TINY_HEADS // 2 if cfg.num_kv_heads < cfg.heads else None,
        ffn=TINY_FFN,
        vocab=TINY_VOCAB,
        seq_len=seq_len or TINY_SEQ,
        experts=experts,
        top_k=top_k,
        shared_experts=min(cfg.shared_experts, 1),
        dense_layers=dense,
        dense_ffn=TINY_FFN if cfg.dense_ffn else None,
        capacity_factor=experts / top_k if experts else cfg.capacity_factor,
    )

    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return models.build(tiny, dtype="float32", device="cpu")

    return build


def model_fn_for(spec: str, parallel: Parallel, *, seq_len: int | None = None) -> ModelFn:
    """The model builder for a CLI model spec: a zoo preset at verify size
    (`preset_model_fn`), or `path/to/file.py:factory` called as `meshplan plan` calls it
    (`load_model`; it must build a small real model)."""
    from .api import load_model

    if spec.lower() in models.PRESETS:
        return preset_model_fn(spec.lower(), parallel, seq_len=seq_len)
    if ":" not in spec:
        models.config(spec)  # raises the unknown-model error listing the presets
    return lambda: load_model(spec, seq_len=seq_len)


def _build(model_fn: ModelFn, example_inputs: Sequence[torch.Tensor] | None):
    """(model, example inputs) from `model_fn` after seeding torch; the model in fp32."""
    torch.manual_seed(SEED)
    built = model_fn()
    model, example = built if isinstance(built, tuple) else (built, example_inputs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"verify: model_fn returned {type(model).__name__}, not a module")
    if example is None:
        raise ValueError(
            "verify: model_fn returned a bare module; return (model, example_inputs) or pass "
            "example_inputs="
        )
    if any(t.is_meta for t in model.parameters()):
        raise ValueError(
            "verify: the model is on the meta device; verify trains it: build a small real "
            "model on CPU"
        )
    example = (example,) if isinstance(example, torch.Tensor) else tuple(example)
    return model.float(), example


def _with_seq_len(example: tuple, seq_len: int | None) -> tuple:
    """The example inputs with their sequence dim (dim 1 of 2-D+ tensors) set to `seq_len`."""
    if seq_len is None:
        return example
    return tuple(
        t.new_zeros((t.shape[0], seq_len, *t.shape[2:]))
        if isinstance(t, torch.Tensor) and t.dim() >= 2
        else t
        for t in example
    )


def _vocab(model: nn.Module, graph: Graph) -> int:
    if graph.info.vocab:
        return graph.info.vocab
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError("verify: cannot tell the model's vocabulary size; pass inputs_fn=")


def logits_of(outputs: object) -> torch.Tensor:
    """The logits of a model's output: itself, its `.logits`, or a tuple's first element (an
    HF output under `return_dict=False`, or under PP)."""
    if hasattr(outputs, "logits"):
        return outputs.logits  # type: ignore[attr-defined]
    if isinstance(outputs, (tuple, list)):
        return outputs[0]
    return outputs  # type: ignore[return-value]


def default_loss(outputs: object, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of the logits (`logits_of(outputs)`) against `targets`."""
    logits = logits_of(outputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def default_batches(
    model: nn.Module, example: tuple, graph: Graph, global_batch: int, steps: int
) -> list[Batch]:
    """`steps` global batches shaped like the first example input: token ids in [0, vocab)
    for an integer input, standard normal values for a float one; targets are class ids of
    the logits the model returns (probed once on one row)."""
    first = example[0]
    with torch.no_grad():
        probe = model(first[:1])
    logits = logits_of(probe)
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise ValueError("verify: the model does not return logits; pass loss_fn= and inputs_fn=")
    classes, target_shape = logits.shape[-1], tuple(logits.shape[1:-1])
    batches = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        shape = (global_batch, *first.shape[1:])
        if first.is_floating_point():
            x = torch.randn(shape, generator=g, dtype=first.dtype)
        else:
            x = torch.randint(0, _vocab(model, graph), shape, generator=g, dtype=first.dtype)
        y = torch.randint(0, classes, (global_batch, *target_shape), generator=g)
        batches.append((x, y))
    return batches


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _quantize_like(plan: Plan, model: nn.Module) -> None:
    """Give the single process the plan's activation widths: modules inside a layer unit at
    their stage's, the rest (embedding, head) at stage 0's."""
    from meshplan.runtime.quantize import plan_activation_bits, quantize_saved_activations

    merged = dict(plan_activation_bits(plan, model, 0) or {})
    for st in plan.stages[1:]:
        units = plan.model.units[st.first_unit : st.last_unit]
        for path, bits in (plan_activation_bits(plan, model, st.index) or {}).items():
            if any(path == u or path.startswith(u + ".") for u in units):
                merged[path] = bits
    quantize_saved_activations(model, merged)


class ModuleOutputs:
    """The input and output of every module in the last forward call of each step, kept as
    this rank's local pieces with their layout, for `localize`: forward hooks installed after
    the plan is applied, so they see what the parallel styles hand on.

    The last call, not the first: a pipeline's first step runs a shape-inference forward on
    empty tensors first, and under recompute the last call (the last micro-batch's
    recomputation) has the values of that micro-batch's forward. A piece is
    `(tensor, layout)`, layout ("shard", dim) / ("replicate",) / ("partial",) for a DTensor
    on one mesh axis, ("local",) for a plain tensor (a shard or a whole tensor: `localize`
    tells them apart by shape)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        from meshplan.runtime import clean_name

        self.steps: list[dict[str, tuple[Piece | None, Piece | None]]] = []
        self.handles = []
        for root in modules:
            for name, module in root.named_modules():
                path = clean_name(name + ".")[:-1] if name else ""
                if path in ("", "module"):  # a stage's or a wrapper's root: not the model's
                    continue
                self.handles.append(module.register_forward_hook(self._hook(path)))

    def _hook(self, path: str):
        def record(module, args, output) -> None:
            piece = _piece(output)
            if piece is not None and self.steps:
                self.steps[-1][path] = (_piece(args), piece)

        return record

    def begin_step(self) -> None:
        self.steps.append({})


def _first_tensor(output: object) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None


def _piece(output: object) -> Piece | None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    t = _first_tensor(output)
    if t is None or t.is_meta:
        return None
    if not isinstance(t, DTensor):
        return t.detach().clone(), ("local",)
    if len(t.placements) != 1:
        return None
    p = t.placements[0]
    if type(p) is Shard:  # not a strided shard: plain concatenation rebuilds it
        layout: tuple = ("shard", p.dim)
    elif isinstance(p, Replicate):
        layout = ("replicate",)
    elif isinstance(p, Partial):
        layout = ("partial",)
    else:
        return None
    return t.to_local().detach().clone(), layout


def reference_run(
    model: nn.Module, plan: Plan, loss_fn: LossFn, batches: Sequence[Batch]
) -> tuple[list[float], list[dict], list[dict]]:
    """One process: SGD on each global batch, micro-batch by micro-batch (as the replicas
    split it); (losses, parameter snapshots before and after every step, each step's module
    outputs in forward order for the micro-batch dp replica 0 runs last)."""
    if plan.parallel.quantize_activations:
        _quantize_like(plan, model)
    opt = _sgd(model.parameters())
    m = plan.parallel.global_batch // plan.parallel.micro_batch  # type: ignore[operator]
    watched = plan.parallel.num_microbatches - 1
    outputs: list[dict] = []
    recording: list[bool] = [False]

    def hook(path: str):
        def record(module, args, output) -> None:
            t, x = _first_tensor(output), _first_tensor(args)
            if recording[0] and t is not None:
                outputs[-1][path] = (None if x is None else x.detach().clone(), t.detach().clone())

        return record

    handles = [mod.register_forward_hook(hook(n)) for n, mod in model.named_modules() if n]
    losses, states = [], [_snapshot(model)]
    try:
        for x, y in batches:
            total = 0.0
            outputs.append({})
            for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m))):
                recording[0] = i == watched
                loss = loss_fn(model(xi), yi) / m
                recording[0] = False
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
            states.append(_snapshot(model))
    finally:
        for h in handles:
            h.remove()
    return losses, states, outputs


def _rank_run(model_fn: ModelFn, example_inputs, plan: Plan, loss_fn: LossFn, batches) -> dict:
    """Inside a rank: build the model (seeded), apply the plan, train; losses, rank 0's
    unsharded parameter snapshots, this rank's module outputs and mesh coordinates."""
    import logging

    from meshplan.runtime import apply

    # torch warns once per rank that gathering FSDP x TP shards takes two all-gathers.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model, _ = _build(model_fn, example_inputs)
    runner = apply(model, plan, loss_fn, _sgd)
    outputs = ModuleOutputs(runner.modules)
    states, losses = [runner.full_state_dict()], []
    for x, y in batches:
        outputs.begin_step()
        losses.append(runner.step(x, y))
        states.append(runner.full_state_dict())
    return {
        "losses": losses,
        "states": states,
        "outputs": outputs.steps,
        "coords": runner.ctx.coords,
    }


# -- comparison and report --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `verify` found. `ok`: PASS. `layout`: the reduced layout that ran, `notes` what
    the reduction changed. Losses per step: `reference_losses` of one process, `rank_losses`
    of every rank. `divergence`: the first divergence or the refusal ("" on PASS).
    `max_loss_diff` / `max_grad_diff`: the largest differences seen (up to the divergence).
    `model`: the model that ran (class and parameter count)."""

    ok: bool
    world: int
    layout: str
    notes: tuple[str, ...] = ()
    reference_losses: tuple[float, ...] = ()
    rank_losses: tuple[tuple[float, ...], ...] = ()
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    divergence: str = ""
    seconds: float = 0.0
    model: str = ""

    def summary(self) -> str:
        """`PASS (...)` or `FAIL: <divergence>`, one line."""
        if not self.ok:
            return f"FAIL: {self.divergence}"
        return (
            f"PASS (max loss diff {self.max_loss_diff:.2g}, max grad diff "
            f"{self.max_grad_diff:.2g}, {self.world} rank{'s' if self.world > 1 else ''}, "
            f"{self.seconds:.1f} s)"
        )


@dataclass(frozen=True, slots=True)
class Tolerance:
    """fp32 tolerances: a value v matches its reference r when |v - r| <= atol + rtol *
    max|r| (gradients: GRAD_ATOL_FACTOR / GRAD_RTOL_FACTOR times looser); `quantized`:
    the approximate comparison of quantized activations (see the module docstring)."""

    atol: float = ATOL
    rtol: float = RTOL
    quantized: bool = False

    def of(self, ref: torch.Tensor | float) -> float:
        r = abs(ref) if isinstance(ref, float) else _max_abs(ref)
        return self.atol + self.rtol * r

    def loss(self, ref: float) -> float:
        return QUANT_LOSS_RTOL * abs(ref) if self.quantized else self.of(ref)

    def grad(self, ref: torch.Tensor) -> float:
        return GRAD_ATOL_FACTOR * self.atol + GRAD_RTOL_FACTOR * self.rtol * _max_abs(ref)


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


@dataclass(frozen=True, slots=True)
class Comparison:
    """The largest loss and gradient differences seen, and the first divergence ("" when
    none) with the step it appeared in (0: before the first step)."""

    max_loss_diff: float
    max_grad_diff: float
    divergence: str = ""
    step: int = 0


def compare(
    ref, results: Sequence[dict], tol: Tolerance, tied: dict[str, str] | None = None
) -> Comparison:
    """The ranks' `results` against the single process's `ref` = (losses, snapshots, ...).
    Step by step: the loss on every rank, then each parameter (in the model's order) after
    the step, with its gradient recovered from the SGD update. `tied`: the model's second
    names of shared parameters (name -> the name it shares a tensor with)."""
    ref_losses, ref_states = ref[0], ref[1]
    states = results[0]["states"]
    tied = tied or {}
    seen = {"loss": 0.0, "grad": 0.0}

    def done(why: str = "", step: int = 0) -> Comparison:
        return Comparison(seen["loss"], seen["grad"], why, step)

    got0, want0 = states[0], ref_states[0]
    if set(got0) != set(want0):
        ranks, one = sorted(set(got0) - set(want0)), sorted(set(want0) - set(got0))
        split = [n for n in ranks if n in tied]
        if split:
            return done(
                f"parameter {split[0]} is tied to {tied[split[0]]} in the model but trained as "
                "a separate parameter on the ranks: the layout breaks the tie"
            )
        return done(f"parameter names differ: the ranks have {ranks[:3]}, one process {one[:3]}")
    for name, want in want0.items():
        d = _max_abs(got0[name] - want)
        if d > tol.of(want):
            return done(
                f"parameter {name} differs before the first step (max abs diff {d:.3g}): "
                "the model is not built the same in every process (seed it with torch)"
            )
    for k in range(1, len(ref_states)):
        want_loss = ref_losses[k - 1]
        for rank, r in enumerate(results):
            d = abs(r["losses"][k - 1] - want_loss)
            seen["loss"] = max(seen["loss"], d)
            if not d <= tol.loss(want_loss):  # NaN fails too
                return done(
                    f"loss at step {k} on rank {rank}: {r['losses'][k - 1]:.6g}, one process "
                    f"{want_loss:.6g} (diff {d:.3g}, tol {tol.loss(want_loss):.3g})",
                    k,
                )
        for name, want in ref_states[k].items():
            got = states[k][name]
            g_ref = (ref_states[k - 1][name] - want) / LR
            g_got = (states[k - 1][name] - got) / LR
            gd = _max_abs(g_got - g_ref)
            seen["grad"] = max(seen["grad"], gd)
            if tol.quantized:
                rel = float((g_got - g_ref).norm()) / max(float(g_ref.norm()), 1e-12)
                if not rel <= QUANT_GRAD_REL_L2:
                    return done(
                        f"parameter {name} after step {k}: gradient off by {rel:.2f} relative "
                        f"L2 (tol {QUANT_GRAD_REL_L2})",
                        k,
                    )
                continue
            pd = _max_abs(got - want)
            if not (pd <= tol.of(want) and gd <= tol.grad(g_ref)):
                return done(
                    f"parameter {name} after step {k}: max abs diff {pd:.3g} (tol "
                    f"{tol.of(want):.3g}); its gradient's {gd:.3g} (tol {tol.grad(g_ref):.3g})",
                    k,
                )
    return done()


def _blame(model: nn.Module, where: Culprit, step: int) -> str:
    """One line naming the module a `Culprit` points at, with its parameters: the first
    diverging module itself, or the module whose forward hands it its input (containers,
    which run no code of their own, skipped)."""
    path = where.module
    if not where.own:
        path = path.rpartition(".")[0]
        while path and isinstance(model.get_submodule(path), (nn.ModuleList, nn.ModuleDict)):
            path = path.rpartition(".")[0]
    params = [f"{path}.{n}".lstrip(".") for n, _ in model.get_submodule(path).named_parameters()]
    owns = f" (parameters {', '.join(params[:4])}{', ...' if len(params) > 4 else ''})"
    head = f"module {path or type(model).__name__}{owns if params else ''}: step {step}'s forward"
    numbers = f"max abs diff {where.diff:.3g} (tol {where.tol:.3g})"
    if where.own:
        return f"{head} first diverges in its output, from the same input: {numbers}"
    return f"{head} first diverges in its own code: the input it gives {where.module}, {numbers}"


def _tied(model: nn.Module) -> dict[str, str]:
    """Second names of shared parameters -> the first name (`named_parameters` order)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _whole(pieces: list[tuple[torch.Tensor, tuple]], ref: torch.Tensor) -> torch.Tensor | None:
    """The whole output from the tp ranks' pieces (in tp order), or None when the layout
    cannot be told (a plain tensor sharded on no single dim of the reference's shape)."""
    layout = pieces[0][1]
    tensors = [t for t, _ in pieces]
    if layout[0] == "shard":
        return torch.cat(tensors, dim=layout[1])
    if layout[0] == "partial":
        return torch.stack(tensors).sum(0)
    first = tensors[0]
    if layout[0] == "replicate" or first.shape == ref.shape:
        return first
    if first.dim() != ref.dim():
        return None
    dims = [d for d in range(ref.dim()) if first.shape[d] != ref.shape[d]]
    if len(dims) == 1 and sum(t.shape[dims[0]] for t in tensors) == ref.shape[dims[0]]:
        return torch.cat(tensors, dim=dims[0])
    return None


@dataclass(frozen=True, slots=True)
class Culprit:
    """Where a forward first diverges: `module` is the first whose output differs; `own`:
    from the same input (its own computation), else its input differs already (or cannot be
    compared): the divergence is in the code of its parent's forward, between sub-modules.
    `diff`/`tol`: of that output, or of that input."""

    module: str
    own: bool
    diff: float
    tol: float


def localize(
    ref_outputs: dict[str, tuple[torch.Tensor | None, torch.Tensor]],
    results: Sequence[dict],
    plan: Plan,
    tol: Tolerance,
) -> Culprit | None:
    """The first module, in the single process's forward order, whose output in one step's
    forward differs from the ranks', and whether its input already differed; None when all
    that can be compared match. `results`: per rank, its mesh "coords" and its "outputs" of
    that step (`ModuleOutputs`); `ref_outputs` the single process's (input, output) of the
    same micro-batch. A rank tensor is rebuilt from dp replica 0's pieces over tp (cp rank
    0's tokens under context parallelism: the reference is cut to its positions along the
    sequence dim, dim 1); tensors whose layout cannot be told are skipped."""
    from meshplan.runtime import sequence_positions

    p, seq = plan.parallel, plan.model.seq_len
    mine = [r for r in results if r["coords"][1] == 0 and r["coords"][2] == 0]  # dp 0, cp 0

    def diff(path: str, which: int, ref: torch.Tensor | None) -> tuple[float, float] | None:
        """(max abs diff, tol) of the ranks' input (0) or output (1) of `path`, or None."""
        if ref is None:
            return None
        if p.cp > 1:  # type: ignore[operator]
            if ref.dim() < 2 or ref.shape[1] != seq:
                return None
            ref = ref[:, sequence_positions(seq, p.cp, 0, p.cp_shares)]
        pieces = {r["coords"][3]: r["outputs"][path][which] for r in mine if path in r["outputs"]}
        if sorted(pieces) != list(range(p.tp)) or any(v is None for v in pieces.values()):
            return None
        got = _whole([pieces[t] for t in range(p.tp)], ref)  # type: ignore[arg-type]
        if got is None or got.shape != ref.shape:
            return None
        return _max_abs(got.float() - ref.float()), tol.of(ref.float())

    for path, (ref_in, ref_out) in ref_outputs.items():
        out = diff(path, 1, ref_out)
        if out is None or out[0] <= out[1]:
            continue
        inp = diff(path, 0, ref_in)
        if inp is not None and inp[0] <= inp[1]:
            return Culprit(path, True, *out)
        return Culprit(path, False, *(inp or out))
    return None


def verify(
    model_fn: ModelFn,
    plan: Plan | Parallel,
    *,
    loss_fn: LossFn | None = None,
    inputs_fn: InputsFn | None = None,
    steps: int = 2,
    seq_len: int | None = None,
    example_inputs: Sequence[torch.Tensor] | None = None,
    max_ranks: int = MAX_RANKS,
    atol: float = ATOL,
    rtol: float = RTOL,
    timeout_s: float = 300.0,
) -> VerifyReport:
    """Run `plan`'s layout at CPU size with the user's model code and compare it with one
    process (see the module docstring); PASS, or the first parameter that diverges.

    `model_fn()` builds a small real model (fp32 on CPU; called after `torch.manual_seed`, in
    this process and in every rank) and returns `(model, example_inputs)` or the model alone
    with `example_inputs=` given. `plan`: a Plan (its layout, TP placements and validity
    checked) or a complete Parallel (a layout to try). `loss_fn(outputs, targets)`: default
    `default_loss` (next-token cross entropy on the logits). `inputs_fn(global_batch, step)
    -> (inputs, targets)`: default `default_batches`. `seq_len` sets the sequence length of
    the example inputs (dim 1). `steps` SGD steps; tolerances `atol`/`rtol` (fp32).

    A plan the runtime refuses (`check_plan`, or `apply` in a rank) and a rank that crashes
    are a FAIL with one line. Raises ValueError (one line) when the small model cannot hold
    the layout or the plan was made for another model.
    """
    from meshplan.runtime import RankFailure, RuntimePlanError, check_plan, run_local

    t0 = time.perf_counter()
    if steps < 1:
        raise ValueError(f"verify: steps must be >= 1, got {steps}")
    model, example = _build(model_fn, example_inputs)
    example = _with_seq_len(example, seq_len)
    # the public trace (`meshplan.trace`): the planner's rules (`ModelInfo.blockers`) included
    graph = trace(model, *example, name=type(model).__name__)
    described = f"{type(model).__name__}, {graph.num_params():,} parameters"
    is_plan = isinstance(plan, Plan)
    if is_plan:
        check_same_model(plan, graph)
    else:
        plan = complete_layout(plan, graph)
    layout = reduce_layout(plan, graph, max_ranks=max_ranks)
    world = layout.world
    text = layout_text(layout.parallel)

    def report(ok: bool, divergence: str = "", **kw) -> VerifyReport:
        return VerifyReport(
            ok,
            world,
            text,
            layout.notes,
            divergence=divergence,
            seconds=time.perf_counter() - t0,
            model=described,
            **kw,
        )

    try:
        small = reduced_plan(plan, graph, layout)
    except ValueError as e:  # the planner's own rules refuse the layout for this model
        return report(False, f"the layout cannot run on this model: {e}")
    try:
        if is_plan:
            check_plan(plan)  # the plan as written, then as reduced
        check_plan(small)
    except RuntimePlanError as e:
        return report(False, f"the runtime refuses the plan: {e}")
    loss_fn = loss_fn or default_loss
    gb = small.parallel.global_batch
    if inputs_fn is not None:
        batches = [inputs_fn(gb, step) for step in range(steps)]
    else:
        batches = default_batches(model, example, graph, gb, steps)
    ref = reference_run(model, small, loss_fn, batches)
    try:
        results = run_local(
            _rank_run,
            world,
            model_fn,
            example_inputs,
            small,
            loss_fn,
            batches,
            timeout_s=timeout_s,
            collective_timeout_s=min(60.0, timeout_s),
        )
    except RankFailure as e:
        prefix = f"{RuntimePlanError.__name__}: "
        if e.cause.startswith(prefix):
            why = e.cause[len(prefix) :]
            return report(False, f"the runtime refuses the plan (rank {e.rank}): {why}")
        return report(False, f"rank {e.rank} failed: {e.cause}")
    tol = Tolerance(atol, rtol, quantized=bool(small.parallel.quantize_activations))
    found = compare(ref, results, tol, _tied(model))
    divergence = found.divergence
    if divergence and found.step and not tol.quantized:
        k = found.step
        step_outputs = [{"coords": r["coords"], "outputs": r["outputs"][k - 1]} for r in results]
        where = localize(ref[2][k - 1], step_outputs, small, tol)
        if where is not None:
            divergence = f"{_blame(model, where, k)}; then {divergence}"
    return report(
        not divergence,
        divergence,
        reference_losses=tuple(ref[0]),
        rank_losses=tuple(tuple(r["losses"]) for r in results),
        max_loss_diff=found.max_loss_diff,
        max_grad_diff=found.max_grad_diff,
    )
