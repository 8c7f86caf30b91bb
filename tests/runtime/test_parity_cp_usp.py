"""Parity of the two-level context attention "usp" (USP / LoongTrain: heads over
`cp_head_degree` ranks, K/V all-gathered over the rest) with one process, and its collectives
counted against the cost model.

The tiny model here has 6 query heads, which cp = 4 does not divide: "heads" is refused for it
(`cp_heads_problem`), and "usp" runs it with u = gcd(6, 4) = 2 head-parallel ranks and r = 2
K/V groups. One local launch on 4 ranks runs three plans made with `cp_mode="usp"` (GQA with
2 K/V heads, which u divides; 3 K/V heads, repeated to 6 first; multi-query under full
recomputation). For each: the losses of 3 SGD steps equal the single-process run on every
rank and rank 0's gathered parameters after each step equal the single process's
(`assert_parity`); each rank's head group runs exactly 4 all-to-alls per attention and
direction of its local q, k, v and output, its K/V group one all-gather in forward and one
reduce-scatter in backward of K/V of its heads over the whole sequence, and nothing else
moves K/V; the cost model prices the same collectives of the same bytes
(`Pricer.cp_collectives`). The launch also checks `ContextParallel.attention` alone against
SDPA on the whole sequence (outputs and q/k/v gradients; causal or not; zig-zag and
contiguous splits; several query and K/V head counts).
"""

from __future__ import annotations

import math
from collections import Counter

import meshplan
import pytest
import torch
from meshplan.cost_model.pricer import pricer_for
from meshplan.ir import Parallel
from meshplan.ir.rules import cp_heads_problem, cp_usp_problem, usp_degree
from meshplan.runtime import ContextParallel, run_local
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
    rank_key,
    reference,
    sgd,
    train,
)

SIX = dict(hidden=48, heads=6)  # head_dim 8, as the harness model's
CONFIGS = {
    "cp4-usp": (dict(cp=4, micro_batch=2, global_batch=2), dict(SIX, kv_heads=2)),
    # 3 K/V heads: u = 2 does not divide them, each is repeated twice before the all-to-all
    "cp4-usp-kv3": (dict(cp=4, micro_batch=1, global_batch=2), dict(SIX, kv_heads=3)),
    # one K/V head, forward run again in backward
    "cp4-usp-mqa-recompute": (
        dict(cp=4, micro_batch=1, global_batch=2, recompute="full"),
        dict(SIX, kv_heads=1),
    ),
}


def _plan(fields, model_kw):
    cluster = meshplan.Cluster.preset("cpu", gpus=4)
    parallel = meshplan.Parallel(**fields, cp_mode="usp")
    plan = meshplan.estimate_plan(graph(**model_kw), cluster=cluster, parallel=parallel)
    p = plan.parallel
    assert (p.cp_mode, p.cp_head_degree) == ("usp", 2)  # completed: gcd(6, 4)
    kept = meshplan.Plan.from_json(plan.to_json()).parallel
    assert (kept.cp_mode, kept.cp_head_degree) == ("usp", 2)  # kept in the JSON
    return plan


def _run(plan, model_kw):
    from meshplan.runtime import apply

    runner = apply(build_model(**model_kw), plan, loss_fn, sgd)
    losses, states, records = train(runner, plan.parallel.global_batch)
    groups = group_names(runner)
    groups["heads"] = rank_key(runner.cp.usp.heads_group)
    groups["kv"] = rank_key(runner.cp.usp.ring_group)
    return {
        "losses": losses,
        "states": states,
        "records": records,
        "groups": groups,
        "coords": runner.ctx.coords,
    }


def _all(plans):
    out = {name: _run(plan, CONFIGS[name][1]) for name, plan in plans.items()}
    out["attention"] = _attention_checks()
    return out


