"""What-if analysis: the best plan for each of several hardware configurations, side by side.

    import meshplan
    model, inputs = meshplan.models.get("llama3-8b")
    records = meshplan.whatif(model, inputs, base="dgx-h100",
                              vary={"gpus": [64, 128, 256], "inter_bw": ["200Gbps", "400Gbps"]},
                              tokens="1T")
    for r in records:
        print(r.label, r.tokens_per_s, r.cost_usd, r.bottleneck)

The model is traced once; every configuration is planned by `meshplan.plan` (CP-SAT) on the same
graph and global batch, so the step times compare like for like.

Configurations (`sweep_points`): the cartesian product of the *bases* (cluster presets, cluster
files, `Cluster` objects, or `mix` clusters) and the values of each *axis* in `vary`:

- `gpus`: total GPU count of a preset (`Cluster.preset(name, gpus=N)`) or of a mix.
- `gpu`: swap the GPU type of a cluster that has one GPU type. The nodes, their GPU count and
  their network stay (an NVLink domain wider than a node only between rack-scale types, GB200
  and GB300); the intra-node link becomes the new type's own (NVLink generation, or
  PCIe for consumer and PCIe cards: `meshplan.ir.hardware.default_intra_link`), and the price
  the new type's (see "Cost"). One variable changes at a time, so the comparison isolates the GPU.
- `inter_bw`: the per-NIC bandwidth of every group's inter-node link tier (a copy of the tier
  with the new bandwidth, named like `ib-ndr@200Gbps`; latency and efficiency kept).
- `wan_bw`: the bandwidth of every `group_links` tier (the links between groups or sites).
- `mix` ("H100:A100=1:3,1:1,3:1"): for each ratio, a cluster of 8-GPU nodes of each type at one
  site, `gpus` in total split by the ratio (each type's group built like the GPU-type preset;
  the groups meet over the slower of their inter-node links, as in `mixed-h100-a100`).

A configuration that cannot be built (a GPU count that is not whole nodes, a ratio that does not
divide) or planned (`InfeasibleError`: does not fit; a pinned degree that does not divide) is a
record with `feasible=False` and the one-line reason; the sweep goes on.

Cost. `usd_per_hour` = sum over the cluster's groups of GPUs x price per GPU-hour, for *every*
GPU of the cluster (a plan may leave some idle, `gpus_used`, but you rent the cluster). The price
of a group is, first to apply: `prices[gpu type]` (the `--price` overrides), the group's
`price_per_gpu_hour` (cluster file), `meshplan.ir.cluster_io.EXAMPLE_PRICE_PER_GPU_HOUR` (example
on-demand prices, not quotes). `train_time_s = tokens / tokens_per_s`,
`cost_usd = usd_per_hour * train_time_s / 3600`, `usd_per_mtok` the same for 1M tokens. No price
known for a group: the costs are None.

Bottleneck. `bottleneck_part` is the largest part of the predicted step-time breakdown and
`time_bottleneck` its name, for what to buy more of:

- `compute` -> "compute"; `optimizer` -> "optimizer" (the memory-bound Adam update);
  `host` -> "host" (the GPU waits for Python to issue its kernels: a faster host, bigger
  micro-batches, no selective-checkpoint mode, or CUDA graphs; `cost_model.host`);
  `pp_bubble` -> "pipeline bubble"; `recompute` -> "memory" (recomputation only buys memory);
- a communication part -> the link tier it runs on (`part_link_tier`): `tp_comm` the intra-node
  tier (TP stays inside a node or NVLink domain, e.g. nvlink4); `cp_comm`, `ep_comm` and
  `dp_comm_exposed` the intra-node tier when the ring fits in one node (one NVLink domain:
  a GB200 NVL72 rack's 72 GPUs), else the inter-node tier (e.g. ib-ndr), and
  for a DP group spanning device groups the tier between them (e.g. wan-100g); `pp_p2p` the
  tier between consecutive stages. Several candidates: the slowest (least effective bandwidth).

A plan is `memory_bound` when the tightest rank has less than `MEMORY_HEADROOM_FRACTION` (5%)
of its capacity free, or when it uses recomputation or ZeRO-3 and the same plan without them
(recompute none, ZeRO-2) would not fit: memory, not time, shaped it. `bottleneck` is
`time_bottleneck`, except that a memory-bound plan whose largest part is on the GPU (compute,
recompute, optimizer) reports "memory": more memory per GPU, not more FLOP/s, is then what
would let a cheaper configuration run. A link tier or the pipeline bubble that is the largest
part stays the bottleneck even in a memory-bound plan: it costs the most time whatever the
memory. `headroom_bytes` is min over ranks of (capacity - peak).

Caching (`PlanCache`). Each configuration's plan (or its infeasibility reason) is stored as JSON
under `cache_dir` (default `$XDG_CACHE_HOME/meshplan/whatif`, i.e. `~/.cache/meshplan/whatif`),
keyed by a hash of the graph fingerprint, the cluster fingerprint (prices and the cluster's name
left out: they do not change a plan), the pinned parallel fields, the global batch, the solver
time limit, the meshplan version and a hash of the planner and cost-model sources. A re-run
that changes one point re-plans only that point; changing prices or `tokens` re-plans nothing.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import importlib
import io
import itertools
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from meshplan.cost_model import BREAKDOWN_PARTS, predict
from meshplan.cost_model.host import default_node_s
from meshplan.ir import Cluster, DeviceGroup, Graph, LinkTier, Parallel, Recompute
from meshplan.ir.cluster_io import (
    EXAMPLE_PRICE_PER_GPU_HOUR,
    RACK_SCALE,
    parse_bandwidth,
    resolve_cluster,
)
from meshplan.ir.hardware import (
    LINK_TIERS,
    canonical_gpu_name,
    default_intra_link,
    gpu_spec,
)
from meshplan.ir.plan import Plan, plan_from_dict

from . import api
from .version import __version__

__all__ = [
    "AXES",
    "MEMORY_HEADROOM_FRACTION",
    "MixSpec",
    "PlanCache",
    "Point",
    "WhatIfRecord",
    "bottleneck_of",
    "build_cluster",
    "default_cache_dir",
    "pareto_front",
    "parse_mix",
    "parse_price",
    "parse_tokens",
    "parse_vary",
    "part_link_tier",
    "plot_records",
    "records_table",
    "records_to_csv",
    "records_to_json",
    "require_matplotlib",
    "sweep_points",
    "whatif",
]

AXES = ("gpus", "gpu", "inter_bw", "wan_bw")
_BANDWIDTH_AXES = ("inter_bw", "wan_bw")

# Below this fraction of free memory on the tightest rank the plan counts as memory-bound: the
# allocator's fragmentation and NCCL buffers (a few GiB on an 80 GiB part) live in that margin,
# so a real run at higher occupancy risks OOM and the next model/batch step will not fit.
MEMORY_HEADROOM_FRACTION = 0.05

CACHE_VERSION = "meshplan.whatif-cache/v1"

# Named as the bottleneck for a step-time part that is not communication.
_PART_NAMES = {
    "compute": "compute",
    "host": "host",
    "recompute": "memory",
    "pp_bubble": "pipeline bubble",
    "optimizer": "optimizer",
}

# Step-time parts spent on the GPU itself: in a memory-bound plan these make "memory" the
# bottleneck (communication and the bubble keep their own name).
_ON_GPU_PARTS = ("compute", "recompute", "optimizer")

SweepProgress = Callable[[int, int, str], None] | None


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WhatIfRecord:
    """One configuration of a what-if sweep and its best plan (None fields: not known, e.g. an
    infeasible point, or no price). Times in seconds, memory in bytes, money in US dollars."""

    label: str  # the configuration, e.g. "gpus=64 inter_bw=200Gbps"
    cluster: str  # the cluster's name ("" when it could not be built)
    gpus: int  # GPUs in the cluster (requested count when it could not be built; 0 unknown)
    gpu_types: tuple[str, ...]
    feasible: bool
    reason: str = ""  # why not feasible (one line)
    parallel: str = ""  # e.g. "dp8 tp2 pp1 mb4 ZeRO-2", "... ZeRO-3 rc=full" (recomputation)
    gpus_used: int | None = None  # GPUs the plan runs on (the rest idle)
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    tokens: float | None = None  # the training run priced below
    train_time_s: float | None = None
    cost_usd: float | None = None
    usd_per_hour: float | None = None  # the whole cluster
    usd_per_mtok: float | None = None
    headroom_bytes: int | None = None
    headroom_fraction: float | None = None  # of the tightest rank's capacity
    bottleneck: str = ""  # "memory" when memory_bound, else time_bottleneck
    bottleneck_part: str = ""  # the largest step-time part ("compute", "dp_comm_exposed", ...)
    time_bottleneck: str = ""  # that part's name ("compute", "ib-ndr", "pipeline bubble", ...)
    memory_bound: bool = False
    breakdown: tuple[tuple[str, float], ...] = ()  # (part, seconds), as Prediction.breakdown
    settings: tuple[tuple[str, str], ...] = ()  # (axis, value) of the point

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (breakdown and settings as objects, gpu_types as a list)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["gpu_types"] = list(self.gpu_types)
        out["breakdown"] = dict(self.breakdown)
        out["settings"] = dict(self.settings)
        return out


# ---------------------------------------------------------------------------------------------
# Parsing (command-line style values; the Python API accepts the same)
# ---------------------------------------------------------------------------------------------

_TOKEN_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TOKENS_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")


def parse_tokens(value: str | float | int) -> float:
    """Tokens to train on: a number, or "300B", "1T", "2.5T", "500M", "10k" (B = billion)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    else:
        match = _TOKENS_RE.match(str(value))
        if not match:
            raise ValueError(f"tokens must be like 1T, 300B, 500M or 1e12, got {value!r}")
        out = float(match.group(1)) * _TOKEN_SUFFIX[match.group(2).lower()]
    if not (out > 0 and math.isfinite(out)):
        raise ValueError(f"tokens must be positive, got {value!r}")
    return out


