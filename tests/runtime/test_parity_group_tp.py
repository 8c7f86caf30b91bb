"""Per-group TP (`StagePlacement.group_tp`): each device group's pipelines run at their own
tensor-parallel degree, and the replicas' gradients are averaged across groups piece by piece
(`runtime.data_parallel.HeteroGradients`).

Parity: losses on every rank and parameters (hence gradients) after every step equal one
process over the whole global batch (3 SGD steps), with uneven micro-batch shares.
Collectives at the first steady step, on every rank, against the cost model:
- tp group: the exact (kind, elements) multiset the cost model prices for the rank's own
  group view (`mesh.group_view`: its tp, its SP);
- the piece all-reduces: L / tp_g of them, each of the elements `Pricer.hetero_dp_traffic`
  prices (P_tp / L + P_rep of the rank's stage), and nothing else on the piece groups;
- the world's scalar loss all-reduce.
"""

from __future__ import annotations

import copy
from collections import Counter

import meshplan
import pytest
from meshplan.api import with_chunks
from meshplan.cost_model import predict, pricer_for
from meshplan.ir import Parallel, StagePlacement
from meshplan.ir.cluster_io import cluster_from_dict
from meshplan.ir.plan import Plan
from meshplan.passes.partition import even_stages
from meshplan.runtime import run_local
from meshplan.runtime.mesh import group_view

from tests.runtime.harness import (
    _composition,
    assert_parity,
    expected_loss_sync,
    expected_tp,
    fixed_plan,
    graph,
    rank_ranges,
    reference,
    run_all,
)


def cpu_groups(sizes: dict[str, int]):
    """CPU ranks in device groups of the given sizes, one node each."""
    d = meshplan.Cluster.preset("cpu", gpus=sum(sizes.values())).to_dict()
    base = d["groups"][0]
    d["groups"] = []
    for name, n in sizes.items():
        g = copy.deepcopy(base)
        g.update(name=name, gpus_per_node=n, nodes=1)
        d["groups"].append(g)
    return cluster_from_dict(d, source="test")


def group_tp_plan(
    replicas: dict[str, int],
    shares: dict[str, int],
    tps: dict[str, int] | None = None,
    **parallel,
) -> Plan:
    """A per-group TP plan for the tiny model, priced by the cost model (group-pure
    pipelines, ZeRO-0, SP where a group's tp > 1): `replicas` pipelines per group at its tp
    (default "fast" 1, "slow" 2), on CPU groups of exactly the ranks they need."""
    tps = tps or {"fast": 1, "slow": 2}
    per = parallel.get("pp", 1) * parallel.get("cp", 1)
    cluster = cpu_groups({g: n * tps[g] * per for g, n in replicas.items()})
    g = graph()
    first = next(iter(tps))
    dp = sum(replicas.values())
    p = Parallel(
        dp=dp,
        tp=tps[first],
        ep=1,
        zero=0,
        sequence_parallel=True,
        **{"pp": 1, "cp": 1, "recompute": "none", "schedule": "1f1b", **parallel},
    )
    stages = tuple(
        StagePlacement(
            i, a, b, tuple(replicas.items()), tuple(shares.items()), group_tp=tuple(tps.items())
        )
        for i, (a, b) in enumerate(even_stages(g, p.pp))
    )
    stages = with_chunks(g, p, stages)
    return fixed_plan(g, cluster, p, stages)


def _plans_3():
    return {
        # one replica at tp 1, one at tp 2 (SP), 3 and 1 micro-batches of 2 rows
        "tp1+tp2": group_tp_plan(
            {"fast": 1, "slow": 1},
            {"fast": 3, "slow": 1},
            micro_batch=2,
            global_batch=8,
        ),
        "tp1+tp2-full-recompute": group_tp_plan(
            {"fast": 1, "slow": 1},
            {"fast": 2, "slow": 2},
            micro_batch=2,
            global_batch=8,
            recompute="full",
        ),
    }


def _plans_4():
    return {
        # two tp-1 replicas in one group (dp 3 in all), shares 1 / 1 / 4
        "2xtp1+tp2": group_tp_plan(
            {"fast": 2, "slow": 1},
            {"fast": 1, "slow": 4},
            micro_batch=2,
            global_batch=12,
        ),
    }


def _plans_6():
    return {
        # pipelines inside each group: 2 stages at tp 1 and 2 stages at tp 2
        "pp2: tp1+tp2": group_tp_plan(
            {"fast": 1, "slow": 1},
            {"fast": 5, "slow": 3},
            pp=2,
            micro_batch=1,
            global_batch=8,
        ),
        # the zero-bubble schedule (ZB-V, split backward) and interleaved 1F1B in each group
        "zbv: tp1+tp2": group_tp_plan(
            {"fast": 1, "slow": 1},
            {"fast": 5, "slow": 3},
            pp=2,
            micro_batch=1,
            global_batch=8,
            schedule="zero_bubble",
        ),
        "interleaved: tp1+tp2": group_tp_plan(
            {"fast": 1, "slow": 1},
            {"fast": 4, "slow": 4},
            pp=2,
            micro_batch=1,
            global_batch=8,
            schedule="interleaved_1f1b",
            virtual_stages=2,
        ),
        # context parallelism in both groups (dp x cp = 4 ranks reduce each piece)
        "cp2: tp1+tp2": group_tp_plan(
            {"fast": 1, "slow": 1},
            {"fast": 2, "slow": 2},
            cp=2,
            micro_batch=2,
            global_batch=8,
        ),
    }


