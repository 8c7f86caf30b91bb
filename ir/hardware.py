"""The hardware tables: accelerator specs (`GpuSpec`) and link tiers (`LinkTier`).

Every number below cites where it comes from: the vendor datasheet named in each spec's
`source`. "hardware.md" in a comment or a `source` marks a figure from the project's table of
those datasheet rows (kept outside this repository, so the datasheet is the one to check);
figures that are not in that table cite the vendor document directly. Link latencies and
efficiencies are *default assumptions* (typical values, cited where a public source exists)
that `meshplan calibrate` is meant to replace with measurements.

Conventions (the same as `meshplan.ir.cluster`):

- FLOP/s are **dense** peaks. Datasheets often print "with sparsity" figures, twice the dense
  ones; those are halved here. `peak_flops` keys are torch dtype names: "bfloat16",
  "float16", "float32", "float8_e4m3fn", plus "tfloat32" and "int8" (INT8 tensor-core dense
  TOPS, for the per-group int8 linears of `Engine.hybrid`; parts without INT8 tensor cores,
  V100 and older, have none). "float32" is the rate an fp32
  matmul runs at by default in PyTorch (`torch.backends.cuda.matmul.allow_tf32` is off): the
  CUDA-core FP32 rate on NVIDIA parts, the FP32 matrix rate on AMD parts; "tfloat32" is the
  TF32 tensor-core dense rate, on parts that have TF32 (Ampere and later, MI300X), used when
  a plan's precision is "tf32". A precision the part lacks has no key (V100, T4 and RTX 2080
  Ti: no bfloat16, no tfloat32; float8 only from Hopper/Ada on): `cluster.precision_problem`
  refuses it instead of pricing another. Each entry says where its figure comes from.
- Bandwidths are bytes/s in **one direction**. NVLink / Infinity Fabric datasheet figures are
  aggregate bidirectional per GPU, so they are halved here.
- `memory_bytes` is the datasheet capacity read as **GiB** ("80 GB" -> 80 * 2**30 bytes).
  NVIDIA and AMD HBM parts expose within about 1-2% of that to software (an "80GB" H100
  reports roughly 79.6 GiB); GDDR parts with ECC enabled lose a few percent more. What the
  CUDA context, NCCL buffers and allocator fragmentation take is *not* subtracted here: that
  reserve belongs to the memory model, which can then apply one rule to every device.
- Names: each spec has one canonical name (`known_gpus()`); `gpu_spec` also accepts aliases,
  compared ignoring case, spaces, hyphens and underscores ("h100", "H100-SXM", "H100 SXM5").
"""

from __future__ import annotations

import difflib
import re
from types import MappingProxyType

from .devices import GpuSpec, LinkKind, LinkTier

# Units, so that the tables below read like the datasheets they copy.
TERA = 1e12
GB = 1e9  # decimal gigabyte (bandwidths are decimal in every datasheet); float like parsed values
GiB = 2**30  # binary gibibyte (memory capacities, see the module docstring)
GBIT = 1e9 / 8  # one gigabit per second in bytes per second


class UnknownGpuError(ValueError):
    """A GPU name that is neither a canonical name nor an alias in the spec table."""


class UnknownLinkError(ValueError):
    """A link tier name that is not in the built-in tier table."""


# --------------------------------------------------------------------------------------------
# Accelerators
# --------------------------------------------------------------------------------------------

# The project's table of datasheet rows (the module docstring: kept outside this repository,
# so a spec's `source` names it by title and the datasheet is the one to check).
_HW_MD = "the project's hardware table (hardware.md)"