def parse_vary(text: str) -> tuple[str, list[str]]:
    """`AXIS=V1,V2,...` -> (axis, values). Bandwidth values without a unit take the unit of the
    last value that has one ("100,200,400Gbps"); when none has one the list is refused, as a
    cluster file refuses a bare bandwidth (bytes/s? Gb/s?), naming the accepted forms."""
    axis, sep, rest = text.partition("=")
    axis = axis.strip().lower().replace("-", "_")
    if not sep or not rest.strip():
        raise ValueError(f"--vary wants AXIS=V1,V2,... (axes: {', '.join(AXES)}), got {text!r}")
    if axis not in AXES:
        raise ValueError(f"--vary: unknown axis {axis!r}; axes: {', '.join(AXES)}")
    values = [v.strip() for v in rest.split(",")]
    if any(not v for v in values):
        raise ValueError(f"--vary {axis}: empty value in {rest!r}")
    if axis in _BANDWIDTH_AXES:
        units = [re.sub(r"^[-+0-9.eE\s]+", "", v) for v in values]
        default = next((u for u in reversed(units) if u), None)
        if default is None:
            try:
                parse_bandwidth(values[0], unit_required=True)
            except ValueError as e:
                raise ValueError(f"--vary {axis}: {e}") from None
        values = [v if u else f"{v}{default}" for v, u in zip(values, units)]
    return axis, values


def parse_price(text: str) -> tuple[str, float]:
    """`GPU=PRICE` ($ per GPU-hour), e.g. "H100=2.5"; the GPU type as in the spec table."""
    name, sep, price = text.partition("=")
    try:
        value = float(price)
    except ValueError:
        value = -1.0
    if not sep or not name.strip() or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"--price wants GPU=DOLLARS_PER_GPU_HOUR like H100=2.5, got {text!r}")
    return _gpu_key(name.strip()), value


def _gpu_key(name: str) -> str:
    """The canonical type name for known GPUs; a custom spec's name as written."""
    return canonical_gpu_name(name) or name


