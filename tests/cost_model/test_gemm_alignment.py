"""Misaligned tensor-core GEMMs (`compute.alignment_factor`): a GEMM whose N or K is not a
multiple of 16 bytes runs cuBLAS's slow kernels; the planner prices it at
`MISALIGNED_GEMM_FACTOR` of the aligned efficiency, and nothing else changes."""

from __future__ import annotations

import pytest
from meshplan.cost_model import compute
from meshplan.cost_model.kernel_data import bmm_op, linear_op
from meshplan.ir.hardware import gpu_spec

H100 = gpu_spec("H100")
F = compute.MISALIGNED_GEMM_FACTOR


@pytest.mark.parametrize(
    "m, n, k, dtype, factor",
    [
        (4096, 50304, 2048, "bfloat16", 1.0),  # GPT-2's vocabulary padded to 64
        (4096, 50257, 2048, "bfloat16", F),  # unpadded: N odd
        (4096, 4096, 4100, "bfloat16", F),  # K not a multiple of 8 elements
        (4097, 4096, 4096, "bfloat16", 1.0),  # M (tokens) is free
        (4096, 4100, 4096, "float32", 1.0),  # CUDA cores: no tensor-core alignment
        (4096, 4100, 4096, "tfloat32", 1.0),  # TF32: 4-byte elements, 4 per 16 bytes
        (4096, 4098, 4096, "tfloat32", F),
    ],
)
def test_the_factor_follows_the_16_byte_rule(m, n, k, dtype, factor):
    op_dtype = "float32" if dtype == "tfloat32" else dtype
    assert compute.alignment_factor(linear_op(m, n, k, op_dtype), H100, dtype) == factor


def test_bmm_and_the_host_cpu():
    assert compute.alignment_factor(bmm_op(32, 2048, 2048, 100, "bfloat16"), H100, "bfloat16") == F
    cpu = gpu_spec("CPU") if _has("CPU") else None
    if cpu is not None:
        assert compute.alignment_factor(linear_op(64, 63, 64, "bfloat16"), cpu, "bfloat16") == 1.0


def _has(name: str) -> bool:
    try:
        gpu_spec(name)
    except Exception:
        return False
    return True


def test_a_compute_bound_misaligned_gemm_costs_one_over_the_factor():
    """Hand-derived: 8192^2 x 8190 vs 8192^3 in bf16 on H100 are compute-bound (the memory
    term is ~1% of the FLOP term), so the misaligned one's roofline is the aligned one's
    times 1 / factor, up to the 0.02% fewer FLOPs and the p-norm's memory share."""
    aligned = compute.roofline_time(linear_op(8192, 8192, 8192, "bfloat16"), H100, "bfloat16")
    odd = compute.roofline_time(linear_op(8192, 8190, 8192, "bfloat16"), H100, "bfloat16")
    assert odd / aligned == pytest.approx(1 / F, rel=0.01)