def test_cp_usp_parity_four_ranks():
    plans = {name: _plan(f, m) for name, (f, m) in CONFIGS.items()}
    refs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_parity_cp_heads.py
    try:
        for name, plan in plans.items():
            p = plan.parallel
            refs[name] = reference(p.global_batch, p.dp * p.num_microbatches, **CONFIGS[name][1])
    finally:
        torch.set_num_threads(threads)
    results = run_local(_all, 4, plans, timeout_s=120)
    for name, plan in plans.items():
        assert_parity(name, refs[name], [r[name] for r in results])
        _check_usp_collectives(plan, results, name, CONFIGS[name][1])
        for rank, r in enumerate(results):
            check_step_collectives(
                f"{name} rank {rank}",
                plan,
                graph(**CONFIGS[name][1]),
                r[name],
                ignore_kinds=frozenset({"send", "recv", "all_to_all"}),
            )
    # head groups {0, 1}, {2, 3}; K/V groups {0, 2}, {1, 3} (cp rank c = j * u + i)
    groups = [r["cp4-usp"]["groups"] for r in results]
    assert [g["heads"] for g in groups] == ["0,1", "0,1", "2,3", "2,3"]
    assert [g["kv"] for g in groups] == ["0,2", "1,3", "0,2", "1,3"]
    assert len(results[0]["attention"]) == 24


