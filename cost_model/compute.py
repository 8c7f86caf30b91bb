"""Compute time of operators and blocks: an analytic roofline with per-kind efficiencies.

One op on one GPU takes

    t(op) = max(flops / (peak(dtype) * eff_flops(kind)), bytes / (hbm_bw * eff_mem)) + floor

for its forward (`fwd_flops`, `fwd_bytes`) and, separately, for its share of the backward
(`bwd_flops`, `bwd_bytes`). `floor` is a per-kernel minimum (launch + tail) paid by every op
that does any work. Causal attention (`attrs` causal=True) does half the FLOPs on a GPU because
flash attention skips fully masked tiles; the traced FLOPs (FlopCounterMode convention, see
`meshplan.ir.flops`) count the full square, so the halving happens here, in time only.

Sharding scales an op's work, never its floor: under tensor parallelism an op runs on 1/tp of
its data when it is TP-sharded (`splits_with_tp`), under context parallelism every op of the
block runs on 1/cp of the sequence, and a micro-batch of `k` times the traced one does `k`
times the work (linear scaling in the micro-batch size; see `BlockCompute.times`). Because
`max(a*r, b*r) = r*max(a, b)`, the roofline time of an op scales exactly linearly with its
share of the data, so a block's time under any (tp, cp, micro-batch) is a weighted sum of a
few per-block aggregates computed once per GPU type (`block_compute`). That is what keeps the
planner's inner loop free of per-op Python.

Efficiencies are per GPU type (`KERNEL_EFFICIENCY`), each with the source or the published
runs that set it; docs/fidelity.md has the results against those runs.

Learned op times (issue 7, docs/op_latency.md): when the shipped learned latency model
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
import statistics
from dataclasses import dataclass

from meshplan.ir import DTYPE_BYTES, Block, GpuSpec, Op, OpKind, TensorMeta


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


# Per GPU type (`GpuSpec.name`). Where each number comes from:
# - attention: published kernel benchmarks, not fitted here. FlashAttention-2 (Dao 2023,
#   Fig. 5-6, head dim 128, causal, long sequences): A100 forward ~190-200 TFLOP/s of 312 and
#   forward+backward ~ 170-190 (backward ~0.55 of peak). FlashAttention-3 (Shah et al. 2024,
#   Fig. 1/4-5): on H100 FA2 reaches ~330-370 TFLOP/s forward (~0.35 of 989), cuDNN and FA3
#   ~500-650 forward, backward ~0.3-0.45. The H100 value sits between FA2 (PyTorch SDPA,
#   torchtitan) and cuDNN (Transformer Engine, Megatron-Core). V100 has no flash kernel with
#   bf16 tensor cores; the fp16 FlashAttention-1 paper (Dao et al. 2022) reports ~0.5 of peak
#   on A100 and V100-era fused kernels are assumed at the same fraction.
# - gemm: calibrated per GPU type on the published runs of that type
#   (benchmarks/fidelity.py, docs/fidelity.md lists the rows), within hardware.md's "70-90% of
#   peak for large GEMMs": A100 on Korthikanti et al. Table 5 (rows 1-8) and the 2020 Megatron
#   DGX A100 rows; H100 SXM on the Megatron-Core r0.8 table; V100 on the 2020 DGX-2 rows;
#   H100-96GB-500W (power capped) on the eager bf16 torchtitan rows.
# - memory: STREAM-like kernels reach ~0.8-0.9 of HBM bandwidth on A100/H100 (NVIDIA's
#   babelstream/nvbandwidth numbers); 0.8 is used for every type.
KERNEL_EFFICIENCY: dict[str, KernelEfficiency] = {
    "V100": KernelEfficiency(0.80, 0.50, 0.45, 0.8, "2020 Megatron DGX-2 rows"),
    "A100-80GB": KernelEfficiency(0.80, 0.62, 0.55, 0.8, "Korthikanti T5; 2020 DGX A100 rows"),
    "A100-40GB": KernelEfficiency(0.80, 0.62, 0.55, 0.8, "as A100-80GB"),
    "A100-PCIe": KernelEfficiency(0.80, 0.62, 0.55, 0.8, "as A100-80GB"),
    "H100": KernelEfficiency(0.75, 0.45, 0.38, 0.8, "Megatron-Core r0.8 table"),
    "H200": KernelEfficiency(0.75, 0.45, 0.38, 0.8, "as H100 (same GH100 compute)"),
    "H100-PCIe": KernelEfficiency(0.75, 0.45, 0.38, 0.8, "as H100"),
    "H100-96GB-500W": KernelEfficiency(0.62, 0.40, 0.33, 0.8, "torchtitan eager bf16 rows"),
}
# Any other type: hardware.md's low end for large GEMMs and the FA2-on-A100 attention fraction.
DEFAULT_EFFICIENCY = KernelEfficiency(0.75, 0.5, 0.45, 0.8, "assumption")

# Kept for callers that want one number: the default efficiencies.
GEMM_EFFICIENCY = DEFAULT_EFFICIENCY.gemm
MEMORY_EFFICIENCY = DEFAULT_EFFICIENCY.memory


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

# FLOPs of every other kind run on CUDA cores: on H100 SXM the non-tensor FP32 rate is 67
# TFLOP/s against 989 dense BF16 tensor-core TFLOP/s (NVIDIA H100 datasheet), about 7%.
# These kinds are almost always memory-bound, so the number rarely matters. Assumption.
VECTOR_FLOP_EFFICIENCY = 0.07

# Minimum time of one kernel: launch overhead and a short tail (CUDA launch latency is a few
# microseconds; assumption).
KERNEL_FLOOR_S = 5e-6

# Flash attention computes only the unmasked tiles of a causal mask: about half the FLOPs.
CAUSAL_FLOP_FRACTION = 0.5


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


def effective_flops(op: Op, *, backward: bool = False) -> float:
    """The FLOPs a GPU actually executes for `op` (causal attention halved)."""
    flops = op.bwd_flops if backward else op.fwd_flops
    if op.kind == OpKind.ATTENTION and op.attr("causal", False):
        return flops * CAUSAL_FLOP_FRACTION
    return float(flops)


def roofline_time(op: Op, gpu: GpuSpec, dtype: str, *, backward: bool = False) -> float:
    """Roofline time of `op` at its traced size, without the kernel floor (seconds)."""
    flops = effective_flops(op, backward=backward)
    nbytes = op.bwd_bytes if backward else op.fwd_bytes
    k = kernel_efficiency(gpu)
    if op.kind == OpKind.ATTENTION:
        eff = k.attention_bwd if backward else k.attention_fwd
    elif op.kind in TENSOR_CORE_KINDS:
        eff = k.gemm
    else:
        eff = VECTOR_FLOP_EFFICIENCY
    return max(flops / (gpu.peak(dtype) * eff), nbytes / (gpu.hbm_bandwidth * k.memory))


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
    return scale * roofline_time(op, gpu, dtype, backward=backward) + KERNEL_FLOOR_S


@dataclass(frozen=True, slots=True)
class BlockCompute:
    """Roofline aggregates of one block on one GPU type, by TP split class.

    `*_tp` sums ops that TP always shards, `*_sp` ops that only sequence parallelism shards.
    `sel_*` are the forward times of the ops selective recomputation repeats
    (`kept_by_selective` is False). `n_*` count the
    kernels (each pays `KERNEL_FLOOR_S`). Times are at the traced micro-batch, in seconds.
    `floor_*` are the per-call overheads in total (None: `n_* * KERNEL_FLOOR_S`; the learned
    model's own overheads otherwise) and `source` names the model that priced the block.
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

    def times(
        self, *, tp: int, cp: int, sequence_parallel: bool, scale: float
    ) -> tuple[float, float, float]:
        """(forward, backward, selective-recompute forward) seconds of one block instance.

        `scale` is micro_batch / traced micro_batch: costs grow linearly with the number of
        sequences (assumption: GEMM efficiency does not change with the batch dimension).
        """
        r_tp = scale / (tp * cp)
        r_sp = scale / ((tp if sequence_parallel else 1) * cp)
        fl_f = self.n_fwd * KERNEL_FLOOR_S if self.floor_fwd is None else self.floor_fwd
        fl_b = self.n_bwd * KERNEL_FLOOR_S if self.floor_bwd is None else self.floor_bwd
        fl_s = self.n_sel * KERNEL_FLOOR_S if self.floor_sel is None else self.floor_sel
        fwd = r_tp * self.fwd_tp + r_sp * self.fwd_sp + fl_f
        bwd = r_tp * self.bwd_tp + r_sp * self.bwd_sp + fl_b
        sel = r_tp * self.sel_tp + r_sp * self.sel_sp + fl_s
        return fwd, bwd, sel


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


def block_compute(block: Block, gpu: GpuSpec, dtype: str) -> BlockCompute:
    """Aggregate the op times of `block` on `gpu` (one pass over its ops): the learned model's
    when it covers `gpu` (`latency_model`), else the analytic roofline's."""
    model = latency_model(gpu)
    if model is not None:
        return _learned_block_compute(model, block, gpu, dtype)
    acc = {k: 0.0 for k in ("fwd_tp", "fwd_sp", "bwd_tp", "bwd_sp", "sel_tp", "sel_sp")}
    n_fwd = n_bwd = n_sel = 0
    for op in block.ops:
        cls = "tp" if splits_with_tp(op, block.kind) else "sp"
        if op.fwd_flops or op.fwd_bytes:
            t = roofline_time(op, gpu, dtype)
            acc["fwd_" + cls] += t
            n_fwd += 1
            if not kept_by_selective(op):
                acc["sel_" + cls] += t
                n_sel += 1
        if op.bwd_flops or op.bwd_bytes:
            acc["bwd_" + cls] += roofline_time(op, gpu, dtype, backward=True)
            n_bwd += 1
    return BlockCompute(**acc, n_fwd=n_fwd, n_bwd=n_bwd, n_sel=n_sel)


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
        return roofline_time(op, gpu, dtype, backward=backward), KERNEL_FLOOR_S
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
    from .calibrate import CPU_GEMM_SHAPES, GPU_GEMM_SHAPES

    on_cpu = gpu.name.upper().startswith("CPU")
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
    n_fwd = n_bwd = n_sel = 0
    anchor = host_gemm_anchor(model, gpu)
    parts = iter(_learned_parts(model, block, gpu, dtype))
    for op in block.ops:
        cls = "tp" if splits_with_tp(op, block.kind) else "sp"
        (w_f, o_f), (w_b, o_b) = next(parts), next(parts)
        if op.kind in TENSOR_CORE_KINDS:
            w_f, w_b = w_f * anchor, w_b * anchor
        if op.fwd_flops or op.fwd_bytes:
            acc["fwd_" + cls] += w_f
            floor["fwd"] += o_f
            n_fwd += 1
            if not kept_by_selective(op):
                acc["sel_" + cls] += w_f
                floor["sel"] += o_f
                n_sel += 1
        if op.bwd_flops or op.bwd_bytes:
            acc["bwd_" + cls] += w_b
            floor["bwd"] += o_b
            n_bwd += 1
    return BlockCompute(
        **acc,
        n_fwd=n_fwd,
        n_bwd=n_bwd,
        n_sel=n_sel,
        floor_fwd=floor["fwd"],
        floor_bwd=floor["bwd"],
        floor_sel=floor["sel"],
        source="learned",
    )
