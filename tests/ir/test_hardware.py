"""The GPU table's newer and smaller parts: names, datasheet figures, links, and a plan on each.

Unit tier (no GPU, a few seconds). The expected figures below are copied from the vendor
documents (written here independently of `ir/hardware.py`), in the units the datasheets print:
TFLOP/s, GB, GB/s. Where a datasheet prints "with sparsity", the table says `sparse(x)`; where
it prints a rack total, `per_gpu(x)`; NVLink figures are aggregate bidirectional, halved by
`one_way`.
"""

from __future__ import annotations

from dataclasses import dataclass

import meshplan
import pytest
from meshplan.ir.devices import LinkKind
from meshplan.ir.hardware import (
    GB,
    GPU_SPECS,
    TERA,
    GiB,
    default_intra_link,
    gpu_spec,
    link_tier,
)


def sparse(tflops: float) -> float:
    """A datasheet's "with sparsity" figure as the dense one (2:4 sparsity doubles it)."""
    return tflops / 2


def per_gpu(rack_pflops: float) -> float:
    """A GB200/GB300 NVL72 rack figure (PFLOP/s, with sparsity) as one GPU's dense TFLOP/s."""
    return sparse(rack_pflops * 1000 / 72)


def one_way(bidirectional_gbs: float) -> float:
    """An aggregate bidirectional NVLink figure as one direction."""
    return bidirectional_gbs / 2


@dataclass(frozen=True)
class Part:
    name: str
    aliases: tuple[str, ...]
    bf16: float | None  # dense TFLOP/s; None: no BF16 hardware
    fp16: float
    fp32: float  # TF32 dense where the part has TF32 ("tfloat32"), else CUDA-core FP32
    fp8: float | None
    memory_gb: float
    bandwidth_gbs: float
    sms: int
    intra_link: str
    link_gbs: float | None  # GPU-GPU NVLink one way; None: PCIe
    source: str