_SPECS: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="H100",
        peak_flops=(
            ("bfloat16", 989 * TERA),  # hardware.md, H100 SXM5 dense
            ("float16", 989 * TERA),  # hardware.md
            ("tfloat32", 494.5 * TERA),  # TF32 dense: datasheet 989 with sparsity / 2
            ("float32", 67 * TERA),  # CUDA-core FP32: H100 SXM datasheet 67
            ("float8_e4m3fn", 1979 * TERA),  # hardware.md
            ("int8", 1979 * TERA),  # H100 datasheet (SXM5): INT8 3,958 TOPS with sparsity / 2
        ),
        memory_bytes=80 * GiB,  # hardware.md: 80 GB HBM3
        hbm_bandwidth=3350 * GB,  # hardware.md: 3,350 GB/s
        sms=132,  # hardware.md
        nvlink_bandwidth=450 * GB,  # hardware.md: NVLink4 900 GB/s bidirectional / 2
        source=f"NVIDIA H100 Tensor Core GPU datasheet (SXM5); {_HW_MD}",
    ),
    GpuSpec(
        name="H100-PCIe",
        peak_flops=(
            ("bfloat16", 756 * TERA),  # hardware.md: H100 PCIe 756 BF16
            ("float16", 756 * TERA),  # same tensor-core rate as BF16 (datasheet)
            ("tfloat32", 378 * TERA),  # TF32 dense: datasheet 756 with sparsity / 2
            ("float32", 51 * TERA),  # CUDA-core FP32: H100 PCIe datasheet 51
            ("float8_e4m3fn", 1513 * TERA),  # datasheet 3,026 with sparsity / 2
            ("int8", 1513 * TERA),  # H100 datasheet (PCIe): INT8 3,026 TOPS with sparsity / 2
        ),
        memory_bytes=80 * GiB,  # datasheet: 80 GB HBM2e
        hbm_bandwidth=2000 * GB,  # hardware.md: 2.0 TB/s
        sms=114,  # hardware.md
        # The optional 2-GPU NVLink bridge is ignored: PCIe servers are modelled over PCIe.
        nvlink_bandwidth=0.0,
        source=f"NVIDIA H100 Tensor Core GPU datasheet (PCIe); {_HW_MD}",
    ),
    GpuSpec(
        name="H200",
        peak_flops=(
            ("bfloat16", 989 * TERA),  # hardware.md: same compute as H100 SXM
            ("float16", 989 * TERA),  # hardware.md
            ("tfloat32", 494.5 * TERA),  # TF32 dense, as H100 SXM
            ("float32", 67 * TERA),  # CUDA-core FP32: H200 datasheet 67 (the H100 SXM's cores)
            ("float8_e4m3fn", 1979 * TERA),  # hardware.md
            ("int8", 1979 * TERA),  # H200 datasheet: INT8 3,958 TOPS with sparsity / 2
        ),
        memory_bytes=141 * GiB,  # hardware.md: 141 GB HBM3e
        hbm_bandwidth=4800 * GB,  # hardware.md: 4,800 GB/s
        sms=132,  # NVIDIA H200 datasheet: same GH100 configuration as H100 SXM
        nvlink_bandwidth=450 * GB,  # hardware.md: NVLink4 900 GB/s bidirectional / 2
        source=f"NVIDIA H200 Tensor Core GPU datasheet (SXM); {_HW_MD}",
    ),
    GpuSpec(
        name="B200",
        peak_flops=(
            ("bfloat16", 2250 * TERA),  # hardware.md, HGX B200 dense
            ("float16", 2250 * TERA),  # hardware.md
            # TF32 dense: HGX B200 datasheet 18 PFLOPS with sparsity for 8 GPUs -> /8 /2.
            ("tfloat32", 1125 * TERA),
            ("float32", 75 * TERA),  # CUDA-core FP32: HGX B200 datasheet 600 TFLOPS for 8 GPUs / 8
            ("float8_e4m3fn", 4500 * TERA),  # hardware.md
        ),
        # hardware.md gives 180-192 GB; HGX B200 ships 1,440 GB for 8 GPUs = 180 GB each.
        memory_bytes=180 * GiB,
        hbm_bandwidth=8000 * GB,  # hardware.md: 8,000 GB/s
        sms=148,  # NVIDIA Blackwell architecture whitepaper: 148 SMs per B200 (two dies)
        nvlink_bandwidth=900 * GB,  # hardware.md: NVLink5 1,800 GB/s bidirectional / 2
        source=f"NVIDIA HGX B200 datasheet; {_HW_MD}",
    ),
    GpuSpec(
        # The Hopper GPU of the GH200 Grace Hopper Superchip, first (HBM3) version. Compute is
        # the H100 SXM5's; the datasheet prints its tensor rates with sparsity.
        name="GH200",
        peak_flops=(
            ("bfloat16", 989 * TERA),  # GH200 datasheet: BF16 1,979 with sparsity / 2
            ("float16", 989 * TERA),  # GH200 datasheet: FP16 1,979 with sparsity / 2
            ("tfloat32", 494.5 * TERA),  # TF32 dense: GH200 datasheet 989 with sparsity / 2
            ("float32", 67 * TERA),  # CUDA-core FP32: GH200 datasheet 67
            ("float8_e4m3fn", 1979 * TERA),  # GH200 datasheet: FP8 3,958 with sparsity / 2
        ),
        memory_bytes=96 * GiB,  # GH200 datasheet: 96 GB HBM3
        hbm_bandwidth=4000 * GB,  # GH200 datasheet: up to 4 TB/s
        sms=132,  # NVIDIA Grace Hopper Superchip architecture whitepaper: the H100 SXM5 GPU
        # GH200 datasheet: NVLink4 900 GB/s bidirectional GPU-GPU / 2 (NVLink-C2C to the
        # Grace CPU, also 900 GB/s, is host memory, not a GPU-GPU path).
        nvlink_bandwidth=450 * GB,
        source="NVIDIA GH200 Grace Hopper Superchip datasheet (96GB HBM3)",
    ),
    GpuSpec(
        # GH200 with HBM3e (the GH200 NVL2 part): same GPU, more and faster memory.
        name="GH200-144GB",
        peak_flops=(
            ("bfloat16", 989 * TERA),  # GH200 datasheet: BF16 1,979 with sparsity / 2
            ("float16", 989 * TERA),  # GH200 datasheet: FP16 1,979 with sparsity / 2
            ("tfloat32", 494.5 * TERA),  # TF32 dense: GH200 datasheet 989 with sparsity / 2
            ("float32", 67 * TERA),  # CUDA-core FP32: GH200 datasheet 67
            ("float8_e4m3fn", 1979 * TERA),  # GH200 datasheet: FP8 3,958 with sparsity / 2
        ),
        memory_bytes=144 * GiB,  # GH200 datasheet: 144 GB HBM3e
        hbm_bandwidth=4900 * GB,  # GH200 datasheet: up to 4.9 TB/s
        sms=132,  # as GH200 (H100 SXM5 GPU)
        nvlink_bandwidth=450 * GB,  # GH200 datasheet: NVLink4 900 GB/s bidirectional / 2
        source="NVIDIA GH200 Grace Hopper Superchip datasheet (144GB HBM3e)",
    ),
    GpuSpec(
        # H100 SXM5 silicon with NVLink cut to 400 GB/s (and FP64 to ~1 TFLOP/s) for export.
        name="H800",
        peak_flops=(
            ("bfloat16", 989 * TERA),  # H800 datasheet: BF16 1,979 with sparsity / 2
            ("float16", 989 * TERA),  # H800 datasheet: FP16 1,979 with sparsity / 2
            ("tfloat32", 494.5 * TERA),  # TF32 dense: H800 datasheet 989 with sparsity / 2
            ("float32", 67 * TERA),  # CUDA-core FP32: H800 SXM5 datasheet 67
            ("float8_e4m3fn", 1979 * TERA),  # H800 datasheet: FP8 3,958 with sparsity / 2
        ),
        memory_bytes=80 * GiB,  # H800 datasheet: 80 GB HBM3
        hbm_bandwidth=3350 * GB,  # H800 datasheet: 3.35 TB/s
        sms=132,  # the H100 SXM5 configuration (same GH100 part)
        nvlink_bandwidth=200 * GB,  # H800 datasheet: NVLink 400 GB/s bidirectional / 2
        source="NVIDIA H800 Tensor Core GPU datasheet (SXM)",
    ),
    GpuSpec(
        # Export Hopper with most tensor throughput removed but HBM3 and NVLink4 kept. NVIDIA
        # has no public datasheet page; the figures are the HGX H20 product brief's as widely
        # reported (they are dense: 148 BF16 is ~15% of H100 SXM's dense 989).
        name="H20",
        peak_flops=(
            ("bfloat16", 148 * TERA),  # HGX H20 brief: BF16/FP16 148 (dense)
            ("float16", 148 * TERA),  # HGX H20 brief
            ("tfloat32", 74 * TERA),  # TF32 dense: HGX H20 brief 74
            ("float32", 44 * TERA),  # CUDA-core FP32: HGX H20 brief 44
            ("float8_e4m3fn", 296 * TERA),  # HGX H20 brief: FP8 296 (dense)
        ),
        memory_bytes=96 * GiB,  # HGX H20 brief: 96 GB HBM3
        hbm_bandwidth=4000 * GB,  # HGX H20 brief: 4.0 TB/s
        sms=78,  # not in the brief: 78 SMs as the driver reports it (Geekbench 6 listing)
        nvlink_bandwidth=450 * GB,  # HGX H20 brief: NVLink 900 GB/s bidirectional / 2
        source="NVIDIA HGX H20 product brief (as reported; no public datasheet page)",
    ),
    GpuSpec(
        # One B200 GPU of a GB200 NVL72 rack (liquid-cooled, 1,200 W: faster than HGX B200).
        # Per-GPU figures are the NVL72 rack's divided by its 72 GPUs.
        name="GB200",
        peak_flops=(
            ("bfloat16", 2500 * TERA),  # hardware.md: GB200 2,500 BF16 (360 PF sparse / 72 / 2)
            ("float16", 2500 * TERA),  # GB200 NVL72 datasheet: FP16 as BF16
            ("tfloat32", 1250 * TERA),  # TF32 dense: GB200 NVL72 datasheet 180 PF sparse / 72 / 2
            # CUDA-core FP32: GB200 NVL72 datasheet 5,760 TFLOPS for 72 GPUs / 72
            ("float32", 80 * TERA),
            ("float8_e4m3fn", 5000 * TERA),  # GB200 NVL72 datasheet: FP8 720 PF sparse / 72 / 2
        ),
        # GB200 NVL72 datasheet: up to 13.4 TB HBM3e per rack; GB200 superchip: up to 372 GB
        # for its two GPUs -> 186 GB per GPU.
        memory_bytes=186 * GiB,
        hbm_bandwidth=8000 * GB,  # GB200 NVL72 datasheet: 576 TB/s / 72 GPUs
        sms=148,  # the B200 configuration (2 dies x 74 SMs), as HGX B200
        nvlink_bandwidth=900 * GB,  # GB200 NVL72 datasheet: NVLink5 1.8 TB/s per GPU / 2
        source=f"NVIDIA GB200 NVL72 datasheet, per GPU; {_HW_MD}",
    ),
    GpuSpec(
        # One Blackwell Ultra GPU of a GB300 NVL72 rack; per-GPU figures are the rack's / 72.
        name="GB300",
        peak_flops=(
            ("bfloat16", 2500 * TERA),  # GB300 NVL72 datasheet: FP16/BF16 360 PF sparse / 72 / 2
            ("float16", 2500 * TERA),  # GB300 NVL72 datasheet
            ("tfloat32", 1250 * TERA),  # TF32 dense: GB300 NVL72 datasheet 180 PF sparse / 72 / 2
            # CUDA-core FP32: not in our GB300 source; taken as GB200's (Blackwell SMs)
            ("float32", 80 * TERA),
            ("float8_e4m3fn", 5000 * TERA),  # GB300 NVL72 datasheet: FP8 720 PF sparse / 72 / 2
        ),
        memory_bytes=288 * GiB,  # NVIDIA "Inside Blackwell Ultra" blog: 288 GB HBM3e per GPU
        hbm_bandwidth=8000 * GB,  # same blog: 8 TB/s per GPU (GB300 NVL72: 576 TB/s / 72)
        # Same blog: 160 SMs "in the full GPU implementation"; shipping parts may enable fewer.
        sms=160,
        nvlink_bandwidth=900 * GB,  # GB300 NVL72 datasheet: NVLink5 1.8 TB/s per GPU / 2
        source="NVIDIA GB300 NVL72 datasheet, per GPU; NVIDIA technical blog "
        '"Inside NVIDIA Blackwell Ultra" (2025)',
    ),
    GpuSpec(
        name="A100-80GB",
        peak_flops=(
            ("bfloat16", 312 * TERA),  # hardware.md, A100 SXM4
            ("float16", 312 * TERA),  # hardware.md
            ("tfloat32", 156 * TERA),  # hardware.md: TF32 156 (dense)
            ("float32", 19.5 * TERA),  # CUDA-core FP32: A100 datasheet 19.5
            ("int8", 624 * TERA),  # A100 datasheet: INT8 1,248 TOPS with sparsity / 2
        ),
        memory_bytes=80 * GiB,  # hardware.md: 80 GB HBM2e
        hbm_bandwidth=2039 * GB,  # hardware.md: 2,039 GB/s
        sms=108,  # NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs
        nvlink_bandwidth=300 * GB,  # hardware.md: NVLink3 600 GB/s bidirectional / 2
        source=f"NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); {_HW_MD}",
    ),
    GpuSpec(
        name="A100-40GB",
        peak_flops=(
            ("bfloat16", 312 * TERA),  # hardware.md
            ("float16", 312 * TERA),  # hardware.md
            ("tfloat32", 156 * TERA),  # hardware.md: TF32 156 (dense)
            ("float32", 19.5 * TERA),  # CUDA-core FP32: A100 datasheet 19.5
            ("int8", 624 * TERA),  # A100 datasheet: INT8 1,248 TOPS with sparsity / 2
        ),
        memory_bytes=40 * GiB,  # hardware.md: 40 GB HBM2
        hbm_bandwidth=1555 * GB,  # hardware.md: 1,555 GB/s
        sms=108,  # A100 architecture whitepaper
        nvlink_bandwidth=300 * GB,  # hardware.md: NVLink3 600 GB/s bidirectional / 2
        source=f"NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB); {_HW_MD}",
    ),
    GpuSpec(
        name="A100-PCIe",
        peak_flops=(
            ("bfloat16", 312 * TERA),  # A100 datasheet: same tensor-core rate on PCIe
            ("float16", 312 * TERA),
            ("tfloat32", 156 * TERA),  # TF32 dense
            ("float32", 19.5 * TERA),  # CUDA-core FP32: A100 datasheet 19.5
            ("int8", 624 * TERA),  # A100 datasheet: INT8 1,248 TOPS with sparsity / 2
        ),
        memory_bytes=80 * GiB,  # datasheet: A100 80GB PCIe
        hbm_bandwidth=1935 * GB,  # hardware.md: PCIe 80GB 1,935 GB/s
        sms=108,  # A100 architecture whitepaper
        nvlink_bandwidth=0.0,  # the optional 2-GPU NVLink bridge is ignored (PCIe server)
        source=f"NVIDIA A100 Tensor Core GPU datasheet (PCIe 80GB); {_HW_MD}",
    ),
    GpuSpec(
        name="V100",
        peak_flops=(
            # No BF16 hardware: GpuSpec.peak falls back to this FP16 figure for bfloat16,
            # which overstates bf16 on V100; plan V100 runs in float16.
            ("float16", 125 * TERA),  # hardware.md: V100 SXM2 125
            ("float32", 15.7 * TERA),  # CUDA-core FP32 (no TF32): V100 datasheet, SXM2
        ),
        memory_bytes=32 * GiB,  # hardware.md: 16/32 GB; the 32 GB part
        hbm_bandwidth=900 * GB,  # hardware.md: 900 GB/s
        sms=80,  # NVIDIA Tesla V100 GPU architecture whitepaper: 80 SMs
        nvlink_bandwidth=150 * GB,  # hardware.md: NVLink2 300 GB/s bidirectional / 2
        source=f"NVIDIA Tesla V100 datasheet (SXM2 32GB); {_HW_MD}",
    ),
    GpuSpec(
        name="V100-16GB",
        peak_flops=(
            ("float16", 125 * TERA),  # V100 datasheet (SXM2): tensor performance 125
            ("float32", 15.7 * TERA),  # V100 datasheet (SXM2): single precision 15.7
        ),
        memory_bytes=16 * GiB,  # V100 datasheet: 16 GB HBM2 (the SXM2 16 GB part)
        hbm_bandwidth=900 * GB,  # V100 datasheet: 900 GB/s (both memory sizes)
        sms=80,  # NVIDIA Tesla V100 GPU architecture whitepaper: 80 SMs
        nvlink_bandwidth=150 * GB,  # V100 datasheet: NVLink 300 GB/s bidirectional / 2
        source="NVIDIA Tesla V100 datasheet (SXM2 16GB; Sailor's and DGX-1's V100)",
    ),
    GpuSpec(
        name="L40S",
        peak_flops=(
            ("bfloat16", 362 * TERA),  # hardware.md (datasheet 733 with sparsity)
            ("float16", 362 * TERA),  # hardware.md
            ("tfloat32", 183 * TERA),  # TF32 dense: datasheet 366 with sparsity / 2
            ("float32", 91.6 * TERA),  # CUDA-core FP32: L40S datasheet 91.6
            ("float8_e4m3fn", 733 * TERA),  # hardware.md
            ("int8", 733 * TERA),  # L40S datasheet: INT8 1,466 TOPS with sparsity / 2
        ),
        memory_bytes=48 * GiB,  # hardware.md: 48 GB GDDR6 (ECC on costs a few percent)
        hbm_bandwidth=864 * GB,  # hardware.md: 864 GB/s
        sms=142,  # NVIDIA L40S datasheet / Ada architecture whitepaper: 142 SMs
        nvlink_bandwidth=0.0,  # hardware.md: no NVLink, PCIe4 x16
        source=f"NVIDIA L40S datasheet; {_HW_MD}",
    ),
    GpuSpec(
        name="RTX4090",
        peak_flops=(
            ("bfloat16", 165.2 * TERA),  # hardware.md: with FP32 accumulate (training)
            ("float16", 165.2 * TERA),  # hardware.md: FP32 accumulate
            ("tfloat32", 82.6 * TERA),  # TF32 dense: NVIDIA Ada (AD102) whitepaper
            ("float32", 82.6 * TERA),  # CUDA-core FP32: Ada (AD102) whitepaper 82.6 shader TFLOPS
            ("float8_e4m3fn", 330.3 * TERA),  # hardware.md
        ),
        memory_bytes=24 * GiB,  # hardware.md: 24 GB GDDR6X
        hbm_bandwidth=1008 * GB,  # hardware.md: 1,008 GB/s
        sms=128,  # hardware.md
        nvlink_bandwidth=0.0,  # hardware.md: no NVLink
        source=f"NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090); {_HW_MD}",
    ),
    GpuSpec(
        name="A10",
        peak_flops=(
            ("bfloat16", 125 * TERA),  # hardware.md
            ("float16", 125 * TERA),  # hardware.md
            ("tfloat32", 62.5 * TERA),  # TF32 dense: A10 datasheet 125 with sparsity / 2
            ("float32", 31.2 * TERA),  # CUDA-core FP32: A10 datasheet 31.2
            ("int8", 250 * TERA),  # A10 datasheet: INT8 500 TOPS with sparsity / 2
        ),
        memory_bytes=24 * GiB,  # hardware.md: 24 GB GDDR6
        hbm_bandwidth=600 * GB,  # hardware.md: 600 GB/s
        sms=72,  # NVIDIA A10 datasheet / GA102 whitepaper: 72 SMs
        nvlink_bandwidth=0.0,  # hardware.md: PCIe4 only
        source=f"NVIDIA A10 Tensor Core GPU datasheet; {_HW_MD}",
    ),
    GpuSpec(
        name="L4",
        peak_flops=(
            ("bfloat16", 121 * TERA),  # L4 datasheet: BF16 242 with sparsity / 2
            ("float16", 121 * TERA),  # L4 datasheet: FP16 242 with sparsity / 2
            ("tfloat32", 60 * TERA),  # TF32 dense: L4 datasheet 120 with sparsity / 2
            ("float32", 30.3 * TERA),  # CUDA-core FP32: L4 datasheet 30.3
            ("float8_e4m3fn", 242.5 * TERA),  # L4 datasheet: FP8 485 with sparsity / 2
            ("int8", 242.5 * TERA),  # L4 datasheet: INT8 485 TOPS with sparsity / 2
        ),
        memory_bytes=24 * GiB,  # L4 datasheet: 24 GB GDDR6
        hbm_bandwidth=300 * GB,  # L4 datasheet: 300 GB/s
        # TechPowerUp GPU database: 7,424 CUDA cores / 128 per SM. (Some databases print 60,
        # the full AD104; 58 is what the 121 TFLOP/s dense rate at 2,040 MHz implies.)
        sms=58,
        nvlink_bandwidth=0.0,  # L4 datasheet: PCIe Gen4 x16, no NVLink
        source="NVIDIA L4 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        name="A40",
        peak_flops=(
            ("bfloat16", 149.7 * TERA),  # A40 datasheet: BF16 (FP32 accumulate) 149.7 dense
            ("float16", 149.7 * TERA),  # A40 datasheet: FP16 tensor 149.7 dense
            ("tfloat32", 74.8 * TERA),  # TF32 dense: A40 datasheet 74.8
            ("float32", 37.4 * TERA),  # CUDA-core FP32: A40 datasheet 37.4
            ("int8", 299.3 * TERA),  # A40 datasheet: INT8 598.6 TOPS with sparsity / 2
        ),
        memory_bytes=48 * GiB,  # A40 datasheet: 48 GB GDDR6 with ECC
        hbm_bandwidth=696 * GB,  # A40 datasheet: 696 GB/s
        sms=84,  # A40 datasheet: 10,752 CUDA cores / 128 per SM (GA102 whitepaper)
        # The optional 2-GPU NVLink bridge (112.5 GB/s) is ignored: modelled over PCIe Gen4.
        nvlink_bandwidth=0.0,
        source="NVIDIA A40 datasheet; NVIDIA Ampere GA102 GPU architecture whitepaper v2",
    ),
    GpuSpec(
        name="RTX-A6000",
        peak_flops=(
            # GA102 whitepaper v2 appendix C / RTX A6000 datasheet: tensor 309.7 with sparsity
            # / 2 = 84 SMs x 4 tensor cores x 256 FLOP/clock x 1.80 GHz (FP32 accumulate at full
            # rate on professional parts).
            ("bfloat16", 154.8 * TERA),
            ("float16", 154.8 * TERA),
            ("tfloat32", 77.4 * TERA),  # TF32 dense: half the FP16 tensor rate (GA102 whitepaper)
            ("float32", 38.7 * TERA),  # CUDA-core FP32: RTX A6000 datasheet 38.7
        ),
        memory_bytes=48 * GiB,  # RTX A6000 datasheet: 48 GB GDDR6 with ECC
        hbm_bandwidth=768 * GB,  # RTX A6000 datasheet: 768 GB/s
        sms=84,  # 10,752 CUDA cores / 128 per SM (GA102 whitepaper)
        nvlink_bandwidth=0.0,  # the optional 2-GPU NVLink bridge is ignored (PCIe Gen4)
        source="NVIDIA RTX A6000 datasheet; NVIDIA Ampere GA102 GPU architecture whitepaper v2",
    ),
    GpuSpec(
        name="RTX3090",
        peak_flops=(
            # GA102 whitepaper appendix A: FP16 tensor 142 dense with FP16 accumulate, 71 with
            # FP32 accumulate (what mixed-precision training uses; GeForce halves it).
            ("bfloat16", 71 * TERA),  # GA102 whitepaper: BF16 (FP32 accumulate) 71 dense
            ("float16", 71 * TERA),  # GA102 whitepaper: FP16, FP32 accumulate
            ("tfloat32", 35.6 * TERA),  # TF32 dense: GA102 whitepaper 35.6
            ("float32", 35.6 * TERA),  # CUDA-core FP32: GA102 whitepaper appendix A 35.6
        ),
        memory_bytes=24 * GiB,  # GA102 whitepaper: 24 GB GDDR6X
        hbm_bandwidth=936 * GB,  # GA102 whitepaper: 936 GB/s
        sms=82,  # GA102 whitepaper appendix A: 82 SMs
        nvlink_bandwidth=0.0,  # the optional 2-GPU NVLink bridge is ignored (PCIe Gen4)
        source="NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A (GeForce RTX 3090)",
    ),
    GpuSpec(
        name="RTX2080Ti",
        peak_flops=(
            # No BF16 hardware (Turing): no bfloat16 entry (see V100). FP16 tensor rate with
            # FP32 accumulate at reference clocks (1,545 MHz): NVIDIA Turing whitepaper 53.8
            # (107.6 with FP16 accumulate; Founders Edition 56.9 / 113.8).
            ("float16", 53.8 * TERA),
            ("float32", 13.4 * TERA),  # CUDA-core FP32 (no TF32): Turing whitepaper 13.4
        ),
        memory_bytes=11 * GiB,  # Turing whitepaper: 11 GB GDDR6
        hbm_bandwidth=616 * GB,  # Turing whitepaper: 616 GB/s
        sms=68,  # Turing whitepaper: 68 SMs
        nvlink_bandwidth=0.0,  # the optional 2-GPU NVLink bridge is ignored (PCIe Gen3)
        source="NVIDIA Turing GPU architecture whitepaper (GeForce RTX 2080 Ti)",
    ),
    GpuSpec(
        name="T4",
        peak_flops=(
            # No BF16 hardware (Turing): no bfloat16 entry (see V100).
            ("float16", 65 * TERA),  # T4 datasheet: mixed precision (FP16/FP32) 65, dense
            ("float32", 8.1 * TERA),  # CUDA-core FP32 (no TF32): T4 datasheet 8.1
            ("int8", 130 * TERA),  # T4 datasheet: INT8 130 TOPS (Turing has no sparsity)
        ),
        memory_bytes=16 * GiB,  # T4 datasheet: 16 GB GDDR6
        hbm_bandwidth=320 * GB,  # T4 datasheet: 320+ GB/s (TechPowerUp: 320.0)
        sms=40,  # 2,560 CUDA cores / 64 per Turing SM (T4 datasheet; Turing whitepaper)
        nvlink_bandwidth=0.0,  # T4 datasheet: x16 PCIe Gen3, no NVLink
        source="NVIDIA T4 Tensor Core GPU datasheet",
    ),
    GpuSpec(
        # One graphics compute die (GCD): ROCm shows each MI250X as two GPUs.
        name="MI250X",
        peak_flops=(
            ("bfloat16", 191.5 * TERA),  # hardware.md: 383 per package / 2 dies
            ("float16", 191.5 * TERA),  # hardware.md
            ("float32", 47.85 * TERA),  # FP32 matrix: AMD MI250X datasheet 95.7 / 2 dies
        ),
        memory_bytes=64 * GiB,  # hardware.md: 128 GB per package, 64 GB per die
        hbm_bandwidth=1600 * GB,  # hardware.md: 1.6 TB/s per die
        sms=110,  # AMD CDNA2 whitepaper: 220 CUs per MI250X, 110 per die
        # hardware.md: Infinity Fabric 800 GB/s aggregate per package; split over two dies and
        # two directions. An approximation: die-to-die bandwidth inside a node varies by pair.
        nvlink_bandwidth=200 * GB,
        source=f"AMD Instinct MI250X datasheet, one GCD; {_HW_MD}",
    ),
    GpuSpec(
        name="MI300X",
        peak_flops=(
            ("bfloat16", 1307 * TERA),  # hardware.md
            ("float16", 1307 * TERA),  # hardware.md
            ("tfloat32", 653.7 * TERA),  # TF32 dense: AMD MI300X datasheet
            ("float32", 163.4 * TERA),  # FP32 vector and matrix: AMD MI300X datasheet 163.4
            ("float8_e4m3fn", 2615 * TERA),  # hardware.md (2,615)
        ),
        memory_bytes=192 * GiB,  # hardware.md: 192 GB HBM3
        hbm_bandwidth=5300 * GB,  # hardware.md: 5,300 GB/s
        sms=304,  # AMD CDNA3 whitepaper: 304 CUs
        # hardware.md: Infinity Fabric 896 GB/s aggregate bidirectional / 2. This is the sum over
        # the 7 peer links of an 8-GPU platform; one peer pair gets 1/7 of it.
        nvlink_bandwidth=448 * GB,
        source=f"AMD Instinct MI300X datasheet; {_HW_MD}",
    ),
    GpuSpec(
        # A generic host CPU seen as one "device" for local gloo runs (tests, debugging). These
        # are modest PLACEHOLDERS, not a datasheet: profiling (`meshplan calibrate`) should
        # replace them for any timing that matters.
        name="CPU",
        # placeholders: a few AVX-512 cores' worth; torch runs bf16/fp16 matmuls on CPUs too
        # (no faster without AMX), so the same figure for every precision but TF32/FP8
        # int8: `torch._int_mm` runs integer GEMMs on CPUs (the runtime's int8 forward linears,
        # `runtime.hybrid_precision`), at the same placeholder rate
        peak_flops=(
            ("float32", 1 * TERA),
            ("bfloat16", 1 * TERA),
            ("float16", 1 * TERA),
            ("int8", 1 * TERA),
        ),
        memory_bytes=16 * GiB,  # placeholder: host RAM one process may use
        hbm_bandwidth=20 * GB,  # placeholder: a share of a DDR4/DDR5 socket's bandwidth
        sms=8,  # placeholder: cores per device
        nvlink_bandwidth=0.0,
        source="placeholder numbers for a host CPU device; calibrate before trusting timings",
    ),
)

