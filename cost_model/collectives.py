"""Collective communication time on the link tier a group spans.

Default (datasheet) tiers use the alpha-beta model with NCCL's ring latency:

    t = alpha_0 + steps(kind, n) * alpha_hop + S * f(n) / busbw

with `S` the full buffer size in bytes (the all-reduced tensor, the gathered output), `n` the
ranks, and the bus factor f = 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for point-to-point (NCCL's "Performance reported by NCCL
tests" notes, NVIDIA/nccl-tests doc/PERFORMANCE.md). alpha_0 = `BASE_LATENCY_S` is NCCL's
per-collective base latency and alpha_hop the tier's `latency`, paid once per ring step:
2(n-1) steps for an all-reduce, n-1 for all-gather and reduce-scatter, one for send/recv and
all-to-all (its n-1 transfers run concurrently). That is NCCL's own tuning model
(NVIDIA/nccl src/graph/tuning.cc: `baseLat` + steps x `hwLat`, Ring/Simple protocol).

Bandwidth against message size. Written as a curve, the model above is Hockney's
(r_inf, n_1/2) form (Hockney, "The communication challenge for MPP", Parallel Computing 1994):
the bus bandwidth a message of S bytes reaches is busbw * S / (S + S_half) with the
half-bandwidth size S_half = (alpha_0 + steps * alpha_hop) * busbw / f(n). For 8 GPUs on
NVLink3 (busbw 240 GB/s after the 0.8 efficiency, alpha_hop 2 us) an all-reduce reaches half
its bandwidth at S_half = (8.4 + 14 * 2) us * 240 GB/s / 1.75 = 5.0 MB, where nccl-tests on
DGX A100 reach about half of their large-message busbw between 4 and 8 MB (NVIDIA/nccl#583,
8 x A100 all_reduce_perf). `half_bandwidth_size` gives S_half for any path.

Calibrated tiers (`meshplan calibrate`, `Cluster.with_profile`) replace the formula by the
measured curve: t = S * f(n) / (busbw * frac_kind(S)), where busbw is the tier's measured
large-message bus bandwidth (as the topology below scales it) and frac_kind(S) the measured
bus bandwidth of that collective at S over it, interpolated linearly in log(S) between the
measured sizes, constant above the largest and of constant time below the smallest. The
measured times include the latency, so no alpha is added. A collective that was not measured
uses the curve of the one that moves data the same way (reduce-scatter <-> all-gather, then
all-reduce).

`busbw` is the bus bandwidth one rank of the group reaches on the slowest tier it spans. The
unit of locality is the group's NVLink domain (`DeviceGroup.domain_gpus`): one node, or, where
an NVLink switch fabric joins several hosts (a GB200 NVL72 rack), all the GPUs on it. A ring's
ranks "per node" below are its ranks per domain:

- inside one domain: the intra-node link's per-GPU bandwidth (NVLink/PCIe), times its
  efficiency (on an NVL72 rack the same NVLink 5 rate between trays as inside one);
- across domains of one device group: the GPUs of a host share its NICs. Every GPU of a host
  runs the same collective pattern at the same time in SPMD training, so one GPU's share is
  `nics_per_node * nic_bw / gpus_per_node` (per host, whatever the domain); a ring with `p`
  ranks in each domain drives `p` such shares out of it (NCCL runs one ring per NIC), so
  busbw = p * share, capped by the intra-node link when p > 1. Measured: two 8-GPU A100
  nodes with 8 x 100 Gb/s NICs reach ~75 GB/s all-reduce busbw, i.e. the node's aggregate
  NIC rate, not one NIC (NVIDIA/nccl#495); NDR gives 46-48 GB/s per NIC (NVIDIA/nccl-tests#290).
- across device groups: the slower of the two groups' NIC egress and, when an explicit
  `GroupLink` (a WAN or a site interconnect) joins them, that whole link's bandwidth divided by
  the number of concurrent streams crossing it (`CrossPath`).

Algorithms. Data-parallel all-reduces that span nodes take the cheapest of a flat ring, NCCL's
tree (a chain inside each node and a double binary tree across nodes: the same bandwidth as
the ring, latency 2((p-1) intra hops + ceil(log2 nodes) inter hops); Sanders et al., "Two-tree
algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing 2009) and the
hierarchical algorithm (reduce-scatter inside the node, all-reduce across nodes on 1/p of the
data, all-gather inside the node), as NCCL's tree/ring selection and Horovod's hierarchical
all-reduce do.
"""

