"""Configurations that cannot work get a one-line error naming the broken constraint:
TP not dividing heads, PP beyond the layers, dp*tp*pp*cp != GPUs, EP not dividing experts."""

from __future__ import annotations

import pytest
from meshplan.api import estimate
from meshplan.cli import app
from meshplan.ir import Parallel
from typer.testing import CliRunner

from tests.synthetic import h100_cluster, transformer_graph

DENSE = transformer_graph(2, 256, 4, 4, 1024, 1000, 64, 1)  # 2 layers, 4 heads
MOE = transformer_graph(2, 256, 4, 4, 1024, 1000, 64, 1, experts=8, top_k=2)


@pytest.mark.parametrize(
    "graph,parallel,message",
    [
        (DENSE, Parallel(tp=3, dp=1, pp=1), r"tp=3 does not divide the model's heads \(4\)"),
        (DENSE, Parallel(tp=1, pp=3, dp=1), r"pp=3 exceeds the model's 2 layers"),
        (
            DENSE,
            Parallel(dp=2, tp=2, pp=1, cp=1),
            r"dp\*tp\*pp\*cp = 2\*2\*1\*1 = 4 must equal the GPU count \(8",
        ),
        (DENSE, Parallel(dp=16, tp=1, pp=1), r"= 16 GPUs but cluster .* has 8"),
        (
            MOE,
            Parallel(dp=6, tp=1, pp=1, ep=3, global_batch=6),
            r"ep=3 does not divide the model's experts \(8\)",
        ),
        (DENSE, Parallel(dp=2, tp=1, pp=1, ep=2), r"ep=2 but the model has no experts"),
    ],
)
def test_broken_constraint_is_named(graph, parallel, message):
    with pytest.raises(ValueError, match=message) as e:
        estimate(graph, (), h100_cluster(1), parallel)
    assert "\n" not in str(e.value)


def test_cli_reports_the_constraint_in_one_line():
    r = CliRunner().invoke(
        app, ["estimate", "--model", "tiny", "--cluster", "cpu", "--gpus", "4", "--tp", "3"]
    )
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: tp=3 does not divide")
