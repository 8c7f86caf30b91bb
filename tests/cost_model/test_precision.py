"""Precision as a planning input: what each GPU supports, the rate each precision's matmuls
run at, and what the plan records (`ir.cluster.PRECISIONS`, `planner.api.resolve_precision`).

Oracles: datasheet figures (A100: TF32 156 dense, FP32 19.5 on CUDA cores; H100 SXM: FP8 1979
dense, BF16 989) and hand-derived ratios of roofline times for a compute-bound GEMM.
"""

from __future__ import annotations

import dataclasses

import meshplan
import pytest
import torch
from meshplan.cost_model.compute import CUDA_CORE_GEMM_EFFICIENCY, kernel_efficiency, roofline_time
from meshplan.ir import Op, OpKind, TensorMeta
from meshplan.ir.devices import default_precision, precision_problem
from meshplan.ir.hardware import gpu_spec
from meshplan.runtime.errors import RuntimePlanError
from meshplan.runtime.precision import apply_precision
from torch import nn

# These models are small enough that the host would bind (`cost_model.host`).
pytestmark = pytest.mark.usefixtures("gpu_time_only")


def test_which_parts_train_in_which_precision():
    v100, a100, h100 = gpu_spec("V100"), gpu_spec("A100"), gpu_spec("H100")
    assert precision_problem("fp16", [v100]) == ""
    assert "V100 cannot train in bf16" in precision_problem("bf16", [v100, a100])
    assert "V100 cannot train in tf32 (no TF32 units)" in precision_problem("tf32", [v100])
    assert "A100-80GB cannot train in fp8" in precision_problem("fp8", [a100, h100])
    assert precision_problem("fp8", [h100]) == ""
    assert "must be one of" in precision_problem("int4", [h100])
    # the default follows the model's dtype; bf16 falls back to fp16 with a note
    assert default_precision("float32", [a100]) == ("fp32", "")
    assert default_precision("bfloat16", [a100]) == ("bf16", "")
    precision, note = default_precision("bfloat16", [a100, v100])
    assert precision == "fp16" and "V100 has no bfloat16" in note


def _gemm(n: int = 8192) -> Op:
    flops = 2 * n**3
    t = TensorMeta((n, n), "float32")
    return Op("mm", OpKind.MATMUL, "aten.mm.default", "", (t, t), (t,), flops, 2 * flops,
              3 * t.nbytes, 6 * t.nbytes)  # fmt: skip


def test_fp32_matmuls_run_on_cuda_cores_and_tf32_on_tensor_cores():
    """A100: a compute-bound GEMM is 156 / 19.5 = 8x faster in TF32 than in FP32 (PyTorch's
    default, TF32 off) at equal efficiency, times the tensor-core efficiency over the CUDA-core
    one (sgemm reaches a lower fraction of its peak), and 312 / 156 = 2x faster again in bf16."""
    a100, op = gpu_spec("A100"), _gemm(65536)  # compute-bound: the memory term moves it < 1e-5
    fp32 = roofline_time(op, a100, "float32")
    tf32 = roofline_time(op, a100, "tfloat32")
    bf16 = roofline_time(op, a100, "bfloat16")
    cores = kernel_efficiency(a100).gemm / CUDA_CORE_GEMM_EFFICIENCY
    assert fp32 / tf32 == pytest.approx(156 / 19.5 * cores, rel=1e-5)
    assert tf32 / bf16 == pytest.approx(2.0, rel=1e-5)


def test_elementwise_ops_run_at_the_cuda_core_rate_whatever_the_precision():
    a100 = gpu_spec("A100")
    t = TensorMeta((1024,), "float32")
    op = Op("gelu", OpKind.ELEMENTWISE, "aten.gelu.default", "", (t,), (t,), 10**12, 0, 1, 1)
    assert roofline_time(op, a100, "tfloat32") == roofline_time(op, a100, "bfloat16")
    assert roofline_time(op, a100, "tfloat32") == pytest.approx(1e12 / 19.5e12)


@pytest.fixture(scope="module")
def tiny():
    return meshplan.models.transformer(layers=2, hidden=256, heads=4, ffn=1024, vocab=512,
                                       seq_len=256)  # fmt: skip


