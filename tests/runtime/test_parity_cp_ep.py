"""Parity of context parallelism (CP) and expert parallelism (EP) with one process, and their
collectives against the cost model.

One local launch per world size (`run_local`: torch imported once, ranks forked) runs several
plans in turn. For each plan: the losses of 3 SGD steps equal the single-process run on every
rank, and rank 0's gathered parameters after each step (so the gradients, recovered from the
SGD update) equal the single process's within fp32 tolerance.

The single process runs each data-parallel replica's micro-batch in turn (`dp *
num_microbatches` chunks of the global batch): for dense models that is the same loss, and for
the MoE it gives every chunk the capacity a replica computes for its own tokens, so choices
beyond an expert's capacity are dropped exactly as under DP/EP (the EP configs use
capacity_factor 1, which drops). Under CP an MoE sees a share of each sequence and so a
different capacity: the CPxEP config uses capacity_factor 2 (E/top_k), which never drops.

Each plan's collectives of one step are compared with the cost model (kinds, counts and
sizes where it prices them; see the `_check_*` docstrings). The 2-rank launch also checks
`ContextParallel.attention` alone against SDPA (both variants, causal or not, zig-zag and
contiguous splits) and an MoE routing that gives one rank no tokens (zero splits).
"""

from __future__ import annotations

import time
from collections import Counter

import meshplan
import pytest
import torch
from meshplan.runtime import run_local

