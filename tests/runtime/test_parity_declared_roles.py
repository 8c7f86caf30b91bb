"""A model whose MLP inner width equals the model width, under tensor parallelism.

The sharding pass reads row-parallel projections off op order and widths; with ffn == hidden
its down projection looks like an input projection, and tp ranks sharded that way stopped at
the first step ("a and b must have same reduction dim"). The zoo now declares the role
(`meshplan_tp_roles`, `passes.sharding`), and tp = 2 trains like one process: losses and
parameters after every step (the harness's SGD run) on 2 gloo ranks.
"""

from __future__ import annotations

import meshplan
from meshplan.runtime import run_local

from tests.runtime.harness import CFG, assert_parity, distributed_run, graph, reference

WIDE = dict(ffn=CFG["hidden"])  # the MLP's inner width = the model width


def _plan():
    cluster = meshplan.Cluster.preset("cpu", gpus=2)
    parallel = meshplan.Parallel(tp=2, micro_batch=2, global_batch=2)
    return meshplan.estimate_plan(graph(**WIDE), cluster=cluster, parallel=parallel)


def _rank(plan):
    return distributed_run(plan, **WIDE)


def test_declared_row_parallel_down_projection_trains_like_one_process():
    plan = _plan()
    assert dict(plan.placements)["layer:mlp.down_proj.weight"] == "S(1)"
    ref = reference(2, 1, **WIDE)
    assert_parity("tp2-ffn=hidden", ref, run_local(_rank, 2, plan, timeout_s=120))