@dataclass(frozen=True, slots=True)
class MixSpec:
    """A mixed cluster: GPU types and their share of the GPUs (parts of a ratio)."""

    types: tuple[str, ...]  # as the user wrote them (canonicalised when built)
    parts: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.types) < 2 or len(self.types) != len(self.parts):
            raise ValueError(f"mix: need two or more GPU types with one ratio part each: {self}")
        if any(p < 0 or not math.isfinite(p) for p in self.parts) or not any(self.parts):
            raise ValueError(f"mix: ratio parts must be non-negative, not all 0: {self.label}")
        for t in self.types:
            gpu_spec(t)  # fail early on a typo

    @property
    def label(self) -> str:
        return ":".join(self.types) + "=" + ":".join(f"{p:g}" for p in self.parts)


def parse_mix(value: str | Sequence[Mapping[str, float]] | MixSpec) -> list[MixSpec]:
    """ "H100:A100=1:3,1:1" or [{"H100": 1, "A100": 3}, ...] -> one MixSpec per ratio."""
    if isinstance(value, MixSpec):
        return [value]
    if not isinstance(value, str):
        return [MixSpec(tuple(m), tuple(float(v) for v in m.values())) for m in value]
    types_text, sep, ratios = value.partition("=")
    types = tuple(t.strip() for t in types_text.split(":"))
    if not sep or len(types) < 2 or any(not t for t in types) or not ratios.strip():
        raise ValueError(f"--mix wants TYPE:TYPE=A:B,C:D,... like H100:A100=1:3,1:1; got {value!r}")
    out = []
    for ratio in ratios.split(","):
        try:
            parts = tuple(float(p) for p in ratio.split(":"))
        except ValueError:
            raise ValueError(f"--mix: ratio {ratio.strip()!r} is not numbers like 1:3") from None
        if len(parts) != len(types):
            raise ValueError(
                f"--mix: ratio {ratio.strip()!r} has {len(parts)} parts for {len(types)} types"
            )
        out.append(MixSpec(types, parts))
    return out


