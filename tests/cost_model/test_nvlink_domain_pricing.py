"""Collectives inside and across NVLink domains wider than a node (GB200 NVL72), by hand.

A GB200 NVL72 rack is 18 trays of 4 GPUs on one NVLink 5 switch fabric: any two of its 72 GPUs
talk at 1.8 TB/s bidirectional, 900 GB/s each way (NVIDIA GB200 NVL72 datasheet), whether they
share a tray or not; between racks traffic leaves through the trays' NICs, one 400 Gb/s
ConnectX-7 per GPU (4 per tray). The expected times below are written from the ring formula
t = alpha_0 + steps * alpha_hop + S * f(n) / busbw with these figures, not from the cost
model's code (tests/cost_model/test_collectives.py checks the formula itself on DGX nodes).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from meshplan.cost_model import predict
from meshplan.cost_model.collectives import (
    Collective,
    Path,
    collective_time,
    group_collective_time,
    group_path,
)
from meshplan.ir import Cluster, DeviceGroup, Parallel
from meshplan.passes.partition import even_stages, place_stages

from tests.synthetic import transformer_graph

GiB = 2**30
A0 = 8.4e-6  # NCCL's per-collective base latency (src/graph/tuning.cc baseLat)
# NVLink 5: 1.8 TB/s per GPU bidirectional / 2 (GB200 NVL72 datasheet), at the NVLink
# default efficiency 0.8 (meshplan.ir.hardware.DEFAULT_EFFICIENCY) and 2 us per hop.
NVLINK5_BUS = 900e9 * 0.8
NV_HOP = 2e-6
# One GPU's share of its tray's NICs: 4 x 400 Gb/s NDR (50 GB/s, efficiency 0.85) over 4 GPUs.
NIC_SHARE = 4 * 50e9 * 0.85 / 4
IB_HOP = 5e-6


def nvl72(gpus: int) -> tuple[Cluster, DeviceGroup]:
    cluster = Cluster.preset("GB200", gpus)
    return cluster, cluster.groups[0]


def trays_without_domain(gpus: int) -> tuple[Cluster, DeviceGroup]:
    """The same trays as separate 4-GPU nodes, no NVLink between them (how the preset used to
    pretend nodes were built): the contrast a domain must not be priced like."""
    cluster, g = nvl72(gpus)
    plain = dataclasses.replace(g, nvlink_domain=None)
    return dataclasses.replace(cluster, groups=(plain,)), plain


def one_big_node(gpus: int) -> Cluster:
    """One node per NVLink domain, each with one NIC per GPU: what an NVL72 rack is to the cost
    model, written with plain nodes (no `nvlink_domain`)."""
    cluster, g = nvl72(gpus)
    d = g.domain_gpus
    big = DeviceGroup(
        g.name, g.gpu, gpus // d, d, g.intra_link, g.inter_link, nics_per_node=d,
        price_per_gpu_hour=g.price_per_gpu_hour,
    )  # fmt: skip
    return Cluster(cluster.name, (big,), cluster.links)


def test_the_preset_tiers_are_the_datasheet_figures() -> None:
    cluster, g = nvl72(72)
    assert cluster.link(g.intra_link).effective_bandwidth == pytest.approx(NVLINK5_BUS)
    assert g.nics_per_node * cluster.link(g.inter_link).effective_bandwidth / 4 == NIC_SHARE


@pytest.mark.parametrize("kind", [Collective.ALL_REDUCE, Collective.ALL_TO_ALL])
def test_sixteen_gpus_over_four_trays_run_at_nvlink5(kind: Collective) -> None:
    """A TP (or EP) collective over 16 GPUs spanning 4 trays of one rack runs on NVLink 5,
    exactly as over the 4 GPUs of one tray, the bandwidth term scaled by the ring's bus
    factor: all-reduce 2(n-1)/n (30/16 against 6/4), all-to-all (n-1)/n (15/16 against 3/4),
    both 1.25 times the 4-GPU term; latency 2(n-1) hops (all-reduce) or one (all-to-all)."""
    cluster, g = nvl72(72)
    size = 256 * 2**20
    on_nvlink = Path(NVLINK5_BUS, NV_HOP)
    # Ranks per domain as the pricer passes them for EP (tp = cp = 1): the whole domain.
    assert group_path(cluster, g, 16, g.domain_gpus) == on_nvlink
    assert group_path(cluster, g, 4, g.domain_gpus) == on_nvlink
    if kind == Collective.ALL_REDUCE:
        steps16, steps4, f16, f4 = 30, 6, 2 * 15 / 16, 2 * 3 / 4
    else:
        steps16, steps4, f16, f4 = 1, 1, 15 / 16, 3 / 4
    t16 = group_collective_time(kind, size, cluster, g, 16, g.domain_gpus)
    t4 = group_collective_time(kind, size, cluster, g, 4, g.domain_gpus)
    assert t16 == pytest.approx(A0 + steps16 * NV_HOP + size * f16 / NVLINK5_BUS, rel=1e-12)
    assert t4 == pytest.approx(A0 + steps4 * NV_HOP + size * f4 / NVLINK5_BUS, rel=1e-12)
    bandwidth_term16 = t16 - A0 - steps16 * NV_HOP
    bandwidth_term4 = t4 - A0 - steps4 * NV_HOP
    assert bandwidth_term16 == pytest.approx(1.25 * bandwidth_term4, rel=1e-12)
    # Not at the InfiniBand rate: 4 ranks per tray would drive 4 NIC shares, 170 GB/s.
    _, plain = trays_without_domain(72)
    ib = group_path(cluster, plain, 16, 4)
    assert ib == Path(4 * NIC_SHARE, IB_HOP)
    assert collective_time(kind, size, 16, ib) > 4 * bandwidth_term16


def test_a_ring_across_two_racks_crosses_the_inter_link() -> None:
    """144 GPUs are two NVLink domains of 72: a ring inside one stays on NVLink 5; a ring with
    ranks in both goes through the NICs, p NIC shares per rack (capped by NVLink 5), at the
    InfiniBand hop latency."""
    cluster, g = nvl72(144)
    assert (g.domain_gpus, g.domains) == (72, 2)
    assert group_path(cluster, g, 72, 72) == Path(NVLINK5_BUS, NV_HOP)
    # The DP ring of a tp=72 configuration: one rank per rack, one NIC share.
    assert group_path(cluster, g, 2, 1) == Path(NIC_SHARE, IB_HOP)
    # A DP ring of 16 with 8 ranks per rack (tp = 9): 8 NIC shares, 340 GB/s.
    assert group_path(cluster, g, 16, 8) == Path(8 * NIC_SHARE, IB_HOP)
    # Every GPU of both racks: 72 NIC shares (3.06 TB/s) exceed a GPU's NVLink 5, which caps.
    assert group_path(cluster, g, 144, 72) == Path(NVLINK5_BUS, IB_HOP)
    t = group_collective_time(Collective.REDUCE_SCATTER, GiB, cluster, g, 2, 1)
    assert t == pytest.approx(A0 + IB_HOP + GiB / 2 / NIC_SHARE, rel=1e-12)


# -- through predict: an EP all-to-all and whole steps ----------------------------------------

B, S, H, TOP_K = 1, 4096, 2048, 2
TOKENS = TOP_K * B * S * H * 2  # a rank's all-to-all buffer: top_k copies of its tokens, bf16


def busiest(ep: int) -> float:
    """The busiest of ep ranks under a balanced router (the mean + sqrt(2 ln ep) std devs of
    Binomial(ep A, 1/ep), A = top_k tokens a rank routes; tests/cost_model/test_ep_topology)."""
    assignments = TOP_K * B * S
    return 1 + math.sqrt(2 * math.log(ep)) * math.sqrt((1 - 1 / ep) / assignments)


def config(**kw) -> Parallel:
    base = dict(tp=1, pp=1, cp=1, ep=1, micro_batch=1, recompute="none", zero=0, schedule="1f1b")
    return Parallel(**(base | {"sequence_parallel": False} | kw))


def run(cluster: Cluster, graph, parallel: Parallel):
    stages = place_stages(cluster, parallel, even_stages(graph, parallel.pp))
    return predict(graph, cluster, parallel, stages)


def test_ep16_over_four_trays_is_one_nvlink_all_to_all_by_hand() -> None:
    """ep = 16 on 16 GB200s (4 trays of one rack): dispatch and combine, forward and backward,
    each one all-to-all of the busiest rank's buffer over NVLink 5 (15/16 of it leaves the
    rank). As 4 separate 4-GPU nodes it would cross InfiniBand at 4 NIC shares."""
    moe = transformer_graph(
        1, H, 16, 16, 4 * H, 0, S, B, experts=16, top_k=TOP_K, embed_and_head=False
    )
    size = busiest(16) * TOKENS
    cluster, _ = nvl72(16)
    ep_comm = run(cluster, moe, config(dp=16, ep=16, global_batch=16)).breakdown_dict()["ep_comm"]
    assert ep_comm == pytest.approx(4 * (A0 + NV_HOP + size * 15 / 16 / NVLINK5_BUS), rel=1e-9)
    plain, _ = trays_without_domain(16)
    on_ib = run(plain, moe, config(dp=16, ep=16, global_batch=16)).breakdown_dict()["ep_comm"]
    assert on_ib == pytest.approx(4 * (A0 + IB_HOP + size * 15 / 16 / (4 * NIC_SHARE)), rel=1e-9)


@pytest.mark.parametrize(
    ("gpus", "parallel"),
    [
        (16, config(tp=16, dp=1, global_batch=4)),  # TP over 4 trays
        (64, config(tp=4, dp=8, cp=2, global_batch=8)),  # CP and DP rings over 16 trays
        (144, config(tp=8, pp=2, dp=9, global_batch=18)),  # a stage per rack: p2p over IB
    ],
)
def test_a_domain_prices_like_one_node_of_its_size(gpus: int, parallel: Parallel) -> None:
    """Trays in an NVLink domain are, to the cost model, one node of the domain's GPUs with one
    NIC per GPU: every part of the step, memory included, comes out the same."""
    graph = transformer_graph(2, 2048, 16, 16, 8192, 32000, 4096, 1)
    cluster, _ = nvl72(gpus)
    domain, node = run(cluster, graph, parallel), run(one_big_node(gpus), graph, parallel)
    assert domain.breakdown == node.breakdown
    assert domain.step_time_s == node.step_time_s
    assert domain.peak_memory_bytes == node.peak_memory_bytes
    if gpus == 144:  # two racks: the boundary between stages is priced on the NICs
        assert domain.breakdown_dict()["pp_p2p"] > 0
