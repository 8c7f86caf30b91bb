"""Pipelines whose stages run at different TP degrees, and stages whose replicas mix degrees
(Sailor's plan shape): the hand-off between TP groups (`runtime.pipeline_handoff`) and each
stage's own piece-wise gradient average (`runtime.data_parallel.HeteroGradients`).

Parity: losses on every rank and parameters (hence gradients) after every step equal one
process over the whole global batch (3 SGD steps). Collectives at the first steady step, on
every rank:
- tp group: the exact (kind, elements) multiset the cost model prices for the rank's own
  (stage, group) view (`mesh.stage_group_view`), plus, where the stage needs the boundary
  whole at tp > 1 without SP, the hand-off's all-gather of it (forward, on a receiving
  stage) and of its gradient (backward, on a sending stage), which the cost model leaves
  unpriced;
- the piece all-reduces of the rank's stage: what `Pricer.hetero_dp_traffic` prices;
- the hand-off's point-to-point elements: a sender sends X / t_a and a receiver receives
  X / t_b per micro-batch and direction, so the busier side moves X / min(t_a, t_b), what
  `Pricer.handoff` prices.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from meshplan.cost_model import pricer_for
from meshplan.ir import Parallel, StagePlacement, group_tp_problem
from meshplan.ir.plan import Plan
from meshplan.passes.partition import even_stages
from meshplan.runtime import check_plan, run_local
from meshplan.runtime.errors import RuntimePlanError
from meshplan.runtime.mesh import stage_group_view

from tests.runtime.harness import (
    CFG,
    SEQ,
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
from tests.runtime.test_parity_group_tp import cpu_groups


def stage_tp_plan(layout: list[dict[str, int]], tps: list[dict[str, int]], **parallel) -> Plan:
    """A plan for the tiny model whose stage s has `layout[s]` replicas per group at
    `tps[s]` degrees, on CPU groups of exactly the ranks they need, priced by `predict`."""
    g = graph()
    need: Counter = Counter()
    for reps, tp in zip(layout, tps):
        for name, n in reps.items():
            need[name] += n * tp[name]
    cluster = cpu_groups(dict(need))
    first = layout[0]
    p = Parallel(
        dp=sum(first.values()),
        tp=tps[0][next(iter(first))],
        pp=len(layout),
        ep=1,
        cp=1,
        zero=0,
        **{"sequence_parallel": True, "recompute": "none", "schedule": "1f1b", **parallel},
    )
    stages = tuple(
        StagePlacement(
            i, a, b, tuple(layout[i].items()), group_tp=tuple((k, tps[i][k]) for k in layout[i])
        )
        for i, (a, b) in enumerate(even_stages(g, p.pp))
    )
    return fixed_plan(g, cluster, p, stages)


def _plans_3():
    return {
        # tp 2 (SP) -> tp 1: the sequence shards meet on one rank
        "tp2->tp1": stage_tp_plan(
            [{"a": 1}, {"b": 1}], [{"a": 2}, {"b": 1}], micro_batch=2, global_batch=4
        ),
        # tp 1 -> tp 2 without SP: the receivers all-gather, the senders get the gradient whole
        "tp1->tp2 no SP, gpipe": stage_tp_plan(
            [{"a": 1}, {"b": 1}],
            [{"a": 1}, {"b": 2}],
            micro_batch=1,
            global_batch=3,
            sequence_parallel=False,
            schedule="gpipe",
        ),
    }


def _plans_5():
    return {
        # three stages: tp 2 -> tp 1 -> tp 2 (SP), 4 micro-batches under 1F1B
        "tp2->tp1->tp2": stage_tp_plan(
            [{"a": 1}, {"b": 1}, {"a": 1}],
            [{"a": 2}, {"b": 1}, {"a": 2}],
            micro_batch=1,
            global_batch=4,
        ),
        # a mixed stage: stage 0's replicas at tp 1 (fast) and tp 2 (slow), stage 1 two tp-1
        # replicas in fast; pipeline 1 crosses from slow to fast
        "mixed stage": stage_tp_plan(
            [{"fast": 1, "slow": 1}, {"fast": 2}],
            [{"fast": 1, "slow": 2}, {"fast": 1}],
            micro_batch=1,
            global_batch=4,
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
            _check_collectives(f"{name} rank {rank}", plan, res[name], rank)
    return results


def _side(plan, stage, replica):
    from meshplan.runtime.pipeline_handoff import stage_side

    return stage_side(plan, stage, replica)


def _check_collectives(name, plan, r, rank):
    me = next(a for a in plan.ranks if a.rank == r["plan_rank"])
    s, d = me.coords[0], me.coords[1]
    st = plan.stages[s]
    view = stage_group_view(plan, s, me.group)
    m = plan.parallel.num_microbatches
    groups = r["groups"]
    boundary = plan.parallel.micro_batch * SEQ * CFG["hidden"]  # X, elements
    mine = _side(plan, s, d)
    exact: dict[str, Counter] = {groups["world"]: expected_loss_sync()}
    if view.parallel.tp > 1:
        tp = Counter(expected_tp(view, graph(), s, m))
        if not mine.sharded:  # the hand-off's node-local all-gathers (unpriced)
            whole = Counter()
            if s > 0:
                whole[("all_gather", boundary)] += m  # forward, the input
            if s < plan.parallel.pp - 1:
                whole[("all_gather", boundary)] += m  # backward, the output's gradient
            tp.update(whole)
        exact.setdefault(groups["tp"], Counter()).update(tp)
    pricer = pricer_for(graph(), plan.cluster, dtype="float32")
    comp = _composition(pricer.costs, rank_ranges(view, s))
    tps = {g: st.tp_of(g, plan.parallel.tp) for g, _ in st.replicas}
    traffic = pricer.hetero_dp_traffic(comp, plan.parallel, tps)
    pieces = Counter(
        ("all_reduce", round(size / 4)) for _, size, _ in traffic[me.group].collectives
    )
    known = {groups[a] for a in ("tp", "world")}
    got_pieces = Counter(
        (x.kind, x.numel)
        for x in r["records"]
        if x.group not in known and x.group_size > 1 and x.kind not in ("send", "recv")
    )
    assert got_pieces == pieces, f"{name}: piece reductions {dict(got_pieces)}, plan {dict(pieces)}"
    if plan.parallel.dp > 1:  # L / t pieces per rank (L = lcm of the stage's degrees)
        assert sum(pieces.values()) == math.lcm(*tps.values()) // tps[me.group]
    for group, want in exact.items():
        got = Counter(
            (x.kind, x.numel)
            for x in r["records"]
            if x.group == group and x.group_size > 1 and x.kind not in ("send", "recv")
        )
        assert got == want, f"{name}: group {group}: missing {want - got}, unexpected {got - want}"
    # point-to-point: X / t per micro-batch and direction on each side of each boundary
    sent = sum(x.numel for x in r["records"] if x.kind == "send")
    received = sum(x.numel for x in r["records"] if x.kind == "recv")
    want_sent = want_received = 0
    if s < plan.parallel.pp - 1:  # forward out, gradient in
        want_sent += m * boundary // mine.tp
        want_received += m * boundary // mine.tp
    if s > 0:  # forward in, gradient out
        want_received += m * boundary // mine.tp
        want_sent += m * boundary // mine.tp
    assert (sent, received) == (want_sent, want_received), (
        f"{name}: p2p elements sent {sent}, received {received}; want {want_sent}, {want_received}"
    )


def test_stage_tp_parity_three_ranks():
    _check(3, _plans_3())


def test_stage_tp_parity_five_ranks():
    _check(5, _plans_5())


def test_handoff_pieces_follow_the_priced_rule():
    """Every rank on the side with fewer ranks moves X / min(t_a, t_b), as `Pricer.handoff`
    prices; the pieces tile X once."""
    from meshplan.runtime.pipeline_handoff import Side, pieces

    for ta, tb in [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (2, 3), (4, 1)]:
        a = Side(tuple(range(ta)), True)
        b = Side(tuple(range(ta, ta + tb)), True)
        L = math.lcm(ta, tb)
        msgs = pieces(a, b)
        assert sorted(c for _, _, lo, hi in msgs for c in range(lo, hi)) == list(range(L))
        by_sender = Counter()
        by_receiver = Counter()
        for j, i, lo, hi in msgs:
            by_sender[j] += hi - lo
            by_receiver[i] += hi - lo
        assert set(by_sender.values()) == {L // ta} and set(by_receiver.values()) == {L // tb}
        assert max(L // ta, L // tb) / L == 1 / min(ta, tb)


def test_what_the_hand_off_does_not_run_is_refused_in_one_line():
    import dataclasses

    plan = _plans_5()["tp2->tp1->tp2"]
    check_plan(plan)  # runs
    assert group_tp_problem(plan.parallel, plan.stages) is None
    zb = dataclasses.replace(plan.parallel, schedule="zero_bubble", virtual_stages=2)
    why = group_tp_problem(zb, plan.stages)
    assert why is not None and why.startswith("schedule='zero_bubble'") and "\n" not in why
    with pytest.raises(RuntimePlanError, match="runtime: per-group tp needs zero=0"):
        check_plan(dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, zero=1)))


def test_stage_tp_parity_mixed_stage_between_the_runs():
    """The mixed stage between a run on one group and a run on the other (step 2b's
    `mixed_at="between"`): pipeline 0 runs a (tp 2) -> a (tp 2) -> b (tp 1), pipeline 1
    a (tp 2) -> b (tp 1) -> b (tp 1); 9 ranks."""
    plans = {
        "mixed between": stage_tp_plan(
            [{"a": 2}, {"a": 1, "b": 1}, {"b": 2}],
            [{"a": 2}, {"a": 2, "b": 1}, {"b": 1}],
            micro_batch=1,
            global_batch=6,
        )
    }
    _check(9, plans)


def test_stage_tp_parity_a_chain_through_three_groups():
    """Step 2b's chains (`meshplan.solver_chains`): one pipeline through three device groups,
    a (tp 2) -> b (tp 1) -> c (tp 2), two pipelines; 10 ranks."""
    plans = {
        "a->b->c": stage_tp_plan(
            [{"a": 2}, {"b": 2}, {"c": 2}],
            [{"a": 2}, {"b": 1}, {"c": 2}],
            micro_batch=1,
            global_batch=6,
        )
    }
    _check(10, plans)
