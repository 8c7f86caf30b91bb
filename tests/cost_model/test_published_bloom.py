"""A published run held out of every fit: BLOOM-176B on 384 A100 80GB (docs/fidelity.md,
"Held out: BLOOM-176B").

BigScience's tr11-176B-ml (github.com/bigscience-workshop/bigscience, train/tr11-176B-ml:
README.md and tr11-176B-ml.slurm): Megatron-DeepSpeed, 48 nodes of 8 A100 80GB (NVLink inside,
4 Omni-Path 100 Gb/s links per node), TP 4 x PP 12 x DP 8, micro-batch 2, global batch 2048
of 2048 tokens, bf16, full activation checkpointing, ZeRO-1 (DeepSpeed's BF16_Optimizer, "its
own ZeRO stage 1"), the embedding counted as a block when partitioning: stages of 5, 6 x 10
and 5 transformer blocks. Its log at iteration 85376: "elapsed time per iteration (s): 104.70
... TFLOPs: 149.77". Priced as the run ran: Megatron's fused kernels and its materialised
attention (no FlashAttention in that stack), gradients reduced after the last backward
(DeepSpeed's pipeline engine, `Engine.dp_overlap`). The tolerance, 12%, is the one the
prediction meets (-9%), not a target.
"""

from __future__ import annotations

import sys
from pathlib import Path

import meshplan
import pytest
from meshplan.api import as_graph, check_config, complete_parallel
from meshplan.cost_model.engine import Engine
from meshplan.cost_model.simulate import predict
from meshplan.ir import Parallel
from meshplan.passes.partition import place_stages, stages_of
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "frameworks"))
import bloom_176b  # noqa: E402

pytestmark = pytest.mark.usefixtures("gpu_time_only")

MEASURED_S, TFLOPS = 104.70, 149.77  # iteration 85376 of the run's log (README)
GPUS, GLOBAL_BATCH, SEQ, LAYERS, HIDDEN, VOCAB = 384, 2048, 2048, 70, 14336, 250880
SPLIT = (5,) + (6,) * 10 + (5,)


def megatron_flops(batch: int) -> float:
    """FLOPs of one iteration with full recomputation (Narayanan et al. 2021, Eq. 3), what
    Megatron-DeepSpeed logs as TFLOPs."""
    s, l, h, v = SEQ, LAYERS, HIDDEN, VOCAB  # noqa: E741
    return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def test_the_logged_figures_agree():
    assert megatron_flops(GLOBAL_BATCH) / GPUS / MEASURED_S / 1e12 == pytest.approx(
        TFLOPS, rel=1e-3
    )


@pytest.fixture(scope="module")
def graphs():
    """The model traced with PyTorch's math attention (scores materialised, as the run's
    Megatron kernels did) and with its fused attention."""
    with sdpa_kernel(SDPBackend.MATH):
        math = as_graph(*bloom_176b.build())
    return math, as_graph(*bloom_176b.build())


def _step(graph, engine: Engine) -> float:
    cluster = meshplan.Cluster.load(ROOT / "examples" / "frameworks" / "jean_zay_a100.yaml")
    pinned = Parallel(
        dp=8, tp=4, pp=12, cp=1, ep=1, micro_batch=2, global_batch=GLOBAL_BATCH,
        recompute="full", zero=1, schedule="1f1b", sequence_parallel=False,
    )  # fmt: skip
    p = complete_parallel(graph, cluster, pinned)
    check_config(graph, cluster, p, pinned)
    pred = predict(graph, cluster, p, place_stages(cluster, p, stages_of(graph, SPLIT)),
                   dtype="bfloat16", engine=engine)  # fmt: skip
    assert pred.fits
    return pred.step_time_s


def test_bloom_is_built_at_its_size(graphs):
    # 176.2B with the zoo's learned positions (29M) in place of ALiBi
    assert graphs[0].num_params() == pytest.approx(176.27e9, rel=1e-3)


def test_bloom_176b_step_time_against_the_published_iteration(graphs):
    math, fused_attention = graphs
    as_run = _step(math, Engine(fused=True, dp_overlap=False))
    assert as_run == pytest.approx(MEASURED_S, rel=0.12)
    assert as_run < MEASURED_S  # the Megatron-DeepSpeed stack is slower than priced (MT-NLG too)
    # materialised attention and an exposed reduction each cost time
    assert _step(fused_attention, Engine(fused=True, dp_overlap=False)) < as_run
    assert _step(math, Engine(fused=True)) < as_run
