"""The operator profiler: robust timing, op replay, and the versioned, appendable dataset
(`meshplan.measure.profile` writes it, `meshplan.cost_model.dataset` reads it)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from meshplan.cost_model import dataset as D
from meshplan.ir import Op, OpKind, TensorMeta
from meshplan.measure import profile as P


def test_robust_median_drops_outliers():
    med, dropped, spread = P.robust_median([1.0, 1.01, 0.99, 1.02, 0.98, 50.0])
    assert med == pytest.approx(1.0, abs=0.011)
    assert dropped == 1
    assert spread < 0.05


def test_measure_returns_positive_time():
    m = P.measure(lambda: torch.ones(64).sum(), torch.device("cpu"), max_seconds=0.01)
    assert m.seconds > 0 and m.samples >= 3


@pytest.mark.parametrize(
    ("src", "dst", "dims", "keep"),
    [
        ((2, 128, 256), (2, 128, 1), [2], True),
        ((256, 2, 256), (256, 256), [1], False),
        ((512, 4), (512,), [1], False),
        ((640, 1), (640, 1), [1], True),
    ],
)
def test_reduced_dims(src, dst, dims, keep):
    assert P._reduced_dims(src, dst) == (dims, keep)


def test_synth_op_counts_flops_like_the_tracer():
    op = P.synth_op(
        "mm",
        OpKind.MATMUL,
        "aten.mm.default",
        (TensorMeta((8, 16), "float32"), TensorMeta((16, 4), "float32")),
    )
    assert op.fwd_flops == 2 * 8 * 16 * 4
    assert op.bwd_flops == 2 * op.fwd_flops
    assert op.fwd_bytes == 4 * (8 * 16 + 16 * 4 + 8 * 4)
    assert op.outputs == (TensorMeta((8, 4), "float32"),)


def test_synth_op_backward_matches_the_tracer():
    """The tracer charges no backward to an add (autograd passes the gradient through)."""
    x = TensorMeta((32, 64), "float32")
    assert P.synth_op("add", OpKind.ELEMENTWISE, "aten.add.Tensor", (x, x)).bwd_bytes == 0
    assert P.synth_op("mul", OpKind.ELEMENTWISE, "aten.mul.Tensor", (x, x)).bwd_bytes > 0


def test_every_op_of_a_traced_model_replays():
    """Each op the tracer emits for a small dense and a small MoE model has a recipe."""
    from meshplan import models
    from meshplan.ir import trace

    for kw in (dict(), dict(experts=4, top_k=2)):
        m, inputs = models.transformer(
            layers=1,
            hidden=64,
            heads=4,
            kv_heads=2,
            ffn=96,
            vocab=128,
            seq_len=16,
            dtype="float32",
            **kw,
        )
        g = trace(m, *inputs)
        for _, block in g.blocks:
            for op in block.ops:
                timed = P.time_op(op, torch.device("cpu"), max_seconds=0.002)
                assert timed.fwd is not None and timed.fwd.seconds > 0, op.name


def _records(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def test_tiny_profile_writes_then_appends(tmp_path):
    out = tmp_path / "cpu.jsonl.gz"
    kw = dict(
        families=["sweep"], dtypes=("float32",), quick=True, max_seconds=0.002, progress=False
    )
    path, n1, skipped = P.run_profile(out, **kw)
    assert path == out and n1 > 0 and skipped == 0
    recs = _records(out)
    dev = [r for r in recs if r["type"] == "device"]
    assert len(dev) == 1 and dev[0]["schema"] == D.SCHEMA_VERSION
    d = dev[0]["device"]
    assert d["name"] == "CPU" and d["cores"] >= 1 and d["torch_version"] == torch.__version__
    assert dict(d["peak_flops"])["float32"] > 0 and d["mem_bandwidth"] > 0
    rows = [r for r in recs if r["type"] == "row"]
    assert all(r["seconds"] > 0 and r["family"] == "sweep" for r in rows)
    assert {"op", "dtype", "flops", "bytes", "backward", "model"} <= set(rows[0])

    _, n2, _ = P.run_profile(out, **kw)
    ds = D.load_dataset(out)
    assert len(ds) == n1 + n2
    assert len([r for r in _records(out) if r["type"] == "device"]) == 2
    s = ds.samples[0]
    assert s.device.name == "CPU" and s.op.outputs  # ops round-trip through the dataset


def test_newer_schema_is_rejected(tmp_path):
    out = tmp_path / "x.jsonl.gz"
    with gzip.open(out, "wt") as f:
        f.write(
            json.dumps({"type": "device", "schema": D.SCHEMA_VERSION + 1, "id": "a", "device": {}})
            + "\n"
        )
    with pytest.raises(ValueError, match="schema"):
        D.load_dataset(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replay_and_descriptor():
    dev = torch.device("cuda")
    op = P.synth_op(
        "mm",
        OpKind.MATMUL,
        "aten.mm.default",
        (TensorMeta((256, 512), "bfloat16"), TensorMeta((512, 128), "bfloat16")),
    )
    timed = P.time_op(op, dev, max_seconds=0.01)
    assert timed.fwd.seconds > 0 and timed.bwd.seconds > 0
    desc = P.describe_device(dev, ("bfloat16",), quick=True)
    assert desc.backend == "cuda" and desc.timer == "wall" and desc.cores > 0


def test_replay_counts_see_what_the_ir_charges_but_the_replay_does_not_run():
    """MoE's combine `sum` over the top-k dim: the tracer charges its backward the gradient
    copy of the `view` folded into it; replayed alone, its backward is an `expand` (a view,
    no bytes). The dataset records both, and the model trains on what was timed."""
    x = TensorMeta((64, 2, 32), "float32")
    out = TensorMeta((64, 32), "float32")
    c = P.replay_counts(Op("combine", OpKind.REDUCTION, "aten.sum.dim_IntList", "", (x,), (out,)))
    assert c.bwd_bytes == 0 and c.bwd_flops == 0
    assert c.fwd_bytes == x.nbytes + out.nbytes  # read every input, write the output
    ir_op = Op(
        "combine",
        OpKind.REDUCTION,
        "aten.sum.dim_IntList",
        "",
        (x,),
        (out,),
        fwd_bytes=c.fwd_bytes,
        bwd_bytes=2 * x.nbytes,  # the folded view's gradient copy
    )
    dev = _descriptor()
    s = D.Sample(
        "mixtral",
        "m",
        ir_op,
        True,
        "float32",
        19e-6,
        0.0,
        dev,
        timed=(c.fwd_flops, c.bwd_flops, c.fwd_bytes, c.bwd_bytes),
    )
    assert s.op.bwd_bytes == 2 * x.nbytes and s.measured_op.bwd_bytes == 0
    assert D.Sample("x", "m", ir_op, True, "float32", 1.0, 0.0, dev).measured_op is ir_op


def _descriptor(**kw) -> D.DeviceDescriptor:
    base = dict(
        name="CPU",
        processor="t",
        backend="cpu",
        cores=1,
        clock_hz=1e9,
        l2_bytes=1 << 20,
        l3_bytes=1 << 24,
        memory_bytes=1 << 30,
        torch_version="x",
        peak_flops=(("float32", 100e9),),
        mem_bandwidth=10e9,
        cache_bandwidth=50e9,
    )
    return D.DeviceDescriptor(**{**base, **kw})


def test_bound_devices_makes_one_roofline_that_bounds_every_row():
    from meshplan.cost_model.features import DeviceFeatures, physics_time

    a = _descriptor(peak_flops=(("float32", 100e9),), mem_bandwidth=10e9)
    b = _descriptor(peak_flops=(("float32", 120e9),), mem_bandwidth=12e9, cache_bandwidth=40e9)
    mm = P.synth_op(
        "mm",
        OpKind.MATMUL,
        "aten.mm.default",
        (TensorMeta((64, 64), "float32"), TensorMeta((64, 64), "float32")),
    )
    x = TensorMeta((256, 256), "float32")
    add = P.synth_op("add", OpKind.ELEMENTWISE, "aten.add.Tensor", (x, x))
    rows = [
        D.Sample("f", "m", mm, False, "float32", mm.fwd_flops / 150e9, 0.0, a),  # 150 GFLOP/s
        D.Sample("f", "m", add, False, "float32", add.fwd_bytes / 90e9, 0.0, b),  # 90 GB/s
        D.Sample("f", "m", add, False, "float32", add.fwd_bytes / 20e9, 0.0, a),
    ]
    out = D.bound_devices(rows)
    devs = {id(s.device) for s in out}
    assert len(devs) == 1
    d = out[0].device
    assert dict(d.peak_flops)["float32"] == pytest.approx(150e9)
    assert d.cache_bandwidth == pytest.approx(90e9)
    assert d.mem_bandwidth == pytest.approx(11e9)  # median of the runs
    feats = DeviceFeatures.from_descriptor(d)
    for s in out:
        assert physics_time(s.measured_op, feats, s.backward) <= s.seconds * (1 + 1e-9)


def test_backfill_adds_timed_counts_to_schema_1_rows(tmp_path):
    out = tmp_path / "cpu.jsonl.gz"
    kw = dict(
        families=["sweep"], dtypes=("float32",), quick=True, max_seconds=0.002, progress=False
    )
    P.run_profile(out, **kw)
    P.run_profile(out, **kw)
    recs = _records(out)
    assert all("timed" in r for r in recs if r["type"] == "row")
    # make it look like a schema 1 file, then backfill
    with gzip.open(out, "wt") as f:
        for r in recs:
            r.pop("timed", None)
            f.write(json.dumps(r) + "\n")
    assert all(s.timed is None for s in D.load_dataset(out).samples)
    filled = P.backfill_timed_counts(out)
    assert filled == sum(r["type"] == "row" for r in recs)
    ds = D.load_dataset(out)
    assert len(ds.devices) == 2
    for s in ds.samples:  # sweep ops are synthesised from their replay: counts agree
        assert s.measured_op == s.op
