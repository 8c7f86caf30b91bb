"""Engine features (fused kernels, Float8 linears, TP overlap, FP8 all-gather) against
hand-derived roofline numbers."""

from __future__ import annotations

import dataclasses

import pytest
from meshplan.cost_model.compute import (
    FLOAT8_CAST_KERNELS,
    GEMM_OVERLAP_P,
    KERNEL_FLOOR_S,
    block_compute,
    kernel_efficiency,
    memory_efficiency,
    weight_quantize_time,
)
from meshplan.cost_model.engine import EAGER, Engine, EngineError
from meshplan.cost_model.pricer import exposed, pricer_for
from meshplan.ir import Block, Op, OpKind, StageConfig, TensorMeta
from meshplan.ir.hardware import gpu_spec
from meshplan.passes.fusion import fusion_regions

from tests.synthetic import h100_cluster, transformer_graph

H100 = gpu_spec("H100")  # the datasheet spec, FP8 peak included
B, S, H, F = 2, 1024, 1024, 4096
NO_WAVES = dataclasses.replace(H100, sms=0)  # isolate the feature under test


def _t(*shape: int, dtype: str = "bfloat16") -> TensorMeta:
    return TensorMeta(shape, dtype)


def _ew(name: str, kind: OpKind, inputs, out) -> Op:
    nbytes = sum(t.nbytes for t in inputs) + out.nbytes
    return Op(name, kind, "aten.x", "", tuple(inputs), (out,), fwd_bytes=nbytes, bwd_bytes=nbytes)


def _linear(name: str, m: int, k: int, n: int) -> Op:
    x, w, y = _t(m, k), _t(k, n), _t(m, n)
    io = x.nbytes + w.nbytes + y.nbytes
    return Op(
        name, OpKind.MATMUL, "aten.mm.default", name, (x, w), (y,),
        fwd_flops=2 * m * n * k, bwd_flops=4 * m * n * k, fwd_bytes=io, bwd_bytes=2 * io,
        params=(f"{name}.weight",),
    )  # fmt: skip


def _pnorm(a: float, b: float) -> float:
    """A GEMM's seconds from its FLOP and memory times, (a^p + b^p)^(1/p) written out."""
    return (a**GEMM_OVERLAP_P + b**GEMM_OVERLAP_P) ** (1 / GEMM_OVERLAP_P)


def _chain_block() -> Block:
    """linear -> add(x, x) -> mul(., w) -> silu -> linear: one fusable chain of three ops."""
    x, w = _t(B * S, H), _t(H)
    ops = (
        _linear("up", B * S, H, H),
        _ew("add", OpKind.ELEMENTWISE, [x, x], x),
        _ew("mul", OpKind.NORM, [x, w], x),
        _ew("silu", OpKind.ELEMENTWISE, [x], x),
        _linear("down", B * S, H, H),
    )
    return Block("layer", "layer", ops, (), inputs=(_t(1, B * S, H),))


def test_fusion_region_reads_its_inputs_and_writes_its_output_once():
    block = _chain_block()
    (region,) = fusion_regions(block)
    assert region.ops == (1, 2, 3)
    x, w = B * S * H * 2, H * 2
    # external inputs: add's two operands and mul's weight; mul and silu read add's and
    # mul's outputs inside the kernel; the chain writes silu's output once
    assert region.fwd_bytes == 2 * x + w + x
    assert region.bwd_bytes == x + 2 * (2 * x + w)
    assert fusion_regions(dataclasses.replace(block, kind="epilogue")) == ()


def test_fused_engine_prices_one_kernel_per_chain():
    block = _chain_block()
    eager = block_compute(block, NO_WAVES, "bfloat16")
    fused = block_compute(block, NO_WAVES, "bfloat16", Engine(fused=True))
    (region,) = fusion_regions(block)
    bw = H100.hbm_bandwidth * kernel_efficiency(H100).memory
    # eager kernels stream at their kind's achieved bandwidth, the fused one at the default
    eager_bw = [H100.hbm_bandwidth * memory_efficiency(op, H100) for op in block.ops[1:4]]
    chain_eager = (
        sum(op.fwd_bytes / b for op, b in zip(block.ops[1:4], eager_bw)) + 3 * KERNEL_FLOOR_S
    )
    chain_fused = region.fwd_bytes / bw + KERNEL_FLOOR_S
    f_eager, b_eager, _ = eager.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)
    f_fused, b_fused, _ = fused.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)
    assert f_eager - f_fused == pytest.approx(chain_eager - chain_fused, rel=1e-9)
    bwd_eager = (
        sum(op.bwd_bytes / b for op, b in zip(block.ops[1:4], eager_bw)) + 3 * KERNEL_FLOOR_S
    )
    assert b_eager - b_fused == pytest.approx(
        bwd_eager - (region.bwd_bytes / bw + KERNEL_FLOOR_S), rel=1e-9
    )


