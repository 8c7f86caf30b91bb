"""The host's share of an eager step (`cost_model.host`): the chain formula against a
hand-derived case, where it applies (GPU groups, eager engines), the breakdown, the options,
and the oracle that matters: training steps measured on GPU machines whose host held the GPU
up (data/gpu_step/*_session26.json; the constants came from other runs: the tiny-8 steps on
the H200 machine's host and this host's own CPU passes, docs/op_latency.md)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import meshplan
import pytest
from meshplan.cost_model.engine import Engine, EngineError
from meshplan.cost_model.host import HOST_NODE_S, PHASE_FACTORS, host_exposed, host_times
from meshplan.ir.parallel import Recompute

from tests.benchmark_module import benchmark_module

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "data" / "gpu_step" / "H100_session26.json"


def test_host_time_is_nodes_times_the_phase_factors():
    f, b = PHASE_FACTORS[Recompute.SELECTIVE]
    assert host_times(100, Recompute.SELECTIVE, 2e-6) == pytest.approx((200e-6 * f, 200e-6 * b))
    assert host_times(100, None, 2e-6) == host_times(100, Recompute.NONE, 2e-6)


@pytest.mark.parametrize(
    "g_f, g_b, h_f, h_b, want",
    [
        (3.0, 6.0, 1.0, 2.0, (0.0, 0.0)),  # GPU-bound: the host runs ahead, nothing exposed
        (1.0, 2.0, 4.0, 5.0, (3.0, 3.0)),  # host-bound: the step is the host's 9
        (1.0, 6.0, 4.0, 1.0, (0.0, 0.0)),  # the forward's wait hidden behind a long backward
        (1.0, 3.0, 4.0, 1.0, (1.0, 0.0)),  # host 5 against GPU 4: the forward waits 1
    ],
)
def test_exposed_host_time(g_f, g_b, h_f, h_b, want):
    # by hand: over the micro-batches the GPU waits max(0, H - G) in all, first in forward
    assert host_exposed(g_f, g_b, h_f, h_b) == pytest.approx(want)


def _tiny(cluster: str, engine: Engine = Engine(), recompute=Recompute.NONE):
    model, inputs = meshplan.models.transformer(
        dtype="bfloat16", layers=2, hidden=128, heads=4, kv_heads=4, ffn=256, vocab=512,
        seq_len=64,
    )  # fmt: skip
    par = meshplan.Parallel(dp=1, tp=1, pp=1, micro_batch=1, global_batch=2, recompute=recompute)
    plan = meshplan.estimate_plan(model, inputs, cluster, par, engine=engine)
    return plan.predicted


def test_a_small_model_on_a_gpu_is_host_bound_and_the_breakdown_says_so():
    p = _tiny("H100")
    parts = dict(p.breakdown)
    assert parts["host"] > parts["compute"]  # kernels of microseconds, ~50 us of host an op
    assert sum(parts.values()) == pytest.approx(p.step_time_s)
    off = _tiny("H100", Engine(host_node_s=0.0))
    assert dict(off.breakdown)["host"] == 0.0
    assert off.step_time_s < p.step_time_s / 3
    # by hand: host-bound, the exposed part is H - G; twice the host's time per op adds H,
    # which is the exposed part plus the GPU's compute
    slow = _tiny("H100", Engine(host_node_s=2 * HOST_NODE_S))
    added = dict(slow.breakdown)["host"] - parts["host"]
    assert added == pytest.approx(parts["host"] + parts["compute"], rel=1e-6)


def test_selective_checkpointing_costs_the_host_most():
    none = dict(_tiny("H100").breakdown)["host"]
    full = dict(_tiny("H100", recompute=Recompute.FULL).breakdown)["host"]
    sel = dict(_tiny("H100", recompute=Recompute.SELECTIVE).breakdown)["host"]
    assert none < full < sel


def test_compiled_engines_and_cpu_groups_have_no_host_term():
    assert dict(_tiny("H100", Engine(fused=True)).breakdown)["host"] == 0.0
    assert dict(_tiny("cpu").breakdown)["host"] == 0.0


def test_engine_checks_its_host_time():
    with pytest.raises(EngineError, match="host_node_s"):
        Engine(host_node_s=-1.0)
    assert Engine(host_node_s=1e-6).is_eager  # the learned op model still applies
    assert "host 1 us/op" in Engine(host_node_s=1e-6).describe()


def test_cli_host_us_is_checked():
    from meshplan.cli import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["estimate", "--host-us", "-3"])
    assert r.exit_code == 2 and r.stderr.strip().startswith("error:"), r.output
    assert "--host-us" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not H100.is_file(), reason="data/gpu_step not present")
def test_steps_measured_on_a_held_out_host_are_predicted():
    """The H100 machine's host (Firecracker, not the H200's gVisor host the level was measured
    on): tiny steps, small micro-batches and selective recompute, 2-25x of the GPU's time."""
    step = benchmark_module("gpu_step")
    rows = json.loads(H100.read_text())
    errs, gpu_only = [], []
    for r in rows:
        case = step.case_of(r)
        errs.append(step.predicted(case, r["gpu"]).predicted.step_time_s / r["measured_s"] - 1)
        off = step.predicted(case, r["gpu"], Engine(host_node_s=0.0)).predicted
        gpu_only.append(off.step_time_s / r["measured_s"] - 1)
    assert statistics.median(abs(e) for e in errs) < 0.2, errs
    assert max(abs(e) for e in errs) < 0.35, errs  # host-bound steps vary 15-25% run to run
    assert statistics.median(abs(e) for e in gpu_only) > 0.4, gpu_only  # without it: -41..-95%