# Variants measured in published runs but not (yet) in the preset table: a preset needs a node
# network in `cluster_io._NODE_NETWORK`, so these are used by building a `DeviceGroup` with the
# spec directly (benchmarks/fidelity.py does). Same conventions as `_SPECS`.
H100_96GB_500W = GpuSpec(
    # Meta's Grand Teton H100 variant that torchtitan's H100 benchmarks ran on
    # (published_runs_calibration.csv, torchtitan rows: "H100 SXM 96GB HBM2e @500W";
    # docs/performance.md: "H100 SXM 95GB HBM2e (lower TDP)"). No public datasheet: the
    # tensor cores are the SXM5 part's (same peak; the 500 W cap lowers sustained clocks,
    # which the cost model's per-GPU-type GEMM efficiency carries), the memory is HBM2e.
    name="H100-96GB-500W",
    peak_flops=(
        ("bfloat16", 989 * TERA),  # as H100 SXM5 (hardware.md)
        ("float16", 989 * TERA),
        ("tfloat32", 494.5 * TERA),
        ("float32", 67 * TERA),  # CUDA-core FP32: as H100 SXM5 (datasheet 67)
        ("float8_e4m3fn", 1979 * TERA),
    ),
    memory_bytes=95 * GiB,  # torchtitan docs/performance.md: "95GB"
    # Estimate, no datasheet: six HBM2e stacks (6 x 16 GB) at 3.2 Gb/s per pin x 1024
    # pins = 6 x 409.6 GB/s. (H100 PCIe, five HBM2e stacks: 2.0 TB/s, hardware.md.)
    hbm_bandwidth=2458 * GB,
    sms=132,  # the SXM5 configuration
    nvlink_bandwidth=450 * GB,  # NVLink4 (Grand Teton: "NVLink")
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md hardware line; "
    f"compute as H100 SXM5 ({_HW_MD}); HBM bandwidth estimated",
)