def _check_usp_collectives(plan, results, name, model_kw):
    """Per attention layer and micro-batch (forwards: 2 under full recomputation), the head
    group moves q and the output, (micro_batch, 6, S/4, d), and k and v, (micro_batch, kv',
    S/4, d) with kv' the K/V heads repeated 2 / gcd(kv, 2) times, by one all-to-all each per
    direction; the K/V group all-gathers (and in backward reduce-scatters) K and V of kv'/2
    heads over all S tokens: (S, micro_batch, 2 kv'/2, d). Nothing else on either group."""
    p = plan.parallel
    cfg = {**CFG, **model_kw}
    d = cfg["hidden"] // cfg["heads"]
    h, kv = cfg["heads"], cfg["kv_heads"]
    u = p.cp_head_degree
    kv_sent = kv * (u // math.gcd(kv, u))
    local = p.micro_batch * SEQ // p.cp * d
    forwards = 2 if p.recompute == "full" else 1
    per_layer = cfg["layers"] * p.num_microbatches
    a2a = Counter()
    for heads in (h, kv_sent):
        a2a[("all_to_all", heads * local)] += (forwards + 1) * 2 * per_layer
    gathered = SEQ * p.micro_batch * kv_sent // u * 2 * d
    kv_want = Counter(
        {("all_gather", gathered): forwards * per_layer, ("reduce_scatter", gathered): per_layer}
    )
    kinds = {"all_to_all", "all_gather", "reduce_scatter", "send", "recv"}
    for rank, r in enumerate(results):
        res = r[name]
        for group, want in ((res["groups"]["heads"], a2a), (res["groups"]["kv"], kv_want)):
            got = Counter(
                (c.kind, c.numel) for c in res["records"] if c.group == group and c.kind in kinds
            )
            assert got == want, f"{name}: rank {rank} group {group} {dict(got)}, want {dict(want)}"
        cp_group = res["groups"]["cp"]
        assert not [c for c in res["records"] if c.group == cp_group and c.kind in kinds]
    pricer = pricer_for(graph(**model_kw), plan.cluster, "float32")
    layer = next(k for k in pricer.costs.unit_keys if pricer.costs.facts[k].kind == "layer")
    scale = p.micro_batch / pricer.costs.traced_micro_batch
    moved = pricer.cp_collectives(pricer.costs.facts[layer], p.stage(), scale)
    priced = Counter((phase, kind.value, size) for phase, kind, size in moved)
    want = Counter()
    for phase, kv_kind in (("fwd", "all_gather"), ("bwd", "reduce_scatter")):
        for heads in (h, kv_sent, kv_sent, h):
            want[(phase, "all_to_all", float(heads * local * 4))] += 1
        want[(phase, kv_kind, float(gathered * 4))] += 1
    assert priced == want, f"{name}: priced {dict(priced)}, want {dict(want)}"


# -- ContextParallel.attention alone (inside the launch) -----------------------------------------


def _attention_checks():
    """ "usp" attention (u = 2 over 4 ranks) against SDPA on the whole sequence
    (`harness.attention_checks`), query/K/V heads (6, 6), (6, 3), (6, 2), (6, 1), (2, 2) and
    (10, 5)."""
    import torch.distributed as dist
    from meshplan.runtime.mesh import UspGroups

    rank, size, u = dist.get_rank(), dist.get_world_size(), 2
    heads_groups = [dist.new_group([j * u + i for i in range(u)]) for j in range(size // u)]
    kv_groups = [dist.new_group(list(range(i, size, u))) for i in range(u)]
    usp = UspGroups(heads_group=heads_groups[rank // u], ring_group=kv_groups[rank % u])
    cp = ContextParallel(dist.group.WORLD, rank, size, "usp", head_degree=u, usp=usp)
    return attention_checks(cp, ((6, 6), (6, 3), (6, 2), (6, 1), (2, 2), (10, 5)))


# -- the rule, the planner's choice and refusals (no processes) ------------------------------------


@pytest.mark.parametrize(
    "heads, cp, degree", [(6, 4, 2), (12, 8, 4), (6, 8, 2), (10, 4, 2), (24, 16, 8)]
)
def test_usp_degree_is_the_largest_that_divides_both(heads, cp, degree):
    """Checked against every divisor: the largest u dividing cp and the heads, which
    `cp_usp_problem` accepts, while "heads" is refused (cp does not divide the heads)."""
    best = max(u for u in range(1, cp + 1) if cp % u == 0 and heads % u == 0)
    assert usp_degree(heads, cp) == best == degree
    assert cp_usp_problem(heads, cp, degree) is None
    assert cp_heads_problem(heads, cp) is not None


@pytest.mark.parametrize(
    "heads, cp, degree, words",
    [
        (6, 4, 4, "strictly between 1 and cp"),
        (6, 4, 1, "strictly between 1 and cp"),
        (6, 8, 3, "must divide cp=8"),
        (6, 8, 4, "query heads divisible by cp_head_degree, got heads=6, cp_head_degree=4"),
        (6, 4, None, "needs cp_head_degree"),
    ],
)
def test_usp_refusals_name_the_fix(heads, cp, degree, words):
    why = cp_usp_problem(heads, cp, degree)
    assert why is not None and words in why and "\n" not in why


def test_usp_refused_by_the_runtime_before_any_collective():
    """A degree the heads do not allow is refused at the first attention (group None)."""
    cp = ContextParallel(None, 0, 4, "usp", head_degree=4)
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(RuntimePlanError, match="strictly between 1 and cp"):
        cp.attention(q, q, q, is_causal=True)
    with pytest.raises(RuntimePlanError, match="uneven cp shares"):
        ContextParallel(None, 0, 4, "usp", shares=(4, 4, 4, 4), head_degree=2)


def test_estimate_refuses_a_degree_the_heads_do_not_allow():
    cluster = meshplan.Cluster.preset("cpu", gpus=4)
    bad = Parallel(cp=4, micro_batch=1, global_batch=2, cp_mode="usp", cp_head_degree=4)
    with pytest.raises(ValueError, match="strictly between 1 and cp"):
        meshplan.estimate_plan(graph(**SIX, kv_heads=2), cluster=cluster, parallel=bad)
    stray = Parallel(cp=4, micro_batch=1, global_batch=2, cp_mode="allgather", cp_head_degree=2)
    with pytest.raises(ValueError, match="cp_head_degree needs cp attention 'usp'"):
        meshplan.estimate_plan(graph(**SIX, kv_heads=2), cluster=cluster, parallel=stray)
