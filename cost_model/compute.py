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

Every constant below is an assumption to be calibrated in issue 3 unless a citation says
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.ir import Block, GpuSpec, Op, OpKind

# Fraction of the dense tensor-core peak that large GEMMs reach. hardware.md: "Measured
# large-GEMM throughput is typically 70-90% of peak; small GEMMs far less". 0.75 sits at the
# low end because training GEMMs are not all large. Assumption, calibrated in issue 3.
GEMM_EFFICIENCY = 0.75

# Kinds whose FLOPs run on tensor cores (matrix multiplies and fused attention).
TENSOR_CORE_KINDS = frozenset({OpKind.MATMUL, OpKind.ATTENTION, OpKind.EXPERTS})

# FLOPs of every other kind run on CUDA cores: on H100 SXM the non-tensor FP32 rate is 67
# TFLOP/s against 989 dense BF16 tensor-core TFLOP/s (NVIDIA H100 datasheet), about 7%.
# These kinds are almost always memory-bound, so the number rarely matters. Assumption.
VECTOR_FLOP_EFFICIENCY = 0.07

# Fraction of the HBM bandwidth that streaming (memory-bound) kernels reach. Assumption,
# calibrated in issue 3 (STREAM-like kernels reach ~80-90% on A100/H100).
MEMORY_EFFICIENCY = 0.8

# Minimum time of one kernel: launch overhead and a short tail. Assumption (CUDA launch
# latency is a few microseconds), calibrated in issue 3.
KERNEL_FLOOR_S = 5e-6

# Flash attention computes only the unmasked tiles of a causal mask: about half the FLOPs.
CAUSAL_FLOP_FRACTION = 0.5

# Kinds that selective recomputation (Korthikanti et al. 2022, "Reducing Activation
# Recomputation in Large Transformer Models") recomputes during the backward pass.
SELECTIVE_RECOMPUTE_KINDS = frozenset({OpKind.ATTENTION, OpKind.SOFTMAX})

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
    eff = GEMM_EFFICIENCY if op.kind in TENSOR_CORE_KINDS else VECTOR_FLOP_EFFICIENCY
    return max(flops / (gpu.peak(dtype) * eff), nbytes / (gpu.hbm_bandwidth * MEMORY_EFFICIENCY))


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
    `sel_*` are the forward times of the ops selective recomputation repeats. `n_*` count the
    kernels (each pays `KERNEL_FLOOR_S`). Times are at the traced micro-batch, in seconds.
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

    def times(
        self, *, tp: int, cp: int, sequence_parallel: bool, scale: float
    ) -> tuple[float, float, float]:
        """(forward, backward, selective-recompute forward) seconds of one block instance.

        `scale` is micro_batch / traced micro_batch: costs grow linearly with the number of
        sequences (assumption: GEMM efficiency does not change with the batch dimension).
        """
        r_tp = scale / (tp * cp)
        r_sp = scale / ((tp if sequence_parallel else 1) * cp)
        fwd = r_tp * self.fwd_tp + r_sp * self.fwd_sp + self.n_fwd * KERNEL_FLOOR_S
        bwd = r_tp * self.bwd_tp + r_sp * self.bwd_sp + self.n_bwd * KERNEL_FLOOR_S
        sel = r_tp * self.sel_tp + r_sp * self.sel_sp + self.n_sel * KERNEL_FLOOR_S
        return fwd, bwd, sel


def block_compute(block: Block, gpu: GpuSpec, dtype: str) -> BlockCompute:
    """Aggregate the roofline times of `block`'s ops on `gpu` (one pass over its ops)."""
    acc = {k: 0.0 for k in ("fwd_tp", "fwd_sp", "bwd_tp", "bwd_sp", "sel_tp", "sel_sp")}
    n_fwd = n_bwd = n_sel = 0
    for op in block.ops:
        cls = "tp" if splits_with_tp(op, block.kind) else "sp"
        if op.fwd_flops or op.fwd_bytes:
            t = roofline_time(op, gpu, dtype)
            acc["fwd_" + cls] += t
            n_fwd += 1
            if op.kind in SELECTIVE_RECOMPUTE_KINDS:
                acc["sel_" + cls] += t
                n_sel += 1
        if op.bwd_flops or op.bwd_bytes:
            acc["bwd_" + cls] += roofline_time(op, gpu, dtype, backward=True)
            n_bwd += 1
    return BlockCompute(**acc, n_fwd=n_fwd, n_bwd=n_bwd, n_sel=n_sel)
