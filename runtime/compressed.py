"""Losslessly compressed collectives on torch.distributed (any backend; tested on gloo).

The design follows ZipCCL (Lin et al., "ZipCCL: Efficient Lossless Data Compression of
Communication Collectives for Accelerating LLM Training", arXiv 2604.27844, 2026):

- Traffic is coded with `meshplan.runtime.codec` (exponent coding, ~1.45x on bf16), so every
  result is bit-identical to the same collective run on the raw tensors.
- Compressed data cannot be summed, so reduce-scatter is an all-to-all of compressed
  chunks, decompression, and a sum in fp32; all-reduce is that reduce-scatter followed by a
  compressed all-gather of the reduced shards.
- Coding is pipelined with the transfer: tensors are cut along dim 0 into chunks of about
  `chunk_numel` values; chunk i+1 is coded while chunk i is in flight (async collectives,
  at most `depth` rounds in flight) and chunk i is decoded while later ones travel. The
  break-even: coding in sequence with the transfer pays only if B/C + B/D < 1 - 1/r (link
  bandwidth B, compression and decompression rates C and D, ratio r); pipelined it pays
  whenever the codec outruns the link.

Every exchange is built on `all_to_all_single` with uneven splits, because compressed sizes
differ per rank and per chunk: gloo's list-form `all_gather`/`all_to_all` reject tensors of
different sizes, while `all_to_all_single` accepts uneven and zero splits (and so does NCCL).
A round first exchanges the buffer sizes (a small all-to-all), then the buffers. The codec's
buffers carry dtype and shape, so receivers need no side information; an all-gather sends
one coded buffer to every peer (the same per-rank volume as a ring all-gather).

Reductions: `reduce_reference(parts, op)` defines the result exactly. Values are widened
to fp32 (exact for bf16/fp16), added in rank order 0, 1, ..., ws-1 with IEEE fp32
round-to-nearest-even (`((x0 + x1) + x2) + ...`), divided by ws in fp32 for "avg", and
rounded once to the input dtype. All ranks of an all-reduce get the same bits. This is NOT
bitwise what `dist.all_reduce` returns (backends pick their own order and precision); tests
compare against `reduce_reference`, which the uncompressed path (`compress=False`) also meets.

All functions are collective: every rank of `group` calls them with the same options and
(for reductions) tensors of the same shape. Ranks are global ranks, as in torch.distributed.
Supported dtypes: bf16, fp16, fp32 (the codec's).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import codec

__all__ = [
    "DEFAULT_CHUNK_NUMEL",
    "CommStats",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "recv",
    "reduce_reference",
    "reduce_scatter",
    "send",
]

DEFAULT_CHUNK_NUMEL = 1 << 20
"""Values per pipelined chunk (2 MiB of bf16): big enough that the codec header and the size
exchange are noise, small enough that a 100 MB bucket gives ~50 chunks to overlap."""

DEFAULT_DEPTH = 2
"""Rounds in flight: coding round i+1 overlaps the transfer of round i (double buffering)."""

_REDUCE_OPS = ("sum", "avg")


@dataclass
class CommStats:
    """What the collectives of one caller did (pass one in as `stats=` to accumulate).

    `payload_bytes`: raw bytes of the tensor data sent to peers; `wire_bytes`: bytes put on
    the wire for them (coded buffers with headers, plus the size exchanges)."""

    collectives: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0

    @property
    def ratio(self) -> float:
        """Payload bytes / wire bytes."""
        return self.payload_bytes / self.wire_bytes if self.wire_bytes else 1.0


# -- helpers --------------------------------------------------------------------------------


def _row_chunks(t: torch.Tensor, chunk_numel: int) -> list[torch.Tensor]:
    """`t` cut along dim 0 into views of about `chunk_numel` values (at least one row each;
    a 0-d or empty tensor is one chunk, so its shape still reaches the receiver)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return [t]
    row_numel = max(1, t[0].numel())
    rows = max(1, chunk_numel // row_numel)
    return list(t.split(rows, dim=0))


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in codec.SUPPORTED_DTYPES:
        raise TypeError(f"{what}: dtype {t.dtype} not supported; use {codec.SUPPORTED_DTYPES}")


def _encode(t: torch.Tensor, use_codec: bool, stats: CommStats | None) -> torch.Tensor:
    t0 = time.perf_counter()
    buf = codec.compress(t, raw=not use_codec).data
    if stats is not None:
        stats.encode_s += time.perf_counter() - t0
    return buf


def _decode(buf: torch.Tensor, stats: CommStats | None) -> torch.Tensor:
    t0 = time.perf_counter()
    out = codec.decompress(buf)
    if stats is not None:
        stats.decode_s += time.perf_counter() - t0
    return out


def _count(stats: CommStats | None, collectives: int = 0, payload: int = 0, wire: int = 0):
    if stats is not None:
        stats.collectives += collectives
        stats.payload_bytes += payload
        stats.wire_bytes += wire


def _global_max(value: int, group, device: torch.device, stats: CommStats | None) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    _count(stats, collectives=1)
    return int(t.item())


def _rounds(
    sends: Sequence[Sequence[torch.Tensor]],
    group,
    *,
    use_codec: bool,
    rounds: int | None,
    depth: int,
    stats: CommStats | None,
) -> Iterator[tuple[int, list[torch.Tensor | None]]]:
    """The pipelined exchange under every collective here.

    `sends[dst]` lists the chunks this rank sends to `dst`, one per round (fewer is fine).
    Yields `(round, chunks)` with `chunks[src]` the chunk `src` sent this round (None if it
    sent none); this rank's own chunk is passed through uncoded. A chunk object sent to
    several peers in one round is coded once (all-gather). `rounds` must be equal on all
    ranks; None finds it with one small all-reduce."""
    if depth < 1:
        raise ValueError(f"compressed collectives: depth must be >= 1, got {depth}")
    ws = dist.get_world_size(group)
    me = dist.get_rank(group)  # rank within the group: all_to_all_single's order
    # Buffers live where the data lives (NCCL wants CUDA tensors, gloo takes CPU ones).
    device = next((c.device for s in sends for c in s), torch.device("cpu"))
    if rounds is None:
        rounds = _global_max(max(len(s) for s in sends), group, device, stats)
    pending: deque = deque()

    def finish(item) -> tuple[int, list[torch.Tensor | None]]:
        r, work, out, recv_sizes = item
        work.wait()
        chunks: list[torch.Tensor | None] = []
        for src, buf in enumerate(out.split(recv_sizes)):
            if src == me:
                chunks.append(sends[me][r] if r < len(sends[me]) else None)
            else:
                chunks.append(_decode(buf, stats) if buf.numel() else None)
        return r, chunks

    empty = torch.empty(0, dtype=torch.uint8, device=device)
    for r in range(rounds):
        coded: dict[int, torch.Tensor] = {}  # id(chunk) -> buffer: code each chunk once
        bufs, payload = [], 0
        for dst in range(ws):
            if dst == me or r >= len(sends[dst]):
                bufs.append(empty)
                continue
            chunk = sends[dst][r]
            if id(chunk) not in coded:
                coded[id(chunk)] = _encode(chunk, use_codec, stats)
            bufs.append(coded[id(chunk)])
            payload += chunk.numel() * chunk.element_size()
        send_sizes = [b.numel() for b in bufs]
        recv_sizes_t = torch.empty(ws, dtype=torch.int64, device=device)
        dist.all_to_all_single(
            recv_sizes_t, torch.tensor(send_sizes, dtype=torch.int64, device=device), group=group
        )
        recv_sizes = recv_sizes_t.tolist()
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        work = dist.all_to_all_single(
            out, torch.cat(bufs), recv_sizes, send_sizes, group=group, async_op=True
        )
        _count(stats, collectives=2, payload=payload, wire=sum(send_sizes) + 8 * (ws - 1))
        pending.append((r, work, out, recv_sizes))
        if len(pending) >= depth:
            yield finish(pending.popleft())
    while pending:
        yield finish(pending.popleft())


# -- collectives ----------------------------------------------------------------------------


def all_to_all(
    inputs: Sequence[torch.Tensor],
    group=None,
    *,
    compress: bool = True,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    depth: int = DEFAULT_DEPTH,
    stats: CommStats | None = None,
) -> list[torch.Tensor]:
    """`inputs[dst]` goes to rank `dst`; returns what each rank sent here, by source.

    Tensors may differ in shape per destination (uneven all-to-all, e.g. MoE dispatch);
    shapes travel in the buffers."""
    ws = dist.get_world_size(group)
    if len(inputs) != ws:
        raise ValueError(f"all_to_all: {len(inputs)} inputs for a group of {ws} ranks")
    for t in inputs:
        _check_dtype(t, "all_to_all")
    me = dist.get_rank(group)
    sends = [_row_chunks(t.contiguous(), chunk_numel) for t in inputs]
    received: list[list[torch.Tensor]] = [[] for _ in range(ws)]
    for _, chunks in _rounds(
        sends, group, use_codec=compress, rounds=None, depth=depth, stats=stats
    ):
        for src, c in enumerate(chunks):
            if c is not None and src != me:
                received[src].append(c)
    received[me] = [inputs[me].clone()]
    return [_join(parts) for parts in received]


def all_gather(
    tensor: torch.Tensor,
    group=None,
    *,
    compress: bool = True,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    depth: int = DEFAULT_DEPTH,
    stats: CommStats | None = None,
    _rounds_hint: int | None = None,
) -> list[torch.Tensor]:
    """Every rank's `tensor`, by rank (shapes may differ between ranks).

    Each chunk is coded once and sent to every peer."""
    _check_dtype(tensor, "all_gather")
    ws = dist.get_world_size(group)
    me = dist.get_rank(group)
    chunks = _row_chunks(tensor.contiguous(), chunk_numel)
    received: list[list[torch.Tensor]] = [[] for _ in range(ws)]
    for _, got in _rounds(
        [chunks] * ws, group, use_codec=compress, rounds=_rounds_hint, depth=depth, stats=stats
    ):
        for src, c in enumerate(got):
            if c is not None and src != me:
                received[src].append(c)
    received[me] = [tensor.clone()]
    return [_join(parts) for parts in received]


def reduce_reference(parts: Sequence[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """The defined result of a reduction over `parts` (one per rank, in rank order): widen
    to fp32, add in list order, divide by len(parts) for "avg", round once to the dtype."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce: op must be one of {_REDUCE_OPS}, got {op!r}")
    acc = parts[0].to(torch.float32, copy=True)
    for p in parts[1:]:
        acc.add_(p)  # p is widened to fp32 exactly; the add rounds in fp32
    if op == "avg":
        acc.div_(len(parts))
    return acc.to(parts[0].dtype)


def reduce_scatter(
    tensor: torch.Tensor,
    group=None,
    *,
    op: str = "sum",
    compress: bool = True,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    depth: int = DEFAULT_DEPTH,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Rank j gets `reduce_reference` of every rank's part j, where parts are
    `tensor.tensor_split(ws, dim=0)` (dim 0 need not divide evenly).

    All-to-all of coded chunks, decode, fp32 sum in rank order, chunk by chunk."""
    _check_dtype(tensor, "reduce_scatter")
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce_scatter: op must be one of {_REDUCE_OPS}, got {op!r}")
    if tensor.dim() == 0:
        raise ValueError("reduce_scatter: needs at least one dimension to scatter")
    ws = dist.get_world_size(group)
    me = dist.get_rank(group)
    parts = tensor.contiguous().tensor_split(ws, dim=0)
    sends = [_row_chunks(p, chunk_numel) for p in parts]
    # Shapes are equal on all ranks, so the round count is known without asking.
    rounds = max(len(s) for s in sends)
    out_chunks: list[torch.Tensor] = []
    for r, chunks in _rounds(
        sends, group, use_codec=compress, rounds=rounds, depth=depth, stats=stats
    ):
        if r < len(sends[me]):
            out_chunks.append(reduce_reference(chunks, op))  # rank order 0..ws-1
    return _join(out_chunks)


def all_reduce(
    tensor: torch.Tensor,
    group=None,
    *,
    op: str = "sum",
    compress: bool = True,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    depth: int = DEFAULT_DEPTH,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """`reduce_reference` of every rank's `tensor`, on every rank (a new tensor).

    Compressed reduce-scatter of the flattened tensor, then a compressed all-gather of the
    reduced shards: each value is rounded to the dtype once, so the shards are exact."""
    ws = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    shard = reduce_scatter(
        flat, group, op=op, compress=compress, chunk_numel=chunk_numel, depth=depth, stats=stats
    )
    rounds = max(len(_row_chunks(p, chunk_numel)) for p in flat.tensor_split(ws))
    shards = all_gather(
        shard,
        group,
        compress=compress,
        chunk_numel=chunk_numel,
        depth=depth,
        stats=stats,
        _rounds_hint=rounds,
    )
    return torch.cat(shards).view(tensor.shape)


def send(
    tensor: torch.Tensor,
    dst: int,
    group=None,
    *,
    compress: bool = True,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    tag: int = 0,
    stats: CommStats | None = None,
) -> None:
    """Send `tensor` to global rank `dst` (pair with `recv`). Chunk i+1 is coded while
    chunk i is in flight; returns when everything is sent."""
    _check_dtype(tensor, "send")
    chunks = _row_chunks(tensor.contiguous(), chunk_numel)
    device = tensor.device
    dist.send(
        torch.tensor([len(chunks)], dtype=torch.int64, device=device), dst, group=group, tag=tag
    )
    works, keep = [], []
    for c in chunks:
        buf = _encode(c, compress, stats)
        size = torch.tensor([buf.numel()], dtype=torch.int64, device=device)
        keep += [buf, size]  # isend buffers must outlive the sends
        works.append(dist.isend(size, dst, group=group, tag=tag))
        works.append(dist.isend(buf, dst, group=group, tag=tag))
        _count(stats, collectives=2, payload=c.numel() * c.element_size(), wire=buf.numel() + 8)
    for w in works:
        w.wait()
    _count(stats, collectives=1, wire=8)


def recv(
    src: int,
    group=None,
    *,
    tag: int = 0,
    device: torch.device | str = "cpu",
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Receive the tensor that global rank `src` sends with `send` (dtype and shape come
    with it) onto `device`. Chunk i is decoded while chunk i+1 arrives."""
    count = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(count, src, group=group, tag=tag)
    parts: list[torch.Tensor] = []
    previous = None
    for _ in range(int(count.item())):
        size = torch.empty(1, dtype=torch.int64, device=device)
        dist.recv(size, src, group=group, tag=tag)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        work = dist.irecv(buf, src, group=group, tag=tag)
        if previous is not None:
            previous[0].wait()
            parts.append(_decode(previous[1], stats))
        previous = (work, buf)
    if previous is not None:
        previous[0].wait()
        parts.append(_decode(previous[1], stats))
    return _join(parts)


# -- plan-driven hooks ------------------------------------------------------------------------


def _ddp_hook(fn):
    """DDP's `register_comm_hook` compares a hook's annotations with the objects
    `dist.GradBucket` / `Future[Tensor]`; under `from __future__ import annotations` they
    are strings and it refuses the hook, so they are dropped (the docstring says the types)."""
    fn.__annotations__ = {}
    return fn


@dataclass(frozen=True, slots=True)
class LosslessHookState:
    """State of `lossless_allreduce_hook`: the process group and the chunk count the plan
    chose (`CommDecision.chunks`)."""

    group: dist.ProcessGroup | None = None
    chunks: int = 1


@_ddp_hook
def lossless_allreduce_hook(
    state: LosslessHookState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket with the losslessly coded `all_reduce` (bit-exact
    with `reduce_reference`), in the plan's number of pipelined chunks. Synchronous, the
    Future returned completed (gloo, see docs/torch_notes.md)."""
    state = state or LosslessHookState()
    buf = bucket.buffer()
    chunk = max(1, -(-buf.numel() // max(1, state.chunks)))
    buf.copy_(all_reduce(buf, state.group, op="avg", chunk_numel=chunk))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


__all__ += ["LosslessHookState", "lossless_allreduce_hook"]


# -- FSDP2 communication hooks ----------------------------------------------------------------

try:  # FSDP2's extension points (torch >= 2.9)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover
    _AllGather = _ReduceScatter = object


def chunk_numel(numel: int, chunks: int) -> int:
    """Values per pipelined chunk when a tensor of `numel` values is cut into `chunks`
    (the plan's `CommDecision.chunks`)."""
    return max(1, -(-numel // max(1, chunks)))


class LosslessReduceScatter(_ReduceScatter):
    """FSDP2 gradient reduce-scatter with losslessly coded traffic:
    `fsdp_module.set_custom_reduce_scatter(LosslessReduceScatter(chunks))`.

    FSDP2 hands a flat input of ws equal shards and wants the reduction of shard j on rank j
    in `output_tensor`: `reduce_scatter` of the flat input gives exactly `reduce_reference`
    of the shards (fp32 sum in rank order, / ws for AVG), the same bits whether coded or not.
    With fp32/bf16 gradients FSDP2 asks for AVG, otherwise SUM with its own pre/post
    division. Runs synchronously (returns None: FSDP2 then does not wait on a Work)."""

    def __init__(self, chunks: int = 1, stats: CommStats | None = None) -> None:
        self.chunks, self.stats = chunks, stats

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        name = _fsdp_op(op, "LosslessReduceScatter")
        out = reduce_scatter(
            input_tensor.reshape(-1),
            group,
            op=name,
            chunk_numel=chunk_numel(output_tensor.numel(), self.chunks),
            stats=self.stats,
        )
        output_tensor.copy_(out.view_as(output_tensor))
        return None


class LosslessAllGather(_AllGather):
    """FSDP2 parameter all-gather with losslessly coded traffic:
    `fsdp_module.set_custom_all_gather(LosslessAllGather(chunks))`. Every rank's shard is
    coded once and decoded bit-exactly into `output_tensor` (rank-major, as FSDP2 expects).
    Parameters of mixed dtypes, which FSDP2 gathers as raw bytes (uint8), go uncoded."""

    def __init__(self, chunks: int = 1, stats: CommStats | None = None) -> None:
        self.chunks, self.stats = chunks, stats

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if input_tensor.dtype not in codec.SUPPORTED_DTYPES:
            dist.all_gather_single(output_tensor, input_tensor, group=group)
            return None
        flat = input_tensor.reshape(-1)
        per = chunk_numel(flat.numel(), self.chunks)
        parts = all_gather(
            flat,
            group,
            chunk_numel=per,
            stats=self.stats,
            _rounds_hint=len(_row_chunks(flat, per)),  # FSDP2's shards are equal on all ranks
        )
        torch.cat(parts, out=output_tensor.view(-1))
        return None


def _fsdp_op(op, who: str) -> str:
    if op == dist.ReduceOp.AVG:
        return "avg"
    if op == dist.ReduceOp.SUM:
        return "sum"
    raise NotImplementedError(f"{who}: reduce op {op} not supported (sum or avg)")


__all__ += ["LosslessAllGather", "LosslessReduceScatter", "chunk_numel"]