# PCIe parts of older generations that public kernel-latency datasets were measured on
# (`cost_model.kernel_data`, NeuSight's devices). Same conventions as `_SPECS`.
A100_PCIE_40GB = GpuSpec(
    name="A100-PCIe-40GB",
    peak_flops=(
        ("bfloat16", 312 * TERA),  # A100 datasheet (PCIe 40GB): BF16 tensor 312 dense
        ("float16", 312 * TERA),  # A100 datasheet: FP16 tensor 312 dense
        ("tfloat32", 156 * TERA),  # A100 datasheet: TF32 156 dense
        ("float32", 19.5 * TERA),  # A100 datasheet: CUDA-core FP32 19.5
    ),
    memory_bytes=40 * GiB,  # A100 datasheet: 40 GB HBM2
    hbm_bandwidth=1555 * GB,  # A100 datasheet (PCIe 40GB): 1,555 GB/s
    sms=108,  # A100 architecture whitepaper: 108 SMs
    nvlink_bandwidth=0.0,  # PCIe server (the 2-GPU NVLink bridge is ignored)
    source="NVIDIA A100 Tensor Core GPU datasheet (PCIe 40GB)",
)
V100_PCIE = GpuSpec(
    name="V100-PCIe",
    peak_flops=(
        ("float16", 112 * TERA),  # V100 datasheet (PCIe): tensor performance 112
        ("float32", 14 * TERA),  # V100 datasheet (PCIe): single precision 14
    ),
    memory_bytes=32 * GiB,  # V100 datasheet: 32/16 GB HBM2; the 32 GB part
    hbm_bandwidth=900 * GB,  # V100 datasheet: 900 GB/s
    sms=80,  # Tesla V100 architecture whitepaper: 80 SMs
    nvlink_bandwidth=0.0,  # PCIe part
    source="NVIDIA Tesla V100 datasheet (PCIe 32GB)",
)
P100_PCIE = GpuSpec(
    name="P100-PCIe",
    peak_flops=(
        # No tensor cores: FP16 is packed half2 on the CUDA cores, twice the FP32 rate.
        ("float16", 18.7 * TERA),  # Tesla P100 datasheet (PCIe): half precision 18.7
        ("float32", 9.3 * TERA),  # Tesla P100 datasheet (PCIe): single precision 9.3
    ),
    memory_bytes=16 * GiB,  # Tesla P100 datasheet: 16 GB CoWoS HBM2
    hbm_bandwidth=732 * GB,  # Tesla P100 datasheet (PCIe 16GB): 732 GB/s
    sms=56,  # Tesla P100 (GP100) whitepaper: 56 SMs
    nvlink_bandwidth=0.0,  # PCIe part
    source="NVIDIA Tesla P100 PCIe datasheet; Pascal GP100 whitepaper",
)
P4 = GpuSpec(
    name="P4",
    peak_flops=(
        # GP104 runs FP16 arithmetic at a small fraction of FP32: no float16 entry.
        ("float32", 5.5 * TERA),  # Tesla P4 datasheet: single precision 5.5
    ),
    memory_bytes=8 * GiB,  # Tesla P4 datasheet: 8 GB GDDR5
    hbm_bandwidth=192 * GB,  # Tesla P4 datasheet: 192 GB/s
    sms=20,  # Tesla P4 datasheet: 2,560 CUDA cores / 128 per Pascal GP104 SM
    nvlink_bandwidth=0.0,  # PCIe part
    source="NVIDIA Tesla P4 datasheet",
)

