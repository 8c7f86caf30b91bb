"""GEMM throughput in a short burst against the same GEMM run for many seconds, on a GPU.

    python benchmarks/gpu_sustained.py                 # ~2 minutes on an H100 / H200
    python benchmarks/gpu_sustained.py --seconds 5     # a quick look
    python benchmarks/gpu_sustained.py -o out.json     # also write the figures

Why (docs/fidelity.md, "The sustained-clock hypothesis"): meshplan's Hopper GEMM efficiency
(0.784 of the dense BF16 peak) comes from `collect_gpu_ops.py`, which times each kernel in
bursts of ~10 ms. A training step keeps the tensor cores busy for seconds, and a 700 W part
then runs below the clock a short burst gets. Megatron-Core's H100 rows (compute-bound, GEMMs
of 4096 tokens) run ~21% slower than meshplan prices them while its big-GEMM rows are within
~10%; if sustained GEMMs lose 10-20% to the clock, that is the missing term, and this script
measures it on the machine at hand.

What it does, per GEMM shape (bf16, random normal inputs: zeros or repeated values draw less
power and run faster, Horace He, "Strangely, Matrix Multiplications on GPUs Run Faster When
Given 'Predictable' Data!", 2024):
- burst: `collect_gpu_ops.py`'s method (the call captured into a CUDA graph ~2 ms long, the
  median of 5 replays) on a GPU that has idled for `--rest` seconds;
- sustained: the same graph replayed back to back for `--seconds`, each replay timed with
  CUDA events, the median of the second half reported; the SM clock, power and temperature
  are sampled once a second (torch.cuda's NVML readers where pynvml is installed, else
  `nvidia-smi`).
It prints, per shape, burst and sustained TFLOP/s, their ratio, and the clocks; `-o` writes
the same as JSON. Needs torch with CUDA alone (no meshplan import), like collect_gpu_ops.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# (tokens m, output features n, reduction k): the GEMMs of one layer of Megatron-Core's 1.7B
# (hidden 2048, ffn 8192, 4096 tokens; rows 11-12 of docs/fidelity.md), and a large square one
# (Llama 3 405B's layers at TP 8 are of this size).
SHAPES = ((4096, 6144, 2048), (4096, 8192, 2048), (4096, 2048, 8192), (8192, 8192, 8192))
BURST_S = 2e-3  # one graph replay lasts about this long (collect_gpu_ops.TARGET_S)
BURST_REPLAYS = 5


def graph_of(m: int, n: int, k: int, device: torch.device):
    """(CUDA graph of `reps` GEMMs lasting ~BURST_S, reps, FLOPs per replay)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)

    def call():
        torch.matmul(x, w.t(), out=out)

    call()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        call()
    b.record()
    torch.cuda.synchronize()
    one = a.elapsed_time(b) / 1e3 / 10
    reps = max(1, min(200, round(BURST_S / max(one, 1e-7))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.keep = (x, w, out)  # the graph reads these: keep them alive with it
    return graph, reps, 2.0 * m * n * k * reps


def replay_seconds(graph) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def sensors(device: torch.device) -> dict[str, float]:
    """SM clock (MHz), power (W), temperature (C) now; NaN where unreadable."""
    out = {"sm_clock_mhz": float("nan"), "power_w": float("nan"), "temp_c": float("nan")}
    try:
        out["sm_clock_mhz"] = float(torch.cuda.clock_rate(device))
        out["power_w"] = float(torch.cuda.power_draw(device)) / 1e3
        out["temp_c"] = float(torch.cuda.temperature(device))
        return out
    except Exception:  # no pynvml: ask nvidia-smi
        pass
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--id={device.index or 0}",
             "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip().splitlines()[0]  # fmt: skip
        clock, power, temp = (float(v) for v in line.split(","))
        out.update(sm_clock_mhz=clock, power_w=power, temp_c=temp)
    except Exception:
        pass
    return out


def measure(shape, device: torch.device, seconds: float, rest: float) -> dict:
    m, n, k = shape
    graph, reps, flops = graph_of(m, n, k, device)
    time.sleep(rest)  # let the clock recover from the previous shape
    burst_sensors = sensors(device)
    burst = statistics.median(replay_seconds(graph) for _ in range(BURST_REPLAYS))
    times, samples = [], []
    start = last = time.monotonic()
    while time.monotonic() - start < seconds:
        times.append(replay_seconds(graph))
        if time.monotonic() - last >= 1.0:
            samples.append(sensors(device))
            last = time.monotonic()
    late = times[len(times) // 2 :]
    sustained = statistics.median(late)

    def median_of(key: str) -> float:
        vals = [s[key] for s in samples[len(samples) // 2 :] if s[key] == s[key]]
        return statistics.median(vals) if vals else float("nan")

    return {
        "m": m, "n": n, "k": k, "reps": reps,
        "burst_tflops": flops / burst / 1e12,
        "sustained_tflops": flops / sustained / 1e12,
        "sustained_over_burst": burst / sustained,
        "burst_sm_clock_mhz": burst_sensors["sm_clock_mhz"],
        "sustained_sm_clock_mhz": median_of("sm_clock_mhz"),
        "sustained_power_w": median_of("power_w"),
        "sustained_temp_c": median_of("temp_c"),
        "seconds": seconds, "replays": len(times),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="sustained run per shape")
    ap.add_argument("--rest", type=float, default=5.0, help="idle seconds before each burst")
    ap.add_argument("-o", "--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_sustained: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    print(f"{name}, torch {torch.__version__}: {args.seconds:g} s per shape")
    rows = []
    for shape in SHAPES:
        r = measure(shape, device, args.seconds, args.rest)
        rows.append(r)
        print(
            f"  {r['m']}x{r['n']}x{r['k']}: burst {r['burst_tflops']:.0f} TFLOP/s at "
            f"{r['burst_sm_clock_mhz']:.0f} MHz, sustained {r['sustained_tflops']:.0f} at "
            f"{r['sustained_sm_clock_mhz']:.0f} MHz ({r['sustained_power_w']:.0f} W, "
            f"{r['sustained_temp_c']:.0f} C): ratio {r['sustained_over_burst']:.3f}",
            flush=True,
        )
    if args.out:
        args.out.write_text(
            json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
