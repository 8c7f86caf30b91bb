"""Experts across ranks: expert parallelism (EP), expert tensor parallelism (ETP), and both.

The layout of the experts of every MoE module follows the plan's degrees:

    ep > 1, tp == 1   expert parallelism: stacked expert weights cut along dim 0 (the expert
                      dim) over the ep group, tokens all-to-all'd to their experts' owners
    ep == 1, tp > 1   expert tensor parallelism: the MoE is one tensor-parallel region, like
                      the MLP (Megatron-LM); every tp rank holds every expert, cut on the ffn dim
    ep > 1, tp > 1    both (Megatron-Core's expert TP under EP); needs sequence parallelism

Groups (`mesh.expert_groups`): ep divides dp and an ep group is ep consecutive dp ranks with
the same (pp, cp, tp) coordinates; its rank i holds experts `[i*E/ep, (i+1)*E/ep)`: every
parameter of the experts module is cut along dim 0, keeping its name.

EP: two dispatches, both exact against one process running the same MoE:

    "tokens"  (default; MoE modules of the zoo's shape, `tensor_parallel.is_zoo_moe`:
              `router(x_th) -> (weights_tk, experts_tk)`, `capacity(tokens)`, `top_k`,
              `experts`, optional `shared`)
              True uneven routing. Each rank routes its own tokens with the zoo's semantics
              (top-k; a choice beyond its expert's capacity, counted token-major, is dropped),
              sorts the kept (token, choice) rows by expert, exchanges the per-expert counts
              (one small all-to-all of E integers), then sends each row to the rank owning its
              expert with `all_to_all_single` and uneven splits (zero splits allowed). The
              owner runs its experts (rows padded per local expert to the largest count, so the
              experts module's own batched forward is used), and a second all-to-all with the
              splits swapped returns the outputs. Backward runs the same two all-to-alls in
              reverse. Only kept rows move: no capacity padding on the wire.
    "slots"   (any experts module with stacked weights whose forward maps per-expert slot
              buffers (E, capacity, hidden) -> (E, capacity, hidden), expert by expert; e.g. the
              zoo's `MoEExperts`, or a user module marked `stacked_experts = True`)
              The slot buffer is exchanged on the expert dim with equal splits, the local
              experts run on (E/ep, ep*capacity, hidden), and the result comes back the same
              way. Simplest; moves the capacity padding too. tp == 1 only (refused under TP).

ETP (zoo-shaped MoE modules; `ExpertTensorParallel`). The experts' stacked weights follow the
plan's tp placements (`passes.sharding`: Megatron's column/row rule on their last two dims:
w_up / w_gate (E, h, ffn) S(2), w_down (E, ffn, h) S(1), a column bias (E, 1, ffn) S(2)) and
become DTensors on the tp mesh; the experts module's own forward runs on their local shards
(`ExpertTensorParallel.run_on_shards`; the router's through `torch.func.functional_call`).
With ep == 1 the MoE is one region:

    x (b, s/tp, h) under SP, (b, s, h) without
      -> all-gather over tp (backward: reduce-scatter)   | without SP: identity (backward:
                                                         |   all-reduce)
      -> route on all the tokens (the same on every tp rank, so capacity drops are exactly
         one process's), dispatch to (E, capacity, h) slots, experts on their ffn shard
      -> combine: a partial sum over tp
      -> reduce-scatter to the sequence shard (backward: all-gather) | without SP: all-reduce
      + shared experts (a zoo MLP, column/row-parallel with its own region) on the input

which is what the cost model prices (`cost_model.graph_costs._tp_collectives`: the experts are
one row-parallel region of the block output's size). Replicated parameters get gradients
that are partial sums over tp: the router's (the routing weights scale partial outputs), and
a replicated experts parameter's (a row-parallel bias such as the GPT-style `b_down`, which
is applied on tp rank 0 only so that the reduction adds it once). They are Replicate
DTensors whose gradients are `Partial` DTensors, reduced over tp once per gradient reduction
like the norm weights under SP (FSDP2 / `replicate` do it, else
`tensor_parallel.reduce_partial_gradients`), as `cost_model.pricer.Pricer.sp_grad_sync`
prices them (with or without SP).

EP x TP (ep > 1, tp > 1; sequence parallelism required). Each tp rank routes ITS sequence
shard's tokens and sends the kept rows over its ep group as above; the destination
all-gathers the rows its tp peers received (uneven: the counts are all-gathered first, then
`all_to_all_single` with uneven splits, which gloo supports where the list-form all-gather
does not), runs its local experts on their ffn shard (experts cut on dim 0 over ep AND on
the ffn dim over tp), reduce-scatters the partial outputs back to the tp rank that received
each row (an uneven all-to-all and a local sum), then the all-to-all back and the combine,
which gives the sequence-sharded output directly. Routing per sequence shard gives each
shard its own capacity, so drops differ from one process unless the capacity never binds.

Gradients. Dense parameters stay data-parallel over the full dp (x cp) group. With ep == 1
the expert shards are ordinary TP parameters (DDP / FSDP2 reduce them over dp x cp). With
ep > 1 expert parameters are left out of DDP / `replicate` / the dense FSDP2 units; the
gradient a shard owner accumulates already sums the contributions of all ep (and tp) ranks'
tokens (they flow back through the all-to-all and the tp gather), so summing it over the
ranks holding the same shard (its R = dp/ep x cp replicas; same tp rank) and dividing by
dp*cp counts every dp x cp rank's mean loss once. How, by ZeRO stage, as the cost model
prices it (`cost_model.pricer.Pricer.dp_traffic`, `cost_model.memory`):

    zero=0   after backward `ExpertParallel.finish_gradients` all-reduces the expert gradients
             over the replicas (one flat buffer), / dp*cp
    zero>0   the expert parameters are sharded over their replicas, as Megatron-LM's
             distributed optimizer and torchtitan's FSDP over `dp_shard_mod_ep` do: every
             experts module is an FSDP2 unit of its own (`shard_over_replicas`) on the
             "replica" axis of the experts' mesh (`mesh.expert_groups`: axes (pp, ep,
             replica, tp) over the plan's rank grid), resharded after forward under ZeRO-3
             only, gradients reduce-scattered (sum, / dp*cp: FSDP2's divide factor) and
             parameters all-gathered over the replicas. Under EP x TP the parameters are
             DTensors on that mesh's tp axis, so FSDP2 shards them on the 2-D (replica, tp)
             mesh, as FSDP2 x TP does for dense parameters; their forward takes its local
             shards after FSDP2's pre-forward gather (`ExpertTensorParallel.run_on_shards`).
             Each unit cuts the first dim R divides and tp does not (dim 0, the local experts,
             first; `_replica_placement`), so every replica holds exactly 1/R. Gradient
             accumulation treats the units as the dense ones (`data_parallel.gradient_sync`
             reaches every FSDP2 module under the root: under ZeRO-1/2 they stay gathered
             until the last micro-batch). With one replica (R == 1) there is nothing to
             shard: zero=0's path, without collectives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from meshplan.ir.facts import is_hf_experts, is_zoo_moe
from meshplan.ir.rules import ep_experts_problem, ep_tp_problem
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.func import functional_call

from .data_parallel import Method, code_fsdp_module, reduce_flat
from .errors import RuntimePlanError
from .mesh import ExpertGroups, RankContext, expert_groups
from .steps import Chunks, Options
from .tensor_parallel import placement_of

MODES = ("tokens", "slots")


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` along dim 0 with (possibly uneven, zero) splits; backward sends the
    gradient back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group
        )
        return out, None, None, None


# -- tensor-parallel mappings of the MoE region (Megatron-LM's `mappings.py`) --------------------
# Written on torch.distributed directly: each is one collective each way, as the cost model
# prices them, with no DTensor dispatch in between.


def _all_gather_seq(x_bsh: torch.Tensor, group, size: int) -> torch.Tensor:
    """(b, s/tp, h) shards -> (b, s, h), tp rank order along the sequence."""
    xt = x_bsh.transpose(0, 1).contiguous()
    out = xt.new_empty((size * xt.shape[0], *xt.shape[1:]))
    dist.all_gather_single(out, xt, group=group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(y_bsh: torch.Tensor, group, size: int) -> torch.Tensor:
    """(b, s, h) partial sums -> this rank's (b, s/tp, h) sequence shard of their sum."""
    yt = y_bsh.transpose(0, 1).contiguous()
    out = yt.new_empty((yt.shape[0] // size, *yt.shape[1:]))
    dist.reduce_scatter_single(out, yt, group=group)
    return out.transpose(0, 1).contiguous()


class _GatherSequence(torch.autograd.Function):
    """Enter the region under SP: all-gather the sequence over tp; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group, size: int):
        ctx.group, ctx.size = group, size
        return _all_gather_seq(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group, ctx.size), None, None


class _ScatterSequence(torch.autograd.Function):
    """Leave the region under SP: reduce-scatter the partial sums to the sequence shards;
    backward all-gathers."""

    @staticmethod
    def forward(ctx, y, group, size: int):
        ctx.group, ctx.size = group, size
        return _reduce_scatter_seq(y, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group, ctx.size), None, None


class _CopyToRegion(torch.autograd.Function):
    """Enter the region without SP: identity; backward all-reduces the partial gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """Leave the region without SP: all-reduce the partial sums; backward is the identity."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """Uneven all-gather of rows over tp (`counts[j]` rows from rank j, concatenated in rank
    order), as one `all_to_all_single` sending this rank's rows to every peer; backward sums
    every peer's gradient of this rank's rows (an uneven reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, counts: list[int], group, size: int):
        n = x.shape[0]
        ctx.counts, ctx.group, ctx.size, ctx.n = counts, group, size, n
        mine = x.unsqueeze(0).expand(size, *x.shape).reshape(size * n, *x.shape[1:])
        return _exchange_rows(mine, counts, [n] * size, group)

    @staticmethod
    def backward(ctx, grad):
        back = _exchange_rows(grad, [ctx.n] * ctx.size, ctx.counts, ctx.group)
        return back.view(ctx.size, ctx.n, *grad.shape[1:]).sum(0), None, None, None


class _ScatterRows(torch.autograd.Function):
    """Uneven reduce-scatter of rows over tp: every rank holds partial sums of all the rows
    (`counts[j]` belong to rank j); rank j receives its rows from every peer and sums them.
    Backward all-gathers the gradients of the rows (an uneven all-gather)."""

    @staticmethod
    def forward(ctx, y, counts: list[int], group, size: int, rank: int):
        n = counts[rank]
        ctx.counts, ctx.group, ctx.size, ctx.n = counts, group, size, n
        got = _exchange_rows(y, [n] * size, counts, group)
        return got.view(size, n, *y.shape[1:]).sum(0)

    @staticmethod
    def backward(ctx, grad):
        n, size = ctx.n, ctx.size
        mine = grad.unsqueeze(0).expand(size, *grad.shape).reshape(size * n, *grad.shape[1:])
        return _exchange_rows(mine, ctx.counts, [n] * size, ctx.group), None, None, None, None


@dataclass(frozen=True)
class ExpertTensorParallel:
    """The tp side of the experts (see the module docstring): the tp mesh and group, this
    rank's place in it, and whether the MoE's input arrives sequence-sharded."""

    mesh: DeviceMesh  # 1-D, the tp axis
    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool

    def enter(self, x_bsh: torch.Tensor) -> torch.Tensor:
        """The region's input on every tp rank: all tokens, (b, s, h)."""
        if self.sequence_parallel:
            return _GatherSequence.apply(x_bsh, self.group, self.size)
        return _CopyToRegion.apply(x_bsh, self.group)

    def leave(self, y_bsh: torch.Tensor) -> torch.Tensor:
        """The region's partial output summed over tp: this rank's sequence shard under SP."""
        if self.sequence_parallel:
            return _ScatterSequence.apply(y_bsh, self.group, self.size)
        return _ReduceFromRegion.apply(y_bsh, self.group)

    def row_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Every tp rank's `counts` (the same shape on each), stacked in rank order."""
        flat = counts.reshape(-1).contiguous()
        out = flat.new_empty(self.size * flat.numel())
        dist.all_gather_single(out, flat, group=self.group)
        return out.view(self.size, *counts.shape)

    def gather_rows(self, x_rh: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return _GatherRows.apply(x_rh, counts, self.group, self.size)

    def scatter_rows(self, y_rh: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return _ScatterRows.apply(y_rh, counts, self.group, self.size, self.rank)

    def call(self, module: nn.Module, *args, once: bool = False):
        """`module(*args)` on this rank's local shards of its DTensor parameters (`views`)."""
        return functional_call(module, self.views(module, once), args)

    def views(self, module: nn.Module, once: bool = False) -> dict[str, torch.Tensor]:
        """This rank's local shards of `module`'s DTensor parameters, by name.

        Sharded parameters are used as they are. Replicated ones are handed on with partial
        gradients over tp (see the module docstring); `once`: they are applied on tp rank 0
        only (a row-parallel bias, added once by the region's reduction)."""
        views: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            if not isinstance(p, DTensor):
                continue
            if all(isinstance(pl, Shard) for pl in p.placements):
                views[name] = p.to_local()
                continue
            local = p.to_local(grad_placements=_partial_over_tp(p))
            views[name] = local * 0.0 if once and self.rank != 0 else local
        return views

    def run_on_shards(self, module: nn.Module, once: bool = False) -> None:
        """Make `module`'s own forward run on its local shards (`views`), taken each time it
        is called, inside its hooks: when `module` is an FSDP2 unit of its own (experts under
        EP x ZeRO > 0) its pre-forward hook has gathered the parameters by then, so the views
        are of the gathered (tp-sharded) weights. (`call` takes the views before the module's
        hooks run.)"""
        forward = module.forward

        def local_forward(*args, **kwargs):
            with _parameters_replaced(module, self.views(module, once)):
                return forward(*args, **kwargs)

        module.forward = local_forward


@contextlib.contextmanager
def _parameters_replaced(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """Within: `module`'s parameters named in `tensors` read as those tensors (as
    `torch.func.functional_call` does, without calling the module and so its hooks again)."""
    saved = []
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner)
        saved.append((sub, leaf, sub._parameters[leaf]))
        sub._parameters[leaf] = t
    try:
        yield
    finally:
        for sub, leaf, p in reversed(saved):
            sub._parameters[leaf] = p


def _partial_over_tp(p: DTensor) -> list[Placement]:
    """`p`'s placements with Replicate on the tp mesh dim made Partial (the gradient's
    placements when every tp rank holds a part of it)."""
    names = p.device_mesh.mesh_dim_names or ()
    tp_dim = names.index("tp") if "tp" in names else p.device_mesh.ndim - 1
    return [
        Partial() if i == tp_dim and isinstance(pl, Replicate) else pl
        for i, pl in enumerate(p.placements)
    ]


def _tensor_parallel(ctx: RankContext) -> ExpertTensorParallel:
    mesh = ctx.submesh("tp")
    return ExpertTensorParallel(
        mesh=mesh,
        group=ctx.group("tp"),
        size=ctx.size("tp"),
        rank=ctx.coord("tp"),
        sequence_parallel=bool(ctx.plan.parallel.sequence_parallel),
    )


@dataclass
class ExpertParallel:
    """This rank's expert shard, its groups, and the gradient / state handling of experts."""

    groups: ExpertGroups
    num_experts: int  # E, all ranks together
    grad_divisor: int  # dp * cp
    mode: str = "tokens"
    params: list[nn.Parameter] = field(default_factory=list)
    # The experts modules holding them (one per MoE layer of this rank's chunks).
    modules: list[nn.Module] = field(default_factory=list)
    # How the expert gradients travel (the plan's decision: `data_parallel.DpCoding.experts`).
    coding: tuple[str, int] = ("raw", 1)
    # EP x TP: the experts are also cut on the ffn dim over tp (None: tp == 1).
    tp: ExpertTensorParallel | None = None
    # ZeRO > 0: the experts modules are FSDP2 units over their replicas (`shard_over_replicas`),
    # which reduce their gradients themselves.
    sharded: bool = False

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.groups.ep

    def owns(self, p: torch.Tensor) -> bool:
        return any(p is q for q in self.params)

    def ignore_in_ddp(self, module: nn.Module) -> None:
        """Tell DDP (if it wraps `module` next) to leave the expert parameters alone."""
        names = [n for n, p in module.named_parameters() if self.owns(p)]
        if names:
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                module, names
            )

    def shard_over_replicas(self, zero: int) -> None:
        """ZeRO > 0: make every experts module an FSDP2 unit on the replica axis of the
        experts' mesh (module docstring), as the cost model prices the experts' states and
        traffic. Call after tensor parallelism and recomputation, before the dense units are
        wrapped (FSDP2 wraps bottom-up; the dense units then skip the experts' parameters).
        Nothing under ZeRO-0 or with one replica (`finish_gradients` reduces, or only
        divides)."""
        if zero == 0 or self.groups.replicas == 1:
            return
        mesh = self.groups.mesh["replica"]
        placement = _replica_placement(self.groups.replicas)
        for experts in self.modules:
            # Under EP x TP the parameters are DTensors on the experts' tp axis: FSDP2 shards
            # them on the 2-D (replica, tp) mesh.
            fully_shard(
                experts,
                mesh=mesh,
                reshard_after_forward=zero == 3,
                shard_placement_fn=placement,
            )
            # Sum over the replicas / (dp * cp), not FSDP's mean over the replicas (module
            # docstring); sum reductions then one division (gloo has no PREMUL_SUM).
            experts.set_gradient_divide_factor(float(self.grad_divisor))
            experts.set_force_sum_reduction_for_comms(True)
        # FSDP2 registered new (sharded) parameters in place of the shards.
        self.params = [q for m in self.modules for q in m.parameters()]
        self.sharded = True

    def install_coding(self, gradients: Method, weights: Method) -> None:
        """The plan's coded traffic for the expert parameters (`DpCoding.experts` and
        `.expert_weights`): on the FSDP2 experts units, their custom reduce-scatter and
        all-gather (as `data_parallel.install_gradient_coding` for the dense units); else the
        method of `finish_gradients`' all-reduce (weights are not gathered there)."""
        self.coding = gradients
        if self.sharded:
            for experts in self.modules:
                code_fsdp_module(experts, gradients, weights)

    def finish_gradients(self) -> None:
        """Sum expert gradients over the shard's replicas (one flat all-reduce), / dp*cp.

        Under EP x TP the gradients are DTensors on the tp mesh: their local shards are
        reduced (a replicated parameter's partial gradient is first summed over tp). Nothing
        when FSDP2 reduced them (`shard_over_replicas`)."""
        if not self.params or self.sharded:
            return
        grads = []
        for p in self.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if isinstance(g, DTensor):
                if any(isinstance(pl, Partial) for pl in g.placements):
                    g = g.redistribute(placements=list(p.placements))
                g = g.to_local()
            grads.append(g)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.groups.replica_group is not None:
            flat = reduce_flat(flat, self.groups.replica_group, self.coding)
        flat /= self.grad_divisor
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            local = flat[offset : offset + n].view_as(g).clone()
            if isinstance(p, DTensor):
                local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
            p.grad = local
            offset += n

    def full_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """All experts of a sharded parameter (all-gather over the replicas (FSDP2) and tp,
        then over the ep group; every rank must call it for the same parameter)."""
        x = p.full_tensor() if isinstance(p, DTensor) else p
        x = x.detach().contiguous()
        out = x.new_empty((self.groups.ep * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x, group=self.groups.ep_group)
        return out

    # -- dispatch -----------------------------------------------------------------------------
    def exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        return _AllToAll.apply(x, out_splits, in_splits, self.groups.ep_group)

    def moe_forward(self, moe: nn.Module, x_bsh: torch.Tensor) -> torch.Tensor:
        """The zoo MoE's forward with tokens routed to the experts' ranks ("tokens" mode).
        Under EP x TP `x_bsh` is this rank's sequence shard and so is the output."""
        given, x_bsh = x_bsh, _local(x_bsh)
        b, s, h = x_bsh.shape
        x_th = x_bsh.reshape(b * s, h)
        t, k, e = b * s, moe.top_k, self.num_experts
        ep, el = self.groups.ep, self.local_experts
        cap = moe.capacity(t)
        if self.tp is None:
            weights_tk, experts_tk = moe.router(x_th)
        else:
            weights_tk, experts_tk = self.tp.call(moe.router, x_th)
        expert_n = experts_tk.reshape(-1)  # n = t*k choices, token-major (the zoo's order)
        onehot_ne = F.one_hot(expert_n, e)
        slot_n = ((onehot_ne.cumsum(0) - 1) * onehot_ne).sum(-1)
        kept = (slot_n < cap).nonzero().squeeze(1)
        # Kept choices sorted by expert (= by destination rank, then its local expert).
        order = kept[torch.argsort(expert_n[kept], stable=True)]
        send_counts = torch.bincount(expert_n[kept], minlength=e).view(ep, el)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.groups.ep_group)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        x_recv = self.exchange(x_th.index_select(0, order // k), out_splits, in_splits)
        if self.tp is None:
            y_recv = _run_local(moe.experts, x_recv, recv_counts)
        else:
            y_recv = self._run_local_tp(moe.experts, x_recv, recv_counts)
        y_sent = self.exchange(y_recv, in_splits, out_splits)
        y_nh = y_sent.new_zeros(t * k, h).index_copy(0, order, y_sent)
        out_th = (y_nh * weights_tk.reshape(-1, 1)).view(t, k, h).sum(1)
        if getattr(moe, "shared", None) is not None:
            if self.tp is None:
                out_th = out_th + moe.shared(x_th)
            else:  # its own TP region: it takes the (b, s/tp, h) sequence shard
                out_th = out_th + moe.shared(given).reshape(t, h)
        return out_th.view(b, s, h)

    def _run_local_tp(self, experts: nn.Module, x_rh: torch.Tensor, recv_counts: torch.Tensor):
        """EP x TP: the rows every tp peer received, gathered; the local experts' ffn shard
        on all of them; each row's partial outputs summed back on the rank that received it."""
        tp = self.tp
        assert tp is not None
        counts = tp.row_counts(recv_counts)  # (tp, ep, el)
        rows = counts.sum((1, 2)).tolist()
        x_all = tp.gather_rows(x_rh, rows)
        el = recv_counts.shape[1]
        # `experts` runs on its local shards (`ExpertTensorParallel.run_on_shards`)
        y_all = _run_local(experts, x_all, counts.reshape(-1, el))
        return tp.scatter_rows(y_all, rows)

    def hf_forward(
        self,
        experts: nn.Module,
        experts_forward,
        hidden_th: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """A HuggingFace experts module's forward with each (token, choice) row sent to the
        rank owning its expert: the router has already chosen (`top_k_index`, no capacity:
        nothing drops), the rows go out sorted by expert (so by owner, then local expert),
        the owner runs its local experts with the module's own code (`experts_forward` on
        the received rows, each with its local expert id and weight 1), and the outputs come
        back to be weighted and summed over the k choices, as the unsplit module does."""
        t, h = hidden_th.shape
        k = top_k_index.shape[1]
        e, ep, el = self.num_experts, self.groups.ep, self.local_experts
        expert_n = top_k_index.reshape(-1)  # n = t*k choices, token-major
        order = torch.argsort(expert_n, stable=True)
        send_counts = torch.bincount(expert_n, minlength=e).view(ep, el)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.groups.ep_group)
        in_splits, out_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        x_recv = self.exchange(hidden_th.index_select(0, order // k), out_splits, in_splits)
        # Received rows are grouped by source, then by local expert.
        local_ids = torch.arange(el, device=x_recv.device).repeat(ep)
        ids = torch.repeat_interleave(local_ids, recv_counts.reshape(-1)).unsqueeze(1)
        ones = x_recv.new_ones(x_recv.shape[0], 1)
        y_recv = experts_forward(x_recv, ids, ones)
        y_sent = self.exchange(y_recv, in_splits, out_splits)
        y_nh = y_sent.new_zeros(t * k, h).index_copy(0, order, y_sent)
        return (y_nh * top_k_weights.reshape(-1, 1).to(y_nh.dtype)).view(t, k, h).sum(1)

    def slots_forward(self, experts_forward, x_ech: torch.Tensor) -> torch.Tensor:
        """Slot buffers of all experts -> their owners, local experts, and back ("slots")."""
        e, cap, h = x_ech.shape
        ep, el = self.groups.ep, self.local_experts
        equal = [el * cap] * ep
        got = self.exchange(x_ech.reshape(e * cap, h), equal, equal)  # (src, el, cap, h)
        local = got.view(ep, el, cap, h).transpose(0, 1).reshape(el, ep * cap, h)
        y = experts_forward(local)
        back = y.view(el, ep, cap, h).transpose(0, 1).reshape(e * cap, h)
        return self.exchange(back, equal, equal).view(e, cap, h)


def _replica_placement(replicas: int):
    """FSDP2's `shard_placement_fn` for expert parameters: the first dim the replicas divide
    that tp does not cut, dim 0 (the local experts) first, so that every replica holds exactly
    1/replicas of the shard, as the cost model assumes (FSDP2 would pad dim 0 when there are
    fewer local experts than replicas, e.g. one expert per rank, and save nothing). Dim 0,
    padded, when no dim divides."""

    def placement(p: nn.Parameter) -> Shard:
        cut = (
            {pl.dim for pl in p.placements if isinstance(pl, Shard)}
            if isinstance(p, DTensor)
            else set()
        )
        for dim, size in enumerate(p.shape):
            if dim not in cut and size % replicas == 0:
                return Shard(dim)
        return Shard(0)

    return placement


def _run_local(experts, x_rh: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """Rows received from each source (grouped by source, then local expert;
    `recv_counts` (sources, local experts)) through the local experts (`experts` maps
    (el, m, h) -> (el, m, h)), returned in the same row order."""
    src, el = recv_counts.shape
    h = x_rh.shape[-1]
    per_expert = recv_counts.sum(0)  # (el,)
    m = int(per_expert.max()) if per_expert.numel() else 0
    dev = x_rh.device
    flat = recv_counts.reshape(-1)
    block = torch.repeat_interleave(torch.arange(src * el, device=dev), flat)
    within = torch.arange(block.numel(), device=dev) - (torch.cumsum(flat, 0) - flat)[block]
    # Offset of source i's rows inside local expert l's rows: sources before i.
    before = (torch.cumsum(recv_counts, 0) - recv_counts).reshape(-1)
    local_e = block % el
    dest = local_e * m + before[block] + within
    buf = x_rh.new_zeros(el * m, h).index_copy(0, dest, x_rh)
    y = experts(buf.view(el, m, h))
    return y.reshape(el * m, h).index_select(0, dest)


def moe_region_forward(
    tp: ExpertTensorParallel, num_experts: int, moe: nn.Module, x_bsh: torch.Tensor
) -> torch.Tensor:
    """The zoo MoE's forward as one tensor-parallel region (ep == 1; module docstring): the
    zoo's static-capacity slot dispatch on all the tokens, experts on their ffn shard."""
    x = tp.enter(_local(x_bsh))
    b, s, h = x.shape
    t, e, k = b * s, num_experts, moe.top_k
    x_th = x.reshape(t, h)
    cap = moe.capacity(t)
    weights_tk, experts_tk = tp.call(moe.router, x_th)
    # The zoo's dispatch (`MoE.forward`): a running count per expert gives each choice its
    # slot; choices past the capacity go to a drop bin (row e*cap), empty slots read zeros.
    onehot_ne = F.one_hot(experts_tk.reshape(-1), e)
    slot_n = ((onehot_ne.cumsum(0) - 1) * onehot_ne).sum(-1)
    dest_n = torch.where(slot_n < cap, experts_tk.reshape(-1) * cap + slot_n, e * cap)
    token_n = torch.arange(t, device=x.device).repeat_interleave(k)
    src_index = torch.full((e * cap + 1,), t, dtype=torch.long, device=x.device)
    src_index = src_index.scatter(0, dest_n, token_n)[: e * cap]
    x_padded = torch.cat([x_th, x_th.new_zeros(1, h)])
    x_ech = x_padded.index_select(0, src_index).view(e, cap, h)
    y_ech = moe.experts(x_ech)  # on its local shards (`run_on_shards`): partial sums over tp
    y_flat = torch.cat([y_ech.reshape(e * cap, h), y_ech.new_zeros(1, h)])
    y_nh = y_flat.index_select(0, dest_n) * weights_tk.reshape(-1, 1)
    out = tp.leave(y_nh.view(t, k, h).sum(1).view(b, s, h))
    if getattr(moe, "shared", None) is not None:
        out = out + moe.shared(x_bsh)  # its own TP region, on the region's input
    return out


def _local(x: torch.Tensor) -> torch.Tensor:
    """The MoE's input as a plain tensor: under SP the norm before it hands on a Shard(1)
    DTensor (`SequenceParallel`), whose local part is this rank's sequence shard."""
    return x.to_local() if isinstance(x, DTensor) else x


def _expert_count(experts: nn.Module, where: str) -> int:
    counts = {p.shape[0] for p in experts.parameters()}
    if len(counts) != 1:
        raise RuntimePlanError(
            f"runtime: experts module {where!r} has parameters with different leading dims "
            f"{sorted(counts)}; expert parallelism needs weights stacked along dim 0"
        )
    return counts.pop()


def _shard(experts: nn.Module, lo: int, hi: int) -> list[nn.Parameter]:
    out = []
    for sub in experts.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            q = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
            sub._parameters[name] = q
            out.append(q)
    return out


def _tp_placement(name: str, plan, where: str) -> Placement:
    """The plan's tp placement of expert / router parameter `name` as a DTensor placement."""
    got = placement_of(name, plan)
    if got in (None, "R"):
        return Replicate()
    if got.startswith("S(") and got.endswith(")"):
        return Shard(int(got[2:-1]))
    raise RuntimePlanError(f"runtime: placement {got} of {where} {name!r} is unsupported")


def _distribute(
    module: nn.Module,
    prefix: str,
    tp: ExpertTensorParallel,
    plan,
    where: str,
    mesh: DeviceMesh | None = None,
):
    """Make every parameter of `module` a DTensor on the tp mesh (`mesh`, a 1-D tp mesh of
    the same ranks, when given) with the plan's placement (this rank's shard of the current
    local values); returns them."""
    out = []
    for sub_path, sub in module.named_modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            full = ".".join(x for x in (prefix, sub_path, name) if x)
            pl = _tp_placement(full, plan, where)
            if where == "router" and not isinstance(pl, Replicate):
                # every tp rank routes with the whole gate (the routing must agree)
                raise RuntimePlanError(f"runtime: the plan shards MoE router parameter {full!r}")
            local = p.detach()
            if isinstance(pl, Shard):
                if local.shape[pl.dim] % tp.size:
                    raise RuntimePlanError(
                        f"runtime: tp={tp.size} does not divide dim {pl.dim} of {full} "
                        f"{tuple(local.shape)}"
                    )
                local = local.chunk(tp.size, dim=pl.dim)[tp.rank]
            d = DTensor.from_local(local.clone(), mesh or tp.mesh, [pl], run_check=False)
            q = nn.Parameter(d, requires_grad=p.requires_grad)
            sub._parameters[name] = q
            out.append(q)
    return out


def _distribute_moe(
    moe: nn.Module,
    experts_path: str,
    tp: ExpertTensorParallel,
    plan,
    experts_mesh: DeviceMesh | None = None,
):
    """A zoo MoE's router (whole) and experts (the plan's tp placements) as DTensors on the
    tp mesh (the experts on `experts_mesh` when given: the tp axis of the experts' mesh under
    EP); the experts' forward then runs on their local shards. Returns the experts'
    parameters."""
    moe_path = experts_path.rpartition(".")[0]
    _distribute(moe.router, f"{moe_path}.router" if moe_path else "router", tp, plan, "router")
    shards = _distribute(moe.experts, experts_path, tp, plan, "experts", experts_mesh)
    tp.run_on_shards(moe.experts, once=True)
    return shards


def _find_moes(modules: Sequence[nn.Module]):
    """(path, experts module, zoo MoE or None) of every MoE in `modules` (paths relative to
    each, which keep the model's names)."""
    found: list[tuple[str, nn.Module, nn.Module | None]] = []
    for root in modules:
        for path, m in root.named_modules():
            if is_zoo_moe(m):
                found.append((f"{path}.experts" if path else "experts", m.experts, m))
            elif (getattr(m, "stacked_experts", False) or is_hf_experts(m)) and not any(
                m is f[1] for f in found
            ):
                found.append((path, m, None))
    return found


def apply_expert_parallel(
    chunks: Chunks, ctx: RankContext, options: Options
) -> ExpertParallel | None:
    """Lay out the experts of every MoE module of this rank's chunks for the plan's ep and
    tp degrees (module docstring) and route tokens to them (`options.ep_dispatch`).

    Returns the handle the runner uses for expert gradients and the full state dict, and
    data parallelism for the experts' replicas (None when ep == 1: expert TP shards are
    ordinary TP parameters). Every rank must call it, once for all its chunks (it creates
    the ep groups)."""
    p = ctx.plan.parallel
    ep, tp_size = p.ep or 1, p.tp or 1
    mode = options.ep_dispatch
    roots = [chunk.module for chunk in chunks]
    if ep == 1 and tp_size == 1:
        return None
    if mode not in MODES:
        raise RuntimePlanError(f"runtime: ep dispatch must be one of {MODES}, got {mode!r}")
    found = _find_moes(roots)
    if tp_size > 1:
        for path, experts, moe in found:
            if is_hf_experts(experts):
                raise RuntimePlanError(
                    f"runtime: experts {path!r} ({type(experts).__name__}) with tp={tp_size}: "
                    "HuggingFace experts run expert parallelism, not tensor parallelism; "
                    "re-plan with tp=1"
                )
            if moe is None or (ep > 1 and mode == "slots"):
                raise RuntimePlanError(
                    f"runtime: experts {path!r} with tp={tp_size}: the slots dispatch (and "
                    "`stacked_experts` modules) run with tp == 1 only; use the zoo's MoE shape "
                    "with ep_dispatch='tokens', or tp=1"
                )
        if why := ep_tp_problem(ep, tp_size, bool(p.sequence_parallel)):
            raise RuntimePlanError(f"runtime: {why}; re-plan with sequence_parallel=True")
    tp = _tensor_parallel(ctx) if tp_size > 1 else None
    if ep == 1:  # expert tensor parallelism: each MoE is one TP region
        assert tp is not None
        for path, experts, moe in found:
            e = _expert_count(experts, path)
            _distribute_moe(moe, path, tp, ctx.plan)
            moe.forward = _bind(_region_forward(tp, e), moe)
        return None
    groups = expert_groups(ctx, ep)
    if not found:
        raise RuntimePlanError(
            f"runtime: ep={ep} but the model has no MoE module this runtime can shard (the "
            "zoo's MoE shape, or an experts module marked `stacked_experts = True`)"
        )
    handle: ExpertParallel | None = None
    for path, experts, moe in found:
        e = _expert_count(experts, path)
        hf = is_hf_experts(experts)  # before its weights are cut to the local experts
        if why := ep_experts_problem(ep, e):
            raise RuntimePlanError(f"runtime: {path}: {why}")
        if handle is None:
            handle = ExpertParallel(groups, e, p.dp * (p.cp or 1), mode, tp=tp)
        elif e != handle.num_experts:
            raise RuntimePlanError("runtime: MoE layers with different expert counts")
        el = e // ep
        shards = _shard(experts, groups.ep_rank * el, (groups.ep_rank + 1) * el)
        if tp is not None:
            shards = _distribute_moe(moe, path, tp, ctx.plan, groups.mesh["tp"])
        handle.params += shards
        handle.modules.append(experts)
        if moe is not None and mode == "tokens":
            moe.forward = _bind(handle.moe_forward, moe)
        elif hf:  # HF's own interface: routed rows, whatever the mode
            experts.num_experts = el  # its code indexes the local experts
            experts.forward = functools.partial(handle.hf_forward, experts, experts.forward)
        else:
            experts.forward = _bind(handle.slots_forward, experts.forward)
    return handle


def _region_forward(tp: ExpertTensorParallel, num_experts: int):
    def forward(moe, x_bsh):
        return moe_region_forward(tp, num_experts, moe, x_bsh)

    return forward


def _bind(fn, first):
    def forward(*args, **kwargs):
        return fn(first, *args, **kwargs)

    return forward
