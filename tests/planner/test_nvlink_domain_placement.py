"""The planner on GB200 NVL72 racks: TP and EP wider than a 4-GPU tray stay inside the rack's
NVLink domain, where they are priced on NVLink 5 (tests/cost_model/test_nvlink_domain_pricing.py
derives the prices by hand); the same trays without a domain refuse tp = 16."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from meshplan.ir import Cluster, DeviceGroup, Parallel
from meshplan.ir.plan import assign_ranks
from meshplan.solver import InfeasibleError, enumerate_candidates, solve
from meshplan.whatif import part_link_tier

from tests.synthetic import transformer_graph

# 16 heads and 16 kv heads: tp = 16 divides them.
SMALL = transformer_graph(8, 2048, 16, 16, 8192, 32000, 4096, 1, name="small")
MOE = transformer_graph(4, 2048, 16, 16, 4096, 32000, 4096, 1, experts=16, top_k=2, name="moe")


def one_big_node(cluster: Cluster) -> Cluster:
    """The rack as one 64-GPU node with one NIC per GPU: the cost model's equivalent."""
    (g,) = cluster.groups
    big = dataclasses.replace(
        g, nodes=1, gpus_per_node=g.domain_gpus, nics_per_node=g.domain_gpus, nvlink_domain=None
    )
    return dataclasses.replace(cluster, groups=(big,))


def without_domain(cluster: Cluster) -> Cluster:
    (g,) = cluster.groups
    return dataclasses.replace(cluster, groups=(dataclasses.replace(g, nvlink_domain=None),))


def trays_of_each_tp_group(cluster: Cluster, result) -> set[int]:
    """How many trays (nodes) each TP group's ranks sit on."""
    trays: dict[tuple, set[int]] = {}
    for row in assign_ranks(cluster, result.parallel, result.stages):
        if row.coords is not None:
            pp, dp, cp, _ = row.coords
            trays.setdefault((pp, dp, cp), set()).add(row.node)
    return {len(v) for v in trays.values()}


def test_tp16_is_placed_across_four_trays_of_one_rack() -> None:
    cluster = Cluster.preset("GB200", 64)  # 16 trays of one NVL72 rack
    r = solve(SMALL, cluster, Parallel(tp=16), global_batch=16, time_limit_s=5)
    assert r.parallel.tp == 16 and r.prediction.fits
    assert trays_of_each_tp_group(cluster, r) == {4}
    # Priced as inside one node of 64 GPUs, i.e. on NVLink 5, not between trays over IB.
    same = solve(SMALL, one_big_node(cluster), r.parallel, global_batch=16, time_limit_s=5)
    assert r.prediction.breakdown_dict()["tp_comm"] == same.prediction.breakdown_dict()["tp_comm"]
    # The same trays without the NVLink domain: TP stays inside a 4-GPU node.
    with pytest.raises(InfeasibleError, match="tp=16 does not divide gpus_per_node=4"):
        solve(SMALL, without_domain(cluster), Parallel(tp=16), global_batch=16, time_limit_s=5)


def test_the_planner_considers_tp_wider_than_a_tray() -> None:
    cluster = Cluster.preset("GB200", 64)
    wide = {c.tp for c in enumerate_candidates(SMALL, cluster, Parallel(), 16)}
    assert {8, 16} <= wide
    narrow = {c.tp for c in enumerate_candidates(SMALL, without_domain(cluster), Parallel(), 16)}
    assert max(narrow) == 4


def test_ep16_over_four_trays_is_priced_on_nvlink() -> None:
    cluster = Cluster.preset("GB200", 16)  # 4 trays
    pinned = Parallel(ep=16, tp=1, cp=1, pp=1)
    r = solve(MOE, cluster, pinned, global_batch=16, time_limit_s=5)
    assert r.parallel.ep == 16 and r.parallel.dp == 16
    ep_comm = r.prediction.breakdown_dict()["ep_comm"]
    node = solve(MOE, one_big_node(cluster), r.parallel, global_batch=16, time_limit_s=5)
    assert ep_comm == node.prediction.breakdown_dict()["ep_comm"]
    trays = solve(MOE, without_domain(cluster), r.parallel, global_batch=16, time_limit_s=5)
    assert trays.prediction.breakdown_dict()["ep_comm"] > 2 * ep_comm  # 4 NIC shares, not NVLink
    # `meshplan whatif` names the tier the all-to-all runs on the same way.
    assert part_link_tier(r, "ep_comm", cluster) == "nvlink5"
    assert part_link_tier(trays, "ep_comm", without_domain(cluster)) == "ib-ndr"


def test_two_racks_keep_tp_inside_a_rack() -> None:
    """144 GPUs are two domains of 72: tp = 16 does not divide 72, so a TP group would straddle
    the racks and is refused, one line, naming the domain size."""
    cluster = Cluster.preset("GB200", 144)
    (g,) = cluster.groups
    assert isinstance(g, DeviceGroup) and g.domains == 2
    with pytest.raises(InfeasibleError) as info:
        solve(SMALL, cluster, Parallel(tp=16), global_batch=18, time_limit_s=5)
    assert "tp=16 does not divide the GPUs per NVLink domain (72)" in str(info.value)


def test_whatif_gpu_swap_keeps_the_domain_only_between_rack_scale_types() -> None:
    W = importlib.import_module("meshplan.whatif")  # the module; `meshplan.whatif` is its function
    gb300, h100 = (
        W.build_cluster(p, 16) for p in W.sweep_points(["GB200"], {"gpu": ["GB300", "H100"]})
    )
    assert gb300.groups[0].nvlink_domain == 72 and gb300.groups[0].domain_gpus == 16
    assert h100.groups[0].nvlink_domain is None and h100.groups[0].domain_gpus == 4
