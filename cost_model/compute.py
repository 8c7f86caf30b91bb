"""Compute time of operators and blocks: an analytic roofline with per-kind efficiencies.

One op on one GPU takes

    t(op) = max(flops / (peak(dtype) * eff_flops(kind)), bytes / (hbm_bw * eff_mem)) + floor

(a GEMM takes the p-norm of the two times in place of their max, `gemm_roofline`: its memory
traffic and math overlap only in part near the ridge point)

for its forward (`fwd_flops`, `fwd_bytes`) and, separately, for its share of the backward
(`bwd_flops`, `bwd_bytes`). `floor` is a per-kernel minimum (launch + tail) paid by every op
that does any work. Causal attention (`attrs` causal=True) does half the FLOPs on a GPU because
flash attention skips fully masked tiles; the traced FLOPs (FlopCounterMode convention, see
`meshplan.ir.flops`) count the full square, so the halving happens here, in time only.

Sharding scales an op's work, never its floor: under tensor parallelism an op runs on 1/tp of
its data when it is TP-sharded (`splits_with_tp`), under context parallelism every op of the
block runs on 1/cp of the sequence, and a micro-batch of `k` times the traced one does `k`
times the work (linear scaling in the micro-batch size; see `BlockCompute.times`). Because
`max(a*r, b*r) = r*max(a, b)` (and likewise for the p-norm), the roofline time of an op
scales exactly linearly with its share of the data, so a block's time under any (tp, cp,
micro-batch) is a weighted sum of a few per-block aggregates computed once per GPU type
(`block_compute`). That is what keeps the planner's inner loop free of per-op Python.

Efficiencies are per GPU type (`KERNEL_EFFICIENCY`), each with the source or the published
runs that set it; docs/fidelity.md has the results against those runs.

Learned op times (docs/op_latency.md): when the shipped learned latency model
(`learned.load_for_device`) was trained on measurements of the GPU type (device descriptor
name, e.g. "CPU" for the `cpu` cluster preset), `block_compute` prices every op with it
instead: the learned time splits into work (physics roofline / learned efficiency, never
below the roofline, scaled by the op's share of the data like the analytic term) and a
per-call overhead (in place of `KERNEL_FLOOR_S`, not scaled). `MESHPLAN_LEARNED_LATENCY=0`
turns it off; `latency_source` says which model priced a GPU type. Predictions are cached
per op shape and direction (`_LEARNED_PARTS`), so each distinct op is priced once per
process; the variable is read when a graph is first priced on a GPU type. A GEMM efficiency
measured on the user's own machine by `meshplan calibrate` re-anchors the learned times of
tensor-core ops to that machine (`host_gemm_anchor`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass

from meshplan.ir import DTYPE_BYTES, Block, GpuSpec, Op, OpKind, TensorMeta
from meshplan.ir.devices import HYBRID_PEAKS, matmul_dtype
from meshplan.passes.fusion import fusion_regions
from meshplan.passes.sharding import TpRole, tp_sharding

from .engine import EAGER, Engine
from .features import essential_bytes


@dataclass(frozen=True, slots=True)
class KernelEfficiency:
    """Fractions of a GPU type's datasheet peaks that training kernels sustain.

    `gemm`: dense matmuls (cuBLAS / cuBLASLt) of the sizes transformer training runs, as a
    fraction of the dense tensor-core peak. `attention_fwd` / `attention_bwd`: fused (flash)
    attention, forward and backward, on the FLOPs it executes (causal tiles skipped).
    `memory`: streaming (memory-bound) kernels as a fraction of the HBM bandwidth.
    """

    gemm: float
    attention_fwd: float
    attention_bwd: float
    memory: float
    source: str = ""
    # FP8 GEMMs (`Engine.float8`) as a fraction of the dense FP8 peak; None: as `gemm`.
    gemm_fp8: float | None = None
    # INT8 GEMMs (`torch._int_mm`, per-group int8 forwards) as a fraction of the dense INT8
    # peak; None: as `gemm` (an assumption where no INT8 kernel was measured).
    gemm_int8: float | None = None

    @property
    def fp8(self) -> float:
        return self.gemm if self.gemm_fp8 is None else self.gemm_fp8

    @property
    def int8(self) -> float:
        return self.gemm if self.gemm_int8 is None else self.gemm_int8


# Per GPU type (`GpuSpec.name`). Where each number comes from:
# - attention: published kernel benchmarks, not fitted here, for FlashAttention-2 at its
#   reference shape (head dim 128, causal, >= 16k tokens: `ATTENTION_REFERENCE`); other
#   shapes and kernels scale both by `attention_shape_factor`. A100: FlashAttention-2 (Dao
#   2023, Fig. 4(d), A100 80GB SXM4) runs forward + backward of causal head-dim-128 attention
#   at 189 TFLOP/s at 16k tokens, 0.606 of 312; split into forward 0.661 and backward 0.586
#   so that 3.5 / (1 / 0.661 + 2.5 / 0.586) = 0.606 (the backward does 2.5x the forward's
#   FLOPs, FA2 paper section 4.1), with the backward at 0.89 of the forward's rate (the
#   FA2 paper reports its backward below its forward efficiency; the 0.89 ratio is the one the
#   earlier shipped 0.62 / 0.55 had, not re-read from its Fig. 5-6). FlashAttention-3 (Shah
#   et al. 2024, Fig. 1/4-5): on H100 FA2 reaches ~330-370 TFLOP/s forward (~0.35 of 989),
#   cuDNN and FA3 ~500-650 forward, backward ~0.3-0.45. The H100 value sits between FA2
#   (PyTorch SDPA, torchtitan) and cuDNN (Transformer Engine, Megatron-Core). V100 has no
#   flash kernel with bf16 tensor cores; the fp16 FlashAttention-1 paper (Dao et al. 2022)
#   reports ~0.5 of peak on A100 and V100-era fused kernels are assumed at the same fraction.
# - gemm (bf16/fp16) and gemm_fp8: measured on GPU kernels where public kernel timings exist,
#   else fitted per GPU type on the published runs of that type.
#   A100 (0.723): Vidur's fp16 GEMM kernels on A100 80GB (`benchmarks/gpu_op_latency.py`,
#   docs/op_latency.md), the value that zeroes the median signed error of its 36,516 rows
#   priced as the planner prices them (wave quantization at the best tile side, the p-norm
#   roofline `gemm_roofline`, the source's measurement overhead taken from the other GPU
#   types; 0.712 under the plain max before session 18): no published run set it, so
#   `benchmarks/fidelity.py` never refits it (`KERNEL_MEASURED_GEMM`).
#   H100 / H200 (0.784, FP8 0.692, attention 0.344 / 0.302 since session 22): meshplan's own
#   H200 kernels (`benchmarks/collect_gpu_ops.py`, data/gpu_op_latency/meshplan/, PyTorch
#   2.11 + CUDA 13, 700 W): the bf16 value zeroes the median signed error of the 194 aligned
#   bf16 `F.linear` rows priced as above (`gpu_op_latency.py --fit`), FP8 likewise on the 96
#   `torch._scaled_mm` rows (e4m3, tensorwise), INT8 (0.355) on the 96 `torch._int_mm` rows
#   (the held-out H100's own rows give 0.354; it was priced at the bf16 0.784, 2x fast);
#   attention is PyTorch SDPA's flash backend (FlashAttention-2) at the reference shape,
#   causal head dim 128, 16k tokens (GQA 32/8): forward 340 TFLOP/s, backward 299 (the FA3
#   paper's FA2-on-H100 ~330-370 forward). H100 SXM takes them: the same GH100 die, SM
#   count, clocks and power limit; the H200's larger HBM bandwidth only enters through the
#   memory term. Before: 0.667 fitted on the Megatron-Core r0.8 step times, attention
#   0.45 / 0.38 between FA2 and cuDNN.
#   The others: `python benchmarks/fidelity.py --fit` (each type's value zeroes the median
#   signed step-time error of its counted rows, bisection within 0.3-0.9; docs/fidelity.md
#   lists the rows). The fit runs with wave quantization and the rows' own engines (fused
#   kernels, Float8, TP overlap, fp32 gradient reduction; `cost_model.engine`), so these are
#   the efficiencies of a perfectly tiled GEMM: V100 on the 2020 DGX-2 rows (0.813);
#   H100-96GB-500W (power capped) on the torchtitan rows (0.575 bf16, 0.586 of the FP8 peak
#   on its Float8 rows, and its attention 0.199 / 0.174, fitted on the 32k-262k-token
#   context-parallel rows, through torch's context-parallel SDPA at 500 W). Refitted in
#   session 18 under the p-norm GEMM roofline (`gemm_roofline`; before: V100 0.800, 500 W
#   0.605 / 0.585) and in session 22 once unfused norms took the elementwise bandwidth and
#   the H100's attention became the measured one (500 W was 0.606, attention 0.208 / 0.171).
# - memory: STREAM-like kernels reach ~0.8-0.9 of HBM bandwidth on A100/H100 (NVIDIA's
#   babelstream/nvbandwidth numbers); 0.8 is used for every type, for the kinds
#   `MEMORY_EFFICIENCY_BY_KIND` (below, fitted on measured kernels) does not cover and for
#   fused kernels.
_FIT = "benchmarks/fidelity.py --fit"
# The GH100 parts' values, measured on H200 kernels (above).
_GH100 = KernelEfficiency(
    0.784, 0.344, 0.302, 0.8, "H200 kernels (collect_gpu_ops.py)", gemm_fp8=0.692, gemm_int8=0.355
)
KERNEL_EFFICIENCY: dict[str, KernelEfficiency] = {
    "V100": KernelEfficiency(0.813, 0.50, 0.45, 0.8, f"2020 Megatron DGX-2 rows ({_FIT})"),
    "V100-16GB": KernelEfficiency(0.813, 0.50, 0.45, 0.8, "as V100 (same GV100 compute)"),
    "A100-80GB": KernelEfficiency(
        0.723, 0.661, 0.586, 0.8, "Vidur A100 80GB fp16 GEMM kernels (gpu_op_latency.py)"
    ),
    "A100-40GB": KernelEfficiency(0.723, 0.661, 0.586, 0.8, "as A100-80GB"),
    "A100-PCIe": KernelEfficiency(0.723, 0.661, 0.586, 0.8, "as A100-80GB"),
    "H100": dataclasses.replace(_GH100, source="H200 kernels (collect_gpu_ops.py; same GH100 die)"),
    "H200": _GH100,
    "H100-PCIe": dataclasses.replace(_GH100, source="as H100"),
    "H100-96GB-500W": KernelEfficiency(
        0.575, 0.199, 0.174, 0.8, f"torchtitan rows ({_FIT})", gemm_fp8=0.586
    ),
}
# Any other type: hardware.md's low end for large GEMMs and the FA2-on-A100 attention fraction.
DEFAULT_EFFICIENCY = KernelEfficiency(0.75, 0.5, 0.45, 0.8, "assumption")

# Kept for callers that want one number: the default efficiencies.
GEMM_EFFICIENCY = DEFAULT_EFFICIENCY.gemm
MEMORY_EFFICIENCY = DEFAULT_EFFICIENCY.memory

# Fitted on measured GPU kernels, the same fraction on every GPU type (`python
# benchmarks/gpu_op_latency.py --fit`: each value minimises the MAPE of its rows, and
# docs/op_latency.md gives the errors with every GPU type held out of its own fit).
# - Achieved fraction of HBM bandwidth by kind of memory-bound kernel, in place of
#   `KernelEfficiency.memory`: PyTorch's own CUDA kernels (NeuSight's float32 elementwise,
#   softmax and layer-norm rows on A100-PCIe-40GB, V100-PCIe, T4, P100 and P4), the
#   embedding on Vidur's TP-1 `F.embedding` rows (A100 80GB, A40). Other kinds (copies,
#   reductions, the loss) keep `KernelEfficiency.memory`.
MEMORY_EFFICIENCY_BY_KIND: dict[OpKind, float] = {
    OpKind.ELEMENTWISE: 0.84,
    OpKind.SOFTMAX: 0.64,
    OpKind.NORM: 0.46,
    OpKind.EMBEDDING: 0.46,  # Vidur A40 0.5, A100 0.15 (its gather runs at ~300 GB/s on both)
}
# - float32 GEMMs on CUDA cores (TF32 off, PyTorch's default) as a fraction of the CUDA-core
#   FP32 peak: NeuSight's `linear` and `bmm` rows (cuBLAS sgemm) on the same five GPUs. Used
#   for every "float32" GEMM unless `meshplan calibrate` measured this machine's GEMMs. 0.762
#   is a 128-tile's rate under `sgemm_seconds` (tiles, waves and split-K, session 29), fitted
#   jointly with `SGEMM`; 0.67 before it, as one fraction with wave quantization alone.
CUDA_CORE_GEMM_EFFICIENCY = 0.762


# float32 GEMMs on CUDA cores by cuBLAS's own levers (session 29), in place of wave
# quantization alone: cuBLAS's sgemm kernels cut the output into tiles, one thread block
# each, and may split K over s blocks per tile whose partial sums a second kernel adds
# (split-K; NVIDIA CUTLASS docs, "Efficient GEMM in CUDA", "Parallelized Reductions").
# NeuSight's rows list the kernels each call ran: `volta_sgemm_128x64_tn`,
# `ampere_sgemm_32x32_sliced1x4_tn`, `maxwell_sgemm_32x128_tn`, ..., and on 3-11% of the
# `linear` rows per GPU type a `splitkreduce_kernel` after it. Here the tiles are square, of
# side 128, 64 or 32 (assumption: standing for the rectangular ones of about that area).
# The tiles run in waves of one block per SM. Per wave, a block pays a fixed cost (prologue,
# epilogue, the pipeline's fill) and then its tile's FLOPs at the SM's share of the CUDA-core
# peak; a smaller tile reuses each loaded operand less and may run at a fraction of the
# 128-tile's rate (fitted: it does not, nearly). A split adds its partial sums' traffic
# (write and read s float32 copies of the output). cuBLAS's heuristic is taken to pick the
# cheapest (side, split) (assumption: it does, nearly). Fitted by
# `benchmarks/gpu_op_latency.py --fit` on NeuSight's float32 `linear` and `bmm` rows of five
# GPU types (A100-PCIe-40GB, V100-PCIe, T4, P100, P4); docs/op_latency.md gives the error
# with each type held out of the fit.
@dataclass(frozen=True)
class SgemmModel:
    """The constants of `sgemm_seconds`; a 128-tile's FLOP rate is `gemm_efficiency` (for
    float32: `CUDA_CORE_GEMM_EFFICIENCY`, or what `meshplan calibrate` measured)."""

    wave_latency_s: float  # fixed cost of one wave of blocks
    tile_rate: tuple[tuple[int, float], ...]  # (tile side, its rate relative to the 128-tile)
    min_split_k: float  # a split keeps at least this many of K per block
    splits: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # increasing (`sgemm_seconds` stops early)

    def __post_init__(self) -> None:
        if list(self.splits) != sorted(set(self.splits)) or self.splits[0] != 1:
            raise ValueError(f"SgemmModel.splits must increase from 1, got {self.splits}")


SGEMM = SgemmModel(
    wave_latency_s=9.81e-7,
    tile_rate=((128, 1.0), (64, 0.988), (32, 1.0)),
    min_split_k=136.6,
)


def sgemm_seconds(
    batch: float, m: float, n: float, k: float, gpu: GpuSpec, efficiency: float,
    model: SgemmModel = SGEMM,
) -> float:  # fmt: skip
    """Compute seconds of `batch` float32 GEMMs (m x k) @ (k x n) on `gpu`'s CUDA cores
    (`SgemmModel`): the cheapest tile side and split-K, each wave paying `wave_latency_s`
    plus its tile's FLOPs at `efficiency` x the FP32 peak over the SMs (x the side's relative
    rate), a split adding its partial sums' bytes at the matmul memory fraction. Never below
    the FLOPs at `efficiency` x the peak. The memory roofline is the caller's (`GemmTerm`)."""
    sms = gpu.sms
    sm_rate = gpu.peak(VECTOR_DTYPE) * efficiency / sms
    partial_bw = gpu.hbm_bandwidth * kernel_efficiency(gpu).memory
    out_bytes = DTYPE_BYTES[VECTOR_DTYPE] * batch * m * n
    best = math.inf
    for side, rel in model.tile_rate:
        tiles = math.ceil(batch) * math.ceil(m / side) * math.ceil(n / side)
        per_k = 2.0 * side * side / (sm_rate * rel)
        for s in model.splits:
            k_split = math.ceil(k / s)
            if s > 1 and k_split < model.min_split_k:
                break
            t = math.ceil(tiles * s / sms) * (model.wave_latency_s + per_k * k_split)
            if s > 1:
                t += 2 * s * out_bytes / partial_bw
            best = min(best, t)
    return best


