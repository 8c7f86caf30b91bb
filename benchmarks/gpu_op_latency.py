"""Per-op pricing checked on real GPU kernels (docs/op_latency.md).

Reads public measured kernel latencies (`--data`, default `DEFAULT_DATA`) laid out as NeuSight's
`neusight/<op>/<device>.csv.gz` and Vidur's `vidur/<gpu>__<org>__<model>__mlp.csv.gz` (see
`meshplan.cost_model.kernel_data`), maps each device to the GPU table (an unknown device
stops the run with its name), prices every row with the planner's own function
(`compute.block_compute` of a one-op block: roofline, the kernel constants, wave
quantization), and prints per source, GPU and op class the MAPE, median and p90 absolute
error, plus one transformer layer's summed ops (Vidur rows).

    python benchmarks/gpu_op_latency.py                    # table, shipped constants
    python benchmarks/gpu_op_latency.py --json             # JSON summary on stdout
    python benchmarks/gpu_op_latency.py --data DIR         # another dataset of that layout
    python benchmarks/gpu_op_latency.py --fit              # refit the kernel-data constants
    python benchmarks/gpu_op_latency.py --learned          # + the learned path held out (~5 min)

Two protocols, both printed:

- **shipped**: the constants as shipped in `cost_model/compute.py`. The constants fitted on
  kernel data (`compute.MEMORY_EFFICIENCY_BY_KIND`, `compute.CUDA_CORE_GEMM_EFFICIENCY`)
  saw every GPU here, so this is in-sample for them.
- **leave-one-GPU-out** (the one to quote): for each GPU type, those constants are refitted
  on the rows of every *other* GPU type and the held-out type is priced with them. The
  per-GPU tensor-core GEMM efficiencies (`compute.KERNEL_EFFICIENCY`) come from published
  step times, never from these rows; GPU types without one take the default.

What a measurement includes differs by source, and is not part of an op's work: NeuSight
times one call between CUDA events (the launch and the event pair included, about 25 us),
Vidur the kernel alone. The planner's per-kernel floor (`compute.KERNEL_FLOOR_S`) is what a
kernel costs inside a training step, a third quantity. So each prediction here is the op's
work (the planner's time less its floor) plus the source's *measurement overhead*: the
median, over the other GPU types of that source, of each type's fastest elementwise kernel
(the smallest shapes are launch-bound); NeuSight's cuBLAS calls (`linear`, `bmm`) take the
fastest call of their own class the same way (`row_overheads`: cuBLAS's host-side work is
inside the timed call).

`--learned` adds the learned model (`cost_model.learned`) under the same leave-one-GPU-out
protocol: for each GPU type, an ensemble trained on a fixed-seed sample of the *other* types'
rows (`LearnedSettings`: 250 per GPU type and op class) on their datasheet features, with the
source's overhead as a training offset (`learned.train(offsets=)`) and added back to its
held-out prediction. Printed side by side with the analytic path, with a "best of" that picks,
per source and op class, the path with the lower held-out MAPE on the *other* GPU types, and
keeps the analytic path for a GPU type whose rows lie outside the training rows' device range
(`within_range`): the choice never looks at the GPU type it prices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from meshplan.cost_model import compute, learned
from meshplan.cost_model.features import essential_bytes, feature_names, gemm_dims
from meshplan.cost_model.kernel_data import (
    KernelRow,
    as_sample,
    device_spec,
    read_all,
    read_meshplan_raw,
)
from meshplan.ir import Block, GpuSpec, OpKind

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu_op_latency"
# Kernels meshplan measured itself (`benchmarks/collect_gpu_ops.py`; H200 in session 22),
# read beside the public data. No constant is fitted on them (`fit` reads NeuSight and Vidur).
OWN_DATA = Path(__file__).resolve().parents[1] / "data" / "gpu_op_latency"

# NeuSight's reported per-op errors (Lee et al., "Forecasting GPU Performance for Deep
# Learning Training and Inference", ASPLOS'25, per-operator table): the bar per op class.
NEUSIGHT_ERROR = {
    "bmm": 13.8,
    "linear": 13.9,
    "elementwise": 19.3,
    "softmax": 13.9,
    "layernorm": 56.7,
}
TARGET_FP16_GEMM = 10.0  # % MAPE
TARGET_LAYER = 5.0  # % MAPE of one layer's summed ops

# Kinds whose memory efficiency is fitted here (`compute.MEMORY_EFFICIENCY_BY_KIND`) and the
# rows that fit each: PyTorch's own kernels (NeuSight) for the kinds a training step runs
# eagerly; the embedding from Vidur's TP-1 rows (a plain `F.embedding`; under TP its rows
# also mask and fill, more kernels than one op).
FIT_KINDS = (OpKind.ELEMENTWISE, OpKind.SOFTMAX, OpKind.NORM, OpKind.EMBEDDING)
# log2 elements of the two dense-sweep rows (`collect_gpu_ops.py --only memory_dense`) a
# row-wise kernel's line goes through (`fit_rowwise`); its third size, 2^22, is the check.
ROWWISE_FIT_SIZES = (18, 26)


@dataclasses.dataclass
class Priced:
    """The rows as arrays (one entry per row) for fitting and reporting."""

    rows: list[KernelRow]
    gpu: np.ndarray  # GPU type name
    source: np.ndarray
    cls: np.ndarray
    kind: np.ndarray
    fp32_gemm: np.ndarray  # a GEMM on CUDA cores (float32)
    tp1: np.ndarray  # Vidur row at TP 1 (NeuSight: True)
    flop_s: np.ndarray  # seconds of FLOPs at the peak of the row's dtype (no efficiency)
    mem_s: np.ndarray  # seconds of essential bytes at the HBM bandwidth (no efficiency)
    wave: np.ndarray  # wave-quantization efficiency of a GEMM (1 otherwise)
    gemm_eff: np.ndarray  # the GPU type's tensor-core GEMM efficiency (published-run fits)
    align: np.ndarray  # `compute.alignment_factor` (misaligned tensor-core GEMMs; 1 otherwise)
    measured: np.ndarray
    # `compute.rowwise_efficiency` (row-wise kernels on GH100 parts; NaN otherwise) and
    # `compute.rowwise_latency` (0 otherwise); None: none
    rowwise: np.ndarray | None = None
    rowwise_latency: np.ndarray | None = None
    # GEMM shape (`features.gemm_dims`; 0 for other kinds) and, for `sgemm_work`, the GPU
    # type's SMs, FP32 peak (FLOP/s) and the bandwidth split-K's partial sums move at (B/s)
    dims: np.ndarray | None = None  # (rows, 4): batch, M, N, K
    sms: np.ndarray | None = None
    fp32_peak: np.ndarray | None = None
    partial_bw: np.ndarray | None = None


def load(roots: Path | list[Path]) -> tuple[Priced, dict[str, GpuSpec]]:
    """Read every row under `roots` and the arrays the fit needs."""
    roots = [roots] if isinstance(roots, Path) else roots
    rows = [r for root in roots for r in read_all(root)]
    if not rows:
        names = ", ".join(map(str, roots))
        raise SystemExit(f"gpu_op_latency: no neusight/, vidur/ or meshplan/ files under {names}")
    specs: dict[str, GpuSpec] = {}
    for r in rows:
        if r.device not in specs:
            specs[r.device] = device_spec(r.device)  # raises on an unknown device
    cols = defaultdict(list)
    for r in rows:
        g = specs[r.device]
        op = r.op
        matmul = op.kind in compute.TENSOR_CORE_KINDS
        dtype = r.dtype if matmul else compute.VECTOR_DTYPE
        b, m, n, k = gemm_dims(op)
        cols["gpu"].append(g.name)
        cols["source"].append(r.source)
        cols["cls"].append(r.op_class)
        cols["kind"].append(op.kind.value)
        cols["fp32_gemm"].append(matmul and r.dtype == "float32")
        cols["tp1"].append(r.tp == 1)
        cols["flop_s"].append(compute.effective_flops(op) / g.peak(dtype))
        cols["mem_s"].append(essential_bytes(op) / g.hbm_bandwidth)
        sides = compute.tile_sides(g, r.dtype)
        cols["wave"].append(compute.wave_efficiency(b, m, n, g.sms, sides=sides) if matmul else 1.0)
        cols["gemm_eff"].append(compute.kernel_efficiency(g).gemm)
        cols["align"].append(compute.alignment_factor(op, g, r.dtype) if matmul else 1.0)
        rowwise = compute.rowwise_efficiency(op, g)
        cols["rowwise"].append(math.nan if rowwise is None else rowwise)
        cols["rowwise_latency"].append(compute.rowwise_latency(op, g))
        cols["measured"].append(r.seconds)
        cols["dims"].append((b, m, n, k))
        cols["sms"].append(g.sms)
        cols["fp32_peak"].append(g.peak("float32"))
        cols["partial_bw"].append(g.hbm_bandwidth * compute.kernel_efficiency(g).memory)
    arrays = {k: np.asarray(v) for k, v in cols.items()}
    return Priced(rows=rows, **arrays), specs


@dataclasses.dataclass(frozen=True)
class Constants:
    memory: dict[str, float]  # OpKind value -> fraction of HBM bandwidth
    cuda_core_gemm: float
    sgemm: compute.SgemmModel = compute.SGEMM


def shipped() -> Constants:
    return Constants(
        {k.value: v for k, v in compute.MEMORY_EFFICIENCY_BY_KIND.items()},
        compute.CUDA_CORE_GEMM_EFFICIENCY,
        compute.SGEMM,
    )


GEMM_KINDS = [OpKind.MATMUL.value, OpKind.EXPERTS.value]


def gemm_roofline(flop: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """`compute.gemm_roofline` on arrays: the p-norm of FLOP and memory seconds."""
    q = compute.GEMM_OVERLAP_P
    hi, lo = np.maximum(flop, mem), np.minimum(flop, mem)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = hi * (1.0 + (lo / hi) ** q) ** (1.0 / q)
    return np.where(hi > 0, out, 0.0)


def work(p: Priced, c: Constants) -> np.ndarray:
    """Seconds of work of every row under constants `c`: the roofline of `compute` (the
    planner's formula: the p-norm for GEMMs, the max otherwise) without the floor.
    `check_against_planner` proves it equal to `block_compute` on every row. Row-wise kernels
    on GH100 parts take `compute.rowwise_efficiency` and `compute.rowwise_latency` (fitted on
    the H200's rows by `fit_rowwise`, not refitted here; the latency is a per-call cost the
    planner keeps apart from the floor, so it is part of the work here)."""
    default_mem = compute.DEFAULT_EFFICIENCY.memory
    mem_eff = np.array([c.memory.get(k, default_mem) for k in p.kind])
    if p.rowwise is not None:
        mem_eff = np.where(np.isnan(p.rowwise), mem_eff, p.rowwise)
    gemm = np.where(p.fp32_gemm, c.cuda_core_gemm, p.gemm_eff * p.align)
    tc = np.isin(p.kind, [k.value for k in compute.TENSOR_CORE_KINDS])
    flop = np.where(tc, p.flop_s / gemm / p.wave, p.flop_s)
    if p.dims is not None and p.fp32_gemm.any():  # CUDA-core GEMMs: `compute.sgemm_seconds`
        flop = flop.copy()
        flop[p.fp32_gemm] = sgemm_work(p, p.fp32_gemm, c.cuda_core_gemm, c.sgemm)
    mem = p.mem_s / mem_eff
    out = np.where(np.isin(p.kind, GEMM_KINDS), gemm_roofline(flop, mem), np.maximum(flop, mem))
    return out if p.rowwise_latency is None else out + p.rowwise_latency


def sgemm_work(
    p: Priced, rows: np.ndarray, efficiency: float, model: compute.SgemmModel
) -> np.ndarray:
    """`compute.sgemm_seconds` of the float32 GEMMs `rows` on arrays."""
    b, m, n, k = (p.dims[rows, i].astype(np.float64) for i in range(4))
    sms = p.sms[rows].astype(np.float64)
    sm_rate = p.fp32_peak[rows] * efficiency / sms
    out_bytes = 4.0 * b * m * n
    best = np.full(len(b), np.inf)
    for side, rel in model.tile_rate:
        tiles = np.ceil(b) * np.ceil(m / side) * np.ceil(n / side)
        per_k = 2.0 * side * side / (sm_rate * rel)
        for s in model.splits:
            k_split = np.ceil(k / s)
            t = np.ceil(tiles * s / sms) * (model.wave_latency_s + per_k * k_split)
            if s > 1:
                t = t + 2 * s * out_bytes / p.partial_bw[rows]
                t = np.where(k_split >= model.min_split_k, t, np.inf)
            best = np.minimum(best, t)
    return best


def planner_work(p: Priced, specs: dict[str, GpuSpec], sample: int = 1) -> np.ndarray:
    """Work of every `sample`-th row by `compute.block_compute` of a one-op block (NaN for
    the rows skipped): the planner's own function."""
    out = np.full(len(p.rows), np.nan)
    for i in range(0, len(p.rows), sample):
        r = p.rows[i]
        bc = compute.block_compute(
            Block("kernel", "prologue", (r.op,), ()), specs[r.device], r.dtype
        )
        fwd = bc.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)[0]
        out[i] = fwd - bc.n_fwd * compute.KERNEL_FLOOR_S
    return out


