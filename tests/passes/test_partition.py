"""Even stage split and the default placement (`meshplan.passes.partition`), which `predict`
and `estimate` price."""

from __future__ import annotations

import itertools

import pytest
from meshplan.ir import Parallel
from meshplan.passes.partition import even_stages, place_stages

from tests.synthetic import h100_cluster, mixed_cluster, transformer_graph


def test_even_stages_split_layers_evenly_with_prologue_first_and_epilogue_last():
    g = transformer_graph(10, 256, 4, 4, 1024, 1000, 128, 1)  # units: pro, 10 layers, epi
    assert even_stages(g, 1) == ((0, 12),)
    assert even_stages(g, 2) == ((0, 6), (6, 12))
    ranges = even_stages(g, 3)  # 4, 3, 3 layers: the extra layer never lands on the head
    assert ranges == ((0, 5), (5, 8), (8, 12))
    assert even_stages(g, 10)[0] == (0, 2) and even_stages(g, 10)[-1] == (10, 12)
    for pp in range(1, 11):
        r = even_stages(g, pp)
        assert r[0][0] == 0 and r[-1][1] == 12
        assert all(a[1] == b[0] for a, b in itertools.pairwise(r))
        layers = [b - a for a, b in r]
        layers[0] -= 1  # prologue
        layers[-1] -= 1  # epilogue
        assert max(layers) - min(layers) <= 1 and sum(layers) == 10


def test_even_stages_rejects_more_stages_than_layers():
    g = transformer_graph(4, 256, 4, 4, 1024, 1000, 128, 1)
    with pytest.raises(ValueError, match="pp=5 exceeds the 4 layer units"):
        even_stages(g, 5)


def test_place_stages_fills_ranks_in_order_stage_by_stage():
    g = transformer_graph(8, 256, 4, 4, 1024, 1000, 128, 1)
    c = mixed_cluster(1, 1)  # 8 H100 then 8 A100
    p = Parallel(tp=2, pp=2, dp=4, cp=1)
    stages = place_stages(c, p, even_stages(g, 2))
    assert [s.replicas for s in stages] == [(("h100", 4),), (("a100", 4),)]
    p = Parallel(tp=2, pp=2, dp=3, cp=1)  # 3 + 3 replicas of 2: stage 1 straddles the groups
    stages = place_stages(c, p, even_stages(g, 2))
    assert [s.replicas for s in stages] == [(("h100", 3),), (("h100", 1), ("a100", 2))]


def test_place_stages_errors():
    g = transformer_graph(8, 256, 4, 4, 1024, 1000, 128, 1)
    c = h100_cluster(2)
    with pytest.raises(ValueError, match="exceeds the cluster's 16"):
        place_stages(c, Parallel(tp=4, pp=2, dp=4), even_stages(g, 2))
    with pytest.raises(ValueError, match="tp=3 does not divide gpus_per_node=8"):
        place_stages(c, Parallel(tp=3, pp=1, dp=1), even_stages(g, 1))


def test_stages_of_follows_the_even_split_rules_for_any_counts():
    from meshplan.passes.partition import layer_counts, stages_of

    graph = transformer_graph(6, 256, 4, 4, 1024, 1000, 128, 1)
    ranges = stages_of(graph, (1, 3, 2))
    assert ranges[0][0] == 0 and ranges[-1][1] == len(graph.units)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert layer_counts(graph, ranges) == (1, 3, 2)
    assert stages_of(graph, (2, 2, 2)) == even_stages(graph, 3)
    with pytest.raises(ValueError, match="add up to the 6 layers"):
        stages_of(graph, (1, 1))


def test_compositions_are_every_split():
    from meshplan.passes.partition import compositions, count_compositions

    got = list(compositions(5, 3))
    assert len(got) == count_compositions(5, 3) == 6
    assert all(sum(c) == 5 and min(c) >= 1 for c in got) and len(set(got)) == 6


def test_balanced_counts_minimise_the_slowest_stage():
    from meshplan.passes.partition import balanced_counts, compositions

    # a fast group (1.0 per layer) and a slow one (2.5), an LM head of 4 layers' time at the end
    layer, fixed = [1.0, 1.0, 2.5, 2.5], [0.5, 0.0, 0.0, 4.0]
    got = balanced_counts(20, layer, fixed)

    def slowest(c):
        return max(f + n * a for f, n, a in zip(fixed, c, layer))

    assert sum(got) == 20
    assert slowest(got) == min(slowest(c) for c in compositions(20, 4))
    assert got[0] > got[2] and got[3] < got[2]  # faster GPUs and the head's stage


# -- chunk layouts (interleaved 1F1B, ZB-V) ------------------------------------------------------


def test_chunk_layers_megatron_layouts():
    """Equal chunks when pp * v divides the layers; else, when it divides the layers + 2, the
    embedding and the loss count as a layer each (hand-derived: Llama 3 405B's 126 layers on
    pp 16: v = 8 gives chunks of one layer with an embedding-only first and a head-only last)."""
    from meshplan.passes.partition import chunk_layers, rank_layers

    assert chunk_layers(32, 4, 2) == (4,) * 8
    assert chunk_layers(126, 16, 8) == (0, *([1] * 126), 0)
    assert chunk_layers(126, 16, 2) == (3, *([4] * 30), 3)
    assert chunk_layers(125, 16, 2) is None
    # rank r runs chunks r, r + 16, ...: rank 0 and rank 15 hold the two short chunks
    assert rank_layers(126, 16, 8) == (7, *([8] * 14), 7)
    # ZB-V: rank 0 holds the first and the last chunk
    assert rank_layers(6, 2, 2, v_shape=True) == (2, 4)
    with pytest.raises(ValueError, match="multiple of 32, or of 32 less 2"):
        rank_layers(125, 16, 2)


def test_rank_chunks_puts_prologue_and_epilogue_alone_when_their_chunks_have_no_layer():
    from meshplan.passes.partition import rank_chunks

    g = transformer_graph(6, 512, 8, 8, 2048, 1000, 512, 1)  # prologue, 6 layers, epilogue
    per_rank = rank_chunks(g, 2, 4)  # 8 chunks for 6 + 2
    assert per_rank[0][0] == (0, 1) and g.units[0].name.startswith("<")
    assert per_rank[1][-1] == (len(g.units) - 1, len(g.units))
    covered = sorted(r for rank in per_rank for r in rank)
    assert [a for a, _ in covered] == [b for _, b in [(0, 0), *covered[:-1]]]


def test_interleaved_plan_with_uneven_first_and_last_chunks():
    """The solver searches the Megatron layout: 6 layers on pp 2 with 4 chunks per rank."""
    import meshplan

    g = transformer_graph(6, 512, 8, 8, 2048, 1000, 512, 1)
    plan = meshplan.plan(
        g,
        cluster=h100_cluster(2),
        global_batch=8,
        parallel=Parallel(pp=2, tp=1, cp=1, schedule="interleaved_1f1b", virtual_stages=4),
    )
    assert plan.parallel.virtual_stages == 4
    assert [s.last_unit - s.first_unit for s in plan.stages] == [4, 4]  # 3 layers + one end each