def on_cuda_cores(gpu: GpuSpec, dtype: str) -> bool:
    """A GEMM in `dtype` runs on `gpu`'s CUDA cores: float32 with TF32 off, on a GPU (the host
    CPU "device" has no such split)."""
    return dtype == VECTOR_DTYPE and gpu.name != "CPU"


def tile_sides(gpu: GpuSpec, dtype: str, *, float8: bool = False) -> tuple[int, ...]:
    """Tile sides a GEMM in `dtype` on `gpu` chooses among (`wave_efficiency`)."""
    cuda_core = not float8 and on_cuda_cores(gpu, dtype)
    return CUDA_CORE_TILES if cuda_core else TENSOR_CORE_TILES


# Tensor-core GEMMs need each row-major operand's leading dimension (K of the input, N of the
# weight and the output) to be a multiple of 16 bytes (8 bf16 / fp16 elements, 4 TF32) for
# cuBLAS's vectorised tensor-core kernels; otherwise cuBLAS runs its "align1/align2" kernels,
# several times slower (the reason vocabularies are padded, e.g. 50257 -> 50304). Measured on
# H200 kernels (meshplan's own, `benchmarks/collect_gpu_ops.py`; `gpu_op_latency.py --fit`):
# the factor on the aligned efficiency that zeroes the median signed error of the misaligned
# bf16 `F.linear` rows (118 rows; the fp16, bmm and TF32 rows are not used and are reported
# as held out in docs/op_latency.md). The M dimension (tokens) does not matter.
GEMM_ALIGN_BYTES = 16
MISALIGNED_GEMM_FACTOR = 0.128


def alignment_factor(op: Op, gpu: GpuSpec, dtype: str) -> float:
    """Factor on the tensor-core efficiency of matmul `op` priced in `dtype`:
    `MISALIGNED_GEMM_FACTOR` when its N or K is not a multiple of `GEMM_ALIGN_BYTES` in that
    dtype's element size, else 1 (also for CUDA-core float32 GEMMs, the host CPU and every
    other kind). Judged on the traced (unsharded) N and K: a TP shard of an aligned dimension
    stays aligned when the degree divides it into multiples of 8, as transformer widths do."""
    if op.kind != OpKind.MATMUL or gpu.name == "CPU" or on_cuda_cores(gpu, dtype):
        return 1.0
    return 1.0 if gemm_aligned(op, dtype) else MISALIGNED_GEMM_FACTOR


