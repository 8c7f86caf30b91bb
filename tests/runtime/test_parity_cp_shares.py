"""Parity of asymmetric context parallelism (HexiSeq: uneven token and head shares per cp
rank, `Parallel.cp_shares` / `cp_head_shares`) with one process.

One local launch per world size (`run_local`) runs several plans in turn, each with shares
that differ from rank to rank by up to 5x: "allgather" with uneven token shares (its
all-gather padded to the largest share), and "heads" with uneven token shares and uneven
head shares (all-to-alls of uneven splits), under dp, tp (sequence parallel), micro-batches
and full recomputation. For each plan the losses of 3 SGD steps equal the single-process
run on every rank, and rank 0's gathered parameters after each step (so the gradients) equal
the single process's within fp32 tolerance: that holds only if each rank's loss is weighted
by its share of the tokens (`runtime.apply.cp_token_weight`) and the causal mask follows the
uneven zig-zag. Each launch also checks `ContextParallel.attention` alone against SDPA on
the whole sequence, output and q/k/v gradients, over shares, modes, head counts (K/V heads
repeated where the head shares need it) and masks (`_attention_checks`). The cp group's
collectives are counted and compared with what the cost model prices
(`_check_cp_collectives`). Refusals need no processes.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import meshplan
import pytest
import torch
from meshplan.cost_model.pricer import pricer_for
from meshplan.ir import Parallel
from meshplan.ir.rules import cp_split_problem, kv_expansion
from meshplan.runtime import ContextParallel, run_local
from meshplan.runtime.context_parallel import sequence_positions
from meshplan.runtime.errors import RuntimePlanError

from tests.runtime.harness import (
    CFG,
    assert_parity,
    build_model,
    check_step_collectives,
    graph,
    group_names,
    loss_fn,
    reference,
    sgd,
    train,
)
from tests.runtime.test_parity_group_tp import cpu_groups

# name -> (plan fields, model overrides); the tiny model has 4 query and 2 K/V heads, 8 tokens
CONFIGS_2 = {
    # 6 + 2 tokens, K/V all-gathered (padded to 6 per rank)
    "cp2-shares": (dict(cp=2, micro_batch=2, global_batch=4, cp_shares=(6, 2)), {}),
    # 2 + 6 tokens, heads 3 + 1: each K/V head repeated twice (3 is not a multiple of 2)
    "cp2-heads-shares": (
        dict(
            cp=2,
            micro_batch=1,
            global_batch=2,
            cp_mode="heads",
            cp_shares=(2, 6),
            cp_head_shares=(3, 1),
        ),
        {},
    ),
    # a cp group spanning two device groups (one rank each): 6 tokens on "fast", 2 on "slow"
    "cp2-span": (
        dict(cp=2, micro_batch=2, global_batch=4, cp_shares=(6, 2)),
        {},
        {"fast": 1, "slow": 1},
    ),
}
CONFIGS_4 = {
    # dp 2 x cp 2 with 2 + 6 tokens, forward run again in backward (cp 4 with uneven shares
    # needs more than the harness's 8 tokens: `_attention_checks` covers it, 10 + 2 + 8 + 4)
    "cpxdp-shares-recompute": (
        dict(dp=2, cp=2, micro_batch=2, global_batch=4, recompute="full", cp_shares=(2, 6)),
        {},
    ),
    # dp 2 x cp 2, heads with token shares only (equal heads)
    "cpxdp-heads-shares": (
        dict(dp=2, cp=2, micro_batch=1, global_batch=4, cp_mode="heads", cp_shares=(6, 2)),
        {},
    ),
    # tp 2 (sequence parallel inside each cp share) x cp 2 with 2 + 6 tokens
    "cpxtp-shares": (dict(cp=2, tp=2, micro_batch=2, global_batch=4, cp_shares=(2, 6)), {}),
    # tp 2 x cp 2, the cp group spanning two groups of 2 ranks, heads 3 + 1 under "heads"
    "cpxtp-span-heads": (
        dict(
            cp=2,
            tp=2,
            micro_batch=1,
            global_batch=2,
            cp_mode="heads",
            cp_shares=(6, 2),
            cp_head_shares=(1, 1),
        ),
        {},
        {"fast": 2, "slow": 2},
    ),
}


# A pipeline of 3 stages, each stage's cp group spanning both groups alike (cp rank 0 on
# "fast", 1 on "slow" in every stage: the hand-offs stay inside each group), 6 + 2 tokens.
CONFIGS_6 = {
    "pp3-cp2-span": (
        dict(pp=3, cp=2, micro_batch=1, global_batch=3, cp_shares=(6, 2)),
        {},
        {"fast": 3, "slow": 3},
    ),
    # 3 replicas of a cp group of 2 spanning both groups, experts over the 3 replicas (ep 3):
    # each ep group is the replicas' cp rank 0 (all on "fast") or cp rank 1 (all on "slow").
    # Capacity factor E / top_k drops no choice, so the shares route as one process does.
    "dp3-cp2-ep3-span": (
        dict(dp=3, cp=2, ep=3, micro_batch=1, global_batch=3, cp_shares=(6, 2)),
        dict(experts=6, top_k=2, capacity_factor=3.0),
        {"fast": 3, "slow": 3},
    ),
}


def _plan(world, fields, model_kw, groups=None):
    """The plan of `fields`; `groups`: on CPU device groups of these sizes, where the cp
    group spans them (`StagePlacement.cp_groups`)."""
    if groups:
        cluster = cpu_groups(groups)
    else:
        cluster = meshplan.Cluster.preset("cpu", gpus=world)
    plan = meshplan.estimate_plan(graph(**model_kw), cluster=cluster, parallel=Parallel(**fields))
    if groups:
        cp_groups = plan.stages[0].cp_groups
        # every stage spans alike; each replica takes its cp ranks from every group
        per_rank = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("dp", 1)
        assert cp_groups == tuple((g, n // per_rank) for g, n in groups.items())
        assert all(st.cp_groups == cp_groups for st in plan.stages)
        # cp rank r of the replica sits in the group cp_groups gives it
        for r in plan.ranks:
            assert r.group == ("fast" if r.coords[2] == 0 else "slow"), r
        assert meshplan.Plan.from_json(plan.to_json()).stages[0].cp_groups == cp_groups
    assert plan.parallel.cp_shares == fields["cp_shares"]
    again = meshplan.Plan.from_json(plan.to_json()).parallel  # kept in the plan JSON
    assert (again.cp_shares, again.cp_head_shares) == (
        fields["cp_shares"],
        fields.get("cp_head_shares"),
    )
    return plan


def _run(plan, model_kw):
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
    plans = {name: _plan(world, *spec) for name, spec in configs.items()}
    refs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_parity_cp_heads.py: tiny ops on a shared 2-core host
    try:
        for name, plan in plans.items():
            p = plan.parallel
            refs[name] = reference(p.global_batch, p.dp * p.num_microbatches, **configs[name][1])
    finally:
        torch.set_num_threads(threads)
    results = run_local(_all, world, plans, configs, timeout_s=180)
    for name, plan in plans.items():
        assert_parity(name, refs[name], [r[name] for r in results])
        _check_cp_collectives(plan, results, name, configs[name][1])
        for rank, r in enumerate(results):
            # tp collectives at this rank's own share; the cp group's counted exactly (with
            # dp 1 the gradient group is the cp group: compared together)
            cp_rank = r[name]["coords"][2]
            check_step_collectives(
                f"{name} rank {rank}",
                plan,
                graph(**configs[name][1]),
                r[name],
                extra={"cp": _cp_want(plan, cp_rank, configs[name][1], r[name]["coords"][0])},
            )
    return results


def test_cp_shares_parity_two_ranks():
    results = _check_all(2, CONFIGS_2)
    assert len(results[0]["attention"]) == 48


def test_cp_shares_parity_four_ranks():
    results = _check_all(4, CONFIGS_4)
    assert len(results[0]["attention"]) == 48


def test_cp_spanning_groups_in_a_pipeline_and_with_experts_six_ranks():
    results = _check_all(6, CONFIGS_6)
    # cp rank 0 of every stage on "fast", cp rank 1 on "slow"
    coords = sorted(r["pp3-cp2-span"]["coords"] for r in results)
    assert coords == [(s, 0, c, 0) for s in range(3) for c in range(2)]
    # each ep group is the 3 replicas' ranks at one cp index
    ep_groups = {r["dp3-cp2-ep3-span"]["groups"]["ep"] for r in results}
    assert len(ep_groups) == 2 and all(len(g.split(",")) == 3 for g in ep_groups)


# -- collectives --------------------------------------------------------------------------------


def _cp_want(plan, cp_rank, model_kw, pp_rank: int = 0) -> Counter:
    """(kind, elements) -> calls of the cp group's collectives in one step of cp rank
    `cp_rank`, counted by hand from the shares.

    "allgather": per attention layer and forward (twice under full recomputation) one
    all-gather of K and V padded to the largest share, (largest, micro_batch, 2 kv, d) from
    each rank, and one reduce-scatter of the same in backward. "heads": per layer the four
    all-to-alls of each direction, of uneven splits; recorded is what a rank puts in: to
    heads, all its tokens of every head; back, its heads of every token."""
    p = plan.parallel
    cfg = {**CFG, **model_kw}
    d = cfg["hidden"] // cfg["heads"]
    h, kv = cfg["heads"] // p.tp, cfg["kv_heads"] // p.tp
    st = plan.stages[pp_rank]  # the layers of this rank's pipeline stage
    layers = sum(not u.startswith("<") for u in plan.model.units[st.first_unit : st.last_unit])
    b, n = p.micro_batch, layers * p.num_microbatches
    forwards = 2 if p.recompute == "full" else 1
    want = Counter()
    if (p.cp_mode or "allgather") == "allgather":
        gathered = p.cp * max(p.cp_shares) * b * 2 * kv * d
        want[("all_gather", gathered)] += forwards * n
        want[("reduce_scatter", gathered)] += n
        return want
    heads = p.cp_head_shares or (h // p.cp,) * p.cp
    per = h // (kv * kv_expansion(h, kv, heads))  # query heads per K/V copy
    kv_split = tuple(x // per for x in heads)
    mine, seq = p.cp_shares[cp_rank], sum(p.cp_shares)
    q_in, kv_in = mine * b * sum(heads) * d, mine * b * sum(kv_split) * d
    q_back, kv_back = heads[cp_rank] * b * seq * d, kv_split[cp_rank] * b * seq * d
    for size, calls in (
        (q_in, forwards + 1),  # q in each forward; the output's gradient in backward
        (kv_in, 2 * forwards),  # k, v in each forward
        (q_back, forwards + 1),  # the output back; q's gradient back in backward
        (kv_back, 2),  # k's and v's gradients back in backward
    ):
        want[("all_to_all", size)] += calls * n
    return want


def _check_cp_collectives(plan, results, name, model_kw):
    """Each rank's cp group runs `_cp_want` and nothing else (no send/recv), and under
    "allgather" the cost model prices one layer's all-gather at the padded bytes the runtime
    moves (`Pricer.cp_collectives`)."""
    p = plan.parallel
    kinds = {"all_to_all", "all_gather", "reduce_scatter", "send", "recv"}
    for rank, r in enumerate(results):
        want = _cp_want(plan, r[name]["coords"][2], model_kw, r[name]["coords"][0])
        group = r[name]["groups"]["cp"]
        got = Counter(
            (c.kind, c.numel) for c in r[name]["records"] if c.group == group and c.kind in kinds
        )
        if group == r[name]["groups"]["grad"]:  # dp 1: the gradient all-reduce shares it
            got = Counter({k: v for k, v in got.items() if k[0] != "all_reduce"})
        assert got == want, f"{name}: rank {rank} cp collectives {dict(got)}, want {dict(want)}"
    if (p.cp_mode or "allgather") == "allgather":
        cfg = {**CFG, **model_kw}
        kv, d = cfg["kv_heads"] // p.tp, cfg["hidden"] // cfg["heads"]
        pricer = pricer_for(graph(**model_kw), plan.cluster, "float32")
        layer = next(k for k in pricer.costs.unit_keys if pricer.costs.facts[k].kind == "layer")
        scale = p.micro_batch / pricer.costs.traced_micro_batch
        moved = pricer.cp_collectives(pricer.costs.facts[layer], p.stage(), scale)
        gathered = p.cp * max(p.cp_shares) * p.micro_batch * 2 * kv * d * 4  # fp32 bytes
        assert sorted((ph, k.value, s) for ph, k, s in moved) == [
            ("bwd", "reduce_scatter", float(gathered)),
            ("fwd", "all_gather", float(gathered)),
        ], f"{name}: priced {moved}"


# -- ContextParallel.attention alone (inside each launch) --------------------------------------


def _attention_checks():
    """`ContextParallel.attention` with uneven shares against SDPA on the whole sequence:
    output and q/k/v gradients, causal or not, "allgather" and "heads" (equal and uneven
    head shares), (query, K/V) heads from full multi-head to multi-query. Returns the cases."""
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, size, cases = dist.get_rank(), dist.get_world_size(), []
    if size not in (2, 4):  # the 6-rank launch runs a pipeline: its cp groups are of 2
        return []
    token_shares = {2: [(6, 2), (2, 10)], 4: [(10, 2, 8, 4), (6, 6, 6, 6)]}[size]
    head_shares = {2: [(3, 1), (1, 7)], 4: [(4, 1, 2, 1), (2, 2, 2, 2)]}[size]
    for shares in token_shares:
        seq = sum(shares)
        for mode, splits in (("allgather", [None]), ("heads", [None, *head_shares])):
            for hs in splits:
                heads = sum(hs) if hs else 2 * size
                for kv_heads in sorted({heads, heads // 2, 1}, reverse=True):
                    for causal in (True, False):
                        cp = ContextParallel(dist.group.WORLD, rank, size, mode, shares, hs)
                        g = torch.Generator().manual_seed(seq * 10 + heads + kv_heads)
                        q, k, v = (
                            torch.randn(2, n, seq, 8, generator=g)
                            for n in (heads, kv_heads, kv_heads)
                        )
                        w = torch.randn(2, heads, seq, 8, generator=g)
                        full = [t.clone().requires_grad_() for t in (q, k, v)]
                        ref = F.scaled_dot_product_attention(
                            *full, is_causal=causal, scale=0.3, enable_gqa=True
                        )
                        (ref * w).sum().backward()
                        pos = cp.positions(shares[rank])
                        mine = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
                        got = cp.attention(*mine, is_causal=causal, scale=0.3, enable_gqa=True)
                        (got * cp.shard(w, dim=2)).sum().backward()
                        case = f"{mode} {shares} heads {hs} ({heads}/{kv_heads}) causal={causal}"
                        torch.testing.assert_close(
                            got,
                            ref.detach().index_select(2, pos),
                            msg=lambda m, c=case: f"{c}: {m}",
                        )
                        for x, a, b in zip("qkv", mine, full):
                            torch.testing.assert_close(
                                a.grad,
                                b.grad.index_select(2, pos),
                                msg=lambda m, c=case, x=x: f"{c}: d{x}: {m}",
                            )
                        cases.append(case)
    return cases


# -- layout and refusals (no processes) -------------------------------------------------------


def test_uneven_zigzag_positions_and_balance():
    """Every position held once; each rank's front and mirrored back chunk; its causal work
    (keys its queries see, summed) is share/2 x (S + 1): in proportion to its tokens."""
    shares, seq = (10, 2, 8, 4), 24
    held = [sequence_positions(seq, 4, r, shares) for r in range(4)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    assert held[1].tolist() == [5, 18]  # x = 1 after the first rank's 5
    for share, pos in zip(shares, held):
        assert len(pos) == share
        assert int((pos + 1).sum()) == share // 2 * (seq + 1)
    # equal shares are the equal zig-zag
    for r in range(4):
        assert torch.equal(sequence_positions(24, 4, r, (6, 6, 6, 6)), sequence_positions(24, 4, r))


def _p(**kw):
    return Parallel(cp=2, **kw)


@pytest.mark.parametrize(
    "parallel, seq, heads, words",
    [
        (_p(cp_shares=(6, 2, 2)), 10, 4, "cp_shares has 3 entries but cp=2"),
        (_p(cp_shares=(5, 3)), 8, 4, "each share must be an even number of tokens"),
        (_p(cp_shares=(6, 4)), 8, 4, "sum to 10 tokens, not the sequence length (8)"),
        (_p(cp_shares=(6, 2), cp_mode="ring"), 8, 4, "cp attention 'ring' is not run"),
        (_p(cp_head_shares=(3, 1)), 8, 4, "need cp attention 'heads'"),
        (_p(cp_head_shares=(3, 2), cp_mode="heads"), 8, 4, "sum to 5, not the 4 query heads"),
        (Parallel(cp=1, cp_shares=(8,)), 8, 4, "need cp > 1"),
    ],
)
def test_cp_split_refused_in_one_line(parallel, seq, heads, words):
    why = cp_split_problem(parallel, seq, heads)
    assert why is not None and words in why and "\n" not in why


def test_estimate_and_plan_file_refuse_bad_shares():
    """`estimate` refuses shares that do not sum to the sequence; a plan file edited to
    such shares is refused when read (`plan_problem`), before any rank starts."""
    cluster = meshplan.Cluster.preset("cpu", gpus=2)
    with pytest.raises(ValueError, match="not the sequence length"):
        meshplan.estimate_plan(graph(), cluster=cluster, parallel=Parallel(cp=2, cp_shares=(6, 4)))
    plan = meshplan.estimate_plan(
        graph(), cluster=cluster, parallel=Parallel(cp=2, cp_shares=(6, 2))
    )
    bad = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, cp_shares=(4, 2)))
    with pytest.raises(meshplan.PlanError, match="cp_shares"):
        meshplan.Plan.from_json(bad.to_json())


def test_ring_refused_with_shares_at_runtime():
    with pytest.raises(RuntimePlanError, match="ring attention over uneven cp shares"):
        ContextParallel(None, 0, 2, "ring", (6, 2))


def test_uneven_all_to_all_priced_at_the_busiest_rank():
    """`Pricer.cp_collectives` under "heads" with uneven shares, against the bytes each rank
    of the runtime's all-to-alls sends to and receives from the others, derived by hand:
    rank r sends s_r x h_j x b x d elements to each other rank j and receives s_j x h_r x b x
    d from it. Each priced buffer, less the rank's own part ((cp-1)/cp of it), is what the
    busiest rank moves. 6 + 2 tokens, 1 + 3 query heads of 4, K/V heads 2: each K/V head
    repeated twice (`kv_expansion`), so K and V split as the query heads do."""
    fields = dict(cp=2, micro_batch=2, global_batch=4, cp_mode="heads")
    plan = _plan(2, {**fields, "cp_shares": (6, 2), "cp_head_shares": (1, 3)}, {})
    p = plan.parallel
    pricer = pricer_for(graph(), plan.cluster, "float32")
    layer = next(k for k in pricer.costs.unit_keys if pricer.costs.facts[k].kind == "layer")
    scale = p.micro_batch / pricer.costs.traced_micro_batch
    moved = pricer.cp_collectives(pricer.costs.facts[layer], p.stage(), scale)
    d, b = CFG["hidden"] // CFG["heads"], p.micro_batch
    tokens, heads = p.cp_shares, p.cp_head_shares
    busiest = max(
        max(
            sum(tokens[r] * heads[j] for j in range(2) if j != r),  # sent
            sum(tokens[j] * heads[r] for j in range(2) if j != r),  # received
        )
        for r in range(2)
    )
    elements = busiest * b * d
    assert kv_expansion(4, 2, heads) == 2  # K/V at 4 copies: the same split as q
    want = [("bwd", "all_to_all", 2.0 * elements * 4)] * 4 + [
        ("fwd", "all_to_all", 2.0 * elements * 4)
    ] * 4
    # (cp - 1) / cp = 1/2 of each priced buffer is what the busiest rank moves (fp32 bytes)
    assert sorted((ph, k.value, s) for ph, k, s in moved) == sorted(want)
