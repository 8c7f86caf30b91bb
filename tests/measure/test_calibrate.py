"""`meshplan calibrate`: measured curves on several CPU ranks (gloo), the profile file, and
the cost model using a profile (oracle: times computed by hand from the profile's own
points)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from meshplan.cli import app
from meshplan.cost_model.collectives import Collective, group_collective_time
from meshplan.ir import Cluster, Parallel
from meshplan.ir.cluster import (
    ClusterProfile,
    CollectiveCurve,
    GemmMeasurement,
    TierProfile,
    busbw_factor,
)
from meshplan.ir.cluster_io import (
    ProfileError,
    dump_profile,
    load_cluster,
    load_profile,
    profile_from_dict,
    profile_to_dict,
)
from meshplan.measure.calibrate import CalibrateConfig, CalibrateError, calibrate, parse_size
from typer.testing import CliRunner

from tests.synthetic import transformer_graph

KiB, MiB = 2**10, 2**20
SMALL = CalibrateConfig(min_size=4 * KiB, max_size=64 * KiB, iters=2, warmup=1)


@pytest.fixture(scope="module")
def measured() -> ClusterProfile:
    """One real calibration: 3 gloo ranks, 4-64 KiB, small GEMMs (a few seconds)."""
    cfg = CalibrateConfig(
        min_size=4 * KiB,
        max_size=64 * KiB,
        iters=2,
        warmup=1,
        gemm_shapes=((64, 64, 64), (128, 128, 128)),
        codec_numel=1 << 18,
    )
    return calibrate(3, cfg, timeout_s=120)


def test_codec_speed_is_measured_and_used_by_the_cost_model(measured):
    from meshplan.cost_model.compression import CPU_CODEC, codec_speed

    (c,) = measured.codec
    assert c.gpu == "CPU" and c.dtype == "bfloat16"
    assert c.compress_bps > 0 and c.decompress_bps > 0 and c.compress_call_s >= 0
    cpu = Cluster.preset("cpu")
    before = codec_speed(cpu.groups[0].gpu)
    assert before == CPU_CODEC  # the shipped measurement until a profile says otherwise
    after = codec_speed(cpu.with_profile(measured).groups[0].gpu)
    assert (after.compress_bps, after.decompress_bps) == (c.compress_bps, c.decompress_bps)
    assert "calibrate" in after.source


def test_calibration_measures_every_collective_on_the_loopback_tier(measured):
    (tier,) = measured.tiers
    assert tier.tier == "loopback" and tier.intra_node and tier.ranks_per_node == 3
    assert [c.collective for c in tier.curves] == list(CalibrateConfig().collectives)
    for c in tier.curves:
        assert c.ranks == 3
        sizes = [s for s, _ in c.points]
        assert len(sizes) == 5  # 4, 8, 16, 32, 64 KiB (rounded down to whole float32 / rank)
        assert all(s % 12 == 0 and s > 0.99 * 4 * KiB * 2**i for i, s in enumerate(sizes))
        assert all(t > 0 and math.isfinite(t) for _, t in c.points)
    assert {(g.m, g.dtype, g.gpu) for g in measured.gemm} == {
        (64, "float32", "CPU"),
        (128, "float32", "CPU"),
    }
    assert all(0 < g.efficiency for g in measured.gemm)
    assert "gloo/cpu" in measured.source


def test_profile_round_trips_through_json_and_yaml(measured, tmp_path):
    for name in ("p.json", "p.yaml"):
        dump_profile(measured, tmp_path / name)
        assert load_profile(tmp_path / name) == measured
    assert profile_from_dict(profile_to_dict(measured)) == measured


def test_profile_changes_the_estimate_as_its_own_curve_says(measured):
    """DP all-reduce of a small model on the `cpu` preset: with the profile, its time is the
    one interpolated by hand from the measured points (independent of the cost model)."""
    base = Cluster.preset("cpu", 3)
    cal = base.with_profile(measured)
    assert cal.link("loopback").bandwidth != base.link("loopback").bandwidth
    g = cal.groups[0]
    curve = measured.tiers[0].curve("all_reduce")
    sizes = [s for s, _ in curve.points]
    bus = [s * busbw_factor("all_reduce", 3) / t for s, t in curve.points]
    peak = max(bus)
    for size in (sizes[1], math.sqrt(sizes[1] * sizes[2]), 2 * sizes[-1], sizes[0] / 4):
        x = math.log(size)
        xs = [math.log(s) for s in sizes]
        if x <= xs[0]:
            frac = bus[0] / peak * size / sizes[0]
        elif x >= xs[-1]:
            frac = bus[-1] / peak
        else:
            i = next(i for i in range(1, len(xs)) if xs[i] >= x)
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            frac = (bus[i - 1] + w * (bus[i] - bus[i - 1])) / peak
        expect = size * busbw_factor("all_reduce", 3) / (peak * frac)
        got = group_collective_time(Collective.ALL_REDUCE, size, cal, g, 3, 3)
        assert got == pytest.approx(expect, rel=1e-9)


def _slow_and_fast(factor: float) -> tuple[ClusterProfile, ClusterProfile]:
    pts = ((64 * KiB, 1e-3), (64 * MiB, 0.1))
    make = lambda k: ClusterProfile(  # noqa: E731
        tiers=(
            TierProfile(
                "loopback",
                True,
                4,
                1,
                4,
                (CollectiveCurve("all_reduce", 4, tuple((s, t * k) for s, t in pts)),),
            ),
        )
    )
    return make(factor), make(1.0)


def test_a_slower_measured_link_gives_a_slower_step():
    from meshplan.api import estimate

    g = transformer_graph(2, 256, 4, 4, 1024, 1000, 64, 1)
    slow, fast = _slow_and_fast(10.0)
    p = Parallel(dp=4, tp=1, pp=1, global_batch=8)
    base = Cluster.preset("cpu", 4)
    t_fast = estimate(g, (), base.with_profile(fast), p).breakdown_dict()["dp_comm_exposed"]
    t_slow = estimate(g, (), base.with_profile(slow), p).breakdown_dict()["dp_comm_exposed"]
    assert t_slow > 5 * t_fast > 0


def test_measured_gemm_efficiency_scales_compute():
    from meshplan.api import estimate

    g = transformer_graph(2, 512, 8, 8, 2048, 1000, 256, 4)
    p = Parallel(dp=1, tp=1, pp=1, global_batch=4, micro_batch=4)
    base = Cluster.preset("cpu", 1)
    peak = base.groups[0].gpu.peak("float32")

    def prof(eff: float) -> ClusterProfile:
        return ClusterProfile(
            gemm=(GemmMeasurement("CPU", "float32", 8, 8, 8, 1024 / (eff * peak), peak),)
        )

    lo = estimate(g, (), base.with_profile(prof(0.05)), p).breakdown_dict()["compute"]
    hi = estimate(g, (), base.with_profile(prof(0.5)), p).breakdown_dict()["compute"]
    assert base.with_profile(prof(0.05)).groups[0].gpu.gemm_efficiency == pytest.approx(0.05)
    assert lo > 3 * hi


def test_calibration_that_agrees_with_the_learned_model_changes_nothing():
    """Re-anchoring oracle: a measured GEMM efficiency equal to the learned model's own at
    calibrate's default shapes leaves compute as it was; twice that halves the GEMM work."""
    import statistics

    from meshplan.api import estimate
    from meshplan.cost_model.compute import _gemm_op, host_gemm_anchor, latency_model
    from meshplan.ir.cluster import CPU_GEMM_SHAPES

    base = Cluster.preset("cpu", 1)
    gpu = base.groups[0].gpu
    model = latency_model(gpu)
    if model is None:
        pytest.skip("no learned model covers the CPU")
    own = statistics.median(
        model.efficiency(_gemm_op(m, n, k, "float32"), gpu) for m, n, k in CPU_GEMM_SHAPES
    )
    peak = gpu.peak("float32")

    def with_eff(eff: float) -> Cluster:
        meas = GemmMeasurement("CPU", "float32", 64, 64, 64, 2 * 64**3 / (eff * peak), peak)
        return base.with_profile(ClusterProfile(gemm=(meas,)))

    assert host_gemm_anchor(model, with_eff(own).groups[0].gpu) == pytest.approx(1.0)
    assert host_gemm_anchor(model, with_eff(2 * own).groups[0].gpu) == pytest.approx(0.5)
    g = transformer_graph(2, 512, 8, 8, 2048, 1000, 256, 4)
    p = Parallel(dp=1, tp=1, pp=1, global_batch=4, micro_batch=4)
    plain = estimate(g, (), base, p).breakdown_dict()["compute"]
    same = estimate(g, (), with_eff(own), p).breakdown_dict()["compute"]
    assert same == pytest.approx(plain, rel=1e-9)


