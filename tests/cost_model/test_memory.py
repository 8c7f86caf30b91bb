"""Per-rank memory against the hardware.md / ZeRO / Korthikanti formulas, by hand."""

from __future__ import annotations

import pytest
from meshplan.cost_model import predict
from meshplan.cost_model.engine import Engine
from meshplan.cost_model.memory import (
    ALLOCATOR_MARGIN,
    CONTEXT_BYTES,
    state_bytes_per_param,
)
from meshplan.ir import Parallel
from meshplan.passes.partition import even_stages, place_stages

from tests.synthetic import h100_cluster, transformer_graph

L, H, A, F, V, S, B = 2, 64, 4, 256, 1000, 32, 2  # layers, hidden, heads, ffn, vocab, seq, mb


def graph():
    return transformer_graph(L, H, A, A, F, V, S, B)


def run(tp=2, pp=2, dp=4, zero=0, recompute="none", schedule="1f1b", sp=True, m=8):
    g, c = graph(), h100_cluster(4)
    p = Parallel(
        dp=dp,
        tp=tp,
        pp=pp,
        cp=1,
        ep=1,
        micro_batch=B,
        global_batch=dp * B * m,
        recompute=recompute,
        zero=zero,
        schedule=schedule,
        sequence_parallel=sp,
    )
    pred = predict(g, c, p, place_stages(c, p, even_stages(g, pp)))
    return {r.stage: dict(r.breakdown) | {"peak": r.peak_bytes} for r in pred.memory}


def stage_parts(tp=2, recompute="none", policy="keep_linear"):
    """The components of the whole model's stage (pp = 1) before the peak rule picks a
    moment (`StageMemory`)."""
    from meshplan.cost_model.pricer import pricer_for
    from meshplan.ir import Recompute, StageConfig

    g, c = graph(), h100_cluster(4)
    pricer = pricer_for(g, c, engine=Engine(selective=policy))
    comp = pricer.costs.composition(0, len(g.units))
    cfg = StageConfig(tp, 1, 1, True, B, Recompute(recompute))
    return pricer.stage_memory(comp, cfg, dp=4, zero=0)


def layer_params_per_rank(tp):
    return (4 * H * H + 2 * H * F) / tp + 2 * H  # qkv, o, up, down split; two norms whole


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_follow_the_zero_formulas(zero):
    tp, dp = 2, 4
    per_byte = {0: 16, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}[zero]
    stage0 = V * H / tp + layer_params_per_rank(tp)  # embedding + layer 0
    stage1 = layer_params_per_rank(tp) + V * H / tp + H  # layer 1 + head + final norm
    mem = run(tp=tp, dp=dp, zero=zero)
    for s, params in ((0, stage0), (1, stage1)):
        states = mem[s]["weights"] + mem[s]["grads"] + mem[s]["optimizer"]
        assert states == pytest.approx(per_byte * params, abs=3)
        gathered = 2 * layer_params_per_rank(tp) if zero == 3 else 0  # largest gathered layer
        assert mem[s]["zero3_gather"] == pytest.approx(gathered, abs=1)
    assert sum(state_bytes_per_param(zero, dp)) == pytest.approx(per_byte)


def korthikanti_layer(tp=1):
    """s*b*h*34 + 5*a*s^2*b bytes per layer, divided by tp under sequence parallelism."""
    return (S * B * H * 34 + 5 * A * S * S * B) / tp


def test_synthetic_layer_saves_korthikanti_bytes():
    assert graph().block("layer").saved_bytes == korthikanti_layer()


def test_activations_with_sequence_parallel_and_1f1b_in_flight():
    tp, pp = 2, 2
    mem = run(tp=tp, pp=pp)
    embed_saved = 8 * B * S  # int64 token ids, on the vocab-parallel embedding
    head_saved = 2 * B * S * H + 2 * B * S * H + 4 * B * S * V  # norm in, head in, fp32 logp
    per_mb0 = korthikanti_layer(tp) + embed_saved / tp
    per_mb1 = korthikanti_layer(tp) + head_saved / tp
    # 1F1B: stage i of p holds p - i micro-batches (hardware.md)
    assert mem[0]["activations"] == pytest.approx(pp * per_mb0, abs=2)
    assert mem[1]["activations"] == pytest.approx(1 * per_mb1, abs=2)


