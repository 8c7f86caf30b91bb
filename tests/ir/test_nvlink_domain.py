"""NVLink domains wider than a node (`DeviceGroup.nvlink_domain`): validation, the GB200 /
GB300 NVL72 presets and the cluster-file key.

A GB200 NVL72 rack is 18 compute trays of 4 GPUs on one NVLink 5 switch fabric of 72 GPUs
(NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs, NVLink 5 at 1.8 TB/s per GPU, i.e. 900 GB/s
each way); each tray has 4 x 400 Gb/s ConnectX-7 NICs, one per GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from meshplan.ir.cluster import Cluster, DeviceGroup
from meshplan.ir.cluster_io import (
    ClusterError,
    cluster_from_dict,
    dump_cluster,
    load_cluster,
    preset_cluster,
)
from meshplan.ir.hardware import gpu_spec

GB200 = gpu_spec("GB200")

NVL72_FILE = """
name: two-nvl72-racks
groups:
  - name: gb200
    gpu: GB200
    nodes: 36                    # 2 racks x 18 compute trays
    gpus_per_node: 4
    nvlink_domain: 72
    inter_link: ib-ndr
    nics_per_node: 4
"""


def _group(nodes: int, per_node: int, domain: int | None) -> DeviceGroup:
    return DeviceGroup("g", GB200, nodes, per_node, "nvlink5", "ib-ndr", 4, nvlink_domain=domain)


# -- the field and its two views ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "per_node", "domain", "domain_gpus", "domains"),
    [
        (4, 8, None, 8, 4),  # no domain: one node each, as before
        (36, 4, 72, 72, 2),  # two NVL72 racks
        (18, 4, 72, 72, 1),  # one rack
        (4, 4, 72, 16, 1),  # four trays of a rack: the domain is cut to the group
        (1, 4, 72, 4, 1),  # one tray
        (32, 4, 64, 64, 2),  # 16 of each rack's 18 trays in use
    ],
)
def test_domain_gpus_and_domains(nodes, per_node, domain, domain_gpus, domains) -> None:
    g = _group(nodes, per_node, domain)
    assert (g.domain_gpus, g.domains) == (domain_gpus, domains)
    assert g.num_gpus == nodes * per_node  # hosts stay hosts
    assert g.domains * g.domain_gpus == g.num_gpus


@pytest.mark.parametrize(
    ("nodes", "domain", "needle"),
    [
        (36, 6, "nvlink_domain must be a positive multiple of gpus_per_node (4), got 6"),
        (36, 0, "nvlink_domain must be a positive multiple of gpus_per_node (4), got 0"),
        (25, 72, "nvlink_domain=72 neither divides nor covers the group's 100 GPUs"),
    ],
)
def test_bad_domain_is_one_line_naming_group_and_field(nodes, domain, needle) -> None:
    with pytest.raises(ValueError) as info:
        _group(nodes, 4, domain)
    message = str(info.value)
    assert message.startswith("group g: ") and needle in message
    assert "\n" not in message


def test_plain_groups_keep_their_dict_and_fingerprint() -> None:
    """No nvlink_domain: the key stays out of `to_dict`, so existing plans and fingerprints
    keep their bytes."""
    plain = preset_cluster("dgx-h100", 16)
    assert "nvlink_domain" not in plain.to_dict()["groups"][0]
    assert plain.groups[0].domain_gpus == plain.groups[0].gpus_per_node


# -- presets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", ["GB200", "GB300"])
@pytest.mark.parametrize(
    ("gpus", "nodes", "domain_gpus", "domains"),
    [(None, 2, 8, 1), (4, 1, 4, 1), (16, 4, 16, 1), (72, 18, 72, 1), (144, 36, 72, 2)],
)
def test_nvl72_presets_are_trays_in_racks(gpu, gpus, nodes, domain_gpus, domains) -> None:
    (g,) = preset_cluster(gpu, gpus).groups
    assert (g.gpus_per_node, g.nvlink_domain) == (4, 72)
    assert (g.nodes, g.domain_gpus, g.domains) == (nodes, domain_gpus, domains)
    # One NIC per GPU: GB200 4 x 400 Gb/s ConnectX-7 per tray, GB300 4 x 800 Gb/s ConnectX-8.
    assert g.nics_per_node == 4
    assert g.inter_link == {"GB200": "ib-ndr", "GB300": "ib-xdr"}[gpu]
    assert g.intra_link == "nvlink5"


def test_nvl72_preset_refuses_a_partial_rack_beyond_the_first() -> None:
    with pytest.raises(ClusterError) as info:
        preset_cluster("GB200", 100)
    message = str(info.value)
    assert "\n" not in message
    assert "gpus must be at most 72" in message and "multiple of 72" in message


# -- cluster files --------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_nvlink_domain_round_trips_through_files(tmp_path: Path, suffix: str) -> None:
    src = tmp_path / "nvl72.yaml"
    src.write_text(NVL72_FILE)
    cluster = load_cluster(src)
    (g,) = cluster.groups
    assert (g.nvlink_domain, g.domain_gpus, g.domains) == (72, 72, 2)
    out = tmp_path / f"again{suffix}"
    dump_cluster(cluster, out)
    again = load_cluster(out)
    assert again.groups == cluster.groups
    assert again.fingerprint() == cluster.fingerprint()
    # The layout plan files embed (`Cluster.to_dict`) carries the key too.
    assert cluster.to_dict()["groups"][0]["nvlink_domain"] == 72
    assert cluster_from_dict(cluster.to_dict()) == cluster


def test_preset_round_trips_with_its_domain(tmp_path: Path) -> None:
    cluster = Cluster.preset("GB300", 144)
    dump_cluster(cluster, tmp_path / "gb300.yaml")
    assert load_cluster(tmp_path / "gb300.yaml").groups == cluster.groups


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("70", "groups[0].nvlink_domain: group gb200: nvlink_domain must be a positive multiple"),
        ("96", "groups[0].nvlink_domain: group gb200: nvlink_domain=96 neither divides nor covers"),
        ("0", "groups[0].nvlink_domain"),
        ("seventy-two", "groups[0].nvlink_domain"),
    ],
)
def test_bad_nvlink_domain_in_a_file_names_file_and_field(
    tmp_path: Path, value: str, needle: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(NVL72_FILE.replace("nvlink_domain: 72", f"nvlink_domain: {value}"))
    with pytest.raises(ClusterError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert needle in message