def check_against_planner(p: Priced, specs: dict[str, GpuSpec]) -> float:
    """Largest relative difference between `work` at the shipped constants and the planner's
    `block_compute` over every 7th row; the fit below is only valid when this is ~0."""
    ref = planner_work(p, specs, sample=7)
    mask = ~np.isnan(ref)
    ours = work(p, shipped())[mask]
    return float(np.max(np.abs(ours / ref[mask] - 1)))


# Sources that time the kernel alone (no launch): they share one measurement overhead.
KERNEL_TIME_SOURCES = ("vidur", "meshplan")


def overheads(p: Priced, held_out: str | None) -> dict[str, float]:
    """Measurement overhead per source: median over GPU types (all but `held_out`) of each
    type's fastest elementwise kernel. The kernel-time sources (Vidur's profiler ranges,
    meshplan's own CUDA-graph replays: `KERNEL_TIME_SOURCES`) pool their GPU types, so a
    source of one GPU type held out still takes the other sources' figure."""
    fastest: dict[str, list[float]] = defaultdict(list)
    for src in np.unique(p.source):
        pool = "kernel" if src in KERNEL_TIME_SOURCES else str(src)
        for g in np.unique(p.gpu[p.source == src]):
            if g == held_out:
                continue
            m = (p.source == src) & (p.gpu == g) & (p.cls == "elementwise")
            if not m.any():
                m = (p.source == src) & (p.gpu == g) & np.isin(p.cls, ["residual", "activation"])
            if m.any():  # a partial file (`collect_gpu_ops.py --only gemm`) may have none
                fastest[pool].append(p.measured[m].min())
    out = {}
    for src in np.unique(p.source):
        pool = "kernel" if src in KERNEL_TIME_SOURCES else str(src)
        out[str(src)] = float(np.median(fastest[pool])) if fastest[pool] else 0.0
    return out