# fmt: off
PARTS = (
    Part("GH200", ("gh200", "GH200-96GB", "Grace Hopper"),
         sparse(1979), sparse(1979), sparse(989), sparse(3958), 96, 4000, 132,
         "nvlink4", one_way(900), "GH200 Grace Hopper Superchip datasheet"),
    Part("GH200-144GB", ("gh200 hbm3e", "GH200-NVL2"),
         sparse(1979), sparse(1979), sparse(989), sparse(3958), 144, 4900, 132,
         "nvlink4", one_way(900), "GH200 Grace Hopper Superchip datasheet"),
    Part("H800", ("h800", "H800 SXM5", "H800-80GB"),
         sparse(1979), sparse(1979), sparse(989), sparse(3958), 80, 3350, 132,
         "nvlink4-h800", one_way(400), "H800 Tensor Core GPU datasheet (SXM)"),
    Part("H20", ("h20", "HGX H20"),
         148, 148, 74, 296, 96, 4000, 78,
         "nvlink4", one_way(900), "HGX H20 product brief (dense figures)"),
    Part("GB200", ("gb200", "GB200 NVL72"),
         per_gpu(360), per_gpu(360), per_gpu(180), per_gpu(720), 372 / 2, 576_000 / 72, 148,
         "nvlink5", one_way(1800), "GB200 NVL72 datasheet; GB200 superchip 372 GB / 2 GPUs"),
    Part("GB300", ("gb300", "GB300-NVL72"),
         per_gpu(360), per_gpu(360), per_gpu(180), per_gpu(720), 288, 8000, 160,
         "nvlink5", one_way(1800), "GB300 NVL72 datasheet; Inside Blackwell Ultra blog"),
    Part("L4", ("l4", "L4-24GB"),
         sparse(242), sparse(242), sparse(120), sparse(485), 24, 300, 58,
         "pcie4", None, "L4 datasheet; 7,424 CUDA cores / 128"),
    Part("A40", ("a40",),
         149.7, 149.7, 74.8, None, 48, 696, 84,
         "pcie4", None, "A40 datasheet"),
    Part("RTX-A6000", ("RTX A6000", "a6000"),
         sparse(309.7), sparse(309.7), sparse(154.8), None, 48, 768, 84,
         "pcie4", None, "RTX A6000 datasheet; GA102 whitepaper appendix C"),
    Part("RTX3090", ("RTX 3090", "GeForce RTX 3090", "3090"),
         71, 71, 35.6, None, 24, 936, 82,
         "pcie4", None, "GA102 whitepaper appendix A (FP32 accumulate)"),
    Part("RTX2080Ti", ("RTX 2080 Ti", "geforce-rtx-2080-ti", "2080ti"),
         None, 53.8, 13.4, None, 11, 616, 68,
         "pcie3", None, "Turing whitepaper (reference clocks, FP32 accumulate)"),
    Part("T4", ("t4", "Tesla T4"),
         None, 65, 8.1, None, 16, 320, 40,
         "pcie3", None, "T4 datasheet (mixed precision FP16/FP32)"),
)
# fmt: on
BY_NAME = {p.name: p for p in PARTS}
# CUDA-core FP32 TFLOP/s (what an fp32 matmul runs at with TF32 off, PyTorch's default), from
# the datasheets above; GB300's is not published in them and is taken as GB200's.
CUDA_CORE_FP32 = {
    "GH200": 67, "GH200-144GB": 67, "H800": 67, "H20": 44, "GB200": 5760 / 72, "GB300": 80,
    "L4": 30.3, "A40": 37.4, "RTX-A6000": 38.7, "RTX3090": 35.6, "RTX2080Ti": 13.4, "T4": 8.1,
}  # fmt: skip


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [(p.name, p.name) for p in PARTS] + [(a, p.name) for p in PARTS for a in p.aliases],
)
def test_every_new_part_resolves(alias: str, canonical: str) -> None:
    assert gpu_spec(alias) is GPU_SPECS[canonical]
    assert meshplan.Cluster.preset(alias, gpus=8).groups[0].gpu is GPU_SPECS[canonical]


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.name)
def test_figures_match_the_datasheets(part: Part) -> None:
    spec = gpu_spec(part.name)
    peaks = dict(spec.peak_flops)
    approx = lambda tflops: pytest.approx(tflops * TERA, rel=1e-3)  # noqa: E731  989 vs 1979/2
    if part.bf16 is not None:
        assert peaks["bfloat16"] == approx(part.bf16)
    assert peaks["float16"] == approx(part.fp16)
    assert peaks.get("tfloat32", peaks["float32"]) == approx(part.fp32)
    assert peaks["float32"] == approx(CUDA_CORE_FP32[part.name])
    if part.fp8 is None:
        assert "float8_e4m3fn" not in peaks, f"{part.name} has no FP8 tensor cores"
    else:
        assert peaks["float8_e4m3fn"] == approx(part.fp8)
    assert spec.memory_bytes == round(part.memory_gb) * GiB  # datasheet GB read as GiB
    assert spec.hbm_bandwidth == pytest.approx(part.bandwidth_gbs * GB)
    assert spec.sms == part.sms
    assert spec.source


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.name)
def test_intra_node_link(part: Part) -> None:
    spec = gpu_spec(part.name)
    tier = link_tier(default_intra_link(part.name))
    assert tier.name == part.intra_link
    if part.link_gbs is None:
        assert spec.nvlink_bandwidth == 0.0 and tier.kind is LinkKind.PCIE
    else:
        assert spec.nvlink_bandwidth == pytest.approx(part.link_gbs * GB)
        assert tier.kind is LinkKind.NVLINK and tier.bandwidth == spec.nvlink_bandwidth


def test_pcie_tiers_per_generation() -> None:
    # PCI-SIG: x16 one direction ~16 GB/s (Gen3), ~32 (Gen4); hardware.md: PCIe4 64 GB/s bidir.
    assert link_tier("pcie3").bandwidth == 16 * GB
    assert link_tier("pcie4").bandwidth == 2 * link_tier("pcie3").bandwidth


@pytest.mark.parametrize("name", ["T4", "RTX2080Ti", "V100"])
def test_parts_without_bf16_have_no_bf16_peak(name: str) -> None:
    # Volta and Turing have FP16 tensor cores but no BF16 (Ampere added it).
    assert "bfloat16" not in dict(gpu_spec(name).peak_flops)


def test_bf16_model_on_a_part_without_bf16_says_so(tiny_model) -> None:
    """No silent fallback: the plan trains in fp16 mixed precision, records it, and says why."""
    plan = meshplan.plan(*tiny_model, meshplan.Cluster.preset("T4", gpus=8))
    notes = " ".join(plan.predicted.notes).lower()
    assert "bfloat16" in notes and plan.precision == "fp16"
    with pytest.raises(ValueError, match=r"T4 cannot train in bf16 .*use --precision fp32 or fp16"):
        meshplan.plan(*tiny_model, meshplan.Cluster.preset("T4", gpus=8), precision="bf16")


@pytest.fixture(scope="module")
def tiny_model():
    return meshplan.models.transformer(layers=2, hidden=64, heads=4, ffn=128, vocab=256, seq_len=64)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_plan_on_each_new_part(tiny_model, name: str) -> None:
    plan = meshplan.plan(*tiny_model, meshplan.Cluster.preset(name, gpus=8))
    assert plan.predicted.fits and plan.predicted.step_time_s > 0
    assert {g.gpu.name for g in plan.cluster.groups} == {name}
