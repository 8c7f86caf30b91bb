"""The step-time simulator (`predict`): breakdowns, pipeline bubble, MFU, scaling, errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
from meshplan.cost_model import BREAKDOWN_PARTS, predict
from meshplan.cost_model.compute import KERNEL_FLOOR_S
from meshplan.ir import Parallel, StagePlacement
from meshplan.passes.partition import even_stages, place_stages

from tests.synthetic import H100, h100_cluster, mixed_cluster, transformer_graph

# These models are small enough that the host would bind (`cost_model.host`).
pytestmark = pytest.mark.usefixtures("gpu_time_only")


def config(**kw) -> Parallel:
    base = {
        "dp": 1,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "micro_batch": 1,
        "global_batch": 8,
        "recompute": "none",
        "zero": 0,
        "schedule": "1f1b",
        "sequence_parallel": False,
    }
    return Parallel(**(base | kw))


def run(g, c, p):
    return predict(g, c, p, place_stages(c, p, even_stages(g, p.pp)))


def test_breakdown_has_every_part_and_sums_to_the_step():
    g = transformer_graph(8, 1024, 16, 4, 4096, 32000, 2048, 1)
    c = mixed_cluster(1, 1)
    for p in (
        config(dp=8, tp=2, global_batch=64, zero=1, sequence_parallel=True),
        config(dp=2, tp=2, pp=4, global_batch=64, recompute="full", zero=3),
        config(dp=4, tp=1, pp=4, micro_batch=2, global_batch=64, recompute="selective"),
    ):
        pred = run(g, c, p)
        parts = pred.breakdown_dict()
        assert tuple(parts) == BREAKDOWN_PARTS
        assert sum(parts.values()) == pytest.approx(pred.step_time_s, rel=1e-12)
        assert all(v >= 0 for v in parts.values())


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_1f1b_bubble_fraction_for_equal_stages(pp, m):
    g = transformer_graph(8, 1024, 16, 16, 4096, 0, 1024, 1, embed_and_head=False)
    p = config(pp=pp, global_batch=m)
    pred = run(g, h100_cluster(1), p)
    parts = pred.breakdown_dict()
    pipeline = pred.step_time_s - parts["dp_comm_exposed"] - parts["optimizer"]
    assert parts["pp_bubble"] == pytest.approx((pp - 1) / (m + pp - 1) * pipeline, rel=1e-9)
    stage = pipeline / (m + pp - 1)  # one micro-batch of the (equal) stages, p2p included
    assert parts["pp_bubble"] == pytest.approx((pp - 1) * stage, rel=1e-9)
    assert parts["pp_p2p"] > 0


def test_gpipe_and_1f1b_take_the_same_time_but_not_the_same_memory():
    g = transformer_graph(8, 1024, 16, 16, 4096, 32000, 1024, 1)
    c = h100_cluster(1)
    one = run(g, c, config(pp=4, global_batch=16))
    gpipe = run(g, c, config(pp=4, global_batch=16, schedule="gpipe"))
    assert gpipe.step_time_s == pytest.approx(one.step_time_s, rel=1e-12)
    assert gpipe.memory[0].peak_bytes > one.memory[0].peak_bytes


def test_mfu_counts_model_flops_over_the_peak_of_the_gpus_used():
    g = transformer_graph(4, 2048, 16, 16, 8192, 32000, 2048, 2)
    c = mixed_cluster(1, 1)
    p = config(dp=4, tp=2, pp=2, micro_batch=1, global_batch=32, sequence_parallel=True)
    pred = run(g, c, p)  # stage 0 on the H100 node, stage 1 on the A100 node
    flops = g.total_flops(training=True) * 32 / 2  # the graph holds 2 sequences
    assert pred.model_flops_per_step == pytest.approx(flops)
    peak = 8 * 989e12 + 8 * 312e12
    assert pred.mfu == pytest.approx(flops / (pred.step_time_s * peak), rel=1e-12)
    assert pred.tokens_per_s == pytest.approx(32 * 2048 / pred.step_time_s, rel=1e-12)
    assert "bottleneck: stage 1 on a100" in pred.notes  # the A100 stage is the bottleneck


def test_micro_batch_scales_the_traced_costs_linearly():
    g1 = transformer_graph(4, 4096, 32, 32, 16384, 32000, 4096, 1)
    g2 = transformer_graph(4, 4096, 32, 32, 16384, 32000, 4096, 2)
    c = h100_cluster(1)
    p = config(micro_batch=2, global_batch=8)
    from_1 = run(g1, c, p)
    from_2 = run(g2, c, p)
    assert any("scaled linearly" in n for n in from_1.notes)
    # the same work, except the kernel floors of twice as many launches per sequence
    kernels = sum(1 for op in g1.block("layer").ops if op.fwd_flops or op.fwd_bytes)
    diff = from_1.breakdown_dict()["compute"] - from_2.breakdown_dict()["compute"]
    assert abs(diff) < 4 * 2 * 6 * kernels * KERNEL_FLOOR_S
    assert from_1.breakdown_dict()["compute"] == pytest.approx(
        from_2.breakdown_dict()["compute"], rel=0.02
    )
    assert from_1.memory[0].peak_bytes == pytest.approx(from_2.memory[0].peak_bytes, rel=0.01)


def test_tensor_parallel_traffic_by_hand():
    b, s, h = 1, 2048, 4096
    g = transformer_graph(1, h, 32, 32, 4 * h, 0, s, b, embed_and_head=False)
    c = h100_cluster(1)
    tp = 8
    # two row-parallel linears per layer, an all-reduce each in forward and in backward
    # NCCL ring latency: base 8.4 us + 2(tp-1) hops of 2 us (cost_model/collectives.py)
    ar = 8.4e-6 + 2 * (tp - 1) * 2e-6 + 2 * (tp - 1) / tp * (2 * b * s * h) / (450e9 * 0.8)
    pred = run(g, c, config(tp=tp, global_batch=1))
    assert pred.breakdown_dict()["tp_comm"] == pytest.approx(4 * ar, rel=1e-9)
    # sequence parallel: all-gather + reduce-scatter of the same volume and ring steps, two
    # base latencies
    pred = run(g, c, config(tp=tp, global_batch=1, sequence_parallel=True))
    assert pred.breakdown_dict()["tp_comm"] == pytest.approx(4 * (ar + 8.4e-6), rel=1e-9)


def test_fits_compares_with_gpu_memory():
    g = transformer_graph(4, 2048, 16, 16, 8192, 32000, 4096, 1)
    small = dataclasses.replace(H100, memory_bytes=2 * 2**30)
    assert run(g, h100_cluster(1), config(global_batch=1)).fits
    pred = run(g, h100_cluster(1, gpu=small), config(global_batch=1))
    assert not pred.fits
    assert pred.peak_memory_bytes > 2 * 2**30
    assert all(r.capacity_bytes == 2 * 2**30 for r in pred.memory)


def test_slower_group_is_the_bottleneck_of_a_split_stage():
    g = transformer_graph(4, 2048, 16, 16, 8192, 32000, 2048, 1)
    c = mixed_cluster(1, 1)
    p = config(dp=2, global_batch=8, tp=4, sequence_parallel=True)
    split = (StagePlacement(0, 0, len(g.units), (("h100", 1), ("a100", 1))),)
    only_h = (StagePlacement(0, 0, len(g.units), (("h100", 2),)),)
    only_a = (StagePlacement(0, 0, len(g.units), (("a100", 2),)),)
    t_split = predict(g, c, p, split)
    t_a = predict(g, c, p, only_a)
    assert predict(g, c, p, only_h).step_time_s < t_split.step_time_s
    # same A100 compute; the split pays DP traffic across groups instead of inside one node
    assert t_split.breakdown_dict()["compute"] == pytest.approx(
        t_a.breakdown_dict()["compute"], rel=1e-12
    )
    assert {(r.stage, r.group) for r in t_split.memory} == {(0, "h100"), (0, "a100")}


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 8)])
def test_interleaved_bubble_fraction_for_equal_stages(pp, v, m):
    g = transformer_graph(16, 1024, 16, 16, 4096, 0, 1024, 1, embed_and_head=False)
    p = config(pp=pp, global_batch=m, schedule="interleaved_1f1b", virtual_stages=v)
    parts = run(g, h100_cluster(1), p).breakdown_dict()
    u = sum(parts[k] for k in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm")) / m
    p2p = parts["pp_p2p"] / (m * v)  # every chunk boundary sends: v times 1F1B's messages
    bubble = parts["pp_bubble"] - (pp - 1) * p2p
    assert bubble == pytest.approx((pp - 1) / v * u, rel=1e-9)
    # closed form (Narayanan et al. SC'21): (p - 1) / (v m + p - 1) of the pipeline time
    assert bubble / (m * u + bubble) == pytest.approx((pp - 1) / (v * m + pp - 1), rel=1e-9)
    one = run(g, h100_cluster(1), config(pp=pp, global_batch=m)).breakdown_dict()
    assert parts["compute"] == pytest.approx(one["compute"], rel=1e-12)
    assert parts["pp_bubble"] < one["pp_bubble"]


def test_invalid_configurations_raise_one_line_errors():
    g = transformer_graph(4, 512, 8, 8, 2048, 1000, 512, 1)
    c = h100_cluster(1)
    p = config(pp=2, global_batch=8)
    stages = place_stages(c, p, even_stages(g, 2))
    with pytest.raises(ValueError, match="'zero_bubble' \\(ZB-V\\) needs at least 2\\*pp - 1 = 3"):
        predict(g, c, dataclasses.replace(p, schedule="zero_bubble", global_batch=2), stages)
    uneven = place_stages(c, p, ((0, 2), (2, len(g.units))))  # 1 and 3 layers
    with pytest.raises(
        ValueError, match=r"gives the ranks \[2, 2\] layers, but the stages hold \[1, 3\]"
    ):
        predict(g, c, dataclasses.replace(p, schedule="interleaved_1f1b", virtual_stages=2), uneven)
    with pytest.raises(ValueError, match="not divisible by dp"):
        predict(g, c, dataclasses.replace(p, micro_batch=2, global_batch=7), stages)
    with pytest.raises(ValueError, match="complete Parallel"):
        predict(g, c, Parallel(tp=1), stages)
    with pytest.raises(ValueError, match="1 stage placements"):
        predict(g, c, p, stages[:1])
    with pytest.raises(ValueError, match="2 replicas but dp=1"):
        predict(g, c, p, (stages[0], dataclasses.replace(stages[1], replicas=(("h100", 2),))))
    with pytest.raises(ValueError, match="need 16 GPUs, it has 8"):
        wide = tuple(dataclasses.replace(st, replicas=(("h100", 8),)) for st in stages)
        predict(g, c, dataclasses.replace(p, dp=8, global_batch=8), wide)


def test_zero3_pays_its_traffic_every_micro_batch():
    g = transformer_graph(4, 4096, 32, 32, 16384, 32000, 1024, 1)
    c = mixed_cluster(1, 1, wan=True)  # the DP ring crosses a 100 Gb/s WAN
    p = config(dp=2, tp=8, global_batch=16, sequence_parallel=True)
    split = (StagePlacement(0, 0, len(g.units), (("h100", 1), ("a100", 1))),)
    z2 = predict(g, c, dataclasses.replace(p, zero=2), split).breakdown_dict()
    z3 = predict(g, c, dataclasses.replace(p, zero=3), split).breakdown_dict()
    assert z2["dp_comm_exposed"] > 0
    assert z3["dp_comm_exposed"] > 4 * z2["dp_comm_exposed"]  # 3 collectives x 8 mbs vs 2


def test_context_parallel_gathers_keys_and_values_by_hand():
    b, s, h, a = 1, 8192, 4096, 32
    g = transformer_graph(1, h, a, a, 4 * h, 0, s, b, embed_and_head=False)
    pred = run(g, h100_cluster(1), config(cp=2, global_batch=1))
    kv = 2 * b * a * s * (h // a) * 2  # K and V, bf16
    gather = 8.4e-6 + 2e-6 + kv * (1 / 2) / (450e9 * 0.8)  # all-gather, 2 ranks on NVLink4
    assert pred.breakdown_dict()["cp_comm"] == pytest.approx(2 * gather, rel=1e-9)  # + RS


def test_expert_parallel_all_to_all_by_hand():
    b, s, h, top_k = 1, 4096, 2048, 2
    g = transformer_graph(
        1, h, 16, 16, 4 * h, 0, s, b, experts=8, top_k=top_k, embed_and_head=False
    )
    pred = run(g, h100_cluster(1), config(dp=4, ep=4, global_batch=4))
    tokens = top_k * b * s * h * 2  # top_k copies of every token's hidden state, bf16
    # the busiest of 4 ranks under a balanced router: Binomial(4 A, 1/4) with A = top_k * s
    # assignments a rank sends; mean + sqrt(2 ln 4) standard deviations
    assignments = top_k * b * s
    busiest = 1 + math.sqrt(2 * math.log(4)) * math.sqrt(0.75 / assignments)
    a2a = 8.4e-6 + 2e-6 + busiest * tokens * (3 / 4) / (450e9 * 0.8)  # base + one step
    assert pred.breakdown_dict()["ep_comm"] == pytest.approx(4 * a2a, rel=1e-9)  # 2 fwd + 2 bwd
    # a measured imbalance replaces the bound
    from meshplan.cost_model.engine import Engine
    from meshplan.cost_model.simulate import predict

    p = config(dp=4, ep=4, global_batch=4)
    c = h100_cluster(1)
    skewed = predict(
        g, c, p, place_stages(c, p, even_stages(g, 1)), engine=Engine(moe_imbalance=1.5)
    )
    a2a = 8.4e-6 + 2e-6 + 1.5 * tokens * (3 / 4) / (450e9 * 0.8)
    assert skewed.breakdown_dict()["ep_comm"] == pytest.approx(4 * a2a, rel=1e-9)


def test_moe_imbalance_is_capped_by_the_capacity_factor():
    from meshplan.cost_model.graph_costs import moe_imbalance

    assert moe_imbalance(1000, 1) == 1.0
    assert moe_imbalance(16384, 8) == pytest.approx(
        1 + math.sqrt(2 * math.log(8)) * math.sqrt((7 / 8) / 16384)
    )
    # few tokens: the statistical spread is large, but capacity drops what exceeds it
    assert moe_imbalance(4, 8, capacity_factor=1.25) == 1.25
    assert moe_imbalance(4, 8) > 1.25


def test_expert_parallel_with_tensor_parallel_gathers_routed_rows_by_hand():
    """EP x TP (Megatron-Core's expert TP under EP, SP on): each tp rank routes its sequence
    shard; after the ep all-to-all the tp group all-gathers the rows its ranks received and
    reduce-scatters their partial outputs, forward and backward. The experts' TP region then
    moves top_k x tokens x hidden (the routed rows, at the busiest rank's load) instead of
    tokens x hidden; the attention's region is unchanged, and the ep all-to-all carries the
    sequence shard's rows."""
    b, s, h, top_k, tp, ep = 1, 4096, 2048, 2, 2, 4
    g = transformer_graph(
        1, h, 16, 16, 4 * h, 0, s, b, experts=8, top_k=top_k, embed_and_head=False
    )
    p = config(dp=4, ep=ep, tp=tp, global_batch=4, sequence_parallel=True)
    pred = run(g, h100_cluster(1), p)

    def nvlink(bus_factor, size):  # one NVLink4 collective: base + one step + volume
        return 8.4e-6 + 2e-6 + size * bus_factor / (450e9 * 0.8)

    tokens = b * s * h * 2  # one hidden state per token, bf16
    # a rank sends its sequence shard's top_k choices: the busiest of 4 ep ranks' load
    assignments = top_k * b * s / tp
    busiest = 1 + math.sqrt(2 * math.log(ep)) * math.sqrt((ep - 1) / ep / assignments)
    rows = top_k * tokens * busiest  # the rows the tp group gathers (all tp ranks' rows)
    ag_rs = lambda size: 2 * nvlink(1 / 2, size)  # noqa: E731 (AG + RS over 2 ranks)
    # forward and backward: the attention's region (tokens) and the experts' (routed rows)
    assert pred.breakdown_dict()["tp_comm"] == pytest.approx(
        2 * (ag_rs(tokens) + ag_rs(rows)), rel=1e-9
    )
    a2a = nvlink(3 / 4, top_k * tokens / tp * busiest)  # 4 ranks
    assert pred.breakdown_dict()["ep_comm"] == pytest.approx(4 * a2a, rel=1e-9)
    # without EP the experts are one region of the block output's size (tokens)
    dense = run(g, h100_cluster(1), config(dp=4, tp=tp, global_batch=4, sequence_parallel=True))
    assert dense.breakdown_dict()["tp_comm"] == pytest.approx(4 * ag_rs(tokens), rel=1e-9)


def test_cp_kv_bytes_count_the_kv_heads_not_their_repetition():
    """Context parallelism moves K and V with the model's KV heads. A traced attention whose K/V
    were widened to the query heads before SDPA (HF's `repeat_kv`, which HF runs whenever it
    passes a mask, as under tracing; the tracer's `kv_heads` attr looks through it) is priced
    as the un-repeated K/V, like the one that hands SDPA the KV heads."""
    from meshplan.cost_model.graph_costs import model_costs
    from meshplan.ir import OpKind

    g = transformer_graph(2, 256, 8, 2, 1024, 1000, 512, 1, dtype="float32")
    key = g.layer_units[0].block
    block = g.block(key)
    attn = block.ops_of(OpKind.ATTENTION)[0]
    q, k, v = attn.inputs[:3]
    assert k.shape[1] == 2 and q.shape[1] == 8
    kv = model_costs(g).facts[key].kv_bytes
    assert kv == 2 * 256 // 8 * 2 * 512 * 4  # K and V: kv_heads x head_dim x seq, fp32
    widened = dataclasses.replace(
        attn,
        inputs=(q, dataclasses.replace(k, shape=q.shape), dataclasses.replace(v, shape=q.shape)),
    )
    ops = tuple(widened if op is attn else op for op in block.ops)
    blocks = tuple((k_, dataclasses.replace(b, ops=ops) if k_ == key else b) for k_, b in g.blocks)
    assert model_costs(dataclasses.replace(g, blocks=blocks)).facts[key].kv_bytes == kv