def gemm_aligned(op: Op, dtype: str) -> bool:
    """The GEMM-shaped `op`'s N and K are multiples of `GEMM_ALIGN_BYTES` in `dtype`'s element
    size (True for an op without GEMM dimensions). The priced dtype decides the size (a graph
    traced in fp32 and planned in bf16 runs 2-byte GEMMs); TF32 keeps 4-byte storage."""
    from .features import gemm_dims

    _, _, n, k = gemm_dims(op)
    if not (n and k and op.inputs):
        return True
    size = 4 if dtype == "tfloat32" else DTYPE_BYTES.get(dtype, 0)
    elems = max(1, GEMM_ALIGN_BYTES // (size or DTYPE_BYTES.get(op.inputs[0].dtype, 2)))
    return n % elems == 0 and k % elems == 0


# Targets of fused norm kernels: the kernels `MEMORY_EFFICIENCY_BY_KIND[NORM]` was fitted on.
# A norm written out in PyTorch (RMSNorm as pow, mean, rsqrt, mul, casts: the zoo's and HF
# Llama's) is traced as NORM ops too, but each is a plain pointwise or reduction kernel.
_FUSED_NORMS = ("layer_norm", "rms_norm", "group_norm", "batch_norm")


def memory_efficiency(op: Op, gpu: GpuSpec) -> float:
    """Fraction of `gpu`'s HBM bandwidth the kernel of `op` sustains (by op kind). The pieces
    of an unfused norm take the elementwise kernels' fraction (meshplan's H100 / H200 training
    steps, docs/op_latency.md: priced at the fused-norm fraction they made the step's
    memory-bound share twice too large). Softmax, layer norm and fused RMSNorm on a GH100
    part depend on their row width (`rowwise_efficiency`)."""
    if op.kind == OpKind.NORM and not any(f in op.target for f in _FUSED_NORMS):
        return MEMORY_EFFICIENCY_BY_KIND[OpKind.ELEMENTWISE]
    rowwise = rowwise_efficiency(op, gpu)
    if rowwise is not None:
        return rowwise
    return MEMORY_EFFICIENCY_BY_KIND.get(op.kind) or kernel_efficiency(gpu).memory


# Row-wise kernels (softmax, layer norm, fused RMSNorm) reduce each row of the input before
# they write it, so how long they take depends on the row width (the reduced last dim):
# PyTorch's CUDA softmax runs a persistent warp kernel up to width 2048 on the GH100 parts
# measured and block kernels above it; the norms run one block or warp per row, so narrow
# rows leave threads idle and each wide row is a long serial reduction. Measured on GH100
# parts (meshplan's own kernels, `benchmarks/collect_gpu_ops.py --only memory_dense`,
# data/gpu_op_latency/meshplan/), these kernels are limited by the SMs, not by HBM, over most
# widths: the H100 (3.35 TB/s) moves a bf16 softmax of width 512 at 0.73 of its HBM
# bandwidth, the H200 (4.8 TB/s, the same 132 SMs and clocks) at only 0.56, in nearly the
# same time. And a small one is not proportionally fast: a bf16 softmax of width 2048 takes
# 7 us for 19 rows and for 128 rows alike (the warp kernel walks 64 elements a lane), where
# its bulk rate would give 1 us. So on a GPU type of `ROWWISE_GPUS` a row-wise kernel moving
# B bytes (read + write, as `essential_bytes`) takes
#
#     latency(width) + B / min(hbm_bw * e_stream, fraction(width) * 4.8 TB/s * sms / 132)
#
# seconds (the Hockney form the collectives use), where
# - latency(width), fraction(width): `ROWWISE_LATENCY_S` and `ROWWISE_FRACTION`, linear in
#   log2(width) between the widths of `ROWWISE_WIDTHS` and held at the ends: the line
#   through the H200's two dense-sweep rows of 2^18 and 2^26 elements at that width (time
#   less 1.2 us, the kernel-time sources' measurement overhead, `gpu_op_latency.overheads`;
#   latency clamped at 0), the rate as a fraction of 4.8 TB/s; the H200, PyTorch 2.11 +
#   CUDA 13, 700 W. The widths are every one the sweep measured at both sizes: 768, 1536,
#   2560, 3072, 5120 and 14336 besides the powers of two, so the warp-to-block switch between
#   2048 and 2560 is a knot, not a slope across 2048-4096;
# - sms / 132: the SM throughput scales with the part's SM count (H100-PCIe: 114; an
#   assumption, its clocks are also lower); the latency is one row's walk and does not;
# - e_stream: an elementwise kernel's fraction (`MEMORY_EFFICIENCY_BY_KIND[ELEMENTWISE]`):
#   on a part with less HBM bandwidth per SM the kernel is HBM-bound again.
# Only the H200's rows set these numbers; the H100's are held out (docs/op_latency.md, MAPE
# per family: softmax 8.8%, layer norm 8.5%, RMSNorm 11.5%; 38-51% with one fraction per
# kind, 20-24% with session 26's bulk-rate-only curve). The H200's 2^22-element rows are not
# used: they are the in-sample check. The latency is a per-call cost (`rowwise_latency`,
# added to the op's floor, `kernel_floor`): it does not scale with the micro-batch or the TP /
# CP share as the bytes do.
# Pre-Hopper parts keep one fraction per kind: NeuSight's float32 rows of A100, V100, T4,
# P100 and P4 show a width dependence too, but session 26's H200 curve as a shape, with the
# level refitted leaving each GPU type out, helped A100 and P100 layer norm (25.5 -> 22.4%,
# 27.3 -> 23.5%) and hurt P4, T4 and V100 (18.9 -> 21.0%, 21.8 -> 26.1%, 28.3 -> 31.1%),
# and softmax by under 1 point either way. The backward kernels take the forward's price
# per byte (an assumption: only forwards were measured; the softmax backward has the same
# warp / block split, the norms' one block per row). The width is the input's last dim for
# softmax (the IR does not record a softmax's dim: transformers reduce the last one) and the
# size of a norm's weight (its normalized shape), else the last dim. Group and batch norm,
# log-softmax of the logits (a LOSS op) and dtypes other than 2- and 4-byte floats keep the
# per-kind fraction.
# GH100 parts: the H100 / H200 rows measured it; GH200 and H800 carry the same GH100 SMs (the
# table is SM throughput, scaled by SMs and capped by each part's own HBM).
ROWWISE_GPUS = frozenset({"H100", "H200", "H100-PCIe", "GH200", "GH200-144GB", "H800"})
ROWWISE_REFERENCE_BW = 4.8e12  # the H200's HBM bandwidth, bytes/s (the fraction's unit)
ROWWISE_REFERENCE_SMS = 132  # the H200's SMs
ROWWISE_WIDTHS = (
    32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 8192, 14336, 16384,
    32768, 65536,
)  # fmt: skip
_ROWWISE_LOG2_WIDTHS = tuple(math.log2(w) for w in ROWWISE_WIDTHS)
# (family, bytes per element) columns; 2-byte rows were measured in bf16 (fp16 takes them).
ROWWISE_COLUMNS = (
    ("softmax", 2), ("softmax", 4), ("layer_norm", 2), ("layer_norm", 4), ("rms_norm", 2),
    ("rms_norm", 4),
)  # fmt: skip
# One line a width of `ROWWISE_WIDTHS`, one column a kernel of `ROWWISE_COLUMNS`
# (`benchmarks/gpu_op_latency.py --fit` prints them): the rate as a fraction of 4.8 TB/s ...
_ROWWISE_FRACTION_TABLE = (
    #  softmax        layer norm      RMSNorm          width
    #  bf16   fp32    bf16   fp32     bf16   fp32
    (0.279, 0.548, 0.026, 0.038, 0.044, 0.074),  # 32
    (0.404, 0.766, 0.051, 0.074, 0.087, 0.148),  # 64
    (0.490, 0.879, 0.102, 0.148, 0.175, 0.283),  # 128
    (0.534, 0.866, 0.171, 0.253, 0.313, 0.455),  # 256
    (0.572, 0.848, 0.251, 0.391, 0.522, 0.657),  # 512
    (0.495, 0.860, 0.320, 0.479, 0.584, 0.744),  # 768
    (0.555, 0.856, 0.376, 0.571, 0.680, 0.822),  # 1024
    (0.373, 0.860, 0.446, 0.656, 0.721, 0.846),  # 1536
    (0.388, 0.816, 0.493, 0.692, 0.737, 0.739),  # 2048
    (0.218, 0.428, 0.529, 0.704, 0.741, 0.728),  # 2560
    (0.244, 0.481, 0.550, 0.701, 0.740, 0.704),  # 3072
    (0.270, 0.541, 0.575, 0.649, 0.734, 0.631),  # 4096
    (0.278, 0.551, 0.586, 0.598, 0.713, 0.621),  # 5120
    (0.222, 0.409, 0.526, 0.549, 0.584, 0.590),  # 8192
    (0.453, 0.596, 0.492, 0.587, 0.525, 0.567),  # 14336
    (0.459, 0.670, 0.529, 0.568, 0.554, 0.587),  # 16384
    (0.472, 0.561, 0.635, 0.488, 0.641, 0.603),  # 32768
    (0.467, 0.446, 0.553, 0.751, 0.541, 0.682),  # 65536
)  # fmt: skip
# ... and the latency, microseconds.
_ROWWISE_LATENCY_TABLE = (
    #  softmax        layer norm      RMSNorm          width
    #  bf16   fp32    bf16   fp32     bf16   fp32
    ( 0.09,  0.50,  0.42,  1.51,  0.61,  1.09),  # 32
    ( 0.23,  0.70,  0.57,  1.18,  0.59,  1.08),  # 64
    ( 0.64,  1.04,  0.53,  1.65,  0.59,  0.83),  # 128
    ( 0.61,  0.96,  0.72,  0.97,  0.47,  0.85),  # 256
    ( 1.43,  1.57,  0.98,  1.56,  0.61,  1.12),  # 512
    ( 2.40,  2.35,  1.58,  2.25,  0.94,  1.69),  # 768
    ( 3.04,  2.88,  1.68,  2.46,  0.98,  1.75),  # 1024
    ( 5.17,  4.56,  2.25,  3.35,  1.28,  2.46),  # 1536
    ( 6.39,  5.87,  2.74,  4.12,  1.66,  1.76),  # 2048
    ( 0.44,  1.02,  3.26,  4.99,  1.98,  2.33),  # 2560
    ( 0.61,  1.18,  3.75,  5.77,  2.27,  2.93),  # 3072
    ( 0.97,  1.60,  4.83,  7.16,  3.00,  2.90),  # 4096
    ( 1.34,  1.89,  5.92,  8.75,  3.74,  4.13),  # 5120
    ( 2.20,  2.60,  9.14, 13.27,  5.85,  5.46),  # 8192
    ( 3.36,  5.46, 15.33, 22.12, 10.05,  9.13),  # 14336
    ( 3.70,  5.32, 17.33, 25.40, 11.40, 10.38),  # 16384
    ( 7.39,  8.80, 35.19, 43.89, 22.93, 19.11),  # 32768
    (13.94, 17.73, 68.49, 87.06, 46.20, 38.46),  # 65536
)  # fmt: skip
ROWWISE_FRACTION: dict[tuple[str, int], tuple[float, ...]] = {
    col: tuple(row[i] for row in _ROWWISE_FRACTION_TABLE) for i, col in enumerate(ROWWISE_COLUMNS)
}
ROWWISE_LATENCY_S: dict[tuple[str, int], tuple[float, ...]] = {
    col: tuple(row[i] * 1e-6 for row in _ROWWISE_LATENCY_TABLE)
    for i, col in enumerate(ROWWISE_COLUMNS)
}
_ROWWISE_FAMILY = {
    "_softmax": "softmax",
    "softmax": "softmax",
    "_safe_softmax": "softmax",
    "_log_softmax": "softmax",  # PyTorch's log-softmax runs the softmax kernels
    "log_softmax": "softmax",
    "native_layer_norm": "layer_norm",
    "layer_norm": "layer_norm",
    "_fused_rms_norm": "rms_norm",
    "rms_norm": "rms_norm",
}


def rowwise_shape(op: Op) -> tuple[str, int, int] | None:
    """(family, rows, width) of a softmax, layer norm or fused RMSNorm `op` (`_ROWWISE_FAMILY`
    by its target, of kind SOFTMAX or NORM), else None, also when its input has no shape."""
    from .features import packet

    family = _ROWWISE_FAMILY.get(packet(op.target))
    if family is None or op.kind not in (OpKind.SOFTMAX, OpKind.NORM) or not op.inputs:
        return None
    x = op.inputs[0].shape
    if not x or 0 in x:
        return None
    width = x[-1]
    if family != "softmax" and len(op.inputs) > 1:
        w = op.inputs[1].shape  # the weight: the normalized shape
        if w and len(w) <= len(x) and tuple(x[-len(w) :]) == tuple(w):
            width = math.prod(w)
    return family, math.prod(x) // width, width


def rowwise_efficiency(
    op: Op,
    gpu: GpuSpec,
    *,
    table: tuple[dict[tuple[str, int], tuple[float, ...]], ...] | None = None,
) -> float | None:
    """Fraction of `gpu`'s HBM bandwidth a row-wise kernel (`rowwise_shape`) streams at once
    it runs, at its row width and dtype on a GPU type of `ROWWISE_GPUS` (the bulk rate of the
    formula above; its latency is `rowwise_latency`); None for any other op, GPU type or
    dtype (the caller keeps the per-kind fraction). A spec without an SM count takes the
    H200's 132. `table`: (latency seconds, fraction) per column in place of
    (`ROWWISE_LATENCY_S`, `ROWWISE_FRACTION`) (the fit in `benchmarks/gpu_op_latency.py`
    prices with its own)."""
    key = _rowwise_key(op, gpu, table)
    if key is None:
        return None
    fraction = (ROWWISE_FRACTION if table is None else table[1])[key[0]]
    rate = _log2_interp(_ROWWISE_LOG2_WIDTHS, fraction, key[1]) * ROWWISE_REFERENCE_BW
    rate *= (gpu.sms or ROWWISE_REFERENCE_SMS) / ROWWISE_REFERENCE_SMS
    rate = min(rate, MEMORY_EFFICIENCY_BY_KIND[OpKind.ELEMENTWISE] * gpu.hbm_bandwidth)
    return rate / gpu.hbm_bandwidth


def rowwise_latency(
    op: Op,
    gpu: GpuSpec,
    *,
    table: tuple[dict[tuple[str, int], tuple[float, ...]], ...] | None = None,
) -> float:
    """Seconds a row-wise kernel (`rowwise_shape`) takes beyond its bytes at the bulk rate,
    on a GPU type of `ROWWISE_GPUS` (the latency of the formula above: one row's walk,
    whatever the number of rows, so a per-call cost like `KERNEL_FLOOR_S`, not scaled with the
    micro-batch or the TP / CP share); 0 for any other op, GPU type or dtype. `table` as in
    `rowwise_efficiency`."""
    key = _rowwise_key(op, gpu, table)
    if key is None:
        return 0.0
    latency = (ROWWISE_LATENCY_S if table is None else table[0])[key[0]]
    return _log2_interp(_ROWWISE_LOG2_WIDTHS, latency, key[1])


def _rowwise_key(
    op: Op, gpu: GpuSpec, table: tuple[dict, ...] | None
) -> tuple[tuple[str, int], int] | None:
    """((family, bytes per element), width) of a row-wise kernel on a GPU type of
    `ROWWISE_GPUS` whose column the tables (`table`, else the shipped ones) hold, else None."""
    shape = rowwise_shape(op) if gpu.name in ROWWISE_GPUS else None
    if shape is None:
        return None
    column = (shape[0], DTYPE_BYTES.get(op.inputs[0].dtype, 0))
    latency, fraction = (ROWWISE_LATENCY_S, ROWWISE_FRACTION) if table is None else table
    if column not in fraction or column not in latency:
        return None
    return column, shape[2]


def kernel_floor(op: Op, gpu: GpuSpec) -> float:
    """Per-call seconds of `op`'s kernel that do not scale with its data: `KERNEL_FLOOR_S`,
    plus a row-wise kernel's latency on a GH100 part (`rowwise_latency`)."""
    return KERNEL_FLOOR_S + rowwise_latency(op, gpu)


def _log2_interp(xs: tuple[float, ...], ys: tuple[float, ...], value: float) -> float:
    """`ys` at log2(`value`), linear between the points `xs` (log2 values), held at the ends."""
    x = min(max(math.log2(value), xs[0]), xs[-1])
    for i in range(len(xs) - 1):
        if x <= xs[i + 1]:
            return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
    return ys[-1]


def gemm_efficiency(gpu: GpuSpec, dtype: str) -> float:
    """Fraction of `gpu.peak(dtype)` a large GEMM in `dtype` sustains: the GPU type's
    tensor-core value, or the CUDA-core one for float32 (`CUDA_CORE_GEMM_EFFICIENCY`)
    unless this machine's GEMMs were measured by `meshplan calibrate` (or it is the host
    CPU "device", whose placeholder table entry keeps the default)."""
    if on_cuda_cores(gpu, dtype) and gpu.gemm_efficiency is None:
        return CUDA_CORE_GEMM_EFFICIENCY
    return kernel_efficiency(gpu).gemm


def kernel_efficiency(gpu: GpuSpec) -> KernelEfficiency:
    """The efficiency constants of `gpu`'s type (`DEFAULT_EFFICIENCY` when not calibrated);
    a GEMM efficiency measured by `meshplan calibrate` (`GpuSpec.gemm_efficiency`, set by
    `Cluster.with_profile`) replaces the table's."""
    base = KERNEL_EFFICIENCY.get(gpu.name, DEFAULT_EFFICIENCY)
    if gpu.gemm_efficiency is None:
        return base
    return _measured(base, gpu.gemm_efficiency)


@functools.lru_cache(maxsize=64)
def _measured(base: KernelEfficiency, gemm: float) -> KernelEfficiency:
    return dataclasses.replace(base, gemm=gemm, source=f"{base.source}; GEMM: meshplan calibrate")


# Kinds whose FLOPs run on tensor cores (matrix multiplies and fused attention).
TENSOR_CORE_KINDS = frozenset({OpKind.MATMUL, OpKind.ATTENTION, OpKind.EXPERTS})

# FLOPs of every other kind run on CUDA cores, at the part's FP32 rate (`GpuSpec.peak`'s
# "float32": CUDA-core FP32 on NVIDIA parts, e.g. 67 TFLOP/s on H100 SXM against 989 dense
# BF16 tensor-core TFLOP/s, datasheet), whatever the training precision. These kinds are
# almost always memory-bound, so the number rarely matters.
VECTOR_DTYPE = "float32"

# Minimum time of one kernel: launch overhead and a short tail (CUDA launch latency is a few
# microseconds; assumption).
KERNEL_FLOOR_S = 5e-6

# Flash attention computes only the unmasked tiles of a causal mask: about half the FLOPs.
# Exactly half is the FlashAttention papers' convention for their causal TFLOP/s (Dao 2023,
# section 4.1, and flash-attn's `benchmarks/benchmark_flash_attention.py`: forward FLOPs
# 4 b s^2 a d for a heads, halved when causal, backward 2.5x, fwd + bwd 3.5x); the kernel runs
# (n + 1) / 2n of the n x n tiles (the diagonal ones whole), and that extra work is in the measured
# throughputs of `ATTENTION_TFLOPS`, which are stated on the halved count. So the halving
# here and those efficiencies go together. The traced backward (flop_counter's
# `sdpa_backward_flop_count`) is 5 matmuls, 2.5x the forward: it includes the recompute of
# Q K^T that flash attention does in its backward, the same count as the papers'.
CAUSAL_FLOP_FRACTION = 0.5

# Measured forward + backward throughput of fused-attention kernels, TFLOP/s on A100 80GB
# SXM4 (peak 312), by kernel, head dim, causal mask and sequence length 512, 1k, 2k, 4k, 8k,
# 16k (batch x sequence = 16k tokens, 2048 hidden, fp16): FlashAttention-2 paper (Dao 2023,
# "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
# Fig. 4(a)-(d), the labels of its bars; FLOPs counted as in `CAUSAL_FLOP_FRACTION`).
# Kernels (`Engine.attention`): "flash2" FlashAttention-2 (flash-attn 2.x, PyTorch SDPA's
# flash backend), "flash1" FlashAttention (flash-attn 1.x CUDA). The figure's "FlashAttention
# Triton" bars are OpenAI Triton's `triton.ops.flash_attention` (flash-attn's
# `benchmarks/benchmark_flash_attention.py` of the FA2 release), not flash-attn's own
# `flash_attn_triton.py` that MosaicML's MPT runs as `attn_impl: triton`; that one states
# "Overall Triton forward + backward is slightly slower than CUDA forward + backward" (its
# docstring; CUDA = FlashAttention 1.x), so it is priced as "flash1", a slight overestimate of
# its speed. Two FA2 labels are hidden by the legend: non-causal head dim 128 at 512 and 1k,
# read off the bar heights (151, 173); head dim 64 at 1k reads 153.
ATTENTION_SEQ_POINTS = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_TFLOPS: dict[tuple[str, int, bool], tuple[float, ...]] = {
    ("flash2", 64, True): (88, 119, 140, 156, 165, 171),  # Fig. 4(c)
    ("flash2", 128, True): (99, 133, 155, 173, 182, 189),  # Fig. 4(d)
    ("flash2", 64, False): (132, 153, 162, 171, 175, 176),  # Fig. 4(a)
    ("flash2", 128, False): (151, 173, 187, 196, 201, 203),  # Fig. 4(b)
    ("flash1", 64, True): (58, 70, 77, 87, 92, 97),
    ("flash1", 128, True): (55, 62, 69, 76, 80, 83),
    ("flash1", 64, False): (91, 92, 104, 108, 110, 110),
    ("flash1", 128, False): (76, 72, 76, 80, 82, 83),
}
# The shape `KernelEfficiency.attention_fwd` / `attention_bwd` are stated at: FlashAttention-2,
# head dim 128, causal, 16k tokens (189 TFLOP/s on A100).
ATTENTION_REFERENCE = ("flash2", 128, True, 16384)


def attention_shape_factor(kernel: str, head_dim: int, causal: bool, seq_len: int) -> float:
    """Throughput of fused attention with `kernel` at (head dim, causal, key length) relative
    to the reference shape (`ATTENTION_REFERENCE`), from the A100 measurements of
    `ATTENTION_TFLOPS`: linear in log2 of the sequence between the measured lengths, held at
    the ends (512 and 16k; from 8k to 16k the kernels gain at most 5%: saturated), linear in
    the head dim between 64 and 128 and held outside (smaller heads run slower still:
    optimistic below 64). The same relative curve is used on every GPU type (assumption; the
    FA2 release's H100 runs, flash-attn's `assets/flash2_h100_fwd_bwd_benchmark.png` panel
    (d), give 163 / 328 = 0.50 at 512 and 294 / 328 = 0.90 at 4k where A100 gives 0.52 and
    0.92)."""
    if not ATTENTION_TFLOPS.get((kernel, 128, True)):
        raise ValueError(f"unknown attention kernel {kernel!r}")
    pts = ATTENTION_SEQ_POINTS
    x = math.log2(min(max(seq_len, pts[0]), pts[-1]))

    def at(d: int) -> float:
        ys = ATTENTION_TFLOPS[(kernel, d, causal)]
        for i in range(len(pts) - 1):
            x0, x1 = math.log2(pts[i]), math.log2(pts[i + 1])
            if x <= x1:
                return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)
        return ys[-1]

    w = (min(max(head_dim, 64), 128) - 64) / 64
    ref_kernel, ref_d, ref_causal, ref_s = ATTENTION_REFERENCE
    ref = ATTENTION_TFLOPS[(ref_kernel, ref_d, ref_causal)][pts.index(ref_s)]
    return ((1 - w) * at(64) + w * at(128)) / ref


