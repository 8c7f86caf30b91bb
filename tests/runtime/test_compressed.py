"""Compressed collectives on gloo: every result bit-identical to the uncompressed collective
(torch's own all_gather / all_to_all_single / send for data movement; `reduce_reference`, the
defined fp32 rank-order reduction, for reduce-scatter and all-reduce).

Each world size is one fork launch (`meshplan.runtime.launch.run_local`: torch imported
once, a process-group timeout and a faulthandler watchdog per rank) running every check, so
the file costs two launches. Chunks are small (`CHUNK`) so every tensor crosses several
pipelined rounds.
"""

from __future__ import annotations

import pytest
import torch
from meshplan.runtime import compressed as cc
from meshplan.runtime.codec import compress

CHUNK = 3000  # values per chunk: several rounds per tensor, uneven last chunks


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    it = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def make(seed: int, shape: tuple[int, ...], dtype: torch.dtype, specials: bool = False):
    """Deterministic test data: Gaussian at a seed-dependent scale, some exact zeros, and
    optionally inf/-inf/-0.0 (the codec's escape paths) sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2.0 ** (seed % 7 - 3)
    if x.numel():
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)] = 0.0
        if specials:
            flat[:: max(1, flat.numel() // 5)] = float("inf")
            flat[1 :: max(1, flat.numel() // 3)] = -0.0
    return x.to(dtype)


def _rank_checks() -> dict[str, str]:
    """Runs on every rank; returns check name -> "" (pass) or a failure message, plus a
    digest of the all-reduce result so the parent can compare ranks."""
    import torch.distributed as dist

    me, ws = dist.get_rank(), dist.get_world_size()
    out: dict[str, str] = {}

    def check(name: str, ok: bool, msg: str = "mismatch") -> None:
        out[name] = "" if ok else msg

    # all_gather: shapes differ by rank; compare with the generator and, for the common
    # shape, with torch's own all_gather.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = make(10 + me, (40 + 13 * me, 33), dtype, specials=me == 1)
        stats = cc.CommStats()
        got = cc.all_gather(x, chunk_numel=CHUNK, stats=stats)
        ok = all(
            same_bits(got[r], make(10 + r, (40 + 13 * r, 33), dtype, specials=r == 1))
            for r in range(ws)
        )
        check(f"all_gather[{dtype}]", ok)
        y = make(20 + me, (500,), dtype)
        plain = [torch.empty_like(y) for _ in range(ws)]
        dist.all_gather(plain, y)
        got = cc.all_gather(y, chunk_numel=128)
        check(f"all_gather_vs_torch[{dtype}]", all(same_bits(a, b) for a, b in zip(got, plain)))
    check("all_gather_stats", stats.collectives > 2 and stats.wire_bytes > 0)

    # all_to_all, uneven (zero rows included) and 3-D; compare with the generator and with
    # torch's all_to_all_single on the raw values.
    def a2a_shape(src: int, dst: int) -> tuple[int, ...]:
        return ((src + 2 * dst) % 4 * 50, 3, 7)

    inputs = [make(100 * me + d, a2a_shape(me, d), torch.bfloat16) for d in range(ws)]
    got = cc.all_to_all(inputs, chunk_numel=CHUNK)
    ok = all(
        same_bits(got[s], make(100 * s + me, a2a_shape(s, me), torch.bfloat16)) for s in range(ws)
    )
    check("all_to_all_uneven", ok)
    send_sizes = [t.numel() for t in inputs]
    recv_sizes = [torch.Size(a2a_shape(s, me)).numel() for s in range(ws)]
    plain = torch.empty(sum(recv_sizes), dtype=torch.bfloat16)
    dist.all_to_all_single(
        plain, torch.cat([t.reshape(-1) for t in inputs]), recv_sizes, send_sizes
    )
    check("all_to_all_vs_torch", same_bits(torch.cat([t.reshape(-1) for t in got]), plain))
    raw = cc.all_to_all(inputs, chunk_numel=CHUNK, compress=False)
    check("all_to_all_uncompressed", all(same_bits(a, b) for a, b in zip(got, raw)))

    # send / recv around a ring, even ranks sending first so nothing waits on itself.
    nxt, prv = (me + 1) % ws, (me - 1) % ws
    payload = make(300 + me, (123, 45), torch.bfloat16, specials=True)
    if me % 2 == 0:
        cc.send(payload, nxt, chunk_numel=CHUNK)
        got = cc.recv(prv)
    else:
        got = cc.recv(prv)
        cc.send(payload, nxt, chunk_numel=CHUNK)
    check("send_recv", same_bits(got, make(300 + prv, (123, 45), torch.bfloat16, specials=True)))
    if me == 0:
        cc.send(torch.tensor(2.5, dtype=torch.float16), 1)
        cc.send(torch.empty(0, 4, dtype=torch.float32), 1)
    elif me == 1:
        check("send_recv_scalar", same_bits(cc.recv(0), torch.tensor(2.5, dtype=torch.float16)))
        check("send_recv_empty", same_bits(cc.recv(0), torch.empty(0, 4)))

    # reduce_scatter and all_reduce against the defined reference (every rank's input is
    # regenerated locally from its seed), compressed and not.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        shape = (ws * 37 + 1, 50)  # dim 0 does not divide: uneven parts
        xs = [make(500 + r, shape, dtype) for r in range(ws)]
        for op in ("sum", "avg"):
            part = [x.tensor_split(ws)[me] for x in xs]
            ref = cc.reduce_reference(part, op)
            got = cc.reduce_scatter(xs[me], op=op, chunk_numel=CHUNK)
            check(f"reduce_scatter[{dtype},{op}]", same_bits(got, ref))
            got_raw = cc.reduce_scatter(xs[me], op=op, chunk_numel=CHUNK, compress=False)
            check(f"reduce_scatter_uncompressed[{dtype},{op}]", same_bits(got_raw, ref))
        xs = [make(700 + r, (2, 3001), dtype, specials=r == 0) for r in range(ws)]
        got = cc.all_reduce(xs[me], op="avg", chunk_numel=CHUNK)
        check(f"all_reduce[{dtype}]", same_bits(got, cc.reduce_reference(xs, "avg")))
        out[f"digest[{dtype}]"] = str(got.float().nan_to_num().sum().item())

    # Traffic: a bf16 all-reduce of Gaussian data puts ~1/1.4 of the raw bytes on the wire.
    stats = cc.CommStats()
    cc.all_reduce(torch.randn(ws * 40000).bfloat16(), chunk_numel=20000, stats=stats)
    check("all_reduce_compresses", stats.ratio > 1.3, f"wire ratio {stats.ratio:.3f}")
    # 2 rounds reduce-scatter + 2 rounds all-gather, 2 collectives each (sizes, data)
    check("all_reduce_collectives", stats.collectives == 8, f"{stats.collectives} collectives")
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compressed_collectives(world_size):
    from meshplan.runtime.launch import run_local

    results = run_local(_rank_checks, world_size, timeout_s=90, collective_timeout_s=60)
    for rank, res in enumerate(results):
        failed = {k: v for k, v in res.items() if not k.startswith("digest") and v}
        assert not failed, f"rank {rank}: {failed}"
    digests = [{k: v for k, v in r.items() if k.startswith("digest")} for r in results]
    assert all(d == digests[0] for d in digests), "ranks disagree on the all-reduce"


# -- single-process pieces ------------------------------------------------------------------


def test_reduce_reference_is_fp32_rank_order():
    """The definition, spelled out: widen, add left to right in fp32, round once."""
    a = torch.tensor([1.0, 2.0**-8], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-8, 1.0], dtype=torch.bfloat16)
    c = torch.tensor([2.0**-8, 2.0**-8], dtype=torch.bfloat16)
    got = cc.reduce_reference([a, b, c])
    # in bf16 arithmetic 1 + 2^-8 rounds back to 1 (a tie, to even); fp32 keeps both small
    # terms and 1 + 2^-7 is a bf16 value
    want = ((a.float() + b.float()) + c.float()).bfloat16()
    assert same_bits(got, want)
    assert got[0].item() != 1.0
    assert same_bits(cc.reduce_reference([a, b], "avg"), ((a.float() + b.float()) / 2).bfloat16())
    with pytest.raises(ValueError):
        cc.reduce_reference([a], "max")


def test_row_chunks_cover_the_tensor():
    x = torch.randn(1000, 7)
    parts = cc._row_chunks(x, 700)
    assert len(parts) == 10 and torch.equal(torch.cat(parts), x)
    assert len(cc._row_chunks(torch.randn(5, 10000), 100)) == 5  # at least one row each
    assert cc._row_chunks(torch.tensor(1.0), 10)[0].dim() == 0
    assert compress(torch.randn(10)).nbytes > 0
