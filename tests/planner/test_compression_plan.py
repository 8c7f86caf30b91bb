"""The planner's compression and quantization decisions (docs/compression.md): where coding
pays, that allowing it never slows a plan, plan JSON round trips and old plans still load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import meshplan
import pytest
from meshplan import Cluster, Parallel
from meshplan.ir.plan import CompressionPlan, Plan, PlanError, QuantizationPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from synthetic import transformer_graph  # noqa: E402


@pytest.fixture(scope="module")
def small():
    return transformer_graph(4, 1024, 8, 8, 4096, 32000, 1024, 1, name="small")


@pytest.fixture(scope="module")
def wide():
    # ~2.8B parameters: its gradients make data-parallel traffic across a WAN expensive
    return transformer_graph(16, 4096, 32, 8, 14336, 32000, 4096, 1, name="wide")


CROSS = Parallel(dp=16, tp=1, pp=1, cp=1, micro_batch=1, recompute="full", zero=2)


@pytest.mark.parametrize("preset", ["dgx-h100", "two-sites", "rtx4090-ethernet"])
def test_allowing_compression_never_slows_the_plan(small, preset):
    c = Cluster.preset(preset, gpus=16)
    off = meshplan.plan(small, cluster=c, global_batch=64, compress="off", time_limit_s=20)
    on = meshplan.plan(small, cluster=c, global_batch=64, compress="auto", time_limit_s=20)
    assert off.solver.status == on.solver.status == "optimal"
    assert on.predicted.step_time_s <= off.predicted.step_time_s * (1 + 1e-9)
    assert off.compression == CompressionPlan()  # nothing recorded when off


def test_wan_dp_traffic_is_coded_and_the_step_is_faster(wide):
    c = Cluster.preset("two-sites", gpus=16)
    off = meshplan.plan(wide, cluster=c, parallel=CROSS, global_batch=64, compress="off")
    on = meshplan.plan(wide, cluster=c, parallel=CROSS, global_batch=64, compress="auto")
    assert len(on.stages[0].replicas) == 2  # the DP ring crosses the WAN
    assert on.predicted.step_time_s < off.predicted.step_time_s
    cross = [d for d in on.compression.decisions if "across" in d.group]
    assert cross and all(d.method == "lossless" for d in cross)
    assert "compression (auto" in on.explain() and "lossless" in on.explain()


def test_nvlink_traffic_stays_raw(small):
    """TP traffic is raw: the runtime cannot code it (the decision says why), and on NVLink
    coding would not pay anyway (priced with TP coding allowed, as for another engine)."""
    from meshplan.cost_model.collectives import intra_node_path
    from meshplan.cost_model.compression import CommOptions
    from meshplan.cost_model.pricer import pricer_for

    c = Cluster.preset("dgx-h100", gpus=8)
    p = meshplan.plan(
        small, cluster=c, parallel=Parallel(tp=8, pp=1, dp=1), global_batch=8, compress="auto"
    )
    tp = [d for d in p.compression.decisions if d.group.startswith("tp in")]
    assert tp and all(d.method == "raw" and d.reason.startswith("raw: DTensor") for d in tp)
    what_if = pricer_for(small, c, "bfloat16", CommOptions(axes=("dp", "tp")))
    g = c.groups[0]
    for fact in what_if.costs.facts.values():
        for col in fact.tp_collectives:
            for kind in col.with_sp:
                ch = what_if.comm_choice(
                    kind, col.size_bytes, 8, intra_node_path(c, g), g.gpu, "activations", "tp"
                )
                assert ch.method == "raw" and ch.lossless_s > ch.raw_s


def test_round_trip_keeps_every_decision(wide):
    c = Cluster.preset("two-sites", gpus=16)
    p = meshplan.plan(
        wide, cluster=c, parallel=CROSS, global_batch=64, compress="auto", quantize="auto"
    )
    q = Plan.from_json(p.to_json(), cluster=c)
    assert q.compression == p.compression and q.compression.decisions
    assert q.quantization == p.quantization and q.quantization.mode == "auto"
    assert q.parallel == p.parallel
    assert q.to_json() == p.to_json()


def test_old_v1_plans_load_with_defaults(small):
    c = Cluster.preset("dgx-h100", gpus=8)
    p = meshplan.plan(small, cluster=c, global_batch=8, compress="off")
    data = json.loads(p.to_json())
    # v1 as written before the decisions existed: explicit "none" ...
    assert data["quantization"] == {"activations": "none", "gradients": "none"}
    assert data["compression"] == {"collectives": "none"}
    assert Plan.from_json(json.dumps(data)).compression == CompressionPlan()
    # ... or the fields missing altogether
    del data["quantization"], data["compression"]
    old = Plan.from_json(json.dumps(data))
    assert old.compression == CompressionPlan() and old.quantization == QuantizationPlan()
    assert old.parallel.quantize_activations is None


def test_schema_rejects_a_bad_method(wide):
    c = Cluster.preset("two-sites", gpus=16)
    p = meshplan.plan(wide, cluster=c, parallel=CROSS, global_batch=64, compress="auto")
    data = json.loads(p.to_json())
    data["compression"]["collectives"][0]["method"] = "zip"
    with pytest.raises(PlanError, match=r"compression\.collectives\[0\]\.method"):
        Plan.from_json(json.dumps(data))


def test_quantized_activations_when_memory_binds(wide):
    """A pinned configuration whose activations do not fit in 80 GB without quantization:
    off by default (no plan), found with quantize="activations" (AGoQ widths recorded)."""
    c = Cluster.preset("dgx-h100", gpus=8)
    pin = Parallel(dp=8, tp=1, pp=1, cp=1, micro_batch=2, recompute="none", zero=3)
    with pytest.raises(meshplan.InfeasibleError):
        meshplan.plan(wide, cluster=c, parallel=pin, global_batch=32)
    p = meshplan.plan(wide, cluster=c, parallel=pin, global_batch=32, quantize="activations")
    assert p.parallel.quantize_activations and p.predicted.fits
    bits = dict(dict(p.quantization.activation_bits)[0])
    assert bits["mlp"] == 4 and bits["norm"] == 8 and bits["embedding"] is None
    assert "stage 0 activation bits" in p.explain()


def test_bad_options_are_one_line_errors(small):
    with pytest.raises(ValueError, match="compress must be one of auto, off, got 'yes'"):
        meshplan.plan(small, compress="yes")
    with pytest.raises(ValueError, match="quantize must be one of"):
        meshplan.plan(small, quantize="int4")
