"""Expert-parallel all-to-alls priced on the path their ranks take (unit tier, no GPU).

An ep group is ep consecutive dp ranks; where a stage's replicas are split over two sites, an
ep group can hold ranks of both, and the share of its all-to-all that goes to the other site
crosses the WAN. The expected times below are written from bytes / bandwidth + latency with
the datasheet link figures (`ir/hardware.py`), not from the cost model's code.
"""

from __future__ import annotations

import dataclasses
import math

import meshplan
import pytest
from meshplan.cost_model import predict
from meshplan.cost_model.ep_traffic import ep_spans
from meshplan.ir import Parallel
from meshplan.ir.cluster import GroupLink
from meshplan.ir.hardware import link_tier
from meshplan.passes.partition import even_stages, place_stages

from tests.synthetic import transformer_graph

B, S, H, TOP_K = 1, 4096, 2048, 2
BASE = 8.4e-6  # NCCL's per-collective base latency
NVLINK4 = 450e9 * 0.8  # per GPU, one way, NCCL efficiency 0.8
NIC = 8 * 50e9 * 0.85 / 8  # a DGX H100's 8 NDR NICs (0.85) shared by its 8 GPUs
WAN = 100e9 / 8 * 0.5  # the two-sites preset's 100 Gb/s WAN at efficiency 0.5
WAN_LATENCY = 1e-3  # its default one-way latency
NVLINK_LATENCY = 2e-6


def moe_layer():
    return transformer_graph(
        1, H, 16, 16, 4 * H, 0, S, B, experts=8, top_k=TOP_K, embed_and_head=False
    )


def config(**kw) -> Parallel:
    base = dict(tp=1, pp=1, cp=1, micro_batch=1, recompute="none", zero=0, schedule="1f1b")
    return Parallel(**(base | {"sequence_parallel": False} | kw))


def busiest(ep: int) -> float:
    """The busiest of ep ranks under a balanced router (the mean + sqrt(2 ln ep) std devs of
    Binomial(ep A, 1/ep), A = top_k tokens a rank routes)."""
    assignments = TOP_K * B * S
    return 1 + math.sqrt(2 * math.log(ep)) * math.sqrt((1 - 1 / ep) / assignments)


TOKENS = TOP_K * B * S * H * 2  # a rank's all-to-all buffer: top_k copies of its tokens, bf16


def run(cluster, parallel, replicas=None):
    g = moe_layer()
    stages = place_stages(cluster, parallel, even_stages(g, 1))
    if replicas is not None:
        stages = (dataclasses.replace(stages[0], replicas=replicas),)
    return stages, predict(g, cluster, parallel, stages)


def test_ep_group_spanning_the_wan_by_hand():
    """ep = 16 over two sites of 8: each rank sends 7/16 of its buffer inside its site
    (NVLink), 8/16 to the other site through its NIC share, and the WAN carries
    8 x 8 / 16 buffers each way. The WAN is the bottleneck."""
    cluster = meshplan.Cluster.preset("two-sites", gpus=16)
    stages, pred = run(cluster, config(dp=16, ep=16, global_batch=16))
    assert stages[0].replicas == (("h100-dc1", 8), ("h100-dc2", 8))
    size = busiest(16) * TOKENS
    per_byte = max(7 / 16 / NVLINK4, 8 / 16 / NIC, 8 * 8 / 16 / WAN)
    assert per_byte == 4 / WAN
    a2a = BASE + WAN_LATENCY + size * per_byte
    ep_comm = pred.breakdown_dict()["ep_comm"]
    assert ep_comm == pytest.approx(4 * a2a, rel=1e-9)  # dispatch + combine, fwd and bwd
    # ~0.09 s; priced inside one node of NVLink (as before this was fixed) it was ~0.4 ms
    nvlink_only = 4 * (BASE + NVLINK_LATENCY + size * (15 / 16) / NVLINK4)
    assert ep_comm > 100 * nvlink_only


