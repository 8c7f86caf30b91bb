"""`meshplan estimate --layout` / `estimate(layout=...)`: a user's stage list (another planner's
plan) priced as given. Oracles: the planner's own placement of the same configuration, and
`predict` on hand-built `StagePlacement`s."""

from __future__ import annotations

import meshplan
import pytest
from meshplan.cost_model import predict
from meshplan.ir import Parallel
from meshplan.layout import LayoutError, stages_from_layout
from meshplan.passes.partition import layer_counts

from tests.cost_model.test_stage_tp_layouts import _sailor_like
from tests.planner.test_cli import run
from tests.synthetic import h100_cluster, transformer_graph


def _as_layout(graph, stages):
    counts = layer_counts(graph, [(st.first_unit, st.last_unit) for st in stages])
    return [
        {"layers": n, "replicas": dict(st.replicas), "tp": dict(st.group_tp)}
        for n, st in zip(counts, stages, strict=True)
    ]


def test_a_layout_of_the_default_placement_prices_as_that_configuration():
    graph = transformer_graph(8, 1024, 8, 8, 4096, 32000, 1024, 1)
    cluster = h100_cluster(2)
    pins = Parallel(dp=4, tp=2, pp=2, micro_batch=1, global_batch=32)
    plain = meshplan.estimate_plan(graph, cluster=cluster, parallel=pins)
    layout = [{"layers": 4, "replicas": {"h100": 4}, "tp": {"h100": 2}}] * 2
    given = meshplan.estimate_plan(
        graph, cluster=cluster, parallel=Parallel(micro_batch=1, global_batch=32), layout=layout
    )
    assert [(s.first_unit, s.last_unit, s.replicas) for s in given.stages] == [
        (s.first_unit, s.last_unit, s.replicas) for s in plain.stages
    ]
    assert given.parallel == plain.parallel
    assert given.predicted.step_time_s == pytest.approx(plain.predicted.step_time_s, rel=1e-9)


def test_a_sailor_like_layout_prices_as_predict_on_its_stages():
    graph, cluster, p, stages = _sailor_like()
    want = predict(graph, cluster, p, stages, dtype="float16")
    pins = Parallel(micro_batch=p.micro_batch, global_batch=p.global_batch,
                    sequence_parallel=False, recompute=p.recompute)  # fmt: skip
    got = meshplan.estimate(
        graph, cluster=cluster, parallel=pins, precision="fp16", layout=_as_layout(graph, stages)
    )
    assert got.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
    assert got.memory == want.memory


@pytest.mark.parametrize(
    "change,message",
    [
        ({"replicas": {"h200": 4}}, "field replicas: no device group 'h200'"),
        ({"replicas": {"h100": 2}}, "field replicas adds up to 2, stage 0's to 4"),
        ({"tp": {"h100": 0}}, "field tp.h100 must be a positive integer"),
        ({"layers": 5}, "field layers: layer counts (4, 5)"),
        ({"layers": 0}, "field layers must be a positive integer"),
        ({"pipeline": 1}, "unknown field 'pipeline'"),
    ],
)
def test_layout_errors_name_the_stage_and_field(change, message):
    graph = transformer_graph(8, 1024, 8, 8, 4096, 32000, 1024, 1)
    base = {"layers": 4, "replicas": {"h100": 4}, "tp": {"h100": 2}}
    with pytest.raises(LayoutError) as e:
        stages_from_layout(graph, h100_cluster(2), [base, {**base, **change}])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(("layout stage 1", "layout:"))


def test_cli_layout_prices_the_file_and_refuses_a_bad_one_in_one_line(tmp_path):
    good = tmp_path / "layout.yaml"
    good.write_text(
        "stages:\n"
        "  - {layers: 16, replicas: {h100: 4}, tp: {h100: 2}}\n"
        "  - {layers: 16, replicas: {h100: 4}, tp: {h100: 2}}\n"
    )
    r = run("estimate", "--cluster", "dgx-h100", "--gpus", "16", "--layout", str(good),
            "--global-batch", "32")  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "tokens/s" in r.stdout and "pp" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - {layers: 32, replicas: {a100: 8}}\n")
    r = run("estimate", "--cluster", "dgx-h100", "--gpus", "16", "--layout", str(bad))
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.exit_code != 0 and len(lines) == 1
    assert "layout stage 0: field replicas: no device group 'a100'" in lines[0]
