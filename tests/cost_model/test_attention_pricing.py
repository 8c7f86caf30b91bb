"""Fused attention and activation memory against independent oracles: FLOPs counted by hand
with the FlashAttention-2 paper's throughput (Dao 2023, Fig. 4), and the traced activations of
a GPT layer against Korthikanti et al. (2022)."""

from __future__ import annotations

import pytest
from meshplan.cost_model.compute import (
    attention_efficiency,
    attention_shape_factor,
    block_compute,
    fused_loss_time,
    kernel_efficiency,
    loss_chain,
    roofline_time,
)
from meshplan.cost_model.engine import Engine, EngineError
from meshplan.cost_model.memory import block_memory, stage_memory
from meshplan.ir import Op, OpKind, Recompute, TensorMeta

from tests.synthetic import A100, H100


def _sdpa(b: int, a: int, s: int, d: int, *, causal: bool) -> Op:
    """A fused attention op as the tracer records it: FlopCounterMode's FLOPs (the full
    square; backward 5 matmuls, 2.5x the forward), bytes of q, k, v and the output."""
    q = TensorMeta((b, a, s, d), "bfloat16")
    flops = 4 * b * a * s * s * d
    return Op(
        "attn",
        OpKind.ATTENTION,
        "aten._scaled_dot_product_flash_attention.default",
        "attn",
        (q, q, q),
        (q,),
        fwd_flops=flops,
        bwd_flops=5 * flops // 2,
        fwd_bytes=4 * q.nbytes,
        bwd_bytes=8 * q.nbytes,
        attrs=(("causal", causal), ("head_dim", d), ("heads", a)),
    )


def _fwd_bwd_tflops(op: Op, gpu, kernel: str) -> float:
    """Forward + backward TFLOP/s the cost model gives `op`, on the FA2 paper's FLOP count
    (4 b a s^2 d forward, 2.5x that backward, halved under a causal mask)."""
    b, a, s, d = op.inputs[0].shape
    paper_flops = 3.5 * 4 * b * a * s * s * d * (0.5 if op.attr("causal") else 1.0)
    t = sum(roofline_time(op, gpu, "bfloat16", backward=bw, attention=kernel) for bw in (0, 1))
    return paper_flops / t / 1e12


