"""Context parallelism: each rank of the cp group holds a share of every sequence.

torch's own `context_parallel` is CUDA-only (docs/torch_notes.md), so attention over the sharded
sequence is written here on public collectives. All three variants are exact (they match
one process within fp32 rounding):

    "allgather"  (default) K and V of the local tokens are all-gathered over the cp group in
                 forward (`all_gather_single`), their gradients reduce-scattered in backward
                 (`reduce_scatter_single`); SDPA runs on the local queries against every key
                 with a causal mask built from absolute positions. One collective per
                 attention and direction: what the cost model prices (`cp_comm`).
    "ring"       ring attention (Liu et al. 2023): K/V chunks travel around the cp ring by
                 send/recv while the rank attends to the chunk it holds; per-chunk results are
                 merged with their log-sum-exp (online softmax, as FlashAttention). Backward
                 is written by hand (FlashAttention's recurrence with the saved log-sum-exp);
                 the K/V gradients travel with their chunk and arrive back at its owner. Holds
                 two K/V chunks at a time instead of all of them, and skips chunks that the
                 causal mask hides entirely.
    "heads"      head-parallel attention (DeepSpeed-Ulysses, Jacobs et al. 2023): one
                 all-to-all per tensor turns q, k and v from this rank's tokens of every head
                 into every token of h/cp heads (rank r: query heads [r*h/cp, (r+1)*h/cp));
                 SDPA runs on the whole sequence for those heads (tokens put in position
                 order, so `is_causal` holds) and one all-to-all turns the output back
                 (`_SwapSharding`). Communication: 4 all-to-alls per attention forward (q, k,
                 v in, the output back), each sending and receiving (cp-1)/cp of the local
                 tensor (K/V: after the repetition below); backward the same 4 in reverse
                 (the gradient of an all-to-all is the inverse all-to-all). Memory: the scores
                 of h/cp heads over the whole sequence, (b, h/cp, S, S), as many as
                 "allgather"'s (b, h, S/cp, S); K/V of kv'/cp heads over all S tokens, where
                 "allgather" holds all kv heads over S.
                 Grouped-query K/V: query head i reads K/V head i // (h/kv), so when cp
                 divides kv the K/V heads shard the same way (rank r: [r*kv/cp,
                 (r+1)*kv/cp), exactly the heads its query heads read); otherwise each K/V
                 head is repeated f = cp/gcd(kv, cp) times first (kv' = kv*f, the fewest
                 copies that cp divides, rather than all the way to h; f divides h/kv because
                 cp divides h). Needs cp to divide the query heads a rank holds (h/tp under
                 tensor parallelism): refused otherwise (`ir.rules.cp_heads_problem`).
    "usp"        the two-level split of USP (Fang and Zhao 2024) and LoongTrain's 2D
                 attention (Gu et al. 2024), for heads that cp does not divide: cp = u x r
                 with u = `Parallel.cp_head_degree` dividing the heads. cp rank c = j*u + i
                 is rank i of head group j (the u consecutive cp ranks j*u .. j*u+u-1) and
                 rank j of K/V group i (the r ranks i, u+i, 2u+i, ...). Inside its head group
                 a rank runs "heads" (4 all-to-alls per attention and direction over u ranks:
                 afterwards it holds h/u heads of the group's u shares of tokens, which are
                 themselves zig-zag shares, so causal work stays balanced); then it
                 all-gathers K/V of those heads over its K/V group (each of the r members holds
                 its head group's tokens of the same heads) and runs SDPA of its group's
                 queries against the whole sequence with the causal mask by absolute
                 positions, as "allgather"; backward reduce-scatters the K/V gradients.
                 Communication per attention and direction: the 4 all-to-alls of "heads"
                 over u ranks (each sending (u-1)/u of the local tensor) and one K/V
                 all-gather (reduce-scatter) over r ranks of 1/u of "allgather"'s size.
                 GQA K/V heads are repeated u/gcd(kv, u) times first, as under "heads"
                 with u for cp.

Sequence layout. A sequence of S tokens is cut into 2*cp chunks and rank r holds chunks r and
2*cp-1-r ("zig-zag", Megatron-LM / Llama 3 CP): under a causal mask every rank then does the
same attention work (a contiguous split would give the last rank cp times the first's). When
S is not a multiple of 2*cp but is of cp, the split is contiguous. `sequence_positions` gives
a rank's absolute positions; the runner shards inputs and targets with them (`shard`).

Which modules are changed (the contract for user models):
- a module that defines `context_parallel_attention(self, cp: ContextParallel)` is handed the
  `ContextParallel` once at apply time and does the rest itself: `cp.positions(local_len)`
  for its position encodings, `cp.attention(q, k, v, is_causal=...)` instead of SDPA;
- otherwise every module with `q_proj`, `k_proj` and `v_proj` children (the zoo's
  `Attention`, HF-style attention) has its forward wrapped: inside it,
  `F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)` on
  (batch, heads, local_seq, head_dim) tensors is redirected to `cp.attention`, and a `rope`
  argument holding (cos, sin) tables indexed by absolute position (the zoo's) is re-indexed
  to this rank's positions. Explicit `attn_mask` and dropout are refused (not exact under CP);
- a root child `pos_embed` (an `nn.Embedding` of learned positions called with
  `arange(local_len)`, the zoo's GPT style) maps its indices to this rank's positions;
- a HuggingFace decoder of the Llama family's shape (`rotary_emb` beside `layers`, attention
  modules with q/k/v projections, SDPA), the user's model or one it wraps, gets its rotary
  positions from `reposition_hf_decoder` (below), which sequence parallelism needs too.

HuggingFace decoders count positions from the hidden state they hold. `LlamaModel.forward`
takes `position_ids = arange(len)` of its embedded input and builds the causal mask from the
same length; `HFDecoderStage` does the same per pipeline stage. Under sequence parallelism
that length is 1/tp of the rank's tokens (the embedding's output is sequence-sharded) while
attention, which applies the rotary tables to q and k, runs on the tp-gathered sequence;
under context parallelism the rank holds the zig-zag share, not the first tokens. So the
runtime leaves the model's code alone and gives its rotary module (`rotary_emb`, one per HF
decoder or stage) the positions of the tokens the attention's queries hold: len x tp under SP,
mapped to this rank's cp positions under CP (a forward pre-hook). The mask needs nothing:
without padding HF's SDPA path skips it (`is_causal`, decided on the sharded length, which is
causal as well for the whole sequence) and CP's attention masks by absolute positions. What
this cannot fix (other HF shapes, eager attention, sliding windows shorter than the sequence)
is refused in one line (`check_sequence_sharding`, from the tracer's
`meshplan.ir.trace.sequence_sharding_blocker`, which also keeps the planner from emitting it).

Loss and gradients: each cp rank's loss is the mean over its own tokens (equal counts), so the
global loss is the mean over cp ranks and the parameter gradient is the average over cp ranks
of what each rank's backward accumulates (the K/V collectives carry the cross-rank terms).
Data parallelism therefore reduces gradients over dp x cp together
(`mesh.data_parallel_context`), as Megatron-LM does.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from meshplan.ir.plan import Plan
from meshplan.ir.rules import (
    cp_head_shares_problem,
    cp_heads_problem,
    cp_sequence_problem,
    cp_shares_problem,
    cp_usp_problem,
    kv_expansion,
)
from meshplan.ir.trace import hf_models, sequence_sharding_blocker, sliding_window
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import RuntimePlanError
from .mesh import RankContext, UspGroups, usp_groups
from .steps import Chunks, Options

MODES = ("allgather", "ring", "heads", "usp")


# -- sequence layout ---------------------------------------------------------------------------


def sequence_layout(seq_len: int, cp: int) -> str:
    """How a sequence is split: "zigzag" if it cuts into 2*cp chunks, else "contiguous"."""
    if seq_len % (2 * cp) == 0:
        return "zigzag"
    if why := cp_sequence_problem(cp, seq_len):
        raise RuntimePlanError(f"runtime: {why}")
    return "contiguous"


def sequence_positions(
    seq_len: int, cp: int, rank: int, shares: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Absolute positions (int64, ascending) of the tokens cp rank `rank` holds.

    `shares` (tokens per cp rank, each even, summing to `seq_len`; `Parallel.cp_shares`):
    the asymmetric zig-zag. Rank r holds x_r = shares[r] / 2 tokens from the front,
    [F_r, F_r + x_r) with F_r = x_0 + ... + x_{r-1}, and the mirrored x_r from the back,
    [S - F_r - x_r, S - F_r). Its causal attention work (the keys its queries see) is
    (F_r + 1) + ... + (F_r + x_r) + (S - F_r - x_r + 1) + ... + (S - F_r) = x_r (S + 1):
    proportional to its share whatever the others' are, so the load balance of the equal
    zig-zag is kept. Equal shares give the equal zig-zag exactly."""
    if shares is not None:
        if why := cp_shares_problem(shares, cp, seq_len):
            raise RuntimePlanError(f"runtime: {why}")
        half = [s // 2 for s in shares]
        first = sum(half[:rank])
        x = half[rank]
        return torch.cat(
            [
                torch.arange(first, first + x),
                torch.arange(seq_len - first - x, seq_len - first),
            ]
        )
    if sequence_layout(seq_len, cp) == "zigzag":
        c = seq_len // (2 * cp)
        first, second = rank, 2 * cp - 1 - rank
        return torch.cat(
            [torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)]
        )
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


