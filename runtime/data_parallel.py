"""Data parallelism by ZeRO stage: DDP or FSDP2 over the plan's dp axis.

How the plan's ZeRO stage maps onto torch (honestly: torch has no separate ZeRO-1/2):

    zero=0  DistributedDataParallel (gradients all-reduced in buckets). With tensor
            parallelism the parameters are DTensors, which DDP does not take; the FSDP2-based
            `replicate()` does the same all-reduce on the dp axis instead (also under the
            zero-bubble schedule, see `_wrap_module`).
    zero=1  FSDP2 `fully_shard(reshard_after_forward=False)`: parameters, gradients and
    zero=2  optimizer states are sharded between steps; the parameters stay gathered from
            forward to the end of backward, so per micro-batch there is one all-gather and
            one reduce-scatter, as ZeRO-2 has. ZeRO-1 (only optimizer states sharded) is
            approximated by the same: it holds less memory than the plan assumed, never more.
    zero=3  FSDP2 `fully_shard(reshard_after_forward=True)`: parameters re-gathered for
            backward (two all-gathers and one reduce-scatter per unit and micro-batch).

FSDP2 wraps each repeated unit (transformer layer) and then the root, so communication is
per layer and overlaps with compute.

Coded traffic (`dp_coding`, `install_gradient_coding`): the plan records, per stage, how its
data-parallel collectives travel (`plan.compression.decisions`: raw, lossless ZipCCL-style
coding, int8 AGoQ-style gradients). The runtime runs each decision on torch's own extension
points: a DDP comm hook (`compressed.lossless_allreduce_hook`, `quantize.
quantized_allreduce_hook`), FSDP2's custom reduce-scatter and all-gather
(`compressed.LosslessReduceScatter` / `LosslessAllGather`, `quantize.QuantizedReduceScatter`).
FSDP2's `replicate()` (zero=0 with TP or under ZB-V) has no hook on its all-reduce, so a coded
plan leaves such a module unwrapped and reduces its gradients after backward in one coded
all-reduce (`CodedGradients`), which is what `replicate` would have done, coded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from meshplan.ir.parallel import Schedule
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from . import compressed as cc
from . import quantize as Q
from .mesh import RankContext, data_parallel_context
from .steps import AfterBackward, Chunk, Chunks, Options
from .tensor_parallel import clean_name, placement_of

# torch 2.13 renamed `broadcast_buffers`; the new flag still syncs once at construction.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


@dataclass(frozen=True, slots=True)
class DataParallel:
    """What `apply_data_parallel` leaves the runner: the chunks as wrapped, the context their
    gradients are averaged on, and the reductions to run after backward."""

    chunks: Chunks  # DDP, FSDP2 or unwrapped modules, in the order of the chunks given
    context: RankContext  # dp, or dp x cp merged (`mesh.data_parallel_context`)
    after_backward: tuple[AfterBackward, ...] = ()  # `CodedGradients`, `HeteroGradients`


def apply_data_parallel(chunks: Chunks, ctx: RankContext, options: Options) -> DataParallel:
    """Average the gradients over the plan's replicas: each chunk wrapped for the plan's dp
    degree and ZeRO stage (module docstring; with cp > 1 over dp x cp), with the plan's
    coded traffic for this stage (`dp_coding`). Last, so it sees the final parameters
    (tensor parallelism's DTensors) and wraps the checkpointed units.

    Expert parameters (`options.experts`) are left to expert parallelism: under ZeRO > 0
    every experts module first becomes an FSDP2 unit over its own replicas (FSDP2 wraps
    bottom-up), under ZeRO-0 the handle reduces them after backward; their coded traffic is
    installed last. Per-group TP wraps nothing (replicas shard differently): after backward
    `HeteroGradients` averages over every group's replicas.
    """
    hetero = ctx.whole is not None
    dp_ctx = ctx if hetero else data_parallel_context(ctx)
    coding = dp_coding(ctx.plan, ctx.stage_index)  # the plan's coded DP traffic of this stage
    experts = options.experts
    if experts is not None:
        experts.shard_over_replicas(ctx.plan.parallel.zero or 0)
    split = ctx.num_stages > 1 and ctx.plan.parallel.schedule == Schedule.ZERO_BUBBLE
    wrapped: list[Chunk] = []
    after: list[AfterBackward] = []
    for chunk in chunks:
        m = chunk.module
        if experts is not None:
            experts.ignore_in_ddp(m)  # names as DDP will see them (after recompute wrappers)
        ignored = {q for q in m.parameters() if experts is not None and experts.owns(q)}
        if hetero:
            wrapped.append(chunk)
            continue
        coded = coding.gradients[0] != "raw"
        w = _wrap_module(
            m, dp_ctx, list(chunk.units), ignored=ignored, split_backward=split, coded=coded
        )
        wrapped.append(dataclasses.replace(chunk, module=w))
        handle = install_gradient_coding(w, dp_ctx, coding, ignored=ignored)
        if handle is not None:
            after.append(handle)
    if hetero:
        after.append(HeteroGradients(ctx, [c.module for c in wrapped]))
    if experts is not None:
        experts.install_coding(coding.experts, coding.expert_weights)
    return DataParallel(tuple(wrapped), dp_ctx, tuple(after))


def _wrap_module(
    module: nn.Module,
    ctx: RankContext,
    unit_paths: list[str],
    *,
    ignored: set[nn.Parameter] | None = None,
    split_backward: bool = False,
    coded: bool = False,
) -> nn.Module:
    """Wrap `module` for the plan's dp degree and ZeRO stage (see module docstring).

    `coded`: the plan codes this stage's gradient reduction; where `replicate()` would be
    used (it has no hook) the module is returned unwrapped for `CodedGradients`.

    `ignored` parameters (expert shards, left to expert parallelism, which reduces them over
    their own replicas: under ZeRO > 0 in FSDP2 units of its own, wrapped before this) stay
    out of the dense units (`fully_shard(ignored_params=...)`); DDP is told by name
    beforehand (`ExpertParallel.ignore_in_ddp`). `split_backward` (zero-bubble schedules,
    which run the input and the weight gradients as separate passes) uses `replicate()` for
    zero=0: torch's pipeline stage drives FSDP2-style modules through split backwards, while
    its DDP path arms the reducer on the wrong pass (measured: gradients off by ~1e-2).
    """
    plan = ctx.plan
    if (plan.parallel.dp or 1) == 1:
        return module
    zero = plan.parallel.zero or 0
    dp_mesh = ctx.submesh("dp")
    if zero == 0:
        if has_dtensor_params(module) or split_backward:
            if coded:
                return module
            from torch.distributed._composable.replicate_with_fsdp import replicate

            return replicate(module, mesh=dp_mesh, ignored_params=ignored or None)
        # Buffers are not re-broadcast every forward: they start equal (same seed on every
        # rank, as FSDP2 also assumes) and FSDP2 does not broadcast them either.
        return DistributedDataParallel(module, process_group=ctx.group("dp"), **_NO_BUFFER_SYNC)
    reshard = zero == 3
    ignored = set(ignored or ())
    for path in unit_paths:
        unit = module.get_submodule(path)
        mine = {p for p in unit.parameters() if p in ignored}
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=mine or None)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    return module


def gradient_sync(module: nn.Module, enabled: bool, *, keep_gathered: bool = False):
    """A context in which backward does (or skips) the dp gradient reduction.

    Used for gradient accumulation over micro-batches: only the last one reduces. With
    `keep_gathered` (ZeRO-1/2) FSDP also keeps the parameters gathered after a backward that
    does not reduce, so a step runs one all-gather and one reduce-scatter whatever its number
    of micro-batches (as ZeRO-1/2 are priced, and as replicas with uneven micro-batch shares
    need: their collectives must pair up).
    """
    if isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    if isinstance(module, FSDPModule) or hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(enabled)
        if keep_gathered and hasattr(module, "set_reshard_after_backward"):
            module.set_reshard_after_backward(enabled)
    return contextlib.nullcontext()


# -- coded traffic from the plan's decisions ----------------------------------------------------

Method = tuple[str, int]  # ("raw" | "lossless" | "int8", pipelined chunks)
RAW: Method = ("raw", 1)


@dataclass(frozen=True, slots=True)
class DpCoding:
    """How one pipeline stage's data-parallel traffic travels, from the plan: the gradient
    reduction (all-reduce or reduce-scatter), the weight all-gather (ZeRO > 0), and the same
    two of the expert parameters over their replicas (EP)."""

    gradients: Method = RAW
    weights: Method = RAW
    experts: Method = RAW
    expert_weights: Method = RAW

    @property
    def active(self) -> bool:
        return (self.gradients, self.weights, self.experts, self.expert_weights) != (RAW,) * 4


def dp_coding(plan, stage: int) -> DpCoding:
    """The `DpCoding` of pipeline stage `stage` from `plan.compression.decisions`: its "dp
    stage <stage> ..." entries, in the order `cost_model.pricer.Pricer.dp_traffic` lists the
    collectives (dense parameters, then experts), for one group (or group pair) of the stage."""
    prefix = f"dp stage {stage} "
    mine = [d for d in plan.compression.decisions if d.group.startswith(prefix)]
    if not mine:
        return DpCoding()
    mine = [d for d in mine if d.group == mine[0].group]
    grads = [(d.method, d.chunks) for d in mine if d.tensor == "gradients"]
    weights = [(d.method, d.chunks) for d in mine if d.tensor == "weights"]
    # Weight all-gathers per parameter set (and per reduction): 2 under ZeRO-3, else 1 (0).
    per = len(weights) // len(grads) if grads else 0
    return DpCoding(
        gradients=grads[0] if grads else RAW,
        weights=weights[0] if weights else RAW,
        experts=grads[1] if len(grads) > 1 else RAW,
        expert_weights=weights[per] if per and len(weights) > per else RAW,
    )


class CodedGradients:
    """The data-parallel gradient average of a module left unwrapped (see the module
    docstring): after backward, one all-reduce (average over `group`) of every gradient,
    flattened (local shards of DTensor gradients), losslessly coded (`compressed.all_reduce`,
    the plan's chunk count) or int8 (`quantize.quantized_all_reduce`)."""

    def __init__(self, params: list[nn.Parameter], group, method: Method) -> None:
        self.params, self.group, self.method = params, group, method

    def finish(self) -> None:
        """Average the gradients over the group (call once per step, after backward)."""
        if not self.params:
            return
        grads = []
        for p in self.params:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
                p.grad = g
            grads.append(g._local_tensor if isinstance(g, DTensor) else g)
        flat = torch.cat([g.reshape(-1) for g in grads])
        reduced = reduce_flat(flat, self.group, self.method, op="avg")
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(reduced[offset : offset + n].view_as(g))
            offset += n


def reduce_flat(flat: torch.Tensor, group, method: Method, op: str = "sum") -> torch.Tensor:
    """`flat` reduced (sum or avg) over `group` by the plan's method: raw (`dist.all_reduce`),
    lossless (`compressed.all_reduce`, bit-exact `reduce_reference`) or int8
    (`quantize.quantized_all_reduce`)."""
    kind, chunks = method
    if kind == "lossless":
        return cc.all_reduce(
            flat,
            group,
            op=op,
            chunk_numel=cc.chunk_numel(flat.numel() // max(1, dist.get_world_size(group)), chunks),
        )
    if kind == "int8":
        return Q.quantized_all_reduce(flat, group, op=op)
    out = flat.clone()
    dist.all_reduce(out, group=group)
    if op == "avg":
        out /= dist.get_world_size(group)
    return out


def install_gradient_coding(
    module: nn.Module, ctx: RankContext, coding: DpCoding, *, ignored=()
) -> CodedGradients | None:
    """Run the plan's coded data-parallel traffic for one wrapped module (`_wrap_module`'s
    result on the dp or dp x cp context `ctx`): a comm hook on DDP; custom reduce-scatter /
    all-gather on every FSDP2 module; for a module left unwrapped (`coded=True` where
    `replicate()` would be), the `CodedGradients` the runner calls after backward. Returns that
    handle, or None."""
    plan = ctx.plan
    if (plan.parallel.dp or 1) == 1 or not coding.active:
        return None
    group = ctx.group("dp")
    kind, chunks = coding.gradients
    if isinstance(module, DistributedDataParallel):
        if kind == "lossless":
            module.register_comm_hook(
                cc.LosslessHookState(group, chunks), cc.lossless_allreduce_hook
            )
        elif kind == "int8":
            module.register_comm_hook(Q.QuantHookState(group), Q.quantized_allreduce_hook)
        return None
    skip = {id(p) for p in ignored}
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if fsdp:
        for m in fsdp:
            # units of ignored parameters only (the experts' own, `ExpertParallel`) are coded
            # by their owner
            mine = list(m.parameters())
            if mine and all(id(q) in skip for q in mine):
                continue
            code_fsdp_module(m, coding.gradients, coding.weights)
        return None
    if kind == "raw":
        return None
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in skip]
    return CodedGradients(params, group, coding.gradients)


def plan_gradient_method(plan, stage: int = 0) -> tuple[str, int]:
    """(method, chunks) of stage `stage`'s data-parallel gradient reduction in `plan`:
    "raw", "lossless" or "int8" (`dp_coding`)."""
    return dp_coding(plan, stage).gradients


@dataclass
class PlanHooks:
    """What `install_from_plan` set up: `activations` is a context manager to run forward
    passes under (saved-activation quantization, or a no-op), `gradients` the DP gradient
    method installed ("raw": nothing installed)."""

    activations: object
    gradients: str = "raw"


def install_from_plan(
    plan, model: nn.Module, *, stage: int = 0, ddp=None, fsdp_modules=(), group=None
) -> PlanHooks:
    """Apply `plan`'s quantization and DP-traffic decisions to a model wrapped by hand
    (`runtime.apply` does all of this itself; see `install_gradient_coding`).

    - saved activations: returns `PlanHooks.activations`, an `ActivationQuantizer` with the
      plan's widths for `stage` (enter it around each forward), or a no-op context;
    - DP traffic: on `ddp` (a DistributedDataParallel) registers `quantize.quantized_allreduce_hook`
      (int8) or `compressed.lossless_allreduce_hook` (lossless, the plan's chunk count); on
      each FSDP2 module of `fsdp_modules` sets `quantize.QuantizedReduceScatter` (int8) or
      `compressed.LosslessReduceScatter` (lossless), and `compressed.LosslessAllGather` where
      the plan codes the weight all-gather."""
    bits = Q.plan_activation_bits(plan, model, stage)
    acts = Q.ActivationQuantizer(model, bits) if bits else contextlib.nullcontext()
    coding = dp_coding(plan, stage)
    method, chunks = coding.gradients
    installed = "raw"
    if ddp is not None and method == "int8":
        ddp.register_comm_hook(Q.QuantHookState(group), Q.quantized_allreduce_hook)
        installed = "int8"
    elif ddp is not None and method == "lossless":
        ddp.register_comm_hook(cc.LosslessHookState(group, chunks), cc.lossless_allreduce_hook)
        installed = "lossless"
    for m in fsdp_modules:
        if method == "int8":
            m.set_custom_reduce_scatter(Q.QuantizedReduceScatter())
            installed = "int8"
        elif method == "lossless":
            m.set_custom_reduce_scatter(cc.LosslessReduceScatter(chunks))
            installed = "lossless"
        if coding.weights[0] == "lossless":
            m.set_custom_all_gather(cc.LosslessAllGather(coding.weights[1]))
    return PlanHooks(acts, installed)


def code_fsdp_module(module: FSDPModule, gradients: Method, weights: Method) -> None:
    """Run one FSDP2 unit's reduce-scatter (`gradients`: lossless or int8) and all-gather
    (`weights`: lossless) coded, on FSDP2's custom collectives."""
    kind, chunks = gradients
    if kind == "lossless":
        module.set_custom_reduce_scatter(cc.LosslessReduceScatter(chunks))
    elif kind == "int8":
        module.set_custom_reduce_scatter(Q.QuantizedReduceScatter())
    if weights[0] == "lossless":
        module.set_custom_all_gather(cc.LosslessAllGather(weights[1]))


# -- per-group TP: gradients of replicas with different TP degrees ------------------------------


class HeteroGradients:
    """Per-group TP (`StagePlacement.group_tp`): average the gradients of one pipeline stage
    over replicas whose device groups use different TP degrees, after backward, the way the
    cost model prices it (`cost_model.pricer.Pricer.hetero_dp_traffic`). Each stage has its
    own degrees (stages may differ), so its own L below.

    Replicas shard a tensor-parallel parameter into different numbers of pieces, so no one
    collective pairs their shards. Every parameter the plan places `S(d)` is cut into
    L = lcm(tp_g) pieces along dim d; a rank at tp index t of a group with degree tp holds the
    L / tp consecutive pieces starting at t L / tp (all L when its tp is 1, where the
    parameter is a plain tensor). For each piece j there is one process group of the ranks
    that hold it: one per (replica, cp rank) of the stage. Each rank all-reduces, in every
    group of its pieces, one flat buffer: piece j of each sharded gradient, then every
    TP-replicated gradient (norms) whole (replicated parameters are the same on the tp ranks
    of a replica, so any piece group carries them once per replica), and divides by dp * cp.
    Each replica's loss is already weighted by its share of the samples (`apply`), so the
    average is the one-process gradient. ZeRO-0 only (the plan guarantees it).

    Every rank must construct it (it creates the piece groups of every stage, in order).
    """

    def __init__(self, ctx: RankContext, modules: list[nn.Module]) -> None:
        whole = ctx.whole_plan
        p = whole.parallel
        # Each stage's degrees by group, and its L (stages may differ: `stage_tp_problem`).
        tps = [{g: st.tp_of(g, p.tp) for g, _ in st.replicas} for st in whole.stages]
        stage = ctx.stage_index
        self.pieces = math.lcm(*tps[stage].values())
        my_tp = tps[stage][ctx.assignment.group]
        self.divisor = (p.dp or 1) * (p.cp or 1)
        ranks = sorted((r for r in whole.ranks if r.coords is not None), key=lambda r: r.rank)
        torch_rank = {r.rank: i for i, r in enumerate(ranks)}
        me = torch_rank[ctx.whole_assignment.rank] if ctx.whole_assignment else dist.get_rank()
        self.groups: list[tuple[int, dist.ProcessGroup]] = []  # (piece, group) of mine
        for s in range(p.pp or 1):
            pieces = math.lcm(*tps[s].values())
            for j in range(pieces):
                members = sorted(
                    torch_rank[r.rank]
                    for r in ranks
                    if r.coords[0] == s and r.coords[3] == j * tps[s][r.group] // pieces
                )
                group = dist.new_group(members)
                if me in members:
                    self.groups.append((j, group))
        self.per_rank = self.pieces // my_tp  # pieces this rank holds
        self.first_piece = ctx.coord("tp") * self.per_rank
        self.params: list[tuple[nn.Parameter, int | None]] = []  # (parameter, sharded dim)
        placements = dict(whole.placements)
        for module in modules:
            for name, q in module.named_parameters():
                if not q.requires_grad:
                    continue
                placed = placement_of(clean_name(name), whole, placements)
                dim = int(placed[2:-1]) if placed and placed.startswith("S(") else None
                if isinstance(q, DTensor):
                    kind = q.placements[0]
                    local_dim = getattr(kind, "dim", None)
                    if local_dim != dim:
                        raise RuntimeError(
                            f"runtime: parameter {clean_name(name)} is {kind} on the tp mesh "
                            f"but the plan places it {placed}"
                        )
                if dim is not None and q.shape[dim] % self.pieces:
                    raise RuntimeError(
                        f"runtime: per-group TP cuts {clean_name(name)} into {self.pieces} "
                        f"pieces along dim {dim}, which has {q.shape[dim]} (not divisible)"
                    )
                self.params.append((q, dim))

    def _local_grad(self, q: nn.Parameter) -> torch.Tensor:
        g = q.grad
        if g is None:
            local = q.to_local() if isinstance(q, DTensor) else q
            return torch.zeros_like(local)
        if isinstance(g, DTensor):
            # DTensor's embedding backward gives the vocab-parallel weight a Replicate
            # gradient: lay it out as the parameter (a local slice; Partial: reduce-scatter).
            if g.placements != q.placements:
                g = q.grad = g.redistribute(q.device_mesh, q.placements)
            return g.to_local()
        return g

    def finish(self) -> None:
        """Average this rank's gradients over the replicas (call after backward, before the
        optimizer; SP's partial norm gradients must already be whole)."""
        grads = [self._local_grad(q) for q, _ in self.params]
        # Replicated gradients enter every piece group raw (each group averages them alike).
        raw = [g.clone() if dim is None else None for g, (_, dim) in zip(grads, self.params)]
        for j, group in self.groups:
            k = j - self.first_piece  # which of my pieces
            flat = []
            for g, r, (_, dim) in zip(grads, raw, self.params):
                if dim is None:
                    flat.append(r.reshape(-1))
                else:
                    size = g.shape[dim] // self.per_rank
                    flat.append(g.narrow(dim, k * size, size).reshape(-1))
            buf = torch.cat(flat) if flat else torch.zeros(0)
            dist.all_reduce(buf, group=group)
            buf /= self.divisor
            offset = 0
            for g, (_, dim) in zip(grads, self.params):
                if dim is None:
                    part = g
                else:
                    size = g.shape[dim] // self.per_rank
                    part = g.narrow(dim, k * size, size)
                n = part.numel()
                part.copy_(buf[offset : offset + n].view_as(part))
                offset += n
        for (q, _), g in zip(self.params, grads):
            if q.grad is None:
                q.grad = (
                    DTensor.from_local(g, q.device_mesh, q.placements, run_check=False)
                    if isinstance(q, DTensor)
                    else g
                )