from __future__ import annotations

import bisect
import enum
import functools
import math
from dataclasses import dataclass

from meshplan.ir import Cluster, DeviceGroup, LinkTier
from meshplan.ir.cluster import TierProfile, measured_busbw, tier_peak_busbw

# NCCL's per-collective base latency, Ring algorithm, Simple protocol: 8.4 us
# (NVIDIA/nccl src/graph/tuning.cc, `baseLat`).
BASE_LATENCY_S = 8.4e-6


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


def ring_steps(kind: Collective, n: int) -> int:
    """Latency-bearing steps of NCCL's ring: 2(n-1) for all-reduce, n-1 for all-gather and
    reduce-scatter, 1 for send/recv and all-to-all (concurrent point-to-point transfers)."""
    if kind == Collective.ALL_REDUCE:
        return 2 * (n - 1)
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return n - 1
    return 1


# A collective without a measured curve borrows the curve of one moving data the same way.
_CURVE_FALLBACK: dict[str, tuple[str, ...]] = {
    "all_reduce": ("all_reduce", "reduce_scatter", "all_gather"),
    "all_gather": ("all_gather", "reduce_scatter", "all_reduce"),
    "reduce_scatter": ("reduce_scatter", "all_gather", "all_reduce"),
    "all_to_all": ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"),
    "p2p": ("p2p", "all_gather", "reduce_scatter", "all_reduce"),
}


class TierCurve:
    """A tier's measured bus bandwidth against buffer size, per collective, as fractions of
    the tier's large-message bus bandwidth (`tier_peak_busbw`). Build with `tier_curve`."""

    __slots__ = ("tier", "_by_kind")

    def __init__(self, profile: TierProfile) -> None:
        peak = tier_peak_busbw(profile)
        measured = {
            c.collective: (
                tuple(math.log(s) for s, _ in c.points),
                tuple(b / peak for b in measured_busbw(c)),
            )
            for c in profile.curves
        }
        self.tier = profile.tier
        self._by_kind = {
            kind: measured[next(k for k in order if k in measured)]
            for kind, order in _CURVE_FALLBACK.items()
        }

    def __repr__(self) -> str:
        return f"TierCurve({self.tier!r})"

    def fraction(self, kind: Collective, size_bytes: float) -> float:
        """Measured busbw of `kind` at `size_bytes` over the tier's peak: log-linear between
        the measured sizes, the last value above them, and proportional to the size below the
        smallest (a constant time: latency-bound)."""
        xs, ys = self._by_kind[kind.value]
        x = math.log(size_bytes)
        if x <= xs[0]:
            return ys[0] * size_bytes / math.exp(xs[0])
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])


@functools.lru_cache(maxsize=64)
def _curve_of(profile: TierProfile) -> TierCurve:
    return TierCurve(profile)


def tier_curve(cluster: Cluster, tier: str) -> TierCurve | None:
    """The measured curve of link tier `tier` when the cluster carries a profile that measured
    it (`Cluster.with_profile`), else None (the alpha-beta default)."""
    if cluster.profile is None:
        return None
    measured = cluster.profile.tier(tier)
    return _curve_of(measured) if measured is not None else None


@dataclass(frozen=True, slots=True)
class Path:
    """Bus bandwidth (bytes/s) and per-hop latency (s) one rank of a communicator reaches, and
    the measured curve of the tier that bounds the bandwidth (None: alpha-beta)."""

    bandwidth: float
    latency: float
    curve: TierCurve | None = None


