"""Parity of head-parallel context parallelism (cp attention "heads", DeepSpeed-Ulysses) with
one process, and its all-to-alls counted.

One local launch per world size (`run_local`: torch imported once, ranks forked) runs several
plans in turn, each made with `cp_mode="heads"`, which `apply` reads off the plan (and the
plan JSON keeps). For each plan: the losses of 3 SGD steps equal the single-process run on
every rank, and rank 0's gathered parameters after each step (so the gradients, recovered from
the SGD update) equal the single process's within fp32 tolerance. The plans cover both ways
grouped-query K/V heads are sharded: cp divides the K/V heads (cp=2 over the tiny model's 2)
or not (cp=4 over 2, cp=2 over 1 under MQA, cp=2 over the 1 a rank holds under tp=2), so they
are repeated first.

Every rank's cp group runs exactly 4 all-to-alls per attention and forward (q, k, v in, the
output back) and 4 in backward, of the local tensors' sizes, and no other K/V collective
(`_check_cp_collectives`); its tp, gradient and world collectives are the cost model's
(`harness.check_step_collectives`). Each launch also checks `ContextParallel.attention`
alone against SDPA on the whole sequence, causal or not, zig-zag and contiguous splits,
with several head counts (`_attention_checks`). The refusal of query heads that cp does not
divide needs no processes.
"""

from __future__ import annotations

import math
from collections import Counter

import meshplan
import pytest
import torch
from meshplan.cost_model.pricer import pricer_for
from meshplan.ir.rules import cp_heads_problem
from meshplan.runtime import ContextParallel, run_local
from meshplan.runtime.context_parallel import MODES
from meshplan.runtime.errors import RuntimePlanError

from tests.runtime.harness import (
    CFG,
    SEQ,
    assert_parity,
    attention_checks,
    build_model,
    check_step_collectives,
    graph,
    group_names,
    loss_fn,
    reference,
    sgd,
    train,
)

# name -> (plan fields, model overrides); the tiny model has 4 query and 2 K/V heads
CONFIGS_2 = {
    "cp2-heads": (dict(cp=2, micro_batch=2, global_batch=4), {}),
    # multi-query: 1 K/V head, repeated to 2 before the all-to-all; 2 micro-batches
    "cp2-heads-mqa": (dict(cp=2, micro_batch=1, global_batch=2), dict(kv_heads=1)),
}
CONFIGS_4 = {
    # 2 K/V heads over 4 ranks: each repeated twice; forward run again in backward
    "cp4-heads-recompute": (dict(cp=4, micro_batch=2, global_batch=2, recompute="full"), {}),
    # tp=2 leaves a rank 2 query heads and 1 K/V head, sharded over cp=2
    "cpxtp-heads": (dict(cp=2, tp=2, micro_batch=2, global_batch=4), {}),
    "cpxdp-heads": (dict(dp=2, cp=2, micro_batch=1, global_batch=4), {}),
}


def _graph(model_kw):
    """The traced graph of the tiny model with `model_kw` (plans are made from it)."""
    return graph(**model_kw)


def _plan(world, fields, model_kw):
    cluster = meshplan.Cluster.preset("cpu", gpus=world)
    parallel = meshplan.Parallel(**fields, cp_mode="heads")
    plan = meshplan.estimate_plan(_graph(model_kw), cluster=cluster, parallel=parallel)
    assert plan.parallel.cp_mode == "heads"
    assert meshplan.Plan.from_json(plan.to_json()).parallel.cp_mode == "heads"  # kept in JSON
    return plan


def _run(plan, model_kw):
    """Inside a rank: apply (the plan's "heads" attention), train; losses, snapshots, one
    step's collectives, the groups."""
    from meshplan.runtime import apply

    runner = apply(build_model(**model_kw), plan, loss_fn, sgd)
    losses, states, records = train(runner, plan.parallel.global_batch)
    return {
        "losses": losses,
        "states": states,
        "records": records,
        "groups": group_names(runner),
        "coords": runner.ctx.coords,
    }


def _all(plans, configs):
    out = {name: _run(plan, configs[name][1]) for name, plan in plans.items()}
    out["attention"] = _attention_checks()
    return out


def _check_all(world, configs):
    plans = {name: _plan(world, f, m) for name, (f, m) in configs.items()}
    # References first, on one intra-op thread (as test_parity_cp_ep.py: two threads of
    # these tiny ops wait on each other on a shared 2-core machine).
    refs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, plan in plans.items():
            p = plan.parallel
            refs[name] = reference(p.global_batch, p.dp * p.num_microbatches, **configs[name][1])
    finally:
        torch.set_num_threads(threads)
    results = run_local(_all, world, plans, configs, timeout_s=120)
    for name, plan in plans.items():
        assert_parity(name, refs[name], [r[name] for r in results])
        _check_cp_collectives(plan, results, name, configs[name][1])
        for rank, r in enumerate(results):
            check_step_collectives(
                f"{name} rank {rank}",
                plan,
                _graph(configs[name][1]),
                r[name],
                ignore_kinds=frozenset({"send", "recv", "all_to_all"}),
            )
    return results


