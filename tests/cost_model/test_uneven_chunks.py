"""Model chunks of unequal size (interleaved 1F1B and ZB-V with `StagePlacement.chunks` as a
framework splits them, e.g. torchtitan's first/last_stage_less_layers over pp * v stages):
`predict` prices the chunks the stages list, not the even chunk layout.

The oracle is the roofline of each block (`ModelCosts.compute(...).times`), summed by hand
over the units of each rank's chunks:

    T_r = sum over the chunks c of rank r, over the units u of c, of fwd(u) + bwd(u)

(tp = cp = 1, no recomputation: a rank's stage time is its compute), and the step's compute
is m * max_r T_r; the fill and drain of interleaved 1F1B are (sum_r T_r - max_r T_r) / v.
"""

from __future__ import annotations

import dataclasses

import pytest
from meshplan.cost_model import predict
from meshplan.cost_model.graph_costs import model_costs
from meshplan.cost_model.pricer import compute_dtype
from meshplan.ir import Parallel, StagePlacement
from meshplan.passes.partition import layer_counts, rank_chunks, stages_of

from tests.synthetic import h100_cluster, transformer_graph

# These models are small enough that the host would bind (`cost_model.host`).
pytestmark = pytest.mark.usefixtures("gpu_time_only")

# 12 layers in 2 ranks x 2 chunks of 5, 2, 2 and 3 layers (model order; chunk k on rank k % 2):
# rank 0 runs the embedding and 5 + 2 layers, rank 1 2 + 3 layers and the LM head
CHUNK_LAYERS = (5, 2, 2, 3)
PP, V, M = 2, 2, 8


def config(**kw) -> Parallel:
    base = dict(
        dp=1, tp=1, pp=PP, cp=1, ep=1, micro_batch=1, global_batch=M, recompute="none", zero=0,
        schedule="interleaved_1f1b", virtual_stages=V, sequence_parallel=False,
    )  # fmt: skip
    return Parallel(**(base | kw))


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(12, 1024, 16, 16, 4096, 32000, 1024, 1)


def chunked_stages(g, counts, v_shape=False):
    """Stages holding the model chunks of `counts` layers (hand-built: one replica on h100)."""
    per_rank = rank_chunks(g, PP, len(counts) // PP, v_shape, counts)
    ranges = stages_of(g, [sum(layer_counts(g, held)) for held in per_rank])
    return tuple(
        StagePlacement(s, a, b, (("h100", 1),), chunks=per_rank[s])
        for s, (a, b) in enumerate(ranges)
    )


def rank_compute(g, gpu, held) -> float:
    """T_r: forward + backward roofline of every unit of the rank's chunks, one micro-batch."""
    costs = model_costs(g)
    total = 0.0
    for a, b in held:
        for u in range(a, b):
            fwd, bwd, _ = costs.compute(costs.unit_keys[u], gpu, compute_dtype(g)).times(
                tp=1, cp=1, sequence_parallel=False, scale=1.0
            )
            total += fwd + bwd
    return total


def test_predicted_compute_is_the_chunks_the_stages_hold(graph):
    c = h100_cluster(1)
    stages = chunked_stages(graph, CHUNK_LAYERS)
    assert [layer_counts(graph, st.chunks) for st in stages] == [(5, 2), (2, 3)]
    assert [(st.first_unit, st.last_unit) for st in stages] == [(0, 8), (8, 14)]
    parts = predict(graph, c, config(), stages).breakdown_dict()
    gpu = c.groups[0].gpu
    t = [rank_compute(graph, gpu, st.chunks) for st in stages]
    assert t[0] > t[1]  # 7 layers and the embedding against 5 and the LM head
    assert parts["compute"] == pytest.approx(M * max(t), rel=1e-12)
    # the fill and drain at each rank's mean chunk: (sum_r T_r - max_r T_r) / v, plus the
    # (pp - 1) P of the boundaries, P = pp_p2p / (m v) (every chunk boundary sends)
    p2p = parts["pp_p2p"] / (M * V)
    assert p2p > 0
    assert parts["pp_bubble"] == pytest.approx((sum(t) - max(t)) / V + (PP - 1) * p2p, rel=1e-9)


def test_even_chunks_listed_or_not_price_the_same(graph):
    """The stages' chunks replace the chunk layout only where they differ from it: the planner's
    plans (which list the layout's chunks) price as before."""
    c = h100_cluster(1)
    p = config()
    even = chunked_stages(graph, (3, 3, 3, 3))
    bare = tuple(dataclasses.replace(st, chunks=()) for st in even)
    assert predict(graph, c, p, even) == predict(graph, c, p, bare)
    uneven = predict(graph, c, p, chunked_stages(graph, CHUNK_LAYERS))
    assert uneven.step_time_s > predict(graph, c, p, even).step_time_s


def test_zbv_prices_its_v_of_uneven_chunks(graph):
    """ZB-V: rank 0 holds the first and the last chunk (the V); the compute follows them."""
    c = h100_cluster(1)
    p = config(schedule="zero_bubble", virtual_stages=2)
    stages = chunked_stages(graph, CHUNK_LAYERS, v_shape=True)
    assert [layer_counts(graph, st.chunks) for st in stages] == [(5, 3), (2, 2)]
    parts = predict(graph, c, p, stages).breakdown_dict()
    t = [rank_compute(graph, c.groups[0].gpu, st.chunks) for st in stages]
    assert parts["compute"] == pytest.approx(M * max(t), rel=1e-12)


def test_listed_chunks_that_are_no_layout_are_refused(graph):
    c = h100_cluster(1)
    p = config()
    stages = chunked_stages(graph, CHUNK_LAYERS)
    # the two ranks' chunks swapped: chunk 0 would start at unit 6
    swapped = (
        dataclasses.replace(stages[0], chunks=stages[1].chunks),
        dataclasses.replace(stages[1], chunks=stages[0].chunks),
    )
    with pytest.raises(ValueError, match="the chunks must tile the model in the schedule's order"):
        predict(graph, c, p, swapped)
    # a stage range holding other layers than its chunks
    moved = (
        dataclasses.replace(stages[0], last_unit=7),
        dataclasses.replace(stages[1], first_unit=7),
    )
    with pytest.raises(ValueError, match="stage 0 holds 6 layers .* its model chunks hold 7"):
        predict(graph, c, p, moved)
    with pytest.raises(ValueError, match="lists 2 model chunks, the schedule runs 3"):
        predict(graph, c, config(virtual_stages=3, global_batch=M), stages)
    with pytest.raises(ValueError, match="lists model chunks but the schedule runs one per rank"):
        predict(graph, c, config(schedule="1f1b", virtual_stages=None), stages)
