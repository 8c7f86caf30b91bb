"""Parity of every parallel dimension with one process, and collectives against the plan.

Each test is one local launch (`run_local`: torch imported once, ranks forked) that runs
several plans in turn on the same ranks. For each plan: losses of 3 SGD steps equal the
single-process run on every rank, and rank 0's gathered parameters after each step equal the
single process's (so do the gradients, recovered from the SGD update), within fp32 tolerance.
Every rank's collectives of step 1 on its tp, gradient and world groups equal the cost
model's for the plan (`harness.check_step_collectives`), with no exceptions.
"""

from __future__ import annotations

from meshplan.runtime import run_local

from tests.runtime.harness import (
    assert_parity,
    check_step_collectives,
    distributed_run,
    graph,
    make_plan,
    reference,
)

# name -> (world, plan fields); `stages` gives uneven unit counts per pipeline stage.
CONFIGS_2 = {
    "dp": dict(dp=2, micro_batch=2, global_batch=8),
    "dp-one-microbatch": dict(dp=2, micro_batch=4, global_batch=8),
    "fsdp-zero3": dict(dp=2, zero=3, micro_batch=2, global_batch=8),
    "fsdp-zero2": dict(dp=2, zero=2, micro_batch=4, global_batch=8),
    "tp-sp": dict(tp=2, micro_batch=4, global_batch=8),
    # the same plan with the logits gathered (what an arbitrary loss function gets)
    "tp-sp-gathered-loss": dict(tp=2, micro_batch=4, global_batch=8),
    "tp-nosp-selective": dict(
        tp=2, micro_batch=2, global_batch=8, sequence_parallel=False, recompute="selective"
    ),
    "pp-1f1b-uneven": dict(pp=2, micro_batch=2, global_batch=8, stages=(2, 4)),
    "pp-gpipe": dict(pp=2, micro_batch=2, global_batch=8, schedule="gpipe"),
    "dp-full-recompute": dict(dp=2, micro_batch=2, global_batch=8, recompute="full"),
}
CONFIGS_4 = {
    "dpxtp": dict(dp=2, tp=2, micro_batch=2, global_batch=8),
    "fsdpxtp": dict(dp=2, tp=2, zero=3, micro_batch=2, global_batch=8),
    "tpxpp": dict(tp=2, pp=2, micro_batch=2, global_batch=8),
    "dpxpp-uneven": dict(dp=2, pp=2, micro_batch=1, global_batch=8, stages=(4, 2)),
}
CONFIGS_8 = {
    "dpxtpxpp": dict(dp=2, tp=2, pp=2, micro_batch=1, global_batch=8),
}


def _plans(world, configs):
    plans = {}
    for name, fields in configs.items():
        fields = dict(fields)
        stages = fields.pop("stages", None)
        plans[name] = make_plan(world, stages=stages, **fields)
    return plans


# apply() keywords per config (default: none)
APPLY_KW = {"tp-sp-gathered-loss": {"loss_parallel": False}}


def _all_configs(plans):
    """Inside each rank: run every plan; also name which mesh group is which axis."""
    out = {}
    for name, plan in plans.items():
        out[name] = distributed_run(plan, apply_kw=APPLY_KW.get(name))
    return out


def _check_all(world, configs):
    plans = _plans(world, configs)
    results = run_local(_all_configs, world, plans, timeout_s=240)
    for name, plan in plans.items():
        p = plan.parallel
        ref = reference(p.global_batch, p.num_microbatches)
        assert_parity(name, ref, [r[name] for r in results])
        vocab_parallel = APPLY_KW.get(name, {}).get("loss_parallel", True)
        for rank, r in enumerate(results):
            check_step_collectives(
                f"{name} rank {rank}", plan, graph(), r[name], vocab_parallel=vocab_parallel
            )
    return plans, results


def test_parity_two_ranks():
    _check_all(2, CONFIGS_2)


def test_parity_four_ranks():
    _check_all(4, CONFIGS_4)


def test_parity_eight_ranks():
    _check_all(8, CONFIGS_8)
