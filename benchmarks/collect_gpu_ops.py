"""Measure kernel latencies on this machine's GPU into meshplan's kernel-data layout.

    python benchmarks/collect_gpu_ops.py -o DIR            # every op class, ~3 min on an H100
    python benchmarks/collect_gpu_ops.py -o DIR --quick    # a few shapes per class
    python benchmarks/gpu_op_latency.py --data DIR         # price the rows, errors per class

Writes `DIR/meshplan/<device>.csv.gz` (`<device>` as `torch.cuda.get_device_name()` names it),
which `meshplan.cost_model.kernel_data.read_meshplan` reads beside NeuSight's and Vidur's
public layouts. Needs torch alone (no meshplan import), so it runs wherever a CUDA build of
torch does; `--device cpu` runs the same sweep on the host for a check of the script.

What one row is: `seconds` is the kernel time of one call. Each call is captured `reps` times
into a CUDA graph, the graph replayed `REPLAYS` times between CUDA events, and the median
replay divided by `reps` (no launch cost, as in a training step whose host runs ahead). The
inputs rotate over enough copies that the copies of one graph exceed `ROTATE_BYTES` (more than
an H100's 50 MB or an H200's 60 MB L2), so a memory-bound kernel reads HBM as it would in a
step, not a cached tensor. `reps` is chosen so that one replay takes about `TARGET_S`.

Columns: `op` (what ran), `cls` (the class errors are reported by), `dtype`, shape columns
`b, m, n, k` whose meaning depends on `op` (below), `causal` and `kv` for attention,
`seconds`, `reps`, `device`, `torch`.

- `linear`: `F.linear(x (m x k), w (n x k))`; `mm_nt`: `dy.t() @ x` with dy (k x m) and x
  (k x n), the weight gradient's layout (the reduction over tokens, k).
- `bmm`: b batched (m x k) @ (k x n).
- `scaled_mm` (float8 e4m3, tensorwise scales, bf16 out) and `int_mm` (int8, int32 out):
  (m x k) @ (k x n).
- `add`, `mul` (two inputs), `gelu`, `silu` (one): a (b x m) tensor.
- `softmax` (last dim), `layer_norm`, `rms_norm` (affine, last dim): (b x m).
- `embedding`: b token ids into an (m x n) table.
- `sdpa_fwd`, `sdpa_fwd_bwd`: `F.scaled_dot_product_attention` with batch b, sequence m,
  n query heads of dim k, `kv` key/value heads (GQA), causal or not, on the flash backend.
  fwd_bwd is timed with CUDA events around whole iterations (autograd is not captured).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROTATE_BYTES = 256 * 2**20  # input copies per graph exceed this (beyond any GPU's L2)
TARGET_S = 2e-3  # one graph replay lasts about this long
REPLAYS = 5
MAX_REPS = 50
COLUMNS = ("op", "cls", "dtype", "b", "m", "n", "k", "causal", "kv", "seconds", "reps")

# Transformer shapes: (hidden, ffn, heads, kv heads), Llama 3 8B / 70B, GPT-3 1.3B / 2.7B.
MODELS = ((4096, 14336, 32, 8), (8192, 28672, 64, 8), (2048, 8192, 16, 16), (2560, 10240, 32, 32))
# Steps run only when `--only` names them.
OPT_IN = {"memory_dense"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Timer:
    """Kernel time of a callable on `device` (CUDA graphs), or wall time on the host."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def kernel(self, calls: list, est_s: float) -> tuple[float, int]:
        """Median seconds per call of `calls` (closures over rotating inputs, one per copy)."""
        reps = max(1, min(MAX_REPS, round(TARGET_S / max(est_s, 1e-7))))
        seq = [calls[i % len(calls)] for i in range(reps)]
        if not self.cuda:
            for c in seq[:2]:
                c()
            t0 = time.perf_counter()
            for c in seq:
                c()
            return (time.perf_counter() - t0) / reps, reps
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for c in calls[:3]:
                c()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in seq:
                c()
        graph.replay()
        times = []
        for _ in range(REPLAYS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3 / reps)
        del graph
        return statistics.median(times), reps

    def iterations(self, step, est_s: float) -> tuple[float, int]:
        """Median seconds of `step()` timed whole (events on CUDA), after two warm-ups."""
        reps = max(3, min(20, round(0.05 / max(est_s, 1e-6))))
        for _ in range(2):
            step()
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            else:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        return statistics.median(times), reps