# NeuSight's GEMM calls go through cuBLAS, whose host-side work (picking a kernel by its
# heuristics, setting up the call) lies inside the timed call on top of the launch: its
# fastest `linear` call takes 46-63 us on four of its GPU types where the fastest
# elementwise call takes 24-31 us. These classes take their own overhead, the fastest call
# of the class measured the same way (median over the other GPU types).
CUBLAS_CLASSES = ("linear", "bmm")


def row_overheads(p: Priced, held_out: str | None) -> np.ndarray:
    """The measurement overhead of every row: its source's (`overheads`), or for a NeuSight
    cuBLAS class (`CUBLAS_CLASSES`) the median over the GPU types but `held_out` of each
    type's fastest call of that class."""
    by_source = overheads(p, held_out)
    out = np.array([by_source[s] for s in p.source])
    for cls in CUBLAS_CLASSES:
        rows = (p.source == "neusight") & (p.cls == cls)
        fastest = [
            p.measured[rows & (p.gpu == g)].min() for g in np.unique(p.gpu[rows]) if g != held_out
        ]
        if fastest:
            out[rows] = float(np.median(fastest))
    return out


def predict(p: Priced, c: Constants, held_out: str | None = None) -> np.ndarray:
    return work(p, c) + row_overheads(p, held_out)


# -- fitting the kernel-data constants --------------------------------------------------------
GRID = np.round(np.arange(0.10, 1.201, 0.01), 2)


def _mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / meas - 1))) * 100 if len(meas) else math.nan


def fit(p: Priced, exclude: str | None = None) -> Constants:
    """Constants minimising MAPE on the fitting rows of every GPU type but `exclude`."""
    keep = p.gpu != exclude
    ovh = row_overheads(p, exclude)
    base = shipped()
    memory = dict(base.memory)
    for kind in FIT_KINDS:
        rows = keep & (p.kind == kind.value)
        rows &= (
            (p.source == "vidur") & p.tp1 if kind == OpKind.EMBEDDING else p.source == "neusight"
        )
        if not rows.any():
            continue
        best = min(
            GRID,
            key=lambda e: _mape(
                np.maximum(p.flop_s[rows], p.mem_s[rows] / e) + ovh[rows], p.measured[rows]
            ),
        )
        memory[kind.value] = float(best)
    rows = keep & p.fp32_gemm & (p.source == "neusight")
    if not rows.any():
        return Constants(memory, base.cuda_core_gemm, base.sgemm)
    # GPU types without CUDA-core rows leave the same rows: fitted once
    key = (rows.tobytes(), ovh[rows].tobytes(), _mem(memory))
    if key not in _SGEMM_FITS:
        _SGEMM_FITS[key] = fit_sgemm(p, rows, ovh, _mem(memory), SGEMM_START)
    return Constants(memory, *_SGEMM_FITS[key])