# -- collectives with autograd -----------------------------------------------------------------


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over the cp group; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad, group=ctx.group)
        return out, None, None


class _GatherUneven(torch.autograd.Function):
    """`_GatherSeq` for uneven shares (`ContextParallel.shares`): every rank's rows padded to
    the largest share, all-gathered, the padding dropped; backward pads the gradient the same
    way and reduce-scatters it. The padded collective is what moves (and what is priced)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, sizes: tuple[int, ...], rank: int):
        ctx.group, ctx.sizes, ctx.rank = group, sizes, rank
        top = max(sizes)
        x = x.contiguous()
        if x.shape[0] < top:
            x = torch.cat([x, x.new_zeros((top - x.shape[0], *x.shape[1:]))])
        out = x.new_empty((len(sizes) * top, *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return torch.cat([out[r * top : r * top + n] for r, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        top = max(ctx.sizes)
        parts = grad.split(list(ctx.sizes))
        padded = torch.cat(
            [
                torch.cat([g, g.new_zeros((top - g.shape[0], *g.shape[1:]))]) if len(g) < top else g
                for g in parts
            ]
        ).contiguous()
        out = grad.new_empty((top, *grad.shape[1:]))
        dist.reduce_scatter_single(out, padded, group=ctx.group)
        return out[: ctx.sizes[ctx.rank]], None, None, None


def _exchange(t: torch.Tensor, cp: ContextParallel):
    """Start sending `t` to the next cp rank and receiving the previous rank's into a buffer."""
    buf = torch.empty_like(t)
    works = [
        dist.isend(t, cp.next_rank, group=cp.group),
        dist.irecv(buf, cp.prev_rank, group=cp.group),
    ]
    return buf, works


