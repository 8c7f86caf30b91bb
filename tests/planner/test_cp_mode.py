"""Context-parallel attention mode: the planner picks the cheaper of K/V all-gather and
head-parallel (DeepSpeed-Ulysses) attention, prices the mode it records, and `--cp-mode` pins it.

Oracles: the traffic a mode moves, derived by hand from the model's shape (q, k, v and the
output per rank for "heads", K and V for "allgather"), and `estimate` of the plan's own
configuration under each mode (the planner's choice must be the cheaper). Which one wins
follows from the byte ratio heads / allgather = (h/kv + f) / cp (`Pricer.cp_collectives`):
full multi-head attention at cp = 8 moves a quarter of the all-gather's bytes; 2 K/V heads of
16 at cp = 2 move 4.5 times as much.
"""

from __future__ import annotations

import dataclasses
import math

import meshplan
import pytest
from meshplan.cost_model.pricer import pricer_for
from meshplan.ir import Parallel
from meshplan.solver import InfeasibleError

from tests.synthetic import h100_cluster, transformer_graph

SEQ = 32768
MHA = transformer_graph(4, 2048, 16, 16, 8192, 32000, SEQ, 1, name="mha")  # 16 K/V heads
GQA = transformer_graph(4, 2048, 16, 2, 8192, 32000, SEQ // 4, 1, name="gqa")  # 2 K/V heads
CLUSTER = h100_cluster(1)


@pytest.mark.parametrize(
    "graph,tp,cp",
    [(MHA, 1, 8), (GQA, 1, 2), (GQA, 2, 4), (MHA, 2, 2)],
    ids=["mha-cp8", "gqa-cp2", "gqa-tp2-cp4", "mha-tp2-cp2"],
)
def test_priced_traffic_is_the_hand_derived_one(graph, tp, cp):
    pricer = pricer_for(graph, CLUSTER, "bfloat16")
    facts = pricer.costs.facts[
        next(k for k in pricer.costs.unit_keys if pricer.costs.facts[k].kind == "layer")
    ]
    p = Parallel(dp=1, tp=tp, pp=1, cp=cp, ep=1, micro_batch=1, global_batch=1)
    p = dataclasses.replace(p, recompute="none", zero=0, schedule="1f1b", sequence_parallel=False)
    info = graph.info
    d, b = info.hidden // info.heads, 2  # head dim, bf16 bytes
    h, kv = info.heads // tp, info.kv_heads // tp  # per tp rank
    f = cp // math.gcd(kv, cp)  # K/V copies so that cp divides them
    seq = info.seq_len
    local = seq // cp * d * b  # one head's share of the sequence on a rank
    heads = pricer.cp_collectives(facts, dataclasses.replace(p, cp_mode="heads").stage(), 1.0)
    want = [h * local, kv * f * local, kv * f * local, h * local]  # q, k, v in; output back
    assert [s for ph, _, s in heads if ph == "fwd"] == want
    assert [s for ph, _, s in heads if ph == "bwd"] == want
    gather = pricer.cp_collectives(facts, p.stage(), 1.0)
    assert [s for _, _, s in gather] == [2 * kv * seq * d * b] * 2  # K and V, whole sequence
    assert {k.value for _, k, _ in heads} == {"all_to_all"}


@pytest.mark.parametrize(
    "graph,tp,cp,expected",
    [(MHA, 1, 8, "heads"), (GQA, 1, 2, "allgather")],
    ids=["mha-cp8-heads", "gqa-cp2-allgather"],
)
def test_the_planner_takes_the_cheaper_mode(graph, tp, cp, expected):
    plan = meshplan.plan(graph, cluster=CLUSTER, global_batch=8, parallel=Parallel(tp=tp, cp=cp))
    assert plan.parallel.cp_mode == expected
    assert meshplan.Plan.from_json(plan.to_json()).parallel.cp_mode == expected
    times = {}
    for mode in ("allgather", "heads"):
        p = dataclasses.replace(plan.parallel, cp_mode=mode)
        times[mode] = meshplan.estimate(graph, cluster=CLUSTER, parallel=p).step_time_s
    assert times[expected] < times[other(expected)]
    assert plan.predicted.step_time_s == pytest.approx(times[expected], rel=1e-9)


def other(mode: str) -> str:
    return "allgather" if mode == "heads" else "heads"


def test_a_pinned_mode_is_kept_and_an_impossible_one_refused():
    plan = meshplan.plan(
        MHA, cluster=CLUSTER, global_batch=8, parallel=Parallel(tp=1, cp=8, cp_mode="allgather")
    )
    assert plan.parallel.cp_mode == "allgather"
    six = transformer_graph(4, 1536, 12, 12, 6144, 32000, SEQ, 1, name="twelve")
    with pytest.raises(InfeasibleError, match="heads=12, cp=8"):
        meshplan.plan(
            six, cluster=CLUSTER, global_batch=8, parallel=Parallel(cp=8, cp_mode="heads")
        )
    with pytest.raises(ValueError, match="cp_mode must be one of allgather, ring, heads, usp"):
        Parallel(cp_mode="ulysses")


def test_without_cp_no_mode_is_recorded():
    plan = meshplan.plan(MHA, cluster=CLUSTER, global_batch=8, parallel=Parallel(cp=1))
    assert plan.parallel.cp_mode is None and "cp_mode" not in plan.to_dict()


# -- "usp": heads that cp does not divide (USP / LoongTrain's two-level split) -------------------

TWELVE = transformer_graph(4, 1536, 12, 12, 6144, 32000, SEQ, 1, name="twelve")  # 12 heads


def test_usp_traffic_is_the_hand_derived_one():
    """12 heads at cp = 8: u = gcd(12, 8) = 4 ranks share the heads, r = 2 groups all-gather.
    Per rank and direction: the four all-to-alls of "heads" over 4 ranks (q, k, v, the output:
    each 12 heads x S/8 tokens), and K and V of 12/4 heads over the whole sequence."""
    pricer = pricer_for(TWELVE, CLUSTER, "bfloat16")
    facts = pricer.costs.facts[
        next(k for k in pricer.costs.unit_keys if pricer.costs.facts[k].kind == "layer")
    ]
    p = Parallel(dp=1, tp=1, pp=1, cp=8, ep=1, micro_batch=1, global_batch=1, recompute="none")
    p = dataclasses.replace(
        p, zero=0, schedule="1f1b", sequence_parallel=False, cp_mode="usp", cp_head_degree=4
    )
    d, b = 1536 // 12, 2
    local = SEQ // 8 * d * b
    got = pricer.cp_collectives(facts, p.stage(), 1.0)
    gathered = 2 * 3 * SEQ * d * b  # K and V of 3 heads, every token
    assert [(ph, k.value, s) for ph, k, s in got] == [
        (ph, kind, size)
        for ph, rs in (("fwd", "all_gather"), ("bwd", "reduce_scatter"))
        for kind, size in [("all_to_all", 12 * local)] * 4 + [(rs, gathered)]
    ]


def test_the_planner_takes_usp_where_heads_do_not_divide_cp():
    """On one 8-GPU node, 12 heads at cp = 8 ("heads" refused): "usp" moves 60 of the
    all-gather's 168 head-shares (hand count in test_usp_traffic_is_the_hand_derived_one's
    terms: 4 x 12 x 3/4 + 24 x 1/2 against 2 x 12 x 8 x 7/8), so the planner takes it, with
    the degree the heads allow, and prices what `estimate` prices for it."""
    plan = meshplan.plan(TWELVE, cluster=CLUSTER, global_batch=8, parallel=Parallel(tp=1, cp=8))
    p = plan.parallel
    assert (p.cp_mode, p.cp_head_degree) == ("usp", 4)
    assert "usp attention: heads over 4 ranks, K/V all-gathered over 2" in plan.explain()
    times = {}
    for mode, degree in (("allgather", None), ("usp", 4), ("usp", 2)):
        q = dataclasses.replace(p, cp_mode=mode, cp_head_degree=degree)
        times[(mode, degree)] = meshplan.estimate(TWELVE, cluster=CLUSTER, parallel=q).step_time_s
    assert times[("usp", 4)] < times[("usp", 2)] < times[("allgather", None)]
    assert plan.predicted.step_time_s == pytest.approx(times[("usp", 4)], rel=1e-9)


def test_a_pinned_usp_degree_is_kept():
    plan = meshplan.plan(
        TWELVE,
        cluster=CLUSTER,
        global_batch=8,
        parallel=Parallel(tp=1, cp=8, cp_mode="usp", cp_head_degree=2),
    )
    assert (plan.parallel.cp_mode, plan.parallel.cp_head_degree) == ("usp", 2)
    kept = meshplan.Plan.from_json(plan.to_json()).parallel
    assert (kept.cp_mode, kept.cp_head_degree) == ("usp", 2)
    # a degree given alone means "usp", for plan and estimate alike
    alone = Parallel(tp=1, cp=8, cp_head_degree=2)
    planned = meshplan.plan(TWELVE, cluster=CLUSTER, global_batch=8, parallel=alone)
    assert (planned.parallel.cp_mode, planned.parallel.cp_head_degree) == ("usp", 2)
    full = dataclasses.replace(planned.parallel, cp_mode=None)
    priced = meshplan.estimate(TWELVE, cluster=CLUSTER, parallel=full)
    assert priced.step_time_s == pytest.approx(planned.predicted.step_time_s, rel=1e-9)
    with pytest.raises(InfeasibleError, match="heads=12, cp_head_degree=8"):
        meshplan.plan(
            TWELVE,
            cluster=h100_cluster(2),
            global_batch=8,
            parallel=Parallel(cp=16, cp_mode="usp", cp_head_degree=8),
        )


def test_a_pinned_degree_holds_on_a_mixed_cluster():
    """On 8 H100 + 8 A100 neither the per-group TP families nor the spanning search (which
    attend by all-gather or "heads" only) may return a plan without the pinned degree."""
    from tests.synthetic import mixed_cluster

    for pins in (Parallel(cp=8, cp_head_degree=4), Parallel(cp_head_degree=2)):
        plan = meshplan.plan(TWELVE, cluster=mixed_cluster(1, 1), global_batch=8, parallel=pins)
        p = plan.parallel
        assert (p.cp_mode, p.cp_head_degree) == ("usp", pins.cp_head_degree), p
        assert not any(st.cp_groups or st.group_tp for st in plan.stages)