def test_float8_linear_runs_at_the_fp8_peak_plus_its_casts():
    m, k, n = B * S, H, F
    block = Block(
        "layer", "layer", (_linear("up", m, k, n),), (), inputs=(_t(1, m, k),)
    )  # fmt: skip
    keff = kernel_efficiency(H100)
    bw = H100.hbm_bandwidth * keff.memory
    gemm = 2 * m * n * k / (H100.peak("float8_e4m3fn") * keff.fp8)
    for fused, cast in ((False, 5), (True, 3)):
        bc = block_compute(block, NO_WAVES, "bfloat16", Engine(fused=fused, float8="tensorwise"))
        fwd, bwd, _ = bc.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)
        floors = (1 + FLOAT8_CAST_KERNELS) * KERNEL_FLOOR_S
        io = 0.5 * block.ops[0].fwd_bytes / bw  # FP8 operands
        fwd_gemm = _pnorm(gemm, io)
        assert fwd == pytest.approx(fwd_gemm + cast * (m * k + k * n) / bw + floors, rel=1e-9)
        # backward: two FP8 GEMMs, the output gradient cast, both operands transposed
        conv = cast * m * n + 2 * (m * k + k * n)
        assert bwd == pytest.approx(_pnorm(2 * gemm, 2 * io) + conv / bw + floors, rel=1e-9)

    # against bf16: on this small GEMM the casts cost more than the FP8 GEMM saves (torchao
    # documents that Float8 pays only for large GEMMs); on a Llama-70B MLP projection it pays
    def fwd_time(blk, engine):
        bc = block_compute(blk, NO_WAVES, "bfloat16", engine)
        return bc.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)[0]

    f8 = Engine(fused=True, float8="tensorwise")
    assert fwd_time(block, f8) > fwd_time(block, Engine(fused=True))
    big = Block(
        "layer", "layer", (_linear("up", 8192, 8192, 28672),), (), inputs=(_t(1, 8192, 8192),)
    )
    assert fwd_time(big, f8) < 0.7 * fwd_time(big, Engine(fused=True))


def test_tp_overlap_hides_at_most_eta_of_the_traffic(gpu_time_only):
    assert exposed(1.0, 2.0) == pytest.approx(0.2)  # window long enough: (1 - eta) C
    assert exposed(1.0, 0.5) == pytest.approx(0.6)  # C - eta W
    assert exposed(0.0, 1.0) == 0.0
    g = transformer_graph(2, 2048, 16, 16, 8192, 32000, 2048, 1)
    cluster = h100_cluster(1)
    plain = pricer_for(g, cluster, engine=EAGER)
    over = pricer_for(g, cluster, engine=Engine(tp_overlap=True))
    cfg = StageConfig(tp=8, cp=1, ep=1, sequence_parallel=True, micro_batch=1, recompute="none")
    a, b = plain.block_time("layer", "h100", cfg), over.block_time("layer", "h100", cfg)
    bc = plain.costs.compute("layer", H100, "bfloat16")
    g_fwd, g_bwd = bc.gemm_times(tp=8, cp=1, scale=1.0)
    assert g_fwd > 0 and g_bwd > 0
    assert a.forward == b.forward and a.backward == b.backward  # compute unchanged
    # TP traffic split evenly between the phases here (as many collectives each way)
    half = a.tp_comm / 2
    assert b.tp_comm == pytest.approx(exposed(half, g_fwd) + exposed(half, g_bwd), rel=1e-9)
    assert b.tp_comm < a.tp_comm


def test_fp8_all_gather_halves_the_weight_gathers():
    g = transformer_graph(2, 1024, 8, 8, 4096, 32000, 1024, 1)
    cluster = h100_cluster(1)
    comp = pricer_for(g, cluster).costs.composition(0, len(g.units))
    cfg = StageConfig(tp=1, cp=1, ep=1, sequence_parallel=False, micro_batch=1, recompute="none")
    plain = pricer_for(g, cluster).dp_traffic(comp, cfg, dp=8, zero=3)
    fp8 = pricer_for(
        g, cluster, engine=Engine(float8="tensorwise", float8_all_gather=True)
    ).dp_traffic(comp, cfg, dp=8, zero=3)
    gathers = [s for (k, s, _), (k8, s8, _) in zip(plain.collectives, fp8.collectives) if k == k8]
    for (kind, size, _), (_, size8, _) in zip(plain.collectives, fp8.collectives):
        assert size8 == (size / 2 if str(kind) == "all_gather" else size)
    assert gathers


