"""Device types: a GPU's datasheet figures (`GpuSpec`), a kind of link (`LinkTier`,
`LinkKind`) and the training precisions a GPU can run (`PRECISIONS`, `precision_problem`).

The bottom of the cluster description: `hardware` (the spec table) and `cluster` (groups,
topology, profiles) both stand on it. Units as in `meshplan.ir.cluster`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LinkKind(enum.StrEnum):
    NVLINK = "nvlink"
    PCIE = "pcie"
    INFINIBAND = "infiniband"
    ROCE = "roce"
    ETHERNET = "ethernet"
    WAN = "wan"
    LOOPBACK = "loopback"  # processes on one CPU host (gloo over shared memory / TCP loopback)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet numbers of one accelerator type (dense, no sparsity).

    `peak_flops` maps a dtype name ("bfloat16", "float16", "float32", "float8_e4m3fn") to
    FLOP/s. `source` cites where the numbers come from.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    sms: int  # streaming multiprocessors (or compute units / cores)
    nvlink_bandwidth: float  # bytes/s per GPU, one direction; 0 when the GPU has none
    source: str = ""
    # Fraction of the dense peak that GEMMs reached when `meshplan calibrate` measured this GPU
    # type (`ClusterProfile.gemm_efficiency`); None: the cost model's table value.
    gemm_efficiency: float | None = None
    # The lossless codec's speed measured by `meshplan calibrate` on this type: (compress,
    # decompress) raw bytes/s and (compress, decompress) seconds per call; None: the cost
    # model's estimate (`meshplan.cost_model.compression.codec_speed`).
    codec_speed: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.hbm_bandwidth <= 0:
            raise ValueError(f"GpuSpec {self.name}: memory and bandwidth must be positive")
        if not self.peak_flops:
            raise ValueError(f"GpuSpec {self.name}: no peak FLOP/s given")
        if "float32" not in dict(self.peak_flops):
            raise ValueError(
                f"GpuSpec {self.name}: peak_flops needs float32 (the CUDA-core FP32 rate, "
                "where every op but the matmuls runs)"
            )
        if self.gemm_efficiency is not None and not self.gemm_efficiency > 0:
            raise ValueError(
                f"GpuSpec {self.name}: gemm_efficiency must be positive, got "
                f"{self.gemm_efficiency!r}"
            )

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype` ("tfloat32": TF32 tensor cores). A dtype the part
        lacks raises KeyError: the plan's precision is checked first (`precision_problem`),
        never silently priced at another rate."""
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        raise KeyError(f"GPU {self.name} has no peak FLOP/s for {dtype}")

    def supports(self, precision: str) -> bool:
        """The part runs training `precision` (a `PRECISIONS` name) on its own units."""
        return PRECISIONS[precision] in dict(self.peak_flops)

    @property
    def is_cpu(self) -> bool:
        """A CPU device ("CPU", or a profiled one named "CPU ..."): it is its own host."""
        return self.name.upper().startswith("CPU")


@dataclass(frozen=True, slots=True)
class LinkTier:
    """One kind of link: its bandwidth (bytes/s, one direction), latency and efficiency.

    `efficiency` is the fraction of `bandwidth` that collectives reach on large messages
    (NCCL bus bandwidth over line rate); the cost model applies it.
    """

    name: str
    kind: LinkKind
    bandwidth: float
    latency: float
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"link {self.name}: bandwidth must be positive")
        if self.latency < 0:
            raise ValueError(f"link {self.name}: latency must be non-negative")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name}: efficiency must be in (0, 1]")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


# Training precisions a plan chooses among (`--precision`), with the peak-FLOP/s key
# (`GpuSpec.peak_flops`) the matmuls run at:
#   fp32  float32 weights and matmuls on CUDA cores (PyTorch's default: TF32 off)
#   tf32  float32 weights, matmuls on TF32 tensor cores (`allow_tf32`; Ampere and later)
#   bf16  bf16 mixed precision (fp32 master weights and optimizer; Ampere and later)
#   fp16  fp16 mixed precision with loss scaling (Volta and later)
#   fp8   bf16 mixed precision with float8 linear layers (torchao's tensorwise recipe, as
#         torchtitan runs it; Hopper and Ada and later)
PRECISIONS: dict[str, str] = {
    "fp32": "float32",
    "tf32": "tfloat32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": "float8_e4m3fn",
}
# The dtype the cost model prices a precision's step in (fp8: bf16 around float8 linears).
PRECISION_DTYPE: dict[str, str] = {
    "fp32": "float32",
    "tf32": "tfloat32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": "bfloat16",
}

# Per-group precision (`Plan.hybrid_precision`, `cost_model.engine.Engine.hybrid`,
# `runtime.hybrid_precision`): each mode of a group's forward GEMMs and the `GpuSpec.peak_flops`
# key of the tensor cores it needs.
HYBRID_PEAKS: dict[str, str] = {"fp8": "float8_e4m3fn", "int8": "int8"}
HYBRID_MODES: tuple[str, ...] = tuple(HYBRID_PEAKS)


def matmul_dtype(gpu: GpuSpec, dtype: str) -> str:
    """The dtype `gpu` runs a matmul of the plan's `dtype` in: TF32 on a part without TF32
    units is float32 on its CUDA cores (PyTorch's `allow_tf32` does nothing there); every
    other dtype as given."""
    if dtype == PRECISIONS["tf32"] and not gpu.supports("tf32"):
        return PRECISIONS["fp32"]
    return dtype


def precision_problem(precision: str, gpus) -> str:
    """Why `precision` cannot train on every GPU type in `gpus` (GpuSpecs), or "": the one
    rule the planner, `estimate` and the runtime's check apply. tf32 needs TF32 units on
    one type at least: it is PyTorch's `allow_tf32`, which a part without them ignores and
    runs in fp32 (`matmul_dtype`), as a cluster of A100s and V100s trains under it."""
    if precision not in PRECISIONS:
        return f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
    lacking = sorted({g.name for g in gpus if not g.supports(precision)})
    if precision == "tf32" and len(lacking) < len({g.name for g in gpus}):
        return ""
    if not lacking:
        return ""
    ok = [p for p in PRECISIONS if all(g.supports(p) for g in gpus)]
    return (
        f"{', '.join(lacking)} cannot train in {precision} (no "
        f"{PRECISIONS[precision].replace('tfloat32', 'TF32')} units); use --precision "
        f"{' or '.join(ok)}"
    )


def default_precision(model_dtype: str, gpus) -> tuple[str, str]:
    """(precision, note) when the user names none: the model's own dtype (fp32, bf16, fp16);
    a bf16 model on parts without bf16 (V100, T4, RTX 2080 Ti) trains in fp16 mixed
    precision, as people run it there, and the note says so."""
    want = {"float32": "fp32", "float64": "fp32", "float16": "fp16"}.get(model_dtype, "bf16")
    if want == "bf16" and not precision_problem("bf16", gpus):
        return "bf16", ""
    if want == "bf16":
        lacking = sorted({g.name for g in gpus if not g.supports("bf16")})
        verb = "has" if len(lacking) == 1 else "have"
        return "fp16", (
            f"precision fp16 mixed (loss scaling): {' and '.join(lacking)} {verb} no bfloat16 "
            "(the model's dtype); --precision pins another"
        )
    return want, ""
