"""Reading and writing cluster files, and the built-in cluster presets.

A cluster file is YAML (`.yaml`, `.yml`) or JSON (`.json`); the extension decides. Example:

```yaml
name: my-cluster                 # optional; defaults to the file name without extension
links:                           # optional; built-in tiers can be referenced without this
  - {name: ib-fabric, kind: infiniband, bandwidth: 400Gbps, latency: 5us, efficiency: 0.8}
groups:                          # one entry per set of identical nodes
  - name: h100
    gpu: H100                    # a GPU type from the spec table (any alias, any case)
    nodes: 4
    gpus_per_node: 8
    intra_link: nvlink4          # optional for known GPU types (their NVLink / PCIe tier)
    inter_link: ib-fabric  # required when nodes > 1
    nics_per_node: 8             # optional, default 1
    site: dc1                    # optional, default site0
    price_per_gpu_hour: 2.5      # optional, $/GPU-hour, used by `meshplan whatif`
  - name: a100-big
    gpu: {base: A100-40GB, name: A100-40GB-custom, memory_bytes: 40GiB}   # override fields
    nodes: 2
    gpus_per_node: 8
    inter_link: ib-hdr
    site: dc2
group_links:                     # needed between groups at different sites
  - {a: dc1, b: dc2, link: wan-100g}
```

Fields, units and defaults:

- `links[]`: `name`, `kind` (nvlink, pcie, infiniband, roce, ethernet, wan, loopback),
  `bandwidth` (one direction: per GPU for intra-node tiers, per NIC for inter-node tiers, the
  whole link for group links), optional `latency` and `efficiency` (defaults by kind from
  `meshplan.ir.hardware.DEFAULT_LATENCY` / `DEFAULT_EFFICIENCY`). A tier defined here shadows a
  built-in one of the same name.
- Built-in tiers (`meshplan.ir.hardware.known_links()`): nvlink2-5, xgmi-mi250x,
  xgmi-mi300x, pcie4, pcie5, ib-edr, ib-hdr, ib-ndr, ib-xdr, roce-200g, roce-400g, 100gbe,
  25gbe, wan-10g, wan-100g, loopback.
- `groups[].gpu`: a GPU type name, or a mapping with the `GpuSpec` fields (`name`, `base`,
  `peak_flops` {dtype: FLOP/s}, `memory_bytes`, `hbm_bandwidth`, `sms`, `nvlink_bandwidth`,
  `source`). With `base` (or a `name` that is a known type) the mapping overrides that spec;
  `peak_flops`, when given, replaces the whole table. Without one, `peak_flops`,
  `memory_bytes` and `hbm_bandwidth` are required. Give a changed spec a new name.
- `groups[].nvlink_domain`: optional, the GPUs that share `intra_link` when an NVLink switch
  fabric joins several hosts (default: one host's `gpus_per_node`). A GB200 NVL72 rack is
  `gpus_per_node: 4` (a compute tray), `nics_per_node: 4`, `nvlink_domain: 72`: TP, CP, EP and
  DP rings inside 72 GPUs run at NVLink 5 speed and only traffic between racks uses
  `inter_link`. It must be a multiple of `gpus_per_node` and divide the group's GPUs (whole
  racks) or cover them (part of one rack); to train on 16 of a rack's 18 trays write
  `nvlink_domain: 64`. Launching still starts `gpus_per_node` processes per host.
- `group_links[]`: `a` and `b` are two group names or two site names; `link` a tier. A pair of
  groups at different sites must be connected by one. Groups at one site without an entry
  talk over the slower of their inter-node links.
- `profile`: a cluster profile written by `meshplan calibrate` (a path, relative to the
  cluster file, or the profile mapping itself). The measured tiers and GPU types replace the
  datasheet defaults (`Cluster.with_profile`); `meshplan plan/estimate --profile FILE` does the
  same for any cluster or preset.

Units, one convention for everything a person writes in a cluster file:

- A bandwidth or latency carries its unit. Bandwidth: "400Gbps" / "100 Gb/s" / "200Gbit/s"
  (bits per second, as networks are sold) or "50GB/s" / "12.5 GB/s" (bytes per second; also
  MB/s, TB/s, GiB/s). Latency: "5us" / "2 us" / "5 µs", "2ms", "100ns", "1s". A bare number
  is refused, with the field and these forms (`bandwidth: 100` could mean bytes/s or Gb/s,
  `latency: 20` seconds or microseconds); only 0 needs no unit (`latency: 0`,
  `nvlink_bandwidth: 0` for none).
- Where the field names its unit a bare number is that unit: `memory_bytes` ("80GiB", "80GB"
  = 80e9: GB is decimal, the spec table uses GiB; or a number of bytes) and `peak_flops`
  ("989TFLOP/s", "989 TFLOPS" or a number of FLOP/s). Numbers may be written "50e9" (PyYAML
  reads that as a string; it is parsed like any quantity).
- In Python (`parse_bandwidth`, `parse_latency`, `LinkTier`, `GpuSpec`, `Cluster.to_dict()`)
  numbers are SI base units: bytes/s, seconds, bytes, FLOP/s.

Profile files (`load_profile`, `dump_profile`; JSON or YAML, checked against
`PROFILE_SCHEMA`): `version` (1), `source`, `tiers[]` with `tier`, `intra_node`,
`gpus_per_node`, `nics_per_node`, `ranks_per_node` and `curves[]` of `collective`
(all_reduce, all_gather, reduce_scatter, all_to_all, p2p), `ranks` and `points` ([bytes,
seconds] pairs, sizes increasing); `gemm[]` with `gpu`, `dtype`, `m`, `n`, `k`, `seconds`,
`peak_flops`. Errors raise `ProfileError`, one line, as for cluster files.

Errors raise `ClusterError`, one line: `<file>: <field path>: <what is wrong and what to do>`.

`cluster_from_dict` also reads the layout `Cluster.to_dict()` produces (a GPU as a full spec
mapping, `peak_flops` as [dtype, value] pairs, numbers in base units), which plan files embed;
`load_cluster` reads files, whose bandwidths and latencies need units: write a cluster to a
file with `dump_cluster`, which always writes them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema.exceptions
import yaml

from .cluster import (
    PROFILE_COLLECTIVES,
    PROFILE_VERSION,
    READERS,
    Cluster,
    ClusterProfile,
    CodecMeasurement,
    CollectiveCurve,
    DeviceGroup,
    GemmMeasurement,
    GroupLink,
    TierProfile,
)
from .devices import GpuSpec, LinkKind, LinkTier
from .files import write_text_file
from .graph import DTYPE_BYTES
from .hardware import (
    DEFAULT_EFFICIENCY,
    DEFAULT_LATENCY,
    LINK_TIERS,
    UnknownGpuError,
    canonical_gpu_name,
    default_intra_link,
    gpu_spec,
    known_gpus,
    known_links,
    variant_spec,
)

__all__ = [
    "CLUSTER_SCHEMA",
    "EXAMPLE_PRICE_PER_GPU_HOUR",
    "PROFILE_SCHEMA",
    "RACK_SCALE",
    "ClusterError",
    "ProfileError",
    "cluster_from_dict",
    "cluster_to_file_dict",
    "dump_cluster",
    "dump_profile",
    "list_presets",
    "load_cluster",
    "load_profile",
    "profile_from_dict",
    "profile_to_dict",
    "parse_bandwidth",
    "parse_flops",
    "parse_latency",
    "parse_memory",
    "preset_cluster",
    "resolve_cluster",
]

_EXTENSIONS = (".yaml", ".yml", ".json")


class ProfileError(ValueError):
    """A cluster profile file or field that cannot be used (one line: `<file>: <field>:
    <reason>`)."""

    def __init__(self, reason: str, *, source: str | None = None, field: str | None = None):
        self.reason = reason
        self.source = source
        self.field = field
        parts = [p for p in (source, field) if p] + [reason]
        super().__init__(": ".join(parts))


class ClusterError(ValueError):
    """A cluster file, preset or field that cannot be used.

    The message is one line: `<file>: <field path>: <reason>`; `source` (the file, or None for
    presets) and `field` (a path like `groups[1].gpus_per_node`, or None) are kept as attributes
    for callers that want to point at the problem themselves.
    """

    def __init__(self, reason: str, *, source: str | None = None, field: str | None = None):
        self.reason = reason
        self.source = source
        self.field = field
        parts = [p for p in (source, field) if p] + [reason]
        super().__init__(": ".join(parts))


# --------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_QUANTITY = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-zµμ/]*)\s*$")

# Scales as exact decimals so "12.5 GB/s" or "3us" give the correctly rounded float (and the
# same float the hardware tables compute), which keeps dump/load round trips exact.
_BIT = Decimal(1) / Decimal(8)
_SI = {
    "k": Decimal("1e3"),
    "K": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
}
_BANDWIDTH_UNITS: dict[str, Decimal] = {
    "": Decimal(1),
    "B/s": Decimal(1),
    "Bps": Decimal(1),
    **{f"{p}B/s": scale for p, scale in _SI.items()},
    **{f"{p}Bps": scale for p, scale in _SI.items()},
    **{f"{p}iB/s": Decimal(2) ** e for p, e in (("K", 10), ("M", 20), ("G", 30), ("T", 40))},
    "bps": _BIT,
    "b/s": _BIT,
    **{f"{p}{bits}": scale * _BIT for p, scale in _SI.items() for bits in ("bps", "b/s", "bit/s")},
}
_LATENCY_UNITS: dict[str, Decimal] = {
    "": Decimal(1),
    "s": Decimal(1),
    "ms": Decimal("1e-3"),
    "us": Decimal("1e-6"),
    "µs": Decimal("1e-6"),  # micro sign
    "μs": Decimal("1e-6"),  # Greek mu
    "ns": Decimal("1e-9"),
}
_MEMORY_UNITS: dict[str, Decimal] = {
    "": Decimal(1),
    "B": Decimal(1),
    "KB": Decimal("1e3"),
    "kB": Decimal("1e3"),
    "MB": Decimal("1e6"),
    "GB": Decimal("1e9"),
    "TB": Decimal("1e12"),
    "KiB": Decimal(2) ** 10,
    "MiB": Decimal(2) ** 20,
    "GiB": Decimal(2) ** 30,
    "TiB": Decimal(2) ** 40,
}
# FLOP/s units are matched case-insensitively ("TFLOPS", "TFLOP/s", "tflops").
_FLOPS_UNITS: dict[str, Decimal] = {
    f"{p}{suffix}": Decimal(s)
    for p, s in (("", "1"), ("g", "1e9"), ("t", "1e12"), ("p", "1e15"))
    for suffix in ("flop/s", "flops")
}
_FLOPS_UNITS[""] = Decimal(1)


def _parse_quantity(
    value: object, units: Mapping[str, Decimal], what: str, *, fold_case: bool = False
) -> Decimal:
    """`value` (a number, or a string with one of `units`) as an exact Decimal in base units."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
        return _finite(exact, value, what)
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match:
            unit = match.group(2).lower() if fold_case else match.group(2)
            if unit in units:
                try:
                    return Decimal(match.group(1)) * units[unit]
                except InvalidOperation:  # pragma: no cover - the regex admits valid numbers
                    pass
    raise ValueError(f"must be {what}, got {value!r}")


