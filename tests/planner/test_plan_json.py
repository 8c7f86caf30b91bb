"""Plan JSON v1: canonical bytes, round trip, atomic writes, and one-line rejections."""

import dataclasses
import json

import meshplan
import pytest
from meshplan.ir.plan import PLAN_VERSION, Plan, PlanError


@pytest.fixture(scope="module")
def graph():
    model, inputs = meshplan.models.get("tiny", seq_len=128, micro_batch=1)
    return meshplan.trace(model, *inputs, name="tiny")


@pytest.fixture(scope="module")
def cluster():
    return meshplan.Cluster.preset("dgx-h100", gpus=16)


@pytest.fixture(scope="module")
def plan(graph, cluster):
    return meshplan.plan(graph, cluster=cluster, global_batch=64)


def test_identical_inputs_give_identical_bytes(graph, cluster, plan):
    again = meshplan.plan(graph, cluster=cluster, global_batch=64)
    assert plan.to_json() == again.to_json()


def test_round_trip_is_exact(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.to_json(path)
    loaded = Plan.from_json(path)
    assert loaded.to_json() == plan.to_json()
    assert loaded.parallel == plan.parallel and loaded.stages == plan.stages
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left behind


def test_contents_follow_the_contract(plan, cluster):
    d = json.loads(plan.to_json())
    assert d["version"] == PLAN_VERSION
    deg = d["degrees"]
    assert deg["dp"] * deg["tp"] * deg["pp"] * deg["cp"] <= cluster.world_size
    assert d["global_batch"] == 64 == deg["dp"] * d["micro_batch"] * d["num_microbatches"]
    assert len(d["ranks"]) == cluster.world_size
    used = [r for r in d["ranks"] if len(r) == 8]
    # every mesh coordinate is taken by exactly one rank
    coords = {tuple(r[4:]) for r in used}
    assert len(coords) == len(used) == deg["dp"] * deg["tp"] * deg["pp"] * deg["cp"]
    assert d["predicted"]["fits"] is True
    assert abs(sum(d["predicted"]["breakdown"].values()) - d["predicted"]["step_time_s"]) < 1e-6
    assert d["quantization"] and d["compression"]


def test_explain_names_mesh_stages_memory_and_time(plan):
    text = plan.explain()
    for needle in ("degrees", "stage 0", "GiB", "predicted: step", "solver"):
        assert needle in text


def test_explain_suggests_a_larger_budget_for_a_wide_gap(plan):
    """A plan the search could not prove within 10% of the best says so and names the knob;
    an optimal plan, or a small gap, adds nothing."""
    hint = "a larger --time-limit"
    assert hint not in plan.explain()
    cases = (("feasible", 0.5, True), ("feasible", 0.02, False), ("optimal", 0.0, False))
    for status, gap, shown in cases:
        solver = dataclasses.replace(plan.solver, status=status, gap=gap)
        other = dataclasses.replace(plan, solver=solver)
        assert (hint in other.explain()) is shown, (status, gap)
        if shown:
            assert "as little as 50% of this step time" in other.explain()


def _write(tmp_path, data):
    path = tmp_path / "p.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_rejects_unknown_version(plan, tmp_path):
    d = json.loads(plan.to_json())
    d["version"] = "meshplan.plan/v99"
    with pytest.raises(PlanError, match="unsupported plan version"):
        Plan.from_json(_write(tmp_path, d))


def test_rejects_corrupt_file(plan, tmp_path):
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json(_write(tmp_path, plan.to_json()[:-40]))


def test_rejects_bad_field_naming_it(plan, tmp_path):
    d = json.loads(plan.to_json())
    d["degrees"]["tp"] = 0
    with pytest.raises(PlanError, match=r"degrees\.tp"):
        Plan.from_json(_write(tmp_path, d))


def test_rejects_cluster_mismatch(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.to_json(path)
    other = meshplan.Cluster.preset("dgx-a100", gpus=16)
    with pytest.raises(PlanError, match="made for cluster"):
        Plan.from_json(path, cluster=other)
    Plan.from_json(path, cluster=plan.cluster)  # the right cluster is accepted


def test_rejects_edited_cluster_spec(plan, tmp_path):
    d = json.loads(plan.to_json())
    d["cluster"]["spec"]["groups"][0]["nodes"] += 1
    with pytest.raises(PlanError, match="fingerprint"):
        Plan.from_json(_write(tmp_path, d))


def test_uneven_microbatch_shares_round_trip(plan, tmp_path):
    """Per-group micro-batch shares (uneven DP across GPU types) survive the JSON."""
    import dataclasses

    stage = plan.stages[0]
    group = stage.replicas[0][0]
    shares = ((group, plan.parallel.num_microbatches),)
    edited = dataclasses.replace(
        plan, stages=(dataclasses.replace(stage, microbatches=shares),) + plan.stages[1:]
    )
    loaded = Plan.from_json(edited.to_json())
    assert loaded.stages[0].microbatches == shares
    assert json.loads(edited.to_json())["stages"][0]["microbatches"] == [list(shares[0])]