def _wait(works) -> None:
    for w in works:
        w.wait()


# -- ring attention ----------------------------------------------------------------------------


def _expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """K/V heads -> query heads (grouped-query attention: query head i reads K/V head i//rep)."""
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _reduce_heads(g: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradient w.r.t. expanded K/V heads -> w.r.t. the K/V heads (sum over each group)."""
    if rep == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // rep, rep, s, d).sum(2)


def _block_forward(q, k, v, mask, scale, rep):
    """Softmax attention of q against one K/V chunk: (normalised output, log-sum-exp).

    Rows that the mask hides entirely get output 0 and log-sum-exp -inf."""
    s = torch.matmul(q, _expand(k, rep).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m.unsqueeze(-1))
    denom = p.sum(-1)
    tiny = torch.finfo(p.dtype).tiny
    out = torch.matmul(p, _expand(v, rep)) / denom.clamp_min(tiny).unsqueeze(-1)
    return out, m + torch.log(denom)


def _merge(out, lse, blk_out, blk_lse):
    """Combine two partial softmax results by their log-sum-exps (nan-free for -inf rows)."""
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old, w_blk = torch.exp(lse - safe).unsqueeze(-1), torch.exp(blk_lse - safe).unsqueeze(-1)
    out = out * w_old + blk_out * w_blk
    return out, new


class _RingAttention(torch.autograd.Function):
    """Exact causal (or full) attention over the cp ring; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, causal: bool, scale: float):
        rep = q.shape[1] // k.shape[1]
        dtype = q.dtype
        q32 = q.float()
        local = q.shape[2]
        pos_q = cp.positions(local, q.device)
        pos_all = cp.all_positions(local, q.device)
        out = q32.new_zeros(q.shape)
        lse = q32.new_full(q.shape[:-1], float("-inf"))
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            works = []
            if step < cp.size - 1:
                nxt, works = _exchange(kv, cp)
            mask = _causal_mask(pos_q, pos_all[src]) if causal else None
            if mask is None or mask.any():
                k32, v32 = kv[0].float(), kv[1].float()
                blk_out, blk_lse = _block_forward(q32, k32, v32, mask, scale, rep)
                out, lse = _merge(out, lse, blk_out, blk_lse)
            _wait(works)
            if works:
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.scale, ctx.rep = cp, causal, scale, rep
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, scale, rep = ctx.cp, ctx.causal, ctx.scale, ctx.rep
        q32, dout32 = q.float(), dout.float()
        local = q.shape[2]
        pos_q = cp.positions(local, q.device)
        pos_all = cp.all_positions(local, q.device)
        delta = (dout32 * out).sum(-1, keepdim=True)  # D_i = sum_j P_ij dP_ij
        dq = torch.zeros_like(q32)
        kv = torch.stack([k, v]).contiguous()
        # The gradient of the chunk a rank holds travels with it; after cp hops it is home.
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            works = []
            if step < cp.size - 1:
                nxt, works = _exchange(kv, cp)
            mask = _causal_mask(pos_q, pos_all[src]) if causal else None
            if mask is None or mask.any():
                ke, ve = _expand(kv[0].float(), rep), _expand(kv[1].float(), rep)
                s = torch.matmul(q32, ke.transpose(-1, -2)) * scale
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                p = torch.exp(s - lse.unsqueeze(-1))
                dv = torch.matmul(p.transpose(-1, -2), dout32)
                dp = torch.matmul(dout32, ve.transpose(-1, -2))
                ds = p * (dp - delta)
                dq += torch.matmul(ds, ke) * scale
                dk = torch.matmul(ds.transpose(-1, -2), q32) * scale
                dkv = dkv + torch.stack([_reduce_heads(dk, rep), _reduce_heads(dv, rep)])
            dkv_next, dworks = _exchange(dkv.contiguous(), cp)
            _wait(works + dworks)
            dkv = dkv_next
            if works:
                kv = nxt
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None


