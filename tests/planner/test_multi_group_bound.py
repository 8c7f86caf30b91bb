"""`solver_bounds._multi_group_bound` holds: on small mixed clusters, every placement that uses
two or more device groups (lock-step, group-pure with uneven shares, per-group TP) of every
configuration the planner enumerates and every layer split costs at least the bound of its
configuration. The oracle is exhaustive enumeration priced by `evaluate`, independent of the
bound's derivation; the test also checks that the bound is not vacuous (it is within 2x of the
best multi-group placement of some configuration and above the bound valid for every
placement, `_split_free_bound`, for most of them)."""

from __future__ import annotations

import math

import pytest
from meshplan.cost_model import evaluate, hetero_tables, plan_tables, pricer_for
from meshplan.cost_model.compression import CommOptions
from meshplan.ir import Parallel, Schedule
from meshplan.passes.partition import compositions, rank_layers, replica_capacity, stages_of
from meshplan.solver_bounds import _multi_group_bound, _split_free_bound
from meshplan.solver_candidates import enumerate_candidates

from tests.planner.test_solver import _best_hetero, _placements, _share_placements
from tests.synthetic import (
    mixed_cluster,
    three_type_cluster,
    transformer_graph,
    two_node_sizes_cluster,
)

_CHUNKED = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)


def _splits(c, n_layers):
    if c.schedule in _CHUNKED:
        zb = c.schedule is Schedule.ZERO_BUBBLE
        return [rank_layers(n_layers, c.pp, c.virtual_stages, zb)]
    return list(compositions(n_layers, c.pp))


def _multi_group_steps(pricer, graph, c, split, groups, cap):
    """The step time of every placement of (c, split) over two or more groups."""
    ranges = stages_of(graph, split)
    if c.group_tp:
        t = hetero_tables(pricer, c.parallel(), ranges, dict(c.group_tp))
        # `_best_hetero` keeps the best; collect every one by asking it with an open best
        steps = []
        best = (math.inf, None, None)
        got = _best_hetero(t, cap, best)
        if got[0] < math.inf:
            steps.append(got[0])
        return steps
    t = plan_tables(pricer, c.parallel(), ranges, groups)
    steps = [
        evaluate(t, pl).step_time_s
        for pl in _placements(t, cap)
        if len({g for reps in pl for g, _ in reps}) > 1
    ]
    steps += [evaluate(t, pl, sh).step_time_s for pl, sh in _share_placements(t, cap)]
    return steps


CASES = [
    ("h100+a100 over a WAN", lambda: mixed_cluster(1, 1, wan=True, gpus_per_node=4), None, 8),
    ("h100x4+a100x12", lambda: mixed_cluster(1, 3, gpus_per_node=4), None, 16),
    (
        "WAN, lossless coding allowed",
        lambda: mixed_cluster(1, 1, wan=True, gpus_per_node=4),
        CommOptions(lossless=True),
        8,
    ),
    (
        "WAN, lossless and int8 gradients allowed",
        lambda: mixed_cluster(1, 1, wan=True, gpus_per_node=4),
        CommOptions(lossless=True, int8_gradients=True),
        8,
    ),
    (
        "h100x4+a100x12 over a WAN, lossless coding allowed",
        lambda: mixed_cluster(1, 3, wan=True, gpus_per_node=4),
        CommOptions(lossless=True),
        16,
    ),
    ("per-group TP", two_node_sizes_cluster, None, 8),
    # three GPU types: lock-step placements and shares over any two or all three groups
    ("h100+a100+a40", lambda: three_type_cluster(gpus_per_node=2), None, 12),
]


@pytest.mark.parametrize("name, make, comm, global_batch", CASES, ids=[c[0] for c in CASES])
def test_every_multi_group_placement_costs_at_least_the_bound(name, make, comm, global_batch):
    graph = transformer_graph(3, 512, 8, 8, 2048, 8000, 1024, 1)
    cluster = make()
    pricer = pricer_for(graph, cluster, comm=comm)
    n_layers = len(graph.layer_units)
    cache: dict = {}
    checked = configs = lifted = 0
    closest = math.inf
    for c in enumerate_candidates(graph, cluster, Parallel(), global_batch):
        named = dict(c.group_tp)
        groups = [
            g.name
            for g in cluster.groups
            if (not named or g.name in named) and replica_capacity(g, c.tp_of(g.name), c.cp)
        ]
        cap = {g.name: replica_capacity(g, c.tp_of(g.name), c.cp) for g in cluster.groups}
        m = global_batch // (c.dp * c.micro_batch)
        bound = _multi_group_bound(pricer, c, groups, m, cache, fill=c.fill, zeros=[c.zero])
        steps = [
            s
            for split in _splits(c, n_layers)
            for s in _multi_group_steps(pricer, graph, c, split, groups, cap)
        ]
        for s in steps:
            assert s >= bound * (1 - 1e-9), (c.describe(), s, bound)
        checked += len(steps)
        if steps:
            configs += 1
            closest = min(closest, min(steps) / bound)
            if bound > _split_free_bound(pricer, c, groups, m, cache) * (1 + 1e-6):
                lifted += 1
    assert checked > 100
    assert closest < 2.0, "the bound is never near the placements it bounds"
    assert lifted > configs / 2, "crossing adds nothing over the bound of every placement"


@pytest.mark.parametrize(
    "make",
    [
        lambda: mixed_cluster(1, 3, gpus_per_node=4),
        lambda: mixed_cluster(2, 2, wan=True),
        two_node_sizes_cluster,
    ],
)
def test_a_groups_configurations_are_the_clusters_filtered(make):
    # `_single_group_seed` searches each group over the cluster's configurations that fit it
    # (`_one_group`) instead of enumerating its own: the same families of the same members,
    # in the same order.
    import dataclasses

    from meshplan.solver import _one_group, enumerate_families, flatten

    graph = transformer_graph(4, 512, 8, 8, 2048, 8000, 1024, 1)
    cluster = make()
    families = enumerate_families(graph, cluster, Parallel(), 16)

    def shape(fams):  # each family's members, without their enumeration indices
        return [[c for _, c in f.members] for f in fams]

    for g in cluster.groups:
        sub = dataclasses.replace(cluster, groups=(g,), group_links=())
        own = enumerate_families(graph, sub, Parallel(), 16)
        assert shape(_one_group(families, g)) == shape(own)
        assert flatten(_one_group(families, g)) == enumerate_candidates(graph, sub, Parallel(), 16)