def test_tensor_parallel_multiplies_the_host_time_of_the_ops_issued():
    from meshplan.cost_model.host import TP_FACTOR

    base = sum(host_times(100, Recompute.NONE, 1.0))
    assert sum(host_times(100, Recompute.NONE, 1.0, tp=2)) == pytest.approx(TP_FACTOR[False] * base)
    assert sum(host_times(100, Recompute.NONE, 1.0, tp=8, sequence_parallel=True)) == (
        pytest.approx(TP_FACTOR[True] * base)
    )
    # measured (module docstring): TP 2 + SP + selective at 8.51x TP 1 without recompute
    sel = sum(host_times(100, Recompute.SELECTIVE, 1.0, tp=2, sequence_parallel=True))
    assert sel / base == pytest.approx(8.51, rel=0.05)
    # every other layer checkpointed whole: between none and full, no dispatch mode
    half = sum(host_times(100, Recompute.SELECTIVE, 1.0, every_other_layer=True))
    full = sum(host_times(100, Recompute.FULL, 1.0))
    assert half == pytest.approx((base + full) / 2)


def test_only_the_layers_take_the_recompute_factors(monkeypatch):
    from meshplan.cost_model.pricer import pricer_for
    from meshplan.ir.parallel import StageConfig

    from tests.synthetic import h100_cluster, transformer_graph

    graph = transformer_graph(2, 256, 4, 4, 1024, 1000, 128, 1)
    pricer = pricer_for(graph, h100_cluster(1), "bfloat16", engine=Engine(host_node_s=1e-3))
    layer, edge = {}, {}
    for rc in ("none", "full", "selective"):
        cfg = StageConfig(1, 1, 1, False, 1, rc)
        layer[rc] = pricer.block_time("layer", "h100", cfg).host
        edge[rc] = pricer.block_time("epilogue", "h100", cfg).host
    assert layer["none"] < layer["full"] < layer["selective"]
    assert edge["none"] == edge["full"] == edge["selective"] > 0


def test_a_bad_host_variable_is_one_line_before_tracing(monkeypatch):
    from meshplan.cli import app
    from typer.testing import CliRunner

    monkeypatch.setenv("MESHPLAN_HOST_US", "fast")
    r = CliRunner().invoke(app, ["estimate", "-m", "no-such-model-file.py"])
    assert r.exit_code == 2 and "MESHPLAN_HOST_US" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
