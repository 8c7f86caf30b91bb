"""The single-group seeds of a mixed cluster's search (`solver._single_group_seed`) search the
groups by summed peak, and each group after the first only for a plan faster than the best so
far (`_solve_in_groups`' cutoff, `_NoneFaster` when it holds none).

Oracle: the same seeds without the cutoff (every group searched to its own best plan, in
cluster order, as before session 28): the same seed plan, the same single-group floor, and so
the same plan of the whole search, with either group listed first; the cut searches spend
less work. Small mixed clusters: H100 and A100 nodes at one site and across a WAN, one where
the A100 group outweighs the H100 one."""

from __future__ import annotations

import dataclasses
import math

import pytest
from meshplan import solver
from meshplan.ir import Parallel
from meshplan.solver_candidates import enumerate_families
from meshplan.solver_objective import _Work

from tests.synthetic import mixed_cluster, transformer_graph


def _uncut(monkeypatch):
    """Make every group's seed search run to its own best plan (no cutoff)."""
    original = solver._solve_in_groups

    def uncut(*args, **kwargs):
        kwargs["cutoff"] = math.inf
        return original(*args, **kwargs)

    monkeypatch.setattr(solver, "_solve_in_groups", uncut)
    return original


def _seed(graph, cluster, budget=50.0):
    work = _Work.starting_now(budget)
    cands = enumerate_families(graph, cluster, Parallel(), 64)
    seed, floor = solver._single_group_seed(
        graph, cluster, Parallel(), 64, work, "bfloat16", cands=cands
    )
    return seed, floor, work.spent


@pytest.mark.parametrize(
    "h100_nodes, a100_nodes, wan, reverse",
    [(2, 2, False, False), (2, 2, False, True), (1, 4, True, False), (1, 4, True, True)],
)
def test_cut_seeds_prove_the_same_seed_and_floor(monkeypatch, h100_nodes, a100_nodes, wan, reverse):
    graph = transformer_graph(8, 2048, 16, 16, 8192, 32000, 2048, 1)
    cluster = mixed_cluster(h100_nodes, a100_nodes, wan=wan)
    if reverse:  # the weaker group first in the file: the search order is by peak, not order
        cluster = dataclasses.replace(cluster, groups=cluster.groups[::-1])
    seed, floor, spent = _seed(graph, cluster)
    with monkeypatch.context() as m:
        _uncut(m)  # uncut, the search order only decides exact ties
        ref_seed, ref_floor, ref_spent = _seed(graph, cluster)
    assert seed is not None and ref_seed is not None
    assert seed.prediction.step_time_s == pytest.approx(ref_seed.prediction.step_time_s, rel=1e-12)
    assert (seed.parallel, seed.stages) == (ref_seed.parallel, ref_seed.stages)
    assert floor == pytest.approx(ref_floor, rel=1e-12)
    assert spent < ref_spent  # the cut group's search proved the cutoff in less work

    plan = solver.solve(graph, cluster, Parallel(), global_batch=64, time_limit_s=50.0)
    with monkeypatch.context() as m:
        _uncut(m)
        ref = solver.solve(graph, cluster, Parallel(), global_batch=64, time_limit_s=50.0)
    assert (plan.parallel, plan.stages) == (ref.parallel, ref.stages)
    assert plan.status == ref.status == "optimal"