def test_ep_group_inside_a_site_by_hand():
    """ep = 8 on the same 16 GPUs: every ep group is one site's node, all NVLink."""
    cluster = meshplan.Cluster.preset("two-sites", gpus=16)
    _, pred = run(cluster, config(dp=16, ep=8, global_batch=16))
    a2a = BASE + NVLINK_LATENCY + busiest(8) * TOKENS * (7 / 8) / NVLINK4
    assert pred.breakdown_dict()["ep_comm"] == pytest.approx(4 * a2a, rel=1e-9)
    assert pred.breakdown_dict()["ep_comm"] < 0.01


def test_an_uneven_split_makes_one_ep_group_span_the_sites():
    """ep = 8, dp = 16 placed 4 | 12: dp ranks 0-7 are 4 in dc1 and 4 in dc2 (one spanning ep
    group, 4 x 4 / 8 buffers each way over the WAN), ranks 8-15 one whole ep group in dc2.
    The spanning group sets the stage's EP time on both sites."""
    cluster = meshplan.Cluster.preset("two-sites", gpus=32)
    replicas = (("h100-dc1", 4), ("h100-dc2", 12))
    assert ep_spans(replicas, 8) == ([(("h100-dc1", 4), ("h100-dc2", 4))], {"h100-dc2"})
    _, pred = run(cluster, config(dp=16, ep=8, global_batch=16), replicas)
    per_byte = max(3 / 8 / NVLINK4, 4 / 8 / NIC, 4 * 4 / 8 / WAN)
    a2a = BASE + WAN_LATENCY + busiest(8) * TOKENS * per_byte
    assert pred.breakdown_dict()["ep_comm"] == pytest.approx(4 * a2a, rel=1e-9)


@pytest.mark.parametrize(
    ("replicas", "ep", "spanning", "whole"),
    [
        ((("a", 8), ("b", 8)), 8, [], {"a", "b"}),
        ((("a", 8), ("b", 8)), 16, [(("a", 8), ("b", 8))], set()),
        ((("a", 6), ("b", 10)), 4, [(("a", 2), ("b", 2))], {"a", "b"}),
        ((("a", 2), ("b", 2), ("c", 4)), 8, [(("a", 2), ("b", 2), ("c", 4))], set()),
    ],
)
def test_ep_spans(replicas, ep, spanning, whole):
    assert ep_spans(replicas, ep) == (spanning, whole)


def zoo_moe():
    return meshplan.models.transformer(
        layers=2, hidden=1024, heads=8, ffn=4096, vocab=1000, seq_len=256, experts=16, top_k=2
    )


def two_sites(wan: str):
    cluster = meshplan.Cluster.preset("two-sites", gpus=16)
    links = tuple(t for t in cluster.links if t.name != "wan-100g") + (link_tier(wan),)
    return dataclasses.replace(cluster, links=links, group_links=(GroupLink("dc1", "dc2", wan),))


@pytest.mark.parametrize("wan", ["wan-100g", "wan-10g"])
def test_planner_keeps_ep_groups_inside_a_site(wan):
    """Before, the all-to-all of an ep group spanning both sites was priced on one site's
    NVLink and the planner chose ep = 16 across the WAN (no expert gradients over the WAN);
    priced on the WAN, that plan is several times slower than one with ep groups per site."""
    model, inputs = zoo_moe()
    cluster = two_sites(wan)
    gb = 2**21 // 256  # 2M tokens per step, pinned: the default depends on the cluster size
    plan = meshplan.plan(model, inputs, cluster, global_batch=gb)
    ep = plan.parallel.ep
    assert all(not ep_spans(st.replicas, ep)[0] for st in plan.stages)
    across = meshplan.plan(model, inputs, cluster, global_batch=gb, parallel=Parallel(ep=16))
    assert any(ep_spans(st.replicas, 16)[0] for st in across.stages)
    assert any("spans device groups" in note for note in across.predicted.notes)
    assert across.predicted.step_time_s > 4 * plan.predicted.step_time_s