def test_gpipe_holds_every_micro_batch():
    m = 8
    mem = run(schedule="gpipe", m=m)
    one = run(schedule="1f1b", m=m)
    assert mem[0]["activations"] == pytest.approx(one[0]["activations"] / 2 * m, rel=1e-9)


def test_recompute_selective_and_full():
    tp = 2
    none, sel, full = (run(tp=tp, pp=1, recompute=r) for r in ("none", "selective", "full"))
    # pp = 1: one micro-batch in flight; two layers, prologue and epilogue on the stage
    edges = none[0]["activations"] - 2 * korthikanti_layer(tp)
    # selective keeps the layer input and the outputs of qkv (3h), attention (h), o (h),
    # up (f) and down (h), all bf16 and sequence-sharded under SP; the rest is recomputed
    kept = 2 * B * S * (H + 3 * H + H + H + F + H) / tp
    assert sel[0]["activations"] == pytest.approx(edges + 2 * kept, abs=2)
    ws_sel = stage_parts(tp, "selective").recompute_workspace
    assert ws_sel == pytest.approx(korthikanti_layer(tp) - kept, abs=2)
    layer_input = 2 * B * S * H / tp  # bf16 hidden state, sequence-sharded under SP
    assert full[0]["activations"] == pytest.approx(edges + 2 * layer_input, abs=2)
    # the layer being recomputed rebuilds everything but its (already held) input
    full_parts = stage_parts(tp, "full")
    assert full_parts.recompute_workspace == pytest.approx(
        korthikanti_layer(tp) - layer_input, abs=2
    )


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_peak_is_the_larger_of_two_moments(recompute):
    """Start of backward: every saved activation + twice the largest output (the logits and
    their gradient). A recomputed layer's backward: the epilogue's activations already
    freed, the layer's rebuilt ones and twice its largest output. Never both at once."""
    m = stage_parts(2, recompute)
    start = m.activations_per_microbatch + m.temporary
    during = (
        m.activations_per_microbatch
        - m.freed_before_recompute
        + m.recompute_workspace
        + m.layer_temporary
    )
    peak, parts = m.peak(1)
    parts = dict(parts)
    states = m.weights + m.grads + m.optimizer + m.zero3_gather
    assert parts["activations"] + parts["recompute_workspace"] + parts["temporary"] == (
        pytest.approx(max(start, during), abs=4)
    )
    assert peak == pytest.approx(
        (states + max(start, during)) * (1 + ALLOCATOR_MARGIN) + CONTEXT_BYTES, abs=8
    )
    # the logits (vocab 1000 > ffn 256 > hidden) are the largest output: start of backward
    assert m.temporary > m.layer_temporary > 0


@pytest.mark.parametrize("pp,v,m", [(2, 2, 8), (4, 2, 8), (4, 3, 16), (4, 4, 2)])
def test_interleaved_in_flight_follows_megatron_warmup(pp, v, m):
    from meshplan.cost_model.memory import in_flight_microbatches

    for i in range(pp):
        chunks = min(2 * (pp - i - 1) + (v - 1) * pp + 1, m * v)
        assert in_flight_microbatches("interleaved_1f1b", i, pp, m, v) == chunks / v
    # one chunk is plain 1F1B; stage 0 holds about pp * (1 + 1/v) micro-batches
    assert in_flight_microbatches("interleaved_1f1b", 0, pp, m, 1) == min(pp, m)
    if 2 * (pp - 1) + (v - 1) * pp + 1 <= m * v:
        assert in_flight_microbatches("interleaved_1f1b", 0, pp, m, v) == pytest.approx(
            pp * (1 + 1 / v) - 1 / v
        )


def test_peak_adds_allocator_margin_and_context():
    mem = run()
    for parts in mem.values():
        subtotal = sum(v for k, v in parts.items() if k not in ("overhead", "peak"))
        assert parts["overhead"] == pytest.approx(
            ALLOCATOR_MARGIN * subtotal + CONTEXT_BYTES, abs=8
        )
        assert parts["peak"] == sum(v for k, v in parts.items() if k != "peak")


