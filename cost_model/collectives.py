"""Collective communication time: the alpha-beta model on the link tier a group spans.

    t = alpha + S * f(n) / busbw

with `S` the full buffer size in bytes (the all-reduced tensor, the gathered output), `n` the
ranks, and the bus factor f = 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for point-to-point (shared/reference/hardware.md, from
NCCL's "Performance reported by NCCL tests" notes). `busbw` is the bus bandwidth one rank of
the group reaches on the slowest tier the group spans:

- inside one node: the intra-node link's per-GPU bandwidth (NVLink/PCIe), times its efficiency;
- across nodes of one device group: the GPUs of a node share its NICs. Every GPU of a node runs
  the same collective pattern at the same time in SPMD training, so one GPU's share is
  `nics_per_node * nic_bw / gpus_per_node`; a ring with `p` ranks on each node drives `p`
  such shares through the node (NCCL runs one ring per NIC), so busbw = p * share, capped by
  the intra-node link when p > 1. Measured: two 8-GPU A100 nodes with 8 x 100 Gb/s NICs reach
  ~75 GB/s all-reduce busbw, i.e. the node's aggregate NIC rate, not one NIC
  (NVIDIA/nccl#495); NDR gives 46-48 GB/s per NIC (NVIDIA/nccl-tests#290).
- across device groups: the slower of the two groups' NIC egress and, when an explicit
  `GroupLink` (a WAN or a site interconnect) joins them, that whole link's bandwidth divided by
  the number of concurrent streams crossing it (`CrossPath`).

alpha is the latency of the slowest tier crossed (one alpha per collective: NCCL picks tree or
LL protocols for small messages, which keeps the start-up cost near one hop; assumption,
calibrated in issue 3). Bandwidth is a single number per tier here; hardware.md warns it
depends on message size: issue 3 calibrates a curve.

Data-parallel all-reduces that span nodes take the cheaper of a flat ring and the
hierarchical algorithm (reduce-scatter inside the node, all-reduce across nodes on 1/p of the
data, all-gather inside the node), as NCCL's tree/ring selection and Horovod's hierarchical
all-reduce do.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from meshplan.ir import Cluster, DeviceGroup, LinkTier


class Collective(enum.StrEnum):
    """The NCCL collectives the cost model prices."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"


def bus_factor(kind: Collective, n: int) -> float:
    """NCCL's bus-bandwidth factor f(n): bytes each rank moves per byte of buffer."""
    if kind == Collective.P2P:
        return 1.0
    if n <= 1:
        return 0.0
    if kind == Collective.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    return (n - 1) / n


@dataclass(frozen=True, slots=True)
class Path:
    """Bus bandwidth (bytes/s) and latency (s) one rank of a communicator reaches."""

    bandwidth: float
    latency: float


def collective_time(kind: Collective, size_bytes: float, n: int, path: Path) -> float:
    """alpha + S * f(n) / busbw; zero for a group of one rank (nothing to exchange)."""
    if n <= 1 and kind != Collective.P2P:
        return 0.0
    if size_bytes <= 0:
        return 0.0
    return path.latency + size_bytes * bus_factor(kind, n) / path.bandwidth


def intra_node_path(cluster: Cluster, group: DeviceGroup) -> Path:
    """The path between GPUs of one node: the intra-node link, per GPU, with its efficiency."""
    link = cluster.link(group.intra_link)
    return Path(link.effective_bandwidth, link.latency)


def nic_share(group: DeviceGroup, tier: LinkTier) -> float:
    """One GPU's share of its node's NICs on `tier` (bytes/s): all GPUs of a node communicate
    at once in SPMD training, so the NICs are split over `gpus_per_node` GPUs."""
    return group.nics_per_node * tier.effective_bandwidth / group.gpus_per_node


def _inter_tier(cluster: Cluster, group: DeviceGroup) -> LinkTier:
    return cluster.link(group.inter_link or group.intra_link)


