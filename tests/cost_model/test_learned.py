"""Features and the learned efficiency model (on synthetic data: no profiling needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from meshplan.cost_model import compute, learned
from meshplan.cost_model.dataset import DeviceDescriptor, Sample
from meshplan.cost_model.features import (
    DeviceFeatures,
    essential_bytes,
    feature_names,
    op_features,
    physics_time,
)
from meshplan.ir import Op, OpKind, TensorMeta
from meshplan.ir.hardware import gpu_spec

DEV = DeviceDescriptor(
    name="CPU",
    processor="test",
    backend="cpu",
    cores=1,
    clock_hz=2.3e9,
    l2_bytes=2 << 20,
    l3_bytes=256 << 20,
    memory_bytes=16 << 30,
    torch_version="x",
    peak_flops=(("bfloat16", 80e9), ("float32", 160e9)),
    mem_bandwidth=10e9,
    cache_bandwidth=70e9,
)


def gemm(m: int, n: int, k: int, dtype: str = "float32") -> Op:
    b = 4 if dtype == "float32" else 2
    return Op(
        f"mm{m}x{n}x{k}",
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


def eltwise(rows: int, h: int, dtype: str = "float32") -> Op:
    t = TensorMeta((rows, h), dtype)
    return Op(
        f"add{rows}x{h}",
        OpKind.ELEMENTWISE,
        "aten.add.Tensor",
        "",
        (t, t),
        (t,),
        fwd_bytes=3 * t.nbytes,
        bwd_bytes=2 * t.nbytes,
    )


def sdpa(b: int, h: int, s: int, d: int, causal: bool) -> Op:
    q = TensorMeta((b, h, s, d), "float32")
    f = 4 * b * h * s * s * d
    return Op(
        "sdpa",
        OpKind.ATTENTION,
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "",
        (q, q, q),
        (q,),
        fwd_flops=f,
        bwd_flops=int(2.5 * f),
        fwd_bytes=4 * q.nbytes,
        bwd_bytes=8 * q.nbytes,
        attrs=(("causal", causal), ("heads", h), ("kv_heads", h)),
    )


OPS = [
    gemm(7, 300, 256),
    gemm(512, 512, 512, "bfloat16"),
    eltwise(130, 1536),
    sdpa(1, 4, 128, 64, True),
]


def test_features_are_deterministic_finite_and_named():
    dev = DeviceFeatures.from_descriptor(DEV)
    for op in OPS:
        for bwd in (False, True):
            a, b = op_features(op, dev, bwd), op_features(op, dev, bwd)
            assert a.shape == (len(feature_names()),)
            assert np.array_equal(a, b) and np.all(np.isfinite(a))
    # Datasheet devices (no caches, no clock) are finite too.
    h100 = DeviceFeatures.from_spec(gpu_spec("H100"))
    assert np.all(np.isfinite(op_features(OPS[0], h100)))


def test_features_see_alignment_and_causality():
    dev = DeviceFeatures.from_descriptor(DEV)
    names = feature_names()
    f = op_features(gemm(7, 300, 256), dev)
    assert f[names.index("m_mis64")] == 1 and f[names.index("k_mis64")] == 0
    assert f[names.index("lg_m")] == pytest.approx(math.log2(7))
    assert op_features(sdpa(1, 4, 128, 64, True), dev)[names.index("causal")] == 1


def test_gathers_use_essential_bytes():
    w, idx = TensorMeta((32000, 256), "float32"), TensorMeta((512,), "int64")
    out = TensorMeta((512, 256), "float32")
    op = Op(
        "emb",
        OpKind.EMBEDDING,
        "aten.embedding.default",
        "",
        (w, idx),
        (out,),
        fwd_bytes=w.nbytes + idx.nbytes + out.nbytes,
    )
    assert essential_bytes(op) == 2 * out.nbytes + idx.nbytes
    assert essential_bytes(op) < op.fwd_bytes


def _true_eff(op: Op, backward: bool) -> float:
    """A known efficiency: GEMMs saturate with size, memory ops with bytes."""
    if op.kind == OpKind.MATMUL:
        m = op.inputs[0].shape[0]
        return 0.9 * m / (m + 48.0) * (0.8 if backward else 1.0)
    nbytes = op.bwd_bytes if backward else op.fwd_bytes
    return 0.6 * nbytes / (nbytes + 2e5)


def _synthetic(n: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    dev = DeviceFeatures.from_descriptor(DEV)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            op = gemm(*(int(x) for x in rng.integers(1, 1024, 3)))
        else:
            op = eltwise(int(rng.integers(1, 4096)), int(rng.integers(8, 2048)))
        bwd = bool(rng.random() < 0.5)
        t = physics_time(op, dev, bwd) / _true_eff(op, bwd)
        out.append(Sample("synthetic", "s", op, bwd, "float32", t, 0.0, DEV))
    return out


@pytest.fixture(scope="module")
def model() -> learned.LatencyModel:
    return learned.train(_synthetic(600, 0), epochs=500, ensemble=2, hidden=32)


def test_training_recovers_a_known_efficiency(model):
    test = _synthetic(200, 1)
    meas = np.asarray([s.seconds for s in test])
    assert learned.mape(model.predict_samples(test), meas) < 8.0


def test_efficiency_in_unit_interval_and_never_faster_than_physics(model):
    dev = DeviceFeatures.from_descriptor(DEV)
    for op in (*OPS, gemm(1, 1, 1), eltwise(1, 1), gemm(8192, 8192, 8192)):
        for bwd in (False, True):
            eff = model.efficiency(op, "CPU", backward=bwd)
            assert 0.0 < eff <= 1.0
            assert model.predict_op_time(op, "CPU", backward=bwd) >= physics_time(op, dev, bwd)


def test_predict_op_time_contract(model):
    op = gemm(256, 256, 256)
    t1 = model.predict_op_time(op, gpu_spec("CPU"), "float32")
    t2 = model.predict_op_time(op, gpu_spec("CPU"), "float32", scale=2.0)
    assert t1 > 0 and t2 > t1
    assert model.predict_op_time(Op("v", OpKind.OTHER, "aten.view", "", (), ()), "CPU") == 0.0
    assert model.covers(gpu_spec("CPU")) and model.covers("host-cpu") and not model.covers("H100")


def test_scale_op_scales_work_and_leading_dim():
    op = learned.scale_op(gemm(128, 64, 32), 0.5)
    assert op.fwd_flops == 2 * 64 * 64 * 32 and op.inputs[0].shape == (64, 32)
    assert op.inputs[1].shape == (32, 64)  # the weight keeps its shape


def test_save_load_round_trip(model, tmp_path):
    path = model.save(tmp_path / "m.npz")
    assert path.stat().st_size < 1_000_000
    again = learned.LatencyModel.load(path)
    test = _synthetic(20, 2)
    np.testing.assert_allclose(again.predict_samples(test), model.predict_samples(test), rtol=1e-4)
    assert learned.load_for_device("CPU", path) is not None
    assert learned.load_for_device("H100", path) is None
    assert learned.load_for_device("CPU", tmp_path / "missing.npz") is None


def test_op_seconds_says_which_model_it_used(model):
    op = gemm(64, 64, 64)
    assert compute.op_seconds(model, op, gpu_spec("CPU"), "float32")[1] == "learned"
    assert compute.op_seconds(model, op, gpu_spec("H100"), "bfloat16")[1] == "analytic"
    assert compute.op_seconds(None, op, gpu_spec("CPU"), "float32")[1] == "analytic"


def test_parts_split_work_and_overhead(model):
    for op in (gemm(1, 8, 8), gemm(512, 512, 512)):
        work, overhead = model.predict_op_parts(op, "CPU")
        assert work > 0 and overhead >= 0
        assert work + overhead == pytest.approx(model.predict_op_time(op, "CPU"), rel=1e-9)


def test_env_var_turns_the_learned_model_off(model, tmp_path, monkeypatch):
    path = model.save(tmp_path / "m.npz")
    monkeypatch.setenv("MESHPLAN_LEARNED_LATENCY", "0")
    assert learned.load_for_device("CPU", path) is None


def test_batched_parts_match_one_op_at_a_time(model):
    items = [(op, bwd) for op in (*OPS, gemm(1, 8, 8)) for bwd in (False, True)]
    items.append((Op("v", OpKind.OTHER, "aten.view", "", (), ()), False))
    got = model.predict_parts_many(items, "CPU")
    for (op, bwd), (work, overhead) in zip(items, got, strict=True):
        want = model.predict_op_parts(op, "CPU", backward=bwd)
        assert work == pytest.approx(want[0], rel=1e-9, abs=1e-15)
        assert overhead == pytest.approx(want[1], rel=1e-9, abs=1e-15)


def test_samples_are_priced_as_what_was_timed(model, tmp_path):
    """A row whose replay ran less than the IR charges is featurised by the replay's counts."""
    op = eltwise(256, 512)
    timed = (0, 0, op.fwd_bytes, 0)  # the replay's backward moved nothing
    s = Sample("f", "m", op, True, "float32", 20e-6, 0.0, DEV, timed=timed)
    ir = Sample("f", "m", op, True, "float32", 20e-6, 0.0, DEV)
    dev = DeviceFeatures.from_descriptor(DEV)
    assert model.physics_samples([ir])[0] == pytest.approx(physics_time(op, dev, True))
    assert model.physics_samples([s])[0] == pytest.approx(1e-12)  # no work: the floor
    x_s, _ = learned.design_matrix([s])
    np.testing.assert_array_equal(x_s[0], op_features(s.measured_op, dev, True))
    path = model.save(tmp_path / "m.npz")
    again = learned.LatencyModel.load(path)
    assert again.describe().endswith("trained on CPU, 600 ops")