def test_cluster_file_profile_field_and_bad_profiles(measured, tmp_path):
    dump_profile(measured, tmp_path / "prof.json")
    (tmp_path / "c.yaml").write_text(
        "groups:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 3}\nprofile: prof.json\n"
    )
    c = load_cluster(tmp_path / "c.yaml")
    assert c.profile == measured
    # The plan-JSON layout (Cluster.to_dict) carries the profile inline and loads back equal.
    from meshplan.ir.cluster_io import cluster_from_dict

    assert cluster_from_dict(c.to_dict()) == c
    bad = profile_to_dict(measured) | {"version": 99}
    with pytest.raises(ProfileError, match="version 99 is not supported"):
        profile_from_dict(bad, source="x.json")
    bad = profile_to_dict(measured)
    bad["tiers"][0]["curves"][0]["points"][1][0] = 1  # sizes no longer increasing
    with pytest.raises(ProfileError, match=r"tiers\[0\].curves\[0\]: all_reduce: sizes must"):
        profile_from_dict(bad, source="x.json")


def test_bad_settings_are_refused_before_starting():
    with pytest.raises(CalibrateError, match="unknown collective 'allreduce'"):
        calibrate(2, CalibrateConfig(collectives=("allreduce",)))
    with pytest.raises(CalibrateError, match="unknown GPU type"):
        calibrate(2, CalibrateConfig(gpu="H1OO"))
    with pytest.raises(CalibrateError, match="nccl needs CUDA"):
        calibrate(2, CalibrateConfig(backend="nccl"))
    assert parse_size("64MiB") == 64 * MiB and parse_size("4k") == 4 * KiB
    with pytest.raises(CalibrateError, match="bad size"):
        parse_size("4x")