def _finite(value: Decimal, original: object, what: str) -> Decimal:
    if not value.is_finite():  # YAML's .inf / .nan are floats too
        raise ValueError(f"must be {what}, got {original!r}")
    return value


_BANDWIDTH_WHAT = "a bandwidth like '400Gbps', '100 Gb/s' or '25 GB/s'"
_LATENCY_WHAT = "a latency like '5us', '2 ms' or '100ns'"
# What a file must write instead of a bare number (the one-line refusal names the field).
_BANDWIDTH_FORMS = (
    "write it with its unit, e.g. '100 Gb/s' or '400Gbps' (bits per second, as networks are "
    "sold) or '25 GB/s' (bytes per second; also MB/s, TB/s, GiB/s)"
)
_LATENCY_FORMS = "write it with its unit, e.g. '2 us', '5ms', '100ns' or '1s'"
_MEMORY_WHAT = "a memory size like '80GiB', '96GB' or a number of bytes"
_FLOPS_WHAT = "a rate like '989TFLOP/s' or a number of FLOP/s"


def _is_bare(value: object) -> bool:
    """A number without a unit: an int or float, or a string such as "50e9" (PyYAML reads
    50e9 as a string)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    return bool(match) and not match.group(2)


def _refuse_bare(value: object, forms: str, ambiguity: str) -> None:
    """ValueError for a bare nonzero number where a unit is required (zero needs none)."""
    if _is_bare(value) and float(value) != 0:  # type: ignore[arg-type]
        raise ValueError(f"a bare number is ambiguous ({value!r}: {ambiguity}); {forms}")


def parse_bandwidth(value: object, *, unit_required: bool = False) -> float:
    """Bytes per second from "400Gbps" / "100 Gb/s" (bits), "50GB/s", "12.5 GB/s", "1GiB/s",
    or (Python callers: SI base unit) a number of bytes/s. `unit_required` (cluster files)
    refuses a bare number, naming the accepted forms. Must be positive; raises ValueError
    saying what is accepted."""
    if unit_required:
        _refuse_bare(value, _BANDWIDTH_FORMS, "bytes/s? Gb/s?")
    out = float(_parse_quantity(value, _BANDWIDTH_UNITS, _BANDWIDTH_WHAT))
    if not out > 0:
        raise ValueError(f"must be a positive bandwidth, got {value!r}")
    return out


def parse_latency(value: object, *, unit_required: bool = False) -> float:
    """Seconds from "5us", "2 ms", "100ns", "1s", or (Python callers: SI base unit) a number of
    seconds. `unit_required` (cluster files) refuses a bare number other than 0, naming the
    accepted forms. Must be >= 0."""
    if unit_required:
        _refuse_bare(value, _LATENCY_FORMS, "seconds? microseconds?")
    out = float(_parse_quantity(value, _LATENCY_UNITS, _LATENCY_WHAT))
    if out < 0:
        raise ValueError(f"must be a non-negative latency, got {value!r}")
    return out


def parse_memory(value: object) -> int:
    """Bytes from "80GiB", "96GB" (decimal: 96e9), "512MiB" or a number of bytes. Must be a
    positive whole number of bytes."""
    out = _parse_quantity(value, _MEMORY_UNITS, _MEMORY_WHAT)
    if out <= 0 or out != out.to_integral_value():
        raise ValueError(f"must be a positive whole number of bytes, got {value!r}")
    return int(out)


def parse_flops(value: object) -> float:
    """FLOP/s from "989TFLOP/s", "989 TFLOPS", "2.25PFLOP/s" or a number. Must be positive."""
    out = float(_parse_quantity(value, _FLOPS_UNITS, _FLOPS_WHAT, fold_case=True))
    if not out > 0:
        raise ValueError(f"must be a positive FLOP/s rate, got {value!r}")
    return out


def _human(
    value: float,
    parse: Callable[[str], float],
    units: Sequence[tuple[str, Decimal]],
    base_unit: str | None = None,
):
    """The shortest "<number><unit>" string that parses back to exactly `value`, else (when
    no unit gives a short one) the exact number in `base_unit`, or the bare number when there
    is none (dumped files stay readable without losing a bit)."""
    best: str | None = None
    for unit, scale in units:
        digits = format((Decimal(repr(float(value))) / scale).normalize(), "f")
        if len(digits) > 12:
            continue
        text = f"{digits}{unit}"
        try:
            if parse(text) == value and (best is None or len(text) < len(best)):
                best = text
        except ValueError:
            continue
    if best is None and base_unit is not None:
        best = format(Decimal(repr(float(value))).normalize(), "f") + base_unit
    return best if best is not None else value


_NETWORK_KINDS = (LinkKind.INFINIBAND, LinkKind.ROCE, LinkKind.ETHERNET, LinkKind.WAN)


def _human_bandwidth(value: float, kind: LinkKind | None = None):
    # Networks are sold in bits per second, GPU links and memory in bytes per second.
    if kind in _NETWORK_KINDS:
        units = [("Gbps", _BANDWIDTH_UNITS["Gbps"]), ("Mbps", _BANDWIDTH_UNITS["Mbps"])]
    else:
        units = [("GB/s", _BANDWIDTH_UNITS["GB/s"]), ("MB/s", _BANDWIDTH_UNITS["MB/s"])]
    return _human(value, parse_bandwidth, units, base_unit="B/s")


def _human_latency(value: float):
    units = [(u, _LATENCY_UNITS[u]) for u in ("s", "ms", "us", "ns")]
    return _human(value, parse_latency, units, base_unit="s") if value > 0 else 0


def _human_memory(value: int):
    units = [(u, _MEMORY_UNITS[u]) for u in ("GiB", "MiB", "GB", "MB")]
    return _human(value, lambda s: float(parse_memory(s)), units)


def _human_flops(value: float):
    return _human(value, parse_flops, [("TFLOP/s", Decimal("1e12"))])


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------
# Each leaf's "description" is the phrase error messages use: "must be <description>, got X".
# Quantities are number-or-string here and parsed (with their own messages) afterwards.


def _quantity(what: str) -> dict:
    return {"type": ["number", "string"], "description": what}


_NAME = {"type": "string", "minLength": 1, "description": "a non-empty string"}
_POSITIVE_INT = {"type": "integer", "minimum": 1, "description": "a positive integer"}

_GPU_SCHEMA: dict = {
    # A string (type name) or a mapping of GpuSpec fields; object keywords apply to mappings.
    "type": ["string", "object"],
    "minLength": 1,
    "description": "a GPU type name (e.g. H100) or a mapping of GPU spec fields",
    "properties": {
        "name": _NAME,
        "base": _NAME,
        "peak_flops": {
            "type": ["object", "array"],
            "minProperties": 1,
            "minItems": 1,
            "description": "a mapping of dtype to FLOP/s, e.g. {bfloat16: 989TFLOP/s}",
            "additionalProperties": _quantity(_FLOPS_WHAT),
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "prefixItems": [
                    {"type": "string", "description": "a dtype name"},
                    _quantity(_FLOPS_WHAT),
                ],
                "description": "a [dtype, FLOP/s] pair",
            },
        },
        "memory_bytes": _quantity(_MEMORY_WHAT),
        "hbm_bandwidth": _quantity(_BANDWIDTH_WHAT),
        "sms": {"type": "integer", "minimum": 0, "description": "a non-negative integer"},
        "nvlink_bandwidth": _quantity(_BANDWIDTH_WHAT + " (0 for none)"),
        "source": {"type": "string", "description": "a string"},
        "gemm_efficiency": {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": "a positive fraction of the dense peak (measured by calibrate)",
        },
        "codec_speed": {
            "type": "array",
            "items": {"type": "number", "minimum": 0},
            "minItems": 4,
            "maxItems": 4,
            "description": "[compress B/s, decompress B/s, compress s/call, decompress s/call]"
            " (measured by calibrate)",
        },
    },
    "additionalProperties": False,
}

_LINK_SCHEMA: dict = {
    "type": "object",
    "description": "a mapping with name, kind and bandwidth",
    "required": ["name", "kind", "bandwidth"],
    "properties": {
        "name": _NAME,
        "kind": {"enum": [k.value for k in LinkKind]},
        "bandwidth": _quantity(_BANDWIDTH_WHAT),
        "latency": _quantity(_LATENCY_WHAT),
        "efficiency": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "description": "a fraction in (0, 1]",
        },
    },
    "additionalProperties": False,
}

_GROUP_SCHEMA: dict = {
    "type": "object",
    "description": "a mapping with name, gpu, nodes and gpus_per_node",
    "required": ["name", "gpu", "nodes", "gpus_per_node"],
    "properties": {
        "name": _NAME,
        "gpu": _GPU_SCHEMA,
        "nodes": _POSITIVE_INT,
        "gpus_per_node": _POSITIVE_INT,
        "intra_link": _NAME,
        # "" is what Cluster.to_dict() writes for a single-node group.
        "inter_link": {"type": "string", "description": "a link tier name"},
        "nics_per_node": _POSITIVE_INT,
        "nvlink_domain": _POSITIVE_INT,
        "site": _NAME,
        "price_per_gpu_hour": {
            "type": ["number", "null"],
            "minimum": 0,
            "description": "a non-negative price in $ per GPU-hour",
        },
    },
    "additionalProperties": False,
}

_GROUP_LINK_SCHEMA: dict = {
    "type": "object",
    "description": "a mapping with a, b and link",
    "required": ["a", "b", "link"],
    "properties": {"a": _NAME, "b": _NAME, "link": _NAME},
    "additionalProperties": False,
}

CLUSTER_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "meshplan cluster",
    "type": "object",
    "description": "a mapping with at least a 'groups' list",
    "required": ["groups"],
    "properties": {
        "name": _NAME,
        "links": {"type": "array", "items": _LINK_SCHEMA, "description": "a list of links"},
        "groups": {
            "type": "array",
            "minItems": 1,
            "items": _GROUP_SCHEMA,
            "description": "a non-empty list of device groups",
        },
        "group_links": {
            "type": "array",
            "items": _GROUP_LINK_SCHEMA,
            "description": "a list of group links",
        },
        "profile": {
            "type": ["string", "object"],
            "minLength": 1,
            "description": "a cluster profile file (from `meshplan calibrate`) or its contents",
        },
    },
    "additionalProperties": False,
}

_VALIDATOR = jsonschema.Draft202012Validator(CLUSTER_SCHEMA)

_COUNT = {"type": "integer", "minimum": 1, "description": "a positive integer"}
_CURVE_SCHEMA: dict = {
    "type": "object",
    "description": "a mapping with collective, ranks and points",
    "required": ["collective", "ranks", "points"],
    "properties": {
        "collective": {"enum": list(PROFILE_COLLECTIVES)},
        "ranks": {"type": "integer", "minimum": 2, "description": "an integer >= 2"},
        "points": {
            "type": "array",
            "minItems": 1,
            "description": "a non-empty list of [bytes, seconds] pairs",
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "description": "a [bytes, seconds] pair",
                "prefixItems": [
                    {"type": "integer", "minimum": 1, "description": "a positive byte count"},
                    {"type": "number", "exclusiveMinimum": 0, "description": "positive seconds"},
                ],
            },
        },
    },
    "additionalProperties": False,
}
_TIER_PROFILE_SCHEMA: dict = {
    "type": "object",
    "description": "a mapping with tier, intra_node, per-node counts and curves",
    "required": ["tier", "intra_node", "gpus_per_node", "nics_per_node", "ranks_per_node"],
    "properties": {
        "tier": _NAME,
        "intra_node": {"type": "boolean", "description": "true or false"},
        "gpus_per_node": _COUNT,
        "nics_per_node": _COUNT,
        "ranks_per_node": _COUNT,
        "curves": {
            "type": "array",
            "minItems": 1,
            "items": _CURVE_SCHEMA,
            "description": "a non-empty list of curves",
        },
    },
    "additionalProperties": False,
}
_GEMM_SCHEMA: dict = {
    "type": "object",
    "description": "a mapping with gpu, dtype, m, n, k, seconds and peak_flops",
    "required": ["gpu", "dtype", "m", "n", "k", "seconds", "peak_flops"],
    "properties": {
        "gpu": _NAME,
        "dtype": {"enum": sorted(DTYPE_BYTES)},
        "m": _COUNT,
        "n": _COUNT,
        "k": _COUNT,
        "seconds": {"type": "number", "exclusiveMinimum": 0, "description": "positive seconds"},
        "peak_flops": {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": "a positive FLOP/s rate",
        },
    },
    "additionalProperties": False,
}
_CODEC_SCHEMA: dict = {
    "type": "object",
    "description": "a mapping with gpu, dtype, compress_bps, decompress_bps and per-call times",
    "required": [
        "gpu",
        "dtype",
        "compress_bps",
        "decompress_bps",
        "compress_call_s",
        "decompress_call_s",
    ],
    "properties": {
        "gpu": _NAME,
        "dtype": {"enum": sorted(DTYPE_BYTES)},
        "compress_bps": {"type": "number", "exclusiveMinimum": 0, "description": "bytes/s"},
        "decompress_bps": {"type": "number", "exclusiveMinimum": 0, "description": "bytes/s"},
        "compress_call_s": {"type": "number", "minimum": 0, "description": "seconds"},
        "decompress_call_s": {"type": "number", "minimum": 0, "description": "seconds"},
    },
    "additionalProperties": False,
}
PROFILE_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "meshplan cluster profile",
    "type": "object",
    "description": "a mapping with version, tiers and gemm",
    "required": ["version"],
    "properties": {
        "version": {"const": PROFILE_VERSION, "description": f"{PROFILE_VERSION}"},
        "source": {"type": "string", "description": "a string"},
        "tiers": {"type": "array", "items": _TIER_PROFILE_SCHEMA, "description": "a list"},
        "gemm": {"type": "array", "items": _GEMM_SCHEMA, "description": "a list"},
        "codec": {"type": "array", "items": _CODEC_SCHEMA, "description": "a list"},
    },
    "additionalProperties": False,
}
_PROFILE_VALIDATOR = jsonschema.Draft202012Validator(PROFILE_SCHEMA)


def _path(parts: Iterable[object]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _schema_error(err: jsonschema.exceptions.ValidationError) -> tuple[str, str]:
    """(field path, reason) for the first schema violation, phrased for a person."""
    where = list(err.absolute_path)
    kind, schema, instance = err.validator, err.schema, err.instance
    if kind == "required":
        missing = [k for k in err.validator_value if k not in instance]
        return _path(where), f"missing required field {missing[0]!r}"
    if kind == "additionalProperties":
        allowed = list(schema.get("properties", {}))
        extra = min(k for k in instance if k not in allowed)
        close = difflib.get_close_matches(str(extra), allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return _path([*where, extra]), f"unknown field; {hint}allowed: {', '.join(allowed)}"
    if kind == "enum":
        choices = ", ".join(str(c) for c in err.validator_value)
        return _path(where), f"must be one of {choices}, got {_short(instance)}"
    if "description" in schema:
        return _path(where), f"must be {schema['description']}, got {_short(instance)}"
    return _path(where), err.message  # pragma: no cover - every leaf has a description


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Read and validate a cluster file (YAML or JSON, by extension).

    Raises `ClusterError` with a one-line message naming the file, the field and the fix.
    """
    source = str(path)
    file = Path(path)
    if file.suffix.lower() not in _EXTENSIONS:
        raise ClusterError(
            f"unknown extension {file.suffix or '(none)'!r}; cluster files end in "
            f"{', '.join(_EXTENSIONS)}",
            source=source,
        )
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClusterError(
            "no such file; give a YAML/JSON cluster file or a preset name "
            f"({', '.join(name for name, _ in _PRESETS.items())})",
            source=source,
        ) from None
    except OSError as e:
        raise ClusterError(f"cannot read: {e.strerror or e}", source=source) from None
    try:
        data = json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        reason = " ".join(str(e).split())  # one line, whatever the parser printed
        raise ClusterError(
            f"not valid {file.suffix[1:].upper()}: {reason}", source=source
        ) from None
    return cluster_from_dict(
        data, source=source, default_name=file.stem, base_dir=file.parent, units_required=True
    )