def collective_time(kind: Collective, size_bytes: float, n: int, path: Path) -> float:
    """One collective of `size_bytes` over `n` ranks on `path` (seconds): the alpha-beta ring
    formula of the module docstring, or the measured curve when the path has one. Zero for a
    group of one rank (nothing to exchange) or an empty buffer."""
    if n <= 1 and kind != Collective.P2P:
        return 0.0
    if size_bytes <= 0:
        return 0.0
    volume = size_bytes * bus_factor(kind, n)
    if path.curve is not None:
        return volume / (path.bandwidth * path.curve.fraction(kind, size_bytes))
    return BASE_LATENCY_S + ring_steps(kind, n) * path.latency + volume / path.bandwidth


def half_bandwidth_size(kind: Collective, n: int, path: Path) -> float:
    """Hockney's n_1/2 of the alpha-beta path: the buffer size (bytes) at which a collective
    reaches half of the path's bus bandwidth, (alpha_0 + steps * alpha_hop) * busbw / f(n)."""
    f = bus_factor(kind, n)
    if f <= 0:
        return 0.0
    return (BASE_LATENCY_S + ring_steps(kind, n) * path.latency) * path.bandwidth / f


def intra_node_path(cluster: Cluster, group: DeviceGroup) -> Path:
    """The path between GPUs of one NVLink domain (one node unless the group sets
    `nvlink_domain`): the intra-node link, per GPU, with its efficiency."""
    link = cluster.link(group.intra_link)
    return Path(link.effective_bandwidth, link.latency, tier_curve(cluster, link.name))


def inter_node_path(cluster: Cluster, group: DeviceGroup) -> Path:
    """One rank per domain across the NVLink domains (nodes) of `group`: one NIC share, the
    inter-node tier's latency and curve (pipeline p2p between consecutive stages in different
    domains)."""
    tier = _inter_tier(cluster, group)
    return Path(nic_share(group, tier), tier.latency, tier_curve(cluster, tier.name))


def nic_share(group: DeviceGroup, tier: LinkTier) -> float:
    """One GPU's share of its host's NICs on `tier` (bytes/s): all GPUs of a host communicate
    at once in SPMD training, so the NICs are split over `gpus_per_node` GPUs (the host's,
    not the NVLink domain's: NICs belong to hosts)."""
    return group.nics_per_node * tier.effective_bandwidth / group.gpus_per_node


def _inter_tier(cluster: Cluster, group: DeviceGroup) -> LinkTier:
    return cluster.link(group.inter_link or group.intra_link)


def group_path(cluster: Cluster, group: DeviceGroup, n: int, ranks_per_domain: int) -> Path:
    """Path of a flat ring of `n` ranks of `group`, packed `ranks_per_domain` to an NVLink
    domain (`DeviceGroup.domain_gpus`: a node unless the group sets `nvlink_domain`).

    One domain: the intra-node link. Several domains: `ranks_per_domain` NIC shares out of
    each domain, capped by the intra-node link that the ring's in-domain hops use.
    """
    intra = intra_node_path(cluster, group)
    p = max(1, min(ranks_per_domain, group.domain_gpus))
    if n <= p or group.domains == 1:
        return intra
    tier = _inter_tier(cluster, group)
    bw = p * nic_share(group, tier)
    curve = tier_curve(cluster, tier.name)
    if p > 1 and intra.bandwidth < bw:
        bw, curve = intra.bandwidth, intra.curve
    return Path(bw, max(tier.latency, intra.latency), curve)