def group_path(cluster: Cluster, group: DeviceGroup, n: int, ranks_per_node: int) -> Path:
    """Path of a flat ring of `n` ranks of `group`, packed `ranks_per_node` to a node.

    One node: the intra-node link. Several nodes: `ranks_per_node` NIC shares through each
    node, capped by the intra-node link that the ring's in-node hops use.
    """
    intra = intra_node_path(cluster, group)
    p = max(1, min(ranks_per_node, group.gpus_per_node))
    if n <= p or group.nodes == 1:
        return intra
    tier = _inter_tier(cluster, group)
    bw = p * nic_share(group, tier)
    if p > 1:
        bw = min(bw, intra.bandwidth)
    return Path(bw, max(tier.latency, intra.latency))


def group_collective_time(
    kind: Collective,
    size_bytes: float,
    cluster: Cluster,
    group: DeviceGroup,
    n: int,
    ranks_per_node: int,
) -> float:
    """Time of one collective over `n` ranks of one device group (`ranks_per_node` per node).

    All-reduces spanning nodes take the cheaper of the flat ring and the hierarchical
    reduce-scatter / inter-node all-reduce / all-gather.
    """
    if n <= 1:
        return 0.0
    flat = collective_time(kind, size_bytes, n, group_path(cluster, group, n, ranks_per_node))
    p = max(1, min(ranks_per_node, group.gpus_per_node, n))
    if kind != Collective.ALL_REDUCE or p == 1 or n <= p or group.nodes == 1:
        return flat
    nodes = math.ceil(n / p)
    intra = intra_node_path(cluster, group)
    tier = _inter_tier(cluster, group)
    across = Path(nic_share(group, tier), tier.latency)  # each local rank's own inter ring
    hier = (
        collective_time(Collective.REDUCE_SCATTER, size_bytes, p, intra)
        + collective_time(Collective.ALL_REDUCE, size_bytes / p, nodes, across)
        + collective_time(Collective.ALL_GATHER, size_bytes, p, intra)
    )
    return min(flat, hier)


@dataclass(frozen=True, slots=True)
class CrossPath:
    """The path of a communicator that spans two device groups.

    `bandwidth` is the bus bandwidth of its unshared parts (each group's NIC egress and
    in-group hops). `shared_bandwidth` is the whole bandwidth of an explicit `GroupLink`
    between the groups (None when the groups just share a site fabric): every concurrent
    stream crossing it gets an equal part.
    """

    bandwidth: float
    latency: float
    shared_bandwidth: float | None = None

    def path(self, streams: int) -> Path:
        """The path one stream sees when `streams` streams cross the shared link at once."""
        bw = self.bandwidth
        if self.shared_bandwidth is not None:
            bw = min(bw, self.shared_bandwidth / max(1, streams))
        return Path(bw, self.latency)


def _explicit_group_link(cluster: Cluster, a: DeviceGroup, b: DeviceGroup) -> LinkTier | None:
    for gl in cluster.group_links:
        if {gl.a, gl.b} in ({a.name, b.name}, {a.site, b.site}):
            return cluster.link(gl.link)
    return None


def cross_group_path(
    cluster: Cluster, a: str, b: str, ranks_per_node_a: int = 1, ranks_per_node_b: int = 1
) -> CrossPath:
    """Path of a ring (or p2p stream) between ranks of groups `a` and `b`, with `ranks_per_node_*`
    ranks of the communicator on each node of either side.

    Same-site groups without a `GroupLink` meet on the slower of their inter-node tiers
    (`Cluster.link_between_groups`), reached through each node's NICs. With a `GroupLink`, the
    traffic leaves each group through its own NICs and then shares the link.
    """
    ga, gb = cluster.group(a), cluster.group(b)
    shared = _explicit_group_link(cluster, ga, gb)
    meet = cluster.link_between_groups(a, b)
    bws, lats = [], [meet.latency]
    for g, p in ((ga, ranks_per_node_a), (gb, ranks_per_node_b)):
        p = max(1, min(p, g.gpus_per_node))
        egress = _inter_tier(cluster, g) if shared is not None and g.inter_link else meet
        bws.append(p * nic_share(g, egress))
        lats.append(egress.latency)
        if p > 1:
            intra = intra_node_path(cluster, g)
            bws.append(intra.bandwidth)
            lats.append(intra.latency)
    return CrossPath(
        bandwidth=min(bws),
        latency=max(lats),
        shared_bandwidth=shared.effective_bandwidth if shared is not None else None,
    )
