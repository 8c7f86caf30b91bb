"""Units in cluster files: a bandwidth or latency written as a bare number is refused.

`bandwidth: 100, latency: 20` used to load as 100 bytes/s and 20 seconds. A file must say
"100 Gb/s" / "25 GB/s" and "20 us" (the module docstring of meshplan.ir.cluster_io states the
convention); Python numbers stay SI base units, so the `Cluster.to_dict()` layout that plan
files embed still loads. Unit tier: no GPU, no processes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from meshplan.ir.cluster import Cluster, DeviceGroup
from meshplan.ir.cluster_io import (
    ClusterError,
    cluster_from_dict,
    dump_cluster,
    list_presets,
    load_cluster,
    parse_bandwidth,
    parse_latency,
    preset_cluster,
)
from meshplan.ir.devices import LinkKind, LinkTier
from meshplan.ir.hardware import gpu_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
GROUP = "{name: a, gpu: H100, nodes: 2, gpus_per_node: 8, inter_link: x}"


def _file(tmp_path: Path, link: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"links:\n  - {{name: x, kind: infiniband, {link}}}\ngroups:\n  - {GROUP}\n")
    return path


def _error(path: Path) -> str:
    with pytest.raises(ClusterError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    return message


@pytest.mark.parametrize(
    ("link", "field", "forms"),
    [
        # the report's file: the bandwidth is named first
        ("bandwidth: 100, latency: 20", "links[0].bandwidth", ("100 Gb/s", "25 GB/s")),
        ("bandwidth: 50e9", "links[0].bandwidth", ("100 Gb/s", "25 GB/s")),  # a YAML string
        ("bandwidth: 12.5", "links[0].bandwidth", ("400Gbps",)),
        ("bandwidth: 400Gbps, latency: 20", "links[0].latency", ("2 us", "100ns")),
        ("bandwidth: 400Gbps, latency: 0.000005", "links[0].latency", ("2 us",)),
        ("bandwidth: 400Gbps, latency: '5'", "links[0].latency", ("2 us",)),
    ],
)
def test_bare_numbers_are_refused_naming_field_and_forms(tmp_path, link, field, forms):
    message = _error(_file(tmp_path, link))
    assert f"{field}: a bare number is ambiguous" in message
    assert all(f"'{f}'" in message for f in forms), message


def test_bare_numbers_are_refused_in_json_files_and_gpu_specs(tmp_path: Path):
    data = {
        "links": [{"name": "x", "kind": "infiniband", "bandwidth": 50e9}],
        "groups": [{"name": "a", "gpu": "H100", "nodes": 2, "gpus_per_node": 8, "inter_link": "x"}],
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    assert "links[0].bandwidth: a bare number is ambiguous" in _error(path)
    gpu = "{base: H100, name: H100-slow, hbm_bandwidth: 2000}"
    path = tmp_path / "gpu.yaml"
    path.write_text(f"groups:\n  - {{name: a, gpu: {gpu}, nodes: 1, gpus_per_node: 8}}\n")
    assert "groups[0].gpu.hbm_bandwidth: a bare number is ambiguous" in _error(path)


@pytest.mark.parametrize(
    ("link", "bandwidth", "latency"),
    [
        ("bandwidth: 100 Gb/s, latency: 2 us", 12.5e9, 2e-6),
        ("bandwidth: 400Gbps, latency: 5µs", 50e9, 5e-6),
        ("bandwidth: 25 GB/s, latency: 1ms", 25e9, 1e-3),
        ("bandwidth: 200Gbit/s, latency: 0", 25e9, 0.0),  # zero needs no unit
    ],
)
def test_numbers_with_units_load(tmp_path, link, bandwidth, latency):
    tier = load_cluster(_file(tmp_path, link)).link("x")
    assert (tier.bandwidth, tier.latency) == (bandwidth, latency)


def test_fields_that_name_their_unit_and_zero_nvlink_take_bare_numbers(tmp_path: Path):
    gpu = "{base: H100, name: H100-x, memory_bytes: 85899345920, nvlink_bandwidth: 0}"
    path = tmp_path / "c.yaml"
    path.write_text(f"groups:\n  - {{name: a, gpu: {gpu}, nodes: 1, gpus_per_node: 8}}\n")
    spec = load_cluster(path).groups[0].gpu
    assert (spec.memory_bytes, spec.nvlink_bandwidth) == (80 * 2**30, 0.0)


@pytest.mark.parametrize("file", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_shipped_examples_use_units(file: str):
    load_cluster(EXAMPLES / file)


@pytest.mark.parametrize("preset", [name for name, _ in list_presets()])
def test_presets_dump_with_units_and_load_back(tmp_path: Path, preset: str):
    cluster = preset_cluster(preset)
    dump_cluster(cluster, tmp_path / "c.json")
    assert load_cluster(tmp_path / "c.json") == cluster


def test_a_bandwidth_without_a_short_form_is_dumped_exactly_with_a_unit(tmp_path: Path):
    odd = LinkTier("odd", LinkKind.ETHERNET, 1234567890.123457, 3.14159265358979e-6, 0.7)
    group = DeviceGroup("a", gpu_spec("H100"), 2, 8, "nvlink4", "odd", 1)
    cluster = Cluster("odd", (group,), (odd, preset_cluster("dgx-h100").link("nvlink4")))
    dump_cluster(cluster, tmp_path / "c.json")
    link = json.loads((tmp_path / "c.json").read_text())["links"][1]
    assert isinstance(link["bandwidth"], str) and isinstance(link["latency"], str)
    assert load_cluster(tmp_path / "c.json") == cluster


def test_python_numbers_stay_si_base_units():
    """The API and the `Cluster.to_dict()` layout (embedded in plan files) keep bare numbers
    as bytes/s and seconds."""
    assert parse_bandwidth(50e9) == 50e9 and parse_latency(5e-6) == 5e-6
    with pytest.raises(ValueError, match="a bare number is ambiguous"):
        parse_bandwidth(50e9, unit_required=True)
    cluster = preset_cluster("two-sites")
    assert cluster_from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    slow = dataclasses.replace(cluster.link("wan-100g"), bandwidth=100.0, latency=20.0)
    links = tuple(slow if t.name == slow.name else t for t in cluster.links)
    data = dataclasses.replace(cluster, links=links).to_dict()
    assert cluster_from_dict(data).link("wan-100g").bandwidth == 100.0
