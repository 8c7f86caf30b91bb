"""Public measured GPU kernel latencies, read as IR ops the cost model can price.

Two layouts are read, one per project that published the measurements (NeuSight,
sitar-lab/NeuSight; Vidur, microsoft/vidur), each described below; nothing else about those
projects is used:

- NeuSight (`neusight/<op>/<device>.csv.gz`): single float32 kernels with TF32 off (CUDA
  cores), `Latency` in milliseconds from CUDA events around one call (the launch included),
  shapes in `B, M, N, K` (linear: (M x K) input times a (N x K) weight, B = 1; bmm: B
  batched (M x K) @ (K x N)) or `B, H` (elementwise, softmax and layer norm on a (B, H)
  tensor; an op name ending in `u` is the unary or tensor-with-scalar form).
- meshplan (`meshplan/<device>.csv.gz`): what `benchmarks/collect_gpu_ops.py` measures on a
  GPU at hand (bf16/fp16 GEMMs, float32 GEMMs with TF32 off and on, bmm, memory-bound kernels
  in bf16 and float32, embeddings, and kernels priced by other paths: float8 / int8 GEMMs and
  flash attention), kernel time of one call from CUDA-graph replays (no launch), inputs
  rotated beyond the L2 cache; the columns are that script's docstring's.
- Vidur (`vidur/<gpu>__<org>__<model>__mlp.csv.gz`): float16 forward ops of one LLM layer at
  `num_tokens` tokens and TP degree `num_tensor_parallel_workers`, CUDA kernel time without
  launch, one column group `time_stats.<op>.*` per op; norms, the gated activation and
  rotary embedding are one fused kernel each.

Each measurement becomes a `KernelRow` holding one `Op` built the way the tracer records that
kernel (`meshplan.ir.trace`: kind, input and output `TensorMeta`, FLOPs in FlopCounterMode's
convention, bytes as every input plus every output, `meshplan.ir.flops.op_bytes`), so
pricing a row is calling the planner's own `compute.op_time` on it.
`tests/cost_model/test_kernel_data.py` checks the builders against the tracer.

Device names are mapped to the GPU table (`device_spec`): the vendor prefix is dropped
("NVIDIA A100-PCIE-40GB" -> "A100-PCIE-40GB") and the rest resolved like a cluster file's
`gpu:` (aliases, any case), then among the measured-only variants of `hardware.py`. A name
that maps to nothing raises `UnknownGpuError`; readers never skip a device silently.
"""

from __future__ import annotations

import csv
import gzip
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from meshplan.ir import GpuSpec, Op, OpKind, TensorMeta
from meshplan.ir.hardware import UnknownGpuError, gpu_spec, variant_spec

from . import compute
from .dataset import DeviceDescriptor, Sample

MS = 1e-3  # both datasets state times in milliseconds


@dataclass(frozen=True, slots=True)
class KernelRow:
    """One measured kernel: what ran (`op`, at `dtype`), where (`device`, as the file names
    it) and how long (`seconds`). `op_class` is the class errors are reported by; `group`
    names rows that together make one transformer layer (Vidur), else "".
    `launch_included`: the time includes the launch (CUDA events around one call)."""

    source: str
    device: str
    op_class: str
    op: Op
    dtype: str
    seconds: float
    group: str = ""
    launch_included: bool = False
    tp: int = 1  # Vidur: the row's tensor-parallel degree (its ops are one rank's shard)


_VENDOR = re.compile(r"^(nvidia|tesla|amd)[\s_-]+", re.IGNORECASE)


def device_spec(name: str) -> GpuSpec:
    """The `GpuSpec` of a device as a dataset names it: "NVIDIA A100-PCIE-40GB", "Tesla T4",
    "a100" (Vidur: the A100 80GB SXM). Raises `UnknownGpuError` naming the device."""
    bare = _VENDOR.sub("", name.strip())
    try:
        return gpu_spec(bare)
    except UnknownGpuError:
        spec = variant_spec(bare)
        if spec is None:
            raise UnknownGpuError(
                f"device {name!r} in the kernel data maps to no GPU type; add a spec with its "
                "datasheet figures (or an alias) to meshplan/ir/hardware.py"
            ) from None
        return spec