def attention_efficiency(
    op: Op, gpu: GpuSpec, *, backward: bool = False, kernel: str = "flash2"
) -> float:
    """Fraction of the peak a fused attention op sustains in one direction: the GPU type's
    reference efficiency (`KernelEfficiency.attention_fwd` / `attention_bwd`) times the shape
    factor of its head dim, mask and key length under `kernel` (`attention_shape_factor`)."""
    k = kernel_efficiency(gpu)
    base = k.attention_bwd if backward else k.attention_fwd
    shapes = [t.shape for t in op.inputs[:2]]
    if len(shapes) < 2 or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        return base  # not (batch, heads, sequence, head dim) q and k: shape unknown
    s_k, head_dim = shapes[1][2], int(op.attr("head_dim", 0)) or shapes[0][3]
    causal = bool(op.attr("causal", False))
    return base * _shape_factor(kernel, head_dim, causal, s_k)


@functools.lru_cache(maxsize=4096)
def _shape_factor(kernel: str, head_dim: int, causal: bool, seq_len: int) -> float:
    return attention_shape_factor(kernel, head_dim, causal, seq_len)


# Wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning
# Performance docs, sections "Tile Quantization" and "Wave Quantization"): a GEMM's output is
# cut into tiles, one thread block each, and the tiles run in waves of one per SM, so a GEMM
# takes ceil(tiles / SMs) waves however little of the last one is used, and partial tiles at
# the edges cost as much as full ones. Tile sides: cuBLAS picks among several tile shapes per
# GEMM; here the side among `TENSOR_CORE_TILES` (128, the guide's and CUTLASS's common tile
# for large fp16/bf16 GEMMs on Ampere and Hopper, and 64) that wastes least of its waves,
# at no other loss (assumption). CUDA-core float32 GEMMs also have 32-wide tiles (cuBLAS's
# `sgemm_32x32` / `sgemm_32x128` kernels, named in NeuSight's measurements). Checked against
# measured kernels by benchmarks/gpu_op_latency.py: on Vidur's fp16 projections (A100, A40,
# TP 1-8) best-of-(128, 64) gives 8.3% / 8.8% MAPE where "64 only below one wave of
# 128-tiles" gave 10.9% / 12.5%. Fused attention tiles the query sequence in blocks of 128
# per (batch, head), FlashAttention-2's forward/backward grid (Dao 2023, section 3.2), and
# loops over the keys inside a block.
TENSOR_CORE_TILES = (128, 64)
CUDA_CORE_TILES = (128, 64, 32)
ATTENTION_BLOCK = 128


