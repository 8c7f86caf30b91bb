"""Features of one IR op on one device, for the learned latency model (`learned.py`).

A feature vector describes *what the op is* (kind, aten packet and its class, direction,
dtype), *how big it is* (log FLOPs, log bytes, arithmetic intensity, GEMM M/N/K and batch,
alignment to 64, output / input sizes, wave count and last-wave occupancy), *how it sits on
the device* (log of the roofline's compute and memory times, bytes relative to L2 / L3) and
*what the device is* (log peak FLOP/s for the op's dtype, memory and cache bandwidth, cores
or SMs, cache sizes, clock). Everything numeric is log2-scaled (CDMPP log-normalises device
features the same way); the model standardises columns with statistics it stores.

Features are a pure function of the op's IR fields (`Op.kind/target/inputs/outputs/attrs`
and the direction's FLOPs and bytes) and a `DeviceFeatures`, so the planner can compute them
for any traced op: nothing here runs the op.

`physics_time` is the roofline the learned efficiency divides into: no efficiency factors,
no kernel floor, the best bandwidth the device has shown (cache bandwidth on a profiled CPU,
HBM bandwidth for a datasheet GPU) and the measured (or datasheet) peak for the dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from meshplan.ir import GpuSpec, Op, OpKind

# Flash attention (GPU and torch's CPU flash kernel) skips fully masked tiles: about half the
# FLOPs of causal attention run (same assumption as compute.CAUSAL_FLOP_FRACTION).
CAUSAL_FLOP_FRACTION = 0.5

# Output tile of one GEMM work unit, for the wave count: 128x128 on GPUs (cuBLAS / CUTLASS
# typical), 64x64 on CPUs (a oneDNN/MKL block fitting L2). Assumptions, not measured.
GPU_TILE = 128
CPU_TILE = 64

# aten packets with their own one-hot column (anything else falls in "other").
PACKETS: tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "attention",
    "embedding",
    "index_select",
    "scatter",
    "native_layer_norm",
    "_softmax",
    "_log_softmax",
    "nll_loss_forward",
    "cat",
    "clone",
    "_to_copy",
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "rsqrt",
    "silu",
    "gelu",
    "mean",
    "sum",
    "topk",
    "cumsum",
    "where",
    "eq",
    "lt",
    "full",
    "arange",
    "new_zeros",
    "scalar_tensor",
)
# Coarser classes of packets that behave alike, so that a packet the training data never saw
# (e.g. `sub` when only `add` and `mul` were profiled) still shares a column with its kin.
OP_CLASSES: dict[str, tuple[str, ...]] = {
    "gemm": ("mm", "addmm", "bmm", "matmul", "baddbmm"),
    "attention": ("attention",),
    "unary": ("silu", "gelu", "rsqrt", "pow", "neg", "exp", "tanh", "sigmoid", "relu", "sqrt"),
    "binary": ("add", "sub", "mul", "div", "where", "eq", "ne", "lt", "gt", "le", "ge"),
    "reduce": ("mean", "sum", "cumsum", "topk", "amax", "max", "min", "argmax"),
    "softmax": ("_softmax", "_log_softmax", "softmax", "log_softmax"),
    "norm": ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"),
    "gather": ("embedding", "index_select", "gather", "nll_loss_forward"),
    "scatter": ("scatter", "scatter_add", "index_add", "index_put", "embedding_dense_backward"),
    "copy": ("clone", "_to_copy", "copy_", "cat", "contiguous"),
    "create": ("full", "arange", "new_zeros", "zeros", "scalar_tensor", "new_full", "ones"),
}
_CLASS_OF = {p: c for c, ps in OP_CLASSES.items() for p in ps}
CLASSES: tuple[str, ...] = (*OP_CLASSES, "other")
KINDS: tuple[str, ...] = tuple(k.value for k in OpKind)
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_FLOAT = frozenset({"float32", "bfloat16", "float16", "float64"})
_GEMM_PACKETS = frozenset({"mm", "addmm", "bmm", "matmul", "baddbmm", "attention"})


@dataclass(frozen=True, slots=True)
class DeviceFeatures:
    """The device facts the features and the roofline read.

    Built from a profiled `DeviceDescriptor` (measured peaks) by `from_descriptor`, or from a
    datasheet `GpuSpec` by `from_spec` (caches and clock unknown: 0).
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    mem_bandwidth: float
    roof_bandwidth: float  # bandwidth of the roofline: the best the device reaches
    cores: int
    l2_bytes: int
    l3_bytes: int
    clock_hz: float
    is_gpu: bool

    def peak(self, dtype: str) -> float:
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        for alt in {"bfloat16": ("float16",), "float16": ("bfloat16",)}.get(dtype, ()):
            if alt in table:
                return table[alt]
        return table.get("float32", max(table.values()))

    @classmethod
    def from_descriptor(cls, desc) -> DeviceFeatures:
        """From a profiled device (`cost_model.dataset.DeviceDescriptor`)."""
        return cls(
            name=desc.name,
            peak_flops=tuple(desc.peak_flops),
            mem_bandwidth=desc.mem_bandwidth,
            roof_bandwidth=max(desc.cache_bandwidth, desc.mem_bandwidth),
            cores=desc.cores,
            l2_bytes=desc.l2_bytes,
            l3_bytes=desc.l3_bytes,
            clock_hz=desc.clock_hz,
            is_gpu=desc.backend == "cuda",
        )

    @classmethod
    def from_spec(cls, gpu: GpuSpec) -> DeviceFeatures:
        """From datasheet numbers only (a device nobody profiled)."""
        return cls(
            name=gpu.name,
            peak_flops=tuple(gpu.peak_flops),
            mem_bandwidth=gpu.hbm_bandwidth,
            roof_bandwidth=gpu.hbm_bandwidth,
            cores=gpu.sms,
            l2_bytes=0,
            l3_bytes=0,
            clock_hz=0.0,
            is_gpu=gpu.name != "CPU",
        )


