"""The largest published runs (docs/fidelity.md): Llama 3 405B pre-training on 8,192 and
16,384 H100 (Llama 3 paper, Table 4: TP 8, CP 1, PP 16, DP 64 / 128, sequence 8192, 16M
tokens per step; 430 and 400 TFLOP/s per GPU, BF16 MFU 43% and 41%).

126 layers on 16 stages of interleaved 1F1B: one layer fewer on the first and last stages
(Megatron's rule, the embedding and the loss counting as a layer). The paper states neither
the virtual-stage count nor the recompute policy; without recomputation meshplan's memory
model puts the first stages at 120-143 GiB of an 80 GiB part, so the rows are priced with
selective recomputation, the cheapest policy that fits.
"""

from __future__ import annotations

import meshplan
import pytest
from meshplan.ir.parallel import Parallel

PUBLISHED_MFU = {8192: 0.43, 16384: 0.41}


@pytest.fixture(scope="module")
def graph():
    model, inputs = meshplan.models.get("llama3-405b", seq_len=8192)
    return meshplan.trace(model, *inputs)


@pytest.mark.slow
@pytest.mark.parametrize("virtual_stages", [4, 8])
@pytest.mark.parametrize("gpus", [8192, 16384])
def test_llama3_405b_published_mfu_within_ten_percent(graph, gpus, virtual_stages):
    parallel = Parallel(
        tp=8, pp=16, dp=gpus // 128, cp=1, micro_batch=1, global_batch=2048,
        schedule="interleaved_1f1b", virtual_stages=virtual_stages, zero=1,
        sequence_parallel=True, recompute="selective",
    )  # fmt: skip
    plan = meshplan.estimate_plan(graph, cluster=meshplan.Cluster.preset("H100", gpus=gpus),
                                  parallel=parallel)  # fmt: skip
    # 128 units (embedding, 126 layers, loss) in 16 x v chunks: 8 units per rank, the first
    # rank's holding the embedding and the last rank's the loss, so 7 layers each
    assert [sum(b - a for a, b in s.chunks) for s in plan.stages] == [8] * 16
    assert plan.stages[0].chunks[0][0] == 0 and plan.stages[-1].chunks[-1][1] == 128
    assert plan.predicted.fits
    assert plan.predicted.mfu == pytest.approx(PUBLISHED_MFU[gpus], rel=0.10)