def wave_efficiency(
    batch: float,
    m: float,
    n: float,
    sms: int,
    *,
    attention: bool = False,
    sides: tuple[int, ...] = TENSOR_CORE_TILES,
) -> float:
    """Useful fraction of the tile-waves a GEMM with output (batch, m, n) runs on `sms` SMs:
    batch m n / (waves * sms * tile area), in (0, 1], at the best tile side of `sides`.
    `attention`: fused attention with `m` query positions per (batch, head) row (`n` is
    ignored: keys are looped over, not tiled)."""
    if sms <= 0 or batch <= 0 or m <= 0 or n <= 0:
        return 1.0
    if attention:
        tiles = math.ceil(batch) * math.ceil(m / ATTENTION_BLOCK)
        return batch * m / (math.ceil(tiles / sms) * sms * ATTENTION_BLOCK)
    best = 0.0
    for tile in sides:
        tiles = math.ceil(batch) * math.ceil(m / tile) * math.ceil(n / tile)
        best = max(best, batch * m * n / (math.ceil(tiles / sms) * sms * tile * tile))
    return best


def kept_by_selective(op: Op) -> bool:
    """Selective recomputation keeps the outputs of this op (and does not recompute it).

    meshplan's selective recomputation is op-level (torch's selective activation
    checkpointing, as torchtitan's `selective_ac_option="op"`): the outputs of the expensive
    tensor-core ops are kept, namely linear layers (matmuls that read a parameter), fused
    attention and experts, and everything else is recomputed in the backward pass (norms,
    activations, RoPE, softmax, dropout, and the unparameterised score / context matmuls of
    an unfused attention). On an unfused attention this is exactly Korthikanti et al.'s
    selective recomputation of the attention core; it also recomputes the cheap
    memory-bound ops they keep.
    """
    if op.kind in (OpKind.ATTENTION, OpKind.EXPERTS):
        return True
    return op.kind == OpKind.MATMUL and bool(op.params)


# Ops of the prologue/epilogue that a vocab-parallel embedding / LM head / loss shards by TP
# (Megatron-LM VocabParallelEmbedding, ColumnParallelLinear head, vocab-parallel cross
# entropy). Every other prologue/epilogue op is sharded only under sequence parallelism.
_EDGE_TP_KINDS = frozenset({OpKind.EMBEDDING, OpKind.MATMUL, OpKind.LOSS})


def splits_with_tp(op: Op, block_kind: str) -> bool:
    """True when `op` always runs on 1/tp of its data under tensor parallelism.

    In a transformer layer everything but the norms is inside a column-/row-parallel region
    (Megatron-LM: attention heads and MLP columns are split); norms (and, in the prologue and
    epilogue, ops other than the vocab-parallel embedding/head/loss) see the whole hidden
    state and are split only by sequence parallelism.
    """
    if op.kind == OpKind.NORM:
        return False
    if block_kind == "layer":
        return True
    return op.kind in _EDGE_TP_KINDS


def loss_chain(block: Block) -> tuple[int, ...]:
    """Indices of the ops of an epilogue that run on the logits: every op after the output
    head (the block's last matmul) when a loss op follows it, else none. Eager PyTorch runs
    them as a cast of the logits to fp32, a log-softmax (its fp32 output kept for backward)
    and the NLL loss; a fused cross-entropy kernel (`Engine.fused_loss`) replaces them all."""
    if block.kind != "epilogue":
        return ()
    heads = [i for i, op in enumerate(block.ops) if op.kind == OpKind.MATMUL]
    if not heads:
        return ()
    chain = tuple(range(heads[-1] + 1, len(block.ops)))
    if not any(block.ops[i].kind == OpKind.LOSS for i in chain):
        return ()
    return chain


def logits_of(block: Block) -> tuple[int, int]:
    """(bytes, rows) of the logits a `loss_chain` reads: the output head's output and its
    number of rows (tokens); (0, 0) when the block has no loss chain."""
    chain = loss_chain(block)
    if not chain:
        return 0, 0
    out = block.ops[chain[0] - 1].outputs[0]
    rows = out.numel // out.shape[-1] if out.shape else 0
    return out.nbytes, rows


# flash-attn's fused cross entropy (`flash_attn/losses/cross_entropy.py`, v1.0.x, the CUDA
# `xentropy` kernel from apex): the forward reads the logits once and writes one loss and one
# fp32 logsumexp per row (`ctx.save_for_backward(logits, lse, labels)`); the backward reads
# the logits and writes their gradient (`inplace_backward=False`, its default). Bytes of HBM
# traffic per logit: forward 1 read, backward 1 read + 1 write, at the logits' width.
FUSED_LOSS_PASSES = {False: 1, True: 2}
LSE_BYTES = 4  # fp32 logsumexp per row
LABEL_BYTES = 8  # int64 label per row (saved with the logits and the logsumexp)


def fused_loss_time(block: Block, gpu: GpuSpec, *, backward: bool = False) -> float:
    """Roofline seconds of the fused cross-entropy kernel of `block` at its traced size, one
    direction (memory-bound: `FUSED_LOSS_PASSES`)."""
    nbytes, rows = logits_of(block)
    k = kernel_efficiency(gpu)
    traffic = FUSED_LOSS_PASSES[backward] * nbytes + (0 if backward else rows * LSE_BYTES)
    return traffic / (gpu.hbm_bandwidth * k.memory)


def effective_flops(op: Op, *, backward: bool = False) -> float:
    """The FLOPs a GPU actually executes for `op` (causal attention halved)."""
    flops = op.bwd_flops if backward else op.fwd_flops
    if op.kind == OpKind.ATTENTION and op.attr("causal", False):
        return flops * CAUSAL_FLOP_FRACTION
    return float(flops)


# A GEMM kernel overlaps its memory traffic with its math only in part: near the ridge point
# (memory and FLOP time alike) measured kernels take longer than the larger of the two. Vidur's
# fp16 projections are 12-15% slower than max(FLOP, memory) where the memory time is 0.25-2x
# the FLOP time, on A100 80GB and A40 alike, and within 2% of it far from the ridge. A GEMM
# is priced at the p-norm of its two times, (F^p + M^p)^(1/p): the larger alone far from the
# ridge, 2^(1/p) of it on the ridge. p = 2.5 minimises the MAPE of one layer's summed ops on
# the A100 80GB rows (`benchmarks/gpu_op_latency.py`, with the A100 GEMM efficiency below
# refitted at it); held out, the A40's layer sums go from 5.8% to 4.8% MAPE and its fp16
# GEMMs from 8.8% to 7.8% (docs/op_latency.md). Fused attention keeps the larger of the two:
# its efficiencies are published end-to-end kernel rates.
GEMM_OVERLAP_P = 2.5


def gemm_roofline(flop_s: float, mem_s: float) -> float:
    """Seconds of a GEMM whose math takes `flop_s` and memory traffic `mem_s` alone: their
    p-norm (`GEMM_OVERLAP_P`)."""
    hi, lo = (flop_s, mem_s) if flop_s >= mem_s else (mem_s, flop_s)
    if hi <= 0.0:
        return 0.0
    return hi * (1.0 + (lo / hi) ** GEMM_OVERLAP_P) ** (1.0 / GEMM_OVERLAP_P)


def roofline_time(
    op: Op, gpu: GpuSpec, dtype: str, *, backward: bool = False, attention: str = "flash2"
) -> float:
    """Roofline time of `op` at its traced size, without the kernel floor (seconds);
    `attention` names the fused-attention kernel (`Engine.attention`)."""
    flops = effective_flops(op, backward=backward)
    nbytes = essential_bytes(op, backward)
    dtype = matmul_dtype(gpu, dtype)  # TF32 on a part without it: CUDA-core float32
    if op.kind == OpKind.ATTENTION:
        eff = attention_efficiency(op, gpu, backward=backward, kernel=attention)
    elif op.kind in TENSOR_CORE_KINDS:
        eff = gemm_efficiency(gpu, dtype) * alignment_factor(op, gpu, dtype)
    else:
        eff, dtype = 1.0, VECTOR_DTYPE  # CUDA cores (TF32 and bf16 are matmul modes)
    flop_s = flops / (gpu.peak(dtype) * eff)
    mem_s = nbytes / (gpu.hbm_bandwidth * memory_efficiency(op, gpu))
    if op.kind in (OpKind.MATMUL, OpKind.EXPERTS):
        return gemm_roofline(flop_s, mem_s)
    return max(flop_s, mem_s)


def op_time(
    op: Op, gpu: GpuSpec, dtype: str = "bfloat16", *, backward: bool = False, scale: float = 1.0
) -> float:
    """Time of one op on one GPU when it processes `scale` times its traced data (seconds).

    `scale` folds together the micro-batch ratio and any TP/CP sharding (e.g. 2 / tp). An op
    with no work in that direction (a view; a backward that does nothing) costs nothing.
    """
    flops = op.bwd_flops if backward else op.fwd_flops
    nbytes = op.bwd_bytes if backward else op.fwd_bytes
    if flops == 0 and nbytes == 0:
        return 0.0
    return scale * roofline_time(op, gpu, dtype, backward=backward) + kernel_floor(op, gpu)


