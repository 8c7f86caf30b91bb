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


def test_cross_entropy_probe():
    """The loss runs vocab-parallel only when it is a cross entropy `loss_parallel` computes
    exactly (probed on meta tensors); anything else gets the gathered logits."""
    import torch
    import torch.nn.functional as F
    from meshplan.runtime.tensor_parallel import is_cross_entropy

    from tests.runtime.harness import loss_fn

    v = 64

    def flat(o, t, **kw):
        return F.cross_entropy(o.reshape(-1, v), t.reshape(-1), **kw)

    def hf_loss_fn(out, t):  # test_parity_hf's: HF model outputs carry `.logits`
        return flat(out.logits.float(), t)

    assert is_cross_entropy(loss_fn, v)  # .float().reshape(...) then F.cross_entropy
    assert is_cross_entropy(hf_loss_fn, v)
    assert is_cross_entropy(lambda o, t: flat(o, t, ignore_index=0) * 0.5, v)
    assert is_cross_entropy(torch.nn.CrossEntropyLoss().__call__, v) is False  # (B, S, V): C=S
    assert not is_cross_entropy(lambda o, t: flat(o, t, label_smoothing=0.1), v)
    z_loss = lambda o, t: flat(o, t) + 1e-4 * torch.logsumexp(o, -1).pow(2).mean()  # noqa: E731
    assert not is_cross_entropy(z_loss, v)
    assert not is_cross_entropy(lambda o, t: (o.softmax(-1) - F.one_hot(t, v)).pow(2).mean(), v)
    assert not is_cross_entropy(lambda o, t: F.cross_entropy(o.transpose(1, 2), t), v)
    assert not is_cross_entropy(lambda o, t: o.numpy(), v)  # cannot run on meta: no