def _bandwidth_text(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    return f"{bits / 1e9:g}Gbps" if bits >= 1e9 else f"{bits / 1e6:g}Mbps"


def _axis_values(axis: str, values: Sequence[object]) -> list[tuple[object, str]]:
    """Validated (value, text) pairs of one axis; raises ValueError on a bad value."""
    if axis not in AXES:
        raise ValueError(f"vary: unknown axis {axis!r}; axes: {', '.join(AXES)}")
    if not values:
        raise ValueError(f"vary: axis {axis!r} has no values")
    out: list[tuple[object, str]] = []
    for v in values:
        if axis == "gpus":
            try:
                n = int(str(v))
            except ValueError:
                n = 0
            if n < 1:
                raise ValueError(f"vary gpus: values must be positive integers, got {v!r}")
            out.append((n, str(n)))
        elif axis == "gpu":
            name = gpu_spec(str(v)).name
            out.append((name, name))
        else:
            try:
                bw = parse_bandwidth(v, unit_required=True)  # as cluster files
            except ValueError as e:
                raise ValueError(f"vary {axis}: {e}") from None
            out.append((bw, _bandwidth_text(bw)))
    return out


# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------

Base = Cluster | str | MixSpec


@dataclass(frozen=True, slots=True)
class Point:
    """One configuration: a base cluster (or mix) and a value per varied axis."""

    label: str
    base: Base
    settings: tuple[tuple[str, object, str], ...]  # (axis, value, text)

    def setting(self, axis: str) -> object | None:
        return next((v for a, v, _ in self.settings if a == axis), None)


def _base_label(base: Base) -> str:
    if isinstance(base, Cluster):
        return base.name
    if isinstance(base, MixSpec):
        return base.label
    return base


def sweep_points(
    bases: Sequence[Base], vary: Mapping[str, Sequence[object]] | None = None
) -> list[Point]:
    """The cartesian product bases x vary[axis1] x vary[axis2] ..., bases outermost."""
    vary = dict(vary or {})
    axes = [(axis, _axis_values(axis, values)) for axis, values in vary.items()]
    if any(isinstance(b, MixSpec) for b in bases) and "gpu" in vary:
        raise ValueError(
            "vary gpu swaps the GPU type of one-type clusters; it does not apply to mix"
        )
    show_base = len(bases) > 1 or not axes or any(isinstance(b, MixSpec) for b in bases)
    points = []
    for base in bases:
        for combo in itertools.product(*(values for _, values in axes)):
            settings = tuple((axis, v, text) for (axis, _), (v, text) in zip(axes, combo))
            words = ([_base_label(base)] if show_base else []) + [
                f"{a}={text}" for a, _, text in settings
            ]
            points.append(Point(" ".join(words), base, settings))
    return points


def build_cluster(point: Point, gpus: int | None = None) -> Cluster:
    """The cluster of `point` (`gpus`: the total when the point does not vary it). Raises
    ValueError (one line) when it cannot be built."""
    n = point.setting("gpus")
    n = gpus if n is None else n
    base = point.base
    if isinstance(base, MixSpec):
        if n is None:
            raise ValueError("a mix needs a total GPU count (gpus=, --gpus or --vary gpus)")
        cluster = _mix_cluster(base, int(n))  # type: ignore[arg-type]
    elif isinstance(base, Cluster):
        if n is not None and n != base.world_size:
            raise ValueError(
                f"cluster {base.name}: a GPU count applies to presets; this cluster has its own "
                f"({base.world_size})"
            )
        cluster = base
    else:
        cluster = resolve_cluster(base, n)  # type: ignore[arg-type]
    gpu = point.setting("gpu")
    if gpu is not None:
        cluster = _swap_gpu(cluster, str(gpu))
    bw = point.setting("inter_bw")
    if bw is not None:
        cluster = _set_inter_bandwidth(cluster, float(bw))  # type: ignore[arg-type]
    bw = point.setting("wan_bw")
    if bw is not None:
        cluster = _set_wan_bandwidth(cluster, float(bw))  # type: ignore[arg-type]
    return cluster


def _mix_cluster(mix: MixSpec, total: int) -> Cluster:
    """`total` GPUs split by the ratio, each type's group as its GPU-type preset builds it."""
    whole = sum(mix.parts)
    groups: list[DeviceGroup] = []
    links: dict[str, LinkTier] = {}
    for name, part in zip(mix.types, mix.parts):
        share = total * part / whole
        if abs(share - round(share)) > 1e-9:
            raise ValueError(f"mix {mix.label} does not split {total} GPUs into whole GPUs")
        if round(share) == 0:
            continue
        typed = Cluster.preset(gpu_spec(name).name, gpus=round(share))
        (g,) = typed.groups
        if any(x.name == g.name for x in groups):
            raise ValueError(f"mix {mix.label}: GPU type {g.gpu.name} given twice")
        groups.append(g)
        for t in typed.links:
            links.setdefault(t.name, t)
    label = "-".join(g.name for g in groups)
    return Cluster(f"mix-{label}-{total}", tuple(groups), tuple(links.values()))


def _with_tier(links: tuple[LinkTier, ...], tier: LinkTier) -> tuple[LinkTier, ...]:
    return links if any(t.name == tier.name for t in links) else (*links, tier)


def _swap_gpu(cluster: Cluster, gpu: str) -> Cluster:
    types = sorted({g.gpu.name for g in cluster.groups})
    if len(types) != 1:
        raise ValueError(
            f"vary gpu swaps the GPU type of a one-type cluster; {cluster.name} has "
            f"{', '.join(types)}"
        )
    spec = gpu_spec(gpu)
    intra = default_intra_link(spec.name)
    links = cluster.links
    if not any(t.name == intra for t in links):
        links = (*links, LINK_TIERS[intra])
    # An NVLink domain wider than a node is the rack's switch fabric: it stays for a rack-scale
    # type (GB200 <-> GB300) and goes for the others, whose NVLink ends at the node.
    domain_stays = spec.name in RACK_SCALE
    groups = tuple(
        dataclasses.replace(
            g,
            gpu=spec,
            intra_link=intra,
            price_per_gpu_hour=None,
            nvlink_domain=g.nvlink_domain if domain_stays else None,
        )
        for g in cluster.groups
    )
    name = cluster.name.replace(types[0].lower(), spec.name.lower())
    if name == cluster.name:
        name = f"{cluster.name}-{spec.name.lower()}"
    return dataclasses.replace(cluster, name=name, groups=groups, links=links)


def _retier(tier: LinkTier, bandwidth: float) -> LinkTier:
    return dataclasses.replace(
        tier, name=f"{tier.name}@{_bandwidth_text(bandwidth)}", bandwidth=bandwidth
    )


def _set_inter_bandwidth(cluster: Cluster, bandwidth: float) -> Cluster:
    links, groups = cluster.links, []
    for g in cluster.groups:
        if g.inter_link:
            tier = _retier(cluster.link(g.inter_link), bandwidth)
            links = _with_tier(links, tier)
            g = dataclasses.replace(g, inter_link=tier.name)
        groups.append(g)
    return dataclasses.replace(cluster, groups=tuple(groups), links=links)


def _set_wan_bandwidth(cluster: Cluster, bandwidth: float) -> Cluster:
    links, group_links = cluster.links, []
    for gl in cluster.group_links:
        tier = _retier(cluster.link(gl.link), bandwidth)
        links = _with_tier(links, tier)
        group_links.append(dataclasses.replace(gl, link=tier.name))
    return dataclasses.replace(cluster, group_links=tuple(group_links), links=links)


# ---------------------------------------------------------------------------------------------
# Bottleneck
# ---------------------------------------------------------------------------------------------


def _slowest(tiers: Sequence[LinkTier]) -> str:
    return min(tiers, key=lambda t: t.effective_bandwidth).name if tiers else ""


def _ring_tier(cluster: Cluster, g: DeviceGroup, ranks: int, per_domain: int) -> LinkTier:
    """The tier a ring of `ranks` ranks of group g, `per_domain` to an NVLink domain (a node
    unless the group sets `nvlink_domain`), is limited by."""
    if ranks <= max(1, per_domain) or g.domains == 1 or not g.inter_link:
        return cluster.link(g.intra_link)
    return cluster.link(g.inter_link)


def _pair_tier(cluster: Cluster, a: str, b: str) -> LinkTier:
    """The tier between consecutive pipeline stages on groups a and b."""
    if a != b:
        return cluster.link_between_groups(a, b)
    g = cluster.group(a)
    return cluster.link(g.inter_link if g.domains > 1 and g.inter_link else g.intra_link)


def part_link_tier(plan: Plan, part: str, cluster: Cluster | None = None) -> str:
    """Name of the link tier the communication `part` of `plan`'s step runs on ("" for a part
    that is not communication). See the module docstring for the rules."""
    cluster = cluster or plan.cluster
    p = plan.parallel
    tp, cp, ep, dp = p.tp or 1, p.cp or 1, p.ep or 1, p.dp or 1
    used = [[g for g, n in st.replicas if n > 0] for st in plan.stages]
    groups = [cluster.group(name) for name in dict.fromkeys(g for u in used for g in u)]
    tiers: list[LinkTier] = []
    if part == "tp_comm":
        tiers = [cluster.link(g.intra_link) for g in groups]
    elif part == "cp_comm":
        tiers = [_ring_tier(cluster, g, cp, g.domain_gpus // tp) for g in groups]
    elif part == "ep_comm":
        tiers = [_ring_tier(cluster, g, ep, g.domain_gpus // (tp * cp)) for g in groups]
    elif part == "dp_comm_exposed":
        for u in used:
            if len(u) > 1:
                tiers += [
                    cluster.link_between_groups(a, b) for a, b in itertools.combinations(u, 2)
                ]
            else:
                g = cluster.group(u[0])
                tiers.append(_ring_tier(cluster, g, dp, g.domain_gpus // (tp * cp)))
    elif part == "pp_p2p":
        # group-pure pipelines (uneven shares, per-group TP) never cross between groups
        pure = bool(plan.stages[0].microbatches or plan.stages[0].group_tp)
        for s in range(len(used) - 1):
            tiers += [
                _pair_tier(cluster, a, b)
                for a in used[s]
                for b in used[s + 1]
                if not pure or a == b
            ]
    return _slowest(tiers)


def _ordered(breakdown: Sequence[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """The breakdown in the cost model's order (`BREAKDOWN_PARTS`), whatever order it came in
    (a plan read back from JSON has its parts sorted by name)."""
    rank = {k: i for i, k in enumerate(BREAKDOWN_PARTS)}
    return tuple(sorted(breakdown, key=lambda kv: rank.get(kv[0], len(rank))))


def _part_name(plan: Plan, part: str, cluster: Cluster) -> str:
    return _PART_NAMES.get(part) or part_link_tier(plan, part, cluster) or part


def _headroom(plan: Plan) -> tuple[int, float]:
    """(min over ranks of capacity - peak, that margin over the tightest rank's capacity)."""
    mem = plan.predicted.memory
    if not mem:
        return 0, 0.0
    return (
        min(m.capacity_bytes - m.peak_bytes for m in mem),
        min((m.capacity_bytes - m.peak_bytes) / m.capacity_bytes for m in mem),
    )


def bottleneck_of(
    plan: Plan, relaxed_fits: bool | None = None, cluster: Cluster | None = None
) -> tuple[str, str, str, bool]:
    """(bottleneck, the largest breakdown part, that part's name, memory_bound) of `plan`.

    `relaxed_fits`: whether the same plan without recomputation and ZeRO-3 fits (None: the plan
    uses neither, or not known). See the module docstring for the definition.
    """
    cluster = cluster or plan.cluster
    part, _ = max(_ordered(plan.predicted.breakdown), key=lambda kv: kv[1])
    largest = _part_name(plan, part, cluster)
    _, fraction = _headroom(plan)
    memory_bound = fraction < MEMORY_HEADROOM_FRACTION or relaxed_fits is False
    on_gpu = part in _ON_GPU_PARTS
    return ("memory" if memory_bound and on_gpu else largest), part, largest, memory_bound


def _relaxed_fits(graph: Graph, cluster: Cluster, plan: Plan) -> bool | None:
    """Whether `plan` fits without its memory savings (recompute none, ZeRO-3 -> ZeRO-2);
    None when it uses neither."""
    p = plan.parallel
    if p.recompute == Recompute.NONE and p.zero != 3:
        return None
    relaxed = dataclasses.replace(p, recompute=Recompute.NONE, zero=min(p.zero or 0, 2))
    try:
        return predict(graph, cluster, relaxed, plan.stages).fits
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/meshplan/whatif`, i.e. `~/.cache/meshplan/whatif` by default."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(root).expanduser() / "meshplan" / "whatif"


# The modules whose code decides a plan: a change to any of them invalidates cached plans even
# while the version number stays the same (development checkouts).
_PLANNING_MODULES = (
    "meshplan.api",
    "meshplan.solver",
    "meshplan.solver_candidates",
    "meshplan.solver_objective",
    "meshplan.solver_bounds",
    "meshplan.solver_screen",
    "meshplan.solver_queue",
    "meshplan.solver_model",
    "meshplan.cost_model.simulate",
    "meshplan.cost_model.pricer",
    "meshplan.cost_model.dp_traffic",
    "meshplan.cost_model.graph_costs",
    "meshplan.cost_model.compute",
    "meshplan.cost_model.features",
    "meshplan.cost_model.collectives",
    "meshplan.cost_model.memory",
    "meshplan.cost_model.engine",
    "meshplan.cost_model.recompute",
    "meshplan.cost_model.compression",
    "meshplan.passes.partition",
    "meshplan.passes.sharding",
)


@functools.cache
def _code_fingerprint() -> str:
    h = hashlib.sha256()
    for name in _PLANNING_MODULES:
        path = getattr(importlib.import_module(name), "__file__", None)
        if path and os.path.exists(path):
            h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def _planning_fingerprint(cluster: Cluster) -> str:
    """The cluster's fingerprint without what cannot change a plan (prices, the name)."""
    groups = tuple(dataclasses.replace(g, price_per_gpu_hour=None) for g in cluster.groups)
    return dataclasses.replace(cluster, name="", groups=groups).fingerprint()


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """A cache entry: the plan, or why there is none."""

    plan: Plan | None
    reason: str = ""
    relaxed_fits: bool | None = None


class PlanCache:
    """Plans (or infeasibility reasons) on disk, one JSON file per key; `directory=None`
    disables it. Unreadable entries are misses. Writes are atomic (temp file + rename)."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(
        graph_fingerprint: str,
        cluster: Cluster,
        pinned: Parallel,
        global_batch: int,
        time_limit_s: float,
    ) -> str:
        fields = {
            "graph": graph_fingerprint,
            "cluster": _planning_fingerprint(cluster),
            "pinned": {k: str(v) for k, v in pinned.pinned().items() if k != "global_batch"},
            "global_batch": global_batch,
            "time_limit_s": time_limit_s,
            "meshplan": __version__,
            "code": _code_fingerprint(),
            "host_s": default_node_s(),  # MESHPLAN_HOST_US changes the prices
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{key}.json"

    def get(self, key: str) -> CachedPlan | None:
        if self.directory is None:
            return None
        try:
            data = json.loads(self._path(key).read_text())
            if data.get("version") != CACHE_VERSION:
                raise ValueError("old cache entry")
            plan = plan_from_dict(data["plan"]) if data.get("plan") is not None else None
            got = CachedPlan(plan, str(data.get("reason", "")), data.get("relaxed_fits"))
        except (OSError, ValueError, KeyError, TypeError):
            self.misses += 1
            return None
        self.hits += 1
        return got

    def put(self, key: str, entry: CachedPlan) -> None:
        if self.directory is None:
            return
        data = {
            "version": CACHE_VERSION,
            "plan": entry.plan.to_dict() if entry.plan is not None else None,
            "reason": entry.reason,
            "relaxed_fits": entry.relaxed_fits,
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _plan_point(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    global_batch: int,
    time_limit_s: float,
    cache: PlanCache,
    graph_fingerprint: str,
) -> CachedPlan:
    key = PlanCache.key(graph_fingerprint, cluster, pinned, global_batch, time_limit_s)
    got = cache.get(key)
    if got is not None:
        return got
    try:
        plan = api.plan(
            graph,
            cluster=cluster,
            parallel=pinned,
            global_batch=global_batch,
            time_limit_s=time_limit_s,
        )
    except ValueError as e:  # InfeasibleError, a pin that does not divide, ...
        entry = CachedPlan(None, _one_line(e))
    else:
        entry = CachedPlan(plan, "", _relaxed_fits(graph, cluster, plan))
    cache.put(key, entry)
    return entry


def _price(g: DeviceGroup, prices: Mapping[str, float]) -> float | None:
    for value in (prices.get(g.gpu.name), g.price_per_gpu_hour):
        if value is not None:
            return float(value)
    return EXAMPLE_PRICE_PER_GPU_HOUR.get(g.gpu.name)


def _parallel_summary(p: Parallel, group_tp: tuple[tuple[str, int], ...] = ()) -> str:
    tp = "tp" + "/".join(f"{g}:{t}" for g, t in group_tp) if group_tp else f"tp{p.tp}"
    words = [f"dp{p.dp}", tp, f"pp{p.pp}"]
    words += [f"{k}{v}" for k, v in (("cp", p.cp), ("ep", p.ep)) if (v or 1) > 1]
    words += [f"mb{p.micro_batch}", f"ZeRO-{p.zero}"]
    if p.recompute and p.recompute != Recompute.NONE:
        words.append(f"rc={p.recompute}")  # activation recomputation
    return " ".join(words)


def _record(
    point: Point,
    cluster: Cluster,
    entry: CachedPlan,
    tokens: float | None,
    prices: Mapping[str, float],
) -> WhatIfRecord:
    settings = tuple((a, text) for a, _, text in point.settings)
    types = tuple(dict.fromkeys(g.gpu.name for g in cluster.groups))
    base = WhatIfRecord(
        label=point.label,
        cluster=cluster.name,
        gpus=cluster.world_size,
        gpu_types=types,
        feasible=False,
        reason=entry.reason,
        settings=settings,
    )
    plan = entry.plan
    if plan is None:
        return base
    pr = plan.predicted
    group_prices = [_price(g, prices) for g in cluster.groups]
    per_hour = None
    if all(x is not None for x in group_prices):
        per_hour = sum(g.num_gpus * (x or 0.0) for g, x in zip(cluster.groups, group_prices))
    rate = pr.tokens_per_s
    train = tokens / rate if tokens and rate > 0 else None
    headroom, fraction = _headroom(plan)
    bottleneck, part, largest, memory_bound = bottleneck_of(plan, entry.relaxed_fits, cluster)
    return dataclasses.replace(
        base,
        feasible=True,
        parallel=_parallel_summary(plan.parallel, plan.stages[0].group_tp),
        gpus_used=plan.world_size,
        tokens_per_s=rate,
        mfu=pr.mfu,
        step_time_s=pr.step_time_s,
        tokens=tokens,
        train_time_s=train,
        cost_usd=per_hour * train / 3600 if per_hour is not None and train is not None else None,
        usd_per_hour=per_hour,
        usd_per_mtok=per_hour / (rate * 3600) * 1e6 if per_hour is not None and rate > 0 else None,
        headroom_bytes=headroom,
        headroom_fraction=fraction,
        bottleneck=bottleneck,
        bottleneck_part=part,
        time_bottleneck=largest,
        memory_bound=memory_bound,
        breakdown=_ordered(pr.breakdown),
    )


def _failed(point: Point, gpus: int | None, reason: str) -> WhatIfRecord:
    n = point.setting("gpus")
    types: tuple[str, ...] = ()
    if isinstance(point.base, MixSpec):
        types = tuple(gpu_spec(t).name for t in point.base.types)
    if point.setting("gpu") is not None:
        types = (str(point.setting("gpu")),)
    return WhatIfRecord(
        label=point.label,
        cluster="",
        gpus=int(n if n is not None else gpus or 0),  # type: ignore[call-overload]
        gpu_types=types,
        feasible=False,
        reason=reason,
        settings=tuple((a, text) for a, _, text in point.settings),
    )


def whatif(
    model: torch.nn.Module | Graph,
    example_inputs: tuple | torch.Tensor | None = (),
    *,
    clusters: Sequence[Cluster | str] | None = None,
    base: Cluster | str | None = None,
    gpus: int | None = None,
    vary: Mapping[str, Sequence[object]] | None = None,
    mix: str | Sequence[Mapping[str, float]] | None = None,
    global_batch: int | None = None,
    parallel: Parallel | None = None,
    tokens: float | str | None = None,
    prices: Mapping[str, float] | None = None,
    time_limit_s: float = 10.0,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    progress: SweepProgress = None,
) -> list[WhatIfRecord]:
    """The best plan for each configuration of a sweep, as records (one per configuration,
    in sweep order; see the module docstring for axes, cost, bottleneck and caching).

    `clusters` (several bases) or `base` (one; default preset `dgx-h100`): presets, GPU types,
    cluster files or `Cluster` objects; `gpus` sizes presets. `vary`: {axis: values} over
    `AXES` (bandwidths as "400Gbps" strings or bytes/s numbers), a cartesian product. `mix`:
    "H100:A100=1:3,1:1" or [{"H100": 1, "A100": 3}, ...], mixed clusters of `gpus` GPUs (instead
    of `clusters`/`base`). `global_batch` (sequences per step; default from the sequence length)
    and `parallel` (pinned fields) hold for every point. `tokens` ("1T", "300B", 1e12) prices a
    training run; `prices` maps GPU types to $ per GPU-hour. `progress(done, total, label)` is
    called before each point and once at the end.
    """
    if clusters is not None and base is not None:
        raise ValueError("give clusters=[...] or base=..., not both")
    bases: list[Base]
    if mix is not None:
        if clusters is not None or base is not None:
            raise ValueError("mix builds its own clusters; leave out clusters= and base=")
        bases = list(parse_mix(mix))
    elif clusters is not None:
        if not clusters:
            raise ValueError("clusters is empty")
        bases = list(clusters)
    else:
        bases = [base if base is not None else "dgx-h100"]
    # A cluster file is read once, not once per point.
    bases = [
        resolve_cluster(b)
        if isinstance(b, str) and b.lower().endswith((".yaml", ".yml", ".json"))
        else b
        for b in bases
    ]
    points = sweep_points(bases, vary)
    n_tokens = parse_tokens(tokens) if tokens is not None else None
    price_map = {_gpu_key(k): float(v) for k, v in (prices or {}).items()}
    graph = api.as_graph(model, example_inputs)
    pinned = parallel or Parallel()
    if global_batch is not None and pinned.global_batch not in (None, global_batch):
        raise ValueError(
            f"global_batch={global_batch} conflicts with parallel.global_batch="
            f"{pinned.global_batch}"
        )
    # One batch for every point (by model size, not per cluster), so points compare alike.
    gb = (
        global_batch
        or pinned.global_batch
        or api.default_global_batch(graph.info.seq_len or 1, params=graph.num_params())
    )
    pinned = dataclasses.replace(pinned, global_batch=gb)
    cache = PlanCache((cache_dir or default_cache_dir()) if use_cache else None)
    fingerprint = graph.fingerprint()
    records = []
    for i, point in enumerate(points):
        if progress:
            progress(i, len(points), point.label)
        try:
            cluster = build_cluster(point, gpus)
        except ValueError as e:
            records.append(_failed(point, gpus, _one_line(e)))
            continue
        entry = _plan_point(graph, cluster, pinned, gb, time_limit_s, cache, fingerprint)
        records.append(_record(point, cluster, entry, n_tokens, price_map))
    if progress:
        progress(len(points), len(points), "done")
    return records


# ---------------------------------------------------------------------------------------------
# Output: table, CSV, JSON, plot
# ---------------------------------------------------------------------------------------------


def pareto_front(records: Sequence[WhatIfRecord]) -> list[WhatIfRecord]:
    """Feasible, priced records no other record beats on both throughput (higher) and cost per
    token (lower), cheapest first."""
    priced = [r for r in records if r.feasible and r.usd_per_mtok is not None and r.tokens_per_s]
    priced.sort(key=lambda r: (r.usd_per_mtok, -(r.tokens_per_s or 0)))
    front, best = [], -math.inf
    for r in priced:
        if (r.tokens_per_s or 0) > best:
            front.append(r)
            best = r.tokens_per_s or 0
    return front


def _frontier_ids(records: Sequence[WhatIfRecord]) -> set[int]:
    return {id(r) for r in pareto_front(records)}


def records_to_json(records: Sequence[WhatIfRecord]) -> str:
    """A JSON list of `WhatIfRecord.to_dict()` with `pareto` (on the frontier) added."""
    front = _frontier_ids(records)
    rows = [{**r.to_dict(), "pareto": id(r) in front} for r in records]
    return json.dumps(rows, indent=2) + "\n"


# The record's fields in order (breakdown gets one column per part), then `pareto`.
_CSV_FIELDS = (
    *(f.name for f in dataclasses.fields(WhatIfRecord) if f.name != "breakdown"),
    "pareto",
)


def records_to_csv(records: Sequence[WhatIfRecord]) -> str:
    """CSV with a header: the record fields (gpu_types and settings `;`-joined, empty for
    None) and one `<part>_s` column per step-time breakdown part."""
    front = _frontier_ids(records)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*_CSV_FIELDS, *(f"{p}_s" for p in BREAKDOWN_PARTS)])
    for r in records:
        d = r.to_dict()
        d["gpu_types"] = ";".join(r.gpu_types)
        d["settings"] = ";".join(f"{k}={v}" for k, v in r.settings)
        d["pareto"] = id(r) in front
        parts = dict(r.breakdown)
        row = ["" if d[k] is None else d[k] for k in _CSV_FIELDS]
        row += ["" if p not in parts else parts[p] for p in BREAKDOWN_PARTS]
        w.writerow(row)
    return buf.getvalue()


def _si(x: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _count(x: float) -> str:
    """A token count as people say it: 300B, 1T, 1.5M."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _duration(s: float) -> str:
    for scale, unit in ((86400 * 365, "y"), (86400, "d"), (3600, "h"), (60, "min")):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s:.3g} s"


def _money(x: float) -> str:
    if x >= 1e4:
        return "$" + _si(x)
    if x >= 100:
        return f"${x:,.0f}"
    return f"${x:.2f}" if x >= 1 else f"${x:#.3g}"


def _bottleneck_cell(r: WhatIfRecord) -> str:
    """The bottleneck with the traffic behind a link tier ("ib-ndr (dp)"); for a memory-bound
    plan also the largest step-time part ("memory (step: compute)") or the memory pressure
    behind a link-bound one ("wan-10g (dp) + memory")."""
    traffic = {
        "tp_comm": "tp",
        "cp_comm": "cp",
        "ep_comm": "ep",
        "pp_p2p": "pp",
        "dp_comm_exposed": "dp",
    }.get(r.bottleneck_part)
    if r.bottleneck == "memory":
        return "memory" if r.time_bottleneck == "memory" else f"memory (step: {r.time_bottleneck})"
    cell = f"{r.bottleneck} ({traffic})" if traffic else r.bottleneck
    return f"{cell} + memory" if r.memory_bound else cell


def records_table(records: Sequence[WhatIfRecord]):
    """A rich Table of the records (Pareto-optimal rows marked with *)."""
    from rich.markup import escape
    from rich.table import Table

    front = _frontier_ids(records)
    tokens = next((r.tokens for r in records if r.tokens), None)
    has_run = tokens is not None
    run = f" ({_count(tokens)} tokens)" if tokens is not None else ""
    t = Table(title=f"what-if: best plan per configuration{run}", title_justify="left")
    cols = ["configuration", "GPUs", "plan", "tokens/s", "MFU", "step"]
    cols += ["train time", "cost"] if has_run else []
    cols += ["$/1M tok", "headroom", "bottleneck"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("configuration", "plan", "bottleneck") else "right")
    for r in records:
        label = ("* " if id(r) in front else "  ") + escape(r.label)
        gpus = str(r.gpus) if r.gpus_used in (None, r.gpus) else f"{r.gpus_used}/{r.gpus}"
        if not r.feasible:
            row = [label, gpus, f"[red]infeasible:[/] {escape(r.reason)}"]
            row += [""] * (len(cols) - 3)
            t.add_row(*row)
            continue
        row = [
            label,
            gpus,
            r.parallel,
            _si(r.tokens_per_s or 0),
            f"{(r.mfu or 0) * 100:.1f}%",
            f"{r.step_time_s:.3g} s",
        ]
        if has_run:
            row += [
                _duration(r.train_time_s) if r.train_time_s is not None else "?",
                _money(r.cost_usd) if r.cost_usd is not None else "?",
            ]
        row += [
            _money(r.usd_per_mtok) if r.usd_per_mtok is not None else "?",
            f"{(r.headroom_bytes or 0) / 2**30:.1f} GiB ({(r.headroom_fraction or 0) * 100:.0f}%)",
            escape(_bottleneck_cell(r)),
        ]
        t.add_row(*row)
    t.caption = (
        "* Pareto-optimal (no other configuration is both faster and cheaper per token). "
        "Cost counts every GPU of the cluster; GPUs used/total where the plan leaves some idle."
    )
    return t


def require_matplotlib() -> None:
    """Raise ImportError with a one-line install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib: pip install 'meshplan[plot]' (or pip install matplotlib)"
        ) from None


_PLOT_SUFFIXES = (".png", ".svg", ".pdf")
_PART_COLORS = {
    "compute": "#4c72b0",
    "host": "#64b5cd",
    "recompute": "#8172b3",
    "tp_comm": "#dd8452",
    "cp_comm": "#da8bc3",
    "ep_comm": "#937860",
    "pp_p2p": "#55a868",
    "pp_bubble": "#8c8c8c",
    "dp_comm_exposed": "#c44e52",
    "optimizer": "#ccb974",
}


def plot_records(records: Sequence[WhatIfRecord], path: str | os.PathLike) -> Path:
    """Write one figure (PNG, SVG or PDF by the suffix of `path`) with two panels:

    left, throughput (tokens/s) against cost (the `tokens` run's $ when the records price one,
    else $ per 1M tokens), every feasible priced point labelled and the Pareto frontier drawn
    and ringed; right, each configuration's predicted step time as a stacked bar of its
    breakdown (infeasible configurations listed with no bar).
    """
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    out = Path(path)
    if out.suffix.lower() not in _PLOT_SUFFIXES:
        raise ValueError(f"--plot: {out.name}: use a .png, .svg or .pdf file name")
    n = max(1, len(records))
    fig = Figure(figsize=(15, max(4.5, 1.5 + 0.4 * n)), layout="constrained")
    ax_cost, ax_time = fig.subplots(1, 2, width_ratios=(1, 1.2))

    priced = [r for r in records if r.feasible and r.usd_per_mtok is not None and r.tokens_per_s]
    run = all(r.cost_usd is not None for r in priced) and any(r.tokens for r in priced)
    cost_of = (lambda r: r.cost_usd) if run else (lambda r: r.usd_per_mtok)
    if priced:
        front = pareto_front(priced)
        ax_cost.scatter(
            [cost_of(r) for r in priced],
            [r.tokens_per_s for r in priced],
            color="#4c72b0",
            zorder=3,
            label="configuration",
        )
        ax_cost.plot(
            [cost_of(r) for r in front],
            [r.tokens_per_s for r in front],
            color="#c44e52",
            linestyle="--",
            marker="o",
            markersize=11,
            markerfacecolor="none",
            zorder=2,
            label="Pareto frontier",
        )
        for r in priced:
            ax_cost.annotate(
                r.label,
                (cost_of(r), r.tokens_per_s),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=8,
            )
        ax_cost.legend(loc="best", fontsize=8)
        ax_cost.margins(0.15)  # room for the labels
        xs, ys = [cost_of(r) for r in priced], [r.tokens_per_s for r in priced]
        if min(xs) > 0 and max(xs) / min(xs) > 20:
            ax_cost.set_xscale("log")
        if min(ys) > 0 and max(ys) / min(ys) > 20:  # type: ignore[operator]
            ax_cost.set_yscale("log")
    else:
        ax_cost.text(
            0.5,
            0.5,
            "no feasible configuration with a price",
            ha="center",
            va="center",
            transform=ax_cost.transAxes,
        )
    tokens = next((r.tokens for r in priced if r.tokens), None)
    ax_cost.set_xlabel(
        f"cost of {_count(tokens)} tokens ($)" if run and tokens else "$ per 1M tokens"
    )
    ax_cost.set_ylabel("throughput (tokens/s)")
    ax_cost.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _money(v) if v > 0 else "0"))
    ax_cost.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _si(v)))
    ax_cost.set_title("throughput vs cost")
    ax_cost.grid(True, alpha=0.3)

    labels = [r.label for r in records]
    ys = list(range(len(records)))
    left = [0.0] * len(records)
    shown = [p for p in BREAKDOWN_PARTS if any(dict(r.breakdown).get(p, 0) > 0 for r in records)]
    for part in shown:
        widths = [dict(r.breakdown).get(part, 0.0) for r in records]
        ax_time.barh(ys, widths, left=left, color=_PART_COLORS.get(part), label=part)
        left = [a + b for a, b in zip(left, widths)]
    for y, r in zip(ys, records):
        if not r.feasible:
            ax_time.text(
                0, y, f" infeasible: {r.reason[:60]}", va="center", fontsize=8, color="#c44e52"
            )
    ax_time.set_yticks(ys, labels, fontsize=8)
    ax_time.invert_yaxis()
    ax_time.set_xlabel("predicted step time (s)")
    ax_time.set_title("step-time breakdown")
    if shown:
        ax_time.legend(loc="lower right", fontsize=8)
    ax_time.grid(True, axis="x", alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lower().lstrip("."), dpi=120)
    return out
