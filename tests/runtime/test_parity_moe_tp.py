"""Parity of MoE models under tensor parallelism with one process: expert TP (the MoE as one
TP region, ep == 1) and EP x TP, and their collectives against the cost model.

One local launch per world size (`run_local`) runs several plans in turn, as in
test_parity_cp_ep.py (whose runner and checks this file reuses): the losses of 3 SGD steps
equal the single-process run on every rank, rank 0's gathered parameters after each step
(so the gradients) equal the single process's within fp32 tolerance, and every rank's
collectives of one steady step are compared with the cost model.

Capacity. Expert TP routes all the tokens of the micro-batch on every tp rank (the region
gathers them first), so capacity drops are exactly one process's: those configs use
capacity_factor 1, which drops. EP x TP routes each tp rank's sequence shard (as CP does), so
each shard has its own capacity: those configs use capacity_factor 2 (E / top_k), which never
drops.

The 2-rank launch also checks the GPT-style experts (biases: `b_up` split with `w_up`,
`b_down` added once) as one TP region, with and without SP, module by module.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from meshplan.runtime import RuntimePlanError

from tests.runtime.harness import CFG, FP32, SEQ, build_model
from tests.runtime.test_parity_cp_ep import (
    MOE,
    MOE_NO_DROP,
    _check_all,
    _check_ep_collectives,
    _forwards,
    _graph,
    _plan,
    _records,
    _stage_facts,
)

MOE_SHARED = dict(experts=4, top_k=2, shared_experts=1)
GPT_MOE = dict(experts=4, top_k=2, style="gpt", kv_heads=4)

# name -> (plan fields, apply() keywords, model overrides)
CONFIGS_2 = {
    "moe-tp-sp": (dict(tp=2, micro_batch=2, global_batch=4), {}, MOE),
    "moe-tp-nosp": (dict(tp=2, micro_batch=2, global_batch=4, sequence_parallel=False), {}, MOE),
    # shared experts: a zoo MLP, column/row-parallel in its own region beside the experts'
    "moe-tp-sp-shared": (dict(tp=2, micro_batch=1, global_batch=2), {}, MOE_SHARED),
}
CONFIGS_4 = {
    "moe-tpxfsdp-zero3": (dict(tp=2, dp=2, zero=3, micro_batch=1, global_batch=4), {}, MOE),
    "moe-epxtpxdp": (dict(tp=2, dp=2, ep=2, micro_batch=1, global_batch=4), {}, MOE_NO_DROP),
    "moe-epxtpxfsdp-zero2": (
        dict(tp=2, dp=2, ep=2, zero=2, micro_batch=1, global_batch=4),
        {},
        MOE_NO_DROP,
    ),
}
CONFIGS_8 = {
    "moe-epxtpxpp-recompute": (
        dict(tp=2, dp=2, ep=2, pp=2, micro_batch=1, global_batch=4, recompute="full"),
        {},
        MOE_NO_DROP,
    ),
    # each expert shard on 2 replicas: FSDP2 over the 2-D (replica, tp) mesh (2 layers: time)
    "moe-epxtpxfsdp-zero3": (
        dict(tp=2, dp=4, ep=2, zero=3, micro_batch=1, global_batch=8),
        {},
        dict(MOE_NO_DROP, layers=2),
    ),
}


def test_moe_tp_parity_two_ranks():
    _, results = _check_all(2, CONFIGS_2, extra=_gpt_experts_checks)
    assert results[0]["extra"] == ["sp", "no-sp"]


def test_moe_tp_parity_four_ranks():
    plans, results = _check_all(4, CONFIGS_4)
    for name in ("moe-epxtpxdp", "moe-epxtpxfsdp-zero2"):
        _check_ep_collectives(plans[name], results, name, CONFIGS_4[name])
        _check_tp_rows(plans[name], results, name, CONFIGS_4[name])


def test_moe_ep_tp_pp_parity_eight_ranks():
    plans, results = _check_all(8, CONFIGS_8)
    for name in CONFIGS_8:
        _check_ep_collectives(plans[name], results, name, CONFIGS_8[name])
        _check_tp_rows(plans[name], results, name, CONFIGS_8[name])


def _check_tp_rows(plan, results, name, config):
    """EP x TP's data-dependent traffic on the tp group, against the cost model
    (`Pricer.tp_collectives`, the experts' region under ep > 1): per MoE layer and micro-batch
    an all-gather of the rows the tp ranks received from the ep all-to-all and a
    reduce-scatter of their partial outputs in forward (again under full recompute), and the
    same pair in backward. The runtime runs each as one uneven `all_to_all_single` on the tp
    group. Volumes (the gathered rows, elements): summed over all ranks they equal the price at
    a balanced load (`Engine(moe_imbalance=1)`) when nothing is dropped, and stay below it
    otherwise (each rank's own count varies with the routing)."""
    from meshplan.cost_model.engine import Engine
    from meshplan.cost_model.pricer import pricer_for

    p = plan.parallel
    model_kw = config[2]
    no_drop = model_kw.get("capacity_factor", 1.0) * model_kw["top_k"] >= model_kw["experts"]
    graph_ = _graph(model_kw)
    pricer = pricer_for(graph_, plan.cluster, dtype="float32", engine=Engine(moe_imbalance=1.0))
    m, fwd = p.num_microbatches, _forwards(plan)
    total = price = 0.0
    for rank, r in enumerate(results):
        costs, facts = _stage_facts(plan, model_kw, r[name]["stage"])
        scale = p.micro_batch / costs.traced_micro_batch
        want = []
        for f in facts:
            experts = dataclasses.replace(
                f, tp_collectives=tuple(c for c in f.tp_collectives if c.experts)
            )
            colls = pricer.tp_collectives(
                experts, tp=p.tp, cp=p.cp, ep=p.ep, sp=bool(p.sequence_parallel), scale=scale
            )
            for phase, _, size in colls:
                want += [size / FP32] * (m * (fwd if phase == "fwd" else 1))
        recs = _records(r[name], "tp", {"all_to_all"})
        assert want and len(recs) == len(want), f"{name}: rank {rank}: {len(recs)} row exchanges"
        total += sum(c.numel for c in recs)
        price += sum(want)
    if no_drop:
        assert total == pytest.approx(price), f"{name}: tp rows {total}, priced {price}"
    else:
        assert 0 < total <= price, f"{name}: tp rows {total} > {price}"


# -- GPT-style experts (biases) as one TP region, module by module (inside the 2-rank launch) --


def _gpt_experts_checks():
    """On 2 ranks: the GPT-style MoE of layer 0 (random weights and biases) under expert TP,
    with and without SP, against one process: its output, and the gradient of every MoE
    parameter (gathered: sharded ones over tp, partial ones summed)."""
    import copy

    import torch.distributed as dist
    from meshplan.runtime import build_mesh
    from meshplan.runtime.expert_parallel import apply_expert_parallel
    from meshplan.runtime.steps import Options, whole_model
    from torch.distributed.tensor import DTensor

    rank, done = dist.get_rank(), []
    for sp in (True, False):
        # The whole GPT-style model cannot run SP (learned positions: `ModelInfo.blocker("sp")`),
        # so the planner refuses it; this check runs the MoE module alone, which can.
        plan = _plan(2, dict(tp=2, micro_batch=2, global_batch=2, sequence_parallel=False), GPT_MOE)
        plan = dataclasses.replace(
            plan, parallel=dataclasses.replace(plan.parallel, sequence_parallel=sp)
        )
        model = build_model(**GPT_MOE)
        with torch.no_grad():
            for p in model.layers[0].mlp.parameters():
                p.normal_(std=0.2)
        ref = copy.deepcopy(model.layers[0].mlp)
        apply_expert_parallel(whole_model(model), build_mesh(plan), Options())
        moe = model.layers[0].mlp
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, SEQ, CFG["hidden"], generator=g)
        w = torch.randn(2, SEQ, CFG["hidden"], generator=g)
        mine = (lambda t: t.chunk(2, dim=1)[rank]) if sp else (lambda t: t)
        y = moe(mine(x))
        (y * mine(w)).sum().backward()
        y_ref = ref(x)
        (y_ref * w).sum().backward()
        torch.testing.assert_close(y, mine(y_ref.detach()), atol=1e-5, rtol=1e-4)
        for name, p in moe.named_parameters():
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            want = ref.get_parameter(name).grad
            torch.testing.assert_close(
                got, want, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n} (sp={sp}): {m}"
            )
        done.append("sp" if sp else "no-sp")
    return done