def op_dtype(op: Op, default: str = "float32") -> str:
    """The op's compute dtype: its first floating-point tensor's (else `default`)."""
    for t in (*op.inputs, *op.outputs):
        if t.dtype in _FLOAT:
            return t.dtype
    return default


def packet(target: str) -> str:
    """`aten.mm.default` -> `mm`; every fused attention kernel -> `attention`."""
    if "attention" in target:
        return "attention"
    parts = target.split(".")
    return parts[1] if len(parts) > 1 else target


def effective_flops(op: Op, backward: bool) -> float:
    """FLOPs the kernel executes (causal attention halved)."""
    flops = op.bwd_flops if backward else op.fwd_flops
    if op.kind == OpKind.ATTENTION and op.attr("causal", False):
        return flops * CAUSAL_FLOP_FRACTION
    return float(flops)


# Forward ops whose IR bytes (every input + every output, `meshplan.ir.flops.op_bytes`)
# overstate the traffic a kernel must do: gathers read only the rows they return (an
# embedding counts its whole table), creation ops read nothing (`new_zeros` counts the
# tensor it takes its dtype from).
_GATHERS = frozenset({"embedding", "index_select", "nll_loss_forward", "gather"})
_CREATIONS = frozenset(
    {
        "new_zeros",
        "new_empty",
        "new_full",
        "zeros",
        "full",
        "arange",
        "scalar_tensor",
        "ones",
        "zeros_like",
        "full_like",
    }
)


def essential_bytes(op: Op, backward: bool = False) -> float:
    """Bytes the kernel must move at least: the IR bytes, less for gathers and creations."""
    nbytes = float(op.bwd_bytes if backward else op.fwd_bytes)
    if backward:
        return nbytes
    p = packet(op.target)
    out = sum(t.nbytes for t in op.outputs)
    if p in _CREATIONS:
        return min(nbytes, out)
    if p in _GATHERS:
        index = sum(t.nbytes for t in op.inputs if t.dtype not in _FLOAT)
        return min(nbytes, 2 * out + index)
    return nbytes


def physics_time(
    op: Op, dev: DeviceFeatures, backward: bool = False, dtype: str | None = None
) -> float:
    """Roofline time with no efficiency factor and no floor: a lower bound (seconds)."""
    dt = op_dtype(op, dtype or "float32")
    nbytes = essential_bytes(op, backward)
    return max(effective_flops(op, backward) / dev.peak(dt), nbytes / dev.roof_bandwidth, 1e-12)