def _check(world, plans):
    results = run_local(run_all, world, plans, timeout_s=240)
    for name, plan in plans.items():
        p = plan.parallel
        assert plan.world_size == world
        ref = reference(p.global_batch, p.global_batch // p.micro_batch)
        assert_parity(name, ref, [r[name] for r in results])
        for rank, res in enumerate(results):
            _check_collectives(f"{name} rank {rank}", plan, res[name])


def _check_collectives(name, plan, r):
    first = plan.stages[0]
    me = next(a for a in plan.ranks if a.rank == r["plan_rank"])
    view = group_view(plan, me.group)
    pp_rank = r["coords"][0]
    m = first.shares[me.group]
    groups = r["groups"]
    exact: dict[str, Counter] = {groups["world"]: expected_loss_sync()}
    if view.parallel.tp > 1:
        exact.setdefault(groups["tp"], Counter()).update(expected_tp(view, graph(), pp_rank, m))
    pricer = pricer_for(graph(), plan.cluster, dtype="float32")
    comp = _composition(pricer.costs, rank_ranges(view, pp_rank))
    tps = {g: first.tp_of(g, plan.parallel.tp) for g, _ in first.replicas}
    traffic = pricer.hetero_dp_traffic(comp, plan.parallel, tps)
    pieces = Counter(
        ("all_reduce", round(size / 4)) for _, size, _ in traffic[me.group].collectives
    )
    known = {groups[a] for a in ("tp", "pp", "cp", "world")}  # CP: test_parity_cp_ep.py
    got_pieces = Counter(
        (x.kind, x.numel)
        for x in r["records"]
        if x.group not in known and x.group_size > 1 and x.kind not in ("send", "recv")
    )
    assert got_pieces == pieces, f"{name}: piece reductions {dict(got_pieces)}, plan {dict(pieces)}"
    # L / tp_g pieces per rank (L = lcm of the groups' tp)
    assert sum(pieces.values()) == max(tps.values()) // tps[me.group]
    for group, want in exact.items():
        got = Counter(
            (x.kind, x.numel)
            for x in r["records"]
            if x.group == group and x.group_size > 1 and x.kind not in ("send", "recv")
        )
        assert got == want, f"{name}: group {group}: missing {want - got}, unexpected {got - want}"


def test_group_tp_parity_three_ranks():
    _check(3, _plans_3())


def test_group_tp_parity_four_ranks():
    _check(4, _plans_4())


def test_group_tp_parity_six_ranks():
    _check(6, _plans_6())


def test_group_view_is_a_homogeneous_plan():
    plan = _plans_4()["2xtp1+tp2"]
    fast, slow = group_view(plan, "fast"), group_view(plan, "slow")
    assert (fast.parallel.dp, fast.parallel.tp, fast.parallel.sequence_parallel) == (2, 1, False)
    assert (slow.parallel.dp, slow.parallel.tp, slow.parallel.sequence_parallel) == (1, 2, True)
    # dp indices counted inside the group; the other group's ranks idle
    assert [r.coords for r in slow.ranks] == [None, None, (0, 0, 0, 0), (0, 0, 0, 1)]
    assert [r.coords for r in fast.ranks] == [(0, 0, 0, 0), (0, 1, 0, 0), None, None]
    assert slow.stages[0].shares == {"slow": 4} and not slow.stages[0].group_tp


def test_group_tp_plan_round_trips_through_json():
    plan = _plans_3()["tp1+tp2"]
    again = Plan.from_json(plan.to_json())
    assert again.stages == plan.stages and again.ranks == plan.ranks
    assert again.stages[0].group_tp == (("fast", 1), ("slow", 2))
    assert "tp per group: fast 1, slow 2" in plan.explain()


def test_group_tp_needs_zero0_and_group_pure_pipelines():
    import dataclasses

    plan = _plans_3()["tp1+tp2"]
    zero2 = dataclasses.replace(plan.parallel, zero=2)
    with pytest.raises(ValueError, match="per-group tp needs zero=0"):
        predict(graph(), plan.cluster, zero2, plan.stages)
    # Stages at different degrees with uneven shares: a pipeline crossing groups has no single
    # group's share, so the runtime refuses it in one line naming the field.
    from meshplan.ir import group_tp_problem

    st = plan.stages[0]
    cut = (st.first_unit + st.last_unit) // 2
    mixed = (
        dataclasses.replace(st, last_unit=cut),
        dataclasses.replace(st, index=1, first_unit=cut, group_tp=()),
    )
    two = dataclasses.replace(plan.parallel, pp=2)
    why = group_tp_problem(two, mixed) or ""
    assert "microbatches" in why and "\n" not in why