@dataclass(frozen=True, slots=True)
class GemmTerm:
    """One GEMM (or fused attention) of a block for wave quantization: its roofline parts at
    the traced size and its output shape with what shrinks each dimension.

    `phase` is "fwd", "bwd" or "sel" (a forward that selective recomputation repeats), `cls`
    the block's split class ("tp" / "sp", as `BlockCompute`). Each `*_by` names the factors a
    dimension scales by: "mb" (the micro-batch ratio), "cp" (1 / cp), "tp" (1 / tp).
    """

    phase: str
    cls: str
    flop_s: float
    mem_s: float
    batch: int
    m: int
    n: int
    batch_by: tuple[str, ...] = ()
    m_by: tuple[str, ...] = ()
    n_by: tuple[str, ...] = ()
    attention: bool = False
    sides: tuple[int, ...] = TENSOR_CORE_TILES  # tile sides (`wave_efficiency`)
    # A float32 GEMM on CUDA cores (`sgemm_seconds` prices its FLOPs, with K and what
    # shrinks it): (the GPU, its CUDA-core efficiency, the term's FLOPs over 2 batch m n k:
    # 1 for a GEMM the traced step runs whole; 0.5 for each of a linear's two backward
    # GEMMs when only one runs, a first linear whose input needs no gradient). None: tensor
    # cores (wave quantization at `sides`).
    sgemm: tuple[GpuSpec, float, float] | None = None
    k: int = 0
    k_by: tuple[str, ...] = ()

    def extra(self, factors: dict[str, float], r: float, sms: int) -> float:
        """Seconds wave quantization (on CUDA cores: `sgemm_seconds`) adds to this GEMM at
        work share `r`."""

        def dim(size: int, by: tuple[str, ...]) -> float:
            for f in by:
                size *= factors[f]
            return size

        if self.sgemm is not None:
            gpu, eff, work = self.sgemm
            flop_s = work * sgemm_seconds(
                dim(self.batch, self.batch_by), dim(self.m, self.m_by), dim(self.n, self.n_by),
                dim(self.k, self.k_by), gpu, eff,
            )  # fmt: skip
            return gemm_roofline(flop_s, r * self.mem_s) - r * gemm_roofline(
                self.flop_s, self.mem_s
            )
        q = wave_efficiency(
            dim(self.batch, self.batch_by),
            dim(self.m, self.m_by),
            dim(self.n, self.n_by),
            sms,
            attention=self.attention,
            sides=self.sides,
        )
        if self.attention:
            return r * (max(self.flop_s / q, self.mem_s) - max(self.flop_s, self.mem_s))
        return r * (
            gemm_roofline(self.flop_s / q, self.mem_s) - gemm_roofline(self.flop_s, self.mem_s)
        )


@dataclass(frozen=True, slots=True)
class BlockCompute:
    """Roofline aggregates of one block on one GPU type, by TP split class.

    `*_tp` sums ops that TP always shards, `*_sp` ops that only sequence parallelism shards.
    `sel_*` are the forward times of the ops selective recomputation repeats
    (`kept_by_selective` is False). `n_*` count the
    kernels (each pays `KERNEL_FLOOR_S`). Times are at the traced micro-batch, in seconds.
    `floor_*` are the per-call overheads in total (None: `n_* * KERNEL_FLOOR_S`; with the
    row-wise kernels' latencies on GH100 parts, `rowwise_latency`, when there are any; the
    learned model's own overheads otherwise) and `source` names the model that priced the
    block.
    """

    fwd_tp: float
    fwd_sp: float
    bwd_tp: float
    bwd_sp: float
    sel_tp: float
    sel_sp: float
    n_fwd: int
    n_bwd: int
    n_sel: int
    floor_fwd: float | None = None
    floor_bwd: float | None = None
    floor_sel: float | None = None
    source: str = "analytic"
    gemms: tuple[GemmTerm, ...] = ()  # wave quantization terms (analytic model only)
    sms: int = 0
    # Forward / backward time of the TP-sharded GEMMs (and attention) at the traced size:
    # what tensor-parallel traffic can hide behind (`Engine.tp_overlap`).
    gemm_fwd_tp: float = 0.0
    gemm_bwd_tp: float = 0.0
    # Forward / backward / selective-recompute time of the attention core (`OpKind.ATTENTION`,
    # inside the `*_tp` sums) at the traced size: under head-parallel CP with asymmetric
    # shares it scales with a rank's heads, not its tokens (`times(attention_div=)`).
    attn_fwd: float = 0.0
    attn_bwd: float = 0.0
    attn_sel: float = 0.0

    def gemm_times(self, *, tp: int, cp: int, scale: float) -> tuple[float, float]:
        """(forward, backward) seconds of the TP-sharded tensor-core ops of one instance."""
        r_tp = scale / (tp * cp)
        return r_tp * self.gemm_fwd_tp, r_tp * self.gemm_bwd_tp

    def times(
        self,
        *,
        tp: int,
        cp: float,
        sequence_parallel: bool,
        scale: float,
        attention_div: float | None = None,
    ) -> tuple[float, float, float]:
        """(forward, backward, selective-recompute forward) seconds of one block instance.

        `scale` is micro_batch / traced micro_batch: costs grow linearly with the number of
        sequences (assumption: GEMM efficiency does not change with the batch dimension).
        `cp`: what the rank's share of a sequence divides the work by (cp, or under
        asymmetric shares `StageConfig.seq_div`); `attention_div`: the same for the
        attention core where it differs (head-parallel CP with asymmetric shares).
        """
        r_tp = scale / (tp * cp)
        r_sp = scale / ((tp if sequence_parallel else 1) * cp)
        fl_f = self.n_fwd * KERNEL_FLOOR_S if self.floor_fwd is None else self.floor_fwd
        fl_b = self.n_bwd * KERNEL_FLOOR_S if self.floor_bwd is None else self.floor_bwd
        fl_s = self.n_sel * KERNEL_FLOOR_S if self.floor_sel is None else self.floor_sel
        out = {
            "fwd": r_tp * self.fwd_tp + r_sp * self.fwd_sp + fl_f,
            "bwd": r_tp * self.bwd_tp + r_sp * self.bwd_sp + fl_b,
            "sel": r_tp * self.sel_tp + r_sp * self.sel_sp + fl_s,
        }
        if self.gemms:  # wave quantization at this (tp, cp, micro-batch)
            factors = {"mb": scale, "cp": 1.0 / cp, "tp": 1.0 / tp}
            for g in self.gemms:
                out[g.phase] += g.extra(factors, r_tp if g.cls == "tp" else r_sp, self.sms)
        if attention_div is not None and attention_div != cp:
            r_at = scale / (tp * attention_div)
            out["fwd"] += (r_at - r_tp) * self.attn_fwd
            out["bwd"] += (r_at - r_tp) * self.attn_bwd
            out["sel"] += (r_at - r_tp) * self.attn_sel
        return out["fwd"], out["bwd"], out["sel"]


def latency_model(gpu: GpuSpec):
    """The learned latency model covering `gpu`'s type (`learned.LatencyModel`), else None.

    None too when `MESHPLAN_LEARNED_LATENCY=0` or the shipped model cannot be read (a
    model file of another feature layout: `latency_source` says so).
    """
    from .learned import load_for_device

    try:
        return load_for_device(gpu.name)
    except (OSError, ValueError, KeyError):
        return None


def op_seconds(
    model,
    op: Op,
    gpu: GpuSpec,
    dtype: str,
    *,
    backward: bool = False,
    scale: float = 1.0,
) -> tuple[float, str]:
    """(seconds, "learned" | "analytic"): the learned time when `model` (a
    `learned.LatencyModel`) covers `gpu`, else `op_time`."""
    if model is not None and model.covers(gpu):
        return model.predict_op_time(op, gpu, dtype, backward=backward, scale=scale), "learned"
    return op_time(op, gpu, dtype, backward=backward, scale=scale), "analytic"


def latency_source(gpu: GpuSpec) -> str:
    """Which model prices ops on `gpu`: "learned (<file>, trained on <devices>, <n> ops)" or
    "analytic roofline" (with the reason when a learned model exists but is not used)."""
    import os

    from .learned import DEFAULT_MODEL, load_for_device

    if os.environ.get("MESHPLAN_LEARNED_LATENCY", "1") in ("0", "off", "false"):
        return "analytic roofline (MESHPLAN_LEARNED_LATENCY=0)"
    try:
        model = load_for_device(gpu.name)
    except (OSError, ValueError, KeyError) as e:
        return f"analytic roofline ({DEFAULT_MODEL.name} unusable: {e})"
    if model is None:
        return "analytic roofline"
    return f"learned ({model.describe()})"


# Learned (work, overhead) seconds per (model, GPU type, dtype, op shape, direction): the
# planner prices the same block shapes on every stage and configuration.
_LEARNED_PARTS: dict[tuple, tuple[float, float]] = {}
_LEARNED_CACHE_MAX = 200_000


def _learned_parts(model, block: Block, gpu: GpuSpec, dtype: str) -> list[tuple[float, float]]:
    """(work, overhead) seconds of every (op, direction) of `block`, forward then backward."""
    items = [(op, bwd) for op in block.ops for bwd in (False, True)]
    keys = [
        (
            id(model),
            gpu.name,
            dtype,
            op.target,
            op.kind,
            op.inputs,
            op.outputs,
            op.attrs,
            op.fwd_flops,
            op.bwd_flops,
            op.fwd_bytes,
            op.bwd_bytes,
            bwd,
        )
        for op, bwd in items
    ]
    missing = [i for i, k in enumerate(keys) if k not in _LEARNED_PARTS]
    if missing:
        if len(_LEARNED_PARTS) > _LEARNED_CACHE_MAX:
            _LEARNED_PARTS.clear()
        parts = model.predict_parts_many([items[i] for i in missing], gpu, dtype)
        for i, (work, overhead) in zip(missing, parts, strict=True):
            _LEARNED_PARTS[keys[i]] = (float(work), float(overhead))
    return [_LEARNED_PARTS[k] for k in keys]


