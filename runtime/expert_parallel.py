"""Expert parallelism: stacked expert weights sharded over the ep group, tokens all-to-all'd.

Groups (`mesh.expert_groups`): ep divides dp and an ep group is ep consecutive dp ranks with
the same (pp, cp, tp) coordinates; its rank i holds experts `[i*E/ep, (i+1)*E/ep)`: every
parameter of the experts module is cut along dim 0 (the expert dim), keeping its name.

Two dispatches, both exact against one process running the same MoE:

    "tokens"  (default; MoE modules of the zoo's shape: `router(x_th) -> (weights_tk,
              experts_tk)`, `capacity(tokens)`, `top_k`, `experts`, optional `shared`)
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
              way. Simplest; moves the capacity padding too.

Gradients. Dense parameters stay data-parallel over the full dp (x cp) group. Expert
parameters are left out of DDP; after backward, `ExpertParallel.finish_gradients` sums each
expert gradient over the ranks holding the same shard (dp/ep x cp of them) and divides by
dp*cp: the gradient a shard owner accumulates already sums the contributions of all ep ranks'
tokens (they flow back through the all-to-all), so the sum over replicas counts every dp x cp
rank's mean loss once. With ZeRO > 0 the dense parameters are sharded by FSDP2 over dp (x cp)
and the expert parameters are left out of it (`fully_shard(ignored_params=...)`): they are
already sharded over ep and reduced as above. EP with TP is refused (not implemented).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .errors import RuntimePlanError
from .mesh import ExpertGroups, RankContext, expert_groups

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


@dataclass
class ExpertParallel:
    """This rank's expert shard, its groups, and the gradient / state handling of experts."""

    groups: ExpertGroups
    num_experts: int  # E, all ranks together
    grad_divisor: int  # dp * cp
    mode: str = "tokens"
    params: list[nn.Parameter] = field(default_factory=list)
    # How the expert gradients travel (the plan's decision: `data_parallel.DpCoding.experts`).
    coding: tuple[str, int] = ("raw", 1)

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

    def finish_gradients(self) -> None:
        """Sum expert gradients over the shard's replicas (one flat all-reduce), / dp*cp."""
        if not self.params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.groups.replica_group is not None:
            from .data_parallel import reduce_flat

            flat = reduce_flat(flat, self.groups.replica_group, self.coding)
        flat /= self.grad_divisor
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def full_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """All experts of a sharded parameter (all-gather over the ep group; every ep rank
        must call it for the same parameter)."""
        x = p.detach().contiguous()
        out = x.new_empty((self.groups.ep * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x, group=self.groups.ep_group)
        return out

    # -- dispatch -----------------------------------------------------------------------------
    def exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        return _AllToAll.apply(x, out_splits, in_splits, self.groups.ep_group)

    def moe_forward(self, moe: nn.Module, x_bsh: torch.Tensor) -> torch.Tensor:
        """The zoo MoE's forward with tokens routed to the experts' ranks ("tokens" mode)."""
        b, s, h = x_bsh.shape
        x_th = x_bsh.reshape(b * s, h)
        t, k, e = b * s, moe.top_k, self.num_experts
        ep, el = self.groups.ep, self.local_experts
        cap = moe.capacity(t)
        weights_tk, experts_tk = moe.router(x_th)
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
        y_recv = self._run_local(moe.experts, x_recv, recv_counts)
        y_sent = self.exchange(y_recv, in_splits, out_splits)
        y_nh = y_sent.new_zeros(t * k, h).index_copy(0, order, y_sent)
        out_th = (y_nh * weights_tk.reshape(-1, 1)).view(t, k, h).sum(1)
        if getattr(moe, "shared", None) is not None:
            out_th = out_th + moe.shared(x_th)
        return out_th.view(b, s, h)

    def _run_local(self, experts: nn.Module, x_rh: torch.Tensor, recv_counts: torch.Tensor):
        """Rows received from each source rank (grouped by source, then local expert) through
        the local experts, returned in the same row order."""
        ep, el = recv_counts.shape
        h = x_rh.shape[-1]
        per_expert = recv_counts.sum(0)  # (el,)
        m = int(per_expert.max()) if per_expert.numel() else 0
        dev = x_rh.device
        flat = recv_counts.reshape(-1)
        block = torch.repeat_interleave(torch.arange(ep * el, device=dev), flat)
        within = torch.arange(block.numel(), device=dev) - (torch.cumsum(flat, 0) - flat)[block]
        # Offset of source i's rows inside local expert l's rows: sources before i.
        before = (torch.cumsum(recv_counts, 0) - recv_counts).reshape(-1)
        local_e = block % el
        dest = local_e * m + before[block] + within
        buf = x_rh.new_zeros(el * m, h).index_copy(0, dest, x_rh)
        y = experts(buf.view(el, m, h))
        return y.reshape(el * m, h).index_select(0, dest)

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


def _is_zoo_moe(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("router", "experts", "capacity", "top_k"))


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


def apply_expert_parallel(
    module: nn.Module, ctx: RankContext, mode: str = "tokens"
) -> ExpertParallel | None:
    """Shard the experts of every MoE module over the ep group and route tokens to them.

    Returns the handle the runner uses for expert gradients and the full state dict (None
    when ep == 1). Every rank must call it (it creates the ep groups)."""
    p = ctx.plan.parallel
    ep = p.ep or 1
    if ep == 1:
        return None
    if mode not in MODES:
        raise RuntimePlanError(f"runtime: ep dispatch must be one of {MODES}, got {mode!r}")
    if (p.tp or 1) > 1:
        raise RuntimePlanError("runtime: expert parallelism with tp > 1 is not implemented")
    groups = expert_groups(ctx, ep)
    found: list[tuple[str, nn.Module, nn.Module | None]] = []  # (path, experts, zoo moe)
    for path, m in module.named_modules():
        if _is_zoo_moe(m):
            found.append((f"{path}.experts", m.experts, m))
        elif getattr(m, "stacked_experts", False) and not any(m is f[1] for f in found):
            found.append((path, m, None))
    if not found:
        raise RuntimePlanError(
            f"runtime: ep={ep} but {type(module).__name__} has no MoE module this runtime can "
            "shard (the zoo's MoE shape, or an experts module marked `stacked_experts = True`)"
        )
    handle: ExpertParallel | None = None
    for path, experts, moe in found:
        e = _expert_count(experts, path)
        if e % ep:
            raise RuntimePlanError(f"runtime: ep={ep} does not divide the {e} experts of {path}")
        if handle is None:
            handle = ExpertParallel(groups, e, p.dp * (p.cp or 1), mode)
        elif e != handle.num_experts:
            raise RuntimePlanError("runtime: MoE layers with different expert counts")
        el = e // ep
        handle.params += _shard(experts, groups.ep_rank * el, (groups.ep_rank + 1) * el)
        if moe is not None and mode == "tokens":
            moe.forward = _bind(handle.moe_forward, moe)
        else:
            experts.forward = _bind(handle.slots_forward, experts.forward)
    return handle


def _bind(fn, first):
    def forward(*args, **kwargs):
        return fn(first, *args, **kwargs)

    return forward