_SGEMM_FITS: dict[tuple, tuple[float, compute.SgemmModel]] = {}
# Where `fit_sgemm` starts, set without looking at any row (so no GPU type held out reaches
# its fit through the shipped constants): the uncalibrated GEMM efficiency
# (`compute.DEFAULT_EFFICIENCY`), 1 us a wave, smaller tiles at 0.9 / 0.8 of the 128-tile's
# rate, splits of at least 64 of K.
SGEMM_START = (
    compute.DEFAULT_EFFICIENCY.gemm,
    compute.SgemmModel(1e-6, ((128, 1.0), (64, 0.9), (32, 0.8)), 64.0),
)


# `fit_sgemm`: the fit runs on every SGEMM_FIT_STRIDE-th row (speed; ~12,000 rows per GPU
# type) and stops when every step is below SGEMM_FIT_TOL (log units; the tile rates as fractions).
SGEMM_FIT_STRIDE = 2
SGEMM_FIT_TOL = 1e-3


def fit_sgemm(
    p: Priced,
    rows: np.ndarray,
    ovh: np.ndarray,
    mem_eff: float,
    start: tuple[float, compute.SgemmModel],
) -> tuple[float, compute.SgemmModel]:
    """(CUDA-core GEMM efficiency, `compute.SgemmModel`) minimising the mean over (GPU type,
    op class) of the MAPE of `rows` (each type and class weighing the same whatever its row
    count): a compass search (each parameter stepped up and down within its bounds, the step
    halved when no move helps; deterministic) over log efficiency, log wave latency, the 64-
    and 32-tiles' relative rates (0.05-1) and log minimum split K, from `start`."""
    idx = np.flatnonzero(rows)[::SGEMM_FIT_STRIDE]
    sub = np.zeros(len(rows), bool)
    sub[idx] = True
    mem = p.mem_s[sub] / mem_eff
    meas, extra = p.measured[sub], ovh[sub]
    groups = [
        (p.gpu[sub] == g) & (p.cls[sub] == c)
        for g in np.unique(p.gpu[sub])
        for c in np.unique(p.cls[sub])
    ]
    groups = [g for g in groups if g.any()]
    lo = np.array([np.log(0.05), np.log(1e-8), 0.05, 0.05, np.log(8.0)])
    hi = np.array([0.0, np.log(1e-4), 1.0, 1.0, np.log(4096.0)])

    def unpack(x: np.ndarray) -> tuple[float, compute.SgemmModel]:
        model = dataclasses.replace(
            start[1],
            wave_latency_s=float(np.exp(x[1])),
            tile_rate=((128, 1.0), (64, float(x[2])), (32, float(x[3]))),
            min_split_k=float(np.exp(x[4])),
        )
        return float(np.exp(x[0])), model

    def loss(x: np.ndarray) -> float:
        eff, model = unpack(x)
        pred = gemm_roofline(sgemm_work(p, sub, eff, model), mem) + extra
        err = np.abs(pred / meas - 1)
        return float(np.mean([err[g].mean() for g in groups]))

    eff0, m0 = start
    rates = dict(m0.tile_rate)
    x = np.array([np.log(eff0), np.log(m0.wave_latency_s), rates[64], rates[32],
                  np.log(m0.min_split_k)])  # fmt: skip
    best, step = loss(x), np.array([0.25, 0.25, 0.1, 0.1, 0.25])
    while step.max() > SGEMM_FIT_TOL:
        moved = False
        for i in range(len(x)):
            for sign in (1.0, -1.0):
                y = x.copy()
                y[i] = min(max(x[i] + sign * step[i], lo[i]), hi[i])
                if y[i] == x[i]:
                    continue
                got = loss(y)
                if got < best:
                    x, best, moved = y, got, True
                    break
        if not moved:
            step /= 2
    eff, model = unpack(x)
    model = dataclasses.replace(
        model,
        wave_latency_s=float(f"{model.wave_latency_s:.3g}"),
        tile_rate=tuple((t, round(r, 3)) for t, r in model.tile_rate),
        min_split_k=round(model.min_split_k, 1),
    )
    return round(eff, 3), model


def _zero_median(measured: np.ndarray, price) -> float:
    """The efficiency (bisection in 0.02-1.5) at which `price(e)` has zero median signed
    error against `measured`."""
    lo, hi = 0.02, 1.5
    for _ in range(40):
        mid = (lo + hi) / 2
        if np.median(price(mid) / measured - 1) > 0:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3)


def fit_tensor_core(p: Priced) -> dict[str, dict[str, float]]:
    """Per GPU type of meshplan's own kernel data: the tensor-core GEMM efficiency that zeroes
    the median signed error of its aligned bf16 `F.linear` rows (the planner's pricing: wave
    quantization, the p-norm roofline, the kernel-time sources' overhead), and the misalignment
    factor (`compute.MISALIGNED_GEMM_FACTOR`) that does the same on its misaligned bf16 rows at that
    efficiency. fp16, the weight-gradient layout, bmm and TF32 rows are not used (held out)."""
    out = {}
    names = np.array([r.op.name for r in p.rows])
    dtypes = np.array([r.dtype for r in p.rows])
    for g in np.unique(p.gpu[p.source == "meshplan"]):
        base = (p.source == "meshplan") & (p.gpu == g) & (names == "linear")
        base &= (dtypes == "bfloat16") & np.isin(p.cls, ["gemm", "gemm_misaligned"])
        aligned, misaligned = base & (p.align == 1.0), base & (p.align < 1.0)
        mem = p.mem_s / compute.DEFAULT_EFFICIENCY.memory

        ovh = overheads(p, str(g))["meshplan"]

        def price(e, rows):
            return gemm_roofline(p.flop_s[rows] / e / p.wave[rows], mem[rows]) + ovh

        if not aligned.any():
            continue
        eff = _zero_median(p.measured[aligned], lambda e: price(e, aligned))
        factor = math.nan
        if misaligned.any():
            factor = _zero_median(p.measured[misaligned], lambda e: price(e * eff, misaligned))
        out[str(g)] = {
            "gemm": eff,
            "misaligned_factor": factor,
            "rows": int(aligned.sum()),
            "misaligned_rows": int(misaligned.sum()),
        }
    return out