def _run_policy(policy: str, tp: int = 2):
    g, c = graph(), h100_cluster(4)
    p = Parallel(
        dp=4, tp=tp, pp=1, cp=1, ep=1, micro_batch=B, global_batch=4 * B, recompute="selective",
        zero=0, schedule="1f1b", sequence_parallel=True,
    )  # fmt: skip
    pred = predict(g, c, p, place_stages(c, p, even_stages(g, 1)), engine=Engine(selective=policy))
    return dict(pred.memory[0].breakdown), pred.breakdown_dict()


def test_torchtitan_op_policy_keeps_every_other_linear():
    """torchtitan's op-level SAC saves the 1st, 3rd, ... mm of each layer (qkv, up here) and
    the attention output; o and down are recomputed. By hand, per layer, bf16, /tp under SP:
    input h + qkv 3h + attention h + up f."""
    tp = 2
    none = run(tp=tp, pp=1)
    edges = none[0]["activations"] - 2 * korthikanti_layer(tp)
    mem, step = _run_policy("torchtitan_op", tp)
    kept = 2 * B * S * (H + 3 * H + H + F) / tp
    assert mem["activations"] == pytest.approx(edges + 2 * kept, abs=2)
    ws = stage_parts(tp, "selective", "torchtitan_op").recompute_workspace
    assert ws == pytest.approx(korthikanti_layer(tp) - kept, abs=2)
    # It recomputes more than meshplan's keep-every-linear policy (o and down again).
    _, default = _run_policy("keep_linear", tp)
    assert step["recompute"] > default["recompute"] > 0


def test_every_other_layer_policy_is_half_full_half_none():
    tp = 2
    none, full = run(tp=tp, pp=1), run(tp=tp, pp=1, recompute="full")
    mem, step = _run_policy("every_other_layer", tp)
    expect = (none[0]["activations"] + full[0]["activations"]) / 2
    assert mem["activations"] == pytest.approx(expect, abs=2)
    ws = stage_parts(tp, "selective", "every_other_layer").recompute_workspace
    assert ws == pytest.approx(stage_parts(tp, "full").recompute_workspace, abs=2)
    full_step = predict(
        graph(), h100_cluster(4),
        Parallel(dp=4, tp=tp, pp=1, cp=1, ep=1, micro_batch=B, global_batch=4 * B,
                 recompute="full", zero=0, schedule="1f1b", sequence_parallel=True),
        place_stages(h100_cluster(4), Parallel(dp=4, tp=tp, pp=1, cp=1), even_stages(graph(), 1)),
    ).breakdown_dict()  # fmt: skip
    assert step["recompute"] == pytest.approx(full_step["recompute"] / 2, rel=1e-9)


def test_context_parallel_ranks_share_zero_shards_and_gradient_reduction():
    """CP ranks hold the same weights: ZeRO shards and gradient reductions span dp * cp
    (Megatron's data-parallel group with CP, torchtitan's dp_shard x cp mesh)."""
    from meshplan.cost_model.collectives import Collective
    from meshplan.cost_model.pricer import pricer_for

    g, c = graph(), h100_cluster(4)
    dp, cp = 2, 2
    p = Parallel(
        dp=dp, tp=1, pp=1, cp=cp, ep=1, micro_batch=B, global_batch=dp * B, recompute="none",
        zero=3, schedule="1f1b", sequence_parallel=False,
    )  # fmt: skip
    pred = predict(g, c, p, place_stages(c, p, even_stages(g, 1)))
    params = V * H + 2 * layer_params_per_rank(1) + V * H + H  # embed, 2 layers, head, norm
    mem = dict(pred.memory[0].breakdown)
    states = mem["weights"] + mem["grads"] + mem["optimizer"]
    assert states == pytest.approx(16 * params / (dp * cp), abs=4)
    pricer = pricer_for(g, c)
    comp = pricer.costs.composition(0, len(g.units))
    z0 = pricer.dp_traffic(comp, p.stage(), dp=dp, zero=0).collectives
    assert z0 == ((Collective.ALL_REDUCE, pytest.approx(2 * params, abs=4), dp * cp),)
