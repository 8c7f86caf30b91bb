"""Asymmetric context parallelism priced (issue 19, HexiSeq): cp groups that span GPU types,
token and head shares per cp rank, and the balanced shares of `planner.cp_shares`.

Oracles: a homogeneous cluster's price of the same configuration (equal shares on a
spanning group run at the slower GPU's pace), linearity in the share (the uneven zig-zag
keeps every op in proportion to a rank's tokens), the same price from two attention modes
whose shares say the same thing, the bottleneck segment of a spanning ring derived from the
cluster's own paths, and an exhaustive scan of two-group splits for the balanced shares.

Unit tier: synthetic graphs, no ranks (the runtime's parity is in
tests/runtime/test_parity_cp_shares.py).
"""

from __future__ import annotations

import dataclasses

import meshplan
import pytest
from meshplan.cost_model.collectives import cross_group_path, group_path
from meshplan.cost_model.pricer import pricer_for
from meshplan.ir import Parallel
from meshplan.passes.partition import place_stages

from tests.synthetic import A100, h100_cluster, mixed_cluster, transformer_graph

SEQ = 32768
# 4 layers, hidden 2048, 16 heads (8 K/V), sequence 32k
GRAPH = transformer_graph(4, 2048, 16, 8, 8192, 32000, SEQ, 1, name="long")
MIXED = mixed_cluster(1, 1)  # 8 H100 + 8 A100 at one site


def _p(**kw) -> Parallel:
    base = dict(dp=1, tp=1, pp=1, cp=16, ep=1, micro_batch=1, global_batch=1, zero=3)
    return Parallel(**{**base, "recompute": "full", **kw})


def _estimate(cluster=MIXED, **kw):
    return meshplan.estimate_plan(GRAPH, cluster=cluster, parallel=_p(**kw))


def _part(plan, name: str) -> float:
    return dict(plan.predicted.breakdown)[name]


def test_a_cp_group_too_large_for_one_group_spans_both():
    """cp 16 over 8 H100 + 8 A100: each group gives the replica 8 cp ranks, the H100s cp
    ranks 0-7 (group order); at tp 2 and cp 8, 4 cp ranks of 2 GPUs each. A cp group that
    fits a group stays in it."""
    plan = _estimate()
    (stage,) = plan.stages
    assert stage.cp_groups == (("h100", 8), ("a100", 8))
    for r in plan.ranks:
        assert r.group == ("h100" if r.coords[2] < 8 else "a100")
    assert sorted(r.coords for r in plan.ranks) == [(0, 0, c, 0) for c in range(16)]
    again = meshplan.Plan.from_json(plan.to_json())  # kept, and checked again, in the file
    assert again.stages[0].cp_groups == stage.cp_groups
    tp2 = place_stages(MIXED, _p(tp=2, cp=8, sequence_parallel=True), [(0, len(GRAPH.units))])
    assert tp2[0].cp_groups == (("h100", 4), ("a100", 4))
    whole = place_stages(MIXED, _p(cp=8, dp=2), [(0, len(GRAPH.units))])
    assert [st.cp_groups for st in whole] == [()]


def test_equal_shares_run_at_the_slower_gpus_pace():
    """Equal shares over H100 + A100: the compute part of the step is exactly what the same
    configuration computes on 16 A100s (the A100 ranks set the pace; only the traffic
    differs)."""
    a100s = h100_cluster(2, gpu=A100)  # links differ; the compute part does not see them
    spanning, plain = _estimate(), _estimate(cluster=a100s)
    assert not plain.stages[0].cp_groups
    # (full recomputation re-runs the forward's cp traffic too: only "compute" is traffic-free)
    assert _part(spanning, "compute") == pytest.approx(_part(plain, "compute"), rel=1e-9)
    assert "bottleneck: stage 0 on a100" in spanning.predicted.notes
    assert {r.group for r in spanning.predicted.memory} == {"h100", "a100"}


