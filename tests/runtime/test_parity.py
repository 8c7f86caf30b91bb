"""Parity of every parallel dimension with one process, and collectives against the plan.

Each test is one local launch (`run_local`: torch imported once, ranks forked) that runs
several plans in turn on the same ranks. For each plan: losses of 3 SGD steps equal the
single-process run on every rank, and rank 0's gathered parameters after each step equal the
single process's (so do the gradients, recovered from the SGD update), within fp32 tolerance.
"""

from __future__ import annotations

from collections import Counter

from meshplan.runtime import run_local

from tests.runtime.harness import assert_parity, distributed_run, graph, make_plan, reference

# name -> (world, plan fields); `stages` gives uneven unit counts per pipeline stage.
CONFIGS_2 = {
    "dp": dict(dp=2, micro_batch=2, global_batch=8),
    "dp-one-microbatch": dict(dp=2, micro_batch=4, global_batch=8),
    "fsdp-zero3": dict(dp=2, zero=3, micro_batch=2, global_batch=8),
    "fsdp-zero2": dict(dp=2, zero=2, micro_batch=4, global_batch=8),
    "tp-sp": dict(tp=2, micro_batch=4, global_batch=8),
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


def _all_configs(plans):
    """Inside each rank: run every plan; also name which mesh group is which axis."""
    out = {}
    for name, plan in plans.items():
        out[name] = distributed_run(plan)
    return out


def _check_all(world, configs):
    plans = _plans(world, configs)
    results = run_local(_all_configs, world, plans, timeout_s=240)
    for name, plan in plans.items():
        p = plan.parallel
        ref = reference(p.global_batch, p.num_microbatches)
        assert_parity(name, ref, [r[name] for r in results])
    return plans, results


def test_parity_two_ranks():
    plans, results = _check_all(2, CONFIGS_2)
    _check_tp_collectives(plans["tp-sp"], results[0]["tp-sp"])
    _check_tp_collectives(plans["tp-nosp-selective"], results[0]["tp-nosp-selective"])
    _check_dp_collectives(plans["dp-one-microbatch"], results[0]["dp-one-microbatch"])
    _check_dp_collectives(plans["fsdp-zero2"], results[0]["fsdp-zero2"])


def test_parity_four_ranks():
    plans, results = _check_all(4, CONFIGS_4)
    _check_tp_collectives(plans["dpxtp"], results[0]["dpxtp"])


def test_parity_eight_ranks():
    _check_all(8, CONFIGS_8)


# -- collectives against the cost model's prediction ------------------------------------------

FP32 = 4


def _predicted_tp(plan):
    """(kind, elements) of every TP collective the cost model prices for one step of rank 0's
    stage: per micro-batch, each unit's `tp_collectives` (with or without SP)."""
    from meshplan.cost_model.simulate import model_costs

    costs = model_costs(graph())
    p = plan.parallel
    stage = plan.stages[0]
    want: Counter = Counter()
    for key in costs.unit_keys[stage.first_unit : stage.last_unit]:
        for c in costs.facts[key].tp_collectives:
            kinds = c.with_sp if p.sequence_parallel else c.without_sp
            numel = c.size_bytes // FP32 * p.micro_batch // costs.traced_micro_batch
            for kind in kinds:
                want[(str(kind), numel)] += p.num_microbatches
    return want


def _known_tp_extras(plan):
    """Collectives the runtime runs that the cost model does not price (docs/runtime.md):
    the gather of the logits per micro-batch (any loss function works on them); under SP the
    all-reduce of each replicated (norm) weight's gradient per step, and the backward
    all-gather of the vocab-parallel embedding's output gradient (the backward of its
    forward reduce-scatter; its weight gradient needs every position)."""
    from tests.runtime.harness import CFG, SEQ

    p = plan.parallel
    extra: Counter = Counter()
    extra[("all_gather", p.micro_batch * SEQ * CFG["vocab"])] += p.num_microbatches
    if p.sequence_parallel:
        extra[("all_reduce", CFG["hidden"])] += 2 * CFG["layers"] + 1
        extra[("all_gather", p.micro_batch * SEQ * CFG["hidden"])] += p.num_microbatches
    return extra


def _step_records(result, axis):
    """Records on `axis`'s group, without the runner's one scalar all-reduce of the loss
    (it runs on the world group, which a mesh axis spanning every rank shares)."""
    group = result["groups"][axis]
    return [
        r
        for r in result["records"]
        if r.group == group and not (r.kind == "all_reduce" and r.numel == 1)
    ]


def _check_tp_collectives(plan, result):
    got = Counter((r.kind, r.numel) for r in _step_records(result, "tp"))
    want = _predicted_tp(plan)
    want = Counter({(_normalise(k), n): c for (k, n), c in want.items()})
    extra = _known_tp_extras(plan)
    assert got == want + extra, (
        f"TP collectives differ from the plan: missing {dict(want + extra - got)}, "
        f"unexpected {dict(got - want - extra)}"
    )


def _normalise(kind: str) -> str:
    # cost_model.collectives.Collective values -> runtime record kinds
    return kind.replace("-", "_").lower()


def _check_dp_collectives(plan, result):
    """DP traffic: the kinds the cost model prices for the ZeRO stage, with the volume of the
    stage's parameters (the runtime splits them into buckets / per-layer groups, so compare
    total elements, not the number of calls)."""
    from meshplan.cost_model.simulate import model_costs, pricer_for

    p = plan.parallel
    assert p.num_microbatches == 1, "ZeRO-1/2 volume per step equals the price only for one"
    costs = model_costs(graph())
    pricer = pricer_for(graph(), plan.cluster, dtype="float32")
    comp = costs.composition(plan.stages[0].first_unit, plan.stages[0].last_unit)
    traffic = pricer.dp_traffic(comp, tp=p.tp, ep=p.ep, dp=p.dp, zero=p.zero)
    want: Counter = Counter()
    prec = pricer.precision  # bytes per parameter of gradients and weights (fp32 here)
    for kind, size, n in traffic.collectives:
        gathered = str(kind).lower().replace("-", "_") == "all_gather"
        per = prec.weight_bytes if gathered else prec.grad_bytes
        want[_normalise(str(kind))] += round(size / per)
    got: Counter = Counter()
    for r in _step_records(result, "dp"):
        got[r.kind] += r.numel
    assert got == want, (
        f"DP collective volume (elements by kind): runtime {dict(got)}, plan {dict(want)}"
    )
