"""The cost of lossless compression and quantization, and where they pay.

Design inputs: ZipCCL (Lin et al., "ZipCCL: Efficient Lossless Data Compression of
Communication Collectives for Accelerating LLM Training", arXiv 2604.27844, 2026), AGoQ (Lin
et al., "AGoQ: Activation and Gradient Quantization for Memory-Efficient Distributed Training
of LLMs", arXiv 2605.00539, 2026), and the runtime measurements in docs/compression.md
(`meshplan.runtime.codec`, `.compressed`, `.quantize`).

Codec speed (`CodecSpeed`): a codec call on `nbytes` raw bytes takes

    t = overhead + nbytes / throughput

- CPU (host codec, one core): measured (`CPU_CODEC`, docs/compression.md "Throughput").
- GPU: an ESTIMATE, nothing measured on a GPU yet. The codec is unfused eager torch, so a
  call moves `CODEC_TRAFFIC` bytes of HBM per raw byte (every op's inputs and outputs,
  counted with a TorchDispatchMode by `benchmarks/compression.py --only passes`) at the GPU's
  streaming bandwidth (`hbm_bandwidth * kernel_efficiency(gpu).memory`), and pays a fixed
  CPU-side cost per call: `CODEC_OPS` eager ops at `EAGER_OP_S` each plus `CODEC_SYNCS`
  host syncs at `SYNC_S` each. H100 (3.35 TB/s x 0.8 / 53.5): ~50 GB/s compress and ~61 GB/s
  decompress of bf16 on large chunks, but ~1.7 ms + ~1 ms per call, so a 2 MiB chunk codes
  at ~1.2 GB/s: chunks must be large (the chunk count is chosen per collective below).
- `meshplan.measure.codec_speed.measure_codec_speed()` measures both numbers on the current
  device (calibrate records them; pass them in `CommOptions.codec`).

Ratio (`predicted_ratio`): the measured codec ratio on the tiny model's tensors per dtype and
tensor kind (docs/compression.md "Ratios").

A compressed collective (`coded_time`), as the runtime runs it (`runtime.compressed`): per
rank, `codec_bytes` gives the raw bytes encoded and decoded (reductions go through an
all-to-all, decode and fp32 sum, then a coded all-gather), the wire carries S f(n) / r, and
the transfer is priced by the same function as the raw collective on the smaller size. With
c chunks each stage of a chunk takes

    enc = E / (c C) + o_C      x = transfer(S / (r c))      dec = D / (c D_s) + o_D
    T(c) = enc + x + dec + (c - 1) max(enc, x, dec)

(a 3-stage pipeline: the first chunk passes every stage, then one chunk leaves per slowest
stage). c = 1 is the sequential code-send-decode; the best c in powers of two is used.
Break-even (`break_even_bandwidth`, large messages, no overheads): sequential coding beats
the raw collective on links slower than B = f (1 - 1/r) / (e / C + d / D) (ZipCCL's
B/C + B/D < 1 - 1/r for e = d = f = 1), pipelined on links slower than B = f min(C/e, D/d).

Decisions (`choose`): each collective's time enters the step formula through sums and maxima
(monotone), so picking the fastest method per collective (raw, lossless, int8 gradients) is
exactly optimal for that formula. Lossless coding changes no numerics and may be used wherever
it is faster; int8 gradients (AGoQ) change numerics and are only considered when the user
enables them. Assumption: codec kernels overlap compute as transfers do (the simulator's eta);
their HBM contention with compute is not modelled (optimistic for overlapped DP traffic, exact
for traffic on the critical path).

Quantization: `block_quant_rel_rms` is the error proxy (uniform rounding of block-scaled
Gaussian values); `activation_bits` the AGoQ width per layer kind and stage (the same rule as
`runtime.quantize.agoq_bits`); `quantized_block_memory` shrinks a block's saved activations by
its ops' widths; `quantize_time` is the quantize (forward) + dequantize (backward) time.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshplan.ir import Block, GpuSpec, Op, OpKind

from .collectives import Collective, Path, bus_factor, collective_time
from .compute import kernel_efficiency, splits_with_tp
from .memory import BlockMemory

# -- codec speed ------------------------------------------------------------------------------

GB = 1e9

# HBM bytes moved per raw byte by one call (compress, decompress), counted over every aten op
# the codec dispatches (inputs + outputs, views excluded) on 1M and 4M-value gradient-like
# tensors: `python benchmarks/compression.py --only passes` (docs/compression.md "Passes").
CODEC_TRAFFIC: dict[str, tuple[float, float]] = {
    "bfloat16": (53.5, 43.6),
    "float16": (82.8, 85.8),
    "float32": (53.5, 43.4),
}
# Eager ops and host syncs (nonzero, item, tolist) per call (compress, decompress), same count.
CODEC_OPS: dict[str, tuple[int, int]] = {
    "bfloat16": (166, 89),
    "float16": (211, 154),
    "float32": (174, 96),
}
CODEC_SYNCS = (6, 4)
# int8 block quantization (`runtime.quantize.quantize` / `dequantize`, bf16 input): HBM bytes
# per raw byte and eager ops per call, same count.
QUANT_TRAFFIC = (20.1, 5.6)
QUANT_OPS = (15, 3)

# CPU-side cost of one eager op on a GPU: "~5-25 us of CPU-side work per op" (Python, pybind,
# dispatcher, cudaLaunchKernel; jiahuanglin.xyz gpu_kernel_serving lesson 18); measured here
# on CPU: 166 ops of compress on 4096 values take 1.2 ms, ~7 us an op. Assumption: 10 us.
EAGER_OP_S = 10e-6
# A host sync drains the launch queue, losing the CPU/GPU overlap once. Assumption: 20 us.
SYNC_S = 20e-6


@dataclass(frozen=True, slots=True)
class CodecSpeed:
    """How fast one rank codes: throughputs in raw bytes/s and a fixed cost per call (s)."""

    compress_bps: float
    decompress_bps: float
    compress_overhead_s: float = 0.0
    decompress_overhead_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.compress_bps <= 0 or self.decompress_bps <= 0:
            raise ValueError("CodecSpeed: throughputs must be positive")
        if self.compress_overhead_s < 0 or self.decompress_overhead_s < 0:
            raise ValueError("CodecSpeed: overheads must be non-negative")

    def encode_s(self, nbytes: float, calls: int = 1) -> float:
        """Seconds to compress `nbytes` raw bytes in `calls` calls."""
        return calls * self.compress_overhead_s + nbytes / self.compress_bps

    def decode_s(self, nbytes: float, calls: int = 1) -> float:
        """Seconds to decompress back to `nbytes` raw bytes in `calls` calls."""
        return calls * self.decompress_overhead_s + nbytes / self.decompress_bps


# Measured on the development machine, one core (docs/compression.md "Throughput": 32 MiB bf16
# tensor, median of 5; per-call cost: compress / decompress of 4096 values, 1.2 / 0.66 ms).
CPU_CODEC = CodecSpeed(
    0.068 * GB, 0.112 * GB, 1.2e-3, 0.66e-3, "measured: CPU, 1 core (docs/compression.md)"
)
# int8 block quantization on the same core: 8 MiB bf16, median of 5 (0.37 / 0.55 GB/s), per
# call 0.17 / 0.03 ms (4096 values).
CPU_QUANT = CodecSpeed(0.37 * GB, 0.55 * GB, 0.17e-3, 0.03e-3, "measured: CPU, 1 core")


def _stream_bps(gpu: GpuSpec) -> float:
    return gpu.hbm_bandwidth * kernel_efficiency(gpu).memory


def gpu_codec_speed(gpu: GpuSpec, dtype: str = "bfloat16") -> CodecSpeed:
    """ESTIMATED lossless codec speed on `gpu` (see the module docstring): streaming
    bandwidth / HBM bytes per raw byte, plus eager-op and sync overhead per call."""
    traffic = CODEC_TRAFFIC.get(dtype, CODEC_TRAFFIC["bfloat16"])
    ops = CODEC_OPS.get(dtype, CODEC_OPS["bfloat16"])
    bw = _stream_bps(gpu)
    return CodecSpeed(
        bw / traffic[0],
        bw / traffic[1],
        ops[0] * EAGER_OP_S + CODEC_SYNCS[0] * SYNC_S,
        ops[1] * EAGER_OP_S + CODEC_SYNCS[1] * SYNC_S,
        f"estimate: {gpu.name} HBM {gpu.hbm_bandwidth / GB:.0f} GB/s x "
        f"{kernel_efficiency(gpu).memory} / {traffic[0]}, {traffic[1]} bytes per byte",
    )


def gpu_quant_speed(gpu: GpuSpec) -> CodecSpeed:
    """ESTIMATED int8 block quantize / dequantize speed on `gpu` (as `gpu_codec_speed`)."""
    bw = _stream_bps(gpu)
    return CodecSpeed(
        bw / QUANT_TRAFFIC[0],
        bw / QUANT_TRAFFIC[1],
        QUANT_OPS[0] * EAGER_OP_S,
        QUANT_OPS[1] * EAGER_OP_S,
        f"estimate: {gpu.name} HBM / {QUANT_TRAFFIC[0]}, {QUANT_TRAFFIC[1]} bytes per byte",
    )


def _is_cpu(gpu: GpuSpec) -> bool:
    return gpu.name == "CPU"


def codec_speed(gpu: GpuSpec, dtype: str = "bfloat16", given: CodecSpeed | None = None):
    """The codec speed the planner assumes on `gpu`: `given` (measured by the user or by
    `meshplan.measure.codec_speed`), else the one `meshplan calibrate` measured on this GPU type (a
    cluster profile, `GpuSpec.codec_speed`), the CPU measurement for the host "CPU" device,
    else the GPU estimate."""
    if given is not None:
        return given
    if gpu.codec_speed is not None:  # measured by `meshplan calibrate` (a cluster profile)
        c, d, c_call, d_call = gpu.codec_speed
        return CodecSpeed(c, d, c_call, d_call, f"measured: {gpu.name} (meshplan calibrate)")
    return CPU_CODEC if _is_cpu(gpu) else gpu_codec_speed(gpu, dtype)


def quant_speed(gpu: GpuSpec) -> CodecSpeed:
    """int8 quantize/dequantize speed on `gpu` (CPU measured, GPU estimated)."""
    return CPU_QUANT if _is_cpu(gpu) else gpu_quant_speed(gpu)


# -- ratio ------------------------------------------------------------------------------------

TENSOR_KINDS = ("weights", "gradients", "activations", "optimizer")

# Lossless codec ratio (raw / coded, headers included) on the zoo's tiny model after 5 AdamW
# steps: docs/compression.md "Ratios" (`benchmarks/compression.py --only ratios`).
# "optimizer" is Adam's first moment (the second moment codes better, 1.60x in bf16).
MEASURED_RATIO: dict[tuple[str, str], float] = {
    ("bfloat16", "weights"): 1.487,
    ("bfloat16", "gradients"): 1.460,
    ("bfloat16", "activations"): 1.439,
    ("bfloat16", "optimizer"): 1.438,
    ("float16", "weights"): 1.170,
    ("float16", "gradients"): 1.177,
    ("float16", "activations"): 1.136,
    ("float16", "optimizer"): 1.207,
    ("float32", "weights"): 1.196,
    ("float32", "gradients"): 1.207,
    ("float32", "activations"): 1.180,
    ("float32", "optimizer"): 1.180,
}


def predicted_ratio(dtype: str, kind: str) -> float:
    """Predicted lossless ratio of a tensor of `kind` (weights, gradients, activations,
    optimizer) in `dtype`; 1.0 (no gain) for dtypes the codec does not handle."""
    if kind not in TENSOR_KINDS:
        raise ValueError(f"predicted_ratio: kind must be one of {TENSOR_KINDS}, got {kind!r}")
    return MEASURED_RATIO.get((dtype, kind), 1.0)


# int8 block-scaled gradients: 8 bits + a bf16 scale per 64 values (runtime.quantize).
QUANT_BLOCK = 64


def quantized_bits_per_value(bits: int, block: int = QUANT_BLOCK) -> float:
    """Bits a block-scaled value costs: its integer plus its share of the bf16 scale."""
    return bits + 16 / block


def int8_gradient_ratio(grad_bytes: int = 2) -> float:
    """Wire ratio of int8 block-scaled gradients over `grad_bytes`-byte gradients."""
    return 8 * grad_bytes / quantized_bits_per_value(8)


# -- quantization error proxy ------------------------------------------------------------------


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def block_quant_rel_rms(bits: int, block: int = QUANT_BLOCK, steps: int = 4000) -> float:
    """Relative RMS error of symmetric block quantization of i.i.d. Gaussian values: the
    scale is M / q (M = the block's largest |x|, q = 2^(bits-1) - 1), rounding to the nearest
    step leaves a uniform error of variance (M / q)^2 / 12, so the error RMS over the signal
    RMS (sigma = 1) is sqrt(E[M^2] / 12) / q, with P(M <= a) = (2 Phi(a) - 1)^block and
    E[M^2] = int_0^inf 2 a (1 - (2 Phi(a) - 1)^block) da (midpoint rule up to 12 sigma).
    8 bits, 64 values: ~0.6%; 4 bits: ~11%."""
    q = (1 << (bits - 1)) - 1
    if q < 1:
        raise ValueError(f"block_quant_rel_rms: bits must be >= 2, got {bits}")
    h = 12.0 / steps  # |x| beyond 12 sigma has probability < 1e-32
    m2 = 0.0
    for i in range(steps):
        a = (i + 0.5) * h
        m2 += 2 * a * (1 - (2 * _phi(a) - 1) ** block) * h
    return math.sqrt(m2 / 12) / q


# -- compressed collectives --------------------------------------------------------------------


def codec_bytes(kind: Collective, size: float, n: int) -> tuple[float, float]:
    """(bytes encoded, bytes decoded) per rank by the runtime's compressed `kind` over n ranks
    (`size` as in `collectives.collective_time`: the full buffer). All-reduce = reduce-scatter
    (encode and decode (n-1)/n) + all-gather of the reduced shard (encode 1/n once, decode
    (n-1)/n); p2p codes everything once each side."""
    if kind == Collective.P2P:
        return size, size
    if n <= 1:
        return 0.0, 0.0
    part = size * (n - 1) / n
    if kind == Collective.ALL_REDUCE:
        return part + size / n, 2 * part
    if kind == Collective.ALL_GATHER:
        return size / n, part
    return part, part  # reduce-scatter, all-to-all


def pipelined_time(enc: float, xfer: float, dec: float, chunks: int) -> float:
    """3-stage pipeline of `chunks` chunks whose per-chunk stage times are enc, xfer, dec:
    the first chunk passes every stage, the rest leave one per slowest stage."""
    return enc + xfer + dec + (chunks - 1) * max(enc, xfer, dec)


MAX_CHUNKS = 1024
MIN_CHUNK_BYTES = 64 * 1024  # below this the codec header (~120 bytes) and latency dominate


def coded_time(
    kind: Collective,
    size: float,
    n: int,
    transfer: Callable[[float], float],
    ratio: float,
    enc_speed: CodecSpeed,
    dec_speed: CodecSpeed | None = None,
    *,
    chunks: int | None = None,
) -> tuple[float, int]:
    """(seconds, chunks) of the coded collective: `transfer(bytes)` prices the raw collective
    of that size on its path; the chunk count is `chunks`, or the best power of two with
    chunks of at least MIN_CHUNK_BYTES (1 = sequential coding)."""
    dec_speed = dec_speed or enc_speed
    e_bytes, d_bytes = codec_bytes(kind, size, n)
    if size <= 0 or (n <= 1 and kind != Collective.P2P):
        return 0.0, 1

    def t(c: int) -> float:
        enc = enc_speed.encode_s(e_bytes / c)
        dec = dec_speed.decode_s(d_bytes / c)
        return pipelined_time(enc, transfer(size / (ratio * c)), dec, c)

    if chunks is not None:
        return t(chunks), chunks
    best, best_c, c = t(1), 1, 2
    while c <= MAX_CHUNKS and size / c >= MIN_CHUNK_BYTES:
        got = t(c)
        if got < best:
            best, best_c = got, c
        c *= 2
    return best, best_c


def break_even_bandwidth(
    kind: Collective, n: int, ratio: float, speed: CodecSpeed
) -> tuple[float, float]:
    """(sequential, pipelined): bus bandwidths (bytes/s) below which coding the collective
    pays, for large messages with no latency or per-call cost. Per byte of buffer the raw
    collective takes f / B; sequential coding e / C + f / (r B) + d / D, which is smaller iff
    B < f (1 - 1/r) / (e/C + d/D); pipelined max(e/C, f/(rB), d/D), smaller iff
    B < f min(C/e, D/d)."""
    e, d = codec_bytes(kind, 1.0, n)
    f = bus_factor(kind, n)
    if f <= 0 or ratio <= 1:
        return 0.0, 0.0
    c, dd = speed.compress_bps, speed.decompress_bps
    seq = f * (1 - 1 / ratio) / (e / c + d / dd)
    pipe = f * min(c / e if e else math.inf, dd / d if d else math.inf)
    return seq, pipe


# The traffic meshplan's runtime sends coded (`runtime.apply`, docs/compression.md): the
# data-parallel gradient reductions and FSDP2's weight all-gathers (DDP comm hook, FSDP2
# custom reduce-scatter / all-gather, or one coded all-reduce after backward). A plan codes
# nothing the runtime would then run raw; why each other axis stays raw:
RUNTIME_CODED_AXES = ("dp",)
RAW_AXIS_REASON = {
    "tp": "raw: DTensor's tensor-parallel redistributions have no codec hook",
    "cp": "raw: the runtime's context-parallel K/V exchange is not wired to the codec",
    "ep": "raw: the runtime's expert all-to-all is not wired to the codec",
    "pp": (
        "raw: torch.distributed.pipelining sends fixed-shape buffers (batched isend/irecv "
        "planned at shape inference), which variable-size coded buffers cannot use"
    ),
}


@dataclass(frozen=True, slots=True)
class CommOptions:
    """What the planner may do to the traffic of a plan.

    `lossless`: ZipCCL-style lossless coding wherever it is faster (no numerical change).
    `int8_gradients`: AGoQ-style int8 block-scaled gradient reduce-scatter / all-reduce with
    fp32 accumulation wherever it is faster (changes numerics: only when the user asks).
    `codec`: the codec speed to assume on every device (e.g. `CPU_CODEC` for host-side coding,
    or `meshplan.measure.codec_speed.measure_codec_speed()`); None: `codec_speed` per GPU type.
    `axes`: the traffic that may be coded, by mesh axis (default: what meshplan's runtime
    codes, `RUNTIME_CODED_AXES`; add "tp", "cp", "ep", "pp" for what-if pricing of an engine
    that codes those too)."""

    lossless: bool = True
    int8_gradients: bool = False
    codec: CodecSpeed | None = None
    axes: tuple[str, ...] = RUNTIME_CODED_AXES

    @property
    def active(self) -> bool:
        return self.lossless or self.int8_gradients


METHODS = ("raw", "lossless", "int8")


@dataclass(frozen=True, slots=True)
class CommChoice:
    """The priced options of one collective and the one taken (`method`)."""

    method: str
    raw_s: float
    lossless_s: float  # inf when not allowed
    int8_s: float  # inf when not allowed
    ratio: float  # wire ratio of the chosen method (1 for raw)
    chunks: int  # pipelined chunks of the chosen method

    @property
    def time_s(self) -> float:
        return min(self.raw_s, self.lossless_s, self.int8_s)


RAW = CommChoice("raw", 0.0, math.inf, math.inf, 1.0, 1)


def choose(
    kind: Collective,
    size: float,
    n: int,
    transfer: Callable[[float], float],
    options: CommOptions | None,
    gpu: GpuSpec,
    dtype: str,
    tensor: str,
    axis: str = "dp",
) -> CommChoice:
    """Price `kind` of `size` bytes over n ranks raw, losslessly coded and (gradient
    reductions, when allowed) int8-quantized, and take the fastest. Traffic on an `axis` the
    options do not code (`CommOptions.axes`) is raw."""
    raw = transfer(size) if size > 0 and (n > 1 or kind == Collective.P2P) else 0.0
    if options is None or not options.active or raw <= 0 or axis not in options.axes:
        return dataclasses.replace(RAW, raw_s=raw)
    lossless = int8 = math.inf
    ratio_l = predicted_ratio(dtype, tensor) if tensor in TENSOR_KINDS else 1.0
    chunks = 1
    if options.lossless and ratio_l > 1:
        lossless, chunks = coded_time(
            kind, size, n, transfer, ratio_l, codec_speed(gpu, dtype, options.codec)
        )
    reduces = kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)
    ratio_q = int8_gradient_ratio()
    if options.int8_gradients and tensor == "gradients" and reduces:
        q = quant_speed(gpu)
        int8, _ = coded_time(kind, size, n, transfer, ratio_q, q, chunks=1)
        if kind == Collective.ALL_REDUCE:  # the reduced shard is quantized again
            int8 += q.encode_s(size / n)
    best = min(raw, lossless, int8)
    if best == raw:
        return CommChoice("raw", raw, lossless, int8, 1.0, 1)
    if best == lossless:
        return CommChoice("lossless", raw, lossless, int8, ratio_l, chunks)
    return CommChoice("int8", raw, lossless, int8, ratio_q, 1)


# -- activation quantization -------------------------------------------------------------------

LAYER_KINDS = ("attention", "mlp", "norm", "embedding", "head", "other")

# Op -> AGoQ layer kind, from the op's module path relative to its unit (norm first: HF's
# `post_attention_layernorm` is a norm). Mirrors `runtime.quantize.layer_kind`, which sees
# module classes instead of paths.
_PATH_KINDS = (
    ("norm", re.compile(r"norm|(^|[._])ln", re.I)),
    ("attention", re.compile(r"attn|attention", re.I)),
    ("mlp", re.compile(r"mlp|moe|expert|ffn|feed_forward|feedforward", re.I)),
    ("embedding", re.compile(r"embed", re.I)),
    ("head", re.compile(r"lm_head|^output|^head", re.I)),
)


def op_layer_kind(op: Op) -> str:
    """The AGoQ layer kind of the module an op belongs to."""
    if op.kind == OpKind.NORM:
        return "norm"
    if op.kind == OpKind.EMBEDDING:
        return "embedding"
    if op.kind in (OpKind.LOSS, OpKind.SOFTMAX) and not op.module:
        return "head"  # the logits' softmax / cross-entropy at the model's root
    if op.kind in (OpKind.EXPERTS, OpKind.ROUTER):
        return "mlp"
    for kind, pattern in _PATH_KINDS:
        if pattern.search(op.module):
            return kind
    return "head" if not op.module else "other"


def activation_bits(kind: str, stage: int = 0, num_stages: int = 1) -> int | None:
    """AGoQ width of saved activations (None: kept exact). Norm inputs and the head's logits 8
    bits; MLP/MoE 4; attention 4 on stages holding more than half of stage 0's in-flight
    micro-batches under 1F1B (stage s of p holds p - s), else 8; embedding exact (it saves
    token indices); anything else 8. The same rule as `runtime.quantize.agoq_bits`."""
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"activation_bits: stage {stage} out of range for {num_stages} stages")
    if kind in ("norm", "head"):
        return 8
    if kind == "mlp":
        return 4
    if kind == "attention":
        return 4 if 2 * (num_stages - stage) > num_stages else 8
    if kind == "embedding":
        return None
    return 8


# The runtime keeps exact tensors under 1024 values and those under 1/8 of the saving module's
# input (per-row statistics), runtime.quantize.ActivationQuantizer(min_numel, stat_ratio).
MIN_QUANT_VALUES = 1024
STAT_RATIO = 8


def _value_bytes(op: Op) -> int:
    from meshplan.ir.graph import DTYPE_BYTES

    t = op.inputs[0] if op.inputs else (op.outputs[0] if op.outputs else None)
    return DTYPE_BYTES.get(t.dtype, 2) if t is not None else 2


def _op_factor(op: Op, bits: int | None) -> float:
    """Quantized / exact bytes of what `op` saves (1.0 when kept exact)."""
    if bits is None or op.saved_bytes <= 0:
        return 1.0
    vb = _value_bytes(op)
    ref = op.inputs[0].nbytes if op.inputs else 0
    if op.saved_bytes < MIN_QUANT_VALUES * vb or op.saved_bytes * STAT_RATIO < ref:
        return 1.0
    return quantized_bits_per_value(bits) / (8 * vb)


def quantized_block_memory(
    block: Block, memory: BlockMemory, stage: int = 0, num_stages: int = 1
) -> BlockMemory:
    """`memory` with its saved activations at the AGoQ widths of stage `stage` of
    `num_stages`: each op's saved bytes shrink by (bits + 16/64) / (8 * value bytes) (the
    op's input dtype), split into the TP-sharded and the SP-only part as `block_memory` does;
    the block input (all full recomputation keeps) at the width of the block's first op."""
    parts = {"tp": 0.0, "sp": 0.0, "ktp": 0.0, "ksp": 0.0}
    from .compute import kept_by_selective

    first = None
    for op in block.ops:
        bits = activation_bits(op_layer_kind(op), stage, num_stages)
        f = _op_factor(op, bits)
        cls = "tp" if splits_with_tp(op, block.kind) else "sp"
        parts[cls] += op.saved_bytes * f
        if kept_by_selective(op):
            kept = sum(t.nbytes for t in op.outputs)
            parts["k" + cls] += kept * (f if f < 1 else 1.0)
        if first is None and op.saved_bytes:
            first = f
    return dataclasses.replace(
        memory,
        saved_tp=round(parts["tp"]),
        saved_sp=round(parts["sp"]),
        selective_kept_tp=min(memory.selective_kept_tp, round(parts["ktp"])),
        selective_kept_sp=min(memory.selective_kept_sp, round(parts["ksp"])),
        input_bytes=round(memory.input_bytes * (first if first is not None else 1.0)),
    )


def quantize_time(saved_bytes: float, gpu: GpuSpec, calls: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds to quantize `saved_bytes` of activations in `calls` calls
    when saved and dequantize them in backward (streaming, `quant_speed`)."""
    if saved_bytes <= 0:
        return 0.0, 0.0
    q = quant_speed(gpu)
    return q.encode_s(saved_bytes, calls), q.decode_s(saved_bytes, calls)


def quantizable_ops(block: Block) -> Sequence[Op]:
    """Ops of `block` whose saved activations the AGoQ policy quantizes (on stage 0)."""
    return [
        op for op in block.ops if _op_factor(op, activation_bits(op_layer_kind(op), 0, 1)) < 1.0
    ]


def quantized_share(block: Block) -> tuple[float, int]:
    """(fraction of the block's saved bytes that are quantized, quantize calls per instance):
    what `quantize_time` is applied to."""
    total = sum(op.saved_bytes for op in block.ops)
    ops = quantizable_ops(block)
    if not total:
        return 0.0, 0
    return sum(op.saved_bytes for op in ops) / total, len(ops)


def tensor_of(kind: Collective) -> str:
    """The tensor a data-parallel collective moves: gradients are reduced, weights gathered."""
    if kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER):
        return "gradients"
    return "weights"


def coded_cross(
    collectives: Sequence[tuple[Collective, float, int]],
    repeats: Sequence[int],
    path: Path,
    shared_bandwidth: float | None,
    streams: int,
    options: CommOptions | None,
    gpu: GpuSpec,
    dtype: str,
) -> tuple[float, float, float | None] | None:
    """The coded variant (unshared, latency, per_stage) of cross-group DP traffic, in the form
    of `dp_traffic.CrossTraffic`: each collective takes its fastest coded method priced on
    `path` narrowed to its share of the shared link with one stage crossing (`streams` rings
    share it), which also picks its chunk count, and counted `repeats[i]` times; the shared
    link carries bytes / ratio; `latency` gathers the alphas and the coding time beyond the
    transfer (the pipeline's fill). None when coding is not allowed."""
    if options is None or not options.active:
        return None
    if shared_bandwidth is not None:  # one crossing stage: its rings share the link
        path = Path(min(path.bandwidth, shared_bandwidth / max(1, streams)), path.latency)
    unshared = latency = per = 0.0
    for (kind, size, n), times in zip(collectives, repeats, strict=True):
        if n <= 1 or size <= 0:
            continue
        tensor = tensor_of(kind)
        ch = choose(
            kind,
            size,
            n,
            lambda x, k=kind, n=n: collective_time(k, x, n, path),
            options,
            gpu,
            dtype,
            tensor,
        )
        coded = min(ch.lossless_s, ch.int8_s)
        if not math.isfinite(coded):
            coded, ratio = ch.raw_s, 1.0
        elif ch.lossless_s <= ch.int8_s:
            ratio = predicted_ratio(dtype, tensor)
        else:
            ratio = int8_gradient_ratio()
        unshared += times * coded
        extra = max(0.0, coded - collective_time(kind, size / ratio, n, path))
        latency += times * (path.latency + extra)
        if shared_bandwidth is not None:
            per += times * size * bus_factor(kind, n) * streams / (ratio * shared_bandwidth)
    return unshared, latency, (per if shared_bandwidth is not None else None)


# -- decisions recorded in the plan ------------------------------------------------------------


def _reason(ch: CommChoice) -> str:
    if ch.raw_s <= 0:
        return "no traffic"
    coded = min(ch.lossless_s, ch.int8_s)
    if not math.isfinite(coded):
        return "coding not allowed"
    if ch.method == "raw":
        return f"raw is fastest: coding would take {coded / ch.raw_s:.2f}x the raw time"
    what = "lossless coding" if ch.method == "lossless" else "int8 gradients"
    how = f", {ch.chunks} chunks pipelined" if ch.chunks > 1 else ", coded in sequence"
    return f"{what} saves {1 - ch.time_s / ch.raw_s:.0%} ({ch.ratio:.2f}x fewer bytes{how})"


def _axis_reason(pricer, axis: str) -> str:
    """Why traffic on `axis` is raw when the options do not code it ("" when they may)."""
    comm = pricer.comm
    if comm is None or not comm.active or axis in comm.axes:
        return ""
    return RAW_AXIS_REASON.get(axis, f"raw: {axis} traffic is not coded")


def _decision(group: str, kind: Collective, tensor: str, ch: CommChoice, reason: str = ""):
    from meshplan.ir.plan import CommDecision

    finite = lambda x: x if math.isfinite(x) else None  # noqa: E731
    return CommDecision(
        group=group,
        collective=str(kind),
        tensor=tensor,
        method=ch.method,
        raw_s=ch.raw_s,
        lossless_s=finite(ch.lossless_s),
        int8_s=finite(ch.int8_s),
        ratio=ch.ratio,
        chunks=ch.chunks,
        reason=reason or _reason(ch),
    )


def plan_decisions(pricer, parallel, stages) -> tuple:
    """Every collective group of a placed plan with its priced methods and the one taken
    (`ir.plan.CommDecision`s): TP / CP / EP inside each group used, the data-parallel traffic
    of each stage (inside one group, or across two: raw or coded as a whole, at the plan's
    number of crossing stages), and each pipeline boundary. `pricer` is the
    `pricer.Pricer` the plan was priced with (its `comm` options)."""
    from .collectives import group_path, intra_node_path

    p, costs, cluster = parallel, pricer.costs, pricer.cluster
    cp, ep, dp = p.cp, p.ep, p.dp
    hetero = bool(stages[0].group_tp)
    scale = p.micro_batch / costs.traced_micro_batch
    order = [g.name for g in cluster.groups]
    used = [g for g in order if any(g == r for st in stages for r, _ in st.replicas)]
    keys = dict.fromkeys(
        k for st in stages for k, _ in costs.composition(st.first_unit, st.last_unit)
    )
    out = []
    for name in used:
        g = pricer.groups[name]
        tp = stages[0].tp_of(name, p.tp)  # per-group TP: the group's own degree
        sp = bool(p.sequence_parallel) and tp > 1
        seen: set = set()
        for key in keys:
            facts = costs.facts[key]
            if tp > 1:
                intra = intra_node_path(cluster, g)
                for _, kind, size in pricer.tp_collectives(
                    facts, tp=tp, cp=cp, ep=ep, sp=sp, scale=scale
                ):
                    if ("tp", kind, size) in seen:
                        continue
                    seen.add(("tp", kind, size))
                    ch = pricer.comm_choice(kind, size, tp, intra, g.gpu, "activations", "tp")
                    why = _axis_reason(pricer, "tp")
                    out.append(_decision(f"tp in {name}", kind, "activations", ch, why))
            if cp > 1 and facts.kv_bytes and ("cp", key) not in seen:
                seen.add(("cp", key))
                path = group_path(cluster, g, cp, max(1, g.domain_gpus // tp))
                moved = pricer.cp_collectives(facts, p.stage(tp), scale)
                listed = dict.fromkeys((kind, size) for _, kind, size in moved)  # each once
                for kind, size in listed:
                    ch = pricer.comm_choice(kind, size, cp, path, g.gpu, "activations", "cp")
                    why = _axis_reason(pricer, "cp")
                    out.append(_decision(f"cp in {name}", kind, "activations", ch, why))
            if ep > 1 and facts.a2a_bytes and ("ep", key) not in seen:
                seen.add(("ep", key))
                size = facts.a2a_bytes * scale / (cp * (tp if sp else 1))
                path = group_path(cluster, g, ep, max(1, g.domain_gpus // (tp * cp)))
                kind = Collective.ALL_TO_ALL
                ch = pricer.comm_choice(kind, size, ep, path, g.gpu, "activations", "ep")
                why = _axis_reason(pricer, "ep")
                out.append(_decision(f"ep in {name}", kind, "activations", ch, why))
    crossing = sum(1 for st in stages if len(st.replicas) > 1)
    tp, cfg = p.tp, p.stage()
    for st in stages:
        comp = costs.composition(st.first_unit, st.last_unit)
        groups = [g for g in order if g in dict(st.replicas)]
        if hetero:
            out += _hetero_decisions(pricer, comp, st, groups, p)
            continue
        traffic = pricer.dp_traffic(comp, cfg, dp=dp, zero=p.zero)
        if len(groups) == 1:
            chosen = pricer.dp_single_choices(traffic, groups[0], cfg)
            for (kind, _, _), ch in zip(traffic.collectives, chosen):
                out.append(
                    _decision(f"dp stage {st.index} in {groups[0]}", kind, tensor_of(kind), ch)
                )
            continue
        for i, a in enumerate(groups):
            for b in groups[i + 1 :]:
                out += _cross_decisions(pricer, traffic, st.index, a, b, cfg, crossing)
    streams = tp * cp * dp
    for s in range(len(stages) - 1):
        bkey = costs.boundary_key(stages[s].last_unit)
        for a, _ in stages[s].replicas:
            for b, _ in stages[s + 1].replicas:
                if hetero and a != b:
                    continue  # per-group TP: a pipeline stays inside its group
                tp_a = stages[s].tp_of(a, p.tp)
                size = costs.facts[bkey].output_bytes * scale / (cp * tp_a)
                ch = pricer.p2p_choice(size, a, b, streams)
                group = f"pp boundary {s} {a}->{b}"
                why = _axis_reason(pricer, "pp")
                out.append(_decision(group, Collective.P2P, "activations", ch, why))
    return tuple(out)


def _hetero_decisions(pricer, comp, st, groups, p) -> list:
    """Per-group TP: the stage's piece-wise gradient all-reduces across its groups
    (`dp_traffic.DataParallelTraffic.hetero_dp_traffic`), raw (the runtime does not code
    them); one record per group, since each group's ranks run their own number of pieces."""
    tps = {g: st.tp_of(g, p.tp) for g in groups}
    traffic = pricer.hetero_dp_traffic(comp, p, tps)
    ct = pricer.dp_cross_hetero(comp, groups[0], groups[-1], p, tps)
    ch = CommChoice("raw", ct.unshared, math.inf, math.inf, 1.0, 1)
    out = []
    for g in groups:
        for kind, size, _ in traffic[g].collectives[:1]:
            why = (
                f"per-group tp: {len(traffic[g].collectives)} piece all-reduce(s) of "
                f"{size / 2**20:.1f} MiB per rank in {g} (tp={tps[g]}); not coded"
            )
            group = f"dp stage {st.index} across {'+'.join(groups)}"
            out.append(_decision(group, kind, tensor_of(kind), ch, why))
    return out


def _cross_decisions(pricer, traffic, stage, a, b, cfg, crossing) -> list:
    """Cross-group DP traffic is raw or coded as a whole (`dp_traffic.CrossTraffic`); each
    collective's record shows its own methods priced on the unshared path."""
    tp = cfg.tp
    ct = pricer.dp_cross(traffic, a, b, cfg)
    raw = ct.raw_time(crossing)
    coded = ct.coded.raw_time(crossing) if ct.coded is not None else math.inf
    use = coded < raw
    ga, gb = pricer.groups[a], pricer.groups[b]
    gpu = ga.gpu if ga.gpu.hbm_bandwidth <= gb.gpu.hbm_bandwidth else gb.gpu
    path = pricer.cross_path(
        a,
        b,
        max(1, min(max((n for _, _, n in traffic.collectives), default=1), ga.domain_gpus // tp)),
        max(1, min(max((n for _, _, n in traffic.collectives), default=1), gb.domain_gpus // tp)),
    )
    flat = path.path(tp * max(1, crossing))  # each ring's share of a shared link
    if math.isfinite(coded):
        why = (
            f"{'coded' if use else 'raw'} as a whole across the link: coded {coded * 1e3:.3f} ms "
            f"vs raw {raw * 1e3:.3f} ms with {max(1, crossing)} stage(s) crossing"
        )
    else:
        why = "coding not allowed"
    out = []
    for kind, size, n in traffic.collectives:
        ch = choose(
            kind,
            size,
            n,
            lambda x, k=kind, n=n: collective_time(k, x, n, flat),
            pricer.comm,
            gpu,
            pricer.dtype,
            tensor_of(kind),
        )
        best = "lossless" if ch.lossless_s <= ch.int8_s else "int8"
        if use and math.isfinite(min(ch.lossless_s, ch.int8_s)):
            ratio = (
                predicted_ratio(pricer.dtype, tensor_of(kind))
                if best == "lossless"
                else (int8_gradient_ratio())
            )
            ch = dataclasses.replace(ch, method=best, ratio=ratio)
        else:
            ch = dataclasses.replace(ch, method="raw", ratio=1.0, chunks=1)
        out.append(_decision(f"dp stage {stage} across {a}+{b}", kind, tensor_of(kind), ch, why))
    return out


QUANT_MODES = ("off", "auto", "activations", "gradients")


def quantization_plan(parallel, stages, mode: str, decisions: Sequence = ()):
    """The `ir.plan.QuantizationPlan` of a plan: AGoQ widths per stage and layer kind when its
    activations are quantized, int8 gradients when a DP decision took them, the error proxy."""
    from meshplan.ir.plan import QuantizationPlan

    if mode not in QUANT_MODES:
        raise ValueError(f"quantize must be one of {QUANT_MODES}, got {mode!r}")
    pp = len(stages)
    bits: tuple = ()
    if parallel.quantize_activations:
        bits = tuple(
            (s, tuple((k, activation_bits(k, s, pp)) for k in LAYER_KINDS)) for s in range(pp)
        )
    grads = 8 if any(d.method == "int8" for d in decisions) else None
    if mode == "off":
        return QuantizationPlan()
    parts = []
    if mode in ("auto", "activations"):
        parts.append(
            "activations quantized (the fastest plan that fits uses them)"
            if bits
            else "activations kept exact (no faster plan with quantized activations)"
        )
    if mode in ("auto", "gradients"):
        parts.append(
            "int8 gradients where faster than raw and lossless"
            if grads
            else "gradients exact (int8 did not pay on any DP collective)"
        )
    return QuantizationPlan(
        mode=mode,
        activation_bits=bits,
        gradient_bits=grads,
        error=tuple((b, block_quant_rel_rms(b)) for b in (4, 8)),
        reason="; ".join(parts),
    )
