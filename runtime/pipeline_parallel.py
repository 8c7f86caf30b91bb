"""Pipeline parallelism: cut the model at the plan's stage boundaries, run torch's schedules.

Chunk-stages. A schedule with one model chunk per pipeline rank (GPipe, 1F1B) runs pp stages;
interleaved 1F1B runs v = `virtual_stages` chunks per rank and ZB-V exactly 2, so the model is
cut into pp * v chunk-stages, numbered in model order. Which rank holds which:

    gpipe, 1f1b         rank r holds stage r
    interleaved_1f1b    rank r holds chunk-stages r, r + pp, ..., r + (v-1) pp (Megatron-LM's
                        interleaved layout, Narayanan et al. SC'21; torch's
                        ScheduleInterleaved1F1B)
    zero_bubble         ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24; torch's
                        ScheduleZBVZeroBubble): rank r holds chunk-stages r and 2 pp - 1 - r, a V
                        (rank 0 holds the first and the last chunk; rank pp-1 the two middle
                        ones, which pass activations to each other without communication)

Where the chunk-stages' unit ranges come from (`chunk_ranges`): the plan has one stage entry
per pipeline rank; under interleaved 1F1B and ZB-V, `StagePlacement.chunks` lists the unit
ranges of the rank's chunks in model order (the planner's `passes.partition.rank_chunks`),
which the runtime checks tile the model in the layout above. A plan without `chunks` (made
before they were recorded, or by hand) gives each rank its number of units: rank r's range
is split into v chunks as evenly as possible (earlier chunks take the remainder) and laid
out in the schedule's order, so every rank runs as many units as the plan gave it.

Every stage keeps the user's modules and their parameter names, so state dicts and plan
placements match the unsplit model. torch's tracer frontend (`pipeline()`) is not used: it
sends a value made on stage i straight to stage j > i + 1 and then fails in backward on such
skip connections (RoPE tables built in stage 0; see docs/torch_notes.md).

How a model is cut (`stage_module`, the rule `ir.facts.pipeline_cut`):
- a model may define `pipeline_stage(first_unit, last_unit, units) -> nn.Module` itself;
- the built-in zoo `Transformer` (and models of the same shape: `embed`, optional
  `pos_embed`, `layers`, `norm`, `lm_head`, optional `rope_cos`/`rope_sin` buffers) is cut by
  `TransformerStage`;
- HuggingFace decoder-only models (`LlamaForCausalLM` and the like: `model.embed_tokens`,
  `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`) are cut by `HFDecoderStage`;
- any other model with repeated layers is cut from its exported graph (`graph_stages`):
  torch.export at the micro-batch's input shape (`ModelRef.input`), the units and the
  modules the glue calls kept as the user's modules, values that skip a stage passed through
  the stages between. The tracer refuses pp at plan time when a unit runs twice or out of
  order, and `meshplan.trace` makes the cut once on fake tensors (`rehearse_pipeline_cut`),
  so what torch.export cannot capture is refused when the plan is made.

What the loss sees (`model_output`): the last chunk-stage returns the logits tensor, which
the loss gets as the unsplit model's kind of output, so one `loss_fn` serves with and without
PP: for a HuggingFace model the ModelOutput class its forward returns (only `.logits` set),
or `(logits,)` under `config.return_dict=False`; for other models the tensor, as they return
it (a model's own `pipeline_stage` returns from its last stage what its forward returns); a
model cut from its graph gets its output rebuilt from the exported output structure (every
tensor it returns, e.g. BART's logits and encoder state, in its ModelOutput).

Each chunk keeps only its own modules; the rest are dropped, so the optimizer and data
parallelism only see this rank's parameters.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import torch
from meshplan.ir.facts import pipeline_cut, tied_parameters
from meshplan.ir.parallel import Schedule
from meshplan.ir.plan import Plan
from meshplan.ir.rules import microbatch_problem, zero_bubble_zero3_problem
from meshplan.ir.trace import is_hf_decoder, is_transformers_model
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward
from torch.nn.parallel import DistributedDataParallel

from .errors import RuntimePlanError
from .graph_stages import GraphCut, graph_cut, on_device
from .mesh import RankContext
from .steps import Chunk, Chunks, Options, TiedWeight, whole_model
from .tensor_parallel import clean_name

# ZB-V runs exactly two chunks per rank (the V); the planner records virtual_stages=2 with it.
ZBV_CHUNKS = 2


# -- which units each chunk-stage runs, and which rank holds it ---------------------------------


def chunks_per_rank(plan: Plan) -> int:
    """Model chunks each pipeline rank runs under the plan's schedule (1, v, or 2 for ZB-V)."""
    p = plan.parallel
    if (p.pp or 1) == 1:
        return 1
    if p.schedule == Schedule.ZERO_BUBBLE:
        if p.virtual_stages not in (None, ZBV_CHUNKS):
            raise RuntimePlanError(
                f"runtime: schedule zero_bubble runs ZB-V with exactly 2 chunks per rank, but "
                f"the plan has virtual_stages={p.virtual_stages}"
            )
        return ZBV_CHUNKS
    if p.schedule == Schedule.INTERLEAVED_1F1B:
        return p.virtual_stages or 1
    return 1