# -- head-parallel attention (Ulysses) --------------------------------------------------------


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """(b, h, n, d) of this rank's n tokens -> (b, h/size, size*n, d): the tokens of every cp
    rank (in cp-rank order, `ContextParallel.all_positions`) of this rank's slice of heads."""
    b, h, n, d = x.shape
    # dim 0 = the destination: cp rank r receives head slice [r*h/size, (r+1)*h/size)
    send = x.reshape(b, size, h // size, n, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # dim 0 = the source: cp rank r's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (b, h/size, size*n, d) -> (b, h, n, d)."""
    b, hs, s, d = x.shape
    n = s // size
    # dim 0 = the destination: the cp rank holding those tokens
    send = x.reshape(b, hs, size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # dim 0 = the source: cp rank r's head slice
    return recv.transpose(0, 1).reshape(b, size * hs, n, d)


class _SwapSharding(torch.autograd.Function):
    """Sequence-sharded -> head-sharded (`to_heads`) or back, one all-to-all over the cp
    group; the gradient goes back through the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int, to_heads: bool):
        ctx.group, ctx.size, ctx.to_heads = group, size, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(grad, ctx.group, ctx.size), None, None, None


def _offsets(sizes: tuple[int, ...]) -> list[int]:
    return [sum(sizes[:r]) for r in range(len(sizes))]


def _seq_to_heads_uneven(x: torch.Tensor, cp: ContextParallel, heads: tuple[int, ...]):
    """`_seq_to_heads` with uneven shares: (b, h, n_me, d) of this rank's tokens -> (b,
    heads[me], sum(n_i), d), cp rank r receiving head slice r of sizes `heads`; the tokens
    of every rank (`cp.token_counts`) in cp-rank order. One all-to-all of uneven splits."""
    b, _, n, d = x.shape
    tokens = cp.token_counts(n)
    at = _offsets(heads)
    send = torch.cat([x[:, o : o + hj].permute(1, 0, 2, 3).reshape(-1) for o, hj in zip(at, heads)])
    mine = heads[cp.rank]
    outs = [mine * b * ni * d for ni in tokens]
    parts = _all_to_all_uneven(send, [hj * b * n * d for hj in heads], outs, cp.group)
    return torch.cat(
        [p.view(mine, b, ni, d).permute(1, 0, 2, 3) for p, ni in zip(parts, tokens)], dim=2
    )


def _all_to_all_uneven(
    send: torch.Tensor, ins: list[int], outs: list[int], group
) -> tuple[torch.Tensor, ...]:
    """One all-to-all of a flat `send` cut into `ins` elements per rank (in rank order); the
    received pieces, `outs` elements from each rank."""
    recv = send.new_empty(sum(outs))
    dist.all_to_all_single(recv, send, output_split_sizes=outs, input_split_sizes=ins, group=group)
    return recv.split(outs)


def _heads_to_seq_uneven(y: torch.Tensor, cp: ContextParallel, heads: tuple[int, ...]):
    """The inverse of `_seq_to_heads_uneven`: (b, heads[me], S, d) -> (b, sum(heads), n_me, d)."""
    b, mine, _, d = y.shape
    tokens = cp.token_counts(None)
    at = _offsets(tokens)
    n = tokens[cp.rank]
    send = torch.cat(
        [y[:, :, o : o + nj].permute(1, 0, 2, 3).reshape(-1) for o, nj in zip(at, tokens)]
    )
    outs = [hi * b * n * d for hi in heads]
    parts = _all_to_all_uneven(send, [mine * b * nj * d for nj in tokens], outs, cp.group)
    return torch.cat(
        [p.view(hi, b, n, d).permute(1, 0, 2, 3) for p, hi in zip(parts, heads)], dim=1
    )


class _SwapUneven(torch.autograd.Function):
    """`_SwapSharding` for uneven token and head shares (HexiSeq's asymmetric split)."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallel, heads: tuple[int, ...], to_heads: bool):
        ctx.cp, ctx.heads, ctx.to_heads = cp, heads, to_heads
        return (_seq_to_heads_uneven if to_heads else _heads_to_seq_uneven)(x, cp, heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _heads_to_seq_uneven if ctx.to_heads else _seq_to_heads_uneven
        return back(grad.contiguous(), ctx.cp, ctx.heads), None, None, None


def _head_parallel_uneven(q, k, v, cp: ContextParallel, causal: bool, scale: float):
    """Head-parallel attention with per-rank token shares (`cp.shares`) and query-head shares
    (`cp.head_shares`, default: the equal split): rank r runs SDPA on its head_shares[r]
    query heads over the whole sequence."""
    heads, kv_heads = q.shape[1], k.shape[1]
    shares = cp.head_shares or (heads // cp.size,) * cp.size
    if why := cp_head_shares_problem(shares, cp.size, heads):
        raise RuntimePlanError(f"runtime: {why}")
    f = kv_expansion(heads, kv_heads, shares)
    per = heads // (kv_heads * f)  # query heads per expanded K/V head
    k, v = (_expand(t, f) for t in (k, v))
    kv_shares = tuple(s // per for s in shares)
    q = _SwapUneven.apply(q, cp, shares, True)
    k, v = (_SwapUneven.apply(t, cp, kv_shares, True) for t in (k, v))
    local = cp.token_counts(None)[cp.rank]
    if causal:
        slots = torch.cat(cp.all_positions(local, q.device))
        natural = torch.argsort(slots)
        q, k, v = (t.index_select(2, natural) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    if causal:
        out = out.index_select(2, slots)
    return _SwapUneven.apply(out, cp, shares, False)


def _head_parallel_attention(q, k, v, cp: ContextParallel, causal: bool, scale: float):
    """Exact attention with heads sharded over the cp group; see the module docstring."""
    heads, kv_heads, local = q.shape[1], k.shape[1], q.shape[2]
    if why := cp_heads_problem(heads, cp.size):
        raise RuntimePlanError(f"runtime: {why}")
    # The fewest copies of each K/V head that make their count a multiple of cp. Expanded
    # head e is K/V head e // f, so query head i still reads K/V head i // (heads/kv_heads)
    # through expanded head i // (heads/(kv_heads*f)), and rank r's query heads read exactly
    # its slice of expanded heads. The gradient sums the copies back (repeat_interleave).
    k, v = (_expand(t, cp.size // math.gcd(kv_heads, cp.size)) for t in (k, v))
    q, k, v = (_SwapSharding.apply(t, cp.group, cp.size, True) for t in (q, k, v))
    # Every rank's tokens, in cp-rank order: the zig-zag shares are not in position order,
    # so under a causal mask they are put in order (a fused kernel's `is_causal` then holds)
    # and back afterwards. A contiguous split is in order already.
    reorder = causal and sequence_layout(local * cp.size, cp.size) == "zigzag"
    if reorder:
        slots = torch.cat(cp.all_positions(local, q.device))  # position of each token
        natural = torch.argsort(slots)  # the token at each position
        q, k, v = (t.index_select(2, natural) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    if reorder:
        out = out.index_select(2, slots)
    return _SwapSharding.apply(out, cp.group, cp.size, False)


def _usp_attention(q, k, v, cp: ContextParallel, causal: bool, scale: float):
    """Exact attention split two ways: heads over the head group, K/V all-gathered over the
    K/V group ("usp", see the module docstring)."""
    heads, kv_heads, local = q.shape[1], k.shape[1], q.shape[2]
    u = cp.head_degree
    if why := cp_usp_problem(heads, cp.size, u):
        raise RuntimePlanError(f"runtime: {why}")
    assert cp.usp is not None
    r = cp.size // u
    # K/V heads repeated to the fewest copies u divides (as `_head_parallel_attention`).
    k, v = (_expand(t, u // math.gcd(kv_heads, u)) for t in (k, v))
    q, k, v = (_SwapSharding.apply(t, cp.usp.heads_group, u, True) for t in (q, k, v))
    # (b, h/u, u*local, d): the tokens of cp ranks j*u .. j*u+u-1 in order. Gathered over
    # the K/V group in its rank order j' = 0 .. r-1, K/V then hold every cp rank's tokens in
    # cp-rank order (`all_positions`).
    mask = None
    if causal:
        pos = cp.all_positions(local, q.device)
        j = cp.rank // u
        mask = _causal_mask(torch.cat(pos[j * u : (j + 1) * u]), torch.cat(pos))

    def gather(kv):
        return _GatherSeq.apply(kv, cp.usp.ring_group, r)

    out = _gathered_attention(q, k, v, gather, mask, scale)
    return _SwapSharding.apply(out, cp.usp.heads_group, u, False)


def _gathered_attention(q, k, v, gather, mask, scale: float) -> torch.Tensor:
    """SDPA of `q` against K/V gathered along the sequence by `gather` (an all-gather with
    autograd over (seq, b, 2 kv, d): K and V together, one collective), masked by `mask`."""
    hk = k.shape[1]
    # (seq, b, 2*hk, d): gathering along dim 0 concatenates the ranks' tokens.
    kv = gather(torch.cat([k, v], dim=1).permute(2, 0, 1, 3)).permute(1, 2, 0, 3)
    return F.scaled_dot_product_attention(
        q, kv[:, :hk], kv[:, hk:], attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != hk
    )


def _causal_mask(pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
    """(local queries, keys) bool: query at position i may attend keys at positions <= i."""
    return pos_q.unsqueeze(1) >= pos_k.unsqueeze(0)


# -- the per-rank handle ----------------------------------------------------------------------


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its cp group, and attention over the sharded sequence."""

    group: dist.ProcessGroup
    rank: int  # index inside the cp group
    size: int
    mode: str = "allgather"
    # Tokens of a sequence per cp rank (`Parallel.cp_shares`; None: equal shares).
    shares: tuple[int, ...] | None = None
    # Query heads (of a tp rank's) per cp rank under "heads" (`Parallel.cp_head_shares`;
    # None: equal).
    head_shares: tuple[int, ...] | None = None
    # Under "usp": the head-parallel degree u (`Parallel.cp_head_degree`) and this rank's
    # head and K/V groups (`mesh.usp_groups`).
    head_degree: int = 1
    usp: UspGroups | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise RuntimePlanError(
                f"runtime: cp attention must be one of {MODES}, got {self.mode!r}"
            )
        if self.mode == "usp" and (self.shares is not None or self.head_shares is not None):
            raise RuntimePlanError(
                "runtime: cp attention 'usp' over uneven cp shares is not written; plan "
                "cp_mode allgather or heads with cp_shares"
            )
        if self.mode == "ring" and self.shares is not None:
            raise RuntimePlanError(
                "runtime: ring attention over uneven cp shares is not written; plan cp_mode "
                "allgather or heads with cp_shares"
            )

    @property
    def uneven(self) -> bool:
        return self.shares is not None or self.head_shares is not None

    @property
    def next_rank(self) -> int:
        """Global rank of the next rank on the cp ring."""
        return dist.get_global_rank(self.group, (self.rank + 1) % self.size)

    @property
    def prev_rank(self) -> int:
        return dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def token_counts(self, local_len: int | None) -> tuple[int, ...]:
        """Tokens of a sequence each cp rank holds, given this rank's `local_len` (None: the
        plan's shares, which must then be set)."""
        if self.shares is not None:
            if local_len is not None and local_len != self.shares[self.rank]:
                raise RuntimePlanError(
                    f"runtime: cp rank {self.rank} holds {local_len} tokens of a sequence but "
                    f"the plan's cp_shares give it {self.shares[self.rank]}; run the plan's "
                    f"seq_len ({sum(self.shares)})"
                )
            return self.shares
        if local_len is None:
            raise RuntimePlanError("runtime: token counts of an equal split need its length")
        return (local_len,) * self.size

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """Absolute positions of this rank's `local_len` tokens."""
        counts = self.token_counts(local_len)
        return sequence_positions(sum(counts), self.size, self.rank, self.shares).to(device)

    def all_positions(self, local_len: int, device=None) -> list[torch.Tensor]:
        """The positions every cp rank holds, in cp-rank order (one tensor per rank)."""
        s = sum(self.token_counts(local_len))
        return [
            sequence_positions(s, self.size, r, self.shares).to(device) for r in range(self.size)
        ]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` (full sequences along `dim`)."""
        if self.shares is not None and x.shape[dim] != sum(self.shares):
            raise RuntimePlanError(
                f"runtime: sequences of {x.shape[dim]} tokens, but the plan's cp_shares split "
                f"{sum(self.shares)}; run the plan's seq_len"
            )
        pos = sequence_positions(x.shape[dim], self.size, self.rank, self.shares).to(x.device)
        return x.index_select(dim, pos)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """`F.scaled_dot_product_attention` on this rank's queries against the whole sequence.

        q/k/v: (batch, heads, local_seq, head_dim) of this rank's tokens (K/V may have fewer
        heads, grouped-query attention)."""
        if attn_mask is not None or dropout_p:
            raise RuntimePlanError(
                "runtime: context parallel attention supports is_causal or no mask, without "
                "dropout; explicit attn_mask/dropout_p are not exact under cp"
            )
        if query.shape[1] != key.shape[1] and query.shape[1] % key.shape[1]:
            raise RuntimePlanError("runtime: query heads must be a multiple of K/V heads")
        scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        if self.mode == "ring":
            return _RingAttention.apply(query, key, value, self, bool(is_causal), scale)
        if self.mode == "heads" and self.uneven:
            return _head_parallel_uneven(query, key, value, self, bool(is_causal), scale)
        if self.mode == "heads":
            return _head_parallel_attention(query, key, value, self, bool(is_causal), scale)
        if self.mode == "usp":
            return _usp_attention(query, key, value, self, bool(is_causal), scale)
        local = key.shape[2]
        counts = self.token_counts(local)

        def gather(kv):
            if self.shares is None:
                return _GatherSeq.apply(kv, self.group, self.size)
            return _GatherUneven.apply(kv, self.group, counts, self.rank)

        mask = None
        if is_causal:
            pos_q = self.positions(local, query.device)
            mask = _causal_mask(pos_q, torch.cat(self.all_positions(local, query.device)))
        return _gathered_attention(query, key, value, gather, mask, scale)


class _RedirectSdpa(TorchFunctionMode):
    """Inside an attention module's forward: SDPA -> `ContextParallel.attention`."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.cp.attention(*args, **kwargs)
        return func(*args, **kwargs)


# -- applying it to a model -------------------------------------------------------------------


def _is_attention(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Module) for a in ("q_proj", "k_proj", "v_proj"))


def _wrap_attention(m: nn.Module, cp: ContextParallel) -> None:
    """Replace `m.forward` (instance attribute, so hooks and wrappers keep working)."""
    orig = m.forward
    try:
        names = list(inspect.signature(orig).parameters)
    except (TypeError, ValueError):
        names = []
    rope_at = names.index("rope") if "rope" in names else None
    first = names[0] if names else ""

    # `wraps`: the signature stays the original's, which TP's `RegionInput` reads to find the
    # activation when the module is called by keywords (HF's decoder layers call
    # `self_attn(hidden_states=...)`); without it the region input was not converted and
    # every projection gathered its own input (3 all-gathers for q/k/v, caught under CP x SP).
    @functools.wraps(orig)
    def forward(*args, **kwargs):
        x = args[0] if args else kwargs.get(first, next(iter(kwargs.values())))
        local = x.shape[1]
        if rope_at is not None:
            args, kwargs = _reindex_rope(args, kwargs, rope_at, cp.positions(local, x.device))
        with _RedirectSdpa(cp):
            return orig(*args, **kwargs)

    m.forward = forward


def _reindex_rope(args, kwargs, at, pos):
    def pick(tables):
        if isinstance(tables, (tuple, list)) and len(tables) == 2:
            return tuple(t.index_select(0, pos) for t in tables)
        return tables

    if len(args) > at:
        args = (*args[:at], pick(args[at]), *args[at + 1 :])
    elif "rope" in kwargs:
        kwargs = {**kwargs, "rope": pick(kwargs["rope"])}
    return args, kwargs


def _wrap_positions(embedding: nn.Embedding, cp: ContextParallel) -> None:
    """Learned positions looked up with arange(local_len) -> this rank's positions."""

    def hook(_m, args):
        ids = args[0]
        pos = cp.positions(ids.shape[-1], ids.device)
        return (pos.index_select(0, ids.reshape(-1)).view(ids.shape), *args[1:])

    embedding.register_forward_pre_hook(hook)


def _wrap_unit(unit: nn.Module, cp: ContextParallel) -> None:
    """A repeated layer whose attention is not in a module with q/k/v projections: every
    `F.scaled_dot_product_attention` its forward calls is redirected (no `rope` argument to
    re-index; the tracer refuses cp for models that count positions inside it)."""
    orig = unit.forward

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        with _RedirectSdpa(cp):
            return orig(*args, **kwargs)

    unit.forward = forward


def apply_context_parallel(
    chunks: Chunks, ctx: RankContext, options: Options
) -> ContextParallel | None:
    """Make every chunk's attention work on this rank's sequence share, as
    `options.cp_attention` says (see module docstring); under CP or sequence parallelism, give
    HF decoders the positions of the tokens their attention holds (`options.reposition`,
    `reposition_hf_decoder`).

    Returns the handle the runner uses to shard inputs and targets (None when cp == 1)."""
    cp = None
    usp = None
    if options.cp_attention == "usp" and ctx.size("cp") > 1:
        degree = ctx.plan.parallel.cp_head_degree
        if why := cp_usp_problem(0, ctx.size("cp"), degree):
            raise RuntimePlanError(f"runtime: {why}")
        usp = usp_groups(ctx, degree)  # type: ignore[arg-type]
    for chunk in chunks:
        mine = _shard_attention(
            chunk.module,
            ctx,
            options.cp_attention,
            has_layers=bool(chunk.units),
            units=chunk.units,
            usp=usp,
        )
        cp = mine or cp
        if options.reposition and not reposition_hf_decoder(
            chunk.module, sequence_shards(ctx.plan), cp
        ):
            raise RuntimePlanError(
                f"runtime: {type(chunk.module).__name__} holds a HuggingFace model but no "
                "rotary_emb beside its layers to give the sequence's positions to"
            )
    return cp


def _shard_attention(
    module: nn.Module,
    ctx: RankContext,
    mode: str,
    *,
    has_layers: bool,
    units: tuple[str, ...],
    usp: UspGroups | None = None,
) -> ContextParallel | None:
    """Make `module`'s attention work on this rank's sequence share (see module docstring).

    Raises `RuntimePlanError` when cp > 1 and no attention module is found although
    `module` runs repeated units (`has_layers`; a pipeline chunk of only the prologue or
    epilogue has no attention).
    """
    size = ctx.size("cp")
    if size == 1:
        return None
    p = ctx.plan.parallel
    cp = ContextParallel(
        ctx.group("cp"),
        ctx.coord("cp"),
        size,
        mode,
        p.cp_shares,
        p.cp_head_shares,
        head_degree=(p.cp_head_degree or 1) if mode == "usp" else 1,
        usp=usp,
    )
    hooked = wrapped = 0
    taken: list[str] = []  # paths of modules whose attention is handled
    for path, m in module.named_modules():
        if hasattr(m, "context_parallel_attention"):
            m.context_parallel_attention(cp)
            hooked += 1
            taken.append(path)
        elif _is_attention(m):
            _wrap_attention(m, cp)
            wrapped += 1
            taken.append(path)
    # Repeated layers with no such module inside: their SDPA calls, wherever they are.
    for u in units:
        try:
            unit = module.get_submodule(u)
        except AttributeError:
            continue
        if not any(t == u or t.startswith(u + ".") for t in taken):
            _wrap_unit(unit, cp)
            wrapped += 1
    # Tables of learned positions looked up with 0..n-1 (the plan's, from the trace; and
    # the zoo's root `pos_embed` for plans made before they were recorded).
    tables = [*ctx.plan.model.positions, "pos_embed"]
    seen: set[int] = set()
    for path in tables:
        try:
            table = module.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(table, nn.Embedding) and id(table) not in seen:
            seen.add(id(table))
            _wrap_positions(table, cp)
    # A pipeline stage of only the prologue/epilogue has no attention to shard.
    if not (hooked or wrapped) and has_layers:
        raise RuntimePlanError(
            f"runtime: cp={size} but {type(module).__name__} has no attention module this "
            "runtime can shard: give attention modules q_proj/k_proj/v_proj children calling "
            "F.scaled_dot_product_attention, or a `context_parallel_attention(cp)` method"
        )
    return cp


# -- HuggingFace decoders: the positions of the sequence the attention sees (see the docstring) -


def sequence_shards(plan: Plan) -> int:
    """How many shards of its (cp share of the) sequence a rank's hidden state holds between
    attention regions: tp under sequence parallelism, else 1."""
    tp = plan.parallel.tp or 1
    return tp if plan.parallel.sequence_parallel and tp > 1 else 1


def check_sequence_sharding(model: nn.Module, plan: Plan) -> bool:
    """Refuse, in one line naming the fix, a plan that shards sequences (sequence parallelism,
    cp > 1) of a model that cannot run on a share of them
    (`meshplan.ir.trace.sequence_sharding_blocker`). True when the runtime must give the
    model positions (`reposition_hf_decoder`): it is or holds HuggingFace decoders, under SP
    or CP."""
    sp, cp = sequence_shards(plan) > 1, (plan.parallel.cp or 1) > 1
    if not (sp or cp):
        return False
    why = sequence_sharding_blocker(model, plan.model.seq_len)
    if why:
        fix = " and ".join(f for f, on in (("sequence_parallel=False", sp), ("cp=1", cp)) if on)
        raise RuntimePlanError(f"runtime: {why}; plan with {fix}")
    return bool(hf_models(model))


# Marks a rotary module `reposition_hf_decoder` has hooked.
_REPOSITIONED = "_meshplan_repositioned"


def reposition_hf_decoder(module: nn.Module, shards: int, cp: ContextParallel | None) -> int:
    """Give every HF decoder's rotary module in `module` (a `rotary_emb` beside `layers`: in
    `LlamaModel`, or in an `HFDecoderStage`) the positions of the tokens its attention's
    queries hold; returns how many were found.

    The model calls `rotary_emb(hidden, position_ids)` with `position_ids` an arange over the
    n tokens of the hidden state it holds (HF's default when no ids are passed, which the
    runner never does). They become `first + arange(n x shards)` (`shards`: tp under sequence
    parallelism), mapped to this rank's positions by `cp`. A sequence longer than the model's
    sliding window (`config.sliding_window` of the rotary module) is refused: a sliding
    window is causal attention only up to its length.

    Hooked once per rotary module: a rank's pipeline chunks (interleaved 1F1B, ZB-V) share the
    model's one `rotary_emb`, and a second hook would stretch the ids again."""
    size = cp.size if cp is not None else 1
    rotaries = [
        m.rotary_emb
        for m in module.modules()
        if isinstance(getattr(m, "rotary_emb", None), nn.Module) and hasattr(m, "layers")
    ]
    for rotary in rotaries:
        if getattr(rotary, _REPOSITIONED, False):
            continue
        setattr(rotary, _REPOSITIONED, True)
        window = sliding_window(getattr(rotary, "config", None))

        def hook(_m, args, kwargs, window=window):
            ids = args[1] if len(args) > 1 else kwargs["position_ids"]
            n = ids.shape[-1] * shards
            if window and n * size > window:
                raise RuntimePlanError(
                    f"runtime: sequences of {n * size} tokens exceed the model's sliding window "
                    f"({window}); plan with sequence_parallel=False and cp=1"
                )
            pos = torch.arange(n, device=ids.device) if cp is None else cp.positions(n, ids.device)
            ids = ids[..., :1] + pos  # keeps the batch dim and HF's offset (tokens already seen)
            if len(args) > 1:
                return (args[0], ids, *args[2:]), kwargs
            return args, {**kwargs, "position_ids": ids}

        rotary.register_forward_pre_hook(hook, with_kwargs=True)
    return len(rotaries)
