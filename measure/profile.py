"""Operator micro-benchmarks: measure the ops meshplan's IR emits on the current device.

`meshplan profile` (and `run_profile`) builds a list of IR `Op`s, replays each one on real
tensors of its traced shapes and dtypes, and appends one row per (op, direction) with the
measured seconds to a versioned dataset (`meshplan.cost_model.dataset`). The learned latency
model (`cost_model/learned.py`) trains on these rows; `benchmarks/op_latency.py` evaluates it
holding out model families.

Where the ops come from (every row is tagged with a `family`):

- **Model families** (`MODEL_FAMILIES`): scaled-down GPT-2, Llama, Mixtral and BERT-like
  configurations of the zoo transformer are traced with `meshplan.trace` (one layer is
  enough: identical layers share a block), and every op of every block is profiled at its
  traced shape. BERT-like models are GPT-style layers with bidirectional attention (the
  attention op's `causal` attribute is cleared). The evaluation holds out whole families.
- **Sweep** (`family="sweep"`): synthetic ops over shapes models rarely hit: GEMMs (mm,
  addmm, bmm) at many M/N/K including skinny and non-multiple-of-64 ones, SDPA forward and
  backward at several b/h/s/d (causal and not), layer norm, softmax, elementwise, embedding
  and MoE dispatch (index_select / scatter). Their FLOPs and bytes are counted with the
  tracer's own rules (`meshplan.ir.flops`), so a sweep op is indistinguishable from a traced
  one.

How one op is replayed (`_recipe`): a recipe per aten packet rebuilds the call from the
input shapes (the IR keeps shapes, not scalar arguments, so dims are inferred from the
output shape: the reduced dims of `mean`/`sum`, the concatenated dim of `cat`; `topk` reads
`k` from the op's attrs). The forward time is the op alone; the backward time is
`torch.autograd.grad` of that op's output (graph retained, forward not re-run). Ops without
a recipe are skipped and counted.

How one measurement is taken (`measure`, timer from `clock_for`: thread CPU time on a
1-thread CPU, else the wall clock): warm-up calls, then samples of `inner` calls each (inner
chosen so that a sample lasts >= `min_sample_s`, which amortises the timer), at most
`repeats` samples and at most `max_seconds` per measurement; samples further than 3 scaled
MADs from the median are dropped and the median of the rest is the result. On CUDA each
sample is bracketed by `torch.cuda.synchronize()`. Runs appended at different times are
folded per op into the fastest (`cost_model.dataset.aggregate_runs`) for training and
evaluation.

The dataset's format, and reading it back, are `meshplan.cost_model.dataset`'s.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from meshplan.cost_model.dataset import (
    SCHEMA_VERSION,
    DeviceDescriptor,
    append_dataset,
    default_path,
    op_from_dict,
    op_to_dict,
)
from meshplan.ir import Op, OpKind
from meshplan.ir.flops import ATTENTION_TARGETS, is_metadata_op, op_bytes, op_flops
from meshplan.ir.graph import TensorMeta
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


# ---------------------------------------------------------------------------------------------
# Device descriptor
# ---------------------------------------------------------------------------------------------


def _read_int(path: str) -> int:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return 0
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:].upper(), 1)
    try:
        return int(text.rstrip("KMGkmg")) * mult
    except ValueError:
        return 0


def _cpu_facts() -> tuple[str, float, int, int, int]:
    """(processor name, clock Hz, L2 bytes per core, L3 bytes, RAM bytes) of this host."""
    name, mhz = platform.processor() or platform.machine(), 0.0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine(), "x86_64"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("cpu MHz") and not mhz:
                mhz = float(line.split(":", 1)[1])
    except OSError:
        pass
    max_khz = _read_int("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    clock = max_khz * 1e3 if max_khz else mhz * 1e6
    l2 = l3 = 0
    for idx in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{idx}"
        level = _read_int(f"{base}/level")
        if level == 2:
            l2 = _read_int(f"{base}/size")
        elif level == 3:
            l3 = _read_int(f"{base}/size")
    ram = 0
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return name, clock, l2, l3, ram


def clock_for(device: torch.device) -> tuple[str, Callable[[], float]]:
    """The timer of a measurement: (name, clock).

    On a CPU running torch with one thread, the calling thread's CPU time
    (`time.thread_time`): every op and its autograd backward run on that thread, and CPU
    time leaves out the time other processes of a shared host hold the core (wall time on a
    2-core host with a load of 8 was off by 3x on millisecond ops). Everywhere else (CUDA,
    several CPU threads) the wall clock, synchronised.
    """
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return "thread_cpu", time.thread_time
    return "wall", time.perf_counter


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def measure_peaks(
    device: torch.device, dtypes: Iterable[str], *, quick: bool = False
) -> tuple[tuple[tuple[str, float], ...], float, float]:
    """(peak GEMM FLOP/s per dtype, large-copy bandwidth, best copy bandwidth) of `device`.

    Peaks are the best of a few square GEMMs; bandwidths count read + write bytes of a
    `copy_` (the tracer's bytes convention), large (beyond the last-level cache) and at a
    range of sizes (the best of which is the on-chip cache bandwidth).
    """
    big = device.type == "cuda"
    sizes = (1024, 2048) if quick else ((4096, 8192) if big else (512, 1024, 1536))
    peaks = []
    for dt in dtypes:
        best = 0.0
        for n in sizes:
            a = torch.randn(n, n, device=device).to(_TORCH_DTYPES[dt])
            b = torch.randn(n, n, device=device).to(_TORCH_DTYPES[dt])
            t = measure(lambda a=a, b=b: torch.mm(a, b), device, max_seconds=0.3, repeats=5).seconds
            best = max(best, 2 * n**3 / t)
        peaks.append((dt, best))
    copy_bw = []
    elems = (2**12, 2**15, 2**17, 2**19, 2**21) + ((2**26,) if not quick else (2**24,))
    if big:
        elems = (2**20, 2**24, 2**28)
    for n in elems:
        src = torch.empty(n, device=device, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        t = measure(lambda s=src, d=dst: d.copy_(s), device, max_seconds=0.2, repeats=7).seconds
        copy_bw.append(2 * 4 * n / t)
    return tuple(peaks), copy_bw[-1], max(copy_bw)


def describe_device(
    device: torch.device, dtypes: Iterable[str], *, quick: bool = False
) -> DeviceDescriptor:
    """Describe `device` and measure its peaks (a few seconds)."""
    peaks, mem_bw, cache_bw = measure_peaks(device, dtypes, quick=quick)
    if device.type == "cuda":
        from meshplan.ir.hardware import canonical_gpu_name

        props = torch.cuda.get_device_properties(device)
        raw = props.name.replace("NVIDIA ", "")
        name = canonical_gpu_name(raw) or canonical_gpu_name(raw.split()[0]) or raw
        return DeviceDescriptor(
            name=name,
            processor=props.name,
            backend="cuda",
            cores=props.multi_processor_count,
            clock_hz=float(getattr(props, "clock_rate", 0) or 0) * 1e3,
            l2_bytes=int(getattr(props, "L2_cache_size", 0) or 0),
            l3_bytes=0,
            memory_bytes=int(props.total_memory),
            torch_version=torch.__version__,
            peak_flops=peaks,
            mem_bandwidth=mem_bw,
            cache_bandwidth=cache_bw,
            timer=clock_for(device)[0],
        )
    proc, clock, l2, l3, ram = _cpu_facts()
    return DeviceDescriptor(
        name="CPU",
        processor=proc,
        backend="cpu",
        cores=torch.get_num_threads(),
        clock_hz=clock,
        l2_bytes=l2,
        l3_bytes=l3,
        memory_bytes=ram,
        torch_version=torch.__version__,
        peak_flops=peaks,
        mem_bandwidth=mem_bw,
        cache_bandwidth=cache_bw,
        timer=clock_for(device)[0],
    )


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """Robust time of one call: median of the kept samples, with what was dropped."""

    seconds: float
    samples: int
    dropped: int
    spread: float  # MAD of the kept samples / median (relative noise)
    min_seconds: float = 0.0  # fastest sample (the least disturbed by other processes)


def robust_median(samples: list[float]) -> tuple[float, int, float]:
    """(median, dropped, relative MAD) after dropping samples beyond 3 scaled MADs."""
    med = statistics.median(samples)
    mad = statistics.median(abs(x - med) for x in samples) * 1.4826
    kept = [x for x in samples if mad == 0 or abs(x - med) <= 3 * mad] or samples
    med = statistics.median(kept)
    spread = statistics.median(abs(x - med) for x in kept) / med if med > 0 else 0.0
    return med, len(samples) - len(kept), spread


def measure(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    repeats: int = 15,
    min_sample_s: float = 2e-4,
    max_seconds: float = 0.15,
) -> Measurement:
    """Time `fn` robustly: warm-up, then up to `repeats` samples within `max_seconds`.

    The clock is `clock_for(device)`: thread CPU time on a 1-thread CPU, else wall time.
    """
    sync = _sync(device)
    clock = clock_for(device)[1]
    for _ in range(warmup):
        fn()
    sync()
    t0 = clock()
    fn()
    sync()
    once = max(clock() - t0, 1e-7)
    inner = max(1, min(1000, math.ceil(min_sample_s / once)))
    samples: list[float] = []
    start = time.perf_counter()  # the time cap is on the wall clock
    while len(samples) < repeats:
        t0 = clock()
        for _ in range(inner):
            fn()
        sync()
        samples.append(max(clock() - t0, 1e-9) / inner)
        if time.perf_counter() - start > max_seconds and len(samples) >= 3:
            break
    med, dropped, spread = robust_median(samples)
    return Measurement(med, len(samples), dropped, spread, min(samples))


# ---------------------------------------------------------------------------------------------
# Replaying one IR op
# ---------------------------------------------------------------------------------------------


class NoRecipe(Exception):
    """The profiler does not know how to replay this op."""


def packet(target: str) -> str:
    """`aten.mm.default` -> `mm`; fused attention kernels -> `attention`."""
    if target in ATTENTION_TARGETS or target.rsplit(".", 1)[0] in ATTENTION_TARGETS:
        return "attention"
    parts = target.split(".")
    return parts[1] if len(parts) > 1 else target


def _tensor(
    meta: TensorMeta, device: torch.device, grad: bool, gen: torch.Generator
) -> torch.Tensor:
    dt = _TORCH_DTYPES.get(meta.dtype)
    if dt is None:
        raise NoRecipe(f"dtype {meta.dtype}")
    if dt.is_floating_point:
        t = torch.randn(meta.shape, generator=gen).to(device=device, dtype=dt)
        return t.requires_grad_(grad)
    if dt == torch.bool:
        return (torch.rand(meta.shape, generator=gen) > 0.5).to(device)
    return torch.randint(0, 2, meta.shape, generator=gen).to(device=device, dtype=dt)


def _indices(n_rows: int, shape: tuple[int, ...], device, gen) -> torch.Tensor:
    return torch.randint(0, max(n_rows, 1), shape, generator=gen).to(device)


def _reduced_dims(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[list[int], bool]:
    """Dims of `src` reduced to get `dst` (keepdim when ranks match)."""
    if len(src) == len(dst):
        dims = [i for i, (a, b) in enumerate(zip(src, dst, strict=True)) if a != b and b == 1]
        return dims or [len(src) - 1], True
    dims, j = [], 0
    for i, a in enumerate(src):
        if j < len(dst) and dst[j] == a and len(src) - i > len(dst) - j - 1:
            j += 1
        else:
            dims.append(i)
    return dims or [len(src) - 1], False


def _float_dtype(op: Op) -> str:
    for t in (*op.inputs, *op.outputs):
        if t.dtype in ("float32", "bfloat16", "float16", "float64"):
            return t.dtype
    return (op.outputs or op.inputs)[0].dtype if (op.outputs or op.inputs) else "float32"


_UNARY = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "rsqrt": torch.rsqrt,
    "pow": lambda x: x.pow(2),
    "neg": torch.neg,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "sqrt": torch.sqrt,
    "clone": torch.clone,
}
_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def _recipe(op: Op, device: torch.device, gen: torch.Generator):
    """(forward callable, inputs needing grad, output builder) that replays `op`.

    Returns `(run, grad_inputs)`: `run()` computes the op on fresh-but-fixed tensors and
    returns its output; `grad_inputs` are the float inputs the backward differentiates.
    """
    p = packet(op.target)
    ins = op.inputs
    out0 = op.outputs[0] if op.outputs else None

    def t(i: int, grad: bool = True) -> torch.Tensor:
        return _tensor(ins[i], device, grad, gen)

    if p in ("mm", "bmm", "matmul"):
        a, b = t(0), t(1)
        fn = {"mm": torch.mm, "bmm": torch.bmm, "matmul": torch.matmul}[p]
        return (lambda: fn(a, b)), [a, b]
    if p in ("addmm", "baddbmm"):
        c, a, b = t(0), t(1), t(2)
        fn = torch.addmm if p == "addmm" else torch.baddbmm
        return (lambda: fn(c, a, b)), [c, a, b]
    if p == "attention":
        q, k, v = t(0), t(1), t(2)
        causal = bool(op.attr("causal", False))
        gqa = q.shape[1] != k.shape[1]
        return (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        ), [q, k, v]
    if p == "embedding":
        w = t(0)
        idx = _indices(ins[0].shape[0], ins[1].shape, device, gen)
        return (lambda: F.embedding(idx, w)), [w]
    if p == "index_select":
        src = t(0)
        idx = _indices(ins[0].shape[0], ins[1].shape, device, gen)
        return (lambda: src.index_select(0, idx)), ([src] if src.requires_grad else [])
    if p == "scatter":
        base = t(0)
        n = ins[1].numel
        idx = torch.randperm(max(ins[0].shape[0], n), generator=gen)[:n].clamp(
            max=ins[0].shape[0] - 1
        )
        idx = idx.view(ins[1].shape).to(device)
        src = t(2)
        return (lambda: base.scatter(0, idx, src)), [x for x in (base, src) if x.requires_grad]
    if p in ("native_layer_norm", "layer_norm"):
        x, w, b = t(0), t(1), t(2) if len(ins) > 2 else None
        shape = tuple(ins[1].shape)
        return (lambda: F.layer_norm(x, shape, w, b)), [x for x in (x, w, b) if x is not None]
    if p in ("_softmax", "softmax", "_log_softmax", "log_softmax"):
        x = t(0)
        fn = F.log_softmax if "log" in p else F.softmax
        return (lambda: fn(x, dim=-1)), [x]
    if p in _UNARY and len(ins) >= 1:
        x = t(0)
        fn = _UNARY[p]
        return (lambda: fn(x)), [x]
    if p in _BINARY:
        fn = _BINARY[p]
        if len(ins) == 1:
            x = t(0)
            return (lambda: fn(x, 2)), ([x] if x.requires_grad else [])
        a, b = t(0), t(1)
        return (lambda: fn(a, b)), [x for x in (a, b) if x.requires_grad]
    if p in ("mean", "sum") and out0 is not None:
        x = t(0)
        dims, keep = _reduced_dims(ins[0].shape, out0.shape)
        fn = torch.mean if p == "mean" else torch.sum
        if not x.dtype.is_floating_point:
            return (lambda: torch.sum(x, dims, keepdim=keep)), []
        return (lambda: fn(x, dims, keepdim=keep)), [x]
    if p == "cat" and out0 is not None:
        xs = [t(i) for i in range(len(ins))]
        dim = next(
            (d for d in range(len(out0.shape)) if out0.shape[d] != ins[0].shape[d]),
            0,
        )
        return (lambda: torch.cat(xs, dim)), [x for x in xs if x.requires_grad]
    if p == "_to_copy" and out0 is not None:
        x = t(0)
        dt = _TORCH_DTYPES.get(out0.dtype)
        if dt is None:
            raise NoRecipe(op.target)
        grad = x.requires_grad and dt.is_floating_point
        return (lambda: x.to(dt)), ([x] if grad else [])
    if p == "topk":
        x = t(0)
        k = int(op.attr("k", 1) or 1)
        return (lambda: torch.topk(x, k, dim=-1)[0]), [x]
    if p in ("eq", "ne", "lt", "gt", "le", "ge"):
        fn = getattr(torch, p)
        a = t(0, grad=False)
        b = t(1, grad=False) if len(ins) > 1 else 1
        return (lambda: fn(a, b)), []
    if p == "where" and len(ins) >= 2:
        c = t(0, grad=False)
        a = t(1)
        b = t(2) if len(ins) > 2 else 0
        return (lambda: torch.where(c, a, b)), [
            x for x in (a, b) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
    if (
        p in ("full", "new_zeros", "zeros", "arange", "scalar_tensor", "new_full")
        and out0 is not None
    ):
        dt = _TORCH_DTYPES.get(out0.dtype)
        if dt is None:
            raise NoRecipe(op.target)
        shape = out0.shape
        if p == "arange":
            return (lambda: torch.arange(out0.numel, dtype=dt, device=device)), []
        return (lambda: torch.zeros(shape, dtype=dt, device=device)), []
    if p == "cumsum":
        x = t(0, grad=False)
        return (lambda: torch.cumsum(x, 0)), []
    if p == "nll_loss_forward":
        x = t(0)
        tgt = _indices(ins[0].shape[-1], ins[1].shape, device, gen)
        return (lambda: F.nll_loss(x, tgt)), [x]
    raise NoRecipe(op.target)


@dataclass(frozen=True, slots=True)
class Timed:
    """Forward and backward times of one replayed op (None: not measured)."""

    fwd: Measurement | None
    bwd: Measurement | None


def time_op(
    op: Op, device: torch.device, *, backward: bool = True, max_seconds: float = 0.15, seed: int = 0
) -> Timed:
    """Replay `op` on `device` and time its forward and (when it has one) its backward."""
    gen = torch.Generator().manual_seed(seed)
    run, grad_inputs = _recipe(op, device, gen)
    with torch.no_grad():
        fwd = measure(run, device, max_seconds=max_seconds)
    bwd = None
    grad_inputs = [x for x in grad_inputs if x.requires_grad]
    if backward and grad_inputs and (op.bwd_flops or op.bwd_bytes):
        out = run()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            g = torch.randn_like(out)
            bwd = measure(
                lambda: torch.autograd.grad(out, grad_inputs, g, retain_graph=True),
                device,
                max_seconds=max_seconds,
            )
    return Timed(fwd, bwd)


# ---------------------------------------------------------------------------------------------
# Ops to profile: traced model families and a synthetic sweep
# ---------------------------------------------------------------------------------------------

# Scaled-down configurations of four model families (sizes a 1-thread CPU profiles in
# seconds; head dims and ratios as the published models: GPT-2 ffn 4h with GELU and
# LayerNorm, Llama SwiGLU ffn ~8/3 h with GQA, Mixtral 8 experts top-2, BERT-base ratios with
# bidirectional attention). (family, name, transformer kwargs, micro_batch).
MODEL_FAMILIES: tuple[tuple[str, str, dict, int], ...] = (
    (
        "gpt2",
        "gpt2-s",
        dict(
            hidden=256, heads=4, ffn=1024, vocab=4096, seq_len=128, style="gpt", tie_embeddings=True
        ),
        2,
    ),
    (
        "gpt2",
        "gpt2-m",
        dict(
            hidden=384, heads=6, ffn=1536, vocab=8192, seq_len=256, style="gpt", tie_embeddings=True
        ),
        1,
    ),
    (
        "gpt2",
        "gpt2-l",
        dict(
            hidden=640,
            heads=10,
            ffn=2560,
            vocab=4096,
            seq_len=192,
            style="gpt",
            tie_embeddings=True,
        ),
        1,
    ),
    (
        "llama",
        "llama-s",
        dict(hidden=256, heads=4, kv_heads=2, ffn=688, vocab=4096, seq_len=256),
        1,
    ),
    (
        "llama",
        "llama-m",
        dict(
            hidden=512,
            heads=8,
            kv_heads=2,
            ffn=1376,
            vocab=8000,
            seq_len=128,
        ),
        2,
    ),
    (
        "llama",
        "llama-l",
        dict(hidden=768, heads=6, kv_heads=2, ffn=2048, vocab=4000, seq_len=160),
        1,
    ),
    (
        "mixtral",
        "mixtral-s",
        dict(hidden=256, heads=4, kv_heads=2, ffn=512, vocab=4096, seq_len=128, experts=8, top_k=2),
        2,
    ),
    (
        "mixtral",
        "mixtral-m",
        dict(hidden=448, heads=7, kv_heads=1, ffn=896, vocab=6000, seq_len=192, experts=8, top_k=2),
        1,
    ),
    (
        "bert",
        "bert-s",
        dict(hidden=256, heads=4, ffn=1024, vocab=6000, seq_len=128, style="gpt"),
        4,
    ),
    (
        "bert",
        "bert-m",
        dict(hidden=512, heads=8, ffn=2048, vocab=6000, seq_len=384, style="gpt"),
        1,
    ),
)
BIDIRECTIONAL_FAMILIES = frozenset({"bert"})


@dataclass(frozen=True, slots=True)
class Job:
    """One op to profile and where it came from."""

    family: str
    model: str
    op: Op


def model_ops(
    families: Iterable[str] | None = None, dtypes: Iterable[str] = ("float32", "bfloat16")
) -> Iterator[Job]:
    """The distinct ops (by target, shapes, dtypes, attrs) of each traced model config."""
    from meshplan import models
    from meshplan.ir.trace import trace

    wanted = set(families) if families is not None else None
    for family, name, kw, mb in MODEL_FAMILIES:
        if wanted is not None and family not in wanted:
            continue
        for dt in dtypes:
            m, inputs = models.transformer(layers=1, micro_batch=mb, dtype=dt, **kw)
            g = trace(m, *inputs, name=f"{name}-{dt}")
            seen: set = set()
            for _, block in g.blocks:
                for op in block.ops:
                    if family in BIDIRECTIONAL_FAMILIES and op.kind == OpKind.ATTENTION:
                        attrs = tuple((k, False if k == "causal" else v) for k, v in op.attrs)
                        op = dataclasses.replace(op, attrs=attrs)
                    key = (op.target, op.inputs, op.outputs, op.attrs)
                    if key in seen:
                        continue
                    seen.add(key)
                    yield Job(family, f"{name}", op)


class _Counter(TorchDispatchMode):
    """Counts FLOPs and bytes of the aten ops run under it, by the tracer's rules."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not is_metadata_op(func):
            self.flops += op_flops(func, args, kwargs, out)
            self.bytes += op_bytes(args, kwargs, out)
        return out


@dataclass(frozen=True, slots=True)
class ReplayCounts:
    """FLOPs and bytes of what a replay actually runs, by the tracer's rules (`_Counter`).

    For a synthetic op they are the op's own counts. For a traced op they can differ from
    the IR's: the tracer charges an op the backward work of the metadata ops folded into it
    (e.g. the gradient copy of a `view` that feeds MoE's combine `sum`, or a bias gradient's
    reduction) and the gradient accumulation of its parameters, which replaying the op alone
    does not run. The learned model trains on the computation that was timed (`Sample.
    measured_op`); the planner prices the IR's counts.
    """

    outputs: tuple[TensorMeta, ...]
    fwd_flops: int
    bwd_flops: int
    fwd_bytes: int
    bwd_bytes: int

    def to_dict(self) -> dict:
        return {
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "fwd_bytes": self.fwd_bytes,
            "bwd_bytes": self.bwd_bytes,
        }


def replay_counts(op: Op) -> ReplayCounts:
    """Run `op`'s recipe once on the CPU, forward and backward, counting FLOPs and bytes."""
    gen = torch.Generator().manual_seed(0)
    run, grads = _recipe(op, torch.device("cpu"), gen)
    fwd = _Counter()
    with fwd:
        out = run()
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    out_meta = tuple(TensorMeta(tuple(o.shape), str(o.dtype).replace("torch.", "")) for o in outs)
    bwd = _Counter()
    grads = [g for g in grads if g.requires_grad]
    if grads and outs[0].requires_grad:
        seed = torch.ones_like(outs[0])  # made outside the counter: the tracer's loss grad is
        with bwd:  # not charged to the op either
            torch.autograd.grad(outs[0], grads, seed)
    return ReplayCounts(out_meta, fwd.flops, bwd.flops, fwd.bytes, bwd.bytes)


def synth_op(
    name: str,
    kind: OpKind,
    target: str,
    inputs: tuple[TensorMeta, ...],
    attrs: tuple = (),
    outputs: tuple[TensorMeta, ...] = (),
) -> Op:
    """An IR op built like the tracer would, with FLOPs/bytes counted on a real replay.

    `outputs` is needed only where the recipe reads the output shape (reductions, cat).
    """
    c = replay_counts(Op(name, kind, target, "", inputs, outputs, attrs=attrs))
    return Op(
        name,
        kind,
        target,
        "",
        inputs,
        c.outputs,
        fwd_flops=c.fwd_flops,
        bwd_flops=c.bwd_flops,
        fwd_bytes=c.fwd_bytes,
        bwd_bytes=c.bwd_bytes,
        attrs=attrs,
    )


def sweep_ops(
    dtypes: Iterable[str] = ("float32", "bfloat16"), *, quick: bool = False
) -> Iterator[Job]:
    """Synthetic ops over GEMM, attention, norm, elementwise, softmax, embedding, MoE shapes."""
    T = TensorMeta
    mm_t, addmm_t, bmm_t = "aten.mm.default", "aten.addmm.default", "aten.bmm.default"
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    mnk = [
        (1, 512, 512),
        (7, 300, 256),
        (16, 1024, 256),
        (33, 200, 640),
        (64, 64, 64),
        (100, 100, 100),
        (127, 513, 129),
        (128, 4096, 128),
        (256, 256, 1000),
        (256, 2048, 32),
        (384, 384, 1536),
        (500, 700, 300),
        (512, 512, 512),
        (777, 96, 333),
        (1024, 128, 1024),
        (1024, 1024, 256),
        (2048, 64, 64),
        (96, 3000, 200),
        (320, 320, 2560),
        (200, 50, 4000),
        # skinny N (router gates, small heads)
        (256, 8, 256),
        (512, 4, 1024),
        (1000, 16, 384),
        (64, 8, 448),
        (300, 32, 128),
    ]
    bmm = [
        (8, 64, 64, 64),
        (4, 128, 256, 688),
        (8, 33, 96, 200),
        (16, 128, 64, 128),
        (2, 300, 500, 100),
        (32, 64, 32, 64),
        (8, 96, 384, 768),
        (6, 256, 256, 64),
    ]
    # (b, heads, seq, head_dim, kv_heads, causal): every size both causal and bidirectional.
    attn = [
        (b, h, s, d, kv, c)
        for (b, h, s, d, kv) in (
            (1, 4, 128, 64, 2),
            (2, 8, 256, 32, 8),
            (1, 6, 200, 64, 6),
            (4, 2, 64, 128, 1),
            (1, 12, 320, 64, 4),
            (2, 4, 96, 80, 4),
            (1, 16, 512, 32, 16),
            (8, 4, 32, 64, 4),
            (3, 6, 160, 64, 3),
            (1, 8, 448, 64, 8),
        )
        for c in (True, False)
    ]
    rows_h = [
        (256, 256),
        (1000, 384),
        (4096, 128),
        (130, 1536),
        (2048, 1024),
        (64, 4000),
        (512, 2560),
        (77, 768),
    ]
    embed = [(4096, 256, 512), (32000, 128, 1024), (8000, 512, 200), (1000, 1024, 2048)]
    moe = [(512, 256, 512), (1025, 384, 2048), (257, 1024, 512), (4097, 128, 8192)]
    # MoE routing glue (tokens, experts, top-k, hidden): scores, top-k, slot bookkeeping,
    # combine. Generic sizes, not any traced family's.
    route = [
        (100, 4, 1, 128),
        (300, 16, 2, 256),
        (1000, 8, 2, 96),
        (2048, 64, 4, 64),
        (640, 32, 1, 512),
    ]
    if quick:
        mnk, bmm, attn, rows_h, embed, moe = (
            mnk[:3],
            bmm[:1],
            attn[:1],
            rows_h[:2],
            embed[:1],
            moe[:1],
        )
        route = route[:1]
    for dt in dtypes:
        for i, (m, n, k) in enumerate(mnk):
            yield Job(
                "sweep",
                "gemm",
                synth_op(f"mm{i}", OpKind.MATMUL, mm_t, (T((m, k), dt), T((k, n), dt))),
            )
            if i % 2 == 0:
                ins = (T((n,), dt), T((m, k), dt), T((k, n), dt))
                yield Job("sweep", "gemm", synth_op(f"addmm{i}", OpKind.MATMUL, addmm_t, ins))
        for i, (b, m, n, k) in enumerate(bmm):
            ins = (T((b, m, k), dt), T((b, k, n), dt))
            yield Job("sweep", "bmm", synth_op(f"bmm{i}", OpKind.EXPERTS, bmm_t, ins))
        for i, (b, h, s, d, kvh, causal) in enumerate(attn):
            ins = (T((b, h, s, d), dt), T((b, kvh, s, d), dt), T((b, kvh, s, d), dt))
            attrs = (("causal", causal), ("head_dim", d), ("heads", h), ("kv_heads", kvh))
            yield Job("sweep", "sdpa", synth_op(f"sdpa{i}", OpKind.ATTENTION, sdpa, ins, attrs))
        for i, (r, h) in enumerate(rows_h):
            x = T((r, h), dt)
            ln = (x, T((h,), dt), T((h,), dt))
            yield Job(
                "sweep",
                "norm",
                synth_op(f"ln{i}", OpKind.NORM, "aten.native_layer_norm.default", ln),
            )
            yield Job(
                "sweep",
                "softmax",
                synth_op(f"sm{i}", OpKind.SOFTMAX, "aten._softmax.default", (x,)),
            )
            for p in ("add", "mul"):
                tgt = f"aten.{p}.Tensor"
                yield Job(
                    "sweep", "elementwise", synth_op(f"{p}{i}", OpKind.ELEMENTWISE, tgt, (x, x))
                )
            # broadcasts: a [s, h] table over a batch (learned positions), a bias row
            b3 = (2 + i % 3, r, h)
            ins = (T(b3, dt), T((r, h), dt))
            yield Job(
                "sweep",
                "elementwise",
                synth_op(f"badd{i}", OpKind.ELEMENTWISE, "aten.add.Tensor", ins),
            )
            ins = (T((r, h), dt), T((h,), dt))
            yield Job(
                "sweep",
                "elementwise",
                synth_op(f"bmul{i}", OpKind.ELEMENTWISE, "aten.mul.Tensor", ins),
            )
            for p in ("silu", "gelu"):
                tgt = f"aten.{p}.default"
                yield Job(
                    "sweep", "elementwise", synth_op(f"{p}{i}", OpKind.ELEMENTWISE, tgt, (x,))
                )
            # RMS norm as the tracer sees it: pow, mean, rsqrt, mul by the row scale.
            x32 = T((r, h), "float32")
            yield Job(
                "sweep",
                "rmsnorm",
                synth_op(f"pow{i}", OpKind.NORM, "aten.pow.Tensor_Scalar", (x32,)),
            )
            yield Job(
                "sweep",
                "rmsnorm",
                synth_op(
                    f"mean{i}",
                    OpKind.NORM,
                    "aten.mean.dim",
                    (x32,),
                    outputs=(T((r, 1), "float32"),),
                ),
            )
            row = T((r, 1), "float32")
            yield Job(
                "sweep", "rmsnorm", synth_op(f"rmul{i}", OpKind.NORM, "aten.mul.Tensor", (x32, row))
            )
        for i, (v, h, n) in enumerate(embed):
            ins = (T((v, h), dt), T((n,), "int64"))
            yield Job(
                "sweep",
                "embedding",
                synth_op(f"emb{i}", OpKind.EMBEDDING, "aten.embedding.default", ins),
            )
        for i, (rows, h, n) in enumerate(moe):
            ins = (T((rows, h), dt), T((n,), "int64"))
            yield Job(
                "sweep",
                "moe",
                synth_op(f"isel{i}", OpKind.DATA_MOVEMENT, "aten.index_select.default", ins),
            )
            sc = (T((rows,), "int64"), T((min(n, rows),), "int64"), T((min(n, rows),), "int64"))
            yield Job(
                "sweep", "moe", synth_op(f"scat{i}", OpKind.DATA_MOVEMENT, "aten.scatter.src", sc)
            )
        for i, (t, e, k, h) in enumerate(route):
            for j in yield_routing(f"r{i}", t, e, k, h, dt):
                yield Job("sweep", "router", j)


def yield_routing(tag: str, t: int, e: int, k: int, h: int, dt: str) -> Iterator[Op]:
    """The small ops of top-k routing and static-capacity dispatch at one size."""
    T = TensorMeta
    n = t * k
    f32, i64 = "float32", "int64"
    yield synth_op(f"{tag}sm", OpKind.ROUTER, "aten._softmax.default", (T((t, e), f32),))
    yield synth_op(
        f"{tag}topk", OpKind.ROUTER, "aten.topk.default", (T((t, e), f32),), attrs=(("k", k),)
    )
    yield synth_op(
        f"{tag}ksum",
        OpKind.ROUTER,
        "aten.sum.dim_IntList",
        (T((t, k), f32),),
        outputs=(T((t, 1), f32),),
    )
    yield synth_op(f"{tag}kdiv", OpKind.ROUTER, "aten.div.Tensor", (T((t, k), f32), T((t, 1), f32)))
    yield synth_op(f"{tag}eq", OpKind.ELEMENTWISE, "aten.eq.Tensor", (T((n, 1), i64), T((e,), i64)))
    yield synth_op(f"{tag}cumsum", OpKind.REDUCTION, "aten.cumsum.default", (T((n, e), i64),))
    yield synth_op(
        f"{tag}isum",
        OpKind.REDUCTION,
        "aten.sum.dim_IntList",
        (T((n, e), i64),),
        outputs=(T((n,), i64),),
    )
    yield synth_op(
        f"{tag}imul", OpKind.ELEMENTWISE, "aten.mul.Tensor", (T((n, e), i64), T((n, e), i64))
    )
    yield synth_op(f"{tag}lt", OpKind.ELEMENTWISE, "aten.lt.Scalar", (T((n,), i64),))
    yield synth_op(
        f"{tag}where",
        OpKind.ELEMENTWISE,
        "aten.where.self",
        (T((n,), "bool"), T((n,), i64), T((), i64)),
    )
    yield synth_op(
        f"{tag}full", OpKind.DATA_MOVEMENT, "aten.full.default", (), outputs=(T((n + 1,), i64),)
    )
    yield synth_op(
        f"{tag}zeros",
        OpKind.DATA_MOVEMENT,
        "aten.new_zeros.default",
        (T((t, h), dt),),
        outputs=(T((1, h), dt),),
    )
    yield synth_op(
        f"{tag}cat",
        OpKind.DATA_MOVEMENT,
        "aten.cat.default",
        (T((t, h), dt), T((1, h), dt)),
        outputs=(T((t + 1, h), dt),),
    )
    yield synth_op(
        f"{tag}wmul", OpKind.ELEMENTWISE, "aten.mul.Tensor", (T((n, h), dt), T((n, 1), dt))
    )
    yield synth_op(
        f"{tag}combine",
        OpKind.REDUCTION,
        "aten.sum.dim_IntList",
        (T((t, k, h), dt),),
        outputs=(T((t, h), dt),),
    )


# ---------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------


def backfill_timed_counts(path: Path) -> int:
    """Add `timed` (the replay's counts, `replay_counts`) to every row of `path` lacking it.

    Rewrites the file (one gzip member per device record, as written). Counting runs each
    distinct op once on the CPU without timing it. Returns the number of rows filled.
    """
    with gzip.open(path, "rt", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    cache: dict[str, dict] = {}
    filled = 0
    for rec in recs:
        if rec["type"] != "row" or "timed" in rec:
            continue
        key = json.dumps(rec["op"], sort_keys=True)
        if key not in cache:
            cache[key] = replay_counts(op_from_dict(rec["op"])).to_dict()
        rec["timed"] = cache[key]
        rec["v"] = SCHEMA_VERSION
        filled += 1
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as raw:
        member: list[str] = []
        for rec in [*recs, None]:
            if rec is None or (rec["type"] == "device" and member):
                raw.write(gzip.compress("".join(member).encode()))
                member = []
            if rec is not None:
                member.append(json.dumps(rec) + "\n")
    tmp.replace(path)
    return filled


# ---------------------------------------------------------------------------------------------
# The profiling run
# ---------------------------------------------------------------------------------------------


def run_profile(
    output: Path | None = None,
    *,
    families: Iterable[str] | None = None,
    dtypes: Iterable[str] = ("float32", "bfloat16"),
    sweep: bool = True,
    quick: bool = False,
    max_seconds: float = 0.12,
    threads: int | None = 1,
    device: str | None = None,
    progress: bool = True,
    seed: int | None = None,
) -> tuple[Path, int, int]:
    """Profile the IR's ops on `device` (default: CUDA when present, else CPU) and append.

    `threads` pins CPU threads (default 1: steady numbers on a shared host; the descriptor
    records it). Jobs run in a random order (`seed`; default: a fresh one per run).
    Returns (dataset path, rows written, ops skipped for lack of a recipe).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu" and threads:
        torch.set_num_threads(threads)
    dtypes = tuple(dtypes)
    if dev.type == "cpu" and "float16" in dtypes:
        dtypes = tuple(d for d in dtypes if d != "float16")  # slow emulation on most CPUs
    desc = describe_device(dev, dtypes, quick=quick)
    jobs: list[Job] = []
    if families is None or set(families) - {"sweep"}:
        fam = None if families is None else [f for f in families if f != "sweep"]
        jobs += list(model_ops(fam, dtypes))
    if sweep and (families is None or "sweep" in set(families)):
        jobs += list(sweep_ops(dtypes, quick=quick))
    if quick:
        jobs = jobs[:: max(1, len(jobs) // 40)]
    # Random order: slow drifts of a shared host (other processes, clocks) then spread over
    # every family and dtype instead of biasing whichever ran during them.
    random.Random(seed).shuffle(jobs)
    rows: list[dict] = []
    skipped = 0
    path = Path(output) if output else default_path(desc)

    bar = None
    if progress:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        bar = Progress(
            TextColumn("profile {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        bar.start()
        task = bar.add_task(dev.type, total=len(jobs))
    try:
        for job in jobs:
            if bar is not None:
                bar.update(task, advance=1, description=f"{job.model}:{job.op.name}")
            try:
                timed = time_op(job.op, dev, max_seconds=max_seconds)
                counts = replay_counts(job.op).to_dict()
            except NoRecipe:
                skipped += 1
                continue
            for backward, m in ((False, timed.fwd), (True, timed.bwd)):
                if m is None:
                    continue
                rows.append(
                    {
                        "family": job.family,
                        "model": job.model,
                        "backward": backward,
                        "dtype": _float_dtype(job.op),
                        "flops": job.op.bwd_flops if backward else job.op.fwd_flops,
                        "bytes": job.op.bwd_bytes if backward else job.op.fwd_bytes,
                        "seconds": m.seconds,
                        "samples": m.samples,
                        "dropped": m.dropped,
                        "spread": round(m.spread, 4),
                        "min_seconds": m.min_seconds,
                        "op": op_to_dict(job.op),
                        "timed": counts,
                    }
                )
    finally:
        if bar is not None:
            bar.stop()
    # Peaks: never below what any profiled GEMM achieved (the roofline must bound every row).
    best = dict(desc.peak_flops)
    for r in rows:
        if r["op"]["kind"] in (OpKind.MATMUL.value, OpKind.EXPERTS.value) and r["flops"]:
            best[r["dtype"]] = max(best.get(r["dtype"], 0.0), r["flops"] / r["seconds"])
    desc = dataclasses.replace(desc, peak_flops=tuple(sorted(best.items())))
    if rows:
        append_dataset(path, desc, rows)
    return path, len(rows), skipped