def check_schedule(plan: Plan) -> None:
    """Refuse, with one line, schedule combinations that do not train correctly here."""
    p = plan.parallel
    if why := zero_bubble_zero3_problem(p.schedule, p.pp or 1, p.zero or 0):
        raise RuntimePlanError(f"runtime: {why}")


def check_microbatches(plan: Plan, n_microbatches: int) -> None:
    """Refuse a replica's micro-batch count its schedule cannot run (`ir.microbatch_problem`,
    what torch's schedule constructors refuse: 1F1B below pp, interleaved 1F1B off whole
    rounds)."""
    why = microbatch_problem(plan.parallel.schedule, plan.parallel.pp or 1, n_microbatches)
    if why:
        raise RuntimePlanError(f"runtime: {why}")


def rank_chunks(plan: Plan, pp_rank: int) -> list[int]:
    """The chunk-stage indices pipeline rank `pp_rank` holds, in its schedule's order."""
    pp, v = plan.parallel.pp or 1, chunks_per_rank(plan)
    if plan.parallel.schedule == Schedule.ZERO_BUBBLE and pp > 1:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(v)]


def chunk_ranges(plan: Plan) -> list[tuple[int, int]]:
    """Unit ranges `[first, last)` of the pp * v chunk-stages, in model order (see the module
    docstring for how the plan records them)."""
    pp, v = plan.parallel.pp or 1, chunks_per_rank(plan)
    stages = sorted(plan.stages, key=lambda s: s.index)
    if len(stages) != pp:
        raise RuntimePlanError(f"runtime: the plan lists {len(stages)} stages but pp={pp}")
    out: dict[int, tuple[int, int]] = {}
    for r, s in enumerate(stages):
        listed = tuple(getattr(s, "chunks", ()) or ())
        if v == 1:
            out[r] = (s.first_unit, s.last_unit)
            continue
        if listed:
            if len(listed) != v:
                raise RuntimePlanError(
                    f"runtime: stage {s.index} lists {len(listed)} chunks but "
                    f"{plan.parallel.schedule} runs {v} per rank"
                )
            ranges = [tuple(c) for c in listed]
        else:  # one range per rank: split it into v chunks, earlier chunks take the remainder
            n = s.num_units
            if n < v:
                raise RuntimePlanError(
                    f"runtime: stage {s.index} has {n} units, fewer than the {v} chunks per "
                    f"rank that {plan.parallel.schedule} needs"
                )
            sizes = [n // v + (1 if k < n % v else 0) for k in range(v)]
            ranges = [(0, size) for size in sizes]  # placed in model order below
        for c, rng in zip(rank_chunks(plan, r), ranges):
            out[c] = rng
    ordered = [out[c] for c in range(pp * v)]
    if v > 1 and not any(getattr(s, "chunks", ()) for s in stages):
        first, placed = 0, []
        for _, size in ordered:
            placed.append((first, first + size))
            first += size
        ordered = placed
    first = 0
    for c, (a, b) in enumerate(ordered):
        if a != first or b <= a:
            raise RuntimePlanError(
                f"runtime: chunk-stage {c} runs units [{a}, {b}) but the previous one ends at "
                f"{first}; the plan's chunks must tile the model in order"
            )
        first = b
    if first != len(plan.model.units):
        raise RuntimePlanError("runtime: the plan's stages do not cover the model's units")
    return ordered


def chunk_unit_paths(plan: Plan, chunk: int) -> list[str]:
    """Module paths of the repeated units chunk-stage `chunk` runs."""
    first, last = chunk_ranges(plan)[chunk]
    return [u for u in plan.model.units[first:last] if not u.startswith("<")]


# -- cutting a model ------------------------------------------------------------------------


class TransformerStage(nn.Module):
    """Units `[first, last)` of a zoo-shaped decoder: prologue (embedding), some layers,
    epilogue (final norm + LM head). Attribute names equal the model's, so parameter names do.

    forward: stage 0 takes tokens, the others the hidden state; the last returns logits.
    """

    def __init__(self, model: nn.Module, first: int, last: int, units: tuple[str, ...]) -> None:
        super().__init__()
        container = _container_name(units)
        self.has_prologue = first == 0 and units[0] == "<prologue>"
        self.has_epilogue = last == len(units) and units[-1] == "<epilogue>"
        self.gpt_positions = hasattr(model, "pos_embed")
        if self.has_prologue:
            self.embed = model.embed
            if self.gpt_positions:
                self.pos_embed = model.pos_embed
        _keep_units(self, model, container, units[first:last])
        self._container = container
        if self.has_epilogue:
            self.norm = model.norm
            self.lm_head = model.lm_head
        for buf in ("rope_cos", "rope_sin"):
            if hasattr(model, buf):
                self.register_buffer(buf, getattr(model, buf), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_prologue:
            tokens = x
            x = self.embed(tokens)
            if self.gpt_positions:
                x = x + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        rope = (self.rope_cos, self.rope_sin) if hasattr(self, "rope_cos") else None
        for layer in _get_path(self, self._container).values():
            x = layer(x, rope)
        if self.has_epilogue:
            x = self.lm_head(self.norm(x))
        return x


class HFDecoderStage(nn.Module):
    """Units `[first, last)` of a HuggingFace decoder-only LM (`LlamaForCausalLM` shape:
    `model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`).

    Module paths equal the model's (`model.layers.3.self_attn...`, `lm_head`), so parameter
    names and the plan's placements match. Every stage recomputes the rotary tables from the
    positions (they are a function of the sequence length, not activations), and passes no
    attention mask: HF's SDPA attention is then causal (`is_causal`), as the unsplit model
    is for a batch without padding. Padding masks are not supported across stages. The
    positions count the hidden state the stage holds, as HF does; under sequence or context
    parallelism that is a share of the sequence, and `context_parallel.reposition_hf_decoder`
    (a hook on `model.rotary_emb`) gives the stage the whole sequence's positions.
    """

    def __init__(self, model: nn.Module, first: int, last: int, units: tuple[str, ...]) -> None:
        super().__init__()
        container = _container_name(units)  # "model.layers"
        self.has_prologue = first == 0 and units[0] == "<prologue>"
        self.has_epilogue = last == len(units) and units[-1] == "<epilogue>"
        inner = nn.Module()
        self.model = inner
        if self.has_prologue:
            inner.embed_tokens = model.model.embed_tokens
        inner.rotary_emb = model.model.rotary_emb
        _keep_units(self, model, container, units[first:last])
        self._container = container
        if self.has_epilogue:
            inner.norm = model.model.norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_prologue:
            x = self.model.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rope = self.model.rotary_emb(x, positions)
        for layer in _get_path(self, self._container).values():
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
            x = out[0] if isinstance(out, tuple) else out
        if self.has_epilogue:
            x = self.lm_head(self.model.norm(x))
        return x


def _keep_units(stage: nn.Module, model: nn.Module, container: str, units) -> None:
    """Put the given units under `container` in `stage`, in a ModuleDict keyed by the original
    indices, so names like "layers.5.attn..." survive."""
    kept = {}
    for u in units:
        if u.startswith("<"):
            continue
        if not u.startswith(container + "."):
            raise RuntimePlanError(f"runtime: unit {u!r} is not inside {container!r}")
        kept[u[len(container) + 1 :]] = model.get_submodule(u)
    parent = stage
    *heads, last = container.split(".")
    for h in heads:
        if not hasattr(parent, h):
            setattr(parent, h, nn.Module())
        parent = getattr(parent, h)
    setattr(parent, last, nn.ModuleDict(kept))


def _get_path(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path)


def _container_name(units: tuple[str, ...]) -> str:
    inner = [u for u in units if not u.startswith("<")]
    if not inner:
        raise RuntimePlanError("runtime: the plan has no repeated units to pipeline")
    heads = {u.rsplit(".", 1)[0] for u in inner}
    if len(heads) != 1:
        raise RuntimePlanError(f"runtime: units live in several containers {sorted(heads)}")
    return heads.pop()


def stage_module(
    model: nn.Module, plan: Plan, chunk: int, device: torch.device | None = None
) -> nn.Module:
    """The module chunk-stage `chunk` runs (see module docstring for how models are cut);
    `device`: where it will run (a graph cut's stages create their tensors there)."""
    first, last = chunk_ranges(plan)[chunk]
    units = plan.model.units
    cut = pipeline_cut(model)  # the rule the tracer's "pp" blocker states (`ir.facts`)
    if cut == "hook":
        return model.pipeline_stage(first, last, units)
    if cut == "hf_decoder":
        return HFDecoderStage(model, first, last, units)
    if cut == "graph":
        return on_device(_graph_cut(model, plan).stages[chunk], device)
    return TransformerStage(model, first, last, units)


def model_chunks(model: nn.Module, ctx: RankContext) -> Chunks:
    """This rank's chunks of `model`, moved to its device: under a pipeline its chunk-stages
    (`rank_chunks`, `stage_module`), each with the units it runs; else the whole model, one
    chunk holding every unit. Every later step runs on each of them and sees only their
    modules and parameters."""
    plan = ctx.plan
    check_schedule(plan)
    if ctx.num_stages > 1:
        chunks = tuple(
            Chunk(c, stage_module(model, plan, c, ctx.device), tuple(chunk_unit_paths(plan, c)))
            for c in rank_chunks(plan, ctx.stage_index)
        )
    else:
        chunks = whole_model(model, tuple(u for u in plan.model.units if not u.startswith("<")))
    for chunk in chunks:
        chunk.module.to(ctx.device)
    return chunks


def _graph_cut(model: nn.Module, plan: Plan) -> GraphCut:
    """The plan's chunk-stages of a model cut from its exported graph (`graph_stages`), with
    a zero micro-batch of the input the plan records (its sequence cut to the cp share)."""
    if plan.model.input is None:
        raise RuntimePlanError(
            f"runtime: the plan does not record {plan.model.name}'s input (made before "
            "plans did), which cutting it into pipeline stages needs: make the plan again"
        )
    dtype, shape = plan.model.input
    shape = list(shape)
    cp = plan.parallel.cp or 1
    if cp > 1 and shape:
        shape[0] //= cp  # the runner cuts dim 1 (the sequence) under context parallelism
    held = next(iter(model.parameters()), None)
    on = held.device if held is not None else torch.device("cpu")
    example = torch.zeros(
        (plan.parallel.micro_batch, *shape), dtype=getattr(torch, dtype), device=on
    )
    ranges = chunk_ranges(plan)
    unit_chunk = {}
    epilogue = len(ranges) - 1
    for c, (a, b) in enumerate(ranges):
        for i in range(a, b):
            u = plan.model.units[i]
            if u == "<epilogue>":
                epilogue = c
            elif not u.startswith("<"):
                unit_chunk[u] = c
    return graph_cut(model, example, unit_chunk, len(ranges), epilogue)


def model_output(model: nn.Module, plan: Plan) -> Callable[[object], object]:
    """How the last chunk-stage's output becomes what `model(inputs)` returns: read from the
    unsplit model before it is cut (`as_model_output`), or from its exported graph."""
    if (plan.parallel.pp or 1) > 1 and pipeline_cut(model) == "graph":
        return _graph_cut(model, plan).model_output
    return as_model_output(model)


def as_model_output(model: nn.Module) -> Callable[[torch.Tensor], object]:
    """How the last chunk-stage's logits become the kind of object `model(inputs)` returns
    (see the module docstring), read from the unsplit model before it is cut: for a
    HuggingFace decoder its forward's return annotation (a `ModelOutput` class; the
    `CausalLMOutputWithPast` of every `*ForCausalLM` where the annotation cannot be read), or
    a 1-tuple when its config turns `return_dict` off; the logits as they are otherwise."""
    if not (is_hf_decoder(model) and is_transformers_model(model)):
        return lambda logits: logits
    if not getattr(getattr(model, "config", None), "return_dict", True):
        return lambda logits: (logits,)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    try:
        hint = typing.get_type_hints(type(model).forward).get("return")
    except Exception:  # unresolvable annotations: the causal LMs' class
        hint = None
    # `-> CausalLMOutputWithPast`, or `Union[Tuple, CausalLMOutputWithPast]` (older releases)
    found = [c for c in (hint, *typing.get_args(hint)) if isinstance(c, type)]
    found = [c for c in found if issubclass(c, ModelOutput)] or [CausalLMOutputWithPast]
    cls = found[0]
    return lambda logits: cls(logits=logits)


# -- schedules --------------------------------------------------------------------------------


class _Stage(PipelineStage):
    """torch's PipelineStage, with its first-step shape inference kept away from DDP's reducer,
    and ZeRO-3's gradients kept sharded.

    ZeRO-3 (`keep_sharded`): torch's schedules run every backward but the last with FSDP2's
    gradient sync and resharding off, so the unsharded gradients (and parameters) of every
    unit stay in memory until the step's last micro-batch, ZeRO-2's memory, not the plan's
    ZeRO-3 (measured on 2 x 2 ranks, m = 4: 5 all-gathers and 1 reduce-scatter per unit and
    step, against the 8 and 4 a ZeRO-3 plan prices). With `keep_sharded` every micro-batch's
    backward reduce-scatters its gradients and reshards, as without a pipeline; the schedule's
    final `perform_reduce_grad` then finds nothing left to reduce (FSDP2's `post_backward` is
    a no-op without gradients).

    torch infers the stage's input/output shapes by calling the (DDP-wrapped) module once with
    gradients enabled and outside `no_sync`. DDP then arms its reducer (`prepare_for_backward`)
    although no backward of that forward will reach the parameters, so the first micro-batch's
    backward, meant to accumulate locally, all-reduces and records the gradient order for
    DDP's bucket rebuild; the last micro-batch's backward records it again. When no forward
    runs between those two backwards (exactly 2 micro-batches on stage 0 of 1F1B), DDP's next
    forward finds the order recorded twice and fails ("rebuilt parameter indices size is not
    same as original model parameters size"). Running the inference forward under `no_sync`
    leaves the reducer untouched (and saves step 0 one spurious all-reduce).
    """

    keep_sharded = False

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        if isinstance(module, DistributedDataParallel):
            with module.no_sync():
                return module(*args, **kwargs)
        return module(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        if not (
            self.keep_sharded and backward_type == "full" and isinstance(self.submod, FSDPModule)
        ):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None


def build_schedule(
    modules: list[nn.Module],
    chunks: list[int],
    ctx: RankContext,
    loss_fn,
    n_microbatches: int,
):
    """torch's PipelineStage for each of this rank's chunk-stages and the plan's schedule.

    `modules[i]` runs chunk-stage `chunks[i]` of `pp * v`. `loss_fn` must already be scaled
    for the mean over micro-batches (the runner weights it): torch's `scale_grads` divides
    after DDP/FSDP have reduced, which is wrong when replicas run different counts.
    """
    plan = ctx.plan
    total = (plan.parallel.pp or 1) * chunks_per_rank(plan)
    stages = [
        _Stage(m, c, total, ctx.device, group=ctx.group("pp")) for m, c in zip(modules, chunks)
    ]
    for stage in stages:
        stage.keep_sharded = (plan.parallel.zero or 0) == 3
    kind = plan.parallel.schedule
    check_microbatches(plan, n_microbatches)  # one line instead of torch's ValueError
    if kind in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        cls = ScheduleGPipe if kind == Schedule.GPIPE else Schedule1F1B
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if kind == Schedule.INTERLEAVED_1F1B:
        cls = ScheduleInterleaved1F1B
    elif kind == Schedule.ZERO_BUBBLE:
        cls = ScheduleZBVZeroBubble
    else:
        raise RuntimePlanError(f"runtime: schedule {kind} is not supported")
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


# -- weights tied across stages ---------------------------------------------------------------


def tied_across_stages(model: nn.Module, plan: Plan) -> tuple[TiedWeight, ...]:
    """(names, pipeline ranks holding a copy) of every weight the model ties (one tensor under
    several names: input and output embeddings) whose names fall on two or more pipeline
    ranks. Read from the unsplit model, cutting it as `stage_module` does. A rank holding the
    weight in two of its chunks (ZB-V puts the first and the last chunk on rank 0) is refused:
    its chunks' data-parallel wrappers would each reduce the same tensor."""
    ties = tied_parameters(model)
    if not ties or (plan.parallel.pp or 1) == 1:
        return ()
    held: dict[int, set[str]] = {}  # chunk -> tied names it holds
    wanted = {n for names in ties for n in names}
    pp = plan.parallel.pp or 1
    for r in range(pp):
        for c in rank_chunks(plan, r):
            stage = stage_module(model, plan, c)
            held[c] = {n for n, _ in stage.named_parameters(remove_duplicate=False)} & wanted
    out = []
    for names in ties:
        ranks = []
        for r in range(pp):
            chunks = [c for c in rank_chunks(plan, r) if held[c] & set(names)]
            if len(chunks) > 1:
                raise RuntimePlanError(
                    f"runtime: {' and '.join(names)} are one tensor and pipeline rank {r} holds "
                    f"it in two chunks ({plan.parallel.schedule}); use schedule 1f1b or "
                    "interleaved_1f1b for this model"
                )
            if chunks:
                ranks.append(r)
        if len(ranks) > 1:
            out.append((tuple(names), tuple(ranks)))
    return tuple(out)


class TiedGradients:
    """Gradients of a weight tied across pipeline stages, summed over the pipeline ranks that
    hold a copy (Megatron-LM's embedding group). With input and output embeddings tied, stage
    0 trains the embedding and the last stage the LM head: two copies of one weight, equal at
    the start (every rank builds the model identically). After each stage's data-parallel
    reduction, adding the copies' gradients gives each the tied weight's gradient, so the
    optimizer keeps them equal. `finish()` runs after backward, before the optimizer; for
    DTensor gradients (TP, ZeRO) the local shards are added (the copies are sharded alike).
    One all-reduce of the weight's (local) size per step: not priced by the cost model."""

    def __init__(self, params: list[nn.Parameter], group) -> None:
        self.params, self.group = params, group

    def finish(self) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for p in self.params:
            if p.grad is None:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=self.group)


def apply_tied_gradients(
    chunks: Chunks, ctx: RankContext, options: Options
) -> TiedGradients | None:
    """The `TiedGradients` of this rank for the weights tied across pipeline stages
    (`options.ties`, `tied_across_stages`) over its chunks as data parallelism wrapped them:
    their gradients summed over the stages after the dp reduction. Every rank calls it: one
    process group per tie and (dp, cp, tp) coordinate, created in the same order everywhere."""
    import torch.distributed as dist

    ties = options.ties
    modules = [chunk.module for chunk in chunks]
    if not ties:
        return None
    if ctx.whole is not None:
        raise RuntimePlanError(
            "runtime: weights tied across pipeline stages with per-group tp are not supported; "
            "plan without per-group tp for this model"
        )
    grid = ctx.mesh.mesh  # global ranks, axes (pp, dp, cp, tp)
    me = dist.get_rank()
    params: list[nn.Parameter] = []
    mine = None
    for names, pp_ranks in ties:
        for d in range(grid.shape[1]):
            for c in range(grid.shape[2]):
                for t in range(grid.shape[3]):
                    ranks = [int(grid[r, d, c, t]) for r in pp_ranks]
                    group = dist.new_group(ranks)
                    if me in ranks:
                        mine = group
        if ctx.stage_index in pp_ranks:
            for m in modules:
                for n, p in m.named_parameters(remove_duplicate=False):
                    if clean_name(n) in names and all(p is not q for q in params):
                        params.append(p)
    return TiedGradients(params, mine) if params else None