def test_engine_refuses_what_it_cannot_price():
    with pytest.raises(EngineError, match="rowwise.*not modelled"):
        Engine(float8="rowwise")
    with pytest.raises(EngineError, match="float8_all_gather needs float8"):
        Engine(float8_all_gather=True)
    assert Engine().describe() == "eager"
    assert Engine(fused=True, float8="tensorwise", tp_overlap=True).describe() == (
        "fused+float8(tensorwise)+tp-overlap"
    )


def test_int8_linear_runs_its_forward_at_the_int8_peak_plus_its_quantizing_passes():
    # Oracle: the formula of compute.int8_linear_time written out (INT8 GEMM at the INT8 peak
    # times the INT8 fraction measured on H100 / H200 `torch._int_mm` kernels, 0.355, int8
    # operands, amax + cast of X and W), and a backward exactly the bf16 one (straight-through
    # gradients in the training dtype).
    m, k, n = B * S, H, F
    block = Block("layer", "layer", (_linear("up", m, k, n),), (), inputs=(_t(1, m, k),))
    keff = kernel_efficiency(H100)
    bw = H100.hbm_bandwidth * keff.memory
    a100 = kernel_efficiency(gpu_spec("A100"))  # no INT8 kernels measured: the bf16 fraction
    assert keff.int8 == 0.355 and a100.int8 == a100.gemm
    gemm = 2 * m * n * k / (H100.peak("int8") * keff.int8)
    plain = block_compute(block, NO_WAVES, "bfloat16", Engine()).times(
        tp=1, cp=1, sequence_parallel=False, scale=1.0
    )
    for fused, cast in ((False, 5), (True, 3)):
        bc = block_compute(
            block, NO_WAVES, "bfloat16", Engine(fused=fused, forward_precision="int8")
        )
        fwd, bwd, _ = bc.times(tp=1, cp=1, sequence_parallel=False, scale=1.0)
        floors = (1 + FLOAT8_CAST_KERNELS) * KERNEL_FLOOR_S
        io = 0.5 * block.ops[0].fwd_bytes / bw
        # the activation's quantizing pass per micro-batch; the weight's once per step
        assert fwd == pytest.approx(_pnorm(gemm, io) + cast * m * k / bw + floors, rel=1e-9)
        assert bwd == pytest.approx(plain[1], rel=1e-12)
        assert weight_quantize_time(block, NO_WAVES, fused=fused) == pytest.approx(
            cast * k * n / bw, rel=1e-12
        )


def test_hybrid_precision_changes_only_its_groups_forward():
    from tests.synthetic import mixed_cluster

    graph = transformer_graph(4, 1024, 8, 8, 4096, 32000, 1024, 1)
    # the datasheet specs: INT8 and FP8 peaks
    cluster = mixed_cluster(1, 1, a100=gpu_spec("A100-80GB"))
    h100 = dataclasses.replace(cluster.groups[0], gpu=gpu_spec("H100"))
    cluster = dataclasses.replace(cluster, groups=(h100, *cluster.groups[1:]))
    cfg = StageConfig(1, 1, 1, False, 1, "none")
    # GPU time alone: this small layer at one sequence is host-bound (`cost_model.host`)
    plain = pricer_for(graph, cluster, "bfloat16", engine=Engine(host_node_s=0.0))
    comp = plain.costs.composition(1, 2)
    # the A100s in int8 (no FP8 on Ampere), the H100s in FP8
    for group, mode in (("a100", "int8"), ("h100", "fp8")):
        eng = Engine(hybrid=((group, mode),), host_node_s=0.0)
        hybrid = pricer_for(graph, cluster, "bfloat16", engine=eng)
        assert hybrid.engine_of(group).forward_precision == mode
        for g in ("h100", "a100"):
            a, b = plain.stage_time(comp, g, cfg), hybrid.stage_time(comp, g, cfg)
            if g == group:  # its forward priced in low precision, the same backward
                assert b.forward != a.forward and b.backward == a.backward
            else:
                assert b == a
    with pytest.raises(EngineError, match="not modelled"):
        Engine(hybrid=(("a100", "int4"),))
    with pytest.raises(EngineError, match="no INT8 tensor cores"):
        v100 = mixed_cluster(1, 1, a100=gpu_spec("V100"))
        pricer_for(graph, v100, "float16", engine=Engine(hybrid=(("a100", "int8"),))).stage_time(
            comp, "a100", cfg
        )
