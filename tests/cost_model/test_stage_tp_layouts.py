"""Per-stage TP layouts (`StagePlacement.group_tp` differing between stages, stages mixing
groups: Sailor's plan shape), priced by `predict` through `tables.layout_tables`.

Oracles:
- group-pure per-group TP priced the new way equals the old code path (`hetero_tables` +
  `evaluate` with the shares, what the planner searches), to the last bit;
- a two-stage pipeline tp 2 -> tp 1 on two groups equals the module docstring's formula
  written out here from the Pricer's own per-stage times, point-to-point and DP pieces;
- a hand-off over a shared WAN carries each pipeline's activation once, whatever the degrees
  on either side (the link's bandwidth split among the streams);
- a Sailor-like layout (V100 TP 4 stages, A100 TP 1 stages, a last stage mixing both) prices
  at each (stage, group)'s own degree, and what the cost model cannot price is refused in
  one line.
"""

from __future__ import annotations

import dataclasses

import pytest
from meshplan.cost_model import evaluate, hetero_tables, predict, pricer_for
from meshplan.cost_model.collectives import BASE_LATENCY_S
from meshplan.cost_model.memory import in_flight_microbatches
from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY
from meshplan.cost_model.tables import handoff_pairs, layout_tables
from meshplan.ir import (
    Cluster,
    DeviceGroup,
    GpuSpec,
    LinkKind,
    LinkTier,
    Parallel,
    Recompute,
    StageConfig,
    StagePlacement,
    group_tp_problem,
)
from meshplan.ir.parallel import stage_tp_problem
from meshplan.passes.partition import even_stages, stages_of

from tests.synthetic import (
    A100_40,
    IB_HDR,
    NVLINK3,
    mixed_cluster,
    transformer_graph,
    two_node_sizes_cluster,
)

GiB = 2**30


def _parallel(**kw) -> Parallel:
    base = dict(
        cp=1, ep=1, micro_batch=1, recompute="none", zero=0, schedule="1f1b", sequence_parallel=True
    )
    return Parallel(**{**base, **kw})


# -- (1) group-pure per-group TP: the old price ------------------------------------------------