# -- refusals (one process: they come before any process group is touched) ---------------------


def _ctx(world, fields, model_kw=MOE_NO_DROP, **parallel):
    plan = _plan(world, fields, model_kw)
    if parallel:
        plan = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, **parallel))
    return types.SimpleNamespace(plan=plan)


def test_ep_with_tp_without_sequence_parallelism_is_refused():
    from meshplan.runtime.expert_parallel import apply_expert_parallel
    from meshplan.runtime.steps import Options, whole_model

    ctx = _ctx(4, dict(tp=2, dp=2, ep=2), sequence_parallel=False)
    with pytest.raises(RuntimePlanError, match="ep > 1 with tp > 1 needs sequence parallelism"):
        apply_expert_parallel(whole_model(build_model(**MOE_NO_DROP)), ctx, Options())


def test_slots_dispatch_and_stacked_experts_run_with_tp_1_only():
    from meshplan.runtime.expert_parallel import apply_expert_parallel
    from meshplan.runtime.steps import Options, whole_model

    ctx = _ctx(4, dict(tp=2, dp=2, ep=2))
    slots = Options(ep_dispatch="slots")
    with pytest.raises(RuntimePlanError, match="slots dispatch .* run with tp == 1 only"):
        apply_expert_parallel(whole_model(build_model(**MOE_NO_DROP)), ctx, slots)

    class Stacked(torch.nn.Module):
        stacked_experts = True

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 8, 8))

    with pytest.raises(RuntimePlanError, match="slots dispatch .* run with tp == 1 only"):
        apply_expert_parallel(whole_model(Stacked()), _ctx(2, dict(tp=2)), Options())