@cache
def datasheet_descriptor(spec: GpuSpec) -> DeviceDescriptor:
    """The learned model's record of a GPU type known by its datasheet only: the peaks per
    dtype, HBM bandwidth (also the roofline's, no cache bandwidth is known) and SM count of
    `spec`; caches and clock unknown (0). Its `DeviceFeatures` equal
    `DeviceFeatures.from_spec(spec)`, what the model reads for a GPU it was not trained on."""
    return DeviceDescriptor(
        name=spec.name,
        processor=spec.name,
        backend="cuda",
        cores=spec.sms,
        clock_hz=0.0,
        l2_bytes=0,
        l3_bytes=0,
        memory_bytes=spec.memory_bytes,
        torch_version="",
        peak_flops=spec.peak_flops,
        mem_bandwidth=spec.hbm_bandwidth,
        cache_bandwidth=spec.hbm_bandwidth,
    )


def as_sample(row: KernelRow, spec: GpuSpec) -> Sample:
    """`row` as a learned-model training sample on `spec`'s datasheet descriptor (forward,
    family = source, model = op class). The seconds are the row's as measured; what the
    source's timing adds to them is the caller's `offsets` (`learned.train`)."""
    return Sample(
        family=row.source,
        model=row.op_class,
        op=row.op,
        backward=False,
        dtype=row.dtype,
        seconds=row.seconds,
        spread=0.0,
        device=datasheet_descriptor(spec),
    )


# -- op builders: one IR op per kernel, as the tracer records it -----------------------------
def _t(shape: tuple[int, ...], dtype: str) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in shape), dtype)


def _op(name, kind, target, inputs, outputs, flops=0, params=(), attrs=()) -> Op:
    nbytes = sum(t.nbytes for t in (*inputs, *outputs))
    return Op(
        name, kind, target, "", tuple(inputs), tuple(outputs),
        fwd_flops=int(flops), fwd_bytes=int(nbytes), params=tuple(params), attrs=tuple(attrs),
    )  # fmt: skip


def linear_op(m: int, n: int, k: int, dtype: str, name: str = "linear") -> Op:
    """`F.linear(x, w)` with x (m, k), w (n, k): the tracer's `aten.mm` of x and w.t()."""
    x, w, out = _t((m, k), dtype), _t((k, n), dtype), _t((m, n), dtype)
    return _op(name, OpKind.MATMUL, "aten.mm.default", (x, w), (out,), 2 * m * n * k, ("weight",))


def bmm_op(b: int, m: int, n: int, k: int, dtype: str) -> Op:
    """`torch.bmm` of (b, m, k) and (b, k, n): an activation matmul (no parameters)."""
    a, c, out = _t((b, m, k), dtype), _t((b, k, n), dtype), _t((b, m, n), dtype)
    return _op("bmm", OpKind.MATMUL, "aten.bmm.default", (a, c), (out,), 2 * b * m * n * k)


def elementwise_op(name: str, shape: tuple[int, ...], dtype: str, inputs: int = 1,
                   out_shape: tuple[int, ...] | None = None) -> Op:  # fmt: skip
    """A pointwise kernel reading `inputs` tensors of `shape` and writing one of `out_shape`
    (default `shape`); FlopCounterMode counts no FLOPs for pointwise ops."""
    ins = tuple(_t(shape, dtype) for _ in range(inputs))
    return _op(
        name, OpKind.ELEMENTWISE, f"aten.{name}.Tensor", ins, (_t(out_shape or shape, dtype),)
    )


def softmax_op(shape: tuple[int, ...], dtype: str) -> Op:
    """`aten._softmax` over the last dimension."""
    return _op("softmax", OpKind.SOFTMAX, "aten._softmax.default", (_t(shape, dtype),),
               (_t(shape, dtype),))  # fmt: skip


def norm_op(rows: int, hidden: int, dtype: str, *, rms: bool = False) -> Op:
    """A fused norm of (rows, hidden): `aten.native_layer_norm` (input, weight, bias -> output,
    fp32 mean and rstd per row) or a fused RMSNorm (input, weight -> output)."""
    x, w = _t((rows, hidden), dtype), _t((hidden,), dtype)
    if rms:
        return _op("rms_norm", OpKind.NORM, "aten._fused_rms_norm.default", (x, w), (x,),
                   params=("weight",))  # fmt: skip
    stat = _t((rows, 1), "float32")
    return _op("layer_norm", OpKind.NORM, "aten.native_layer_norm.default", (x, w, w),
               (x, stat, stat), params=("weight", "bias"))  # fmt: skip


