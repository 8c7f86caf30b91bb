"""An edited plan file is refused, or it trains exactly as the unedited plan (multi-process tier).

The runtime half of the property in `tests/planner/test_plan_meaning.py`: edits drawn by the
same strategy (`plan_edits`: one field of a real plan at a time, a random value) to plans of
the tiny model on 2 gloo ranks. Every edit `Plan.from_json` accepts (what `meshplan validate`
and `launch` load) is run as a launched script would run it: each rank loads the edited JSON
text, applies it and trains `STEPS` steps, in the same launch as the unedited plan. Oracle:
the unedited plan's run; the losses of every step and every parameter after every step (with
SGD, so the gradients) must be bit-identical (same ranks, same reduction order).

Accepted edits that load to equal plans (`Plan.__eq__`: every field) give the runtime the same
input, so one of them is run for all; most accepted edits are of free fields (`predicted`,
`solver`, `meshplan_version`, `digests`), and a run shows that the runtime reads none of them.

Default tier: `DRAWS` derandomized draws (a fixed sample) plus `FREE_EDITS` on every layout;
slow tier: `SLOW_DRAWS` random draws.
"""

from __future__ import annotations

import json

import meshplan
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshplan import Parallel, Plan, PlanError
from meshplan.runtime import run_local

from tests.planner.test_plan_meaning import apply_edit, plan_edits
from tests.runtime.harness import distributed_run, graph, make_plan

STEPS = 2
DRAWS = 150
SLOW_DRAWS = 1500

# layout -> the Parallel of a 2-rank plan of the tiny model; one layout per runtime path that
# reads a different part of a plan (DDP; placements under TP; stages and schedule under PP;
# compression decisions: the planner codes DP across a slow WAN, `CODED`)
LAYOUTS = {
    "dp2": dict(dp=2, micro_batch=2, global_batch=8),
    "tp2": dict(tp=2, micro_batch=2, global_batch=4),
    "pp2-1f1b": dict(pp=2, micro_batch=1, global_batch=4, schedule="1f1b"),
    "dp2-lossless": dict(dp=2, micro_batch=2, global_batch=8),
}
CODED = {"dp2-lossless"}

# Edits of the fields the runtime must not read, on every layout (path, value; None: delete).
FREE_EDITS = (
    (("meshplan_version",), "9.9.9"),
    (("predicted", "step_time_s"), 123.0),
    (("solver", "status"), "optimal"),
    (("digests",), None),
)


def _plans() -> dict[str, Plan]:
    from tests.runtime.test_parity_compression import two_sites

    out = {}
    for name, fields in LAYOUTS.items():
        if name in CODED:
            out[name] = meshplan.plan(
                graph(), cluster=two_sites(1), parallel=Parallel(**fields), compress="auto"
            )
            coded = out[name].compression.decisions
            assert {d.method for d in coded if d.tensor == "gradients"} == {"lossless"}, name
        else:
            out[name] = make_plan(2, **fields)
    return out


def _accepted(plans: dict[str, Plan], draws: int, derandomize: bool) -> dict[str, list]:
    """Layout -> [(edited JSON text, [edits that load to this plan])]: every edit of
    `FREE_EDITS` and of `draws` draws of `plan_edits` that `Plan.from_json` accepts, one
    entry per distinct loaded plan (the unedited plan's own JSON first)."""
    originals = {name: json.loads(plan.to_json()) for name, plan in plans.items()}
    found: dict[str, list] = {name: [(plan.to_json(), plan, [])] for name, plan in plans.items()}

    def consider(name, path, value, delete):
        text = json.dumps(apply_edit(originals[name], path, value, delete))
        try:
            loaded = Plan.from_json(text)
        except PlanError:
            return False
        edit = f"{name}: {'del ' if delete else ''}{'.'.join(map(str, path))}" + (
            "" if delete else f" = {value!r}"
        )
        for _, plan, edits in found[name]:
            if loaded == plan:
                edits.append(edit)
                return True
        found[name].append((text, loaded, [edit]))
        return True

    for name in plans:
        for path, value in FREE_EDITS:
            assert consider(name, path, value, value is None), (name, path, "refused")

    @settings(
        max_examples=draws,
        derandomize=derandomize,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def draw(data):
        consider(*data.draw(plan_edits(originals)))

    draw()
    return {name: [(text, edits) for text, _, edits in runs] for name, runs in found.items()}


def _run_texts(texts: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Inside a rank: every plan text of every layout loaded as a launched script loads it,
    applied and trained (`harness.distributed_run`); the first of each layout is the
    unedited plan."""
    out = {}
    for name, runs in texts.items():
        out[name] = []
        for i, text in enumerate(runs):
            try:
                result = distributed_run(Plan.from_json(text), steps=STEPS, count_step=None)
            except Exception as e:
                raise AssertionError(f"{name} plan {i} (accepted) failed to run: {e}") from e
            result.pop("seconds")
            out[name].append(result)
    return out


def _check_runs(draws: int, derandomize: bool) -> int:
    """Run every accepted edit next to its unedited plan; returns how many edited plans ran."""
    found = _accepted(_plans(), draws, derandomize)
    texts = {name: [text for text, _ in runs] for name, runs in found.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the forked ranks inherit it
    try:
        results = run_local(_run_texts, 2, texts, timeout_s=600)
    finally:
        torch.set_num_threads(threads)
    edited = 0
    for name, runs in found.items():
        for rank, r in enumerate(results):
            want = r[name][0]
            for (_, edits), got in zip(runs[1:], r[name][1:]):
                why = f"rank {rank}, {edits}"
                assert got["losses"] == want["losses"], (why, got["losses"], want["losses"])
                assert got["coords"] == want["coords"] and got["plan_rank"] == want["plan_rank"]
                assert len(got["states"]) == len(want["states"]) == STEPS + 1
                for step, (a, b) in enumerate(zip(got["states"], want["states"])):
                    assert a.keys() == b.keys(), why
                    for k in b:
                        assert torch.equal(a[k], b[k]), f"{why}: {k} after step {step}"
        edited += len(runs) - 1
    return edited


def test_accepted_edits_train_as_the_unedited_plan():
    # every layout ran at least its edits of predicted and solver (each loads to its own plan)
    assert _check_runs(DRAWS, derandomize=True) >= 2 * len(LAYOUTS)


@pytest.mark.slow
def test_accepted_edits_train_as_the_unedited_plan_larger_sample():
    assert _check_runs(SLOW_DRAWS, derandomize=False) >= 2 * len(LAYOUTS)
