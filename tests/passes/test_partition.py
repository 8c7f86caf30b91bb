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