def embedding_op(tokens: int, vocab: int, hidden: int, dtype: str) -> Op:
    """`aten.embedding` of a (vocab, hidden) table at `tokens` int64 ids."""
    table, ids = _t((vocab, hidden), dtype), _t((tokens,), "int64")
    return _op("embedding", OpKind.EMBEDDING, "aten.embedding.default", (table, ids),
               (_t((tokens, hidden), dtype),), params=("weight",))  # fmt: skip


# -- NeuSight --------------------------------------------------------------------------------
# Report class of each NeuSight op directory; the elementwise ones read 2 tensors unless
# unary (relu, gelu, tanh) or the tensor-with-scalar form (a trailing "u").
_NEUSIGHT_CLASS = {"linear": "linear", "bmm": "bmm", "softmax": "softmax", "ln": "layernorm"}
_UNARY = frozenset({"relu", "gelu", "tanh"})


def read_neusight(root: Path) -> Iterator[KernelRow]:
    """Every row of `root/neusight/<op>/<device>.csv.gz` (float32, launch included)."""
    base = Path(root) / "neusight"
    for op_dir in sorted(p for p in base.iterdir() if p.is_dir()):
        name = op_dir.name
        for path in sorted(op_dir.glob("*.csv.gz")):
            device = path.name.removesuffix(".csv.gz")
            with gzip.open(path, "rt", newline="") as f:
                for row in csv.DictReader(f):
                    op = _neusight_op(name, row)
                    yield KernelRow(
                        "neusight", device, _NEUSIGHT_CLASS.get(name, "elementwise"), op,
                        "float32", float(row["Latency"]) * MS, launch_included=True,
                    )  # fmt: skip


def _neusight_op(name: str, row: dict) -> Op:
    dt = "float32"
    b = int(row["B"])
    if name == "linear":
        return linear_op(b * int(row["M"]), int(row["N"]), int(row["K"]), dt)
    if name == "bmm":
        return bmm_op(b, int(row["M"]), int(row["N"]), int(row["K"]), dt)
    shape = (b, int(row["H"]))
    if name == "softmax":
        return softmax_op(shape, dt)
    if name == "ln":
        return norm_op(b, int(row["H"]), dt)
    unary = name in _UNARY or name.endswith("u")
    return elementwise_op(name.removesuffix("u") if name != "relu" else name, shape, dt,
                          inputs=1 if unary else 2)  # fmt: skip


# -- Vidur -----------------------------------------------------------------------------------
VIDUR_LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
_VIDUR_CLASS = {
    "emb": "embedding",
    "input_layernorm": "norm",
    "post_attention_layernorm": "norm",
    "attn_pre_proj": "gemm",
    "attn_post_proj": "gemm",
    "mlp_up_proj": "gemm",
    "mlp_down_proj": "gemm",
    "attn_rope": "rope",
    "mlp_act": "activation",
    "add": "residual",
}
# phi-2 (the one model in the files without a gated MLP) uses LayerNorm; the others RMSNorm.
_VIDUR_STAT = "median"


def read_vidur(root: Path) -> Iterator[KernelRow]:
    """Every op of every row of `root/vidur/<gpu>__*__mlp.csv.gz` (float16, kernel time)."""
    for path in sorted((Path(root) / "vidur").glob("*__mlp.csv.gz")):
        device, _, model = path.name.removesuffix("__mlp.csv.gz").partition("__")
        with gzip.open(path, "rt", newline="") as f:
            for i, row in enumerate(csv.DictReader(f)):
                tp = row["num_tensor_parallel_workers"]
                group = f"{device}/{model}/{row['num_tokens']}/tp{tp}/{i}"
                for name, cls in _VIDUR_CLASS.items():
                    value = row.get(f"time_stats.{name}.{_VIDUR_STAT}", "")
                    if value in ("", "nan"):
                        continue
                    op = _vidur_op(name, row)
                    yield KernelRow(
                        "vidur", device, cls, op, "float16", float(value) * MS,
                        group=group if name in VIDUR_LAYER_OPS else "",
                        tp=int(row["num_tensor_parallel_workers"]),
                    )  # fmt: skip