def block_compute(block: Block, gpu: GpuSpec, dtype: str, engine: Engine = EAGER) -> BlockCompute:
    """Aggregate the op times of `block` on `gpu` (one pass over its ops): the learned model's
    when it covers `gpu` (`latency_model`) and the engine is meshplan's eager one, else the
    analytic roofline's with the `engine`'s features (`cost_model.engine`): fused regions of
    memory-bound ops (`passes.fusion`) and Float8 linear layers (`float8_linear_time`)."""
    model = latency_model(gpu) if engine.is_eager else None
    if model is not None:
        return _learned_block_compute(model, block, gpu, dtype)
    acc = {k: 0.0 for k in ("fwd_tp", "fwd_sp", "bwd_tp", "bwd_sp", "sel_tp", "sel_sp")}
    gemm = {"fwd": 0.0, "bwd": 0.0}  # TP-sharded GEMM time, what TP traffic can overlap
    attn = {"fwd": 0.0, "bwd": 0.0, "sel": 0.0}  # the attention core (`BlockCompute.attn_*`)
    n_fwd = n_bwd = n_sel = 0
    # row-wise kernels' latencies on GH100 parts (`rowwise_latency`): per call, like the floor
    latency = {"fwd": 0.0, "bwd": 0.0, "sel": 0.0}
    rows = set()  # row-parallel projections (prologue / epilogue matmuls are column-parallel)
    if block.kind == "layer":
        sharding = tp_sharding(block, _block_hidden(block))  # the roles the runtime shards by
        rows = {id(op) for op in sharding.ops(block, TpRole.ROW)}
    regions = {r.ops[0]: r for r in fusion_regions(block)} if engine.fused else {}
    fused = {i for r in regions.values() for i in r.ops}
    gemms: list[GemmTerm] = []
    chain = set(loss_chain(block)) if engine.fused_loss else set()
    if chain:  # one fused cross-entropy kernel in place of the loss chain (vocab-parallel)
        regions = {i: r for i, r in regions.items() if not set(r.ops) & chain}
        fused = {i for r in regions.values() for i in r.ops} | chain
        fwd, bwd = (fused_loss_time(block, gpu, backward=b) for b in (False, True))
        acc["fwd_tp"] += fwd
        acc["sel_tp"] += fwd
        acc["bwd_tp"] += bwd
        n_fwd, n_sel, n_bwd = n_fwd + 1, n_sel + 1, n_bwd + 1
    for i, op in enumerate(block.ops):
        cls = "tp" if splits_with_tp(op, block.kind) else "sp"
        if i in regions:  # one fused kernel for the whole chain
            fwd, bwd, split = _region_times(block, regions[i], gpu)
            for c, share in split.items():
                acc["fwd_" + c] += share * fwd
                acc["sel_" + c] += share * fwd  # fusable ops are never kept by selective
                acc["bwd_" + c] += share * bwd
            n_fwd, n_sel, n_bwd = n_fwd + 1, n_sel + 1, n_bwd + (1 if bwd else 0)
            continue
        if i in fused:
            continue
        f8 = engine.float8 is not None and is_float8_linear(op, block)
        low = (
            engine.forward_precision
            if not f8 and is_float8_linear(op, block) and lowered(op, engine.hybrid_linears)
            else None
        )
        terms = gemm_terms(
            op, gpu, dtype, cls, row_parallel=id(op) in rows, float8=f8, attention=engine.attention,
            forward=low,
        )  # fmt: skip
        if op.fwd_flops or op.fwd_bytes:
            if f8:
                t = float8_linear_time(op, gpu, fused=engine.fused)
                n_fwd += FLOAT8_CAST_KERNELS
            elif low:
                t = low_forward_linear_time(op, gpu, dtype, low, fused=engine.fused)
                n_fwd += FLOAT8_CAST_KERNELS
            else:
                t = roofline_time(op, gpu, dtype, attention=engine.attention)
            lat = rowwise_latency(op, gpu)
            latency["fwd"] += lat
            acc["fwd_" + cls] += t
            n_fwd += 1
            if op.kind in TENSOR_CORE_KINDS and cls == "tp":
                gemm["fwd"] += t
            gemms += [g for g in terms if g.phase == "fwd"]
            if op.kind == OpKind.ATTENTION and cls == "tp":
                attn["fwd"] += t
                attn["sel"] += 0.0 if kept_by_selective(op) else t
            if not kept_by_selective(op):
                acc["sel_" + cls] += t
                latency["sel"] += lat
                n_sel += 1
                gemms += [dataclasses.replace(g, phase="sel") for g in terms if g.phase == "fwd"]
        if op.bwd_flops or op.bwd_bytes:
            if f8:
                t = float8_linear_time(op, gpu, fused=engine.fused, backward=True)
                n_bwd += FLOAT8_CAST_KERNELS
            else:
                t = roofline_time(op, gpu, dtype, backward=True, attention=engine.attention)
            latency["bwd"] += rowwise_latency(op, gpu)
            acc["bwd_" + cls] += t
            n_bwd += 1
            if op.kind in TENSOR_CORE_KINDS and cls == "tp":
                gemm["bwd"] += t
            if op.kind == OpKind.ATTENTION and cls == "tp":
                attn["bwd"] += t
            gemms += [g for g in terms if g.phase == "bwd"]
    n = {"fwd": n_fwd, "bwd": n_bwd, "sel": n_sel}
    floors = (
        {f"floor_{k}": n[k] * KERNEL_FLOOR_S + v for k, v in latency.items()}
        if any(latency.values())
        else {}
    )
    return BlockCompute(
        **acc, n_fwd=n_fwd, n_bwd=n_bwd, n_sel=n_sel, gemms=tuple(gemms), sms=gpu.sms,
        gemm_fwd_tp=gemm["fwd"], gemm_bwd_tp=gemm["bwd"],
        attn_fwd=attn["fwd"], attn_bwd=attn["bwd"], attn_sel=attn["sel"], **floors,
    )  # fmt: skip


def _region_times(block: Block, region, gpu: GpuSpec) -> tuple[float, float, dict[str, float]]:
    """(forward, backward) roofline seconds of one fused region at the traced size and the
    share of it each split class carries (by the eager bytes of its ops)."""
    k = kernel_efficiency(gpu)
    bw = gpu.hbm_bandwidth * k.memory
    by_cls = {"tp": 0.0, "sp": 0.0}
    flops = {"fwd": 0.0, "bwd": 0.0}
    for i in region.ops:
        op = block.ops[i]
        by_cls["tp" if splits_with_tp(op, block.kind) else "sp"] += op.fwd_bytes + op.bwd_bytes
        flops["fwd"] += op.fwd_flops
        flops["bwd"] += op.bwd_flops
    vector = gpu.peak(VECTOR_DTYPE)
    fwd = max(flops["fwd"] / vector, region.fwd_bytes / bw)
    bwd = max(flops["bwd"] / vector, region.bwd_bytes / bw) if region.bwd_bytes else 0.0
    total = sum(by_cls.values()) or 1.0
    return fwd, bwd, {c: v / total for c, v in by_cls.items() if v}


# Float8 linear layers (torchao tensorwise dynamic scaling, as torchtitan runs them): before
# each GEMM its two operands are scaled by their absolute maximum and cast to FP8, in
# forward X (M x K) and W (K x N), in backward the output gradient (M x N), and the weight
# and input gradients need the transposed FP8 operands. Bytes per element, memory-bound:
# eager, an amax pass (read 2) and a cast (read 2, write 1): 5; fused by torch.compile into
# the producing kernel, read 2 + write 1: 3; a transpose of an FP8 tensor reads and writes 1.
# The GEMM output (and everything outside the linear layers) stays bf16. Assumption on the
# kernel split, consistent with torchao's Float8Linear (amax, scale, cast, `_scaled_mm`).
FLOAT8_CAST_BYTES = {False: 5, True: 3}
FLOAT8_TRANSPOSE_BYTES = 2
FLOAT8_CAST_KERNELS = 2  # per direction: the two casts (forward) / cast + transposes (backward)
FLOAT8_DTYPE = "float8_e4m3fn"


def linear_role(op: Op) -> str:
    """The path of a linear op's module inside its repeated unit: its weight's name without
    ".weight" ("attn.q_proj"), as `runtime.hybrid_precision` names the module (its path
    relative to the unit)."""
    return op.params[0].rsplit(".", 1)[0] if op.params else ""


def lowered(op: Op, linears: tuple[str, ...]) -> bool:
    """Whether per-group precision lowers this linear: every one when `linears` is empty
    (`Engine.hybrid_linears`), else those whose `linear_role` it names."""
    return not linears or linear_role(op) in linears


def is_float8_linear(op: Op, block: Block) -> bool:
    """A linear layer Float8 training converts: a parameterised 2-D matmul inside a
    transformer layer (torchtitan leaves the output head and the embedding in bf16)."""
    return block.kind == "layer" and op.kind == OpKind.MATMUL and bool(op.params)


def float8_linear_time(op: Op, gpu: GpuSpec, *, fused: bool, backward: bool = False) -> float:
    """Roofline seconds of one Float8 linear layer at its traced size, one direction: the FP8
    GEMM(s) at the FP8 peak times `KernelEfficiency.gemm_fp8`, plus the casts (above)."""
    from .features import gemm_dims

    if FLOAT8_DTYPE not in dict(gpu.peak_flops):
        from .engine import EngineError

        raise EngineError(
            f"{gpu.name} has no FP8 tensor cores (no {FLOAT8_DTYPE} peak); price it without float8"
        )
    k = kernel_efficiency(gpu)
    _, m, n, kk = gemm_dims(op)
    bw = gpu.hbm_bandwidth * k.memory
    flops = op.bwd_flops if backward else op.fwd_flops
    gemm_s = flops / (gpu.peak(FLOAT8_DTYPE) * k.fp8)
    io_bytes = (op.bwd_bytes if backward else op.fwd_bytes) * 0.5  # FP8 operands
    cast = FLOAT8_CAST_BYTES[fused]
    if backward:
        conv = cast * m * n + FLOAT8_TRANSPOSE_BYTES * (m * kk + kk * n)
    else:
        conv = cast * (m * kk + kk * n)
    return gemm_roofline(gemm_s, io_bytes / bw) + conv / bw


# Low-precision forward linears (`Engine.forward_precision`, QSync-style): before the forward
# GEMM the activation is quantized per token (int8) or per tensor (fp8), an amax pass and a
# cast like Float8's (FLOAT8_CAST_BYTES per element, one byte written); the weight likewise per
# output channel (int8) or per tensor (fp8), but once per optimizer step, its copy shared by
# the step's micro-batches (`runtime.hybrid_precision`; `weight_quantize_time`, priced with the
# optimizer); the result is scaled back in the GEMM's epilogue. An INT8 GEMM reaches
# `KernelEfficiency.int8` of its peak (measured on H100 / H200 `torch._int_mm` kernels; other
# GPU types: their 16-bit fraction, an assumption), an FP8 one `KernelEfficiency.fp8`
# (docs/op_latency.md). The backward GEMMs stay in the training dtype.


def low_forward_linear_time(op: Op, gpu: GpuSpec, dtype: str, mode: str, *, fused: bool) -> float:
    """Roofline seconds of one linear's forward in `mode` ("int8" or "fp8") at its traced
    size: the GEMM at that peak times its efficiency, plus the quantizing passes (above)."""
    from .features import gemm_dims

    peak_dtype = HYBRID_PEAKS[mode]
    if peak_dtype not in dict(gpu.peak_flops):
        from .engine import EngineError

        raise EngineError(
            f"{gpu.name} has no {mode.upper()} tensor cores (no {peak_dtype} peak); price it "
            f"without {mode}"
        )
    k = kernel_efficiency(gpu)
    _, m, n, kk = gemm_dims(op)
    bw = gpu.hbm_bandwidth * k.memory
    eff = k.fp8 if mode == "fp8" else k.int8
    gemm_s = op.fwd_flops / (gpu.peak(peak_dtype) * eff)
    io_bytes = op.fwd_bytes * 0.5  # one-byte operands (the output is written either way)
    conv = FLOAT8_CAST_BYTES[fused] * m * kk  # the activation's quantizing pass
    return gemm_roofline(gemm_s, io_bytes / bw) + conv / bw


