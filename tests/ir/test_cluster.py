"""Cluster files, presets, units, errors, topology queries and the hardware tables.

Expected numbers are computed by hand from the vendor datasheets that `meshplan.ir.hardware`
cites (one direction = the bidirectional figure / 2; 1 Gb/s = 1e9 / 8 bytes/s; memory in GiB,
see meshplan.ir.hardware).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from meshplan.ir.cluster import Cluster, DeviceGroup, GroupLink
from meshplan.ir.cluster_io import (
    ClusterError,
    cluster_from_dict,
    dump_cluster,
    list_presets,
    load_cluster,
    parse_bandwidth,
    parse_flops,
    parse_latency,
    parse_memory,
    preset_cluster,
    resolve_cluster,
)
from meshplan.ir.devices import LinkKind, LinkTier
from meshplan.ir.hardware import (
    GPU_SPECS,
    UnknownGpuError,
    UnknownLinkError,
    gpu_spec,
    known_gpus,
    known_links,
    link_tier,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
GiB = 2**30


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str, name: str = "cluster.yaml") -> str:
    path = write(tmp_path, text, name)
    with pytest.raises(ClusterError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    assert message.startswith(str(path)), "errors name the file"
    return message


# -- example files ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("file", "world", "gpus"),
    [
        ("dgx_h100_4nodes.yaml", 32, {"H100"}),
        ("mixed_h100_a100.yaml", 48, {"H100", "A100-80GB"}),
        ("two_sites_wan.yaml", 48, {"H100"}),
    ],
)
def test_example_files_load(file: str, world: int, gpus: set[str]) -> None:
    cluster = load_cluster(EXAMPLES / file)
    assert cluster.world_size == world
    assert {g.gpu.name for g in cluster.groups} == gpus


def test_module_docstring_example_loads(tmp_path: Path) -> None:
    from meshplan.ir import cluster_io

    example = cluster_io.__doc__.split("```yaml")[1].split("```")[0]
    cluster = load_cluster(write(tmp_path, example))
    assert cluster.world_size == 48
    assert cluster.group("a100-big").gpu.memory_bytes == 40 * GiB
    assert cluster.link_between_groups("h100", "a100-big").name == "wan-100g"


def test_dgx_example_is_the_default_preset_written_out() -> None:
    from_file = load_cluster(EXAMPLES / "dgx_h100_4nodes.yaml")
    default = preset_cluster("default")
    assert from_file.groups == default.groups
    assert from_file.links == default.links


def test_example_wan_link_is_the_file_defined_tier() -> None:
    cluster = load_cluster(EXAMPLES / "two_sites_wan.yaml")
    wan = cluster.link_between_groups("h100-dc1", "h100-dc2")
    assert wan.name == "wan-dc1-dc2"
    assert wan.kind is LinkKind.WAN
    assert wan.bandwidth == 100e9 / 8
    assert wan.latency == 2e-3
    assert wan.efficiency == 0.5


# -- round trips ------------------------------------------------------------------------------


ALL_PRESETS = [name for name, _ in list_presets()] + [g for g in known_gpus() if g != "CPU"]


@pytest.mark.parametrize("preset", ALL_PRESETS)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_every_preset_round_trips(tmp_path: Path, preset: str, suffix: str) -> None:
    cluster = preset_cluster(preset)
    path = tmp_path / f"c{suffix}"
    dump_cluster(cluster, path)
    loaded = load_cluster(path)
    assert loaded == cluster
    assert loaded.fingerprint() == cluster.fingerprint()


def test_custom_gpu_and_links_round_trip(tmp_path: Path) -> None:
    h100_96 = dataclasses.replace(gpu_spec("H100"), name="H100-96GB", memory_bytes=96 * GiB)
    renamed_free = dataclasses.replace(gpu_spec("A100"), memory_bytes=81_000_000_123)
    odd_link = LinkTier("ib-odd", LinkKind.INFINIBAND, 12_345_678.9, 3.3e-6, 0.77)
    cluster = Cluster(
        name="custom",
        groups=(
            DeviceGroup("a", h100_96, 2, 8, "nvlink4", "ib-odd", 8, "x", 1.25),
            DeviceGroup("b", renamed_free, 1, 4, "nvlink3", "", 1, "y"),
        ),
        links=(
            link_tier("nvlink4"),
            odd_link,
            link_tier("nvlink3"),
            dataclasses.replace(link_tier("wan-10g"), latency=0.0),
        ),
        group_links=(GroupLink("x", "y", "wan-10g"),),
    )
    for name in ("c.yaml", "c.json"):
        dump_cluster(cluster, tmp_path / name)
        assert load_cluster(tmp_path / name) == cluster


def test_dump_is_the_shared_atomic_write(tmp_path: Path) -> None:
    """dump_cluster / dump_profile write as every output file does (`write_text_file`): an
    existing file keeps its mode, a symbolic link is written through, no temp file is left."""
    import os

    from meshplan.ir.cluster import ClusterProfile
    from meshplan.ir.cluster_io import dump_profile, load_profile

    target = tmp_path / "real.yaml"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "c.yaml"
    link.symlink_to(target)
    dump_cluster(preset_cluster("default"), link)
    assert link.is_symlink() and load_cluster(target) == preset_cluster("default")
    assert oct(target.stat().st_mode & 0o777) == oct(0o640)
    profile = ClusterProfile(source="test")
    dump_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "p.json", "real.yaml"]


def test_to_dict_layout_loads_back() -> None:
    cluster = preset_cluster("mixed-h100-a100")
    data = json.loads(json.dumps(cluster.to_dict()))
    assert cluster_from_dict(data) == cluster


def test_dump_writes_readable_units(tmp_path: Path) -> None:
    dump_cluster(preset_cluster("default"), tmp_path / "c.yaml")
    text = (tmp_path / "c.yaml").read_text()
    assert "400Gbps" in text and "450GB/s" in text and "5us" in text


# -- presets ----------------------------------------------------------------------------------


def test_list_presets() -> None:
    names = [name for name, _ in list_presets()]
    assert names == [
        "default",
        "dgx-h100",
        "dgx-a100",
        "mixed-h100-a100",
        "rtx4090-ethernet",
        "two-sites",
        "cpu",
    ]
    assert all(description for _, description in list_presets())


def test_default_preset_is_four_dgx_h100() -> None:
    cluster = preset_cluster("default")
    assert cluster.world_size == 32 and cluster.num_nodes == 4
    (group,) = cluster.groups
    assert group.gpu == gpu_spec("H100")
    assert (group.intra_link, group.inter_link, group.nics_per_node) == ("nvlink4", "ib-ndr", 8)
    assert Cluster.preset("default") == cluster


@pytest.mark.parametrize(
    ("preset", "gpus", "world", "nodes", "per_node"),
    [
        ("dgx-h100", None, 8, 1, 8),
        ("dgx-h100", 64, 64, 8, 8),
        ("dgx-h100", 4, 4, 1, 4),  # fewer than 8: one partial node
        ("dgx-a100", 16, 16, 2, 8),
        ("rtx4090-ethernet", None, 16, 2, 8),
        ("cpu", None, 4, 1, 4),
        ("cpu", 2, 2, 1, 2),
        ("H100", None, 8, 1, 8),
        ("l40s", 24, 24, 3, 8),
    ],
)
def test_preset_sizes(preset: str, gpus: int | None, world: int, nodes: int, per_node: int) -> None:
    cluster = preset_cluster(preset, gpus)
    assert cluster.world_size == world
    assert cluster.num_nodes == nodes
    assert {g.gpus_per_node for g in cluster.groups} == {per_node}


def test_dgx_a100_links() -> None:
    (group,) = preset_cluster("dgx-a100", 16).groups
    assert group.gpu.name == "A100-80GB"
    assert (group.intra_link, group.inter_link, group.nics_per_node) == ("nvlink3", "ib-hdr", 8)


def test_rtx4090_preset_is_pcie_and_ethernet() -> None:
    cluster = preset_cluster("rtx4090-ethernet")
    (group,) = cluster.groups
    assert group.gpu.name == "RTX4090"
    assert cluster.link(group.intra_link).kind is LinkKind.PCIE
    assert cluster.link(group.inter_link).kind is LinkKind.ETHERNET
    assert cluster.link(group.inter_link).bandwidth == 12.5e9
    assert group.nics_per_node == 1


def test_mixed_preset_halves_and_meets_at_the_slower_ib() -> None:
    cluster = preset_cluster("mixed-h100-a100", 32)
    assert [(g.gpu.name, g.num_gpus) for g in cluster.groups] == [("H100", 16), ("A100-80GB", 16)]
    assert len({g.site for g in cluster.groups}) == 1
    assert cluster.link_between_groups("h100", "a100").name == "ib-hdr"


def test_two_sites_preset_uses_the_wan() -> None:
    cluster = preset_cluster("two-sites")
    assert cluster.world_size == 32
    assert [g.site for g in cluster.groups] == ["dc1", "dc2"]
    link = cluster.link_between_groups("h100-dc1", "h100-dc2")
    assert link.kind is LinkKind.WAN and link.bandwidth == 100e9 / 8


def test_cpu_preset_is_loopback() -> None:
    (group,) = preset_cluster("cpu").groups
    assert group.gpu.name == "CPU"
    assert group.intra_link == "loopback" and group.inter_link == ""


@pytest.mark.parametrize("gpu", [g for g in known_gpus() if g != "CPU"])
def test_gpu_type_presets(gpu: str) -> None:
    cluster = preset_cluster(gpu)
    (group,) = cluster.groups
    assert group.gpu == gpu_spec(gpu)
    intra = cluster.link(group.intra_link)
    # Parts with NVLink / Infinity Fabric get their fabric inside the node, the rest PCIe.
    assert (intra.kind is LinkKind.NVLINK) == (group.gpu.nvlink_bandwidth > 0)
    if intra.kind is LinkKind.NVLINK:
        assert intra.bandwidth == group.gpu.nvlink_bandwidth


def test_presets_by_alias_and_case() -> None:
    assert preset_cluster("a100").groups[0].gpu.name == "A100-80GB"
    assert preset_cluster("DGX_H100") == preset_cluster("dgx-h100")


@pytest.mark.parametrize(
    ("preset", "gpus", "needle"),
    [
        ("dgx-h100", 12, "multiple of 8"),
        ("dgx-h100", 0, "positive integer"),
        ("mixed-h100-a100", 7, "even"),
        ("two-sites", 24, "multiple of 8"),  # 12 per site
    ],
)
def test_preset_bad_gpu_counts(preset: str, gpus: int, needle: str) -> None:
    with pytest.raises(ClusterError, match=needle):
        preset_cluster(preset, gpus)


def test_unknown_preset_lists_presets_and_gpu_types() -> None:
    with pytest.raises(ClusterError) as info:
        preset_cluster("dgx-h1000")
    message = str(info.value)
    assert "\n" not in message
    for name in ("default", "dgx-h100", "mixed-h100-a100", "two-sites", "cpu", "MI300X"):
        assert name in message


def test_resolve_cluster_takes_paths_or_presets() -> None:
    assert resolve_cluster("dgx-h100", 16).world_size == 16
    assert resolve_cluster(str(EXAMPLES / "two_sites_wan.yaml")).name == "two-sites-wan"
    with pytest.raises(ClusterError, match="no such file"):
        resolve_cluster("missing.yaml")


# -- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("400Gbps", 50e9),  # 400e9 bits / 8
        ("400 Gb/s", 50e9),
        ("200Gbit/s", 25e9),
        ("100Gbps", 12.5e9),
        ("50GB/s", 50e9),
        ("12.5 GB/s", 12.5e9),
        ("900MB/s", 9e8),
        ("1GiB/s", 1073741824.0),
        ("50e9", 50e9),  # PyYAML reads 50e9 as a string
        (50e9, 50e9),  # a bare number is bytes/s
        (3, 3.0),
    ],
)
def test_parse_bandwidth(text: object, expected: float) -> None:
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5us", 5e-6),
        ("5 µs", 5e-6),
        ("2ms", 2e-3),
        ("100ns", 1e-7),
        ("1s", 1.0),
        (0.5, 0.5),
        (0, 0.0),
    ],
)
def test_parse_latency(text: object, expected: float) -> None:
    assert parse_latency(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 85_899_345_920), ("80GB", 80_000_000_000), ("512MiB", 536_870_912), (1024, 1024)],
)
def test_parse_memory(text: object, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("989TFLOP/s", 989e12), ("989 TFLOPS", 989e12), ("2.25PFLOP/s", 2.25e15), (1e12, 1e12)],
)
def test_parse_flops(text: object, expected: float) -> None:
    assert parse_flops(text) == expected


@pytest.mark.parametrize(
    ("parse", "value"),
    [
        (parse_bandwidth, "fast"),
        (parse_bandwidth, "400 Gbpz"),
        (parse_bandwidth, "-5GB/s"),
        (parse_bandwidth, 0),
        (parse_bandwidth, True),
        (parse_bandwidth, float("inf")),
        (parse_latency, "-1us"),
        (parse_latency, "5 parsecs"),
        (parse_memory, "1.5B"),
        (parse_memory, "80 gigs"),
        (parse_flops, "lots"),
    ],
)
def test_parse_rejects(parse, value: object) -> None:
    with pytest.raises(ValueError, match="must be"):
        parse(value)


# -- file errors ------------------------------------------------------------------------------

GOOD_GROUP = "{name: h100, gpu: H100, nodes: 2, gpus_per_node: 8, inter_link: ib-ndr}"


def test_bad_field_names_file_and_field_path(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"groups:\n  - {GOOD_GROUP}\n  - {{name: b, gpu: A100, nodes: 1, gpus_per_node: 0}}\n",
    )
    path = tmp_path / "cluster.yaml"
    assert message == f"{path}: groups[1].gpus_per_node: must be a positive integer, got 0"


def test_unknown_field_suggests_the_right_one(tmp_path: Path) -> None:
    message = load_error(tmp_path, "groups:\n  - {name: a, gpu: H100, nodes: 1, gpus_per_nod: 8}\n")
    assert "groups[0].gpus_per_nod: unknown field" in message
    assert "did you mean 'gpus_per_node'" in message


def test_missing_required_field(tmp_path: Path) -> None:
    message = load_error(tmp_path, "groups:\n  - {name: a, gpu: H100, gpus_per_node: 8}\n")
    assert "groups[0]: missing required field 'nodes'" in message


def test_unknown_gpu_lists_known_types(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, "groups:\n  - {name: a, gpu: H1000, nodes: 1, gpus_per_node: 8}\n"
    )
    assert "groups[0].gpu: unknown GPU type 'H1000'" in message
    for name in known_gpus():
        assert name in message


def test_unknown_link_names_the_builtin_tiers(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        "groups:\n  - {name: a, gpu: H100, nodes: 2, gpus_per_node: 8, inter_link: ib-nrd}\n",
    )
    assert "groups[0].inter_link: unknown link 'ib-nrd'" in message
    assert "did you mean 'ib-ndr'" in message and "wan-100g" in message


def test_multi_node_group_needs_an_inter_link(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, "groups:\n  - {name: a, gpu: H100, nodes: 2, gpus_per_node: 8}\n"
    )
    assert "groups[0].inter_link: required when nodes > 1" in message


def test_bad_bandwidth_names_the_link_field(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"links:\n  - {{name: x, kind: infiniband, bandwidth: fast}}\ngroups:\n  - {GOOD_GROUP}\n",
    )
    assert "links[0].bandwidth: must be a bandwidth like '400Gbps'" in message


def test_bad_link_kind_lists_the_kinds(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        "links:\n  - {name: x, kind: carrier-pigeon, bandwidth: 1GB/s}\n"
        f"groups:\n  - {GOOD_GROUP}\n",
    )
    assert "links[0].kind: must be one of nvlink, pcie, infiniband" in message


def test_multi_site_cluster_without_wan_is_rejected(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        "groups:\n"
        "  - {name: a, gpu: H100, nodes: 1, gpus_per_node: 8, site: dc1}\n"
        "  - {name: b, gpu: H100, nodes: 1, gpus_per_node: 8, site: dc2}\n",
    )
    assert "group_links:" in message and "dc1" in message and "dc2" in message
    assert "wan-100g" in message  # says what to add


def test_group_link_endpoint_must_exist(tmp_path: Path) -> None:
    message = load_error(
        tmp_path,
        f"groups:\n  - {GOOD_GROUP}\ngroup_links:\n  - {{a: site0, b: mars, link: wan-10g}}\n",
    )
    assert "group_links[0].b: 'mars' is neither a group" in message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ClusterError) as info:
        load_cluster(tmp_path / "nope.yaml")
    assert str(info.value) == (
        f"{tmp_path / 'nope.yaml'}: no such file; give a YAML/JSON cluster file or a preset "
        "name (default, dgx-h100, dgx-a100, mixed-h100-a100, rtx4090-ethernet, two-sites, cpu)"
    )


def test_invalid_yaml_and_json_and_extension(tmp_path: Path) -> None:
    assert "not valid YAML" in load_error(tmp_path, "groups: [\n  - a: b: c\n")
    assert "not valid JSON" in load_error(tmp_path, "{groups: }", name="c.json")
    assert "unknown extension '.txt'" in load_error(tmp_path, "", name="c.txt")
    assert "(top level): must be a mapping" in load_error(tmp_path, "- just\n- a list\n")


def test_cluster_error_is_a_value_error_with_parts(tmp_path: Path) -> None:
    path = write(tmp_path, "groups: []\n")
    with pytest.raises(ValueError) as info:
        load_cluster(path)
    assert isinstance(info.value, ClusterError)
    assert info.value.source == str(path) and info.value.field == "groups"


# -- gpu mappings in files --------------------------------------------------------------------


def test_gpu_override_from_base(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "groups:\n  - name: a\n    gpu: {base: H100, name: H100-96GB, memory_bytes: 96GiB}\n"
        "    nodes: 1\n    gpus_per_node: 8\n",
    )
    gpu = load_cluster(path).groups[0].gpu
    assert gpu.name == "H100-96GB"
    assert gpu.memory_bytes == 96 * GiB
    assert gpu.peak("bfloat16") == 989e12  # the rest comes from the base spec
    assert "overridden: memory_bytes" in gpu.source


def test_custom_gpu_without_base(tmp_path: Path) -> None:
    text = (
        "groups:\n  - name: a\n    gpu: {name: X1, peak_flops: {bfloat16: 100TFLOP/s, "
        "float32: 20TFLOP/s}, "
        "memory_bytes: 32GiB, hbm_bandwidth: 1TB/s}\n    nodes: 1\n    gpus_per_node: 4\n"
        "    intra_link: pcie5\n"
    )
    gpu = load_cluster(write(tmp_path, text)).groups[0].gpu
    assert (gpu.peak("bfloat16"), gpu.memory_bytes, gpu.hbm_bandwidth) == (1e14, 32 * GiB, 1e12)
    message = load_error(tmp_path, text.replace(", float32: 20TFLOP/s", ""))
    assert "groups[0].gpu: GpuSpec X1: peak_flops needs float32 (the CUDA-core FP32" in message
    message = load_error(tmp_path, text.replace(", hbm_bandwidth: 1TB/s", ""))
    assert "groups[0].gpu: a GPU type not in the spec table needs hbm_bandwidth" in message
    message = load_error(tmp_path, text.replace("    intra_link: pcie5\n", ""))
    assert "groups[0].intra_link: required for the custom GPU 'X1'" in message


# -- topology queries -------------------------------------------------------------------------


def test_ranks_are_group_then_node_then_gpu() -> None:
    ranks = preset_cluster("mixed-h100-a100", 32).ranks()
    assert [r.rank for r in ranks] == list(range(32))
    assert (ranks[0].group, ranks[0].node, ranks[0].local_rank) == ("h100", 0, 0)
    assert (ranks[9].group, ranks[9].node, ranks[9].local_rank) == ("h100", 1, 1)
    assert (ranks[16].group, ranks[16].node, ranks[16].local_rank) == ("a100", 2, 0)
    assert (ranks[31].group, ranks[31].node, ranks[31].local_rank) == ("a100", 3, 7)


def test_link_between_groups(tmp_path: Path) -> None:
    cluster = preset_cluster("mixed-h100-a100")
    assert cluster.link_between_groups("h100", "h100").name == "ib-ndr"  # same group: inter-node
    # An explicit group link wins over the same-site default.
    path = write(
        tmp_path,
        "groups:\n"
        "  - {name: a, gpu: H100, nodes: 2, gpus_per_node: 8, inter_link: ib-ndr}\n"
        "  - {name: b, gpu: A100, nodes: 2, gpus_per_node: 8, inter_link: ib-hdr}\n"
        "group_links:\n  - {a: a, b: b, link: 100gbe}\n",
    )
    assert load_cluster(path).link_between_groups("b", "a").name == "100gbe"


def test_cluster_built_by_hand_without_wan_fails_at_query() -> None:
    h100 = gpu_spec("H100")
    cluster = Cluster(
        "hand",
        (
            DeviceGroup("a", h100, 1, 8, "nvlink4", "", site="x"),
            DeviceGroup("b", h100, 1, 8, "nvlink4", "", site="y"),
        ),
        (link_tier("nvlink4"),),
    )
    with pytest.raises(ValueError, match="different sites"):
        cluster.link_between_groups("a", "b")


# -- hardware tables --------------------------------------------------------------------------


def test_h100_matches_hardware_md() -> None:
    h100 = gpu_spec("H100")
    assert h100.peak("bfloat16") == 989e12
    assert h100.peak("float16") == 989e12
    assert h100.peak("float8_e4m3fn") == 1979e12
    assert h100.memory_bytes == 80 * GiB == 85_899_345_920
    assert h100.hbm_bandwidth == 3.35e12
    assert h100.sms == 132
    assert h100.nvlink_bandwidth == 450e9  # NVLink4 900 GB/s bidirectional / 2


@pytest.mark.parametrize(
    ("name", "bf16", "memory_gib", "hbm", "nvlink"),
    [
        ("A100-80GB", 312e12, 80, 2039e9, 300e9),
        ("A100-40GB", 312e12, 40, 1555e9, 300e9),
        ("H200", 989e12, 141, 4.8e12, 450e9),
        ("B200", 2250e12, 180, 8e12, 900e9),
        ("L40S", 362e12, 48, 864e9, 0.0),
        ("RTX4090", 165.2e12, 24, 1008e9, 0.0),
        ("A10", 125e12, 24, 600e9, 0.0),
        ("MI250X", 191.5e12, 64, 1.6e12, 200e9),
        ("MI300X", 1307e12, 192, 5.3e12, 448e9),
        ("V100", 125e12, 32, 900e9, 150e9),  # no bf16: the fp16 figure
    ],
)
def test_specs_match_hardware_md(
    name: str, bf16: float, memory_gib: int, hbm: float, nvlink: float
) -> None:
    spec = gpu_spec(name)
    assert spec.peak("bfloat16" if spec.supports("bf16") else "float16") == bf16
    assert spec.memory_bytes == memory_gib * GiB
    assert spec.hbm_bandwidth == hbm
    assert spec.nvlink_bandwidth == nvlink


def test_tf32_and_cuda_core_fp32_are_separate_entries() -> None:
    assert gpu_spec("A100").peak("tfloat32") == 156e12  # hardware.md: TF32 156
    assert gpu_spec("A100").peak("float32") == 19.5e12  # A100 datasheet: FP32 19.5
    assert gpu_spec("H100").peak("float32") == 67e12  # H100 SXM datasheet: FP32 67
    assert "bfloat16" not in dict(gpu_spec("V100").peak_flops)  # V100 has no BF16
    assert "tfloat32" not in dict(gpu_spec("V100").peak_flops)  # nor TF32
    with pytest.raises(KeyError, match="V100 has no peak FLOP/s for bfloat16"):
        gpu_spec("V100").peak("bfloat16")  # never silently another rate


def test_every_spec_is_cited_and_sane() -> None:
    for name, spec in GPU_SPECS.items():
        assert spec.name == name and spec.source
        assert spec.sms > 0 and spec.memory_bytes > 0
        assert all(v > 0 for _, v in spec.peak_flops)


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("h100", "H100"),
        ("H100-SXM", "H100"),
        ("H100 SXM5", "H100"),
        ("A100", "A100-80GB"),
        ("a100_80gb", "A100-80GB"),
        ("A100-40GB", "A100-40GB"),
        ("RTX 4090", "RTX4090"),
        ("mi250x", "MI250X"),
        ("cpu", "CPU"),
    ],
)
def test_gpu_aliases(alias: str, canonical: str) -> None:
    assert gpu_spec(alias) is GPU_SPECS[canonical]


def test_unknown_gpu_error() -> None:
    with pytest.raises(UnknownGpuError) as info:
        gpu_spec("H1000")
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert all(name in message for name in known_gpus())


@pytest.mark.parametrize(
    ("tier", "bandwidth", "kind"),
    [
        ("nvlink3", 300e9, LinkKind.NVLINK),
        ("nvlink4", 450e9, LinkKind.NVLINK),
        ("nvlink5", 900e9, LinkKind.NVLINK),
        ("pcie4", 32e9, LinkKind.PCIE),
        ("pcie5", 64e9, LinkKind.PCIE),
        ("ib-hdr", 25e9, LinkKind.INFINIBAND),
        ("ib-ndr", 50e9, LinkKind.INFINIBAND),
        ("ib-xdr", 100e9, LinkKind.INFINIBAND),
        ("roce-400g", 50e9, LinkKind.ROCE),
        ("100gbe", 12.5e9, LinkKind.ETHERNET),
        ("25gbe", 3.125e9, LinkKind.ETHERNET),
        ("wan-10g", 1.25e9, LinkKind.WAN),
        ("wan-100g", 12.5e9, LinkKind.WAN),
    ],
)
def test_link_tiers(tier: str, bandwidth: float, kind: LinkKind) -> None:
    link = link_tier(tier)
    assert (link.bandwidth, link.kind) == (bandwidth, kind)
    assert link.latency > 0 and 0 < link.efficiency <= 1


def test_unknown_link_tier() -> None:
    with pytest.raises(UnknownLinkError) as info:
        link_tier("nvlink9")
    assert all(name in str(info.value) for name in known_links())


def test_profile_fields_stay_out_of_uncalibrated_clusters_and_round_trip(tmp_path):
    """An uncalibrated cluster's layout (and so its fingerprint) has no profile fields; a
    calibrated one carries its profile and measured GEMM efficiency through dump/load and
    to_dict/from_dict."""
    from meshplan.ir.cluster import ClusterProfile, CollectiveCurve, GemmMeasurement, TierProfile
    from meshplan.ir.cluster_io import cluster_from_dict, dump_cluster, load_cluster

    c = Cluster.preset("dgx-h100", 16)
    d = c.to_dict()
    assert "profile" not in d and "gemm_efficiency" not in d["groups"][0]["gpu"]
    prof = ClusterProfile(
        tiers=(
            TierProfile(
                "nvlink4", True, 8, 8, 8, (CollectiveCurve("all_gather", 8, ((2**20, 5e-5),)),)
            ),
        ),
        gemm=(GemmMeasurement("H100", "bfloat16", 4096, 4096, 4096, 2e-4, 989e12),),
    )
    cal = c.with_profile(prof)
    assert cal.groups[0].gpu.gemm_efficiency == pytest.approx(2 * 4096**3 / 2e-4 / 989e12)
    assert cal.link("nvlink4").bandwidth == pytest.approx(2**20 * 7 / 8 / 5e-5)
    assert cal.fingerprint() != c.fingerprint()
    assert cluster_from_dict(cal.to_dict()) == cal
    for name in ("c.yaml", "c.json"):
        dump_cluster(cal, tmp_path / name)
        assert load_cluster(tmp_path / name) == cal
