"""Collective costs against hand-derived values: the alpha-beta ring formula with NCCL's
latencies (hardware.md bus factors, NCCL tuning.cc latencies), tree and hierarchical
all-reduce, NIC sharing, and measured curves from a cluster profile."""

from __future__ import annotations

import math

import pytest
from meshplan.cost_model.collectives import (
    BASE_LATENCY_S,
    Collective,
    Path,
    bus_factor,
    collective_time,
    cross_group_path,
    group_collective_time,
    group_path,
    half_bandwidth_size,
    intra_node_path,
    ring_steps,
)
from meshplan.ir.cluster import ClusterProfile, CollectiveCurve, TierProfile

from tests.synthetic import h100_cluster, mixed_cluster

GiB = 2**30
MiB = 2**20
NVLINK4_BUS = 450e9 * 0.8  # NVLink4 one direction, times the tier efficiency
NDR_NIC = 50e9 * 0.85  # one NDR 400 Gb/s NIC, times the tier efficiency
A0 = 8.4e-6  # NCCL baseLat, Ring/Simple (tuning.cc)
NV_HOP, IB_HOP = 2e-6, 5e-6  # the tiers' per-hop latencies (ir/hardware.py DEFAULT_LATENCY)


def test_bus_factors_and_ring_steps():
    assert bus_factor(Collective.ALL_REDUCE, 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor(Collective.ALL_GATHER, 8) == pytest.approx(7 / 8)
    assert bus_factor(Collective.REDUCE_SCATTER, 4) == pytest.approx(3 / 4)
    assert bus_factor(Collective.ALL_TO_ALL, 2) == pytest.approx(1 / 2)
    assert bus_factor(Collective.P2P, 2) == 1.0
    assert [ring_steps(k, 8) for k in Collective] == [14, 7, 7, 1, 1]
    assert BASE_LATENCY_S == A0
    assert collective_time(Collective.ALL_REDUCE, GiB, 1, Path(1e9, 1e-6)) == 0.0


def test_all_reduce_1gib_over_8_gpus_on_nvlink4():
    c = h100_cluster(1)
    t = group_collective_time(Collective.ALL_REDUCE, GiB, c, c.groups[0], 8, 8)
    assert t == pytest.approx(A0 + 14 * NV_HOP + 2 * 7 / 8 * GiB / NVLINK4_BUS, rel=1e-12)


def test_half_bandwidth_size_is_where_busbw_halves():
    """Hockney's n_1/2: at S_half the achieved bus bandwidth S f / t is half the path's."""
    path = Path(300e9 * 0.8, NV_HOP)  # NVLink3, as DGX A100
    s_half = half_bandwidth_size(Collective.ALL_REDUCE, 8, path)
    assert s_half == pytest.approx((A0 + 14 * NV_HOP) * 240e9 / 1.75)
    assert 4e6 < s_half < 8e6  # nccl-tests on 8 x A100: half of peak busbw at 4-8 MB (nccl#583)
    t = collective_time(Collective.ALL_REDUCE, s_half, 8, path)
    assert s_half * 1.75 / t == pytest.approx(240e9 / 2)
    # Smaller messages reach less of the bandwidth: the curve rises with size.
    bw = [
        s * 1.75 / collective_time(Collective.ALL_REDUCE, s, 8, path)
        for s in (2**k for k in range(12, 31, 2))
    ]
    assert bw == sorted(bw) and bw[-1] > 0.99 * 240e9


def test_ring_across_nodes_drives_one_nic_share_per_local_rank():
    c = h100_cluster(4)
    g = c.groups[0]
    share = 8 * NDR_NIC / 8  # the node's 8 NICs split over its 8 GPUs
    # 8 ranks per node: the node's whole NIC bandwidth (NVIDIA/nccl#495), under NVLink.
    assert group_path(c, g, 32, 8) == Path(min(8 * share, NVLINK4_BUS), IB_HOP)
    # DP group of a tp=8 configuration: one rank per node, one NIC share.
    assert group_path(c, g, 4, 1) == Path(share, IB_HOP)
    t = group_collective_time(Collective.REDUCE_SCATTER, GiB, c, g, 4, 1)
    assert t == pytest.approx(A0 + 3 * IB_HOP + 3 / 4 * GiB / share, rel=1e-12)


def test_all_reduce_across_nodes_takes_the_cheapest_of_ring_tree_and_hierarchical():
    c = h100_cluster(2)
    g = c.groups[0]
    share = NDR_NIC
    for S in (64 * 1024, GiB):
        bw = min(8 * share, NVLINK4_BUS)
        flat = A0 + 30 * IB_HOP + 2 * 15 / 16 * S / bw
        tree = A0 + 2 * (7 * NV_HOP + 1 * IB_HOP) + 2 * 15 / 16 * S / bw
        hier = (
            (A0 + 7 * NV_HOP + 7 / 8 * S / NVLINK4_BUS)  # reduce-scatter inside the node
            + (A0 + 2 * IB_HOP + 2 * 1 / 2 * (S / 8) / share)  # all-reduce of 1/8, 2 nodes
            + (A0 + 7 * NV_HOP + 7 / 8 * S / NVLINK4_BUS)  # all-gather inside the node
        )
        t = group_collective_time(Collective.ALL_REDUCE, S, c, g, 16, 8)
        assert t == pytest.approx(min(flat, tree, hier), rel=1e-12)
    # Small messages: the tree's logarithmic latency wins over the ring's 30 steps.
    small = group_collective_time(Collective.ALL_REDUCE, 64 * 1024, c, g, 16, 8)
    assert small == pytest.approx(A0 + 2 * (7 * NV_HOP + IB_HOP) + 2 * 15 / 16 * 65536 / bw)


def test_cross_group_same_site_meets_on_the_slower_tier():
    c = mixed_cluster(1, 1)
    path = cross_group_path(c, "h100", "a100", 1, 1)
    hdr_share = 8 * 25e9 * 0.85 / 8  # the slower (HDR) tier, one NIC share per GPU
    assert path.shared_bandwidth is None
    assert path.path(64) == Path(hdr_share, IB_HOP)


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
    assert intra_node_path(c, c.group("a100")) == Path(300e9 * 0.8, NV_HOP)


# -- measured curves (cluster profiles) ----------------------------------------------------

# An all-reduce curve "measured" on 8 GPUs of one node: (bytes, seconds). busbw = S*1.75/t:
# 1 MiB -> 30 GB/s-ish, 64 MiB -> 300 GB/s-ish; all-gather measured at two sizes only.
AR_POINTS = ((MiB, 61.2e-6), (8 * MiB, 122.4e-6), (64 * MiB, 391.5e-6))
AG_POINTS = ((MiB, 40e-6), (64 * MiB, 220e-6))


def _profile(tier: str = "nvlink4") -> ClusterProfile:
    return ClusterProfile(
        tiers=(
            TierProfile(
                tier=tier,
                intra_node=True,
                gpus_per_node=8,
                nics_per_node=8,
                ranks_per_node=8,
                curves=(
                    CollectiveCurve("all_reduce", 8, AR_POINTS),
                    CollectiveCurve("all_gather", 8, AG_POINTS),
                ),
            ),
        )
    )


def test_measured_curve_gives_back_the_measured_times():
    """Pricing the measured configuration returns the measured time at every measured size."""
    c = h100_cluster(1).with_profile(_profile())
    g = c.groups[0]
    for size, seconds in AR_POINTS:
        t = group_collective_time(Collective.ALL_REDUCE, size, c, g, 8, 8)
        assert t == pytest.approx(seconds, rel=1e-9)
    for size, seconds in AG_POINTS:
        t = group_collective_time(Collective.ALL_GATHER, size, c, g, 8, 8)
        assert t == pytest.approx(seconds, rel=1e-9)


def test_measured_curve_interpolates_in_log_size_and_extrapolates():
    c = h100_cluster(1).with_profile(_profile())
    g = c.groups[0]
    bus = [s * 1.75 / t for s, t in AR_POINTS]
    # 2 MiB sits a third of the way (in log2) from 1 MiB to 8 MiB: busbw interpolates there.
    s = 2 * MiB
    expect_bw = bus[0] + (bus[1] - bus[0]) * (1 / 3)
    t = group_collective_time(Collective.ALL_REDUCE, s, c, g, 8, 8)
    assert t == pytest.approx(s * 1.75 / expect_bw, rel=1e-9)
    # Below the smallest size: latency-bound, the smallest measured time.
    tiny = group_collective_time(Collective.ALL_REDUCE, 4096, c, g, 8, 8)
    assert tiny == pytest.approx(AR_POINTS[0][1], rel=1e-9)
    # Above the largest: the largest size's bus bandwidth.
    big = group_collective_time(Collective.ALL_REDUCE, GiB, c, g, 8, 8)
    assert big == pytest.approx(GiB * 1.75 / bus[-1], rel=1e-9)
    # Four of the eight GPUs: same bus bandwidth, the bus factor of 4 ranks.
    t4 = group_collective_time(Collective.ALL_REDUCE, 64 * MiB, c, g, 4, 4)
    assert t4 == pytest.approx(64 * MiB * 1.5 / bus[-1], rel=1e-9)
    # Reduce-scatter was not measured: it moves data as all-gather does and uses its curve.
    rs = group_collective_time(Collective.REDUCE_SCATTER, 64 * MiB, c, g, 8, 8)
    assert rs == pytest.approx(AG_POINTS[-1][1], rel=1e-9)


def test_profile_sets_the_tier_to_the_measured_peak_and_leaves_others_alone():
    base = h100_cluster(2)
    c = base.with_profile(_profile())
    peak = max(s * 1.75 / t for s, t in AR_POINTS)
    assert c.link("nvlink4").bandwidth == pytest.approx(peak)
    assert c.link("nvlink4").efficiency == 1.0
    assert c.link("ib-ndr") == base.link("ib-ndr")
    assert intra_node_path(c, c.groups[0]).curve is not None
    assert group_path(c, c.groups[0], 2, 1).curve is None  # inter-node: not measured


def test_inter_node_profile_inverts_the_nic_sharing():
    """One rank per node measured B across nodes of 8 GPUs and 8 NICs: the NIC gets B * 8 /
    (1 * 8), so the model's one-rank-per-node path gives back B."""
    pts = ((MiB, 100e-6), (64 * MiB, 2.0e-3))
    prof = ClusterProfile(
        tiers=(TierProfile("ib-ndr", False, 8, 8, 1, (CollectiveCurve("all_reduce", 2, pts),)),)
    )
    c = h100_cluster(2).with_profile(prof)
    measured = max(s * 1.0 / t for s, t in pts)
    assert group_path(c, c.groups[0], 2, 1).bandwidth == pytest.approx(measured)
    t = group_collective_time(Collective.ALL_REDUCE, 64 * MiB, c, c.groups[0], 2, 1)
    assert t == pytest.approx(2.0e-3, rel=1e-9)


def test_profile_that_measured_nothing_of_the_cluster_is_refused():
    with pytest.raises(ValueError, match="none of which is a link tier"):
        h100_cluster(1).with_profile(_profile("loopback"))


def test_curve_fraction_is_continuous_at_the_ends():
    c = h100_cluster(1).with_profile(_profile())
    curve = intra_node_path(c, c.groups[0]).curve
    lo = AR_POINTS[0][0]
    a = curve.fraction(Collective.ALL_REDUCE, lo * (1 - 1e-9))
    b = curve.fraction(Collective.ALL_REDUCE, lo * (1 + 1e-9))
    assert a == pytest.approx(b, rel=1e-6)
    assert math.isfinite(curve.fraction(Collective.P2P, 10.0))