def fit_low_precision(roots: list[Path]) -> dict[str, dict[str, float]]:
    """Per GPU type of meshplan's own kernel data: the FP8 (`torch._scaled_mm`) and INT8
    (`torch._int_mm`) GEMM efficiencies that zero the median signed error of its rows
    (`compute.KernelEfficiency.gemm_fp8` / `gemm_int8`): the p-norm roofline at that dtype's
    peak with wave quantization, the bytes the kernel moves (one-byte operands, the bf16 or
    int32 output as written) at 0.8 of the HBM bandwidth, plus 1 us (the kernel-time sources'
    overhead, rounded)."""
    rows = [r for root in roots for r in read_meshplan_raw(root)]
    out: dict[str, dict[str, float]] = defaultdict(dict)
    peaks = {"gemm_fp8": (compute.FLOAT8_DTYPE, 2), "gemm_int8": ("int8", 4)}
    for device in sorted({r["device"] for r in rows}):
        g = device_spec(device)
        for cls, (peak, out_bytes) in peaks.items():
            mine = [r for r in rows if r["device"] == device and r["cls"] == cls]
            if not mine:
                continue
            m, n, k = (np.array([int(r[c]) for r in mine]) for c in ("m", "n", "k"))
            sides = compute.tile_sides(g, "bfloat16", float8=True)
            wave = np.array([compute.wave_efficiency(1, a, b, g.sms, sides=sides)
                             for a, b in zip(m, n)])  # fmt: skip
            flop = 2 * m * n * k / g.peak(peak)
            mem = (m * k + n * k + out_bytes * m * n) / (g.hbm_bandwidth * 0.8)
            meas = np.array([float(r["seconds"]) for r in mine])
            out[g.name][cls] = _zero_median(
                meas,
                lambda e, flop=flop, wave=wave, mem=mem: gemm_roofline(flop / e / wave, mem) + 1e-6,
            )
    return dict(out)


def fit_rowwise(p: Priced, on: str = "H200") -> dict:
    """The row-wise constants of `compute.rowwise_efficiency`, from GPU type `on`'s rows of
    meshplan's own data only (the other GH100 types are held out). Per (family, bytes per
    element), at each width of `compute.ROWWISE_WIDTHS`: the line t = latency + bytes / rate
    through the type's two dense-sweep rows of 2^18 and 2^26 elements (`ROWWISE_FIT_SIZES`;
    read + write bytes as `essential_bytes`, time less the kernel-time sources' overhead,
    computed without the other types): `latency_us` (clamped at 0) and `fraction`, the rate
    as a fraction of `ROWWISE_REFERENCE_BW`. The sweep's rows of 2^22 elements are not used:
    they are the in-sample check. `mape_on_fit_rows`: every `on` row of each family (all
    sizes) priced with those constants."""
    from meshplan.ir import DTYPE_BYTES

    others = [str(g) for g in np.unique(p.gpu[p.source == "meshplan"]) if g != on]
    ovh = overheads(p, others[0] if len(others) == 1 else None)["meshplan"]
    mine = [i for i in range(len(p.rows)) if p.source[i] == "meshplan" and p.gpu[i] == on]
    spec = next(device_spec(p.rows[i].device) for i in mine)
    shapes = {i: compute.rowwise_shape(p.rows[i].op) for i in mine}
    shapes = {i: s for i, s in shapes.items() if s is not None}
    # (family, size, width) -> {log2 elements: (distance from it, bytes, seconds less overhead)}
    points: dict[tuple[str, int, int], dict[int, tuple[float, float, float]]] = defaultdict(dict)
    for i, (family, rows, width) in shapes.items():
        if width not in compute.ROWWISE_WIDTHS:
            continue
        key = (family, DTYPE_BYTES[p.rows[i].op.inputs[0].dtype], width)
        for size in ROWWISE_FIT_SIZES:
            off = abs(math.log2(rows * width) - size)
            if off < 0.03 and off < points[key].get(size, (1.0,))[0]:
                nbytes = p.mem_s[i] * spec.hbm_bandwidth
                points[key][size] = (off, float(nbytes), float(p.measured[i] - ovh))
    latency: dict[tuple[str, int], list[float]] = defaultdict(list)
    fraction: dict[tuple[str, int], list[float]] = defaultdict(list)
    for family, size in sorted({k[:2] for k in points}):
        lines = []
        for width in compute.ROWWISE_WIDTHS:
            pts = points.get((family, size, width), {})
            if len(pts) < len(ROWWISE_FIT_SIZES):
                break
            (_, b0, t0), (_, b1, t1) = (pts[s] for s in ROWWISE_FIT_SIZES)
            per_byte = (t1 - t0) / (b1 - b0)
            lines.append((max(0.0, t0 - per_byte * b0), per_byte))
        if len(lines) < len(compute.ROWWISE_WIDTHS):
            continue  # a width missing: this column is not fitted
        latency[(family, size)] = [round(a * 1e6, 2) for a, _ in lines]
        fraction[(family, size)] = [
            round(1.0 / c / compute.ROWWISE_REFERENCE_BW, 3) for _, c in lines
        ]
    table = (
        {k: tuple(v * 1e-6 for v in ys) for k, ys in latency.items()},
        {k: tuple(ys) for k, ys in fraction.items()},
    )
    mape = {}
    for family in sorted({s[0] for s in shapes.values()}):
        idx = [i for i, s in shapes.items() if s[0] == family]
        ops = [p.rows[i].op for i in idx]
        eff = np.array([compute.rowwise_efficiency(op, spec, table=table) for op in ops])
        lat = np.array([compute.rowwise_latency(op, spec, table=table) for op in ops])
        mape[family] = round(_mape(p.mem_s[idx] / eff + lat + ovh, p.measured[idx]), 1)
    return {
        "on": on,
        "latency_us": {str(k): tuple(v) for k, v in latency.items()},
        "fraction": {str(k): tuple(v) for k, v in fraction.items()},
        "mape_on_fit_rows": mape,
    }


