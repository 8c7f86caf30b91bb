"""Cluster description: device groups, link tiers and the topology between them.

A cluster is a set of *device groups*. A group is `nodes` identical machines, each holding
`gpus_per_node` GPUs of one type, connected inside the node by `intra_link` and to other nodes
of the group by `inter_link` through `nics_per_node` NICs. Groups live at *sites*; groups at
the same site talk over the slower of their inter-node links unless a `GroupLink` says
otherwise; groups at different sites need a `GroupLink` (typically a WAN tier).

Units are SI and explicit: bandwidths in bytes per second *in one direction*, latencies in
seconds, memory in bytes. Intra-node bandwidth is per GPU; inter-node bandwidth is per NIC
(the GPUs of a node share its NICs); a GroupLink's bandwidth is the whole link's.

Ranks are numbered group by group, node by node, GPU by GPU (row-major), which is also how
`meshplan launch` assigns them.

Loading from YAML/JSON and the presets live in `meshplan.ir.cluster_io`; this module only
holds the types and topology queries.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass


class LinkKind(enum.StrEnum):
    NVLINK = "nvlink"
    PCIE = "pcie"
    INFINIBAND = "infiniband"
    ROCE = "roce"
    ETHERNET = "ethernet"
    WAN = "wan"
    LOOPBACK = "loopback"  # processes on one CPU host (gloo over shared memory / TCP loopback)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet numbers of one accelerator type (dense, no sparsity).

    `peak_flops` maps a dtype name ("bfloat16", "float16", "float32", "float8_e4m3fn") to
    FLOP/s. `source` cites where the numbers come from.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    sms: int  # streaming multiprocessors (or compute units / cores)
    nvlink_bandwidth: float  # bytes/s per GPU, one direction; 0 when the GPU has none
    source: str = ""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.hbm_bandwidth <= 0:
            raise ValueError(f"GpuSpec {self.name}: memory and bandwidth must be positive")
        if not self.peak_flops:
            raise ValueError(f"GpuSpec {self.name}: no peak FLOP/s given")

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; falls back to fp16 for bf16 on GPUs without bf16."""
        table = dict(self.peak_flops)
        if dtype in table:
            return table[dtype]
        for alt in {"bfloat16": ("float16",), "float16": ("bfloat16",)}.get(dtype, ()):
            if alt in table:
                return table[alt]
        if "float32" in table:
            return table["float32"]
        raise KeyError(f"GPU {self.name} has no peak FLOP/s for {dtype}")


@dataclass(frozen=True, slots=True)
class LinkTier:
    """One kind of link: its bandwidth (bytes/s, one direction), latency and efficiency.

    `efficiency` is the fraction of `bandwidth` that collectives reach on large messages
    (NCCL bus bandwidth over line rate); the cost model applies it.
    """

    name: str
    kind: LinkKind
    bandwidth: float
    latency: float
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"link {self.name}: bandwidth must be positive")
        if self.latency < 0:
            raise ValueError(f"link {self.name}: latency must be non-negative")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name}: efficiency must be in (0, 1]")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """`nodes` machines of `gpus_per_node` GPUs of one type."""

    name: str
    gpu: GpuSpec
    nodes: int
    gpus_per_node: int
    intra_link: str  # LinkTier name
    inter_link: str  # LinkTier name ("" for a single-node group)
    nics_per_node: int = 1
    site: str = "site0"
    price_per_gpu_hour: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"group {self.name}: nodes and gpus_per_node must be >= 1")
        if self.nics_per_node < 1:
            raise ValueError(f"group {self.name}: nics_per_node must be >= 1")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class GroupLink:
    """The link between two device groups (or all groups of two sites), by tier name."""

    a: str
    b: str
    link: str


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    group: str
    node: int  # global node index
    local_rank: int  # GPU index within the node


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    groups: tuple[DeviceGroup, ...]
    links: tuple[LinkTier, ...]
    group_links: tuple[GroupLink, ...] = ()

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
        from .cluster_io import load_cluster

        return load_cluster(path)

    @classmethod
    def preset(cls, name: str, gpus: int | None = None) -> Cluster:
        """A named preset (`dgx-h100`, `mixed-h100-a100`, ...) or a homogeneous cluster of
        8-GPU nodes of a GPU type from the spec table (`H100`, `A100-80GB`)."""
        from .cluster_io import preset_cluster

        return preset_cluster(name, gpus)

    def summary(self) -> str:
        parts = [
            f"{g.name}: {g.nodes}x{g.gpus_per_node} {g.gpu.name} ({g.intra_link}"
            + (f", {g.nics_per_node}x {g.inter_link}" if g.nodes > 1 else "")
            + ")"
            for g in self.groups
        ]
        return f"{self.name} ({self.world_size} GPUs): " + "; ".join(parts)