def cluster_from_dict(
    data: object,
    *,
    source: str = "<dict>",
    default_name: str = "cluster",
    base_dir: str | os.PathLike[str] | None = None,
    units_required: bool = False,
) -> Cluster:
    """Validate and build a cluster from the parsed contents of a cluster file.

    `source` names the origin in error messages; `default_name` is used when the data has no
    `name`; a `profile` given as a relative path is read from `base_dir` (default: the
    current directory). `units_required` (what `load_cluster` reads: text a person wrote)
    refuses bandwidths and latencies written as bare numbers; without it numbers are SI base
    units, as `Cluster.to_dict()` writes them (plan files embed that layout).
    """
    bandwidth_of = functools.partial(parse_bandwidth, unit_required=units_required)
    latency_of = functools.partial(parse_latency, unit_required=units_required)
    errors = list(_VALIDATOR.iter_errors(data))
    error = jsonschema.exceptions.best_match(errors)
    if error is not None and error.validator == "required":
        # A misspelt field shows up as "missing X" and "unknown Y" at once; the unknown field
        # (with its did-you-mean) is the more useful report.
        error = next(
            (
                e
                for e in errors
                if e.validator == "additionalProperties" and e.absolute_path == error.absolute_path
            ),
            error,
        )
    if error is not None:
        where, reason = _schema_error(error)
        raise ClusterError(reason, source=source, field=where)
    assert isinstance(data, dict)

    def fail(where: str, reason: str) -> ClusterError:
        return ClusterError(reason, source=source, field=where)

    # Links defined in the file, in file order.
    defined: dict[str, LinkTier] = {}
    for i, raw in enumerate(data.get("links", [])):
        at = f"links[{i}]"
        if raw["name"] in defined:
            raise fail(f"{at}.name", f"duplicate link name {raw['name']!r}")
        kind = LinkKind(raw["kind"])
        bandwidth = _field(raw, "bandwidth", bandwidth_of, at, fail)
        latency = (
            _field(raw, "latency", latency_of, at, fail)
            if "latency" in raw
            else DEFAULT_LATENCY[kind]
        )
        efficiency = float(raw.get("efficiency", DEFAULT_EFFICIENCY[kind]))
        defined[raw["name"]] = LinkTier(raw["name"], kind, bandwidth, latency, efficiency)

    used: dict[str, LinkTier] = dict(defined)

    def resolve_link(name: str, where: str) -> str:
        """The tier's name as the cluster will hold it, adding a built-in tier on first use."""
        if name in used:
            return name
        builtin = LINK_TIERS.get(name.lower())
        if builtin is None:
            options = [*defined, *known_links()]
            close = difflib.get_close_matches(name, options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(
                where,
                f"unknown link {name!r}{hint}; define it under 'links' or use a built-in tier: "
                f"{', '.join(known_links())}",
            )
        used.setdefault(builtin.name, builtin)
        return builtin.name

    groups: list[DeviceGroup] = []
    for i, raw in enumerate(data["groups"]):
        at = f"groups[{i}]"
        if any(g.name == raw["name"] for g in groups):
            raise fail(f"{at}.name", f"duplicate group name {raw['name']!r}")
        gpu, table_type = _resolve_gpu(raw["gpu"], f"{at}.gpu", fail, bandwidth_of)
        if "intra_link" in raw:
            intra = resolve_link(raw["intra_link"], f"{at}.intra_link")
        else:
            if table_type is None:
                raise fail(
                    f"{at}.intra_link",
                    f"required for the custom GPU {gpu.name!r} (e.g. nvlink4, pcie4)",
                )
            intra = resolve_link(default_intra_link(table_type), f"{at}.intra_link")
        inter = raw.get("inter_link", "")
        if inter:
            inter = resolve_link(inter, f"{at}.inter_link")
        elif raw["nodes"] > 1:
            raise fail(
                f"{at}.inter_link",
                f"required when nodes > 1 (got nodes: {raw['nodes']}); name the network "
                "between nodes, e.g. ib-ndr, roce-400g or 100gbe",
            )
        price = raw.get("price_per_gpu_hour")
        domain = raw.get("nvlink_domain")
        try:
            group = DeviceGroup(
                name=raw["name"],
                gpu=gpu,
                nodes=int(raw["nodes"]),
                gpus_per_node=int(raw["gpus_per_node"]),
                intra_link=intra,
                inter_link=inter,
                nics_per_node=int(raw.get("nics_per_node", 1)),
                site=raw.get("site", "site0"),
                price_per_gpu_hour=None if price is None else float(price),
                nvlink_domain=None if domain is None else int(domain),
            )
        except ValueError as e:  # `nvlink_domain_problem`: the check the schema cannot make
            raise fail(f"{at}.nvlink_domain" if domain is not None else at, str(e)) from None
        groups.append(group)

    group_names = {g.name for g in groups}
    sites = {g.site for g in groups}
    group_links: list[GroupLink] = []
    for i, raw in enumerate(data.get("group_links", [])):
        at = f"group_links[{i}]"
        a, b = raw["a"], raw["b"]
        for end in ("a", "b"):
            if raw[end] not in group_names | sites:
                raise fail(
                    f"{at}.{end}",
                    f"{raw[end]!r} is neither a group ({', '.join(sorted(group_names))}) "
                    f"nor a site ({', '.join(sorted(sites))})",
                )
        # Cluster.link_between_groups matches a pair of group names or a pair of site names.
        both_groups = a in group_names and b in group_names and a != b
        both_sites = a in sites and b in sites
        if not (both_groups or both_sites):
            raise fail(at, f"a and b must be two different groups or two sites, got {a!r}, {b!r}")
        group_links.append(GroupLink(a, b, resolve_link(raw["link"], f"{at}.link")))

    _check_sites_connected(groups, group_links, fail)

    try:
        cluster = Cluster(
            name=data.get("name", default_name),
            groups=tuple(groups),
            links=tuple(used.values()),
            group_links=tuple(group_links),
        )
    except ValueError as e:  # pragma: no cover - the checks above run first
        raise fail("(cluster)", str(e)) from None
    if "profile" not in data:
        return cluster
    raw_profile = data["profile"]
    try:
        if isinstance(raw_profile, str):
            file = Path(raw_profile)
            if not file.is_absolute() and base_dir is not None:
                file = Path(base_dir) / file
            profile = load_profile(file)
        else:
            profile = profile_from_dict(raw_profile, source=f"{source}: profile")
    except ProfileError as e:
        raise fail("profile", str(e)) from None
    try:
        return cluster.with_profile(profile)
    except ValueError as e:
        raise fail("profile", str(e)) from None


def _field(raw: Mapping, key: str, parse: Callable[[object], Any], at: str, fail) -> Any:
    try:
        return parse(raw[key])
    except ValueError as e:
        raise fail(f"{at}.{key}", str(e)) from None


def _resolve_gpu(
    value: object, at: str, fail, bandwidth_of: Callable[[object], float] = parse_bandwidth
) -> tuple[GpuSpec, str | None]:
    """A GpuSpec from a type name or a mapping of spec fields (overriding a base spec), and the
    canonical name of the table type it derives from (None for a wholly custom GPU).
    `bandwidth_of` parses its bandwidths (`parse_bandwidth`, units required or not)."""
    if isinstance(value, str):
        try:
            return gpu_spec(value), gpu_spec(value).name
        except UnknownGpuError as e:
            # A measured-only variant (`hardware.VARIANT_SPECS`, e.g. H100-96GB-500W): its
            # spec is known but no node network is, so the group states its links.
            variant = variant_spec(value)
            if variant is not None:
                return variant, None
            raise fail(at, f"{e}; or give a mapping with the spec fields") from None
    assert isinstance(value, dict)
    base: GpuSpec | None = None
    if "base" in value:
        try:
            base = gpu_spec(value["base"])
        except UnknownGpuError as e:
            raise fail(f"{at}.base", str(e)) from None
    elif "name" in value and canonical_gpu_name(value["name"]) is not None:
        base = gpu_spec(value["name"])
    if base is None:
        missing = [
            k for k in ("name", "peak_flops", "memory_bytes", "hbm_bandwidth") if k not in value
        ]
        if missing:
            raise fail(
                at,
                f"a GPU type not in the spec table needs {', '.join(missing)}; or set "
                f"'base' to one of: {', '.join(known_gpus())}",
            )
    fields: dict[str, Any] = (
        {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        if base is not None
        else {"sms": 0, "nvlink_bandwidth": 0.0, "source": ""}
    )
    # The name a spec is filed under: explicit when given with `base`, else canonical.
    if "name" in value and (base is None or "base" in value):
        fields["name"] = value["name"]
    overridden = []
    if "peak_flops" in value:
        raw = value["peak_flops"]
        pairs = list(raw.items()) if isinstance(raw, dict) else [tuple(p) for p in raw]
        table = []
        for j, (dtype, flops) in enumerate(pairs):
            key = f"{at}.peak_flops.{dtype}" if isinstance(raw, dict) else f"{at}.peak_flops[{j}]"
            if dtype not in DTYPE_BYTES and dtype != "tfloat32":
                raise fail(
                    key,
                    f"unknown dtype {dtype!r}; use torch dtype names such as "
                    "bfloat16, float16, float32, float8_e4m3fn, or tfloat32 (TF32 tensor cores)",
                )
            try:
                table.append((dtype, parse_flops(flops)))
            except ValueError as e:
                raise fail(key, str(e)) from None
        fields["peak_flops"] = tuple(table)
        overridden.append("peak_flops")
    for key, parse in (("memory_bytes", parse_memory), ("hbm_bandwidth", bandwidth_of)):
        if key in value:
            fields[key] = _field(value, key, parse, at, fail)
            overridden.append(key)
    if "nvlink_bandwidth" in value:
        raw_bw = value["nvlink_bandwidth"]
        # 0 means "no NVLink" and is allowed here, unlike for a link tier.
        fields["nvlink_bandwidth"] = (
            0.0 if raw_bw in (0, "0") else _field(value, "nvlink_bandwidth", bandwidth_of, at, fail)
        )
        overridden.append("nvlink_bandwidth")
    if "sms" in value:
        fields["sms"] = int(value["sms"])
        overridden.append("sms")
    if "gemm_efficiency" in value:
        fields["gemm_efficiency"] = float(value["gemm_efficiency"])
    if "codec_speed" in value:
        fields["codec_speed"] = tuple(float(x) for x in value["codec_speed"])
    if "source" in value:
        fields["source"] = value["source"]
    elif base is not None and overridden:
        fields["source"] = f"{base.source}; overridden: {', '.join(overridden)}"
    try:
        return GpuSpec(**fields), (base.name if base else None)
    except ValueError as e:
        raise fail(at, str(e)) from None


def _check_sites_connected(
    groups: Sequence[DeviceGroup], group_links: Sequence[GroupLink], fail
) -> None:
    """Every pair of groups at different sites needs a group link (by group or site)."""
    for i, ga in enumerate(groups):
        for gb in groups[i + 1 :]:
            if ga.site == gb.site:
                continue
            pairs = ({ga.name, gb.name}, {ga.site, gb.site})
            if not any({gl.a, gl.b} in pairs for gl in group_links):
                raise fail(
                    "group_links",
                    f"groups {ga.name!r} (site {ga.site}) and {gb.name!r} (site {gb.site}) are "
                    f"at different sites but nothing connects them; add "
                    f"{{a: {ga.site}, b: {gb.site}, link: wan-100g}} (or another tier)",
                )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def cluster_to_file_dict(cluster: Cluster) -> dict:
    """The cluster in cluster-file layout with human units; `load_cluster` of it is equal.

    GPUs identical to the spec table are written by name, others as full spec mappings; every
    link tier is written out, so calibrated numbers survive even where a built-in name is used.
    """
    links = [
        {
            "name": t.name,
            "kind": t.kind.value,
            "bandwidth": _human_bandwidth(t.bandwidth, t.kind),
            "latency": _human_latency(t.latency),
            "efficiency": t.efficiency,
        }
        for t in cluster.links
    ]
    groups = []
    for g in cluster.groups:
        entry: dict[str, Any] = {
            "name": g.name,
            "gpu": _gpu_entry(g.gpu),
            "nodes": g.nodes,
            "gpus_per_node": g.gpus_per_node,
            "intra_link": g.intra_link,
        }
        if g.inter_link:
            entry["inter_link"] = g.inter_link
        entry["nics_per_node"] = g.nics_per_node
        if g.nvlink_domain is not None:
            entry["nvlink_domain"] = g.nvlink_domain
        entry["site"] = g.site
        if g.price_per_gpu_hour is not None:
            entry["price_per_gpu_hour"] = g.price_per_gpu_hour
        groups.append(entry)
    out: dict[str, Any] = {"name": cluster.name, "links": links, "groups": groups}
    if cluster.group_links:
        out["group_links"] = [{"a": gl.a, "b": gl.b, "link": gl.link} for gl in cluster.group_links]
    if cluster.profile is not None:
        out["profile"] = profile_to_dict(cluster.profile)
    return out


def _gpu_entry(spec: GpuSpec) -> str | dict:
    known = canonical_gpu_name(spec.name)
    if known is not None and gpu_spec(known) == spec:
        return spec.name
    if known is None and variant_spec(spec.name) == spec:
        return spec.name
    entry: dict[str, Any] = {"name": spec.name}
    if known is not None:
        # A changed spec filed under a table name: `base` keeps the loader from treating the
        # name as "this table entry" and lets the explicit name through unchanged.
        entry["base"] = known
    entry["peak_flops"] = {dtype: _human_flops(v) for dtype, v in spec.peak_flops}
    entry["memory_bytes"] = _human_memory(spec.memory_bytes)
    entry["hbm_bandwidth"] = _human_bandwidth(spec.hbm_bandwidth)
    entry["sms"] = spec.sms
    entry["nvlink_bandwidth"] = (
        _human_bandwidth(spec.nvlink_bandwidth) if spec.nvlink_bandwidth else 0
    )
    entry["source"] = spec.source
    if spec.gemm_efficiency is not None:
        entry["gemm_efficiency"] = spec.gemm_efficiency
    if spec.codec_speed is not None:
        entry["codec_speed"] = list(spec.codec_speed)
    return entry


def dump_cluster(cluster: Cluster, path: str | os.PathLike[str]) -> None:
    """Write `cluster` as YAML (or JSON for a `.json` path) that `load_cluster` reads back
    equal. The write is atomic: a reader never sees a half-written file."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in _EXTENSIONS:
        raise ClusterError(
            f"unknown extension {file.suffix or '(none)'!r}; use {', '.join(_EXTENSIONS)}",
            source=str(path),
        )
    data = cluster_to_file_dict(cluster)
    if suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        # Links and group links one per line (flow style), groups as blocks: short to scan.
        text = f"# meshplan cluster: {cluster.summary()}\n"
        text += yaml.safe_dump({"name": data["name"]}, sort_keys=False)
        for key in ("links", "groups", "group_links", "profile"):
            if key in data:
                flow = None if key not in ("groups", "profile") else False
                text += yaml.safe_dump(
                    {key: data[key]}, sort_keys=False, default_flow_style=flow, width=120
                )
    write_text_file(file, text)  # atomic; keeps a file's mode, writes through links


# --------------------------------------------------------------------------------------------
# Cluster profiles (`meshplan calibrate`)
# --------------------------------------------------------------------------------------------


def profile_to_dict(profile: ClusterProfile) -> dict:
    """The profile in file layout (what `profile_from_dict` reads back equal)."""
    return {
        "version": profile.version,
        "source": profile.source,
        "tiers": [
            {
                "tier": t.tier,
                "intra_node": t.intra_node,
                "gpus_per_node": t.gpus_per_node,
                "nics_per_node": t.nics_per_node,
                "ranks_per_node": t.ranks_per_node,
                "curves": [
                    {
                        "collective": c.collective,
                        "ranks": c.ranks,
                        "points": [[int(b), float(sec)] for b, sec in c.points],
                    }
                    for c in t.curves
                ],
            }
            for t in profile.tiers
        ],
        "gemm": [
            {
                "gpu": g.gpu,
                "dtype": g.dtype,
                "m": g.m,
                "n": g.n,
                "k": g.k,
                "seconds": g.seconds,
                "peak_flops": g.peak_flops,
            }
            for g in profile.gemm
        ],
        "codec": [
            {
                "gpu": c.gpu,
                "dtype": c.dtype,
                "compress_bps": c.compress_bps,
                "decompress_bps": c.decompress_bps,
                "compress_call_s": c.compress_call_s,
                "decompress_call_s": c.decompress_call_s,
            }
            for c in profile.codec
        ],
    }


def profile_from_dict(data: object, *, source: str = "<dict>") -> ClusterProfile:
    """Validate (`PROFILE_SCHEMA`, then the types' own checks) and build a profile.

    Raises `ProfileError` naming `source`, the field and the problem."""
    error = jsonschema.exceptions.best_match(_PROFILE_VALIDATOR.iter_errors(data))
    if error is not None:
        where, reason = _schema_error(error)
        if where == "version":
            reason = (
                f"profile version {_short(error.instance)} is not supported (this meshplan "
                f"reads version {PROFILE_VERSION}); run `meshplan calibrate` again"
            )
        raise ProfileError(reason, source=source, field=where)
    assert isinstance(data, dict)
    at = "(profile)"
    try:
        tiers = []
        for i, t in enumerate(data.get("tiers", [])):
            at = f"tiers[{i}]"
            curves = []
            for j, c in enumerate(t.get("curves", [])):
                at = f"tiers[{i}].curves[{j}]"
                pts = tuple((int(b), float(sec)) for b, sec in c["points"])
                curves.append(CollectiveCurve(c["collective"], int(c["ranks"]), pts))
            at = f"tiers[{i}]"
            tiers.append(
                TierProfile(
                    tier=t["tier"],
                    intra_node=bool(t["intra_node"]),
                    gpus_per_node=int(t["gpus_per_node"]),
                    nics_per_node=int(t["nics_per_node"]),
                    ranks_per_node=int(t["ranks_per_node"]),
                    curves=tuple(curves),
                )
            )
        gemm = []
        for i, g in enumerate(data.get("gemm", [])):
            at = f"gemm[{i}]"
            gemm.append(
                GemmMeasurement(
                    g["gpu"], g["dtype"], g["m"], g["n"], g["k"], g["seconds"], g["peak_flops"]
                )
            )
        codec = []
        for i, c in enumerate(data.get("codec", [])):
            at = f"codec[{i}]"
            codec.append(
                CodecMeasurement(
                    c["gpu"],
                    c["dtype"],
                    float(c["compress_bps"]),
                    float(c["decompress_bps"]),
                    float(c["compress_call_s"]),
                    float(c["decompress_call_s"]),
                )
            )
        at = "(profile)"
        return ClusterProfile(
            tiers=tuple(tiers),
            gemm=tuple(gemm),
            codec=tuple(codec),
            version=int(data["version"]),
            source=str(data.get("source", "")),
        )
    except ValueError as e:
        raise ProfileError(str(e), source=source, field=at) from None


def load_profile(path: str | os.PathLike[str]) -> ClusterProfile:
    """Read and validate a cluster profile (JSON, or YAML by extension)."""
    source = str(path)
    file = Path(path)
    if file.suffix.lower() not in _EXTENSIONS:
        raise ProfileError(
            f"unknown extension {file.suffix or '(none)'!r}; profiles end in "
            f"{', '.join(_EXTENSIONS)}",
            source=source,
        )
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(
            "no such file; write one with `meshplan calibrate --out FILE`", source=source
        ) from None
    except OSError as e:
        raise ProfileError(f"cannot read: {e.strerror or e}", source=source) from None
    try:
        data = json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        reason = " ".join(str(e).split())
        raise ProfileError(
            f"not valid {file.suffix[1:].upper()}: {reason}", source=source
        ) from None
    return profile_from_dict(data, source=source)


def dump_profile(profile: ClusterProfile, path: str | os.PathLike[str]) -> None:
    """Write `profile` as JSON (or YAML for .yaml/.yml), atomically."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in _EXTENSIONS:
        raise ProfileError(
            f"unknown extension {file.suffix or '(none)'!r}; use {', '.join(_EXTENSIONS)}",
            source=str(path),
        )
    data = profile_to_dict(profile)
    if suffix == ".json":
        text = json.dumps(data, indent=1) + "\n"
    else:
        text = yaml.safe_dump(data, sort_keys=False, width=120)
    write_text_file(file, text)  # atomic; keeps a file's mode, writes through links


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------

# Indicative on-demand prices in $ per GPU-hour: EXAMPLES in the range public GPU clouds
# listed in 2024-25, not quotes. They only make `meshplan whatif` cost columns concrete; put
# your own in a cluster file.
EXAMPLE_PRICE_PER_GPU_HOUR: dict[str, float] = {
    "H100": 3.00,
    "H100-PCIe": 2.50,
    "H200": 3.80,
    "B200": 5.50,
    "A100-80GB": 1.80,
    "A100-40GB": 1.30,
    "A100-PCIe": 1.60,
    "V100": 0.80,
    "L40S": 1.00,
    "RTX4090": 0.40,
    "A10": 0.75,
    "MI250X": 1.20,
    "MI300X": 2.50,
}

# The network between nodes of each type (8 GPUs, or `RACK_SCALE`'s host size): (tier, NICs
# per node). Typical builds, not the only ones; a cluster file describes yours.
_NODE_NETWORK: dict[str, tuple[str, int]] = {
    "H100": ("ib-ndr", 8),  # DGX H100: 8 x 400 Gb/s (hardware.md)
    "H200": ("ib-ndr", 8),  # DGX H200: 8 x 400 Gb/s ConnectX-7, as DGX H100
    "B200": ("ib-ndr", 8),  # DGX B200 datasheet: 8 x 400 Gb/s ConnectX-7
    "A100-80GB": ("ib-hdr", 8),  # DGX A100: 8 x 200 Gb/s (hardware.md)
    "A100-40GB": ("ib-hdr", 8),  # DGX A100 (320 GB model): same network
    "V100": ("ib-edr", 4),  # DGX-1 with V100: 4 x 100 Gb/s EDR
    "V100-16GB": ("ib-edr", 4),  # DGX-1 (its first V100 build was 16 GB): the same
    "MI300X": ("roce-400g", 8),  # typical MI300X platforms: one 400 GbE NIC per GPU
    "MI250X": ("roce-200g", 4),  # Frontier-like node: 4 MI250X (8 dies), 4 x 200 Gb/s NICs
    "H100-PCIe": ("roce-200g", 4),  # PCIe servers: commonly one 200 Gb/s NIC per 2 GPUs
    "A100-PCIe": ("roce-200g", 4),
    "L40S": ("roce-200g", 4),
    "RTX4090": ("100gbe", 1),  # consumer-GPU boxes: one 100 GbE port
    "A10": ("100gbe", 1),
    "GH200": ("ib-ndr", 8),  # GH200 systems: one 400 Gb/s NIC per superchip, typical
    "GH200-144GB": ("ib-ndr", 8),
    "H800": ("ib-ndr", 8),  # HGX H800: 8 x 400 Gb/s ConnectX-7, as DGX H100
    "H20": ("ib-ndr", 8),  # HGX H20: 8 x 400 Gb/s, as HGX H100, typical
    "GB200": ("ib-ndr", 4),  # GB200 NVL72 compute tray: 4 x 400 Gb/s ConnectX-7 per 4 GPUs
    "GB300": ("ib-xdr", 4),  # GB300 NVL72 compute tray: one 800 Gb/s ConnectX-8 per GPU
    "L4": ("100gbe", 1),  # inference boxes: one 100 GbE port, as the consumer boxes
    "A40": ("roce-200g", 4),  # PCIe servers, as L40S
    "RTX-A6000": ("100gbe", 1),  # workstation-class boxes: one 100 GbE port
    "RTX3090": ("100gbe", 1),
    "RTX2080Ti": ("100gbe", 1),
    "T4": ("25gbe", 1),  # T4 inference servers: commonly one 25 GbE port
}


# Rack-scale NVLink systems: (GPUs per host, GPUs per NVLink domain). A GB200 / GB300 NVL72
# rack is 18 compute trays of two superchips (4 GPUs) on one NVLink 5 switch fabric of 72 GPUs,
# 1.8 TB/s per GPU (900 GB/s each way) between any two of them (NVIDIA GB200 NVL72 and GB300
# NVL72 datasheets; NVIDIA DGX GB200 user guide: 18 compute trays, 9 NVLink switch trays).
# The GPU-type presets build these as 4-GPU hosts in 72-GPU domains (`DeviceGroup.nvlink_domain`).
RACK_SCALE: dict[str, tuple[int, int]] = {
    "GB200": (4, 72),
    "GB300": (4, 72),
}


@dataclass(frozen=True, slots=True)
class _Preset:
    description: str
    build: Callable[[int | None], Cluster]


def _fail_preset(name: str, reason: str) -> ClusterError:
    return ClusterError(reason, field=f"preset {name}")


def _nodes(preset: str, gpus: int, per_node: int = 8) -> tuple[int, int]:
    """(nodes, gpus_per_node) for `gpus` GPUs in nodes of `per_node`: whole nodes, or one
    partial node when fewer than `per_node`."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        raise _fail_preset(
            preset,
            f"gpus must be a multiple of {per_node} (whole nodes) or at most {per_node} "
            f"(one partial node), got {gpus}",
        )
    return gpus // per_node, per_node


def _group(preset: str, name: str, gpu: str, gpus: int, site: str = "site0") -> DeviceGroup:
    spec = gpu_spec(gpu)
    host, domain = RACK_SCALE.get(spec.name, (8, None))
    nodes, per_node = _nodes(preset, gpus, host)
    if domain is not None and gpus > domain and gpus % domain:
        raise _fail_preset(
            preset,
            f"gpus must be at most {domain} (one NVLink domain of {spec.name} NVL{domain}) or a "
            f"multiple of {domain} (whole racks), got {gpus}; a cluster file can set a smaller "
            "nvlink_domain",
        )
    inter, nics = _NODE_NETWORK[spec.name]
    return DeviceGroup(
        name=name,
        gpu=spec,
        nodes=nodes,
        gpus_per_node=per_node,
        intra_link=default_intra_link(spec.name),
        inter_link=inter,
        nics_per_node=nics,
        site=site,
        price_per_gpu_hour=EXAMPLE_PRICE_PER_GPU_HOUR.get(spec.name),
        nvlink_domain=domain,
    )


def _cluster(
    name: str, groups: Sequence[DeviceGroup], group_links: Sequence[GroupLink] = ()
) -> Cluster:
    """A cluster holding the built-in tiers its groups and group links name, in first use."""
    names: list[str] = []
    for g in groups:
        names += [g.intra_link] + ([g.inter_link] if g.inter_link else [])
    names += [gl.link for gl in group_links]
    links = tuple(LINK_TIERS[n] for n in dict.fromkeys(names))
    world = sum(g.num_gpus for g in groups)
    return Cluster(f"{name}-{world}", tuple(groups), links, tuple(group_links))


def _homogeneous(
    preset: str, gpu: str, default: int, group: str | None = None
) -> Callable[[int | None], Cluster]:
    def build(gpus: int | None) -> Cluster:
        n = default if gpus is None else gpus
        return _cluster(preset, [_group(preset, group or gpu_spec(gpu).name.lower(), gpu, n)])

    return build


def _even_split(preset: str, gpus: int) -> int:
    if gpus % 2:
        raise _fail_preset(preset, f"gpus must be even (half in each group), got {gpus}")
    return gpus // 2


def _mixed(gpus: int | None) -> Cluster:
    half = _even_split("mixed-h100-a100", 32 if gpus is None else gpus)
    # One site, one IB fabric: the groups meet over the slower (HDR) NICs of the A100 nodes.
    return _cluster(
        "mixed-h100-a100",
        [
            _group("mixed-h100-a100", "h100", "H100", half),
            _group("mixed-h100-a100", "a100", "A100-80GB", half),
        ],
    )


def _two_sites(gpus: int | None) -> Cluster:
    half = _even_split("two-sites", 32 if gpus is None else gpus)
    return _cluster(
        "two-sites",
        [
            _group("two-sites", "h100-dc1", "H100", half, site="dc1"),
            _group("two-sites", "h100-dc2", "H100", half, site="dc2"),
        ],
        [GroupLink("dc1", "dc2", "wan-100g")],
    )


def _cpu(gpus: int | None) -> Cluster:
    n = 4 if gpus is None else gpus
    group = DeviceGroup(
        name="cpu",
        gpu=gpu_spec("CPU"),
        nodes=1,
        gpus_per_node=n,
        intra_link="loopback",
        inter_link="",
    )
    return _cluster("cpu", [group])


_PRESETS: dict[str, _Preset] = {
    "default": _Preset(
        "the shipped default for `meshplan plan`: 4 DGX H100 nodes, 32 x H100 SXM, NVLink4, "
        "8 x 400 Gb/s IB NDR per node",
        _homogeneous("dgx-h100", "H100", 32),
    ),
    "dgx-h100": _Preset(
        "DGX H100 nodes: 8 x H100 SXM, NVLink4, 8 x 400 Gb/s IB NDR per node (default 8 GPUs)",
        _homogeneous("dgx-h100", "H100", 8),
    ),
    "dgx-a100": _Preset(
        "DGX A100 nodes: 8 x A100 80GB SXM, NVLink3, 8 x 200 Gb/s IB HDR per node (default 8 GPUs)",
        _homogeneous("dgx-a100", "A100-80GB", 8, group="a100"),
    ),
    "mixed-h100-a100": _Preset(
        "half DGX H100, half DGX A100 nodes at one site on one IB fabric (default 32 GPUs)",
        _mixed,
    ),
    "rtx4090-ethernet": _Preset(
        "nodes of 8 x RTX 4090 on PCIe4, one 100 GbE port per node (default 16 GPUs)",
        _homogeneous("rtx4090-ethernet", "RTX4090", 16),
    ),
    "two-sites": _Preset(
        "two DGX H100 groups at two sites joined by a 100 Gb/s WAN (default 32 GPUs, "
        "half per site)",
        _two_sites,
    ),
    "cpu": _Preset(
        "one host with N CPU 'devices' over loopback, for local gloo runs (default 4)",
        _cpu,
    ),
}


def _preset_key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def list_presets() -> list[tuple[str, str]]:
    """(name, description) of the named presets. Any GPU type of the spec table
    (`meshplan.ir.hardware.known_gpus()`) is a preset too: 8-GPU nodes of that type, or for
    GB200 / GB300 4-GPU compute trays in 72-GPU NVLink domains (NVL72 racks)."""
    return [(name, p.description) for name, p in _PRESETS.items()]


def preset_cluster(name: str, gpus: int | None = None) -> Cluster:
    """Build preset `name` with `gpus` GPUs in total (None: the preset's default).

    `name` is a named preset (see `list_presets`) or any GPU type of the spec table, which
    gives 8-GPU nodes of that type (GB200 / GB300: 4-GPU trays in 72-GPU NVLink domains,
    `RACK_SCALE`). Raises `ClusterError` for an unknown name or a GPU count
    the preset cannot make.
    """
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise _fail_preset(name, f"gpus must be a positive integer, got {gpus!r}")
    preset = _PRESETS.get(_preset_key(name))
    if preset is not None:
        return preset.build(gpus)
    gpu = canonical_gpu_name(name)
    if gpu is not None:
        return _homogeneous(gpu.lower(), gpu, 8)(gpus)
    raise ClusterError(
        f"unknown cluster preset {name!r}; presets: {', '.join(_PRESETS)}; "
        f"or a GPU type: {', '.join(g for g in known_gpus() if g != 'CPU')}"
    )


def resolve_cluster(spec: str, gpus: int | None = None) -> Cluster:
    """A cluster from a command-line style argument: a path to a cluster file (it has a
    .yaml/.yml/.json extension or exists) or else a preset name."""
    if spec.lower().endswith(_EXTENSIONS) or os.path.exists(spec):
        if gpus is not None:
            raise ClusterError(
                "a GPU count applies to presets only; edit the file instead", source=spec
            )
        return load_cluster(spec)
    return preset_cluster(spec, gpus)


READERS.update(load=load_cluster, preset=preset_cluster)  # `Cluster.load`, `Cluster.preset`