def test_cp_heads_parity_two_ranks():
    results = _check_all(2, CONFIGS_2)
    assert len(results[0]["attention"]) == 20


def test_cp_heads_parity_four_ranks():
    results = _check_all(4, CONFIGS_4)
    assert len(results[0]["attention"]) == 20


# -- collectives --------------------------------------------------------------------------------


def _check_cp_collectives(plan, results, name, model_kw):
    """Per attention layer and micro-batch, each rank's cp group runs one all-to-all of its
    local q, k, v and output in every forward (twice under full recomputation) and one of
    their gradients in backward: q and the output are (micro_batch, h, S/cp, d) with h the
    query heads a rank holds (/tp), k and v (micro_batch, kv', S/cp, d) with kv' its K/V heads
    (/tp) repeated cp/gcd(kv, cp) times. Nothing else moves K/V (no all-gather,
    reduce-scatter or send/recv on the cp group)."""
    p = plan.parallel
    cfg = {**CFG, **model_kw}
    d = cfg["hidden"] // cfg["heads"]
    h, kv = cfg["heads"] // p.tp, (cfg.get("kv_heads") or cfg["heads"]) // p.tp
    kv_sent = kv * (p.cp // math.gcd(kv, p.cp))
    local = p.micro_batch * SEQ // p.cp * d
    forwards = 2 if p.recompute == "full" else 1
    calls = (forwards + 1) * 2 * cfg["layers"] * p.num_microbatches  # 2: q/out, k/v
    want = Counter()  # q and k/v may be of one size (counted together)
    for heads in (h, kv_sent):
        want[("all_to_all", heads * local)] += calls
    kinds = {"all_to_all", "all_gather", "reduce_scatter", "send", "recv"}
    for rank, r in enumerate(results):
        group = r[name]["groups"]["cp"]
        got = Counter(
            (c.kind, c.numel) for c in r[name]["records"] if c.group == group and c.kind in kinds
        )
        assert got == want, f"{name}: rank {rank} cp collectives {dict(got)}, want {dict(want)}"
    # The cost model prices the same four all-to-alls per direction and layer, of the same
    # bytes (fp32 here), per micro-batch.
    pricer = pricer_for(_graph(model_kw), plan.cluster, "float32")
    layer = next(k for k in pricer.costs.unit_keys if pricer.costs.facts[k].kind == "layer")
    scale = p.micro_batch / pricer.costs.traced_micro_batch
    moved = pricer.cp_collectives(pricer.costs.facts[layer], p.stage(), scale)
    priced = Counter((phase, kind.value, size) for phase, kind, size in moved)
    sizes = (h * local * 4, kv_sent * local * 4, kv_sent * local * 4, h * local * 4)
    assert priced == Counter(
        (phase, "all_to_all", float(s)) for phase in ("fwd", "bwd") for s in sizes
    ), f"{name}: priced {dict(priced)}"


# -- ContextParallel.attention alone (inside each launch) ----------------------------------------


def _attention_checks():
    """`ContextParallel.attention` in "heads" mode against SDPA on the whole sequence
    (`harness.attention_checks`): query/K/V heads (4, 4), (4, 2), (4, 1), (8, 2) and (12, 3):
    cp divides the K/V heads or not, and then they are repeated up to the query heads or
    fewer times (12, 3 over cp=2: 6 K/V heads). Returns the cases checked."""
    import torch.distributed as dist

    cp = ContextParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), "heads")
    return attention_checks(cp, ((4, 4), (4, 2), (4, 1), (8, 2), (12, 3)))


# -- refusals (no processes) ----------------------------------------------------------------------


def test_heads_is_a_mode_and_allgather_the_default():
    assert "heads" in MODES
    assert ContextParallel(None, 0, 2).mode == "allgather"
    assert ContextParallel(None, 0, 2, "heads").mode == "heads"
    with pytest.raises(RuntimePlanError, match="cp attention must be one of"):
        ContextParallel(None, 0, 2, "ulysses")


@pytest.mark.parametrize("heads, cp", [(4, 3), (2, 4), (6, 4)])
def test_heads_refused_when_cp_does_not_divide_them(heads, cp):
    """Refused in one line naming both, before any collective (the group here is None)."""
    assert cp_heads_problem(heads, cp) is not None
    handle = ContextParallel(None, 0, cp, "heads")
    q = torch.randn(1, heads, 2, 8)
    kv = torch.randn(1, 1, 2, 8)
    with pytest.raises(RuntimePlanError, match=rf"heads={heads}, cp={cp}\b") as err:
        handle.attention(q, kv, kv, is_causal=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("heads, cp", [(4, 2), (4, 4), (8, 4), (6, 2)])
def test_heads_accepted_when_cp_divides_them(heads, cp):
    assert cp_heads_problem(heads, cp) is None
