"""Pipelines whose stages run at different TP degrees (or in different device groups): the
hand-off between TP groups, and the 1F1B / GPipe schedule that drives it.

torch's pipelining pairs one rank per stage in each pipeline, so a stage of tp 2 cannot hand
its output to a stage of tp 1 there. Here pipeline i is dp index i of every stage (the
plan's rank coordinates, `ir.plan.assign_ranks`), and its stage s is one TP group of t_s
ranks (`mesh.stage_group_view`). Between stage s (t_a senders) and s + 1 (t_b receivers)
the boundary activation X crosses once, cut into pieces (the rule `cost_model.pricer.
Pricer.handoff` prices):

- X is cut along its sequence dim (dim 1) into L = lcm(t_a, t_b) equal chunks. Sender j
  answers for chunks [j L/t_a, (j+1) L/t_a) (its own sequence shard under SP; a replicated
  X is whole on every sender and each sends its block), receiver i needs chunks
  [i L/t_b, (i+1) L/t_b). Every sender sends each receiver the chunks both ranges hold, in
  one message (none when they do not meet), so a sender sends X / t_a, a receiver receives
  X / t_b, and the busier side moves X / min(t_a, t_b).
- A receiver whose stage runs sequence-parallel (t_b > 1 under SP) keeps its shard. One
  that needs X whole (t_b > 1 without SP) all-gathers the shards over its TP group; the
  cost model leaves that node-local all-gather unpriced.
- Backward mirrors it: every receiver's input gradient is the same tensor (replicated
  input) or its shard's (SP); each sends its block's chunks back to their senders, and a
  sender that held X whole all-gathers the gradient blocks over its TP group, so every TP
  rank of the stage gets the whole gradient, as torch's pipelining gives each TP rank with
  equal degrees.

Point-to-point runs on the world group (`isend`, bounded `recv`), so every transfer, as
every collective of the runtime, is bounded by the plan's timeout (`init_distributed`).
At a rank's first micro-batch the sender also sends the boundary's shape and dtype (a small
header, once). One tensor per boundary (the zoo's and HF decoders' hidden state); a stage
returning several tensors is refused with one line.

Schedules: '1f1b' (warm-up of pp - s - 1 forwards, then one forward and one backward in
turn, then the rest of the backwards) and 'gpipe' (all forwards, then all backwards), one
model chunk per rank. Sends are posted without waiting; a rank only waits to receive, so
the schedule's own order cannot deadlock; the sends are waited for at the end of the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from meshplan.ir.parallel import Schedule
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import RuntimePlanError
from .mesh import RankContext, active_ranks

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HEADER = 8  # int64s: dtype, ndim, shape (up to 6 dims)


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a stage boundary in one pipeline: the TP group's torch ranks by tp
    index, and whether it holds the boundary tensor sequence-sharded (SP at tp > 1)."""

    ranks: tuple[int, ...]
    sharded: bool

    @property
    def tp(self) -> int:
        return len(self.ranks)


def stage_side(plan: Plan, stage: int, replica: int) -> Side:
    """The TP group of `stage`'s replica `replica` (dp index over the whole plan)."""
    ranks = active_ranks(plan)
    members = sorted(
        ((r.coords[3], i) for i, r in enumerate(ranks) if r.coords[:2] == (stage, replica)),
    )
    group = next(r.group for r in ranks if r.coords[:2] == (stage, replica))
    tp = plan.stages[stage].tp_of(group, plan.parallel.tp)
    assert len(members) == tp * (plan.parallel.cp or 1), (stage, replica, members)
    return Side(
        ranks=tuple(i for _, i in members),
        sharded=bool(plan.parallel.sequence_parallel) and tp > 1,
    )


