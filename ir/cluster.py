"""Cluster description: device groups, link tiers and the topology between them.

A cluster is a set of *device groups*. A group is `nodes` identical machines, each holding
`gpus_per_node` GPUs of one type, connected inside the node by `intra_link` and to other nodes
of the group by `inter_link` through `nics_per_node` NICs. An NVLink switch fabric may join
several nodes into one *NVLink domain* (`nvlink_domain` GPUs: a GB200/GB300 NVL72 rack is 18
hosts of 4 GPUs on one NVLink 5 fabric): then the GPUs of a domain share `intra_link` and only
traffic between domains goes over `inter_link`. Without it a domain is one node. Placement and
pricing ask the domain (`DeviceGroup.domain_gpus`, `DeviceGroup.domains`); launching, node ranks
and NIC counts ask the host (`gpus_per_node`, `nics_per_node`). Groups live at *sites*; groups at
the same site talk over the slower of their inter-node links unless a `GroupLink` says
otherwise; groups at different sites need a `GroupLink` (typically a WAN tier).

Units are SI and explicit: bandwidths in bytes per second *in one direction*, latencies in
seconds, memory in bytes. Intra-node bandwidth is per GPU; inter-node bandwidth is per NIC
(the GPUs of a node share its NICs); a GroupLink's bandwidth is the whole link's.

Ranks are numbered group by group, node by node, GPU by GPU (row-major), which is also how
`meshplan launch` assigns them.

A cluster may carry a `ClusterProfile`: what `meshplan calibrate` measured on real machines
(collective time against message size per link tier, GEMM throughput per GPU type).
`Cluster.with_profile` applies it: the measured tiers' bandwidth and latency replace the
datasheet defaults, each measured GPU type gets its measured GEMM efficiency, and the cost
model prices collectives on those tiers with the measured curves
(`meshplan.cost_model.collectives`).

Loading from YAML/JSON and the presets live in `meshplan.ir.cluster_io`; the device types
(GPU specs, link tiers, training precisions) in `meshplan.ir.devices`; this module holds
the cluster types and topology queries.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .devices import (
    GpuSpec,
    LinkTier,
)


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """`nodes` machines of `gpus_per_node` GPUs of one type.

    `nvlink_domain` is the number of GPUs that share `intra_link` when an NVLink switch fabric
    spans several machines (72 on a GB200/GB300 NVL72 rack of 18 four-GPU trays); None means
    one machine. It is a multiple of `gpus_per_node`, and either divides the group's GPUs
    (whole domains) or covers them all (a group inside part of one domain)."""

    name: str
    gpu: GpuSpec
    nodes: int
    gpus_per_node: int
    intra_link: str  # LinkTier name
    inter_link: str  # LinkTier name ("" for a single-node group)
    nics_per_node: int = 1
    site: str = "site0"
    price_per_gpu_hour: float | None = None
    nvlink_domain: int | None = None  # GPUs on one NVLink fabric; None: one node's

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"group {self.name}: nodes and gpus_per_node must be >= 1")
        if self.nics_per_node < 1:
            raise ValueError(f"group {self.name}: nics_per_node must be >= 1")
        if (why := nvlink_domain_problem(self)) is not None:
            raise ValueError(f"group {self.name}: {why}")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def domain_gpus(self) -> int:
        """GPUs that talk over `intra_link`: the NVLink domain, cut to the group's size when
        the group is part of one domain (a node's GPUs when `nvlink_domain` is None)."""
        if self.nvlink_domain is None:
            return self.gpus_per_node
        return min(self.nvlink_domain, self.num_gpus)

    @property
    def domains(self) -> int:
        """NVLink domains of the group (its nodes when `nvlink_domain` is None); traffic
        between them goes over `inter_link`."""
        return self.num_gpus // self.domain_gpus


def nvlink_domain_problem(group: DeviceGroup) -> str | None:
    """Why `group.nvlink_domain` cannot be used, or None: it must be a positive multiple of
    `gpus_per_node` (a fabric joins whole machines) and divide the group's GPUs or cover them
    all (ranks are numbered domain by domain, so a domain cut by the group's end would leave
    a partial domain that pricing does not model)."""
    d = group.nvlink_domain
    if d is None:
        return None
    if isinstance(d, bool) or not isinstance(d, int) or d < 1 or d % group.gpus_per_node:
        return (
            f"nvlink_domain must be a positive multiple of gpus_per_node "
            f"({group.gpus_per_node}), got {d!r}"
        )
    if d < group.num_gpus and group.num_gpus % d:
        return (
            f"nvlink_domain={d} neither divides nor covers the group's {group.num_gpus} GPUs "
            f"({group.nodes} x {group.gpus_per_node}); use whole domains or fewer GPUs than one"
        )
    return None


@dataclass(frozen=True, slots=True)
class GroupLink:
    """The link between two device groups (or all groups of two sites), by tier name."""

    a: str
    b: str
    link: str


# --------------------------------------------------------------------------------------------
# Calibration profile (what `meshplan calibrate` measured)
# --------------------------------------------------------------------------------------------

PROFILE_VERSION = 1
PROFILE_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
# GEMM shapes (m, n, k) `meshplan calibrate` times by default, and at which the cost model
# compares its learned model with a measured efficiency (`compute.host_gemm_anchor`). On GPUs:
# square and transformer-like projections of the sizes training runs (Llama-3 8B hidden 4096 /
# FFN 14336 at 8192 tokens); on CPUs small squares that finish in well under a second each.
GPU_GEMM_SHAPES = ((4096, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 8192, 8192))
CPU_GEMM_SHAPES = ((256, 256, 256), (512, 512, 512))


@dataclass(frozen=True, slots=True)
class CollectiveCurve:
    """Measured time of one collective on one tier against its buffer size.

    `points` are (size in bytes, seconds) with strictly increasing sizes; the size is the
    nccl-tests one (the all-reduced buffer, the gathered output, the scattered input, the
    all-to-all buffer, the bytes sent). `ranks` took part, `ranks_per_node` of them per node.
    """

    collective: str
    ranks: int
    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if self.collective not in PROFILE_COLLECTIVES:
            raise ValueError(
                f"unknown collective {self.collective!r}; one of {', '.join(PROFILE_COLLECTIVES)}"
            )
        if self.ranks < 2:
            raise ValueError(f"{self.collective}: a curve needs at least 2 ranks")
        if not self.points:
            raise ValueError(f"{self.collective}: no measurements")
        sizes = [s for s, _ in self.points]
        if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)) or sizes[0] <= 0:
            raise ValueError(f"{self.collective}: sizes must be positive and increasing")
        if any(not t > 0 for _, t in self.points):
            raise ValueError(f"{self.collective}: times must be positive")


