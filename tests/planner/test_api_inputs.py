"""What the Python API takes as a model and a cluster: the same names the CLI takes, and a
one-line TypeError for anything else (not an AttributeError from deep inside)."""

from __future__ import annotations

from pathlib import Path

import meshplan
import pytest
from meshplan.api import as_cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    model, inputs = meshplan.models.get("tiny")
    return meshplan.trace(model, *inputs)


def test_a_cluster_by_preset_name_or_file_is_the_cli_s():
    assert as_cluster("H100") == meshplan.Cluster.preset("H100")
    path = ROOT / "examples" / "clusters" / "mixed_h100_a100.yaml"
    assert as_cluster(str(path)) == meshplan.Cluster.load(path)
    assert as_cluster(path) == meshplan.Cluster.load(path)
    assert as_cluster(None) == meshplan.Cluster.preset("default")


def test_plan_and_estimate_take_a_cluster_name(tiny):
    by_name = meshplan.plan(tiny, cluster="dgx-h100", time_limit_s=1.0)
    by_object = meshplan.plan(tiny, cluster=meshplan.Cluster.preset("dgx-h100"), time_limit_s=1.0)
    assert by_name.to_json() == by_object.to_json()
    assert meshplan.estimate(tiny, cluster="H100").step_time_s > 0


@pytest.mark.parametrize("bad", [3, ["H100"]])
def test_other_clusters_are_a_type_error(tiny, bad):
    with pytest.raises(TypeError, match="cluster must be a meshplan Cluster"):
        meshplan.estimate(tiny, cluster=bad)


@pytest.mark.parametrize("bad", [None, 42])
def test_a_model_that_is_neither_module_nor_graph_is_a_type_error(bad):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        meshplan.plan(bad)


def test_a_model_by_preset_name_is_the_cli_s(tiny):
    assert meshplan.api.as_graph("tiny") == tiny
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        meshplan.estimate("no-such-model")
