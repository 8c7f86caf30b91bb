"""float32 GEMMs on CUDA cores (`compute.sgemm_seconds`): tiles, waves and split-K.

Oracles: hand-derived wave counts and times of the model's own definition on shapes where
one choice is forced (a single tile, a GEMM far larger than one wave), the FLOP bound no
kernel beats, and the planner's block pricing against the function it is built on."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meshplan.cost_model import compute
from meshplan.cost_model.compute import (
    CUDA_CORE_GEMM_EFFICIENCY,
    KERNEL_FLOOR_S,
    SGEMM,
    block_compute,
    gemm_roofline,
    kernel_efficiency,
    sgemm_seconds,
)
from meshplan.cost_model.kernel_data import bmm_op, linear_op
from meshplan.ir import Block
from meshplan.ir.hardware import gpu_spec

V100 = gpu_spec("V100")  # 80 SMs, 15.7 TFLOP/s FP32
EFF = CUDA_CORE_GEMM_EFFICIENCY


def _flop_bound(batch, m, n, k, gpu=V100) -> float:
    return 2.0 * batch * m * n * k / (gpu.peak("float32") * EFF)


def test_a_large_gemm_runs_near_its_flop_rate():
    """8192^3 fills 512 waves of 128-tiles on 80 SMs (64 x 64 tiles = 4096 = 51.2 waves of
    80; ceil 52): within the last wave's waste and the waves' latency of the FLOP bound."""
    t = sgemm_seconds(1, 8192, 8192, 8192, V100, EFF)
    bound = _flop_bound(1, 8192, 8192, 8192)
    assert bound <= t <= bound * (52 / 51.2) + 52 * SGEMM.wave_latency_s


def test_one_tile_with_a_long_k_is_split():
    """M = N = 128, K = 2^16 on 80 SMs: one 128-tile. Unsplit, one block walks all of K; split
    32 ways, 32 blocks run in one wave and write 32 partial (128 x 128) fp32 sums that are
    read back. The price is at most that split's and far below the unsplit one."""
    m = n = 128
    k = 1 << 16
    rate = V100.peak("float32") * EFF / V100.sms
    per_k = 2.0 * 128 * 128 / rate
    unsplit = SGEMM.wave_latency_s + per_k * k
    partial_bw = V100.hbm_bandwidth * kernel_efficiency(V100).memory
    split32 = SGEMM.wave_latency_s + per_k * (k / 32) + 2 * 32 * 4 * m * n / partial_bw
    t = sgemm_seconds(1, m, n, k, V100, EFF)
    assert t <= split32 * (1 + 1e-12)
    assert t < unsplit / 10
    assert t >= _flop_bound(1, m, n, k)


def test_no_split_below_the_minimum_k():
    """K below `min_split_k` is never split: the price is the unsplit one, whatever the tile
    count (here 1 tile of 32 per batch entry, one wave)."""
    model = dataclasses.replace(SGEMM, tile_rate=((32, 1.0),), min_split_k=64.0)
    rate = V100.peak("float32") * EFF / V100.sms
    t = sgemm_seconds(4, 32, 32, 63, V100, EFF, model)
    assert t == pytest.approx(model.wave_latency_s + 2 * 32 * 32 * 63 / rate, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 64),
    m=st.integers(1, 4096),
    n=st.integers(1, 4096),
    k=st.integers(1, 1 << 15),
    gpu=st.sampled_from(["V100", "A100-40GB", "T4", "H100"]),
)
def test_never_faster_than_the_flop_rate(batch, m, n, k, gpu):
    spec = gpu_spec(gpu)
    t = sgemm_seconds(batch, m, n, k, spec, EFF)
    assert t >= _flop_bound(batch, m, n, k, spec) * (1 - 1e-12)
    # a larger output never costs less: each (side, split) takes at least as many waves and
    # moves at least as many partial sums, and which splits are allowed depends on K alone
    for bigger in ((batch + 1, m, n), (batch, m + 1, n), (batch, m, n + 1)):
        assert sgemm_seconds(*bigger, k, spec, EFF) >= t * (1 - 1e-12)


def _block(op) -> Block:
    return Block("b", "layer", (op,), ())


def test_the_planner_prices_a_float32_linear_by_it():
    """A one-op block of a float32 linear: its forward is the p-norm of `sgemm_seconds` and
    the memory time, plus one kernel floor."""
    m, n, k = 4096, 1536, 512
    op = linear_op(m, n, k, "float32")
    bc = block_compute(_block(op), V100, "float32")
    fwd = bc.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)[0]
    mem = op.fwd_bytes / (V100.hbm_bandwidth * compute.memory_efficiency(op, V100))
    assert fwd - KERNEL_FLOOR_S == pytest.approx(
        gemm_roofline(sgemm_seconds(1, m, n, k, V100, EFF), mem), rel=1e-9
    )
    # bf16 on tensor cores is not priced by it
    bf = block_compute(_block(linear_op(m, n, k, "bfloat16")), gpu_spec("A100"), "bfloat16")
    assert bf.gemms and all(g.sgemm is None for g in bf.gemms)


