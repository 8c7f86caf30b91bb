"""`Engine.dp_overlap`: gradients reduced after the last backward (DeepSpeed's pipeline engine,
DeepSpeed ZeRO-0-2 without `overlap_comm`, Megatron-LM without `--overlap-grad-reduce`).

Oracle: the step's formula (`cost_model.simulate`): the exposed DP time of a stage is
C - eta min(C, W); with no window it is the whole traffic C, the tables' own `dp_single`."""

from __future__ import annotations

import meshplan
import pytest
from meshplan.api import as_graph, complete_parallel, default_stages
from meshplan.cost_model import pricer_for
from meshplan.cost_model.engine import Engine
from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY
from meshplan.cost_model.simulate import predict
from meshplan.cost_model.tables import plan_tables
from meshplan.ir import Parallel
from meshplan.passes.partition import place_stages

pytestmark = pytest.mark.usefixtures("gpu_time_only")


@pytest.fixture(scope="module")
def setup():
    graph = as_graph(*meshplan.models.get("llama3-8b", seq_len=1024))
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=16)
    return graph, cluster


def _priced(setup, zero: int, engine: Engine):
    graph, cluster = setup
    p = complete_parallel(
        graph, cluster, Parallel(dp=16, tp=1, pp=1, micro_batch=1, global_batch=64, zero=zero)
    )
    ranges = default_stages(graph, p)
    tables = plan_tables(pricer_for(graph, cluster, engine=engine), p, ranges)
    pred = predict(graph, cluster, p, place_stages(cluster, p, ranges), engine=engine)
    return tables, dict(pred.breakdown)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_reduced_after_the_backward_the_whole_traffic_is_exposed(setup, zero):
    after = Engine(dp_overlap=False)
    tables, breakdown = _priced(setup, zero, after)
    (g,) = tables.window[0]
    assert tables.window[0][g] == 0.0
    comm = tables.dp_single[0][g]
    assert breakdown["dp_comm_exposed"] == pytest.approx(comm, rel=1e-9)
    # overlapped, the same traffic hides behind its window
    over, b_over = _priced(setup, zero, Engine())
    window = over.window[0][g]
    assert window > 0 and over.dp_single[0][g] == pytest.approx(comm)
    hidden = comm - OVERLAP_EFFICIENCY * min(comm, window)
    assert b_over["dp_comm_exposed"] == pytest.approx(hidden, rel=1e-9)
    assert b_over["dp_comm_exposed"] < breakdown["dp_comm_exposed"]


def test_zero3_keeps_its_per_unit_overlap(setup):
    """ZeRO-3 gathers and reduces around every micro-batch (FSDP, DeepSpeed ZeRO-3 prefetch):
    the flag does not apply."""
    after, _ = _priced(setup, 3, Engine(dp_overlap=False))
    over, _ = _priced(setup, 3, Engine())
    assert after.window == over.window and all(w > 0 for w in after.window[0].values())


def test_the_engine_names_it():
    assert Engine(dp_overlap=False).describe() == "dp-after-backward"