@dataclass(frozen=True, slots=True)
class TierProfile:
    """The curves measured on one link tier (by tier name), and where they were measured:
    `gpus_per_node` devices and `nics_per_node` NICs per node on the calibrating machines,
    `ranks_per_node` ranks of each measured communicator per node (1 for an inter-node tier
    measured with one rank per node; all ranks for an intra-node tier)."""

    tier: str
    intra_node: bool
    gpus_per_node: int
    nics_per_node: int
    ranks_per_node: int
    curves: tuple[CollectiveCurve, ...]

    def __post_init__(self) -> None:
        if not self.curves:
            raise ValueError(f"tier {self.tier}: no curves")
        kinds = [c.collective for c in self.curves]
        if len(kinds) != len(set(kinds)):
            raise ValueError(f"tier {self.tier}: one curve per collective")
        if min(self.gpus_per_node, self.nics_per_node, self.ranks_per_node) < 1:
            raise ValueError(f"tier {self.tier}: per-node counts must be >= 1")

    def curve(self, collective: str) -> CollectiveCurve | None:
        """The curve of `collective`, or None when it was not measured."""
        for c in self.curves:
            if c.collective == collective:
                return c
        return None


@dataclass(frozen=True, slots=True)
class CodecMeasurement:
    """The lossless codec (`meshplan.runtime.codec`) timed on `gpu` in `dtype`: throughput in
    raw bytes/s on a large tensor and the fixed cost of one call (a small tensor)."""

    gpu: str
    dtype: str
    compress_bps: float
    decompress_bps: float
    compress_call_s: float
    decompress_call_s: float

    def __post_init__(self) -> None:
        if not (self.compress_bps > 0 and self.decompress_bps > 0):
            raise ValueError(f"codec on {self.gpu}: throughputs must be > 0")
        if self.compress_call_s < 0 or self.decompress_call_s < 0:
            raise ValueError(f"codec on {self.gpu}: per-call times must be >= 0")