def test_token_shares_scale_every_op_with_the_largest_share():
    """3/4 of the tokens on one of two cp ranks of one GPU type: that rank's compute is 1.5x
    the equal split's (every op in proportion to its tokens, attention included under the
    uneven zig-zag), within the kernel floors and wave quantization (1%)."""
    h100s = h100_cluster(1)
    equal = _estimate(cluster=h100s, cp=2, dp=4, global_batch=4)
    uneven = _estimate(
        cluster=h100s, cp=2, dp=4, global_batch=4, cp_shares=(SEQ * 3 // 4, SEQ // 4)
    )
    assert _part(uneven, "compute") / _part(equal, "compute") == pytest.approx(1.5, rel=0.01)


def test_head_shares_in_proportion_price_as_token_shares_do():
    """Under "heads" a rank's attention core scales with its heads and the rest with its
    tokens; with 12 + 4 of 16 heads beside 3/4 + 1/4 of the tokens it is priced as
    "allgather" prices the same token shares (everything at 3/4); with the heads split
    equally the attention core stays at 1/2 and the rank is cheaper."""
    h100s = h100_cluster(1)
    tokens = (SEQ * 3 // 4, SEQ // 4)
    kw = dict(cluster=h100s, cp=2, dp=4, global_batch=4, cp_shares=tokens)
    gathered = _estimate(**kw)
    heads = _estimate(**kw, cp_mode="heads", cp_head_shares=(12, 4))
    assert _part(heads, "compute") == pytest.approx(_part(gathered, "compute"), rel=1e-9)
    equal_heads = _estimate(**kw, cp_mode="heads")
    assert _part(equal_heads, "compute") < _part(heads, "compute")


def test_spanning_ring_runs_at_its_slowest_segment():
    """The cp collectives of a spanning cp group are priced on the slowest of each group's
    own ring and the crossing between them (tp x dp cp groups crossing at once), derived
    here from the cluster's paths."""
    plan = _estimate()
    pricer = pricer_for(GRAPH, MIXED, "bfloat16")
    cfg = dataclasses.replace(
        plan.parallel.stage(), cp_ranks=tuple(range(8)), cp_span=plan.stages[0].cp_groups
    )
    got = pricer._span_path(cfg)
    h100, a100 = MIXED.groups
    parts = [
        group_path(MIXED, h100, 8, 8),
        group_path(MIXED, a100, 8, 8),
        cross_group_path(MIXED, "h100", "a100", 8, 8).path(1),
    ]
    assert got.bandwidth == min(p.bandwidth for p in parts)
    assert got.latency == max(p.latency for p in parts)
    # across a WAN the crossing is the bottleneck: the cp traffic costs far more
    wan = mixed_cluster(1, 1, wan=True)
    assert _part(_estimate(cluster=wan), "cp_comm") > 10 * _part(plan, "cp_comm")


def _step(shares) -> float:
    return _estimate(cp_shares=shares).predicted.step_time_s


def test_balanced_shares_match_an_exhaustive_scan():
    """`balance_cp` (`planner.cp_shares`) against every split that gives the 8 H100 ranks x
    tokens each and the 8 A100 ranks the rest, x on a grid of 256 tokens: within 0.5% of the
    best split scanned, and well ahead of equal shares. Its two groups' times are then
    nearly equal (the balance the linear model aims for)."""
    balanced = meshplan.estimate_plan(GRAPH, cluster=MIXED, parallel=_p(), balance_cp=True)
    shares = balanced.parallel.cp_shares
    assert len(set(shares[:8])) == 1 and len(set(shares[8:])) == 1 and sum(shares) == SEQ
    scan = {}
    for x in range(SEQ // 16, SEQ // 8 - 256, 256):
        rest = (SEQ - 8 * x) // 8
        scan[x] = _step((x,) * 8 + (rest,) * 8)
    best = min(scan.values())
    got = balanced.predicted.step_time_s
    assert got <= best * 1.005, (shares[0], min(scan, key=scan.get))
    assert got < 0.8 * _step(None)
    pricer = pricer_for(GRAPH, MIXED, "bfloat16")
    comp = pricer.costs.composition(0, len(GRAPH.units))
    cfg = balanced.parallel.stage()
    span = balanced.stages[0].cp_groups
    times = [
        pricer.stage_time(
            comp,
            g,
            dataclasses.replace(cfg, cp_ranks=ranks, cp_span=span, cp_streams=1),
        ).total
        for g, ranks in (("h100", tuple(range(8))), ("a100", tuple(range(8, 16))))
    ]
    assert times[0] == pytest.approx(times[1], rel=0.02)


def test_balanced_shares_refused_without_a_spanning_cp_group():
    with pytest.raises(ValueError, match="need cp groups that span device groups"):
        meshplan.estimate_plan(
            GRAPH, cluster=MIXED, parallel=_p(cp=8, dp=2, global_batch=2), balance_cp=True
        )
    with pytest.raises(ValueError, match="not both"):
        meshplan.estimate_plan(
            GRAPH, cluster=MIXED, parallel=_p(cp_shares=(2048,) * 16), balance_cp=True
        )


def test_pinned_shares_are_planned_only_where_a_cp_group_spans():
    """Shares pinned on a cluster of one group: refused in one line. On the mixed cluster a
    cp group of 16 spans both groups and runs them as given."""
    with pytest.raises(meshplan.InfeasibleError, match="only for cp groups that span"):
        meshplan.plan(
            GRAPH,
            cluster=h100_cluster(2),
            global_batch=1,
            parallel=Parallel(cp_shares=(16384,) * 2),
        )
    shares = (2560,) * 8 + (1536,) * 8
    plan = meshplan.plan(GRAPH, cluster=MIXED, global_batch=1, parallel=Parallel(cp_shares=shares))
    assert plan.parallel.cp_shares == shares and plan.stages[0].cp_groups


def test_the_planner_spans_groups_where_that_wins():
    """`meshplan.plan` on 8 H100 + 8 A100, one 32k sequence per step: the plan is the faster
    of the best plan inside groups (`_solve_in_groups`) and the best spanning one
    (`spanning_search`, every spanning configuration priced); here the spanning cp group
    with balanced shares wins, runs (`check_plan`) and records its shares. At a short
    sequence (4k: cp 16 would leave 256 tokens a rank) no cp group spans and the plan is the
    in-groups one."""
    from meshplan.cp_shares import spanning_search
    from meshplan.runtime import check_plan
    from meshplan.solver import _solve_in_groups

    plan = meshplan.plan(GRAPH, cluster=MIXED, global_batch=1)
    inside = _solve_in_groups(GRAPH, MIXED, Parallel(global_batch=1), global_batch=1)
    span = spanning_search(GRAPH, MIXED, Parallel(global_batch=1), 1, comm=None)
    assert span is not None and span.priced > 10
    assert plan.stages[0].cp_groups, "the spanning plan should win at 32k tokens"
    assert plan.predicted.step_time_s < inside.prediction.step_time_s
    assert len(set(plan.parallel.cp_shares)) > 1  # balanced, not equal
    check_plan(plan)
    short = transformer_graph(4, 2048, 16, 8, 8192, 32000, 4096, 1, name="short")
    assert not meshplan.plan(short, cluster=MIXED, global_batch=8).stages[0].cp_groups


def test_memory_caps_the_faster_groups_share():
    """Llama 3 8B, 512k tokens over 8 H100 + 8 A100 (80 GB each), ZeRO-3, full recompute:
    the split that equalises the ranks' times (found on a copy of the cluster with 10x the
    memory) overfills the H100s; the balanced split holds them at what fits (peak within 1%
    of 80 GB) and gives the A100s the rest, still faster than equal shares."""
    from meshplan.api import as_graph

    model, inputs = meshplan.models.get("llama3-8b", seq_len=524288)
    graph = as_graph(model, inputs, name="llama3-8b")
    cluster = meshplan.Cluster.preset("mixed-h100-a100", gpus=16)
    p = _p(cp_mode="allgather")
    roomy = dataclasses.replace(
        cluster,
        groups=tuple(
            dataclasses.replace(
                g, gpu=dataclasses.replace(g.gpu, memory_bytes=10 * g.gpu.memory_bytes)
            )
            for g in cluster.groups
        ),
    )
    free = meshplan.estimate_plan(graph, cluster=roomy, parallel=p, balance_cp=True)
    overfull = meshplan.estimate_plan(graph, cluster=cluster, parallel=free.parallel)
    assert not overfull.predicted.fits
    capped = meshplan.estimate_plan(graph, cluster=cluster, parallel=p, balance_cp=True)
    equal = meshplan.estimate_plan(graph, cluster=cluster, parallel=p)
    assert capped.predicted.fits and equal.predicted.fits
    h100 = next(r for r in capped.predicted.memory if r.group == "h100")
    assert h100.peak_bytes >= 0.99 * h100.capacity_bytes
    assert capped.parallel.cp_shares[0] < free.parallel.cp_shares[0]
    assert capped.predicted.step_time_s < equal.predicted.step_time_s


def test_frameworks_cannot_express_asymmetric_shares():
    """No framework export gives cp ranks their own shares: refused in one line naming it;
    --closest writes the same layout at equal shares."""
    from meshplan.configs import ExportError, export

    plan = _estimate(cp_shares=(2560,) * 8 + (1536,) * 8)
    with pytest.raises(ExportError, match="megatron cannot express asymmetric cp shares"):
        export(plan, "megatron")
    near = export(plan, "megatron", closest=True, graph=GRAPH)
    assert near.plan.parallel.cp_shares is None and near.plan.parallel.cp == 16


def test_pipeline_stages_span_alike_and_hand_off_inside_groups():
    """cp 16 in 3 pipeline stages over 24 H100 + 24 A100: no group holds a stage's cp group
    beside the others' (1 + 1 replicas of 16 for 3 stages), so every stage spans both alike,
    8 cp ranks in each group, cp rank r of every stage in the same group. Its hand-offs stay
    inside each group: the pipeline sends cost the slower of the two groups' own, which a
    cluster of that group alone (6 nodes) prices for the same configuration."""
    mixed = mixed_cluster(3, 3)
    p = _p(pp=3, dp=1, global_batch=3)
    plan = meshplan.estimate_plan(GRAPH, cluster=mixed, parallel=p)
    assert [st.cp_groups for st in plan.stages] == [(("h100", 8), ("a100", 8))] * 3
    for r in plan.ranks:
        assert r.group == ("h100" if r.coords[2] < 8 else "a100"), r
    alone = []
    for g in mixed.groups:
        cluster = dataclasses.replace(mixed, groups=(dataclasses.replace(g, nodes=6),))
        one = meshplan.estimate_plan(GRAPH, cluster=cluster, parallel=p)
        assert not any(st.cp_groups for st in one.stages)
        alone.append(_part(one, "pp_p2p"))
    assert _part(plan, "pp_p2p") == pytest.approx(max(alone), rel=1e-12)
    # the planner finds it when asked for 3 stages (no in-groups plan has room for them)
    planned = meshplan.plan(GRAPH, cluster=mixed, global_batch=3, parallel=Parallel(pp=3, cp=16))
    assert all(st.cp_groups for st in planned.stages)
    # GPUs counted over all stages: 4 stages of 8 + 8 cp ranks need 32 of each group's 24
    too_many = dataclasses.replace(plan.stages[0], index=3)
    with pytest.raises(ValueError, match="group h100: 4 stage"):
        from meshplan.cost_model.simulate import check_parallel

        ranges = [(0, 1), (1, 2), (2, 3), (3, len(GRAPH.units))]
        stages = tuple(
            dataclasses.replace(st, first_unit=a, last_unit=b)
            for (a, b), st in zip(ranges, (*plan.stages, too_many))
        )
        check_parallel(GRAPH, mixed, dataclasses.replace(plan.parallel, pp=4), stages)


def test_experts_over_replicas_of_a_spanning_cp_group_stay_inside_one_group():
    """A MoE of 6 experts, 3 replicas of a cp group of 16 over 24 H100 + 24 A100 (8 cp ranks
    of each replica in each group), ep 3: each ep group is the 3 replicas' ranks at one cp
    index and tp rank, all in one device group, and its all-to-alls are priced there."""
    moe = transformer_graph(4, 2048, 16, 8, 8192, 32000, SEQ, 1, experts=6, top_k=2, name="moe")
    mixed = mixed_cluster(3, 3)
    p = _p(dp=3, ep=3, global_batch=3)
    plan = meshplan.estimate_plan(moe, cluster=mixed, parallel=p)
    assert plan.stages[0].cp_groups == (("h100", 8), ("a100", 8))
    groups: dict[tuple, set] = {}
    for r in plan.ranks:
        pp, dp, cp, tp = r.coords
        groups.setdefault((pp, dp // 3, cp, tp), set()).add(r.group)
    assert len(groups) == 16 and all(len(g) == 1 for g in groups.values())
    assert _part(plan, "ep_comm") > 0
    from meshplan.runtime import check_plan

    check_plan(plan)  # the runtime's checks accept it
    # token shares with experts are priced too; balanced, they beat equal shares here
    balanced = meshplan.estimate_plan(moe, cluster=mixed, parallel=p, balance_cp=True)
    assert len(set(balanced.parallel.cp_shares)) > 1
    assert balanced.predicted.step_time_s < plan.predicted.step_time_s


def test_usp_with_a_spanning_cp_group_is_refused():
    """The two-level split's subgroups are not priced across device groups: refused in one
    line rather than priced as if inside one group."""
    p = _p(cp_mode="usp", cp_head_degree=8)
    with pytest.raises(ValueError, match="'usp' with a cp group spanning device groups"):
        _estimate(**{k: v for k, v in dataclasses.asdict(p).items() if v is not None})


def test_expert_all_to_all_under_token_shares_uses_the_ranks_real_stride():
    """ep 2 over 2 replicas of cp 8 on 2 nodes of 8 H100: the ep ranks sit 8 GPUs apart, one
    per node, whatever the token shares. A rank holding a quarter of each sequence (shares)
    moves what a rank of equal shares moves at twice the micro-batch, over the same path: the
    same EP time (the share divisor, 4, is no rank stride)."""
    from meshplan.cost_model.pricer import pricer_for

    moe = transformer_graph(4, 2048, 16, 8, 8192, 32000, SEQ, 1, experts=4, top_k=2, name="moe")
    cluster = h100_cluster(2)
    pricer = pricer_for(moe, cluster, "bfloat16")
    layer = next(k for k in pricer.costs.unit_keys if pricer.costs.facts[k].kind == "layer")
    base = dict(dp=2, tp=1, pp=1, cp=8, ep=2, global_batch=4, zero=0, recompute="none")
    shares = (SEQ // 4,) + (3584,) * 6 + (3072,)  # a quarter on cp rank 0; sum SEQ
    assert sum(shares) == SEQ
    uneven = Parallel(**base, micro_batch=1, cp_shares=shares, schedule="1f1b")
    even = Parallel(**base, micro_batch=2, schedule="1f1b")
    uneven = dataclasses.replace(uneven, sequence_parallel=False)
    even = dataclasses.replace(even, sequence_parallel=False)
    cfg_u = dataclasses.replace(uneven.stage(), cp_ranks=(0,))
    comp = ((layer, 1),)
    t_u = pricer.stage_time(comp, "h100", cfg_u).ep_comm
    t_e = pricer.stage_time(comp, "h100", even.stage()).ep_comm
    assert t_u > 0 and t_u == pytest.approx(t_e, rel=1e-9)
