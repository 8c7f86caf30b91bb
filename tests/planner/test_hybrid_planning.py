"""Per-group precision (QSync-style, issue 19): the planner may run a slower group's
transformer-block linears in int8 (forward GEMMs) or FP8. Oracles: the linears' own FLOP
arithmetic (backward = 2 x forward), the pricing of the same plan by `estimate` with the engine
stated by hand, the JSON round trip, and the datasheet peaks each mode needs."""

from __future__ import annotations

import dataclasses

import meshplan
import pytest
from meshplan.api import hybrid_options, quantized_fraction
from meshplan.configs import ExportError, export
from meshplan.cost_model import predict
from meshplan.cost_model.compute import is_float8_linear
from meshplan.cost_model.engine import Engine
from meshplan.ir import Cluster, DeviceGroup, Parallel
from meshplan.ir.hardware import gpu_spec, link_tier
from meshplan.ir.plan import Plan, plan_problem

from tests.planner.test_cli import run
from tests.synthetic import transformer_graph


def _cluster(slow: str = "T4", a100_nodes: int = 1, slow_nodes: int = 8) -> Cluster:
    return Cluster(
        name=f"a100+{slow.lower()}",
        groups=(
            DeviceGroup("a100", gpu_spec("A100-80GB"), a100_nodes, 8, "nvlink3", "ib-hdr", 8),
            DeviceGroup("slow", gpu_spec(slow), slow_nodes, 4, "pcie4", "ib-hdr", 1),
        ),
        links=(link_tier("nvlink3"), link_tier("pcie4"), link_tier("ib-hdr")),
    )


GRAPH = transformer_graph(8, 2048, 16, 16, 8192, 32000, 2048, 1)


def test_auto_offers_each_slower_group_its_best_low_precision():
    assert hybrid_options(_cluster("T4"), "off", "float16") == [()]
    assert hybrid_options(_cluster("T4"), "auto", "float16") == [(), (("slow", "int8"),)]
    assert hybrid_options(_cluster("L4"), "auto", "bfloat16") == [
        (),
        (("slow", "fp8"),),
        (("slow", "int8"),),
    ]
    # V100: no INT8 or FP8 tensor cores, so nothing to offer
    assert hybrid_options(_cluster("V100"), "auto", "float16") == [()]
    assert hybrid_options(_cluster("T4"), {"slow": "int8"}, "float16") == [(("slow", "int8"),)]
    for bad, words in (
        ({"t4": "int8"}, "no device group 't4'"),
        ({"slow": "int4"}, "'int4' is not int8 or fp8"),
        ({"slow": "fp8"}, "T4 has no fp8 tensor cores"),
    ):
        with pytest.raises(ValueError, match=words):
            hybrid_options(_cluster("T4"), bad, "float16")


def test_quantized_fraction_follows_the_linears_flops():
    cluster = _cluster("T4")
    plan = meshplan.estimate_plan(
        GRAPH, cluster=cluster, parallel=Parallel(dp=40, tp=1, pp=1, micro_batch=1, global_batch=80)
    )
    blocks = dict(GRAPH.blocks)
    fwd = sum(
        op.fwd_flops
        for u in GRAPH.units
        for op in blocks[u.block].ops
        if is_float8_linear(op, blocks[u.block])
    )
    total = GRAPH.total_flops(training=True)  # one traced sequence
    n_slow = dict(plan.stages[0].replicas)["slow"]
    share = n_slow / plan.parallel.dp  # equal micro-batches on every replica
    int8 = quantized_fraction(GRAPH, plan.parallel, plan.stages, (("slow", "int8"),))
    fp8 = quantized_fraction(GRAPH, plan.parallel, plan.stages, (("slow", "fp8"),))
    assert int8 == pytest.approx(share * fwd / total, rel=1e-12)
    assert fp8 == int8  # both quantize the forward GEMMs only
    assert quantized_fraction(GRAPH, plan.parallel, plan.stages, ()) == 0.0