@dataclass(frozen=True, slots=True)
class GemmMeasurement:
    """One timed GEMM (m x k) @ (k x n) in `dtype` on `gpu` against that type's dense peak."""

    gpu: str
    dtype: str
    m: int
    n: int
    k: int
    seconds: float
    peak_flops: float

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k) < 1 or not self.seconds > 0 or not self.peak_flops > 0:
            raise ValueError(f"GEMM {self.m}x{self.n}x{self.k}: sizes, time and peak must be > 0")

    @property
    def achieved_flops(self) -> float:
        """2 m n k / seconds."""
        return 2.0 * self.m * self.n * self.k / self.seconds

    @property
    def efficiency(self) -> float:
        """Achieved over the datasheet dense peak."""
        return self.achieved_flops / self.peak_flops


@dataclass(frozen=True, slots=True)
class ClusterProfile:
    """A calibration of real machines: collective curves per link tier and GEMM throughput
    per GPU type (written by `meshplan calibrate`, read by `meshplan.ir.cluster_io`)."""

    tiers: tuple[TierProfile, ...] = ()
    gemm: tuple[GemmMeasurement, ...] = ()
    version: int = PROFILE_VERSION
    codec: tuple[CodecMeasurement, ...] = ()  # lossless codec speed per GPU type
    source: str = ""  # host, backend, torch version, date

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {self.version} is not supported (this meshplan reads "
                f"version {PROFILE_VERSION}); run `meshplan calibrate` again"
            )
        names = [t.tier for t in self.tiers]
        if len(names) != len(set(names)):
            raise ValueError("profile: one entry per link tier")

    def tier(self, name: str) -> TierProfile | None:
        """The measurements of tier `name`, or None."""
        for t in self.tiers:
            if t.tier == name:
                return t
        return None

    def gemm_efficiency(self, gpu: str, dtype: str | None = None) -> float | None:
        """Median efficiency over the measured shapes of `gpu` (in `dtype`, or in the dtype with
        the most measurements when None); None when `gpu` was not measured."""
        rows = [g for g in self.gemm if g.gpu == gpu]
        if dtype is None and rows:
            counts: dict[str, int] = {}
            for g in rows:
                counts[g.dtype] = counts.get(g.dtype, 0) + 1
            dtype = max(counts, key=lambda d: (counts[d], d == "bfloat16"))
        effs = [g.efficiency for g in rows if g.dtype == dtype]
        return statistics.median(effs) if effs else None

    def codec_speed(self, gpu: str) -> tuple[float, float, float, float] | None:
        """(compress B/s, decompress B/s, compress s/call, decompress s/call) measured on
        `gpu`, bf16 preferred; None when the codec was not measured there."""
        rows = sorted((c for c in self.codec if c.gpu == gpu), key=lambda c: c.dtype != "bfloat16")
        if not rows:
            return None
        c = rows[0]
        return (c.compress_bps, c.decompress_bps, c.compress_call_s, c.decompress_call_s)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md): 2(n-1)/n for all-reduce,
    (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv."""
    if collective == "p2p":
        return 1.0
    if n <= 1:
        return 0.0
    return (2.0 if collective == "all_reduce" else 1.0) * (n - 1) / n


def measured_busbw(curve: CollectiveCurve) -> tuple[float, ...]:
    """Bus bandwidth (bytes/s) at each measured size: size * factor(n) / time."""
    f = busbw_factor(curve.collective, curve.ranks)
    return tuple(s * f / t for s, t in curve.points)


def tier_peak_busbw(tier: TierProfile) -> float:
    """The tier's large-message bus bandwidth: the all-reduce curve's best, else the best of
    any measured curve (the reference the cost model scales every curve of the tier by)."""
    ar = tier.curve("all_reduce")
    curves = [ar] if ar is not None else list(tier.curves)
    return max(max(measured_busbw(c)) for c in curves)


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    group: str
    node: int  # global node index
    local_rank: int  # GPU index within the node


# Optional calibration fields that `Cluster.to_dict` leaves out while unset.
_OMITTED_WHEN_UNSET = frozenset({"profile", "gemm_efficiency", "codec_speed", "nvlink_domain"})

# The readers behind `Cluster.load` and `Cluster.preset`: `cluster_io` stands on this module
# (it builds Clusters), so it installs them when `meshplan.ir` is imported instead of this
# module importing it back.
READERS: dict[str, Callable[..., Cluster]] = {}
# File names `Cluster.named` reads as cluster files rather than preset names.
CLUSTER_FILE_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    groups: tuple[DeviceGroup, ...]
    links: tuple[LinkTier, ...]
    group_links: tuple[GroupLink, ...] = ()
    profile: ClusterProfile | None = None  # set by `with_profile`

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError(f"cluster {self.name}: no device groups")
        names = [g.name for g in self.groups]
        if len(names) != len(set(names)):
            raise ValueError(f"cluster {self.name}: duplicate group names")
        tiers = {t.name for t in self.links}
        for g in self.groups:
            if g.intra_link not in tiers:
                raise ValueError(f"group {g.name}: unknown intra_link {g.intra_link!r}")
            if g.nodes > 1 and g.inter_link not in tiers:
                raise ValueError(f"group {g.name}: unknown inter_link {g.inter_link!r}")
        for gl in self.group_links:
            if gl.link not in tiers:
                raise ValueError(f"group link {gl.a}-{gl.b}: unknown link {gl.link!r}")

    # -- lookup ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return sum(g.num_gpus for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        return len({g.gpu.name for g in self.groups}) == 1 and len(self.groups) == 1

    def group(self, name: str) -> DeviceGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def link(self, name: str) -> LinkTier:
        for t in self.links:
            if t.name == name:
                return t
        raise KeyError(name)

    def ranks(self) -> tuple[RankInfo, ...]:
        out, rank, node = [], 0, 0
        for g in self.groups:
            for _ in range(g.nodes):
                for local in range(g.gpus_per_node):
                    out.append(RankInfo(rank, g.name, node, local))
                    rank += 1
                node += 1
        return tuple(out)

    def link_between_groups(self, a: str, b: str) -> LinkTier:
        """The tier connecting two different groups: an explicit GroupLink (by group or site
        name) or, for groups at one site, the slower of their inter-node links."""
        if a == b:
            return self.link(self.group(a).inter_link or self.group(a).intra_link)
        ga, gb = self.group(a), self.group(b)
        for gl in self.group_links:
            if {gl.a, gl.b} in ({a, b}, {ga.site, gb.site}):
                return self.link(gl.link)
        if ga.site != gb.site:
            raise ValueError(
                f"cluster {self.name}: groups {a} and {b} are at different sites "
                f"({ga.site}, {gb.site}) and no group_links entry connects them"
            )
        candidates = [self.link(g.inter_link or g.intra_link) for g in (ga, gb)]
        return min(candidates, key=lambda t: t.effective_bandwidth)

    def with_profile(self, profile: ClusterProfile | None) -> Cluster:
        """This cluster calibrated by `profile` (None: unchanged).

        Every link tier the profile measured (matched by name) gets the measured large-message
        bus bandwidth, efficiency 1 and, where send/recv was measured, its smallest time as
        the per-hop latency. The bandwidth is per GPU for a tier measured inside one node; for
        a tier measured across nodes with `ranks_per_node` ranks on nodes of `gpus_per_node`
        GPUs and `nics_per_node` NICs it is per NIC, peak * gpus_per_node / (ranks_per_node *
        nics_per_node), the inverse of the cost model's NIC sharing
        (`meshplan.cost_model.collectives.group_path`), so that pricing the measured
        configuration gives back the measured bandwidth. Every GPU type the profile measured
        gets the median measured GEMM efficiency. The cost model also prices collectives on
        measured tiers with the measured curves (size dependence included).

        Raises ValueError (one line) when the profile measured none of this cluster's tiers
        and none of its GPU types.
        """
        if profile is None:
            return self
        links = []
        matched: list[str] = []
        for t in self.links:
            tp = profile.tier(t.name)
            if tp is None:
                links.append(t)
                continue
            matched.append(t.name)
            peak = tier_peak_busbw(tp)
            bw = peak
            if not tp.intra_node:
                bw = peak * tp.gpus_per_node / (tp.ranks_per_node * tp.nics_per_node)
            p2p = tp.curve("p2p")
            latency = p2p.points[0][1] if p2p is not None else t.latency
            links.append(LinkTier(t.name, t.kind, bw, latency, 1.0))
        groups = []
        for g in self.groups:
            eff = profile.gemm_efficiency(g.gpu.name)
            if eff is not None:
                matched.append(g.gpu.name)
                g = dataclasses.replace(g, gpu=dataclasses.replace(g.gpu, gemm_efficiency=eff))
            codec = profile.codec_speed(g.gpu.name)
            if codec is not None:
                matched.append(g.gpu.name)
                g = dataclasses.replace(g, gpu=dataclasses.replace(g.gpu, codec_speed=codec))
            groups.append(g)
        if not matched:
            measured = [t.tier for t in profile.tiers] + sorted({m.gpu for m in profile.gemm})
            raise ValueError(
                f"the profile measured {', '.join(measured) or 'nothing'}, none of which is a "
                f"link tier ({', '.join(t.name for t in self.links)}) or GPU type "
                f"({', '.join(sorted({g.gpu.name for g in self.groups}))}) of cluster "
                f"{self.name}; calibrate with --intra-link/--inter-link/--gpu naming them"
            )
        return dataclasses.replace(self, links=tuple(links), groups=tuple(groups), profile=profile)

    def fingerprint(self) -> str:
        h = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode())
        return h.hexdigest()[:16]

    def to_dict(self) -> dict:
        """The cluster in the same form `Cluster.load` reads (round-trips)."""

        def plain(obj: object) -> object:
            if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                out = {}
                for f in dataclasses.fields(obj):
                    value = getattr(obj, f.name)
                    if value is None and f.name in _OMITTED_WHEN_UNSET:
                        continue  # uncalibrated clusters keep their layout and fingerprint
                    # float fields given as ints (bandwidth=50e9 vs 50_000_000_000) must
                    # serialise, and so fingerprint, identically.
                    if f.type in ("float", "float | None") and isinstance(value, int):
                        value = float(value)
                    out[f.name] = plain(value)
                return out
            if isinstance(obj, enum.Enum):
                return obj.value
            if isinstance(obj, (tuple, list)):
                return [plain(x) for x in obj]
            return obj

        return plain(self)  # type: ignore[return-value]

    # -- constructors (implemented in cluster_io, kept here so users find them) ---------------
    @classmethod
    def load(cls, path: str) -> Cluster:
        """Read a cluster from a YAML or JSON file; a bad field raises `ClusterError` naming
        the field and the file."""
        return READERS["load"](path)

    @classmethod
    def preset(cls, name: str, gpus: int | None = None) -> Cluster:
        """A named preset (`dgx-h100`, `mixed-h100-a100`, ...) or a homogeneous cluster of
        8-GPU nodes of a GPU type from the spec table (`H100`, `A100-80GB`; `GB200`, `GB300`:
        4-GPU trays in 72-GPU NVLink domains)."""
        return READERS["preset"](name, gpus)

    @classmethod
    def named(cls, spec: str | Path, gpus: int | None = None) -> Cluster:
        """What `--cluster` names: a YAML/JSON cluster file (by its suffix; `gpus` must then
        be None, the file sets its counts) or a preset / GPU type (`preset`)."""
        if Path(spec).suffix.lower() in CLUSTER_FILE_SUFFIXES:
            if gpus is not None:
                raise ValueError(
                    "--gpus applies to preset clusters; a cluster file sets its own counts"
                )
            return cls.load(str(spec))
        return cls.preset(str(spec), gpus)

    def summary(self) -> str:
        parts = [
            f"{g.name}: {g.nodes}x{g.gpus_per_node} {g.gpu.name} ({g.intra_link}"
            + (f" across {g.domain_gpus} GPUs" if g.domain_gpus > g.gpus_per_node else "")
            + (f", {g.nics_per_node}x {g.inter_link}" if g.nodes > 1 else "")
            + ")"
            for g in self.groups
        ]
        return f"{self.name} ({self.world_size} GPUs): " + "; ".join(parts)
