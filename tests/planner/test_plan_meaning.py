"""A plan file means what it says or is refused (unit tier, no processes).

`Plan.from_json` recomputes every derived fact of a plan (world size and mesh from the
degrees, batch arithmetic, stages and ranks, schedule rules, fingerprints) and refuses a
disagreement with one line naming the field; a field changed after the plan was made is
refused by its digest. The property test edits one field of real plans at a time with a
random value: each edit is refused with a one-line `PlanError`, or the loaded plan equals
the original in everything the runtime reads (the edit was a no-op, or to a free field such
as "predicted" or "meshplan_version"). `tests/runtime/test_edited_plans.py` runs the accepted
edits of the same strategy and compares each run with the unedited plan's.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import meshplan
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshplan import Parallel, Plan, PlanError
from meshplan.cli import app
from meshplan.ir.plan import plan_problem
from typer.testing import CliRunner

LAYOUTS = {
    "dp8": Parallel(dp=8, micro_batch=1, global_batch=16),
    "dp4-tp2": Parallel(dp=4, tp=2, micro_batch=2, global_batch=16),
    "dp2-pp2-tp2": Parallel(dp=2, pp=2, tp=2, micro_batch=1, global_batch=8, schedule="1f1b"),
    "dp4-pp2-interleaved": Parallel(
        dp=4, pp=2, micro_batch=1, global_batch=16, schedule="interleaved_1f1b", virtual_stages=2
    ),
    "dp2-cp2-idle": Parallel(dp=2, cp=2, micro_batch=2, global_batch=8, zero=3),
}

# What the runtime reads of a plan: everything but `predicted`, `solver` and `version`.
RUNTIME_FIELDS = (
    "model",
    "cluster",
    "parallel",
    "stages",
    "ranks",
    "placements",
    "compression",
    "quantization",
)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    model, inputs = meshplan.models.transformer(
        layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=64
    )
    graph = meshplan.trace(model, *inputs, name="t4")
    cluster = meshplan.Cluster.preset("cpu", gpus=8)
    return {
        name: meshplan.estimate_plan(graph, cluster=cluster, parallel=p)
        for name, p in LAYOUTS.items()
    }


def edited(plan: Plan, path: tuple, value: object = None, delete: bool = False) -> str:
    """The plan's JSON with the value at `path` replaced (or deleted)."""
    data = json.loads(plan.to_json())
    *parent, last = path
    node = data
    for key in parent:
        node = node[key]
    if delete:
        del node[last]
    else:
        node[last] = value
    return json.dumps(data)


def refusal(text: str) -> str:
    with pytest.raises(PlanError) as info:
        Plan.from_json(text)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_layouts_load_back_unchanged(plans):
    for plan in plans.values():
        assert plan_problem(plan) is None
        assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


# -- hand edits of a plan file, each refused naming its field --------------------------------

EDITS = [
    # (layout, path, value, words the one-line refusal must contain)
    ("dp4-tp2", ("degrees", "tp"), 4, ["mesh.shape", "tp=4"]),
    ("dp4-tp2", ("degrees", "dp"), 2, ["mesh.shape", "dp=2"]),
    ("dp8", ("micro_batch",), 3, ["global_batch=16", "micro_batch", "not divisible"]),
    ("dp8", ("global_batch",), 20, ["global_batch=20", "not divisible"]),
    ("dp8", ("global_batch",), 24, ["num_microbatches", "24"]),
    ("dp8", ("num_microbatches",), 5, ["num_microbatches is 5"]),
    ("dp8", ("cluster", "world_size"), 16, ["cluster.world_size"]),
    ("dp8", ("model", "fingerprint"), "not-a-hash", ["model.fingerprint"]),
    ("dp8", ("model", "fingerprint"), "0123456789abcdef", ["model.fingerprint", "digests"]),
    ("dp8", ("model", "seq_len"), 128, ["model.seq_len"]),
    ("dp8", ("schedule",), "zero_bubble", ["schedule zero_bubble needs a pipeline", "pp=1"]),
    ("dp8", ("schedule",), "interleaved_1f1b", ["field schedule"]),
    ("dp8", ("schedule",), "gpipe", ["field schedule"]),
    ("dp8", ("zero",), 2, ["field zero"]),
    ("dp8", ("ranks", 3, 5), 0, ["ranks[3]"]),
    ("dp8", ("ranks", 0), [0, 0, 0, "cpu", 0, 0], ["ranks[0] has 6 entries"]),
    ("dp2-pp2-tp2", ("stages", 0, "last_unit"), 2, ["stages[1].first_unit"]),
    ("dp2-pp2-tp2", ("stages", 1, "replicas", 0, "count"), 3, ["stages[1].replicas", "dp=2"]),
    ("dp2-pp2-tp2", ("stages", 0, "units", 0), "layers.0", ["stages[0].units"]),
    ("dp2-pp2-tp2", ("schedule",), "interleaved_1f1b", ["field schedule"]),
    ("dp4-pp2-interleaved", ("virtual_stages",), 3, ["chunks", "3 per rank"]),
    ("dp2-cp2-idle", ("ranks", 6), [6, 0, 6, "cpu", 0, 0, 1, 0], ["ranks[6]"]),
    ("dp2-cp2-idle", ("mesh", "shape"), [1, 2, 1, 1], ["mesh.shape"]),
    ("dp2-cp2-idle", ("degrees", "ep"), 2, ["field degrees.ep"]),
    ("dp2-cp2-idle", ("predicted", "step_time_s"), "fast", ["predicted.step_time_s"]),
]


