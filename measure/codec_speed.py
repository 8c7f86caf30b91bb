"""The lossless codec's speed, measured on this machine.

What the cost model assumes instead (`cost_model.compression.codec_speed`: measured once on a
CPU core, estimated on GPUs) and how it prices a coded collective are in
`meshplan.cost_model.compression`; this module runs the real codec (`meshplan.runtime.codec`)
so that `meshplan calibrate` can record the numbers (`ClusterProfile.codec`) or a user can
pass them to `meshplan.plan(..., codec=...)`.
"""

from __future__ import annotations

import time

import torch
from meshplan.cost_model.compression import CodecSpeed
from meshplan.runtime import codec


def measure_codec_speed(
    device: str | None = None, dtype: str = "bfloat16", numel: int = 1 << 22, repeats: int = 3
) -> CodecSpeed:
    """Measure the lossless codec on `device` (default: CUDA if available, else CPU): the
    median time of compress/decompress of `numel` gradient-like values gives the throughput,
    that of 4096 values the per-call cost. For `meshplan calibrate` to record."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)

    def timed(n: int) -> tuple[float, float]:
        x = (torch.randn(n, generator=gen) * 1e-3).to(device=dev, dtype=tdtype)
        enc, dec = [], []
        c = codec.compress(x)  # warm-up
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            c = codec.compress(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            codec.decompress(c)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            enc.append(t1 - t0)
            dec.append(time.perf_counter() - t1)
        return sorted(enc)[len(enc) // 2], sorted(dec)[len(dec) // 2]

    small_e, small_d = timed(4096)
    big_e, big_d = timed(numel)
    nbytes = numel * tdtype.itemsize
    return CodecSpeed(
        nbytes / max(big_e - small_e, 1e-9),
        nbytes / max(big_d - small_d, 1e-9),
        small_e,
        small_d,
        f"measured: {dev.type}, {torch.get_num_threads()} threads, {numel} {dtype} values",
    )