@pytest.mark.parametrize(
    "kernel, d, causal, s, published",
    [
        # FA2 paper Fig. 4(d): causal, head dim 128, 4k tokens: 173 TFLOP/s forward+backward
        ("flash2", 128, True, 4096, 173),
        ("flash2", 128, True, 16384, 189),  # the reference shape
        ("flash2", 64, False, 2048, 162),  # Fig. 4(a)
        # FlashAttention 1.x (and MPT's Triton port of it), Fig. 4(c) and 4(d)
        ("flash1", 64, True, 2048, 77),
        ("flash1", 128, True, 512, 55),
        ("flash1", 128, True, 8192, 80),
    ],
)
def test_attention_runs_at_the_published_throughput_on_a100(kernel, d, causal, s, published):
    op = _sdpa(16384 // s, 2048 // d, s, d, causal=causal)  # the paper's 16k tokens, 2048 wide
    # 0.3%: the shipped A100 reference (0.661 / 0.586) rounds 189 TFLOP/s to three digits
    assert _fwd_bwd_tflops(op, A100, kernel) == pytest.approx(published, rel=3e-3)


def test_between_measured_points_log_sequence_and_head_dim_interpolate():
    # sqrt(2k * 4k) is halfway in log2: (155 + 173) / 2 for causal head dim 128
    mid = attention_shape_factor("flash2", 128, True, 2896)
    assert mid * 189 == pytest.approx(164, abs=0.2)
    # head dim 96 is halfway between 64 and 128: at 4k causal (156 + 173) / 2
    assert attention_shape_factor("flash2", 96, True, 4096) * 189 == pytest.approx(164.5)
    # held at the ends: 64k runs as 16k, 128 tokens as 512, head dim 256 as 128
    assert attention_shape_factor("flash1", 128, True, 65536) == pytest.approx(83 / 189)
    assert attention_shape_factor("flash2", 128, True, 128) == pytest.approx(99 / 189)
    assert attention_shape_factor("flash2", 256, True, 16384) == 1.0


def test_other_gpus_scale_their_reference_by_the_same_shape_factor():
    op = _sdpa(4, 16, 4096, 128, causal=True)
    k = kernel_efficiency(H100)
    assert attention_efficiency(op, H100) == pytest.approx(k.attention_fwd * 173 / 189)
    assert attention_efficiency(op, H100, backward=True, kernel="flash1") == pytest.approx(
        k.attention_bwd * 76 / 189
    )


def test_engine_rejects_an_unknown_attention_kernel():
    with pytest.raises(EngineError, match="attention kernel"):
        Engine(attention="flash9")
    assert Engine(attention="flash1", fused_loss=True).describe() == "attention flash1+fused-loss"


# -- activation memory -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt():
    """A small GPT (LayerNorm, GELU MLP of 4h, flash SDPA, no dropout) traced by meshplan."""
    from meshplan import models
    from meshplan.ir import trace

    model, inputs = models.transformer(
        layers=2, hidden=512, heads=8, ffn=2048, vocab=4096, seq_len=256, style="gpt",
        tie_embeddings=True,
    )  # fmt: skip
    return trace(model, *inputs)


def test_gpt_layer_saves_korthikanti_bytes_with_flash_attention(gpt):
    """Korthikanti et al. 2022 (section 4.1): s b h (34 + 5 a s / h) bytes per layer without
    recompute. Flash attention keeps no s x s tensor (the 5 a s / h term goes); this model
    has no dropout, so the two 1-byte masks (s b h each, after attention and after the MLP)
    go too: 32 s b h, plus what the formula leaves out (the fp32 logsumexp per head and
    token, the norms' mean and rstd)."""
    s, b, h, a = gpt.info.seq_len, gpt.info.micro_batch, 512, 8
    layer = next(blk for _, blk in gpt.blocks if blk.kind == "layer")
    mem = block_memory(layer)
    korthikanti = s * b * h * (34 - 2)
    assert mem.saved_tp + mem.saved_sp == pytest.approx(korthikanti, rel=0.02)
    lse = 4 * a * s * b
    assert mem.saved_tp + mem.saved_sp - korthikanti >= lse


def test_fused_cross_entropy_keeps_the_logits_not_an_fp32_copy(gpt):
    epilogue = next(blk for _, blk in gpt.blocks if blk.kind == "epilogue")
    chain = loss_chain(epilogue)
    assert chain and any(epilogue.ops[i].kind == OpKind.LOSS for i in chain)
    s, b, v = gpt.info.seq_len, gpt.info.micro_batch, 4096
    logits = 2 * s * b * v  # bf16
    mem = block_memory(epilogue)
    kw = {"tp": 1, "cp": 1, "sequence_parallel": False, "scale": 1.0}
    eager = mem.activations(**kw, recompute=Recompute.NONE)
    fused = mem.activations(**kw, recompute=Recompute.NONE, fused_loss=True)
    # eager keeps the fp32 log-softmax (4 bytes a logit), the labels and a scalar weight;
    # fused the bf16 logits, the fp32 logsumexp and the int64 label of each row
    assert eager - fused == pytest.approx(4 * s * b * v - logits - 4 * s * b, abs=8)
    st = stage_memory([(mem, 1)], **kw | {"ep": 1, "dp": 1, "zero": 0},
                      recompute=Recompute.NONE, fused_loss=True)  # fmt: skip
    assert st.temporary == pytest.approx(logits)  # the logits' gradient
    # one kernel: read the logits (and write an fp32 lse a row) forward; read + write back
    bw = A100.hbm_bandwidth * kernel_efficiency(A100).memory
    assert fused_loss_time(epilogue, A100) == pytest.approx((logits + 4 * s * b) / bw)
    assert fused_loss_time(epilogue, A100, backward=True) == pytest.approx(2 * logits / bw)
    # and it is what the block's backward prices in place of the eager chain's passes
    fused_bc = block_compute(epilogue, A100, "bfloat16", Engine(fused_loss=True))
    eager_bc = block_compute(epilogue, A100, "bfloat16", Engine(attention="flash1"))
    rest = (
        eager_bc.bwd_tp
        + eager_bc.bwd_sp
        - sum(roofline_time(epilogue.ops[i], A100, "bfloat16", backward=True) for i in chain)
    )
    assert fused_bc.bwd_tp + fused_bc.bwd_sp == pytest.approx(rest + 2 * logits / bw, rel=1e-9)