def _vidur_op(name: str, row: dict) -> Op:
    dt = "float16"
    t, p = int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
    e, f_ = int(row["n_embd"]), int(row["n_expanded_embd"])
    heads, kv = int(row["n_head"]), int(row["n_kv_head"])
    gated = row["use_gated_mlp"].strip().lower() == "true"
    hd = e // heads
    if name == "emb":
        return embedding_op(t, int(row["vocab_size"]) // p, e, dt)
    if name in ("input_layernorm", "post_attention_layernorm"):
        return norm_op(t, e, dt, rms=gated)
    if name == "attn_pre_proj":  # fused QKV, column-parallel
        return linear_op(t, (heads + 2 * kv) * hd // p, e, dt, name)
    if name == "attn_post_proj":  # row-parallel
        return linear_op(t, e, e // p, dt, name)
    if name == "mlp_up_proj":  # column-parallel; gate and up fused when gated
        return linear_op(t, (2 if gated else 1) * f_ // p, e, dt, name)
    if name == "mlp_down_proj":
        return linear_op(t, e, f_ // p, dt, name)
    if name == "mlp_act":  # SiLU-and-mul (reads gate and up, writes one) or GELU
        width = f_ // p
        if gated:
            return elementwise_op("silu_and_mul", (t, 2 * width), dt, out_shape=(t, width))
        return elementwise_op("gelu", (t, width), dt)
    if name == "attn_rope":  # in place on q and k, with the cos / sin cache row per token
        qk = (heads + kv) * hd // p
        return elementwise_op("rotary", (t, qk + hd), dt, out_shape=(t, qk))
    if name == "add":  # residual add
        return elementwise_op("add", (t, e), dt, inputs=2)
    raise ValueError(f"unknown Vidur op {name!r}")


# -- meshplan's own collector ----------------------------------------------------------------
# Classes `compute.op_time` prices as one op; the others (float8 / int8 GEMMs, fused
# attention) are priced by their own paths and read raw by `read_meshplan_raw`.
MESHPLAN_OP_CLASSES = frozenset(
    {"gemm", "linear_fp32", "linear_tf32", "bmm", "elementwise", "softmax", "layernorm", "norm",
     "embedding"}
)  # fmt: skip
# Report class: float32 GEMMs on CUDA cores are NeuSight's "linear" class.
_MESHPLAN_REPORT = {"linear_fp32": "linear"}
_DTYPE = {"tf32": "tfloat32"}


def read_meshplan_raw(root: Path) -> Iterator[dict]:
    """Every row of `root/meshplan/<device>.csv.gz` as the file states it (strings)."""
    for path in sorted((Path(root) / "meshplan").glob("*.csv.gz")):
        with gzip.open(path, "rt", newline="") as f:
            for row in csv.DictReader(f):
                yield {**row, "device": path.name.removesuffix(".csv.gz")}


def read_meshplan(root: Path) -> Iterator[KernelRow]:
    """The rows of `root/meshplan/` that one op prices (`MESHPLAN_OP_CLASSES`; kernel time)."""
    for row in read_meshplan_raw(root):
        cls = row["cls"]
        if cls not in MESHPLAN_OP_CLASSES:
            continue
        dtype = _DTYPE.get(row["dtype"], row["dtype"])
        op = _meshplan_op(row)
        report = _MESHPLAN_REPORT.get(cls, cls)
        if cls in _TENSOR_CORE_CLASSES and not compute.gemm_aligned(op, dtype):
            report += "_misaligned"  # reported apart: the bars are for aligned shapes
        yield KernelRow("meshplan", row["device"], report, op, dtype, float(row["seconds"]))


_TENSOR_CORE_CLASSES = frozenset({"gemm", "bmm", "linear_tf32"})


def _meshplan_op(row: dict) -> Op:
    name = row["op"]
    dt = "float32" if row["dtype"] == "tf32" else row["dtype"]
    b, m, n, k = (int(row[c] or 0) for c in ("b", "m", "n", "k"))
    if name in ("linear", "mm_nt"):
        return linear_op(m, n, k, dt, name)
    if name == "bmm":
        return bmm_op(b, m, n, k, dt)
    if name == "embedding":
        return embedding_op(b, m, n, dt)
    if name == "softmax":
        return softmax_op((b, m), dt)
    if name in ("layer_norm", "rms_norm"):
        return norm_op(b, m, dt, rms=name == "rms_norm")
    if name in ("add", "mul", "gelu", "silu"):
        return elementwise_op(name, (b, m), dt, inputs=2 if name in ("add", "mul") else 1)
    raise ValueError(f"meshplan kernel data: unknown op {name!r}")


def read_all(root: Path) -> list[KernelRow]:
    """Rows of every layout under `root` (any may be absent)."""
    rows: list[KernelRow] = []
    if (Path(root) / "neusight").is_dir():
        rows += read_neusight(root)
    if (Path(root) / "vidur").is_dir():
        rows += read_vidur(root)
    if (Path(root) / "meshplan").is_dir():
        rows += read_meshplan(root)
    return rows