def copies(nbytes: int) -> int:
    return max(1, min(MAX_REPS, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def rand(shape, dtype, device, gen):
    return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(dtype)


class Sweep:
    def __init__(self, device: torch.device, quick: bool, seed: int = 0):
        self.device = device
        self.quick = quick
        self.timer = Timer(device)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.rng = random.Random(seed)
        self.rows: list[dict] = []
        # Rough rates to size `reps` (not part of any result).
        self.flops = 5e14 if device.type == "cuda" else 5e10
        self.bw = 2e12 if device.type == "cuda" else 1e10

    def est(self, flop: float, nbytes: float) -> float:
        return max(flop / self.flops, nbytes / self.bw, 3e-6)

    def add(self, op, cls, dtype, seconds, reps, b=0, m=0, n=0, k=0, causal="", kv=0):
        self.rows.append(dict(op=op, cls=cls, dtype=dtype, b=b, m=m, n=n, k=k, causal=causal,
                              kv=kv, seconds=f"{seconds:.6e}", reps=reps))  # fmt: skip

    def pick(self, items: list, quick_n: int) -> list:
        return items[:quick_n] if self.quick else items

    # -- GEMMs ---------------------------------------------------------------------------
    def gemm_shapes(self, dtype: str) -> list[tuple[int, int, int]]:
        """(m, n, k): transformer projections at TP 1-8 and 512-8192 tokens, then log-uniform
        random shapes (sizes 64-16384, at most 2 TFLOP)."""
        out = []
        for h, f, heads, kv in MODELS:
            hd = h // heads
            for tp in (1, 2, 4, 8):
                for t in (512, 2048, 8192):
                    out += [(t, (heads + 2 * kv) * hd // tp, h), (t, h, h // tp),
                            (t, 2 * f // tp, h), (t, h, f // tp)]  # fmt: skip
        n_random = 60 if dtype == "float32" else 120
        while len(out) < 192 + n_random:
            m, n, k = (int(2 ** self.rng.uniform(6, 14)) for _ in range(3))
            if 2 * m * n * k <= 2e12:
                out.append((m, n, k))
        if dtype == "float32":  # CUDA-core GEMMs are slow: fewer and smaller projections
            out = [s for s in out if 2 * s[0] * s[1] * s[2] <= 2e11][::3]
        return out

    def linear(self, dtype: str, tf32: bool = False):
        dt = DTYPES[dtype]
        torch.backends.cuda.matmul.allow_tf32 = tf32
        name = "tf32" if tf32 else dtype
        cls = {"float32": "linear_fp32", "tf32": "linear_tf32"}.get(name, "gemm")
        for m, n, k in self.pick(self.gemm_shapes(dtype), 4):
            size = dt.itemsize * (m * k + n * k + m * n)
            xs = [(rand((m, k), dt, self.device, self.gen), rand((n, k), dt, self.device, self.gen))
                  for _ in range(min(4, copies(size)))]  # fmt: skip
            calls = [lambda x=x, w=w: F.linear(x, w) for x, w in xs]
            s, reps = self.timer.kernel(calls, self.est(2 * m * n * k, size))
            self.add("linear", cls, name, s, reps, m=m, n=n, k=k)
        torch.backends.cuda.matmul.allow_tf32 = False

    def weight_grad(self, dtype: str):
        dt = DTYPES[dtype]
        for h, f, heads, kv in self.pick(list(MODELS), 1):
            for tp in (1, 8):
                for t in (2048, 8192):
                    for n_out, k_in in ((h, f // tp), (2 * f // tp, h)):
                        dy = rand((t, n_out), dt, self.device, self.gen)
                        x = rand((t, k_in), dt, self.device, self.gen)
                        size = dt.itemsize * (t * n_out + t * k_in + n_out * k_in)
                        s, reps = self.timer.kernel(
                            [lambda: dy.t() @ x], self.est(2 * t * n_out * k_in, size)
                        )
                        self.add("mm_nt", "gemm", dtype, s, reps, m=n_out, n=k_in, k=t)

    def bmm(self, dtype: str):
        dt = DTYPES[dtype]
        shapes = [(bh, s, s, d) for bh in (32, 128) for s in (512, 2048) for d in (64, 128)]
        shapes += [(bh, s, d, s) for bh in (32, 128) for s in (512, 2048) for d in (64, 128)]
        while len(shapes) < 80:
            b = int(2 ** self.rng.uniform(0, 8))
            m, n, k = (int(2 ** self.rng.uniform(5, 12)) for _ in range(3))
            if 2 * b * m * n * k <= 1e12:
                shapes.append((b, m, n, k))
        for b, m, n, k in self.pick(shapes, 3):
            size = dt.itemsize * b * (m * k + k * n + m * n)
            n_sets = min(4, copies(size))
            xs = [(rand((b, m, k), dt, self.device, self.gen),
                   rand((b, k, n), dt, self.device, self.gen)) for _ in range(n_sets)]  # fmt: skip
            s, reps = self.timer.kernel([lambda x=x, y=y: torch.bmm(x, y) for x, y in xs],
                                        self.est(2 * b * m * n * k, size))  # fmt: skip
            self.add("bmm", "bmm", dtype, s, reps, b=b, m=m, n=n, k=k)

    def low_precision(self):
        """float8 (`torch._scaled_mm`, e4m3, tensorwise) and int8 (`torch._int_mm`) GEMMs on
        the projection shapes: the kernels per-group precision (issue 19) prices."""
        if self.device.type != "cuda":
            return
        shapes = [s for s in self.gemm_shapes("bfloat16")[:192] if s[0] >= 512][::2]
        cap = torch.cuda.get_device_capability(self.device)
        for m, n, k in self.pick(shapes, 3):
            a = rand((m, k), torch.bfloat16, self.device, self.gen)
            b = rand((n, k), torch.bfloat16, self.device, self.gen)
            if cap >= (8, 9):
                a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
                one = torch.ones((), device=self.device)
                s, reps = self.timer.kernel(
                    [lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)],
                    self.est(2 * m * n * k, m * k + n * k + 2 * m * n),
                )
                self.add("scaled_mm", "gemm_fp8", "float8_e4m3fn", s, reps, m=m, n=n, k=k)
            ai = torch.randint(-8, 8, (m, k), dtype=torch.int8, device=self.device)
            bi = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=self.device).t()
            s, reps = self.timer.kernel(
                [lambda: torch._int_mm(ai, bi)], self.est(2 * m * n * k, m * k + n * k + 4 * m * n)
            )
            self.add("int_mm", "gemm_int8", "int8", s, reps, m=m, n=n, k=k)

    # -- memory-bound ----------------------------------------------------------------------
    def sizes(self, n: int) -> list[tuple[int, int]]:
        """(rows, width): 2^14-2^28 elements, widths of hidden and FFN sizes."""
        widths = (768, 1024, 2048, 4096, 5120, 8192, 14336, 28672)
        out = []
        for i in range(n):
            numel = 2 ** (14 + 14 * i / max(n - 1, 1))
            w = widths[i % len(widths)]
            out.append((max(1, round(numel / w)), w))
        return out

    def dense_sizes(self) -> list[tuple[int, int]]:
        """(rows, width) on a grid: widths 32-65536 (powers of two and common hidden sizes) at
        2^18, 2^22 and 2^26 elements, for the row-width dependence of row-wise kernels."""
        widths = sorted({2**i for i in range(5, 17)} | {768, 1536, 2560, 3072, 5120, 14336})
        return [(max(1, 2**e // w), w) for e in (18, 22, 26) for w in widths]

    def memory_bound(self, dtype: str, dense: bool = False):
        dt = DTYPES[dtype]
        unary = {"gelu": F.gelu, "silu": F.silu}
        binary = {"add": torch.add, "mul": torch.mul}
        ops = [(name, 2) for name in binary] + [(name, 1) for name in unary]
        ops += [("softmax", 1), ("layer_norm", 1), ("rms_norm", 1)]
        if dense:
            ops = [("add", 2), ("silu", 1), ("softmax", 1), ("layer_norm", 1), ("rms_norm", 1)]
        cls = {"softmax": "softmax", "layer_norm": "layernorm", "rms_norm": "norm"}
        for name, n_in in ops:
            for rows, w in self.dense_sizes() if dense else self.pick(self.sizes(24), 2):
                nbytes = dt.itemsize * rows * w * (n_in + 1)
                sets = [[rand((rows, w), dt, self.device, self.gen) for _ in range(n_in)]
                        for _ in range(copies(nbytes))]  # fmt: skip
                weight = torch.ones(w, dtype=dt, device=self.device)
                bias = torch.zeros(w, dtype=dt, device=self.device)

                def call(xs, name=name):
                    if name in binary:
                        return binary[name](xs[0], xs[1])
                    if name in unary:
                        return unary[name](xs[0])
                    if name == "softmax":
                        return torch.softmax(xs[0], dim=-1)
                    if name == "layer_norm":
                        return F.layer_norm(xs[0], (w,), weight, bias)
                    return F.rms_norm(xs[0], (w,), weight)

                s, reps = self.timer.kernel([lambda xs=xs: call(xs) for xs in sets],
                                            self.est(0, nbytes))  # fmt: skip
                self.add(name, cls.get(name, "elementwise"), dtype, s, reps, b=rows, m=w)
                del sets

    def embedding(self, dtype: str):
        dt = DTYPES[dtype]
        cases = [(t, v, h) for t in (512, 2048, 8192, 32768) for v, h in
                 ((32000, 4096), (128256, 4096), (128256, 8192), (50304, 2048))]  # fmt: skip
        for t, v, h in self.pick(cases, 2):
            table = rand((v, h), dt, self.device, self.gen)
            ids = [torch.randint(0, v, (t,), device=self.device, generator=self.gen)
                   for _ in range(copies(t * h * dt.itemsize * 2))]  # fmt: skip
            s, reps = self.timer.kernel([lambda i=i: F.embedding(i, table) for i in ids],
                                        self.est(0, 2 * t * h * dt.itemsize))  # fmt: skip
            self.add("embedding", "embedding", dtype, s, reps, b=t, m=v, n=h)

    # -- attention -------------------------------------------------------------------------
    def attention(self, dtype: str):
        if self.device.type != "cuda":
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        dt = DTYPES[dtype]
        cases = [(b, s, heads, d, kv, causal) for (b, s) in ((8, 1024), (4, 2048), (2, 4096),
                 (1, 8192), (1, 16384), (1, 32768)) for (heads, d, kv) in ((32, 128, 8),
                 (16, 64, 16)) for causal in (True, False)]  # fmt: skip
        for b, s, heads, d, kv, causal in self.pick(cases, 2):
            q = rand((b, heads, s, d), dt, self.device, self.gen).requires_grad_()
            k = rand((b, kv, s, d), dt, self.device, self.gen).requires_grad_()
            v = rand((b, kv, s, d), dt, self.device, self.gen).requires_grad_()
            flop = 4 * b * heads * s * s * d * (0.5 if causal else 1.0)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):

                def fwd():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          enable_gqa=kv != heads)  # fmt: skip

                def fwd_bwd():
                    fwd().backward(grad)

                grad = torch.ones((b, heads, s, d), dtype=dt, device=self.device)
                with torch.no_grad():
                    s_f, reps = self.timer.iterations(fwd, self.est(flop, 0))
                self.add("sdpa_fwd", "attention", dtype, s_f, reps, b=b, m=s, n=heads, k=d,
                         causal=int(causal), kv=kv)  # fmt: skip
                s_fb, reps = self.timer.iterations(fwd_bwd, self.est(3.5 * flop, 0))
                self.add("sdpa_fwd_bwd", "attention", dtype, s_fb, reps, b=b, m=s, n=heads, k=d,
                         causal=int(causal), kv=kv)  # fmt: skip

    def run(self, only: set[str] | None = None) -> None:
        steps = [
            ("gemm", lambda: [self.linear("bfloat16"), self.linear("float16"),
                              self.weight_grad("bfloat16")]),
            ("fp32", lambda: [self.linear("float32"), self.linear("float32", tf32=True)]),
            ("bmm", lambda: self.bmm("bfloat16")),
            ("lowp", self.low_precision),
            ("memory", lambda: [self.memory_bound("bfloat16"), self.memory_bound("float32")]),
            ("memory_dense", lambda: [self.memory_bound("bfloat16", dense=True),
                                      self.memory_bound("float32", dense=True)]),
            ("embedding", lambda: self.embedding("bfloat16")),
            ("attention", lambda: self.attention("bfloat16")),
        ]  # fmt: skip
        for name, step in steps:
            if (only and name not in only) or (not only and name in OPT_IN):
                continue
            t0, n0 = time.time(), len(self.rows)
            step()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{name}: {len(self.rows) - n0} rows in {time.time() - t0:.1f} s", flush=True)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def write(rows: list[dict], out: Path, device: str) -> Path:
    path = out / "meshplan" / f"{device}.csv.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", newline="") as f:
        w = csv.DictWriter(f, fieldnames=(*COLUMNS, "device", "torch"))
        w.writeheader()
        for r in rows:
            w.writerow({**r, "device": device, "torch": torch.__version__})
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--out", type=Path, required=True, help="dataset root to write under")
    ap.add_argument("--quick", action="store_true", help="a few shapes per class")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check)")
    ap.add_argument("--only", default="", help="comma-separated steps (gemm, fp32, bmm, lowp, "
                    "memory, embedding, attention; memory_dense only when named)")  # fmt: skip
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("collect_gpu_ops: no CUDA device; pass --device cpu to check the script",
              file=sys.stderr)  # fmt: skip
        return 2
    sweep = Sweep(device, args.quick)
    only = {s for s in args.only.split(",") if s} or None
    t0 = time.time()
    try:
        sweep.run(only)
    finally:  # whatever was measured is written, also when a step fails
        path = write(sweep.rows, args.out, device_name(device))
        print(f"{len(sweep.rows)} rows -> {path} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
