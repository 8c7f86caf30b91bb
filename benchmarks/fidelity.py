"""Fidelity of `meshplan.estimate` against published training runs (issue 3, item 6).

For every row of `shared/reference/published_runs_calibration.csv` this script builds the
row's model with the zoo, a cluster matching the row's hardware and the row's parallel
configuration, runs `meshplan.estimate`, converts the row's measured metric to a step time
with the row's own FLOP convention, and prints predicted vs measured step time (and peak
memory where the row gives it), then the median and p90 absolute errors.

    python benchmarks/fidelity.py                 # table + summary
    python benchmarks/fidelity.py --json out.json # also write every row as JSON
    python benchmarks/fidelity.py --cache /tmp/mp # keep traced graphs between runs

How each source's rows are read (see also docs/fidelity.md):

- **Korthikanti et al. 2022, Table 5** (Selene, A100-80GB, 8 GPUs/node, 8 x HDR IB):
  `iteration_time_s` is the step. GPT style, vocab 51200 (the Megatron GPT-2 BPE padded to
  51200, as calculon's validation configs use), tied embeddings, bf16, ZeRO-0 (dp=1).
  "full" -> full recompute, no sequence parallel; "selective+sequence_parallel" ->
  selective recompute + SP. "virtual pipeline stages=3" -> interleaved 1F1B with v=3.
- **Megatron-LM README (2020)** (DGX-2 V100: 16 GPUs/node on NVSwitch; DGX A100):
  `iteration_time_ms` is the step. vocab 51200, fp16, tied embeddings. The micro-batch is the
  whole per-replica batch (2020 Megatron had no pipeline), and recompute is *full*: the
  README's TFLOP/s per GPU equal 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) / t, the
  with-recomputation formula of Narayanan et al. (SC'21, eq. 3); the script checks that.
- **Megatron-Core r0.8.0 README table** (H100 SXM, DGX H100: 8 x NDR 400 Gb/s per node):
  `model_tflops_per_gpu` -> step = F / (value * gpus) with Megatron's model FLOPs
  F = 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (Narayanan et al., eq. 3 without recompute;
  Megatron's `num_floating_point_operations` for ffn = 4h, no GQA), V = 131072. Not stated
  by the row, assumed: micro-batch 1, no recompute, distributed optimizer (ZeRO-1), sequence
  parallel with TP, plain 1F1B (no virtual stages: Megatron's default). The rows enable
  `--tp-comm-overlap`, which meshplan does not model (TP traffic is priced exposed).
- **torchtitan** (Grand Teton H100 96GB HBM2e @500W, 8/node, 400 Gb/s RDMA per GPU; A100
  rows: DGX A100): `tokens_per_sec_per_gpu` -> step = global_batch * seq / (tps * gpus).
  Llama 3.1 presets. FSDP -> ZeRO-3; 2D -> TP (with sequence parallel) x FSDP. The micro-batch
  column is torchtitan's local batch (no gradient accumulation). torchtitan "selective" and
  "selective (op)" (its default op-level SAC: saves every other matmul of a layer) are priced
  with the `torchtitan_op` policy, "selective (layer)" (every second layer checkpointed) with
  `every_other_layer` (`meshplan.cost_model.recompute`). `peak_mem_GiB` is torch's max
  *reserved* memory, which excludes the CUDA context: it is compared with the predicted peak
  minus `CONTEXT_BYTES`.

Excluded (listed with the reason in the output): rows without a parallel configuration,
Float8 rows and async-TP rows (not modelled). bf16 rows with torch.compile are not counted in
the summary either (meshplan prices eager kernels); they are shown separately.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import pickle
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "reference" / "published_runs_calibration.csv"
GiB = 2**30


# ---------------------------------------------------------------------------------------------
# Row interpretation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """A zoo transformer: `meshplan.models.transformer` arguments or a preset name."""

    preset: str | None = None
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    ffn: int = 0
    vocab: int = 0
    style: str = "gpt"
    attention: str = "flash"  # "flash" (fused SDPA) or "math" (materialised scores)

    def key(self, seq_len: int) -> str:
        if self.preset:
            return f"{self.preset}-s{seq_len}-{self.attention}"
        return (
            f"{self.style}-l{self.layers}-h{self.hidden}-a{self.heads}-f{self.ffn}"
            f"-v{self.vocab}-s{seq_len}-{self.attention}"
        )


@dataclass
class Case:
    """One CSV row, interpreted."""

    row: int  # 1-based data row of the CSV
    source: str
    model: str
    metric: str
    value: float
    gpus: int
    gpu_type: str
    arch: Arch | None = None
    seq_len: int = 0
    cluster: str = ""  # key of CLUSTERS
    parallel: dict = field(default_factory=dict)
    dtype: str = "bfloat16"
    selective_policy: str = "keep_linear"  # meshplan.cost_model.recompute.SelectivePolicy
    engine: dict = field(default_factory=dict)  # meshplan.cost_model.engine.Engine fields
    measured_step_s: float = math.nan
    conversion: str = ""
    measured_mem_gib: float | None = None
    status: str = "counted"  # counted | side (torch.compile) | excluded
    reason: str = ""
    # filled by the run
    predicted_step_s: float = math.nan
    predicted_mem_gib: float | None = None
    breakdown: dict = field(default_factory=dict)

    @property
    def step_error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1

    @property
    def mem_error(self) -> float | None:
        if self.measured_mem_gib is None or self.predicted_mem_gib is None:
            return None
        return self.predicted_mem_gib / self.measured_mem_gib - 1


def _int(x: str) -> int | None:
    x = (x or "").strip()
    return int(float(x)) if x else None


def megatron_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron-LM model FLOPs per step (Narayanan et al. SC'21 eq. 3 without recompute):
    72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))


def megatron_hw_flops_with_recompute(
    batch: int, seq: int, layers: int, hidden: int, vocab: int
) -> float:
    """The same with full recomputation (eq. 3 as printed): 96 B s l h^2 (1 + s/(6h) + V/(16lh))."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