@pytest.mark.parametrize(
    "schedule,pp,v,recompute,shares",
    [
        ("1f1b", 2, None, "none", (2, 2)),
        ("1f1b", 2, None, "selective", (3, 1)),
        ("gpipe", 2, None, "full", (1, 3)),
        ("interleaved_1f1b", 2, 2, "none", (3, 1)),
        ("zero_bubble", 2, None, "full", (2, 2)),
        ("1f1b", 1, None, "none", (3, 1)),
    ],
)
def test_group_pure_per_group_tp_keeps_its_old_price(schedule, pp, v, recompute, shares):
    graph = transformer_graph(8, 1024, 16, 16, 4096, 8000, 4096, 1)
    cluster = two_node_sizes_cluster()
    p = _parallel(
        dp=2,
        tp=4,
        pp=pp,
        global_batch=16,
        recompute=recompute,
        schedule=schedule,
        virtual_stages=v,
    )
    m = p.num_microbatches  # 8 per replica when even
    micro = (("a100", shares[0] * m // 2), ("h100", shares[1] * m // 2))
    tps = (("a100", 4), ("h100", 2))
    reps = (("a100", 1), ("h100", 1))
    ranges = even_stages(graph, pp)
    stages = tuple(
        StagePlacement(i, a, b, reps, micro, group_tp=tps) for i, (a, b) in enumerate(ranges)
    )
    if p.chunks > 1:  # the ranks' chunk layout, as `meshplan.api.with_chunks` records it
        from meshplan.passes.partition import rank_chunks

        chunks = rank_chunks(graph, pp, p.chunks, schedule == "zero_bubble")
        stages = tuple(dataclasses.replace(st, chunks=chunks[st.index]) for st in stages)
    new = predict(graph, cluster, p, stages)

    # The old code path: the planner's tables for group-pure pipelines, with the shares.
    pricer = pricer_for(graph, cluster)
    old_tables = hetero_tables(
        pricer, p, ranges, dict(tps), max_microbatches=max(dict(micro).values())
    )
    old = evaluate(old_tables, [reps] * pp, dict(micro))
    assert new.step_time_s == old.step_time_s
    assert new.breakdown == old.breakdown
    for r in new.memory:
        assert (r.peak_bytes, r.breakdown) == old_tables.group_memory[r.stage][r.group]


# -- (2) two stages, tp 2 -> tp 1, by hand -----------------------------------------------------


def test_two_stage_pipeline_tp2_to_tp1_is_the_formula_by_hand():
    graph = transformer_graph(4, 1024, 16, 16, 4096, 8000, 1024, 1)
    cluster = mixed_cluster(1, 1, gpus_per_node=4)  # 4 H100 (NDR) and 4 A100 (HDR), one site
    r0, r1 = even_stages(graph, 2)
    stages = (
        StagePlacement(0, *r0, (("h100", 2),), group_tp=(("h100", 2),)),
        StagePlacement(1, *r1, (("a100", 2),), group_tp=(("a100", 1),)),
    )
    p = _parallel(dp=2, tp=2, pp=2, global_batch=8)
    got = predict(graph, cluster, p, stages)

    pricer = pricer_for(graph, cluster)
    costs = pricer.costs
    m, pp, eta, none = 4, 2, OVERLAP_EFFICIENCY, Recompute.NONE
    comps = [costs.composition(*r0), costs.composition(*r1)]
    degree = [("h100", 2), ("a100", 1)]  # (group, tp) of stage 0 and stage 1
    # u_s: each stage at its own degree (SP where tp > 1)
    u = [
        pricer.stage_time(c, g, StageConfig(t, 1, 1, t > 1, 1, none))
        for c, (g, t) in zip(comps, degree, strict=True)
    ]
    big_u = max(x.total for x in u)
    # P: the boundary activation A crosses once; the receiving side has min(2, 1) = 1 rank
    # per replica, which takes all of A; 2 pipelines x cp 1 x 1 rank = 2 streams
    activation = costs.facts[costs.boundary_key(r0[1])].output_bytes
    p2p = pricer.p2p(activation / min(2, 1), "h100", "a100", 2 * 1 * min(2, 1))
    pipeline = (m - 1) * big_u + u[0].total + u[1].total + (m + pp - 1) * p2p
    # C_s: each stage's replicas sit in one group: the plain gradient all-reduce at its
    # degree, overlapped with the last backward (ZeRO-0)
    exposed = []
    for c, (g, t), x in zip(comps, degree, u, strict=True):
        cfg = StageConfig(t, 1, 1, t > 1, 1, none)
        comm = pricer.dp_single(pricer.dp_traffic(c, cfg, dp=2, zero=0), g, cfg)
        exposed.append(comm - eta * min(comm, x.backward + x.recompute))
    # O: the slowest rank's update and per-step syncs at its degree; the loss all-reduce
    # over all 4 + 2 ranks, across both groups
    opt = max(
        pricer.optimizer_time(c, g, StageConfig(t, 1, 1, t > 1, 1, none), dp=2, zero=0)
        + pricer.step_sync_time(
            c, g, StageConfig(t, 1, 1, t > 1, 1, none), world=6, groups=("h100", "a100")
        )
        for c, (g, t) in zip(comps, degree, strict=True)
    )
    step = pipeline + max(exposed) + opt
    assert got.step_time_s == pytest.approx(step, rel=1e-12)
    assert sum(v for _, v in got.breakdown) == pytest.approx(step, rel=1e-12)
    # memory per (stage, group) at the stage's own degree
    for r, c, (g, t) in zip(got.memory, comps, degree, strict=True):
        mem = pricer.stage_memory(c, StageConfig(t, 1, 1, t > 1, 1, none), dp=2, zero=0)
        assert (r.stage, r.group) == (comps.index(c), g)
        assert r.peak_bytes == mem.peak(in_flight_microbatches("1f1b", r.stage, pp, m, 1))[0]


def test_handoff_over_a_shared_link_carries_each_pipeline_once():
    graph = transformer_graph(2, 1024, 16, 16, 4096, 8000, 1024, 1)
    cluster = mixed_cluster(1, 1, wan=True, gpus_per_node=4)  # two sites, 100 Gb/s WAN
    pricer = pricer_for(graph, cluster)
    activation = 64 * 2**20
    path = pricer.cross_path("h100", "a100", 1, 1)
    for pipelines in (1, 3):
        # the WAN split among the streams bounds every piece: pipelines x A cross it
        want = 2 * (BASE_LATENCY_S + path.latency + pipelines * activation / path.shared_bandwidth)
        for ta, tb in ((4, 1), (2, 2), (1, 4), (4, 2)):
            got = pricer.handoff(activation, "h100", ta, "a100", tb, pipelines=pipelines, cp=1)
            assert got == pytest.approx(want, rel=1e-12), (ta, tb)


# -- (3) a Sailor-like layout --------------------------------------------------------------------

# V100 SXM2 16GB (NVIDIA Tesla V100 datasheet: 125 TFLOP/s tensor, 15.7 FP32, 16 GB HBM2 at
# 900 GB/s, NVLink2 300 GB/s bidirectional); no bf16, so priced in float16.
V100_16 = GpuSpec(
    name="V100",
    peak_flops=(("float16", 125e12), ("float32", 15.7e12)),
    memory_bytes=16 * GiB,
    hbm_bandwidth=900e9,
    sms=80,
    nvlink_bandwidth=150e9,
    source="V100 datasheet (SXM2 16GB)",
)
NVLINK2 = LinkTier("nvlink2", LinkKind.NVLINK, 150e9, 2e-6, 0.8)


def _sailor_like() -> tuple:
    """6 layers, 3 stages x dp 3 on 8 A100-40GB + 24 V100-16GB, 4 per node: stage 0 on the
    V100s at TP 4, stage 1 on the A100s at TP 1, stage 2 one A100 replica + two V100-TP4."""
    graph = transformer_graph(6, 1024, 16, 16, 4096, 8000, 1024, 1)
    cluster = Cluster(
        name="a100x8+v100x24",
        groups=(
            DeviceGroup("a100", A100_40, 2, 4, "nvlink3", "ib-hdr", nics_per_node=1),
            DeviceGroup("v100", V100_16, 6, 4, "nvlink2", "ib-hdr", nics_per_node=1),
        ),
        links=(NVLINK3, NVLINK2, IB_HDR),
    )
    split = stages_of(graph, (2, 2, 2))
    stages = (
        StagePlacement(0, *split[0], (("v100", 3),), group_tp=(("v100", 4),)),
        StagePlacement(1, *split[1], (("a100", 3),), group_tp=(("a100", 1),)),
        StagePlacement(
            2, *split[2], (("a100", 1), ("v100", 2)), group_tp=(("a100", 1), ("v100", 4))
        ),
    )
    p = _parallel(dp=3, tp=4, pp=3, global_batch=24, sequence_parallel=False)
    return graph, cluster, p, stages


def test_sailor_like_layout_prices_each_stage_and_group_at_its_own_degree(gpu_time_only):
    graph, cluster, p, stages = _sailor_like()
    got = predict(graph, cluster, p, stages, dtype="float16")
    assert 0 < got.step_time_s < float("inf")
    assert sum(v for _, v in got.breakdown) == pytest.approx(got.step_time_s, rel=1e-12)
    # the runtime runs this layout (1F1B, even shares): no refusal note
    assert not any("runtime cannot run" in n for n in got.notes)

    pricer = pricer_for(graph, cluster, "float16")
    costs, m = pricer.costs, p.num_microbatches
    degree = {(0, "v100"): 4, (1, "a100"): 1, (2, "a100"): 1, (2, "v100"): 4}
    comps = [costs.composition(st.first_unit, st.last_unit) for st in stages]
    # memory: every (stage, group) at its own degree, the mixed stage's two groups apart
    assert [(r.stage, r.group) for r in got.memory] == list(degree)
    for r in got.memory:
        t = degree[(r.stage, r.group)]
        mem = pricer.stage_memory(
            comps[r.stage], StageConfig(t, 1, 1, False, 1, Recompute.NONE), dp=3, zero=0
        )
        assert r.peak_bytes == mem.peak(in_flight_microbatches("1f1b", r.stage, 3, m, 1))[0]
    assert got.memory[2].peak_bytes > got.memory[3].peak_bytes  # A100 TP 1 holds 4x the weights
    # lock-step: the compute part is m times that of the slowest (stage, group)
    times = {
        k: pricer.stage_time(comps[k[0]], k[1], StageConfig(t, 1, 1, False, 1, Recompute.NONE))
        for k, t in degree.items()
    }
    slowest = max(times.values(), key=lambda x: x.total)
    assert dict(got.breakdown)["compute"] == pytest.approx(m * slowest.compute, rel=1e-12)
    # pipelines by dp index: 3 V100 -> A100 hand-offs, then one A100 -> A100 and two A100 -> V100
    assert handoff_pairs(stages[0].replicas, stages[1].replicas) == {("v100", "a100"): 3}
    assert handoff_pairs(stages[1].replicas, stages[2].replicas) == {
        ("a100", "a100"): 1,
        ("a100", "v100"): 2,
    }
    tables = layout_tables(pricer, p, stages)
    assert set(tables.p2p[1]) == {("a100", "a100"), ("a100", "v100")}
    # the mixed stage reduces its gradients in L = lcm(1, 4) = 4 pieces: 4 all-reduces on an
    # A100 rank, 1 on a V100-TP4 rank
    pieces = pricer.hetero_dp_traffic(comps[2], p, {"a100": 1, "v100": 4})
    assert (len(pieces["a100"].collectives), len(pieces["v100"].collectives)) == (4, 1)
    assert tables.dp_cross[2][("a100", "v100")] == pricer.dp_cross_hetero(
        comps[2], "a100", "v100", p, {"a100": 1, "v100": 4}
    )
    # both the cost model's rule and the runtime's accept it
    assert stage_tp_problem(p, stages) is None
    assert group_tp_problem(p, stages) is None


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(zero=1), "per-group tp needs zero=0, got zero=1"),
        (dict(ep=3, sequence_parallel=True), "per-group tp needs ep=1, got ep=3"),
        (dict(tp=1), "Parallel.tp=1 must be stage 0's first group's tp (v100: 4)"),
        (
            dict(schedule="interleaved_1f1b", virtual_stages=2, pp=3),
            "schedule 'interleaved_1f1b' over stages of different groups or tp degrees is not "
            "priced",
        ),
    ],
)
def test_what_is_not_priced_is_refused_in_one_line(change, message):
    graph, cluster, p, stages = _sailor_like()
    bad = dataclasses.replace(p, **change)
    with pytest.raises(ValueError) as e:
        predict(graph, cluster, bad, stages, dtype="float16")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_group_short_of_gpus_across_degrees_is_refused():
    graph, cluster, p, stages = _sailor_like()
    # stage 1's three replicas moved to V100 TP 4: 12 + 12 + 8 = 32 V100s needed, 24 there
    moved = dataclasses.replace(stages[1], replicas=(("v100", 3),), group_tp=(("v100", 4),))
    with pytest.raises(ValueError, match=r"group v100: 8 replicas of tp\*cp=4 GPUs need 32 GPUs"):
        predict(graph, cluster, p, (stages[0], moved, stages[2]), dtype="float16")
    # mixed degrees in one group: the message lists each degree's replicas
    wide = dataclasses.replace(stages[1], replicas=(("a100", 3),), group_tp=(("a100", 4),))
    with pytest.raises(ValueError) as e:
        predict(graph, cluster, p, (stages[0], wide, stages[2]), dtype="float16")
    assert str(e.value) == (
        "group a100: its replicas (1 of tp*cp=1 + 3 of tp*cp=4 GPUs) need 13 GPUs, it has 8"
    )