def _cli(*args: str) -> subprocess.CompletedProcess:
    # A real process: the rank launcher needs a real stderr (faulthandler), which CliRunner's
    # captured streams are not.
    return subprocess.run(
        [sys.executable, "-m", "meshplan.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"},
    )


def test_cli_writes_a_profile_and_estimate_uses_it(tmp_path):
    out = tmp_path / "prof.json"
    r = _cli(
        "calibrate", "--nproc", "2", "--max-size", "16KiB", "--iters", "2",
        "--collectives", "all_reduce,p2p", "--gemm-shapes", "64x64x64", "-o", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "tier loopback" in r.stdout and f"wrote {out}" in r.stdout
    assert "loopback: all_reduce" in r.stderr  # progress, per collective
    assert [c.collective for c in load_profile(out).tiers[0].curves] == ["all_reduce", "p2p"]
    # A bad flag is one line, before any rank starts.
    r = _cli(
        "calibrate", "--nproc", "2", "--gemm-dtypes", "float99", "-o", str(tmp_path / "x.json")
    )
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: unknown dtype 'float99' for --gemm-dtypes; use torch names such as bfloat16, "
        "float16, float32"
    )
    # A profile that measured nothing of the cluster is a one-line error for estimate.
    r = CliRunner().invoke(
        app, ["estimate", "--model", "tiny", "--cluster", "dgx-h100", "--profile", str(out)]
    )
    assert r.exit_code == 2 and "none of which is a link tier" in r.stderr
    r = CliRunner().invoke(app, ["estimate", "--model", "tiny", "--profile", "nope.json"])
    assert r.exit_code == 2 and "nope.json: no such file" in r.stderr