def _notes_float(notes: str, key: str) -> float | None:
    m = re.search(re.escape(key) + r"\s*=\s*([0-9.]+)", notes)
    return float(m.group(1)) if m else None


def interpret(i: int, r: dict[str, str]) -> Case:
    """Turn one CSV row into a Case (or an excluded one, with the reason)."""
    src, notes = r["source"], r["notes"]
    gpus = _int(r["gpus"]) or 0
    case = Case(
        row=i,
        source=src,
        model=r["model"],
        metric=r["measured_metric"],
        value=float(r["measured_value"]),
        gpus=gpus,
        gpu_type=r["gpu_type"],
    )
    tp, pp, dp, cp = (_int(r[k]) for k in ("tp", "pp", "dp", "cp"))
    if tp is None or pp is None or dp is None:
        case.status, case.reason = "excluded", "parallel configuration not stated by the source"
        return case
    low = notes.lower().replace("float8 mfu not comparable", "")
    if "rowwise" in low:
        case.status, case.reason = "excluded", "Float8 rowwise scaling (its kernels not modelled)"
        return case
    engine: dict = {}
    if "float8" in low:  # torchao's tensorwise recipe, the default of these runs
        engine["float8"] = "tensorwise"
        engine["float8_all_gather"] = "float8 all-gather" in low
    if "asynctp" in low or "async tp" in low or ("tp-comm-overlap" in low and (tp or 1) > 1):
        engine["tp_overlap"] = True
    if "torch.compile" in low or not src.startswith("pytorch/torchtitan"):
        engine["fused"] = True  # torch.compile, or Megatron-LM's fused kernels
    case.engine = engine
    seq = _int(r["seq_len"]) or 0
    layers, hidden, heads = _int(r["layers"]), _int(r["hidden"]), _int(r["heads"])
    gb = _int(r["global_batch"])
    mb = _int(r["micro_batch"])
    rc_raw = r["recompute"].strip().lower()
    case.seq_len = seq
    case.measured_mem_gib = _notes_float(notes, "peak_mem_GiB")
    cp = cp or 1
    par: dict = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": 1, "global_batch": gb}

    if src.startswith("Korthikanti") and r["measured_metric"] == "iteration_time_s":
        case.arch = Arch(None, layers, hidden, heads, 4 * hidden, 51200, "gpt", "math")
        case.cluster = "dgx-a100"
        full = rc_raw.startswith("full")
        par |= {
            "micro_batch": mb,
            "recompute": "full" if full else "selective",
            "sequence_parallel": not full,
            "zero": 0,
        }
        v = _notes_float(notes, "virtual pipeline stages")
        if v and v > 1:
            par |= {"schedule": "interleaved_1f1b", "virtual_stages": int(v)}
        case.measured_step_s = case.value
        case.conversion = "iteration time"
    elif "Megatron-LM README (2020" in src:
        vocab = 51200
        case.arch = Arch(None, layers, hidden, heads, 4 * hidden, vocab, "gpt", "math")
        case.cluster = "dgx2-v100" if "V100" in r["gpu_type"] else "dgx-a100"
        case.dtype = "float16"
        par |= {"micro_batch": gb // dp, "recompute": "full", "zero": 0}
        case.measured_step_s = case.value / 1000
        tflops = _notes_float(notes, "TFLOP/s per GPU")
        hw = megatron_hw_flops_with_recompute(gb, seq, layers, hidden, vocab)
        implied = hw / (case.measured_step_s * gpus) / 1e12
        case.conversion = (
            f"iteration time; stated {tflops} TFLOP/s/GPU vs {implied:.1f} from the "
            "recompute formula"
        )
    elif src.startswith("NVIDIA/Megatron-LM README 'Performance Benchmarking'"):
        vocab = 131072
        case.arch = Arch(None, layers, hidden, heads, 4 * hidden, vocab, "gpt")
        case.cluster = "dgx-h100"
        par |= {"micro_batch": 1, "recompute": "none", "zero": 1}
        flops = megatron_model_flops(gb, seq, layers, hidden, vocab)
        case.measured_step_s = flops / (case.value * 1e12 * gpus)
        case.conversion = "72Bslh^2(1+s/6h+V/12lh) / (TFLOP/s * gpus)"
    elif src.startswith("pytorch/torchtitan"):
        size = r["model"].split()[-1].lower()  # 8B / 70B / 405B
        case.arch = Arch(f"llama3-{size}")
        gt = r["gpu_type"]
        case.cluster = "dgx-a100" if "A100" in gt else "h200" if "H200" in gt else "grand-teton"
        rc = "full" if rc_raw.startswith("full") else "selective"
        # torchtitan's selective AC: "op" (its default) saves every other mm; "layer"
        # checkpoints every second layer (meshplan.cost_model.recompute).
        if rc == "selective":
            case.selective_policy = "every_other_layer" if "layer" in rc_raw else "torchtitan_op"
        par |= {"micro_batch": mb or gb // dp, "recompute": rc, "zero": 3}
        if pp > 1 and not mb:
            # torchtitan (2024) splits the local batch into as many micro-batches as there are
            # pipeline stages unless told otherwise (`pipeline_parallel_microbatches`: "the
            # default value will be the number of pipeline stages").
            par["micro_batch"] = max(1, gb // dp // pp)
            # ... and FSDP under PP does not reshard after forward (torchtitan's default
            # `reshard_after_forward` policy with PP): weights stay gathered and gradients
            # accumulate unsharded across the micro-batches, reduce-scattered once a step:
            # ZeRO-1's memory with one all-gather and one reduce-scatter per step.
            par["zero"] = 1
            if "interleaved" in low:
                case.status = "excluded"
                case.reason = "interleaved 1F1B with unstated split points (126 layers / pp 8)"
                return case
        case.measured_step_s = gb * seq / (case.value * gpus)
        case.conversion = "global_batch * seq / (tokens/s/GPU * gpus)"
    else:
        case.status, case.reason = "excluded", "no recipe for this source"
        return case
    if par.get("micro_batch") is None:
        case.status, case.reason = "excluded", "micro-batch not stated"
        return case
    case.parallel = par
    return case


# ---------------------------------------------------------------------------------------------
# Clusters
# ---------------------------------------------------------------------------------------------


def build_cluster(kind: str, gpus: int):
    """The row's hardware as a meshplan Cluster."""
    from meshplan.ir import Cluster, DeviceGroup
    from meshplan.ir.hardware import H100_96GB_500W, LINK_TIERS, gpu_spec

    if kind == "dgx-a100":  # Selene / DGX A100: 8 x A100-80GB, NVLink3, 8 x HDR 200 Gb/s
        gpu, per_node, intra, inter, nics = "A100-80GB", 8, "nvlink3", "ib-hdr", 8
    elif kind == "dgx-h100":  # DGX H100 (Eos): 8 x H100 SXM, NVLink4, 8 x NDR 400 Gb/s
        gpu, per_node, intra, inter, nics = "H100", 8, "nvlink4", "ib-ndr", 8
    elif kind == "grand-teton":  # Meta Grand Teton: 8 x H100 96GB @500W, 400 Gb/s RDMA per GPU
        gpu, per_node, intra, inter, nics = "H100-96GB-500W", 8, "nvlink4", "roce-400g", 8
    elif kind == "h200":  # H200 SXM, 8/node on NVLink4, one 400 Gb/s ConnectX-7 per GPU
        gpu, per_node, intra, inter, nics = "H200", 8, "nvlink4", "ib-ndr", 8
    elif kind == "dgx2-v100":  # DGX-2: 16 x V100 32GB on NVSwitch, 8 x EDR 100 Gb/s
        gpu, per_node, intra, inter, nics = "V100", 16, "nvlink2", "ib-edr", 8
    else:
        raise ValueError(kind)
    nodes = max(1, gpus // per_node)
    per_node = min(per_node, gpus)
    spec = H100_96GB_500W if gpu == H100_96GB_500W.name else gpu_spec(gpu)
    group = DeviceGroup(
        name="g",
        gpu=spec,
        nodes=nodes,
        gpus_per_node=per_node,
        intra_link=intra,
        inter_link=inter if nodes > 1 else "",
        nics_per_node=nics,
    )
    links = tuple(LINK_TIERS[n] for n in ([intra, inter] if nodes > 1 else [intra]))
    return Cluster(f"{kind}-{gpus}", (group,), links)


# ---------------------------------------------------------------------------------------------
# Tracing (cached per architecture and sequence length)
# ---------------------------------------------------------------------------------------------

_GRAPHS: dict[str, object] = {}


def graph_for(arch: Arch, seq_len: int, cache_dir: Path | None):
    """The traced graph of `arch` at `seq_len` (micro-batch 1), memoised and optionally kept
    on disk (keyed by the architecture, torch version and tracer source)."""
    import torch
    from meshplan import models
    from meshplan.ir import trace

    key = arch.key(seq_len)
    if key in _GRAPHS:
        return _GRAPHS[key]
    path = None
    if cache_dir is not None:
        import importlib

        h = hashlib.sha256(torch.__version__.encode())
        for name in ("meshplan.ir.trace", "meshplan.ir.lower", "meshplan.ir.flops"):
            h.update(Path(importlib.import_module(name).__file__).read_bytes())
        path = cache_dir / f"{key}-{h.hexdigest()[:12]}.pkl"
        if path.exists():
            _GRAPHS[key] = pickle.loads(path.read_bytes())
            return _GRAPHS[key]
    if arch.preset:
        model, inputs = models.get(arch.preset, seq_len=seq_len)
    else:
        model, inputs = models.transformer(
            layers=arch.layers,
            hidden=arch.hidden,
            heads=arch.heads,
            ffn=arch.ffn,
            vocab=arch.vocab,
            seq_len=seq_len,
            style=arch.style,
            tie_embeddings=True,
        )
    if arch.attention == "math":  # unfused attention: scores and softmax materialised
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            graph = trace(model, *inputs, name=key)
    else:
        graph = trace(model, *inputs, name=key)
    _GRAPHS[key] = graph
    if path is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(graph))
        os.replace(tmp, path)
    return graph


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


def run_case(case: Case, cache_dir: Path | None) -> None:
    """Estimate one counted/side case in place."""
    from meshplan.cost_model.memory import CONTEXT_BYTES
    from meshplan.cost_model.simulate import predict
    from meshplan.ir import Parallel
    from meshplan.passes.partition import even_stages, place_stages

    assert case.arch is not None
    graph = graph_for(case.arch, case.seq_len, cache_dir)
    cluster = build_cluster(case.cluster, case.gpus)
    par = Parallel(**case.parallel)
    from meshplan.api import check_config, complete_parallel
    from meshplan.cost_model.engine import Engine

    p = complete_parallel(graph, cluster, par)
    check_config(graph, cluster, p, par)
    stages = place_stages(cluster, p, even_stages(graph, p.pp))
    pred = predict(
        graph,
        cluster,
        p,
        stages,
        dtype=case.dtype,
        selective_policy=case.selective_policy,
        engine=Engine(**case.engine),
    )
    case.predicted_step_s = pred.step_time_s
    case.breakdown = {k: round(v, 6) for k, v in pred.breakdown}
    if case.measured_mem_gib is not None:
        case.predicted_mem_gib = (pred.peak_memory_bytes - CONTEXT_BYTES) / GiB


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of `xs`, q in [0, 100]."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(cases: list[Case]) -> dict:
    counted = [c for c in cases if c.status == "counted"]
    step = [abs(c.step_error) for c in counted]
    mem = [abs(c.mem_error) for c in counted if c.mem_error is not None]
    return {
        "rows": len(cases),
        "counted": len(counted),
        "side": sum(c.status == "side" for c in cases),
        "excluded": sum(c.status == "excluded" for c in cases),
        "step_median_abs_error": statistics.median(step) if step else math.nan,
        "step_p90_abs_error": percentile(step, 90),
        "memory_rows": len(mem),
        "memory_median_abs_error": statistics.median(mem) if mem else math.nan,
    }


def _short_source(src: str) -> str:
    if src.startswith("Korthikanti") and "Table 5" in src:
        return "Korthikanti T5"
    if src.startswith("Korthikanti"):
        return "Korthikanti abstract"
    if "2020" in src:
        return "Megatron 2020"
    if "Strong Scaling" in src:
        return "Megatron strong"
    if "Megatron-LM README" in src:
        return "Megatron-Core"
    if "performance.md" in src:
        return "torchtitan perf.md"
    if "asyncTP" in src:
        return "torchtitan asyncTP"
    if "h200" in src.lower():
        return "torchtitan H200"
    m = re.search(r"Table (\d+)", src)
    return f"torchtitan T{m.group(1)}" if m else src[:20]


def _config_str(c: Case) -> str:
    p = c.parallel
    s = f"tp{p['tp']} pp{p['pp']} dp{p['dp']}"
    if p.get("cp", 1) > 1:
        s += f" cp{p['cp']}"
    if p.get("virtual_stages"):
        s += f" v{p['virtual_stages']}"
    return s + f" mb{p['micro_batch']} gb{p['global_batch']} {p['recompute']} z{p['zero']}"


def print_report(cases: list[Case], out=sys.stdout) -> None:
    w = out.write
    hdr = (
        f"{'row':>3} {'source':<19} {'model':<18} {'gpus':>5} {'config':<40} "
        f"{'meas s':>8} {'pred s':>8} {'err':>7} {'mem meas':>8} {'pred':>6} {'err':>6}\n"
    )
    for status, title in (
        ("counted", "Counted rows"),
        ("side", "Rows with unmodelled features (not counted: torch.compile, TP comm overlap)"),
    ):
        rows = [c for c in cases if c.status == status]
        if not rows:
            continue
        w(f"\n{title}\n" + hdr)
        for c in rows:
            mm = f"{c.measured_mem_gib:8.1f}" if c.measured_mem_gib is not None else " " * 8
            pm = f"{c.predicted_mem_gib:6.1f}" if c.predicted_mem_gib is not None else " " * 6
            me = f"{c.mem_error:+6.1%}" if c.mem_error is not None else " " * 6
            w(
                f"{c.row:>3} {_short_source(c.source):<19} {c.model[:18]:<18} {c.gpus:>5} "
                f"{_config_str(c):<40} {c.measured_step_s:8.3f} {c.predicted_step_s:8.3f} "
                f"{c.step_error:+7.1%} {mm} {pm} {me}\n"
            )
    ex = [c for c in cases if c.status == "excluded"]
    if ex:
        w("\nExcluded rows\n")
        for c in ex:
            w(f"{c.row:>3} {_short_source(c.source):<19} {c.model[:24]:<24} {c.reason}\n")
    s = summarize(cases)
    w(
        f"\n{s['counted']} rows counted, {s['side']} rows with unmodelled features shown apart, "
        f"{s['excluded']} excluded\n"
        f"step time: median |error| {s['step_median_abs_error']:.1%}, "
        f"p90 {s['step_p90_abs_error']:.1%}\n"
        f"peak memory: median |error| {s['memory_median_abs_error']:.1%} "
        f"over {s['memory_rows']} rows\n"
    )


def _gpu_of(case: Case) -> str:
    return {
        "dgx-a100": "A100-80GB",
        "dgx-h100": "H100",
        "grand-teton": "H100-96GB-500W",
        "dgx2-v100": "V100",
        "h200": "H200",
    }[case.cluster]


def _rerun(cases: list[Case], cache_dir: Path | None) -> None:
    from meshplan.cost_model import simulate

    simulate._MODEL_CACHE.clear()
    simulate._PRICER_CACHE.clear()
    for c in cases:
        run_case(c, cache_dir)


# Bounds of a fitted GEMM efficiency: hardware.md's "70-90% of peak for large GEMMs" at the
# top (a fit that wants more is absorbing a modelling error elsewhere), 0.3 at the bottom.
FIT_RANGE = (0.3, 0.9)


def _fit_fields():
    """(field, rows it is fitted on, bisection range) in coordinate-descent order. The
    attention efficiency (forward and backward scaled together from the type's published
    kernel numbers) is fitted on long-sequence rows, where attention is most of the step."""
    return (
        ("attention", lambda c: c.seq_len >= 32768, (0.3, 1.5)),
        ("gemm", lambda c: not c.engine.get("float8"), FIT_RANGE),
        ("gemm_fp8", lambda c: bool(c.engine.get("float8")), FIT_RANGE),
    )


def _with(eff, name: str, value: float, base):
    import dataclasses as dc

    if name == "attention":
        return dc.replace(
            eff,
            attention_fwd=min(FIT_RANGE[1], base.attention_fwd * value),
            attention_bwd=min(FIT_RANGE[1], base.attention_bwd * value),
        )
    return dc.replace(eff, **{name: value})


def fit_gemm_efficiency(
    cases: list[Case], cache_dir: Path | None, out=sys.stdout, passes: int = 4
) -> dict:
    """Per GPU type, the kernel efficiencies that zero the median signed step-time error of
    that type's counted rows: attention (on its long-sequence rows), then bf16 GEMMs (rows
    without Float8), then FP8 GEMMs (Float8 rows), by bisection (the error falls as an
    efficiency rises), four times round (coordinate descent). A field needs at least 3 rows
    of its kind to be fitted. Prints the values `cost_model/compute.KERNEL_EFFICIENCY` is
    set from; changes nothing on disk."""
    from meshplan.cost_model import compute

    counted = [c for c in cases if c.status == "counted"]
    fitted: dict[str, dict[str, float]] = {}
    for gpu in sorted({_gpu_of(c) for c in counted}):
        base = compute.KERNEL_EFFICIENCY.get(gpu, compute.DEFAULT_EFFICIENCY)
        eff = base
        fitted[gpu] = {}
        for _ in range(passes):
            for name, pick, (lo, hi) in _fit_fields():
                rows = [c for c in counted if _gpu_of(c) == gpu and pick(c)]
                if len(rows) < 3:
                    continue
                for _ in range(14):
                    mid = (lo + hi) / 2
                    compute.KERNEL_EFFICIENCY[gpu] = _with(eff, name, mid, base)
                    _rerun(rows, cache_dir)
                    med = statistics.median(c.step_error for c in rows)
                    lo, hi = (mid, hi) if med > 0 else (lo, mid)
                fitted[gpu][name] = round((lo + hi) / 2, 3)
                eff = _with(eff, name, fitted[gpu][name], base)
                compute.KERNEL_EFFICIENCY[gpu] = eff
                fitted[gpu][name + "_rows"] = [c.row for c in rows]
        compute.KERNEL_EFFICIENCY[gpu] = base
        for name, _, _ in _fit_fields():
            if name in fitted[gpu]:
                v = fitted[gpu][name]
                detail = (
                    f"x{v:.3f}: fwd {eff.attention_fwd:.3f}, bwd {eff.attention_bwd:.3f}"
                    if name == "attention"
                    else f"{v:.3f}"
                )
                rows = fitted[gpu][name + "_rows"]
                out.write(f"{gpu:<16} {name:<9} {detail}  ({len(rows)} rows: {rows})\n")
    return fitted


def leave_one_out(cases: list[Case], cache_dir: Path | None, out=sys.stdout) -> dict:
    """Each counted row predicted with its GPU type's efficiencies refitted without it (one
    coordinate-descent pass from the shipped values, brackets of +-0.15 around them): how
    the cost model does on a published run it was not fitted on. Returns the summary."""
    from meshplan.cost_model import compute

    counted = [c for c in cases if c.status == "counted"]
    shipped = dict(compute.KERNEL_EFFICIENCY)
    errors: dict[int, float] = {}
    for held in counted:
        gpu = _gpu_of(held)
        base = shipped.get(gpu, compute.DEFAULT_EFFICIENCY)
        eff = base
        for name, pick, (lo0, hi0) in _fit_fields():
            rows = [c for c in counted if _gpu_of(c) == gpu and pick(c) and c is not held]
            if len(rows) < 3:
                continue
            now = 1.0 if name == "attention" else getattr(eff, name) or eff.gemm
            lo, hi = max(lo0, now - 0.15), min(hi0, now + 0.15)
            for _ in range(10):
                mid = (lo + hi) / 2
                compute.KERNEL_EFFICIENCY[gpu] = _with(eff, name, mid, eff)
                _rerun(rows, cache_dir)
                med = statistics.median(c.step_error for c in rows)
                lo, hi = (mid, hi) if med > 0 else (lo, mid)
            eff = _with(eff, name, (lo + hi) / 2, eff)
        compute.KERNEL_EFFICIENCY[gpu] = eff
        _rerun([held], cache_dir)
        errors[held.row] = held.step_error
        compute.KERNEL_EFFICIENCY[gpu] = base
    _rerun(counted, cache_dir)
    abs_err = [abs(e) for e in errors.values()]
    summary = {
        "rows": len(errors),
        "step_median_abs_error": statistics.median(abs_err),
        "step_p90_abs_error": percentile(abs_err, 90),
    }
    out.write("row  in-sample  left out\n")
    for c in counted:
        out.write(f"{c.row:>3} {c.step_error:+9.1%} {errors[c.row]:+9.1%}\n")
    out.write(
        f"leave-one-out over {summary['rows']} rows: step time median |error| "
        f"{summary['step_median_abs_error']:.1%}, p90 {summary['step_p90_abs_error']:.1%}\n"
    )
    return summary


def markdown_rows(cases: list[Case]) -> str:
    """The per-row table of docs/fidelity.md (counted rows, then the excluded ones)."""
    lines = [
        "| row | source | model | GPUs | configuration | engine | measured s | predicted s "
        "| error | memory GiB (measured / predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    from meshplan.cost_model.engine import Engine

    for c in cases:
        if c.status == "excluded":
            continue
        mem = ""
        if c.mem_error is not None:
            mem = f"{c.measured_mem_gib:.1f} / {c.predicted_mem_gib:.1f} ({c.mem_error:+.1%})"
        lines.append(
            f"| {c.row} | {_short_source(c.source)} | {c.model} | {c.gpus} | {_config_str(c)} "
            f"| {Engine(**c.engine).describe()} | {c.measured_step_s:.3f} "
            f"| {c.predicted_step_s:.3f} | {c.step_error:+.1%} | {mem} |"
        )
    ex = [c for c in cases if c.status == "excluded"]
    if ex:
        lines.append("")
        lines.append("Excluded: " + "; ".join(f"row {c.row} ({c.reason})" for c in ex) + ".")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--json", type=Path, help="write per-row results and the summary here")
    ap.add_argument("--cache", type=Path, help="directory to keep traced graphs in")
    ap.add_argument("--rows", help="comma-separated row numbers to run (default: all)")
    ap.add_argument(
        "--fit",
        action="store_true",
        help="print the per-GPU-type GEMM efficiencies that zero each type's median error",
    )
    ap.add_argument(
        "--loo",
        action="store_true",
        help="leave-one-out: refit each row's GPU type without it, then predict it",
    )
    ap.add_argument("--markdown", action="store_true", help="print the per-row table as markdown")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    cases = [interpret(i + 1, r) for i, r in enumerate(rows)]
    if args.rows:
        keep = {int(x) for x in args.rows.split(",")}
        cases = [c for c in cases if c.row in keep]
    t0 = time.perf_counter()
    for c in cases:
        if c.status != "excluded":
            run_case(c, args.cache)
    if args.fit:
        fit_gemm_efficiency(cases, args.cache)
        return 0
    if args.loo:
        leave_one_out(cases, args.cache)
        return 0
    if args.markdown:
        sys.stdout.write(markdown_rows(cases))
        return 0
    print_report(cases)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        data = {
            "summary": summarize(cases),
            "rows": [
                asdict(c) | {"step_error": c.step_error if c.status != "excluded" else None}
                for c in cases
            ],
        }
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