def _mem(memory: dict[str, float]) -> float:
    return memory.get(OpKind.MATMUL.value, compute.DEFAULT_EFFICIENCY.memory)


# -- reporting --------------------------------------------------------------------------------
def stats(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    err = np.abs(pred / meas - 1) * 100
    return {
        "rows": int(len(meas)),
        "mape": round(float(np.mean(err)), 1),
        "median": round(float(np.median(err)), 1),
        "p90": round(float(np.percentile(err, 90)), 1),
        "signed_median": round(float(np.median((pred / meas - 1) * 100)), 1),
    }


def layer_sums(p: Priced, pred: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per GPU type: (predicted, measured) sums of each Vidur layer's ops."""
    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for i, r in enumerate(p.rows):
        if r.group:
            acc = groups[p.gpu[i]][r.group]
            acc[0] += pred[i]
            acc[1] += r.seconds
    return {
        g: (np.array([v[0] for v in d.values()]), np.array([v[1] for v in d.values()]))
        for g, d in groups.items()
    }


def report(p: Priced, pred: np.ndarray) -> dict:
    out: dict = {"by_class": {}, "layer": {}}
    for src in np.unique(p.source):
        for g in np.unique(p.gpu[p.source == src]):
            for cls in np.unique(p.cls[(p.source == src) & (p.gpu == g)]):
                m = (p.source == src) & (p.gpu == g) & (p.cls == cls)
                out["by_class"][f"{src}/{g}/{cls}"] = stats(pred[m], p.measured[m])
    for g, (pr, me) in layer_sums(p, pred).items():
        out["layer"][g] = stats(pr, me)
    return out


# -- the learned path, held out the same way --------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LearnedSettings:
    """How `learned_leave_one_gpu_out` trains: fixed, so a run is reproducible, and sized for
    run time (about 20 s per held-out type on one core), not tuned on held-out errors."""

    per_class: int = 250  # training rows drawn per (GPU type, op class)
    epochs: int = 400
    ensemble: int = 4
    seed: int = 0
    threads: int = 1  # torch threads (the host is shared)
    ignore: tuple[str, ...] = ()  # feature columns the nets do not read (ablations)


# The device columns of `features.op_features`. A held-out GPU type whose rows fall outside
# the range the training rows span in any of them is an extrapolation in device space, where
# an MLP fitted on six device types has no evidence (P4, the smallest part, is priced 1.2-5x
# too slow, signed median by class, when the others train it); `best_of` keeps the analytic
# path there. The check is per column over all training rows, whatever their dtype.
DEVICE_COLUMNS = tuple(n for n in feature_names() if n.startswith("dev_"))


@dataclasses.dataclass
class LearnedRun:
    """What `learned_leave_one_gpu_out` returns."""

    pred: np.ndarray  # held-out prediction of every row (seconds, overhead included)
    inside: dict[str, bool]  # "source/GPU/class" -> its rows within the training device range
    trained: dict[str, dict]  # held-out GPU type -> training rows, GPU types, seconds


def training_rows(p: Priced, held_out: str, per_class: int, seed: int) -> np.ndarray:
    """Indices of at most `per_class` rows per (GPU type, op class) of every GPU type but
    `held_out`, drawn with a fixed seed (sorted)."""
    rng = np.random.default_rng(seed)
    picks = []
    for g in np.unique(p.gpu):
        if g == held_out:
            continue
        for cls in np.unique(p.cls[p.gpu == g]):
            idx = np.flatnonzero((p.gpu == g) & (p.cls == cls))
            picks.append(rng.choice(idx, min(per_class, len(idx)), replace=False))
    return np.sort(np.concatenate(picks))


def within_range(x_train: np.ndarray, x: np.ndarray) -> bool:
    """Every row of `x` inside the span of `x_train` in every device column."""
    cols = [feature_names().index(c) for c in DEVICE_COLUMNS]
    lo, hi = x_train[:, cols].min(0), x_train[:, cols].max(0)
    v = x[:, cols]
    return bool(np.all((v >= lo - 1e-9) & (v <= hi + 1e-9)))


def learned_leave_one_gpu_out(
    p: Priced, specs: dict[str, GpuSpec], settings: LearnedSettings
) -> LearnedRun:
    """Per GPU type: the learned model (`learned.train`) trained on rows of the *other* GPU
    types only, each on its datasheet features (`kernel_data.as_sample`), then predicting
    every row of the held-out type.

    Each measurement holds its source's overhead (`overheads`, computed without the held-out
    type, as the analytic path does): the model is trained with it as an offset, so it learns
    the op's own time, and the held-out prediction adds it back.
    """
    samples = [as_sample(r, specs[r.device]) for r in p.rows]
    x, phys = learned.design_matrix(samples)  # what `LatencyModel.predict_samples` computes
    run = LearnedRun(np.empty(len(p.rows)), {}, {})
    for g in np.unique(p.gpu):
        offsets = row_overheads(p, held_out=str(g))
        train = training_rows(p, str(g), settings.per_class, settings.seed)
        model = learned.train(
            [samples[i] for i in train],
            epochs=settings.epochs,
            ensemble=settings.ensemble,
            seed=settings.seed,
            threads=settings.threads,
            offsets=offsets[train],
            bound=False,
            ignore=settings.ignore,
        )
        assert not model.covers(str(g)), f"{g} leaked into its own training rows"
        test = p.gpu == g
        run.pred[test] = phys[test] / model.efficiency_batch(x[test]) + offsets[test]
        for src in np.unique(p.source[test]):
            for cls in np.unique(p.cls[test & (p.source == src)]):
                rows = test & (p.source == src) & (p.cls == cls)
                run.inside[f"{src}/{g}/{cls}"] = within_range(x[train], x[rows])
        run.trained[str(g)] = {
            "train_rows": len(train),
            "train_gpus": sorted(model.devices),
            "train_seconds": model.meta["train_seconds"],
        }
    return run


def best_of(p: Priced, analytic: np.ndarray, run: LearnedRun) -> tuple[np.ndarray, dict[str, str]]:
    """Per (source, GPU type, op class), chosen without the held-out type's measurements:
    the learned path when that type's rows lie within the training device range
    (`within_range`) and the learned path had the lower mean held-out MAPE over the *other*
    GPU types of that source and class that were themselves within range; else analytic
    (also when no other type gives evidence). Returns the rows' predictions and the choices.
    """
    a, lr = report(p, analytic)["by_class"], report(p, run.pred)["by_class"]
    pred = analytic.copy()
    choice = {}
    for key in a:
        src, g, cls = key.split("/")
        others = [
            k
            for k in a
            if k != key and k.split("/")[0] == src and k.split("/")[2] == cls and run.inside[k]
        ]
        wins = (
            run.inside[key]
            and bool(others)
            and np.mean([lr[k]["mape"] for k in others]) < np.mean([a[k]["mape"] for k in others])
        )
        choice[key] = "learned" if wins else "analytic"
        if wins:
            m = (p.source == src) & (p.gpu == g) & (p.cls == cls)
            pred[m] = run.pred[m]
    return pred, choice


def leave_one_gpu_out(p: Priced) -> tuple[np.ndarray, dict[str, Constants]]:
    pred = np.empty(len(p.rows))
    fits = {}
    for g in np.unique(p.gpu):
        c = fit(p, exclude=str(g))
        fits[str(g)] = c
        m = p.gpu == g
        pred[m] = predict(p, c, held_out=str(g))[m]
    return pred, fits


def verdicts(rep: dict) -> list[str]:
    """The targets (`NEUSIGHT_ERROR`, `TARGET_*`) against the leave-one-GPU-out figures."""

    def line(what: str, mape: float, bar: str, target: float) -> str:
        return f"{what}: MAPE {mape}% ({bar} {target}%) {'met' if mape <= target else 'NOT met'}"

    lines = []
    for key, s in rep["by_class"].items():
        src, g, cls = key.split("/")
        bar = target(src, cls)
        if bar is not None:
            what = f"fp16 GEMM {g}" if cls == "gemm" else f"{cls} {g}"
            lines.append(line(f"{what} ({src})", s["mape"], *bar))
    for g, s in rep["layer"].items():
        lines.append(line(f"layer sum {g}", s["mape"], "target <=", TARGET_LAYER))
    return lines


def target(src: str, cls: str) -> tuple[str, float] | None:
    """(what the bar is, % MAPE) set for a class of a source, else None."""
    if src in ("vidur", "meshplan") and cls == "gemm":  # meshplan: bf16 and fp16 GEMMs
        return "target <=", TARGET_FP16_GEMM
    if src == "vidur" and cls == "layer":
        return "target <=", TARGET_LAYER
    if src in ("neusight", "meshplan") and cls in NEUSIGHT_ERROR:
        return "NeuSight", NEUSIGHT_ERROR[cls]
    return None


def side_by_side(reps: dict[str, dict], choice: dict[str, str]) -> str:
    """One line per source/GPU/class: MAPE, median and p90 of each path in `reps` (analytic,
    learned, best of), the best-of choice, and the bar where one is set."""
    names = list(reps)
    keys = sorted(reps[names[0]]["by_class"])
    layers = [f"vidur/{g}/layer" for g in sorted(reps[names[0]]["layer"])]

    def get(rep: dict, key: str) -> dict:
        src, g, cls = key.split("/")
        return rep["layer"][g] if cls == "layer" else rep["by_class"][key]

    head = "  ".join(f"{n + ' MAPE/med/p90 %':>22}" for n in names)
    lines = [f"{'source/GPU/class':<36} {'rows':>6}  {head}  {'choice':<8} bar"]
    for key in keys + layers:
        cells = []
        for n in names:
            s = get(reps[n], key)
            cells.append(f"{s['mape']:>8.1f} {s['median']:>6.1f} {s['p90']:>6.1f}")
        src, _, cls = key.split("/")
        bar = target(src, cls)
        pick = choice.get(key, "per op" if cls == "layer" else "")
        lines.append(
            f"{key:<36} {get(reps[names[0]], key)['rows']:>6}  "
            + "  ".join(f"{c:>22}" for c in cells)
            + f"  {pick:<8} {'' if bar is None else f'{bar[1]:g}'}"
        )
    return "\n".join(lines)


def verdict_rows(reps: dict[str, dict]) -> list[dict]:
    """Every class with a bar, with each path's MAPE and whether it is met."""
    names = list(reps)
    first = reps[names[0]]
    keys = list(first["by_class"]) + [f"vidur/{g}/layer" for g in first["layer"]]
    out = []
    for key in sorted(keys):
        src, g, cls = key.split("/")
        bar = target(src, cls)
        if bar is None:
            continue
        row = {"key": key, "bar": bar[1]}
        for n in names:
            rep = reps[n]
            s = rep["layer"][g] if cls == "layer" else rep["by_class"][key]
            row[n] = s["mape"]
            row[f"{n}_met"] = s["mape"] <= bar[1]
        out.append(row)
    return out


def table(title: str, rep: dict) -> str:
    def row(name: str, s: dict) -> str:
        pct = " ".join(f"{s[k]:>6.1f}%" for k in ("mape", "median", "p90"))
        return f"{name:<44} {s['rows']:>7} {pct} {s['signed_median']:>+6.1f}%"

    head = " ".join(f"{h:>7}" for h in ("rows", "MAPE", "median", "p90", "signed"))
    lines = [title, f"{'source/GPU/class':<44} {head}"]
    lines += [row(key, s) for key, s in sorted(rep["by_class"].items())]
    lines += [row(f"vidur/{g}/layer (summed ops)", s) for g, s in sorted(rep["layer"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data", type=Path, action="append", default=None,
        help="dataset root (neusight/, vidur/, meshplan/); repeat for several; default: the "
        "public data in ../shared and meshplan's own in data/gpu_op_latency",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the JSON summary only")
    ap.add_argument("--fit", action="store_true", help="print the constants fitted on every GPU")
    ap.add_argument(
        "--learned",
        action="store_true",
        help="also train the learned model leaving each GPU type out (a few minutes) and "
        "compare it with the analytic path",
    )
    args = ap.parse_args(argv)
    args.data = args.data or [d for d in (DEFAULT_DATA, OWN_DATA) if d.is_dir()]
    for d in args.data:
        if not d.is_dir():
            print(f"gpu_op_latency: --data {d}: no such directory", file=sys.stderr)
            return 2
    t0 = time.time()
    p, specs = load(args.data)
    diff = check_against_planner(p, specs)
    if diff > 1e-6:
        print(
            f"gpu_op_latency: the fit's formula differs from block_compute by {diff:.2e}",
            file=sys.stderr,
        )
        return 1
    shipped_pred = predict(p, shipped())
    logo_pred, fits = leave_one_gpu_out(p)
    summary = {
        "data": [str(d) for d in args.data],
        "rows": len(p.rows),
        "gpus": {d: s.name for d, s in specs.items()},
        "overheads_s": overheads(p, None),
        "shipped": report(p, shipped_pred),
        "leave_one_gpu_out": report(p, logo_pred),
        "fits": {g: dataclasses.asdict(c) for g, c in fits.items()},
    }
    summary["verdicts"] = verdicts(summary["leave_one_gpu_out"])
    if args.fit:
        summary["fit_all"] = dataclasses.asdict(fit(p))
        summary["fit_tensor_core"] = fit_tensor_core(p)
        summary["fit_low_precision"] = fit_low_precision(args.data)
        if "H200" in set(p.gpu[p.source == "meshplan"]):
            summary["fit_rowwise"] = fit_rowwise(p)
    if args.learned:
        t1 = time.time()
        settings = LearnedSettings()
        run = learned_leave_one_gpu_out(p, specs, settings)
        best_pred, choice = best_of(p, logo_pred, run)
        reps = {
            "analytic": summary["leave_one_gpu_out"],
            "learned": report(p, run.pred),
            "best_of": report(p, best_pred),
        }
        summary["learned"] = {
            "settings": dataclasses.asdict(settings),
            "trained": run.trained,
            "report": reps["learned"],
            "best_of": reps["best_of"],
            "within_training_device_range": run.inside,
            "best_of_choice": choice,
            "targets": verdict_rows(reps),
            "seconds": round(time.time() - t1, 1),
        }
    summary["seconds"] = round(time.time() - t0, 1)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    devices = ", ".join(f"{d} -> {n}" for d, n in summary["gpus"].items())
    print(f"{len(p.rows)} rows from {', '.join(map(str, args.data))}; devices: {devices}")
    print(
        "measurement overhead per source (us): "
        + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in summary["overheads_s"].items())
    )
    print(
        table(
            "\n== shipped constants (in-sample for the kernel-data constants)", summary["shipped"]
        )
    )
    print(table("\n== leave one GPU type out", summary["leave_one_gpu_out"]))
    print("\nconstants fitted without each GPU type:")
    for g, c in fits.items():
        sg = c.sgemm
        print(
            f"  without {g:<16} memory {c.memory}  cuda-core gemm {c.cuda_core_gemm}, "
            f"wave {sg.wave_latency_s * 1e6:.3g} us, tile rates {dict(sg.tile_rate)}, "
            f"split K >= {sg.min_split_k}"
        )
    if args.fit:
        print(f"\nfitted on every GPU type: {summary['fit_all']}")
        for g, f in summary["fit_tensor_core"].items():
            print(f"tensor-core GEMMs fitted on {g}'s own bf16 linears: {f}")
        for g, f in summary["fit_low_precision"].items():
            print(f"one-byte GEMMs fitted on {g}'s own rows: {f}")
        if "fit_rowwise" in summary:
            f = summary["fit_rowwise"]
            print(f"row-wise kernels fitted on {f['on']}'s rows (compute.rowwise_efficiency):")
            for key, ys in f["fraction"].items():
                print(f"  fraction {key}: {ys}")
                print(f"  latency us {key}: {f['latency_us'][key]}")
            print(f"  MAPE on those rows {f['mape_on_fit_rows']}")
    print("\ntargets (leave one GPU type out):")
    for line in summary["verdicts"]:
        print("  " + line)
    if args.learned:
        lrn = summary["learned"]
        print(
            f"\n== learned vs analytic, leave one GPU type out ({lrn['seconds']} s; "
            f"{lrn['settings']})"
        )
        for g, t in lrn["trained"].items():
            print(
                f"  without {g:<16} {t['train_rows']} rows of {', '.join(t['train_gpus'])} "
                f"({t['train_seconds']} s)"
            )
        print(side_by_side(reps, lrn["best_of_choice"]))
        print("\ntargets met (held out): analytic / learned / best of")
        for v in lrn["targets"]:
            marks = " / ".join(
                f"{v[n]:.1f}{'' if v[n + '_met'] else ' NOT'}"
                for n in ("analytic", "learned", "best_of")
            )
            print(f"  {v['key']:<36} bar {v['bar']:>5}%: {marks}")
    print(f"\n{summary['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