from tests.runtime.harness import (
    CFG,
    SEQ,
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

MOE = dict(experts=4, top_k=2)  # capacity_factor 1: some choices are dropped
MOE_NO_DROP = dict(experts=4, top_k=2, capacity_factor=2.0)
FP32 = 4

# name -> (plan fields, apply() keywords, model overrides)
CONFIGS_2 = {
    "cp-allgather": (dict(cp=2, micro_batch=2, global_batch=4), {}, {}),
    "cp-ring-2mb": (
        dict(cp=2, micro_batch=1, global_batch=2),
        {"cp_attention": "ring"},
        {},
    ),
    "ep-tokens": (dict(dp=2, ep=2, micro_batch=2, global_batch=8), {}, MOE),
    "ep-slots": (dict(dp=2, ep=2, micro_batch=2, global_batch=8), {"ep_dispatch": "slots"}, MOE),
    # FSDP2 shards the dense parameters; each expert shard has one replica (dp = ep), so
    # there is nothing to shard it over: it stays out of FSDP2 (ignored_params).
    "epxfsdp-zero3": (dict(dp=2, ep=2, zero=3, micro_batch=2, global_batch=8), {}, MOE),
}
CONFIGS_4 = {
    "cpxdp-ring": (dict(dp=2, cp=2, micro_batch=2, global_batch=4), {"cp_attention": "ring"}, {}),
    "cp4-ring-recompute": (
        dict(cp=4, micro_batch=2, global_batch=2, recompute="full"),
        {"cp_attention": "ring"},
        {},
    ),
    "cpxtp": (dict(cp=2, tp=2, micro_batch=2, global_batch=4), {}, {}),
    "cpxfsdp-zero3": (dict(dp=2, cp=2, zero=3, micro_batch=1, global_batch=4), {}, {}),
    "cpxpp-ring": (dict(cp=2, pp=2, micro_batch=1, global_batch=4), {"cp_attention": "ring"}, {}),
    "epxdp4-tokens": (dict(dp=4, ep=2, micro_batch=1, global_batch=4), {}, MOE),
    # 4 micro-batches: DDP x PP with exactly 2 fails inside DDP's reducer (not EP's doing)
    "epxpp-recompute-slots": (
        dict(dp=2, pp=2, ep=2, micro_batch=1, global_batch=8, recompute="full"),
        {"ep_dispatch": "slots"},
        MOE,
    ),
    "cpxepxdp": (dict(dp=2, cp=2, ep=2, micro_batch=1, global_batch=4), {}, MOE_NO_DROP),
    "cpxepxfsdp-zero2": (
        dict(dp=2, cp=2, ep=2, zero=2, micro_batch=1, global_batch=4),
        {},
        MOE_NO_DROP,
    ),
    # the experts sharded over their 2 replicas, gathered again for each micro-batch's backward
    "epxfsdp4-zero3-slots": (
        dict(dp=4, ep=2, zero=3, micro_batch=1, global_batch=8),
        {"ep_dispatch": "slots"},
        MOE,
    ),
}


def _graph(model_kw):
    """The traced graph the plan is made from (`harness.graph`)."""
    return graph(**model_kw)


def _plan(world, fields, model_kw):
    cluster = meshplan.Cluster.preset("cpu", gpus=world)
    parallel = meshplan.Parallel(**fields)
    return meshplan.estimate_plan(_graph(model_kw), cluster=cluster, parallel=parallel)


def _run(plan, apply_kw, model_kw):
    """Inside a rank: apply, train; losses, snapshots, one step's collectives, the groups."""
    from meshplan.runtime import apply

    t0 = time.perf_counter()
    runner = apply(build_model(**model_kw), plan, loss_fn, sgd, **apply_kw)
    experts = _expert_storage(runner)
    losses, states, records = train(runner, plan.parallel.global_batch)
    ctx = runner.ctx
    groups = group_names(runner)
    return {
        "losses": losses,
        "states": states,
        "records": records,
        "groups": groups,
        "coords": ctx.coords,
        "stage": ctx.stage_index,
        "experts": experts,
        "seconds": time.perf_counter() - t0,
    }


def _expert_storage(runner) -> dict[str, int]:
    """Elements this rank stores of the expert parameters (local shards: of FSDP2's DTensors
    under EP x ZeRO > 0, of TP's under EP x TP) and, filled in when the optimizer steps (all
    reductions done), of their gradients."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    if runner.ep is None:
        return {}
    params = runner.ep.params
    out = {"params": sum(local(q).numel() for q in params)}

    def gradients(optimizer, args, kwargs):
        out["grads"] = sum(local(q.grad).numel() for q in params if q.grad is not None)

    runner.optimizer.register_step_pre_hook(gradients)
    return out


def _all(plans, configs, extra):
    out = {name: _run(plan, configs[name][1], configs[name][2]) for name, plan in plans.items()}
    if extra is not None:
        out["extra"] = extra()
    return out


def _check_all(world, configs, extra=None):
    plans = {name: _plan(world, f, m) for name, (f, _, m) in configs.items()}
    # References first: the forked ranks then inherit a warmed-up torch (first backward,
    # optimizer imports). One intra-op thread: on a shared 2-core machine two threads of
    # these tiny ops wait on each other (the MoE reference: 0.2 s with one, 4-20 s with two).
    refs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, plan in plans.items():
            p = plan.parallel
            refs[name] = reference(p.global_batch, p.dp * p.num_microbatches, **configs[name][2])
    finally:
        torch.set_num_threads(threads)
    results = run_local(_all, world, plans, configs, extra, timeout_s=120)
    for name, plan in plans.items():
        assert_parity(name, refs[name], [r[name] for r in results])
        _check_step(plan, results, name, configs[name])
        if plan.parallel.ep > 1:
            _check_expert_memory(plan, results, name, configs[name])
    return plans, results


def _check_step(plan, results, name, config):
    """Every rank's tp, gradient (dp x cp), expert-replica and world collectives against the
    cost model (`harness.check_step_collectives`), with the all-gather CP variant's K/V
    traffic (`_cp_expected`) on the cp group; ring CP's send/recv and EP's all-to-alls are
    checked by `_check_cp_collectives` / `_check_ep_collectives`."""
    ring = config[1].get("cp_attention") == "ring"
    ignore = frozenset({"send", "recv", "all_to_all"})
    for rank, r in enumerate(results):
        extra = {}
        if plan.parallel.cp > 1 and not ring:
            extra["cp"] = _cp_expected(plan, config, r[name]["stage"])
        check_step_collectives(
            f"{name} rank {rank}",
            plan,
            _graph(config[2]),
            r[name],
            ignore_kinds=ignore,
            extra=extra,
        )


def test_cp_ep_parity_two_ranks():
    plans, results = _check_all(2, CONFIGS_2, extra=_refusals_and_zero_splits)
    for name in ("cp-allgather", "cp-ring-2mb"):
        _check_cp_collectives(plans[name], results, name, CONFIGS_2[name])
    for name in ("ep-tokens", "ep-slots", "epxfsdp-zero3"):
        _check_ep_collectives(plans[name], results, name, CONFIGS_2[name])
    assert len(results[0]["extra"]["attention"]) == 8
    # Every choice goes to rank 0's experts: 2 ranks x 4 x SEQ tokens x top_k 2; rank 1 none.
    assert [r["extra"]["received_rows"] for r in results] == [2 * 4 * SEQ * 2, 0]


def test_cp_ep_parity_four_ranks():
    plans, results = _check_all(4, CONFIGS_4, extra=_one_expert_over_two_replicas)
    assert [r["extra"] for r in results] == [1] * 4  # the experts' FSDP2 shard dim
    cp_names = ("cpxdp-ring", "cp4-ring-recompute", "cpxtp", "cpxfsdp-zero3", "cpxpp-ring")
    for name in (*cp_names, "cpxepxdp", "cpxepxfsdp-zero2"):
        _check_cp_collectives(plans[name], results, name, CONFIGS_4[name])
    ep_names = ("epxdp4-tokens", "epxpp-recompute-slots", "cpxepxdp", "cpxepxfsdp-zero2")
    for name in (*ep_names, "epxfsdp4-zero3-slots"):
        _check_ep_collectives(plans[name], results, name, CONFIGS_4[name])


# -- expert memory against the cost model -------------------------------------------------------


def _check_expert_memory(plan, results, name, config):
    """What each rank stores of the expert parameters and, after backward, of their gradients,
    against `cost_model.memory.stage_memory`: the EP (x TP) shard, `params_expert / (tp * ep)`
    per MoE layer, whole under ZeRO-0, split over its R = dp * cp / ep replicas under ZeRO > 0
    (`state_bytes_per_param(zero, R)`: gradients / R under ZeRO-2/3, weights / R under ZeRO-3
    and, being FSDP2's sharded parameters, the optimizer states they size / R). ZeRO-1 runs as
    ZeRO-2 (`data_parallel`): gradients / R, less than it is priced at."""
    from meshplan.cost_model.memory import FP32 as PRECISION
    from meshplan.cost_model.memory import state_bytes_per_param

    p = plan.parallel
    replicas = p.dp * p.cp // p.ep
    w, g, o = state_bytes_per_param(p.zero, replicas, PRECISION)
    for rank, r in enumerate(results):
        _, facts = _stage_facts(plan, config[2], r[name]["stage"])
        shard = sum(f.memory.params_expert for f in facts) // (p.tp * p.ep)
        got = r[name]["experts"]
        split = replicas if p.zero > 0 else 1
        assert got["params"] * split == shard, f"{name}: rank {rank} stores {got} of {shard}"
        assert got["grads"] * split == shard, f"{name}: rank {rank} gradients {got} of {shard}"
        # what the cost model charges per expert parameter, relative to an unsharded one
        assert got["params"] == shard * o / PRECISION.optimizer_bytes
        assert got["grads"] <= shard * g / PRECISION.grad_bytes
        if p.zero == 3:
            assert got["params"] == shard * w / PRECISION.weight_bytes


# -- collectives against the cost model ---------------------------------------------------------


def _records(result, axis, kinds):
    group = result["groups"][axis]
    return [r for r in result["records"] if r.group == group and r.kind in kinds]


def _stage_facts(plan, model_kw, stage=0):
    from meshplan.cost_model.graph_costs import model_costs

    costs = model_costs(_graph(model_kw))
    s = plan.stages[stage]
    return costs, [costs.facts[k] for k in costs.unit_keys[s.first_unit : s.last_unit]]


def _forwards(plan) -> int:
    """Forward passes per micro-batch: full recomputation runs the forward (and its
    collectives) again in backward, as the cost model prices it."""
    return 2 if plan.parallel.recompute == "full" else 1


def _cp_expected(plan, config, stage) -> Counter:
    """(kind, elements) of the all-gather CP variant in one step of a rank of `stage`, as
    the cost model prices it (`_cp_traffic`): per attention and micro-batch one all-gather of
    K and V (/tp: heads are TP-sharded) per forward and one reduce-scatter of their gradients."""
    p = plan.parallel
    costs, facts = _stage_facts(plan, config[2], stage)
    scale = p.micro_batch / costs.traced_micro_batch
    want: Counter = Counter()
    for f in facts:
        if f.kv_bytes:
            n = round(f.kv_bytes * scale / (p.tp * FP32))
            want[("all_gather", n)] += _forwards(plan) * p.num_microbatches
            want[("reduce_scatter", n)] += p.num_microbatches
    return want


def _check_cp_collectives(plan, results, name, config):
    """The cost model prices CP as one all-gather of K and V per attention and micro-batch in
    forward and one reduce-scatter of their gradients in backward (`_cp_traffic`, /tp: heads
    are TP-sharded). The all-gather variant runs exactly those, with the same sizes. Ring
    attention moves the same K/V by send/recv instead: per attention and micro-batch cp-1
    hops of the local K/V in forward, cp-1 in backward plus cp hops of the K/V gradients (the
    last brings them home). When the cp group is also the expert-replica group (dp / ep = 1),
    the experts' FSDP2 collectives under ZeRO > 0 run on it as well (`_expert_units`)."""
    p = plan.parallel
    ring = config[1].get("cp_attention") == "ring"
    m, cp, fwd = p.num_microbatches, p.cp, _forwards(plan)
    kinds = {"send", "recv", "all_gather", "reduce_scatter"}
    for rank, r in enumerate(results):
        costs, facts = _stage_facts(plan, config[2], r[name]["stage"])
        scale = p.micro_batch / costs.traced_micro_batch
        sizes = [round(f.kv_bytes * scale / (p.tp * FP32)) for f in facts if f.kv_bytes]
        want: Counter = Counter()
        for n in sizes:
            if ring:
                hops = (cp - 1) * fwd + (cp - 1) + cp
                want[("send", n // cp)] += hops * m
                want[("recv", n // cp)] += hops * m
            else:
                want[("all_gather", n)] += fwd * m
                want[("reduce_scatter", n)] += m
        groups = r[name]["groups"]
        if groups.get("replica") == groups["cp"]:
            want.update(_expert_units(plan, facts))
        got = Counter((c.kind, c.numel) for c in _records(r[name], "cp", kinds))
        assert sizes and got == want, f"{name}: rank {rank} CP {dict(got)}, plan {dict(want)}"


def _expert_units(plan, facts) -> Counter:
    """(kind, elements) of the experts' FSDP2 units in one step (EP x ZeRO > 0): per MoE layer
    the cost model's expert parameters of a rank (`params_expert / (tp * ep)`, gathered
    whole over the replicas), reduce-scattered and all-gathered once per step under ZeRO-1/2,
    every micro-batch and twice gathered under ZeRO-3 (`Pricer.dp_traffic`)."""
    p = plan.parallel
    want: Counter = Counter()
    if p.zero == 0 or p.dp * p.cp // p.ep == 1:
        return want
    m = p.num_microbatches
    for f in facts:
        n = f.memory.params_expert // (p.tp * p.ep)
        if n:
            want[("reduce_scatter", n)] += m if p.zero == 3 else 1
            want[("all_gather", n)] += 2 * m if p.zero == 3 else 1
    return want


def _check_ep_collectives(plan, results, name, config):
    """The cost model prices EP as a dispatch and a combine all-to-all per MoE layer and
    micro-batch in forward and again in backward, each of top_k * tokens * hidden elements per
    rank (`_ep_traffic`; tokens of the rank's sequence shard under CP and, with TP, SP). The
    runtime runs exactly those on the ep group, plus (token
    dispatch) one all-to-all of the E per-expert counts per forward. Sizes: token dispatch
    moves only kept choices, so summed over the ep group they equal the price without drops
    and stay below it with drops; slot dispatch moves the capacity buffers (E x capacity x
    hidden each, capacity_factor 1 here)."""
    p = plan.parallel
    elem = 4  # the CPU models run in fp32: tokens travel as 4-byte values
    model_kw, slots = config[2], config[1].get("ep_dispatch") == "slots"
    no_drop = model_kw.get("capacity_factor", 1.0) * model_kw["top_k"] >= model_kw["experts"]
    experts, m, fwd = model_kw["experts"], p.num_microbatches, _forwards(plan)
    totals: Counter = Counter()
    prices: Counter = Counter()
    for rank, r in enumerate(results):
        costs, facts = _stage_facts(plan, model_kw, r[name]["stage"])
        scale = p.micro_batch / costs.traced_micro_batch
        shard = p.cp * (p.tp if p.sequence_parallel else 1)
        per_a2a = [f.a2a_bytes / elem * scale / shard for f in facts if f.a2a_bytes]
        layers = len(per_a2a)
        recs = _records(r[name], "ep", {"all_to_all"})
        counts = [c for c in recs if c.numel == experts and not slots]
        data = [c for c in recs if c not in counts]
        assert layers and len(counts) == (0 if slots else layers * m * fwd), f"{name}: {rank}"
        assert len(data) == (2 * fwd + 2) * layers * m, f"{name}: rank {rank}: {len(data)}"
        group = r[name]["groups"]["ep"]
        totals[group] += sum(c.numel for c in data)
        if slots:
            cap = -(-p.micro_batch * SEQ // shard * model_kw["top_k"] // experts)
            prices[group] += (2 * fwd + 2) * layers * m * experts * cap * CFG["hidden"]
        else:
            prices[group] += (2 * fwd + 2) * sum(per_a2a) * m
    for group, total in totals.items():
        if slots or no_drop:
            assert total == pytest.approx(prices[group]), f"{name}: EP volume {total}"
        else:
            assert 0 < total <= prices[group], f"{name}: EP volume {total} > {prices[group]}"


# -- refusals and a routing with zero splits (inside the 2-rank launch) --------------------------


class _FixedRouter(torch.nn.Module):
    """Every token picks experts 0 and 1 (both on ep rank 0), weighted by a learned softmax."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.top_k = 2
        self.gate = torch.nn.Linear(hidden, 2, bias=False)

    def forward(self, x_th):
        w = torch.softmax(self.gate(x_th), dim=-1)
        return w, torch.tensor([0, 1]).expand(x_th.shape[0], 2)


def _refusals_and_zero_splits():
    """Runs on 2 ranks: a routing that sends every token to rank 0's experts (zero splits to
    rank 1) matches one process, gradients too."""
    import copy
    import importlib

    import torch.distributed as dist
    from meshplan.runtime import CollectiveCounter, build_mesh
    from meshplan.runtime.expert_parallel import apply_expert_parallel
    from meshplan.runtime.steps import Options, whole_model

    zoo = importlib.import_module("meshplan.models.transformer")  # the zoo's module

    out = {}
    torch.manual_seed(0)
    cfg = zoo.TransformerConfig(
        layers=1, hidden=CFG["hidden"], heads=4, vocab=8, ffn=16, **MOE_NO_DROP
    )
    ref = zoo.MoE(cfg)
    ref.router = _FixedRouter(cfg.hidden)
    moe = copy.deepcopy(ref)
    rank = dist.get_rank()
    x = torch.randn(2, 4, SEQ, cfg.hidden)  # one (4, SEQ) batch per rank
    plan = _plan(2, dict(dp=2, ep=2, micro_batch=2, global_batch=8), MOE)
    handle = apply_expert_parallel(whole_model(moe), build_mesh(plan), Options())
    with CollectiveCounter() as counter:
        y = moe(x[rank])
    y.square().mean().backward()
    handle.finish_gradients()  # expert gradients: / dp
    y_ref = ref(x.reshape(8, SEQ, cfg.hidden)).view(2, 4, SEQ, cfg.hidden)
    y_ref.square().mean().backward()  # the mean over both ranks' tokens
    torch.testing.assert_close(y, y_ref[rank], atol=1e-5, rtol=1e-5)
    for name, p in moe.named_parameters():
        if handle.owns(p):
            g = handle.full_tensor(p.grad)
        else:  # dense gradients: averaged over dp, as DDP does
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= 2
        want = ref.get_parameter(name).grad
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    a2a = [r for r in counter.records if r.kind == "all_to_all"]
    out["received_rows"] = a2a[1].numel // cfg.hidden  # [0]: counts, [1]: token dispatch
    out["attention"] = _attention_checks()
    return out


def _one_expert_over_two_replicas():
    """Runs on 4 ranks (dp=4, ep=2, ZeRO-3: each expert shard on 2 replicas) with one expert
    per rank: the experts' FSDP2 units cut dim 1 (dim 0, one expert, would leave one replica
    a padded copy and save nothing); each rank stores exactly half of its expert's weights
    and, after backward, of their gradients, and the MoE's output and every gradient match
    one process. Returns the dim FSDP2 cut."""
    import copy
    import importlib

    import torch.distributed as dist
    from meshplan.runtime import build_mesh
    from meshplan.runtime.expert_parallel import apply_expert_parallel
    from meshplan.runtime.steps import Options, whole_model

    zoo = importlib.import_module("meshplan.models.transformer")
    moe_kw = dict(experts=2, top_k=1, capacity_factor=2.0)  # never drops
    torch.manual_seed(0)
    cfg = zoo.TransformerConfig(layers=1, hidden=CFG["hidden"], heads=4, vocab=8, ffn=16, **moe_kw)
    ref = zoo.MoE(cfg)
    moe = copy.deepcopy(ref)
    rank = dist.get_rank()
    x = torch.randn(4, 2, SEQ, cfg.hidden)  # one (2, SEQ) batch per rank
    plan = _plan(4, dict(dp=4, ep=2, zero=3, micro_batch=2, global_batch=8), moe_kw)
    handle = apply_expert_parallel(whole_model(moe), build_mesh(plan), Options())
    handle.shard_over_replicas(3)
    y = moe(x[rank])
    y.square().mean().backward()
    y_ref = ref(x.reshape(8, SEQ, cfg.hidden)).view(4, 2, SEQ, cfg.hidden)
    y_ref.square().mean().backward()  # the mean over all ranks' tokens
    torch.testing.assert_close(y, y_ref[rank], atol=1e-5, rtol=1e-5)
    placements = set()
    for name, p in moe.named_parameters():
        want = ref.get_parameter(name).grad
        if handle.owns(p):  # FSDP2 reduced it: the sum over replicas / dp
            assert 2 * p.to_local().numel() == p.numel() == want.numel() // 2, name
            assert 2 * p.grad.to_local().numel() == p.numel(), name
            placements.add(p.placements[0].dim)
            g = handle.full_tensor(p.grad)
        else:  # the router: averaged over dp, as the dense units do
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= 4
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    (dim,) = placements
    return dim


def _attention_checks():
    """`ContextParallel.attention` against SDPA on the whole sequence, output and q/k/v
    gradients: both variants, causal and not, zig-zag (seq 8) and contiguous (seq 6) splits,
    grouped-query heads. Returns the cases checked."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from meshplan.runtime import ContextParallel

    rank, cases = dist.get_rank(), []
    for mode in ("allgather", "ring"):
        cp = ContextParallel(dist.group.WORLD, rank, 2, mode)
        for causal in (True, False):
            for seq in (8, 6):
                g = torch.Generator().manual_seed(seq)
                q, k, v = (torch.randn(2, n, seq, 4, generator=g) for n in (4, 2, 2))
                w = torch.randn(2, 4, seq, 4, generator=g)
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
                (ref * w).sum().backward()
                pos = cp.positions(seq // 2)
                mine = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
                got = cp.attention(*mine, is_causal=causal, enable_gqa=True)
                (got * cp.shard(w, dim=2)).sum().backward()
                torch.testing.assert_close(got, ref.detach().index_select(2, pos))
                for a, b in zip(mine, full):
                    torch.testing.assert_close(a.grad, b.grad.index_select(2, pos))
                cases.append((mode, causal, seq))
    return cases
