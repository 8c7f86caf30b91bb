"""The per-step and per-unit terms that small models and small micro-batches expose
(docs/fidelity.md), each checked against a figure derived by hand from its definition:

- ZeRO-3 runs one all-gather per FSDP unit for forward, one for backward and one
  reduce-scatter per unit, each paying its own latency (not one collective per stage);
- the first unit's forward gather and its reduce-scatter are on the critical path of every
  micro-batch (`dp_edge`) and are reported as exposed data-parallel traffic;
- gradients reduced in fp32 (`Engine.reduce_fp32`) move 4 bytes a parameter;
- the optimizer step streams the fused-AdamW and gradient-clipping bytes of the owned shard.
"""

from __future__ import annotations

import pytest
from meshplan.cost_model import predict
from meshplan.cost_model.collectives import (
    BASE_LATENCY_S,
    Collective,
    group_collective_time,
    ring_steps,
)
from meshplan.cost_model.compute import kernel_efficiency
from meshplan.cost_model.engine import Engine
from meshplan.cost_model.pricer import (
    GRAD_CLIP_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM,
    pricer_for,
)
from meshplan.ir import Parallel, Recompute, StageConfig
from meshplan.passes.partition import even_stages, place_stages

from tests.synthetic import h100_cluster, transformer_graph

LAYERS = 6
# A stage of tp = cp = ep = 1 (what the data-parallel traffic reads of it).
DP_ONLY = StageConfig(1, 1, 1, False, 1, Recompute.NONE)


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(LAYERS, 1024, 8, 8, 4096, 32000, 1024, 1)


def _unit_params(pricer, key: str) -> float:
    m = pricer.costs.facts[key].memory
    return m.params_tp + m.params_rep + m.params_expert


def test_zero3_runs_three_collectives_per_unit_and_leaves_the_first_units_edge_out(graph):
    cluster = h100_cluster(2)
    pricer = pricer_for(graph, cluster)
    costs = pricer.costs
    comp = costs.composition(0, len(graph.units))
    first = costs.unit_keys[0]
    traffic = pricer.dp_traffic(comp, DP_ONLY, dp=16, zero=3, first=first)
    edge = pricer.dp_edge(first, DP_ONLY, dp=16)
    units = len(graph.units)
    # 3 collectives per unit, minus the first unit's forward gather and reduce-scatter
    assert traffic.count == 3 * units - 2
    assert edge.count == 2
    # every parameter is gathered twice (bf16) and reduce-scattered once (bf16) per
    # micro-batch, edge included
    total = sum(_unit_params(pricer, k) for k in costs.unit_keys)
    moved = {Collective.ALL_GATHER: 0.0, Collective.REDUCE_SCATTER: 0.0}
    for t in (traffic, edge):
        for (kind, size, _), r in zip(t.collectives, t.times, strict=True):
            moved[kind] += size * r
    assert moved[Collective.ALL_GATHER] == pytest.approx(2 * 2 * total)
    assert moved[Collective.REDUCE_SCATTER] == pytest.approx(2 * total)
    # the edge is the first unit's gather and reduce-scatter, priced as any collective
    p0 = _unit_params(pricer, first)
    group = cluster.groups[0]
    hand = sum(
        group_collective_time(k, p0 * 2, cluster, group, 16, 8)
        for k in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
    )
    assert pricer.dp_single(edge, group.name, DP_ONLY) == pytest.approx(hand)


def test_per_unit_collectives_pay_one_latency_each(graph):
    """Splitting a stage's gather into one per unit adds (units - 1) latencies of an
    all-gather over the same ranks (alpha-beta path: same bandwidth term)."""
    cluster = h100_cluster(1)
    pricer = pricer_for(graph, cluster)
    costs = pricer.costs
    layer = costs.unit_keys[1]
    comp = ((layer, LAYERS),)
    per_unit = pricer.dp_traffic(comp, DP_ONLY, dp=8, zero=3)
    g = cluster.groups[0].name
    t_units = pricer.dp_single(per_unit, g, DP_ONLY)
    p = _unit_params(pricer, layer)
    link = cluster.link(cluster.groups[0].intra_link)
    alpha = BASE_LATENCY_S + ring_steps(Collective.ALL_GATHER, 8) * link.latency
    one_gather = 2 * p * LAYERS * (7 / 8) / link.effective_bandwidth + alpha
    one_rs = one_gather  # same bytes (bf16) and ring steps
    hand = 2 * one_gather + one_rs + 3 * (LAYERS - 1) * alpha
    assert t_units == pytest.approx(hand, rel=1e-9)


def test_fp32_reduction_doubles_the_gradient_bytes_only(graph):
    cluster = h100_cluster(2)
    comp = pricer_for(graph, cluster).costs.composition(0, len(graph.units))
    plain = pricer_for(graph, cluster).dp_traffic(comp, DP_ONLY, dp=16, zero=1)
    fp32 = pricer_for(graph, cluster, engine=Engine(reduce_fp32=True)).dp_traffic(
        comp, DP_ONLY, dp=16, zero=1
    )
    for (kind, size, _), (_, size32, _) in zip(plain.collectives, fp32.collectives, strict=True):
        want = 2 * size if kind == Collective.REDUCE_SCATTER else size
        assert size32 == pytest.approx(want)
    assert Engine(reduce_fp32=True).describe() == "fp32-reduce"


def test_optimizer_streams_adamw_and_clipping_bytes_of_the_owned_shard(graph):
    cluster = h100_cluster(2)
    pricer = pricer_for(graph, cluster)
    comp = pricer.costs.composition(0, len(graph.units))
    gpu = cluster.groups[0].gpu
    total = sum(_unit_params(pricer, k) for k in pricer.costs.unit_keys)
    hbm = gpu.hbm_bandwidth * kernel_efficiency(gpu).memory
    streamed = OPTIMIZER_BYTES_PER_PARAM + GRAD_CLIP_BYTES_PER_PARAM
    g = cluster.groups[0].name
    z0 = pricer.optimizer_time(comp, g, DP_ONLY, dp=16, zero=0)
    z1 = pricer.optimizer_time(comp, g, DP_ONLY, dp=16, zero=1)
    assert z0 == pytest.approx(total * streamed / hbm)
    assert z1 == pytest.approx(total / 16 * streamed / hbm)
    # fused AdamW: read weight, gradient, momentum, variance (fp32) and write three back
    assert OPTIMIZER_BYTES_PER_PARAM == 4 * 4 + 3 * 4


def test_zero3_edge_is_in_every_microbatch_and_reported_as_exposed_dp(graph):
    cluster = h100_cluster(2)
    p = Parallel(
        dp=16,
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        micro_batch=1,
        global_batch=64,
        zero=3,
        recompute="none",
        schedule="1f1b",
        sequence_parallel=False,
        quantize_activations=False,
    )
    stages = place_stages(cluster, p, even_stages(graph, 1))
    pred = predict(graph, cluster, p, stages)
    parts = dict(pred.breakdown)
    assert sum(parts.values()) == pytest.approx(pred.step_time_s, rel=1e-9)
    pricer = pricer_for(graph, cluster)
    first = pricer.costs.unit_keys[0]
    edge = pricer.dp_single(
        pricer.dp_edge(first, p.stage(), dp=16), cluster.groups[0].name, p.stage()
    )
    m = 64 // 16
    assert edge > 0
    assert parts["dp_comm_exposed"] >= m * edge * (1 - 1e-9)
