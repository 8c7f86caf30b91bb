"""Public GPU kernel latencies read as IR ops (`cost_model.kernel_data`).

The oracle for the op builders is the tracer itself: a module running the same kernel is
traced, and its op must carry the kind, FLOPs and bytes the builder gives the dataset row.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from meshplan.cost_model import compute
from meshplan.cost_model.kernel_data import (
    bmm_op,
    device_spec,
    elementwise_op,
    embedding_op,
    linear_op,
    norm_op,
    read_all,
    softmax_op,
)
from meshplan.ir import Block, OpKind, trace
from meshplan.ir.hardware import UnknownGpuError, gpu_spec
from torch import nn

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpu_op_latency"


class _One(nn.Module):
    """Runs one kernel on its input (parameters where the kernel has them)."""

    def __init__(self, kind: str, width: int, out: int = 0, vocab: int = 0):
        super().__init__()
        self.kind = kind
        if kind == "linear":
            self.w = nn.Parameter(torch.empty(out, width))
        if kind == "ln":
            self.ln = nn.LayerNorm(width)
        if kind == "emb":
            self.emb = nn.Embedding(vocab, width)
        self.scale = nn.Parameter(torch.ones(()))  # something to train; its mul is not checked

    def forward(self, x, y=None):
        if x.is_floating_point() and self.kind not in ("linear", "ln"):
            x = x * self.scale
        if self.kind == "linear":
            return F.linear(x, self.w)
        if self.kind == "bmm":
            return torch.bmm(x, y)
        if self.kind == "softmax":
            return torch.softmax(x, dim=-1)
        if self.kind == "ln":
            return self.ln(x)
        if self.kind == "add":
            return x + y
        if self.kind == "gelu":
            return F.gelu(x)
        if self.kind == "emb":
            return self.emb(x)
        raise AssertionError(self.kind)


def _traced_op(module: nn.Module, *inputs, kind: OpKind):
    graph = trace(module, *inputs)
    ops = [
        op for _, b in graph.blocks for op in b.ops if op.kind == kind and "mul" not in op.target
    ]
    assert len(ops) == 1, ops
    return ops[0]


@pytest.mark.parametrize(
    ("name", "build", "module", "inputs", "kind"),
    [
        ("linear", lambda: linear_op(96, 40, 64, "float32"), _One("linear", 64, out=40),
         lambda: (torch.empty(96, 64, requires_grad=True),), OpKind.MATMUL),
        ("bmm", lambda: bmm_op(3, 24, 40, 16, "float32"), _One("bmm", 0),
         lambda: (torch.empty(3, 24, 16, requires_grad=True), torch.empty(3, 16, 40)),
         OpKind.MATMUL),
        ("softmax", lambda: softmax_op((12, 80), "float32"), _One("softmax", 0),
         lambda: (torch.empty(12, 80, requires_grad=True),), OpKind.SOFTMAX),
        ("layer norm", lambda: norm_op(12, 80, "float32"), _One("ln", 80),
         lambda: (torch.empty(12, 80, requires_grad=True),), OpKind.NORM),
        ("add", lambda: elementwise_op("add", (12, 80), "float32", inputs=2), _One("add", 0),
         lambda: (torch.empty(12, 80, requires_grad=True), torch.empty(12, 80)),
         OpKind.ELEMENTWISE),
        ("gelu", lambda: elementwise_op("gelu", (12, 80), "float32"), _One("gelu", 0),
         lambda: (torch.empty(12, 80, requires_grad=True),), OpKind.ELEMENTWISE),
    ],
)  # fmt: skip
def test_builders_match_the_tracer(name, build, module, inputs, kind):
    ours = build()
    traced = _traced_op(module, *inputs(), kind=kind)
    assert ours.kind == traced.kind
    assert ours.fwd_flops == traced.fwd_flops
    assert ours.fwd_bytes == traced.fwd_bytes
    assert bool(ours.params) == bool(traced.params)


def test_embedding_builder_matches_the_tracer_and_is_priced_by_rows_read():
    ours = embedding_op(64, 1000, 32, "float32")
    traced = _traced_op(_One("emb", 32, vocab=1000), torch.zeros(64, dtype=torch.long),
                        kind=OpKind.EMBEDDING)  # fmt: skip
    assert (ours.kind, ours.fwd_bytes) == (traced.kind, traced.fwd_bytes)
    # the kernel reads the 64 rows it returns and writes them, plus the ids: not the table
    a100 = gpu_spec("A100")
    rows = 2 * 64 * 32 * 4 + 64 * 8
    expected = rows / (a100.hbm_bandwidth * compute.MEMORY_EFFICIENCY_BY_KIND[OpKind.EMBEDDING])
    assert compute.roofline_time(ours, a100, "float32") == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("NVIDIA A100-PCIE-40GB", "A100-PCIe-40GB"),
        ("Tesla V100-PCIE-32GB", "V100-PCIe"),
        ("Tesla T4", "T4"),
        ("Tesla P100-PCIE-16GB", "P100-PCIe"),
        ("Tesla P4", "P4"),
        ("a100", "A100-80GB"),
        ("a40", "A40"),
        ("NVIDIA H100 80GB HBM3", "H100"),
    ],
)
def test_device_names_map_to_the_gpu_table(name, canonical):
    assert device_spec(name).name == canonical


def test_an_unknown_device_is_an_error_naming_it():
    with pytest.raises(UnknownGpuError, match="Tesla K80"):
        device_spec("Tesla K80")


def test_rows_priced_by_block_compute_equal_the_roofline_plus_wave_quantization():
    """A single-op block prices a GEMM as the p-norm of FLOP time / wave efficiency and memory
    time (`compute.GEMM_OVERLAP_P`) plus the floor: what the benchmark's vectorised fit
    assumes."""
    a100 = gpu_spec("A100")
    op = linear_op(300, 696, 512, "float16")  # N, K multiples of 8: aligned
    bc = compute.block_compute(Block("k", "prologue", (op,), ()), a100, "float16")
    fwd = bc.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)[0]
    flop_s = op.fwd_flops / (a100.peak("float16") * compute.kernel_efficiency(a100).gemm)
    mem_s = op.fwd_bytes / (a100.hbm_bandwidth * compute.kernel_efficiency(a100).memory)
    q = compute.wave_efficiency(1, 300, 696, a100.sms)
    # best of 128-tiles (3 x 6 = 18 tiles) and 64-tiles (5 x 11 = 55): one wave of 108 either way
    assert q == pytest.approx(300 * 696 / (108 * 64 * 64))
    p = compute.GEMM_OVERLAP_P
    expect = ((flop_s / q) ** p + mem_s**p) ** (1 / p) + compute.KERNEL_FLOOR_S
    assert fwd == pytest.approx(expect, rel=1e-9)


def test_reading_a_dataset_of_that_layout(tmp_path):
    """Both layouts read from a directory made here (one row each)."""
    ns = tmp_path / "neusight" / "softmax"
    ns.mkdir(parents=True)
    with gzip.open(ns / "Tesla T4.csv.gz", "wt") as f:
        f.write("OPName,Latency,Device,B,H\nsoftmax,0.05,Tesla T4,128,1024\n")
    vd = tmp_path / "vidur"
    vd.mkdir()
    cols = ["emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
            "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj",
            "add"]  # fmt: skip
    head = [f"time_stats.{c}.median" for c in cols] + [
        "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp",
        "num_tokens", "num_tensor_parallel_workers",
    ]  # fmt: skip
    values = ["0.01"] * len(cols) + ["32", "8", "4096", "14336", "128256", "True", "512", "2"]
    with gzip.open(vd / "a40__org__model__mlp.csv.gz", "wt") as f:
        f.write(",".join(head) + "\n" + ",".join(values) + "\n")
    rows = read_all(tmp_path)
    assert len(rows) == 1 + len(cols)
    soft = rows[0]
    assert (soft.device, soft.op_class, soft.seconds, soft.launch_included) == (
        "Tesla T4", "softmax", pytest.approx(5e-5), True)  # fmt: skip
    up = next(r for r in rows if r.op.name == "mlp_up_proj")
    # gated MLP, TP 2: gate and up fused, 2 x 14336 / 2 columns, 512 tokens, hidden 4096
    assert up.op.fwd_flops == 2 * 512 * 14336 * 4096
    assert (up.tp, up.dtype) == (2, "float16")
    assert sum(1 for r in rows if r.group) == 9  # one layer's ops, the embedding apart


@pytest.mark.skipif(not DATA.is_dir(), reason="shared/data/gpu_op_latency not present")
def test_every_device_of_the_shipped_data_maps_to_a_gpu_type():
    names = {p.name.removesuffix(".csv.gz") for p in (DATA / "neusight").glob("*/*.csv.gz")}
    names |= {p.name.split("__")[0] for p in (DATA / "vidur").glob("*.csv.gz")}
    assert {device_spec(n).name for n in names} == {
        "A100-PCIe-40GB", "V100-PCIe", "T4", "P100-PCIe", "P4", "A100-80GB", "A40"}  # fmt: skip


# -- meshplan's own layout (benchmarks/collect_gpu_ops.py) ------------------------------------
OWN = Path(__file__).resolve().parents[2] / "data" / "gpu_op_latency"


def test_the_collector_writes_what_the_reader_reads(tmp_path):
    """collect_gpu_ops.py's memory-bound and bmm sweeps on the host, read back as ops whose
    bytes are what the kernels move (inputs plus output), and rows priced by other paths
    (float8 GEMMs, attention) left to their own readers."""
    from tests.benchmark_module import benchmark_module

    col = benchmark_module("collect_gpu_ops")
    sweep = col.Sweep(torch.device("cpu"), quick=True)
    sweep.memory_bound("float32")
    sweep.bmm("bfloat16")
    sweep.add("scaled_mm", "gemm_fp8", "float8_e4m3fn", 1e-5, 1, m=64, n=64, k=64)
    col.write(sweep.rows, tmp_path, "NVIDIA H200")
    rows = read_all(tmp_path)
    assert len(rows) == len(sweep.rows) - 1  # the float8 row is not one op's price
    assert {r.device for r in rows} == {"NVIDIA H200"} and not any(r.launch_included for r in rows)
    add = next(r for r in rows if r.op.name == "add")
    b, w = add.op.inputs[0].shape
    assert add.op.fwd_bytes == 3 * b * w * 4 and add.op_class == "elementwise"
    assert {r.op_class for r in rows} == {"elementwise", "softmax", "layernorm", "norm", "bmm"}
    bmm = next(r for r in rows if r.op_class == "bmm")
    bb, m, k = bmm.op.inputs[0].shape
    assert bmm.op.fwd_flops == 2 * bb * m * bmm.op.outputs[0].shape[2] * k


@pytest.mark.skipif(not (OWN / "meshplan").is_dir(), reason="data/gpu_op_latency not present")
def test_the_shipped_hopper_kernels_map_and_price():
    rows = read_all(OWN)
    assert {device_spec(r.device).name for r in rows} == {"H100", "H200"}
    classes = {r.op_class for r in rows}
    assert {"gemm", "linear", "linear_tf32", "bmm", "embedding", "norm"} <= classes
    tf32 = next(r for r in rows if r.op_class == "linear_tf32")
    assert tf32.dtype == "tfloat32" and tf32.op.inputs[0].dtype == "float32"