# Specs usable by name in measurements and benchmarks but not presets (no node network).
VARIANT_SPECS: MappingProxyType[str, GpuSpec] = MappingProxyType(
    {s.name: s for s in (H100_96GB_500W, A100_PCIE_40GB, V100_PCIE, P100_PCIE, P4)}
)
_VARIANT_ALIASES: dict[str, tuple[str, ...]] = {
    "A100-PCIe-40GB": (),
    "V100-PCIe": ("V100-PCIe-32GB",),
    "P100-PCIe": ("P100-PCIe-16GB",),
    "P4": ("P4-8GB",),
    "H100-96GB-500W": (),
}


def variant_spec(name: str) -> GpuSpec | None:
    """The measured-only variant named `name` (canonical or alias, any case), else None."""
    key = _norm(name)
    for canonical, aliases in _VARIANT_ALIASES.items():
        if key in {_norm(a) for a in (canonical, *aliases)}:
            return VARIANT_SPECS[canonical]
    return None


GPU_SPECS: MappingProxyType[str, GpuSpec] = MappingProxyType({s.name: s for s in _SPECS})

# Aliases by canonical name. Lookup normalises case and drops every non-alphanumeric
# character, so "H100 SXM5", "h100-sxm5" and "H100_SXM5" are one alias.
_ALIASES: dict[str, tuple[str, ...]] = {
    # "H100 80GB HBM3": the SXM part as torch.cuda.get_device_name reports it
    "H100": ("H100-SXM", "H100-SXM5", "H100-80GB", "H100-SXM5-80GB", "H100-80GB-HBM3"),
    "H100-PCIe": ("H100-PCIe-80GB",),
    "H200": ("H200-SXM", "H200-141GB"),
    "B200": ("HGX-B200", "B200-SXM"),
    "GH200": ("GH200-96GB", "GH200-HBM3", "Grace-Hopper", "GH200-Superchip"),
    "GH200-144GB": ("GH200-HBM3e", "GH200-NVL2"),
    "H800": ("H800-SXM", "H800-SXM5", "H800-80GB"),
    "H20": ("H20-96GB", "HGX-H20"),
    "GB200": ("GB200-NVL72", "GB200-Superchip"),
    "GB300": ("GB300-NVL72", "GB300-Superchip"),
    "A100-80GB": ("A100", "A100-SXM", "A100-SXM4", "A100-SXM4-80GB", "A100-80GB-SXM"),
    "A100-40GB": ("A100-SXM4-40GB", "A100-40GB-SXM"),
    "A100-PCIe": ("A100-PCIe-80GB", "A100-80GB-PCIe"),
    "V100": ("V100-SXM2", "V100-32GB", "V100-SXM2-32GB", "Tesla-V100"),
    "V100-16GB": ("V100-SXM2-16GB", "Tesla-V100-16GB"),
    "L40S": (),
    "RTX4090": ("GeForce-RTX-4090", "4090"),
    "A10": ("A10-24GB",),
    "L4": ("L4-24GB",),
    "A40": ("A40-48GB",),
    "RTX-A6000": ("A6000",),
    "RTX3090": ("GeForce-RTX-3090", "3090"),
    "RTX2080Ti": ("GeForce-RTX-2080-Ti", "2080Ti"),
    "T4": ("Tesla-T4", "T4-16GB"),
    "MI250X": ("MI250X-GCD", "Instinct-MI250X"),
    "MI300X": ("Instinct-MI300X",),
    "CPU": ("host-cpu", "gloo-cpu"),
}