def test_auto_keeps_per_group_precision_only_where_faster_and_within_budget():
    cluster = _cluster("T4")
    kw = dict(cluster=cluster, global_batch=128, time_limit_s=2, equal_shares=True, compress="off")
    off = meshplan.plan(GRAPH, **kw)
    auto = meshplan.plan(GRAPH, hybrid_precision="auto", **kw)
    assert auto.hybrid_precision == (("slow", "int8"),)
    assert auto.predicted.step_time_s < off.predicted.step_time_s
    assert any("per-group precision slow int8" in n for n in auto.predicted.notes)
    # priced as `predict` prices that placement with the engine stated by hand
    again = predict(
        GRAPH,
        cluster,
        auto.parallel,
        auto.stages,
        dtype="float16",
        engine=Engine(hybrid=auto.hybrid_precision),
    )
    assert again.step_time_s == pytest.approx(auto.predicted.step_time_s, rel=1e-9)
    # recorded in the plan JSON, and read back
    back = Plan.from_json(auto.to_json())
    assert back.hybrid_precision == auto.hybrid_precision and plan_problem(back) is None
    assert "per-group precision slow int8 linears" in auto.explain()
    # a budget below what it needs keeps it off
    none = meshplan.plan(GRAPH, hybrid_precision="auto", max_quantized_fraction=0.001, **kw)
    assert none.hybrid_precision == ()
    # frameworks cannot express it
    with pytest.raises(ExportError, match="per-group precision"):
        export(auto, "megatron")


def test_plan_files_with_impossible_per_group_precision_are_refused():
    plan = meshplan.estimate_plan(
        GRAPH, cluster=_cluster("V100"), parallel=Parallel(dp=40, tp=1, pp=1, global_batch=80)
    )
    for hybrid, words in (
        ((("slow", "int8"),), "hybrid_precision.slow: V100 has no int8 tensor cores"),
        ((("gone", "int8"),), "hybrid_precision.gone: no device group 'gone'"),
    ):
        assert words in plan_problem(dataclasses.replace(plan, hybrid_precision=hybrid))
    t4 = meshplan.estimate_plan(
        GRAPH, cluster=_cluster("T4"), parallel=Parallel(dp=20, tp=2, pp=1, global_batch=80)
    )
    why = plan_problem(dataclasses.replace(t4, hybrid_precision=(("slow", "int8"),)))
    assert "replicas run tp=2" in why


def test_cli_refuses_a_malformed_hybrid_precision_in_one_line():
    r = run("plan", "--hybrid-precision", "t4=int4")
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        "error: --hybrid-precision: 't4=int4' is not GROUP=int8 or GROUP=fp8 (or give off / auto)"
    ]
    r = run("plan", "--hybrid-precision", "auto", "--max-quantized-fraction", "1.5")
    assert r.exit_code == 2 and "--max-quantized-fraction must be in [0, 1]" in r.output


def test_estimate_prices_a_given_per_group_precision_or_refuses_it():
    cluster = _cluster("T4")
    pins = Parallel(dp=40, tp=1, pp=1, micro_batch=1, global_batch=80)
    plain = meshplan.estimate_plan(GRAPH, cluster=cluster, parallel=pins)
    hybrid = meshplan.estimate_plan(
        GRAPH, cluster=cluster, parallel=pins, engine=Engine(hybrid=(("slow", "int8"),))
    )
    assert hybrid.hybrid_precision == (("slow", "int8"),) and not plain.hybrid_precision
    slow = [m for m in hybrid.predicted.memory if m.group == "slow"]
    assert slow and hybrid.predicted.step_time_s != plain.predicted.step_time_s
    with pytest.raises(ValueError, match="no device group 't4'"):
        meshplan.estimate_plan(
            GRAPH, cluster=cluster, parallel=pins, engine=Engine(hybrid=(("t4", "int8"),))
        )
    with pytest.raises(ValueError, match=r"replicas run tp=2.*pin --tp 1"):
        meshplan.estimate_plan(
            GRAPH,
            cluster=cluster,
            parallel=dataclasses.replace(pins, dp=20, tp=2),
            engine=Engine(hybrid=(("slow", "int8"),)),
        )