@pytest.mark.parametrize("layout, path, value, words", EDITS, ids=lambda x: str(x)[:24])
def test_edit_is_refused_naming_the_field(plans, layout, path, value, words):
    message = refusal(edited(plans[layout], path, value))
    for word in words:
        assert word in message, message


def test_free_fields_may_change(plans):
    plan = plans["dp4-tp2"]
    for path, value in (
        (("meshplan_version",), "9.9.9"),
        (("predicted", "tokens_per_s"), 1.0),
        (("solver", "status"), "optimal"),
    ):
        again = Plan.from_json(edited(plan, path, value))
        assert again.parallel == plan.parallel and again.ranks == plan.ranks


def test_plans_written_before_digests_still_load(plans):
    plan = plans["dp2-pp2-tp2"]
    old = edited(plan, ("digests",), delete=True)
    assert Plan.from_json(old).to_json() == plan.to_json()
    # ... and their derived facts are still checked
    data = json.loads(old)
    data["global_batch"] = 7
    assert "not divisible" in refusal(json.dumps(data))


def test_a_broken_plan_made_in_python_is_refused_too(plans):
    """Digests match whatever `to_json` wrote; the meaning checks catch a plan built wrong."""
    plan = plans["dp8"]
    broken = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, micro_batch=3))
    assert "not divisible" in plan_problem(broken)
    assert "not divisible" in refusal(broken.to_json())
    swapped = dataclasses.replace(plan, ranks=(plan.ranks[1], plan.ranks[0], *plan.ranks[2:]))
    assert "ranks[0]" in refusal(swapped.to_json())


def test_validate_and_launch_refuse_an_edited_plan(plans, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(edited(plans["dp4-tp2"], ("degrees", "tp"), 4))
    runner = CliRunner()
    for args in (
        ["validate", str(path)],
        ["launch", str(path), "--dry-run", "--", "python", "train.py"],
    ):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and "mesh.shape" in lines[0]


# -- property: refused, or the same plan to the runtime ----------------------------------------


def _paths(node, prefix=()):
    """Every path to a value in a JSON tree (containers and leaves)."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


WORDS = ["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "none", "full", "selective"]
WORDS += ["cpu", "layers.0", "<epilogue>", "bfloat16", "float32", "0123456789abcdef", ""]
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 70),
    st.floats(allow_nan=False, width=32),
    st.sampled_from(WORDS),
    st.text(max_size=6),
)
any_json = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


def _value_near(original):
    """Values like the original (so most edits pass the schema and reach the meaning
    checks), and now and then anything."""
    if isinstance(original, bool):
        like = st.just(not original)
    elif isinstance(original, int):
        like = st.sampled_from([original - 1, original + 1, 2 * original, original // 2, 0, 1])
        like = like | st.integers(0, 16) | st.just(float(original))
    elif isinstance(original, float):
        like = st.floats(0, 1e6, allow_nan=False) | st.just(int(original))
    elif isinstance(original, str):
        like = st.sampled_from(WORDS) | st.text(max_size=6) | st.just(original.upper())
    elif isinstance(original, list) and len(original) > 1:
        like = st.permutations(original) | st.just(original[:-1]) | st.just(original * 2)
    elif isinstance(original, dict) and original:
        like = st.sampled_from(sorted(original)).map(
            lambda k: {kk: v for kk, v in original.items() if kk != k}
        )
    else:
        like = json_leaf
    return st.one_of(like, like, like, any_json)


@st.composite
def plan_edits(draw, originals):
    name = draw(st.sampled_from(sorted(originals)))
    data = originals[name]
    # a top-level field first, so the big ones (cluster.spec, ranks) do not take every draw
    key = draw(st.sampled_from(sorted(data)))
    path = draw(st.sampled_from(list(_paths(data[key], (key,)))))
    node = data
    for key in path:
        node = node[key]
    delete = isinstance(path[-1], str) and draw(st.integers(0, 9)) == 0
    value = None if delete else draw(_value_near(node))
    return name, path, value, delete


def apply_edit(doc: dict, path: tuple, value: object, delete: bool) -> dict:
    """A copy of plan JSON `doc` with the value at `path` replaced by `value` (or deleted)."""
    doc = copy.deepcopy(doc)
    *parent, last = path
    node = doc
    for key in parent:
        node = node[key]
    if delete:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.fixture(scope="module")
def originals(plans):
    return {name: json.loads(plan.to_json()) for name, plan in plans.items()}


@settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_every_edit_is_refused_or_changes_nothing_the_runtime_reads(plans, originals, data):
    name, path, value, delete = data.draw(plan_edits(originals))
    doc = apply_edit(originals[name], path, value, delete)
    try:
        loaded = Plan.from_json(json.dumps(doc))
    except PlanError as e:
        assert "\n" not in str(e) and str(e), str(e)
        return
    plan = plans[name]
    for field in RUNTIME_FIELDS:
        assert getattr(loaded, field) == getattr(plan, field), (path, value, delete, field)