def _norm(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


_LOOKUP: dict[str, str] = {}
for _canonical, _aliases in _ALIASES.items():
    for _alias in (_canonical, *_aliases):
        assert _LOOKUP.get(_norm(_alias), _canonical) == _canonical, f"ambiguous alias {_alias}"
        _LOOKUP[_norm(_alias)] = _canonical
assert set(_ALIASES) == set(GPU_SPECS), "every spec needs an alias entry and vice versa"


def known_gpus() -> list[str]:
    """Canonical names of every GPU type in the spec table, in table order."""
    return list(GPU_SPECS)


def gpu_spec(name: str) -> GpuSpec:
    """The spec of GPU type `name` (canonical name or alias, any case).

    Raises `UnknownGpuError` with a one-line message listing the known types.
    """
    canonical = _LOOKUP.get(_norm(name))
    if canonical is None:
        close = difflib.get_close_matches(_norm(name), list(_LOOKUP), n=1)
        hint = f" (did you mean {_LOOKUP[close[0]]!r}?)" if close else ""
        raise UnknownGpuError(
            f"unknown GPU type {name!r}{hint}; known types: {', '.join(known_gpus())}"
        )
    return GPU_SPECS[canonical]


def canonical_gpu_name(name: str) -> str | None:
    """The canonical name for `name` if it is a known GPU type or alias, else None."""
    return _LOOKUP.get(_norm(name))


# --------------------------------------------------------------------------------------------
# Link tiers
# --------------------------------------------------------------------------------------------
#
# Latency is the per-hop alpha of the alpha-beta model. NCCL's own tuning model
# (NVIDIA/nccl src/graph/tuning.cc, `hwLat`, ring algorithm) charges per hop 0.47 us (LL
# protocol) to 3.4 us (Simple) on NVLink, 1.0-5.7 us on PCIe and 2.7-9.6 us on the network;
# the defaults below sit in those ranges. TCP (NCCL socket transport, gloo) and WAN values are
# typical magnitudes. All of them are to be calibrated. (Written as literals, not 5 * 1e-6,
# so that they equal what the cluster-file parser makes of "5us".)
#
# Efficiency is NCCL bus bandwidth over line rate on large messages. These are DEFAULT
# ASSUMPTIONS to be replaced by `meshplan calibrate` (nccl-tests style measurements): large-
# message busbw typically lands at 75-90% of line rate on NVLink and InfiniBand, lower through
# host bridges and TCP stacks.

DEFAULT_LATENCY: MappingProxyType[LinkKind, float] = MappingProxyType(
    {
        LinkKind.NVLINK: 2e-6,  # between NCCL hwLat LL 0.47 and Simple 3.4 us
        LinkKind.PCIE: 3e-6,  # between NCCL hwLat LL 1.0 and Simple 5.7 us
        LinkKind.INFINIBAND: 5e-6,  # between NCCL hwLat NET LL 2.7 and Simple 9.6 us
        LinkKind.ROCE: 6e-6,  # RDMA over Ethernet: IB-like plus switch hops, typical
        LinkKind.ETHERNET: 20e-6,  # NCCL socket transport over TCP, typical
        LinkKind.WAN: 1e-3,  # ~200 km of fiber one way (5 us/km); set yours per link
        LinkKind.LOOPBACK: 20e-6,  # gloo over TCP loopback, typical; placeholder
    }
)

DEFAULT_EFFICIENCY: MappingProxyType[LinkKind, float] = MappingProxyType(
    {
        LinkKind.NVLINK: 0.8,  # assumption, calibrate
        LinkKind.PCIE: 0.7,  # assumption: PCIe packet overhead, often routed via the host
        LinkKind.INFINIBAND: 0.85,  # assumption, calibrate
        LinkKind.ROCE: 0.8,  # assumption, calibrate
        LinkKind.ETHERNET: 0.7,  # assumption: TCP socket transport
        LinkKind.WAN: 0.5,  # assumption: shared long-haul TCP paths rarely fill the pipe
        LinkKind.LOOPBACK: 1.0,  # placeholder: memory copies, calibrate
    }
)


def _tier(name: str, kind: LinkKind, bandwidth: float) -> LinkTier:
    return LinkTier(name, kind, bandwidth, DEFAULT_LATENCY[kind], DEFAULT_EFFICIENCY[kind])


_TIERS: tuple[LinkTier, ...] = (
    # GPU-to-GPU fabrics: per GPU, one direction (aggregate bidirectional / 2).
    _tier("nvlink2", LinkKind.NVLINK, 150 * GB),  # hardware.md: V100 NVLink2 300 GB/s
    _tier("nvlink3", LinkKind.NVLINK, 300 * GB),  # hardware.md: A100 NVLink3 600 GB/s
    _tier("nvlink4", LinkKind.NVLINK, 450 * GB),  # hardware.md: H100/H200 NVLink4 900 GB/s
    _tier("nvlink4-h800", LinkKind.NVLINK, 200 * GB),  # H800 datasheet: NVLink 400 GB/s
    _tier("nvlink5", LinkKind.NVLINK, 900 * GB),  # hardware.md: B200 NVLink5 1,800 GB/s
    # AMD Infinity Fabric (xGMI). LinkKind has no AMD member; NVLINK stands for "GPU fabric".
    _tier("xgmi-mi250x", LinkKind.NVLINK, 200 * GB),  # hardware.md 800 GB/s per package / 4
    _tier("xgmi-mi300x", LinkKind.NVLINK, 448 * GB),  # hardware.md: 896 GB/s / 2
    # PCIe x16, per GPU, one direction.
    _tier("pcie3", LinkKind.PCIE, 16 * GB),  # PCI-SIG: Gen3 x16, 8 GT/s x 16 lanes (128b/130b)
    _tier("pcie4", LinkKind.PCIE, 32 * GB),  # hardware.md: PCIe4 x16 64 GB/s bidirectional
    _tier("pcie5", LinkKind.PCIE, 64 * GB),  # PCI-SIG: Gen5 doubles Gen4's 32 GT/s lane rate
    # Inter-node, per NIC port, one direction.
    _tier("ib-edr", LinkKind.INFINIBAND, 100 * GBIT),  # IBTA: EDR 4x = 100 Gb/s
    _tier("ib-hdr", LinkKind.INFINIBAND, 200 * GBIT),  # hardware.md: HDR 200 Gb/s = 25 GB/s
    _tier("ib-ndr", LinkKind.INFINIBAND, 400 * GBIT),  # hardware.md: NDR 400 Gb/s = 50 GB/s
    _tier("ib-xdr", LinkKind.INFINIBAND, 800 * GBIT),  # hardware.md: XDR 800 Gb/s
    _tier("roce-200g", LinkKind.ROCE, 200 * GBIT),  # IEEE 802.3 200GbE
    _tier("roce-400g", LinkKind.ROCE, 400 * GBIT),  # hardware.md: RoCE 400 GbE
    _tier("100gbe", LinkKind.ETHERNET, 100 * GBIT),  # hardware.md: 100 GbE = 12.5 GB/s
    _tier("25gbe", LinkKind.ETHERNET, 25 * GBIT),  # IEEE 802.3by 25GbE
    # Between sites: the whole link's bandwidth (shared by every flow crossing it).
    _tier("wan-10g", LinkKind.WAN, 10 * GBIT),  # a 10 Gb/s leased line
    _tier("wan-100g", LinkKind.WAN, 100 * GBIT),  # a 100 Gb/s leased line / DCI
    # Processes on one host (gloo). Placeholder bandwidth: a memcpy-bound TCP loopback path.
    _tier("loopback", LinkKind.LOOPBACK, 5 * GB),
)

LINK_TIERS: MappingProxyType[str, LinkTier] = MappingProxyType({t.name: t for t in _TIERS})


def known_links() -> list[str]:
    """Names of the built-in link tiers, in table order."""
    return list(LINK_TIERS)


def link_tier(name: str) -> LinkTier:
    """The built-in link tier `name` (case-insensitive).

    Raises `UnknownLinkError` with a one-line message listing the built-in tiers.
    """
    tier = LINK_TIERS.get(name.lower())
    if tier is None:
        close = difflib.get_close_matches(name.lower(), known_links(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownLinkError(
            f"unknown link tier {name!r}{hint}; built-in tiers: {', '.join(known_links())}"
        )
    return tier


# The link inside a node for each GPU type: its NVLink/xGMI generation for SXM/OAM parts,
# PCIe for the rest (hardware.md "GPU-GPU link" column; H100 PCIe is a Gen5 card).
_INTRA_LINK: dict[str, str] = {
    "H100": "nvlink4",
    "H100-PCIe": "pcie5",
    "H200": "nvlink4",
    "B200": "nvlink5",
    "GH200": "nvlink4",
    "GH200-144GB": "nvlink4",
    "H800": "nvlink4-h800",
    "H20": "nvlink4",
    # GB200/GB300 NVL72: one NVLink5 domain of 72 GPUs over 4-GPU trays; the presets set
    # `DeviceGroup.nvlink_domain` so the whole rack shares this tier (cluster_io._RACK_SCALE).
    "GB200": "nvlink5",
    "GB300": "nvlink5",
    "A100-80GB": "nvlink3",
    "A100-40GB": "nvlink3",
    "A100-PCIe": "pcie4",
    "V100": "nvlink2",
    "V100-16GB": "nvlink2",
    "L40S": "pcie4",
    "RTX4090": "pcie4",
    "A10": "pcie4",
    "L4": "pcie4",  # L4 datasheet: PCIe Gen4 x16
    "A40": "pcie4",  # A40 datasheet: PCIe Gen4
    "RTX-A6000": "pcie4",  # RTX A6000 datasheet: PCIe Gen4 x16
    "RTX3090": "pcie4",  # GA102 whitepaper: PCIe Gen4
    "RTX2080Ti": "pcie3",  # Turing whitepaper: PCIe Gen3 x16
    "T4": "pcie3",  # T4 datasheet: PCIe Gen3 x16
    "MI250X": "xgmi-mi250x",
    "MI300X": "xgmi-mi300x",
    "CPU": "loopback",
}
assert set(_INTRA_LINK) == set(GPU_SPECS)


def default_intra_link(gpu: str) -> str:
    """Name of the built-in tier that connects GPUs of type `gpu` inside one node."""
    return _INTRA_LINK[gpu_spec(gpu).name]
