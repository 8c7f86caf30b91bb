"""Collective costs against hand-derived alpha-beta values (hardware.md formulas)."""

from __future__ import annotations

import pytest
from meshplan.cost_model.collectives import (
    Collective,
    Path,
    bus_factor,
    collective_time,
    cross_group_path,
    group_collective_time,
    group_path,
    intra_node_path,
)

from tests.synthetic import h100_cluster, mixed_cluster

GiB = 2**30
NVLINK4_BUS = 450e9 * 0.8  # NVLink4 one direction, times the tier efficiency
NDR_NIC = 50e9 * 0.85  # one NDR 400 Gb/s NIC, times the tier efficiency


def test_bus_factors():
    assert bus_factor(Collective.ALL_REDUCE, 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor(Collective.ALL_GATHER, 8) == pytest.approx(7 / 8)
    assert bus_factor(Collective.REDUCE_SCATTER, 4) == pytest.approx(3 / 4)
    assert bus_factor(Collective.ALL_TO_ALL, 2) == pytest.approx(1 / 2)
    assert bus_factor(Collective.P2P, 2) == 1.0
    assert collective_time(Collective.ALL_REDUCE, GiB, 1, Path(1e9, 1e-6)) == 0.0


def test_all_reduce_1gib_over_8_gpus_on_nvlink4():
    c = h100_cluster(1)
    t = group_collective_time(Collective.ALL_REDUCE, GiB, c, c.groups[0], 8, 8)
    assert t == pytest.approx(2e-6 + 2 * 7 / 8 * GiB / NVLINK4_BUS, rel=1e-12)


def test_ring_across_nodes_drives_one_nic_share_per_local_rank():
    c = h100_cluster(4)
    g = c.groups[0]
    share = 8 * NDR_NIC / 8  # the node's 8 NICs split over its 8 GPUs
    # 8 ranks per node: the node's whole NIC bandwidth (NVIDIA/nccl#495), under NVLink.
    assert group_path(c, g, 32, 8) == Path(min(8 * share, NVLINK4_BUS), 5e-6)
    # DP group of a tp=8 configuration: one rank per node, one NIC share.
    assert group_path(c, g, 4, 1) == Path(share, 5e-6)
    t = group_collective_time(Collective.REDUCE_SCATTER, GiB, c, g, 4, 1)
    assert t == pytest.approx(5e-6 + 3 / 4 * GiB / share, rel=1e-12)


def test_all_reduce_across_nodes_takes_the_cheaper_of_flat_and_hierarchical():
    c = h100_cluster(2)
    g = c.groups[0]
    S, share = GiB, NDR_NIC
    flat = 5e-6 + 2 * 15 / 16 * S / min(8 * share, NVLINK4_BUS)
    hier = (
        (2e-6 + 7 / 8 * S / NVLINK4_BUS)  # reduce-scatter inside the node
        + (5e-6 + 2 * 1 / 2 * (S / 8) / share)  # all-reduce of 1/8 across 2 nodes
        + (2e-6 + 7 / 8 * S / NVLINK4_BUS)  # all-gather inside the node
    )
    t = group_collective_time(Collective.ALL_REDUCE, S, c, g, 16, 8)
    assert t == pytest.approx(min(flat, hier), rel=1e-12)


def test_cross_group_same_site_meets_on_the_slower_tier():
    c = mixed_cluster(1, 1)
    path = cross_group_path(c, "h100", "a100", 1, 1)
    hdr_share = 8 * 25e9 * 0.85 / 8  # the slower (HDR) tier, one NIC share per GPU
    assert path.shared_bandwidth is None
    assert path.path(64) == Path(hdr_share, 5e-6)


def test_wan_group_link_is_shared_by_concurrent_streams():
    c = mixed_cluster(1, 1, wan=True)
    path = cross_group_path(c, "h100", "a100", 1, 1)
    wan = 12.5e9 * 0.5
    assert path.shared_bandwidth == pytest.approx(wan)
    assert path.latency == pytest.approx(1e-3)
    assert path.path(1).bandwidth == pytest.approx(min(wan, 8 * 25e9 * 0.85 / 8))
    assert path.path(16).bandwidth == pytest.approx(wan / 16)


def test_intra_node_path_is_the_nvlink_tier():
    c = mixed_cluster(1, 1)
    assert intra_node_path(c, c.group("a100")) == Path(300e9 * 0.8, 2e-6)