def weight_quantize_time(
    block: Block, gpu: GpuSpec, *, fused: bool, linears: tuple[str, ...] = ()
) -> float:
    """Seconds to make the low-precision copies of `block`'s forward-quantized linears'
    weights (those `linears` names, every one when empty: `lowered`), once per optimizer
    step (above): an amax pass and a cast of each K x N weight."""
    from .features import gemm_dims

    bw = gpu.hbm_bandwidth * kernel_efficiency(gpu).memory
    total = 0
    for op in block.ops:
        if is_float8_linear(op, block) and lowered(op, linears):
            _, _, n, kk = gemm_dims(op)
            total += FLOAT8_CAST_BYTES[fused] * kk * n
    return total / bw


def _block_hidden(block: Block) -> int:
    """The model width: the last dimension of the activation entering the block."""
    for t in block.inputs:
        if t.shape and t.dtype not in ("int64", "int32"):
            return t.shape[-1]
    return 0


def gemm_terms(
    op: Op,
    gpu: GpuSpec,
    dtype: str,
    cls: str,
    *,
    row_parallel: bool = False,
    float8: bool = False,
    attention: str = "flash2",
    forward: str | None = None,
) -> tuple[GemmTerm, ...]:
    """The wave-quantization terms of one tensor-core op (empty for any other kind).

    Shapes (`features.gemm_dims`: batch, M, N, K) and how sharding shrinks them:
    - a linear layer (a matmul with parameters; MoE experts likewise, per expert): forward
      output (M tokens, N); backward input gradient (M, K) and weight gradient (K, N), half
      the backward FLOPs each. Tokens scale with the micro-batch and 1 / cp; a column-parallel
      layer's N and a row-parallel one's K scale with 1 / tp (Megatron-LM, Shoeybi et al.);
    - a matmul without parameters (an unfused attention's scores and context, batch = b x
      heads): the batch scales with the micro-batch and 1 / tp (heads), M with 1 / cp;
    - fused attention: FlashAttention-2's grid of (b x heads) x query blocks, forward and
      backward alike.
    The FLOP part of the roofline (`roofline_time` without the memory term) is what waves
    quantize; the memory part is kept as is.
    """
    if op.kind not in TENSOR_CORE_KINDS or gpu.sms <= 0:
        return ()
    from .features import gemm_dims

    batch, m, n, k = gemm_dims(op)
    if not (batch and m and n and k):
        return ()
    keff = kernel_efficiency(gpu)
    dtype = matmul_dtype(gpu, dtype)  # TF32 on a part without it: CUDA-core float32
    align = alignment_factor(op, gpu, dtype)
    peak = gpu.peak(FLOAT8_DTYPE if float8 else dtype)
    sides = tile_sides(gpu, dtype, float8=float8)
    cuda_core = on_cuda_cores(gpu, dtype)
    out: list[GemmTerm] = []
    for backward in (False, True):
        flops = effective_flops(op, backward=backward)
        nbytes = essential_bytes(op, backward)
        if not flops:
            continue
        fwd_low = forward if not backward else None  # low-precision forward linears
        low = float8 or fwd_low is not None
        if op.kind == OpKind.ATTENTION:
            eff = attention_efficiency(op, gpu, backward=backward, kernel=attention)
        elif fwd_low is not None:
            eff = keff.fp8 if fwd_low == "fp8" else keff.int8
        else:
            eff = keff.fp8 if float8 else gemm_efficiency(gpu, dtype) * align
        flop_s = flops / ((gpu.peak(HYBRID_PEAKS[fwd_low]) if fwd_low else peak) * eff)
        mem_s = nbytes * (0.5 if low else 1.0) / (gpu.hbm_bandwidth * memory_efficiency(op, gpu))
        phase = "bwd" if backward else "fwd"
        tokens = ("mb", "cp")
        on_cores = cuda_core and not low and op.kind != OpKind.ATTENTION
        # (share, batch, M, N, inner K, and what scales each of the four)
        if op.kind == OpKind.ATTENTION:
            shapes = [(1.0, batch, m, n, k, ("mb", "tp"), ("cp",), (), ())]
        elif not op.params:  # unfused attention matmuls: batch = b x heads
            shapes = [(1.0, batch, m, n, k, ("mb", "tp"), ("cp",), (), ())]
            if backward and on_cores:  # its two GEMMs priced at the forward's shape
                shapes = [(0.5, *shapes[0][1:])] * 2
        else:
            n_by = ("tp",) if cls == "tp" and not row_parallel else ()
            k_by = ("tp",) if cls == "tp" and row_parallel else ()
            if not backward:
                shapes = [(1.0, batch, m, n, k, (), tokens, n_by, k_by)]
            else:  # input gradient (M, K) over N, weight gradient (K, N) over the tokens
                shapes = [
                    (0.5, batch, m, k, n, (), tokens, k_by, n_by),
                    (0.5, batch, k, n, m, (), k_by, n_by, tokens),
                ]
        for share, b, mm, nn, kk, b_by, m_by, n_by_, k_by_ in shapes:
            # the FLOPs the trace charged this GEMM, as a multiple of one whole GEMM
            sgemm = (gpu, eff, share * flops / (2.0 * b * mm * nn * kk)) if on_cores else None
            out.append(
                GemmTerm(
                    phase,
                    cls,
                    share * flop_s,
                    share * mem_s,
                    b,
                    mm,
                    nn,
                    b_by,
                    m_by,
                    n_by_,
                    attention=op.kind == OpKind.ATTENTION,
                    sides=sides,
                    sgemm=sgemm,
                    k=kk,
                    k_by=k_by_,
                )  # fmt: skip
            )
    return tuple(out)


def op_parts(
    op: Op, gpu: GpuSpec, dtype: str = "bfloat16", *, backward: bool = False
) -> tuple[float, float]:
    """(work, overhead) seconds of one op at its traced size, by the model `block_compute`
    uses for `gpu`: the learned split when it covers `gpu`, else (`roofline_time`,
    `KERNEL_FLOOR_S`). Work scales with the op's share of the data, overhead does not; an op
    with no work in that direction costs (0, 0)."""
    if not (op.bwd_flops or op.bwd_bytes if backward else op.fwd_flops or op.fwd_bytes):
        return 0.0, 0.0
    model = latency_model(gpu)
    if model is None:
        return roofline_time(op, gpu, dtype, backward=backward), kernel_floor(op, gpu)
    work, overhead = model.predict_parts_many([(op, backward)], gpu, dtype)[0]
    if op.kind in TENSOR_CORE_KINDS:
        work *= host_gemm_anchor(model, gpu)
    return float(work), float(overhead)


def _gemm_op(m: int, n: int, k: int, dtype: str) -> Op:
    """A plain `(m x k) @ (k x n)` matmul as the tracer records it (FLOPs and bytes of the
    forward and of the two backward GEMMs)."""
    b = DTYPE_BYTES[dtype]
    return Op(
        "calibration_gemm",
        OpKind.MATMUL,
        "aten.mm.default",
        "",
        (TensorMeta((m, k), dtype), TensorMeta((k, n), dtype)),
        (TensorMeta((m, n), dtype),),
        fwd_flops=2 * m * n * k,
        bwd_flops=4 * m * n * k,
        fwd_bytes=b * (m * k + k * n + m * n),
        bwd_bytes=2 * b * (m * k + k * n + m * n),
    )


_ANCHORS: dict[tuple[int, GpuSpec], float] = {}


def host_gemm_anchor(model, gpu: GpuSpec) -> float:
    """Factor on the learned work time of tensor-core ops for a GPU type whose GEMMs were
    measured by `meshplan calibrate` (`gpu.gemm_efficiency`), else 1.

    The learned model was trained on another machine of the same type; the calibration
    measured *this* one. The factor is (learned efficiency) / (measured efficiency) on the
    GEMM shapes calibrate times by default on that kind of device (`calibrate.CPU_GEMM_SHAPES`
    in float32 on a CPU, `GPU_GEMM_SHAPES` in bf16 on a GPU; medians of both), so the learned
    model keeps its shape dependence and takes the measured level.
    """
    if gpu.gemm_efficiency is None:
        return 1.0
    key = (id(model), gpu)
    if key not in _ANCHORS:
        _ANCHORS[key] = _anchor(model, gpu)
    return _ANCHORS[key]


def _anchor(model, gpu: GpuSpec) -> float:
    from meshplan.ir.cluster import CPU_GEMM_SHAPES, GPU_GEMM_SHAPES

    on_cpu = gpu.is_cpu
    shapes, dtype = (CPU_GEMM_SHAPES, "float32") if on_cpu else (GPU_GEMM_SHAPES, "bfloat16")
    learned = statistics.median(
        model.efficiency(_gemm_op(m, n, k, dtype), gpu) for m, n, k in shapes
    )
    return learned / gpu.gemm_efficiency


def _learned_block_compute(model, block: Block, gpu: GpuSpec, dtype: str) -> BlockCompute:
    """`block_compute` with learned op times: work by split class, overheads summed; the work
    of tensor-core ops is re-anchored to a calibrated GEMM efficiency (`host_gemm_anchor`)."""
    acc = {k: 0.0 for k in ("fwd_tp", "fwd_sp", "bwd_tp", "bwd_sp", "sel_tp", "sel_sp")}
    floor = {"fwd": 0.0, "bwd": 0.0, "sel": 0.0}
    attn = {"fwd": 0.0, "bwd": 0.0, "sel": 0.0}  # the attention core (`BlockCompute.attn_*`)
    n_fwd = n_bwd = n_sel = 0
    anchor = host_gemm_anchor(model, gpu)
    parts = iter(_learned_parts(model, block, gpu, dtype))
    for op in block.ops:
        cls = "tp" if splits_with_tp(op, block.kind) else "sp"
        (w_f, o_f), (w_b, o_b) = next(parts), next(parts)
        if op.kind in TENSOR_CORE_KINDS:
            w_f, w_b = w_f * anchor, w_b * anchor
        core = op.kind == OpKind.ATTENTION and cls == "tp"
        if op.fwd_flops or op.fwd_bytes:
            acc["fwd_" + cls] += w_f
            floor["fwd"] += o_f
            n_fwd += 1
            attn["fwd"] += w_f if core else 0.0
            if not kept_by_selective(op):
                acc["sel_" + cls] += w_f
                floor["sel"] += o_f
                n_sel += 1
                attn["sel"] += w_f if core else 0.0
        if op.bwd_flops or op.bwd_bytes:
            acc["bwd_" + cls] += w_b
            floor["bwd"] += o_b
            n_bwd += 1
            attn["bwd"] += w_b if core else 0.0
    return BlockCompute(
        **acc,
        attn_fwd=attn["fwd"],
        attn_bwd=attn["bwd"],
        attn_sel=attn["sel"],
        n_fwd=n_fwd,
        n_bwd=n_bwd,
        n_sel=n_sel,
        floor_fwd=floor["fwd"],
        floor_bwd=floor["bwd"],
        floor_sel=floor["sel"],
        source="learned",
    )