def gemm_dims(op: Op) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a GEMM-like op; zeros for everything else.

    Attention reads as batch = b * heads, M = query length, N = key length, K = head dim.
    """
    p = packet(op.target)
    ins = [t.shape for t in op.inputs]
    try:
        if p == "mm" and len(ins) >= 2:
            (m, k), (_, n) = ins[0], ins[1]
            return 1, m, n, k
        if p == "addmm" and len(ins) >= 3:
            (m, k), (_, n) = ins[1], ins[2]
            return 1, m, n, k
        if p in ("bmm", "baddbmm") and len(ins) >= 2:
            a, b = ins[-2], ins[-1]
            return a[0], a[1], b[2], a[2]
        if p == "attention" and len(ins) >= 2 and len(ins[0]) == 4:
            b, h, s, d = ins[0]
            return b * h, s, ins[1][2], d
    except (ValueError, IndexError):
        pass
    return 0, 0, 0, 0


def _lg(x: float) -> float:
    return math.log2(x) if x > 0 else -1.0


def feature_names() -> tuple[str, ...]:
    """Column names of `op_features`, in order."""
    return _NAMES


_NUMERIC = (
    "backward",
    "lg_flops",
    "lg_bytes",
    "lg_intensity",
    "lg_t_compute",
    "lg_t_memory",
    "lg_t_physics",
    "compute_minus_memory",
    "lg_batch",
    "lg_m",
    "lg_n",
    "lg_k",
    "m_mis64",
    "n_mis64",
    "k_mis64",
    "m_small",
    "n_small",
    "k_small",
    "lg_waves",
    "last_wave",
    "lg_out_numel",
    "lg_in_numel",
    "lg_last_dim",
    "last_mis16",
    "rank",
    "n_inputs",
    "broadcast",
    "lg_rows",
    "causal",
    "lg_gqa",
    "lg_bytes_over_l2",
    "lg_bytes_over_l3",
    "fits_l2",
    "dev_lg_peak",
    "dev_lg_mem_bw",
    "dev_lg_roof_bw",
    "dev_lg_cores",
    "dev_lg_l2",
    "dev_lg_l3",
    "dev_lg_clock",
    "dev_is_gpu",
)
_NAMES: tuple[str, ...] = (
    tuple(f"kind={k}" for k in KINDS)
    + tuple(f"packet={p}" for p in PACKETS)
    + ("packet=other",)
    + tuple(f"class={c}" for c in CLASSES)
    + tuple(f"dtype={d}" for d in DTYPES)
    + ("dtype=other",)
    + _NUMERIC
)


def op_features(
    op: Op, dev: DeviceFeatures, backward: bool = False, dtype: str | None = None
) -> np.ndarray:
    """The feature vector of `op` (one direction) on `dev`, float64, always finite."""
    dt = op_dtype(op, dtype or "float32")
    p = packet(op.target)
    flops = effective_flops(op, backward)
    nbytes = float(op.bwd_bytes if backward else op.fwd_bytes)
    peak = dev.peak(dt)
    t_c = flops / peak
    t_m = essential_bytes(op, backward) / dev.roof_bandwidth
    t_phys = max(t_c, t_m, 1e-12)

    onehot = np.zeros(len(KINDS) + len(PACKETS) + 1 + len(CLASSES) + len(DTYPES) + 1)
    onehot[KINDS.index(op.kind.value)] = 1.0
    off = len(KINDS)
    onehot[off + (PACKETS.index(p) if p in PACKETS else len(PACKETS))] = 1.0
    off += len(PACKETS) + 1
    onehot[off + CLASSES.index(_CLASS_OF.get(p, "other"))] = 1.0
    off += len(CLASSES)
    onehot[off + (DTYPES.index(dt) if dt in DTYPES else len(DTYPES))] = 1.0

    b, m, n, k = gemm_dims(op)
    tile = GPU_TILE if dev.is_gpu else CPU_TILE
    tiles = b * math.ceil(m / tile) * math.ceil(n / tile) if m and n else 0
    waves = tiles / max(dev.cores, 1)
    last_wave = waves / math.ceil(waves) if waves > 0 else 0.0

    out = op.outputs[0] if op.outputs else None
    in_numels = [t.numel for t in op.inputs] or [0]
    first = op.inputs[0].shape if op.inputs else (out.shape if out else ())
    last_dim = first[-1] if first else 1
    heads, kv = op.attr("heads", 0) or 0, op.attr("kv_heads", 0) or 0

    l2 = dev.l2_bytes or 0
    l3 = dev.l3_bytes or 0
    numeric = [
        float(backward),
        _lg(flops + 1),
        _lg(nbytes + 1),
        _lg((flops + 1) / (nbytes + 1)),
        _lg(t_c) if t_c > 0 else -40.0,
        _lg(t_m) if t_m > 0 else -40.0,
        _lg(t_phys),
        (_lg(t_c) if t_c > 0 else -40.0) - (_lg(t_m) if t_m > 0 else -40.0),
        _lg(b),
        _lg(m),
        _lg(n),
        _lg(k),
        float(m > 0 and m % 64 != 0),
        float(n > 0 and n % 64 != 0),
        float(k > 0 and k % 64 != 0),
        float(0 < m < 32),
        float(0 < n < 32),
        float(0 < k < 32),
        _lg(waves),
        last_wave,
        _lg(out.numel if out else 0),
        _lg(max(in_numels)),
        _lg(last_dim),
        float(last_dim % 16 != 0),
        float(len(first)),
        float(len(op.inputs)),
        float(min(in_numels) < max(in_numels)),
        _lg(max(in_numels) / max(last_dim, 1)),
        float(bool(op.attr("causal", False))),
        _lg(heads / kv) if heads and kv else 0.0,
        max(-12.0, min(12.0, _lg(nbytes / l2))) if l2 and nbytes else 0.0,
        max(-12.0, min(12.0, _lg(nbytes / l3))) if l3 and nbytes else 0.0,
        float(bool(l2) and nbytes <= l2),
        _lg(peak),
        _lg(dev.mem_bandwidth),
        _lg(dev.roof_bandwidth),
        _lg(dev.cores),
        _lg(l2),
        _lg(l3),
        _lg(dev.clock_hz),
        float(dev.is_gpu),
    ]
    vec = np.concatenate([onehot, np.asarray(numeric, dtype=np.float64)])
    return np.nan_to_num(vec, nan=0.0, posinf=40.0, neginf=-40.0)