def group_collective_time(
    kind: Collective,
    size_bytes: float,
    cluster: Cluster,
    group: DeviceGroup,
    n: int,
    ranks_per_domain: int,
) -> float:
    """Time of one collective over `n` ranks of one device group (`ranks_per_domain` per
    NVLink domain, `group_path`).

    All-reduces spanning domains take the cheapest of the flat ring, NCCL's tree and the
    hierarchical reduce-scatter / inter-domain all-reduce / all-gather.
    """
    if n <= 1:
        return 0.0
    path = group_path(cluster, group, n, ranks_per_domain)
    flat = collective_time(kind, size_bytes, n, path)
    if kind != Collective.ALL_REDUCE or group.domains == 1:
        return flat
    p = max(1, min(ranks_per_domain, group.domain_gpus, n))
    if n <= p:
        return flat
    nodes = math.ceil(n / p)  # domains the ring spans
    intra = intra_node_path(cluster, group)
    tier = _inter_tier(cluster, group)
    best = flat
    if path.curve is None:
        # NCCL's tree: a chain through the node's p ranks and a double binary tree over the
        # nodes, up and down, at the ring's bus bandwidth.
        hops = (p - 1) * intra.latency + math.ceil(math.log2(nodes)) * tier.latency
        volume = size_bytes * bus_factor(kind, n)
        best = min(best, BASE_LATENCY_S + 2 * hops + volume / path.bandwidth)
    if p > 1:
        across = inter_node_path(cluster, group)  # each local rank's own inter-node ring
        hier = (
            collective_time(Collective.REDUCE_SCATTER, size_bytes, p, intra)
            + collective_time(Collective.ALL_REDUCE, size_bytes / p, nodes, across)
            + collective_time(Collective.ALL_GATHER, size_bytes, p, intra)
        )
        best = min(best, hier)
    return best


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
    curve: TierCurve | None = None  # measured curve of the tier bounding `bandwidth`
    shared_curve: TierCurve | None = None  # measured curve of the shared GroupLink

    def path(self, streams: int) -> Path:
        """The path one stream sees when `streams` streams cross the shared link at once."""
        bw, curve = self.bandwidth, self.curve
        if self.shared_bandwidth is not None and self.shared_bandwidth / max(1, streams) < bw:
            bw, curve = self.shared_bandwidth / max(1, streams), self.shared_curve
        return Path(bw, self.latency, curve)


def _explicit_group_link(cluster: Cluster, a: DeviceGroup, b: DeviceGroup) -> LinkTier | None:
    for gl in cluster.group_links:
        if {gl.a, gl.b} in ({a.name, b.name}, {a.site, b.site}):
            return cluster.link(gl.link)
    return None


def cross_group_path(
    cluster: Cluster, a: str, b: str, ranks_per_domain_a: int = 1, ranks_per_domain_b: int = 1
) -> CrossPath:
    """Path of a ring (or p2p stream) between ranks of groups `a` and `b`, with
    `ranks_per_domain_*` ranks of the communicator in each NVLink domain (node) of either side.

    Same-site groups without a `GroupLink` meet on the slower of their inter-node tiers
    (`Cluster.link_between_groups`), reached through each node's NICs. With a `GroupLink`, the
    traffic leaves each group through its own NICs and then shares the link.
    """
    ga, gb = cluster.group(a), cluster.group(b)
    shared = _explicit_group_link(cluster, ga, gb)
    meet = cluster.link_between_groups(a, b)
    bws: list[tuple[float, TierCurve | None]] = []
    lats = [meet.latency]
    for g, p in ((ga, ranks_per_domain_a), (gb, ranks_per_domain_b)):
        p = max(1, min(p, g.domain_gpus))
        egress = _inter_tier(cluster, g) if shared is not None and g.inter_link else meet
        bws.append((p * nic_share(g, egress), tier_curve(cluster, egress.name)))
        lats.append(egress.latency)
        if p > 1:
            intra = intra_node_path(cluster, g)
            bws.append((intra.bandwidth, intra.curve))
            lats.append(intra.latency)
    bw, curve = min(bws, key=lambda x: x[0])
    return CrossPath(
        bandwidth=bw,
        latency=max(lats),
        shared_bandwidth=shared.effective_bandwidth if shared is not None else None,
        curve=curve,
        shared_curve=tier_curve(cluster, shared.name) if shared is not None else None,
    )