def pieces(a: Side, b: Side) -> list[tuple[int, int, int, int]]:
    """(sender index, receiver index, first chunk, end chunk) of every message from side a
    to side b, chunks in units of X's sequence / L, L = lcm(t_a, t_b)."""
    L = math.lcm(a.tp, b.tp)
    out = []
    for j in range(a.tp):
        for i in range(b.tp):
            lo = max(j * L // a.tp, i * L // b.tp)
            hi = min((j + 1) * L // a.tp, (i + 1) * L // b.tp)
            if lo < hi:
                out.append((j, i, lo, hi))
    return out


class Handoff:
    """This rank's exchanges at the boundaries before and after its stage (one pipeline)."""

    def __init__(self, ctx: RankContext) -> None:
        whole = ctx.whole_plan
        self.stage, self.replica = ctx.stage_index, ctx.replica
        self.me = ctx.rank
        self.mine = stage_side(whole, self.stage, self.replica)
        self.index = self.mine.ranks.index(self.me)
        self.prev = stage_side(whole, self.stage - 1, self.replica) if self.stage > 0 else None
        last = (whole.parallel.pp or 1) - 1
        self.next = stage_side(whole, self.stage + 1, self.replica) if self.stage < last else None
        self.tp_group = ctx.group("tp") if self.mine.tp > 1 else None
        # Every buffer this rank sends or receives lives on its device: NCCL takes no host
        # tensors (the CPU ranks' device is the host, as gloo needs).
        self.device = ctx.device
        self.header: torch.Tensor | None = None  # the full boundary shape I receive, once
        self.sent_header = False
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    # -- forward ---------------------------------------------------------------------------
    def send_forward(self, x: torch.Tensor) -> None:
        """My output (whole, or my sequence shard) to the next stage's TP group."""
        x = _plain(x, "output")
        assert self.next is not None
        if not self.sent_header:
            full = list(x.shape)
            full[1] *= self.mine.tp if self.mine.sharded else 1
            for dst in self._partners(self.mine, self.next, sending=True):
                self._isend(_encode_header(x.dtype, full).to(self.device), dst)
            self.sent_header = True
        self._send_blocks(x, self.mine, self.next)

    def recv_forward(self) -> torch.Tensor:
        """My input from the previous stage: whole, or my sequence shard under SP."""
        assert self.prev is not None
        if self.header is None:
            buf = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            for src in self._partners(self.prev, self.mine, sending=False):
                dist.recv(buf, src)
            self.header = buf
        dtype, full = _decode_header(self.header)
        block = self._recv_blocks(self.prev, self.mine, full, dtype)
        return self._whole(block, self.mine)

    # -- backward --------------------------------------------------------------------------
    def send_backward(self, grad: torch.Tensor, full_shape: torch.Size) -> None:
        """The gradient of my input, back to the previous stage's TP group."""
        assert self.prev is not None
        grad = _plain(grad, "input gradient")
        n = full_shape[1] // self.mine.tp  # my block of the sequence
        if not self.mine.sharded:
            grad = grad.narrow(1, self.index * n, n)  # the same on every tp rank: my block
        chunk = full_shape[1] // math.lcm(self.prev.tp, self.mine.tp)
        for j, i, lo, hi in pieces(self.prev, self.mine):
            if i == self.index:
                start = lo * chunk - self.index * n
                self._isend(grad.narrow(1, start, (hi - lo) * chunk), self.prev.ranks[j])

    def recv_backward(self, out: torch.Tensor) -> torch.Tensor:
        """The gradient of my output from the next stage's TP group, shaped as `out`."""
        assert self.next is not None
        full = list(out.shape)
        full[1] *= self.mine.tp if self.mine.sharded else 1
        block = self._recv_blocks_back(full, out.dtype)
        return self._whole(block, self.mine)

    def finish(self) -> None:
        """Wait for this step's sends (bounded by the group's timeout)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    # -- pieces ----------------------------------------------------------------------------
    def _partners(self, a: Side, b: Side, *, sending: bool) -> list[int]:
        if sending:
            return [b.ranks[i] for j, i, _, _ in pieces(a, b) if j == self.index]
        return [a.ranks[j] for j, i, _, _ in pieces(a, b) if i == self.index]

    def _isend(self, t: torch.Tensor, dst: int) -> None:
        t = t.contiguous()
        self.pending.append((dist.isend(t, dst), t))

    def _send_blocks(self, x: torch.Tensor, a: Side, b: Side) -> None:
        seq = x.shape[1] * (a.tp if a.sharded else 1)
        L = math.lcm(a.tp, b.tp)
        if seq % L:
            raise RuntimePlanError(
                f"runtime: the boundary tensor's sequence ({seq}) does not split into "
                f"lcm({a.tp}, {b.tp}) = {L} pieces for the hand-off between tp degrees"
            )
        chunk = seq // L
        base = self.index * (seq // a.tp) if a.sharded else 0  # where my tensor starts
        for j, i, lo, hi in pieces(a, b):
            if j == self.index:
                self._isend(x.narrow(1, lo * chunk - base, (hi - lo) * chunk), b.ranks[i])

    def _recv_blocks(self, a: Side, b: Side, full: list[int], dtype) -> torch.Tensor:
        """My block of the boundary tensor (sequence / t_b), from the senders holding it."""
        L = math.lcm(a.tp, b.tp)
        chunk = full[1] // L
        parts = []
        for j, i, lo, hi in pieces(a, b):
            if i == self.index:
                shape = list(full)
                shape[1] = (hi - lo) * chunk
                t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(t, a.ranks[j])
                parts.append(t)
        return torch.cat(parts, dim=1)

    def _recv_blocks_back(self, full: list[int], dtype) -> torch.Tensor:
        """My block of my output's gradient (sequence / t_a), from the next stage's ranks."""
        assert self.next is not None
        a, b = self.mine, self.next
        chunk = full[1] // math.lcm(a.tp, b.tp)
        parts = []
        for j, i, lo, hi in pieces(a, b):
            if j == self.index:
                shape = list(full)
                shape[1] = (hi - lo) * chunk
                t = torch.empty(shape, dtype=dtype, device=self.device)
                dist.recv(t, b.ranks[i])
                parts.append(t)
        return torch.cat(parts, dim=1)

    def _whole(self, block: torch.Tensor, side: Side) -> torch.Tensor:
        """`block` (my 1/tp of the sequence) as this stage holds the boundary: kept under SP,
        all-gathered over my TP group when the stage needs it whole."""
        if side.sharded or side.tp == 1:
            return block
        parts = [torch.empty_like(block) for _ in range(side.tp)]
        dist.all_gather(parts, block.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=1)


def _plain(x, what: str) -> torch.Tensor:
    if isinstance(x, DTensor):
        x = x.to_local()
    if not isinstance(x, torch.Tensor):
        raise RuntimePlanError(
            f"runtime: a stage's {what} is {type(x).__name__}, not one tensor; the hand-off "
            "between stages of different tp degrees passes one tensor"
        )
    return x


def _encode_header(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if dtype not in _DTYPES or len(shape) > _HEADER - 2 or len(shape) < 2:
        raise RuntimePlanError(
            f"runtime: boundary tensor {dtype} of shape {tuple(shape)} cannot be handed off "
            "between stages of different tp degrees (floating point, 2-6 dims)"
        )
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(dtype), len(shape)
    h[2 : 2 + len(shape)] = torch.tensor(shape)
    return h


def _decode_header(h: torch.Tensor) -> tuple[torch.dtype, list[int]]:
    n = int(h[1])
    return _DTYPES[int(h[0])], [int(v) for v in h[2 : 2 + n]]


class HandoffSchedule:
    """1F1B or GPipe over `Handoff` for one model chunk per rank, with the interface of
    torch's schedules that `apply.Runner` uses: `step(*args, target=, losses=)`."""

    def __init__(
        self,
        module: nn.Module,
        ctx: RankContext,
        loss_fn: Callable,
        n_microbatches: int,
    ) -> None:
        self.module, self.loss_fn, self.m = module, loss_fn, n_microbatches
        self.handoff = Handoff(ctx)
        self.first = self.handoff.prev is None
        self.last = self.handoff.next is None
        pp = ctx.num_stages
        kind = ctx.whole_plan.parallel.schedule
        if kind == Schedule.ONE_F_ONE_B:
            warmup = min(pp - ctx.stage_index - 1, n_microbatches)
        elif kind == Schedule.GPIPE:
            warmup = n_microbatches
        else:
            raise RuntimePlanError(
                f"runtime: schedule {kind} is not run between stages of different tp degrees"
            )
        self.order = ["F"] * warmup
        for _ in range(n_microbatches - warmup):
            self.order += ["F", "B"]
        self.order += ["B"] * warmup

    def step(self, *args, target=None, losses: list | None = None) -> None:
        xs = args[0].chunk(self.m) if self.first else [None] * self.m
        ys = target.chunk(self.m) if self.last else [None] * self.m
        saved: list[tuple] = []  # (input, output or loss) per micro-batch, in order
        f = b = 0
        for action in self.order:
            if action == "F":
                x = xs[f] if self.first else self.handoff.recv_forward().requires_grad_(True)
                out = self.module(x)
                if self.last:
                    loss = self.loss_fn(out, ys[f])
                    if losses is not None:
                        losses.append(loss.detach())
                    saved.append((x, loss))
                else:
                    self.handoff.send_forward(out.detach())
                    saved.append((x, out))
                f += 1
            else:
                x, out = saved[b]
                saved[b] = ()  # free the micro-batch's activations
                if self.last:
                    out.backward()
                else:
                    out_local = out.to_local() if isinstance(out, DTensor) else out
                    grad = self.handoff.recv_backward(out_local)
                    torch.autograd.backward(out_local, grad)
                if not self.first:
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    self.handoff.send_backward(g, self._full_shape(x))
                b += 1
        self.handoff.finish()

    def _full_shape(self, x: torch.Tensor) -> torch.Size:
        """The boundary tensor's whole shape, given my input `x`."""
        side = self.handoff.mine
        shape = list(x.shape)
        shape[1] *= side.tp if side.sharded else 1
        return torch.Size(shape)