@pytest.mark.parametrize("tp, mb", [(2, 1.0), (4, 2.0)])
def test_sharding_and_micro_batch_scale_the_priced_shape(tp, mb):
    """Under TP the linear's sharded dimension (N column-parallel, K row-parallel: the block's
    sharding rules read a lone linear as the row-parallel one) is divided by tp, and the
    tokens M scale with the micro-batch: the forward prices that shape at work share
    mb / tp."""
    m, n, k = 2048, 1024, 1024
    op = linear_op(m, n, k, "float32")
    bc = block_compute(_block(op), V100, "float32")
    (term,) = bc.gemms
    assert term.k_by == ("tp",) and term.n_by == () and term.m_by == ("mb", "cp")
    fwd = bc.times(tp=tp, cp=1, sequence_parallel=False, scale=mb)[0]
    mem = mb / tp * op.fwd_bytes / (V100.hbm_bandwidth * compute.memory_efficiency(op, V100))
    expect = gemm_roofline(sgemm_seconds(1, m * mb, n, k / tp, V100, EFF), mem)
    assert fwd - KERNEL_FLOOR_S == pytest.approx(expect, rel=1e-9)


def test_small_batched_gemms_pay_their_waves():
    """bmm of 4096 (32 x 32) @ (32 x 32) with only 32-tiles: 4096 tiles on 80 SMs are
    ceil(51.2) = 52 waves of (latency + one tile's 2 x 32^3 FLOPs at an SM's rate); K = 32 is
    below the split minimum."""
    model = dataclasses.replace(SGEMM, tile_rate=((32, 1.0),))
    rate = V100.peak("float32") * EFF / V100.sms
    t = sgemm_seconds(4096, 32, 32, 32, V100, EFF, model)
    assert t == pytest.approx(52 * (model.wave_latency_s + 2 * 32**3 / rate), rel=1e-12)
    assert bmm_op(4096, 32, 32, 32, "float32").fwd_flops == 2 * 4096 * 32**3


def _linear_with_backward(m, n, k, *, input_grad: bool):
    """A float32 linear as the tracer records it for training: backward = the weight gradient
    (K x N over the M tokens), plus the input gradient (M x K over N) when its input needs one
    (not a first linear on raw features, whose backward runs one GEMM)."""
    op = linear_op(m, n, k, "float32")
    gemms = 2 if input_grad else 1
    return dataclasses.replace(op, bwd_flops=gemms * op.fwd_flops, bwd_bytes=gemms * op.fwd_bytes)


def test_the_backward_prices_the_gemms_the_trace_ran():
    """Backward of a linear with an input gradient: its two GEMMs, each `sgemm_seconds` of its
    own shape, in the p-norm with half the backward bytes each. A first linear (weight
    gradient only, bwd FLOPs = fwd FLOPs) is charged half of each (the trace does not say
    which runs), never both whole."""
    m, n, k = 4096, 1536, 512
    both = _linear_with_backward(m, n, k, input_grad=True)
    bc = block_compute(_block(both), V100, "float32")
    bwd = bc.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)[1]
    mem = both.bwd_bytes / (V100.hbm_bandwidth * compute.memory_efficiency(both, V100))
    expect = gemm_roofline(sgemm_seconds(1, m, k, n, V100, EFF), mem / 2) + gemm_roofline(
        sgemm_seconds(1, k, n, m, V100, EFF), mem / 2
    )
    assert bwd - KERNEL_FLOOR_S == pytest.approx(expect, rel=1e-9)

    first = _linear_with_backward(m, n, k, input_grad=False)
    one = block_compute(_block(first), V100, "float32")
    bwd1 = one.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)[1]
    mem1 = first.bwd_bytes / (V100.hbm_bandwidth * compute.memory_efficiency(first, V100))
    half = gemm_roofline(0.5 * sgemm_seconds(1, m, k, n, V100, EFF), mem1 / 2)
    half += gemm_roofline(0.5 * sgemm_seconds(1, k, n, m, V100, EFF), mem1 / 2)
    assert bwd1 - KERNEL_FLOOR_S == pytest.approx(half, rel=1e-9)
    assert bwd1 < 0.6 * bwd  # one GEMM's work, not two
    assert bwd1 - KERNEL_FLOOR_S >= first.bwd_flops / (V100.peak("float32") * EFF)


def test_splits_must_increase():
    with pytest.raises(ValueError, match="must increase from 1"):
        dataclasses.replace(SGEMM, splits=(1, 4, 2))