def test_plans_record_and_price_their_precision(tiny):
    cluster = meshplan.Cluster.preset("A100", gpus=8)
    plans = {p: meshplan.estimate_plan(*tiny, cluster=cluster, precision=p)
             for p in ("fp32", "tf32", "bf16")}  # fmt: skip
    assert [plans[p].precision for p in plans] == ["fp32", "tf32", "bf16"]
    steps = {p: plans[p].predicted.step_time_s for p in plans}
    assert steps["fp32"] > steps["tf32"] > steps["bf16"]
    # fp32 and tf32 keep fp32 model states (4 + 4 + 8 bytes per parameter)
    back = meshplan.Plan.from_json(plans["tf32"].to_json())
    assert back.precision == "tf32"
    fp8 = meshplan.estimate_plan(
        *tiny, cluster=meshplan.Cluster.preset("H100", gpus=8), precision="fp8"
    )
    assert fp8.precision == "fp8"
    with pytest.raises(ValueError, match="A100-80GB cannot train in fp8"):
        meshplan.estimate_plan(*tiny, cluster=cluster, precision="fp8")


def test_a_plan_whose_precision_its_gpus_lack_is_refused(tiny):
    plan = meshplan.estimate_plan(*tiny, cluster=meshplan.Cluster.preset("V100", gpus=8))
    assert plan.precision == "fp16"
    edited = dataclasses.replace(plan, precision="bf16")
    with pytest.raises(RuntimePlanError, match="precision: V100 cannot train in bf16"):
        meshplan.runtime.check_plan(edited)


def test_the_runtime_trains_in_the_plans_precision(tiny):
    plan = meshplan.estimate_plan(*tiny, cluster=meshplan.Cluster.preset("cpu", gpus=1),
                                  precision="fp32")  # fmt: skip
    model = nn.Linear(4, 4)  # float32
    apply_precision(model, plan, torch.device("cpu"))
    assert torch.backends.cuda.matmul.allow_tf32 is False
    bf16 = dataclasses.replace(plan, precision="bf16")
    with pytest.raises(
        RuntimePlanError, match="trains in bf16 but the model's parameters are float32"
    ):
        apply_precision(model, bf16, torch.device("cpu"))


def test_tf32_is_pytorchs_allow_tf32_on_a_mixed_cluster():
    """tf32 on A100 + V100: the A100's matmuls on TF32 tensor cores, the V100's in fp32 on
    CUDA cores (it has no TF32 units; PyTorch's allow_tf32 does nothing there), as Sailor's
    runtime trains. A cluster with no TF32 part at all is still refused."""
    from meshplan.ir.devices import matmul_dtype, precision_problem

    v100, a100, op = gpu_spec("V100"), gpu_spec("A100"), _gemm(65536)
    assert precision_problem("tf32", [v100, a100]) == ""
    assert "V100 cannot train in tf32" in precision_problem("tf32", [v100])
    assert (matmul_dtype(v100, "tfloat32"), matmul_dtype(a100, "tfloat32")) == (
        "float32",
        "tfloat32",
    )
    assert roofline_time(op, v100, "tfloat32") == roofline_time(op, v100, "float32")
    assert roofline_time(op, a100, "tfloat32") < roofline_time(op, a100, "float32") / 4


def test_tf32_plan_on_a100_and_v100_says_which_part_runs_fp32():
    from meshplan.ir.cluster_io import cluster_from_dict

    cluster = cluster_from_dict(
        {
            "name": "mixed",
            "groups": [
                {"name": "a100", "gpu": "A100-40GB", "nodes": 1, "gpus_per_node": 4},
                {"name": "v100", "gpu": "V100-16GB", "nodes": 1, "gpus_per_node": 4},
            ],
        }
    )
    model, inputs = meshplan.models.get("tiny")
    pred = meshplan.estimate(
        model, inputs, cluster, meshplan.Parallel(dp=8, global_batch=16), precision="tf32"
    )
    assert any("no TF32 units on V100-16GB" in n for n in pred.notes)
