"""Measured-only GPU variants (`hardware.VARIANT_SPECS`) named in cluster files."""

from __future__ import annotations

import pytest
from meshplan.ir.cluster import Cluster
from meshplan.ir.cluster_io import ClusterError, cluster_from_dict, cluster_to_file_dict
from meshplan.ir.hardware import H100_96GB_500W, VARIANT_SPECS, variant_spec


def _file(gpu: str, **extra) -> dict:
    group = {"name": "g", "gpu": gpu, "nodes": 2, "gpus_per_node": 8, "inter_link": "ib-ndr"}
    return {"name": "c", "groups": [{**group, **extra}]}


def test_a_cluster_file_names_the_power_capped_h100_and_round_trips():
    cluster = cluster_from_dict(_file("H100-96GB-500W", intra_link="nvlink4"))
    assert cluster.groups[0].gpu == H100_96GB_500W
    written = cluster_to_file_dict(cluster)
    assert written["groups"][0]["gpu"] == "H100-96GB-500W"  # by name, not a copied spec
    assert cluster_from_dict(written).fingerprint() == cluster.fingerprint()
    # the plan JSON's form (every spec field) reads back to the same cluster too
    assert cluster_from_dict(cluster.to_dict()).fingerprint() == cluster.fingerprint()


def test_a_variant_needs_its_links_stated():
    with pytest.raises(ClusterError, match=r"groups\[0\]\.intra_link"):
        cluster_from_dict(_file("H100-96GB-500W"))


@pytest.mark.parametrize("name", sorted(VARIANT_SPECS))
def test_every_variant_resolves_by_its_own_name(name):
    assert variant_spec(name) is VARIANT_SPECS[name]
    assert isinstance(cluster_from_dict(_file(name, intra_link="pcie4")), Cluster)
