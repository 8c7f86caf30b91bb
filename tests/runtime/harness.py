"""Shared pieces of the runtime parity tests: a tiny model, plans, a single-process reference.

Every distributed run is compared with one process training the same model (same seed) on
the same global batch with SGD: equal losses per step, equal parameters after each step, and
hence equal gradients (`g = (p_before - p_after) / lr`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import meshplan
import torch
import torch.nn.functional as F
from meshplan.api import _model_ref
from meshplan.cost_model import predict
from meshplan.ir.parallel import StagePlacement
from meshplan.ir.plan import SolverInfo, assign_ranks
from meshplan.passes.sharding import tp_param_placements

LR = 0.5
STEPS = 3
# The step whose collectives are compared with the cost model: the first in steady state. Step 0
# also runs the pipeline's shape inference (each stage's forward once more), step 1 DDP's
# bucket rebuild (a broadcast of the rebuilt bucket order after the first backward).
COUNT_STEP = 2
SEQ = 8
CFG = dict(layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq_len=SEQ)


def build_model(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = {**CFG, **overrides}
    model, _ = meshplan.models.transformer(dtype="float32", device="cpu", **cfg)
    return model


def batch(global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG["vocab"], (global_batch, SEQ), generator=g)
    targets = torch.randint(0, CFG["vocab"], (global_batch, SEQ), generator=g)
    return tokens, targets


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


_GRAPHS: dict = {}


def graph(**model_kw):
    """The traced graph of the tiny model, with `model_kw` overriding CFG (cached)."""
    key = tuple(sorted(model_kw.items()))
    if key not in _GRAPHS:
        model, _ = meshplan.models.transformer(
            dtype="float32", micro_batch=1, **{**CFG, **model_kw}
        )
        _GRAPHS[key] = meshplan.trace(model, *_example(model))
    return _GRAPHS[key]


def _example(model):
    return (
        torch.zeros(1, SEQ, dtype=torch.long, device="meta"),
        torch.zeros(1, SEQ, dtype=torch.long, device="meta"),
    )


def make_plan(world: int, stages: tuple[int, ...] | None = None, **parallel) -> meshplan.Plan:
    """A fixed plan for the tiny model on `world` CPU ranks; `stages` gives uneven unit
    counts per pipeline stage (units = prologue + layers + epilogue)."""
    cluster = meshplan.Cluster.preset("cpu", gpus=world)
    plan = meshplan.estimate_plan(graph(), cluster=cluster, parallel=meshplan.Parallel(**parallel))
    if stages is not None:
        assert sum(stages) == len(plan.model.units) and len(stages) == len(plan.stages)
        cuts, start = [], 0
        for s, n in zip(plan.stages, stages):
            cuts.append(StagePlacement(s.index, start, start + n, s.replicas))
            start += n
        cuts = tuple(cuts)
        plan = dataclasses.replace(
            plan, stages=cuts, ranks=assign_ranks(cluster, plan.parallel, cuts)
        )
    return plan


def fixed_plan(g, cluster, p, stages) -> meshplan.Plan:
    """The plan of a hand-made configuration `p` and `stages` of graph `g` (no solver): its
    ranks, prediction and TP placements as the planner would write them."""
    return meshplan.Plan(
        model=_model_ref(g),
        cluster=cluster,
        parallel=p,
        stages=stages,
        ranks=assign_ranks(cluster, p, stages),
        predicted=predict(g, cluster, p, stages),
        solver=SolverInfo("fixed", 0.0, 1),
        placements=tp_param_placements(g),
    )


def reference(
    global_batch: int, micro_batches: int = 1, steps: int = STEPS, quantized=None, **model_kw
):
    """Single-process losses and parameter snapshots (before, after each step).
    `quantized`: a plan whose AGoQ activation widths (stage 0) the single process applies
    too (`runtime.quantize.quantize_saved_activations`)."""
    model = build_model(**model_kw)
    if quantized is not None:
        from meshplan.runtime.quantize import plan_activation_bits, quantize_saved_activations

        quantize_saved_activations(model, plan_activation_bits(quantized, model, 0))
    return sgd_reference(model, batch, loss_fn, global_batch, micro_batches, steps)


def sgd_reference(
    model, batch_fn, loss_fn_, global_batch: int, micro_batches: int, steps: int, opt=None
):
    """`model` trained by one process with SGD (`LR`; `opt`: another object with `step` and
    `zero_grad`) on `batch_fn(global_batch, step)`, each global batch as `micro_batches`
    accumulated micro-batches: (losses, parameter snapshots before and after every step)."""
    opt = sgd(model.parameters()) if opt is None else opt
    losses, states = [], [{k: v.detach().clone() for k, v in model.named_parameters()}]
    for step in range(steps):
        x, y = batch_fn(global_batch, step)
        total = 0.0
        for xi, yi in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = loss_fn_(model(xi), yi) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        states.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return losses, states


def train(
    runner,
    global_batch: int,
    steps: int = STEPS,
    count_step: int | None = COUNT_STEP,
    batch_fn=batch,
):
    """Inside a rank: `steps` steps of `runner` on `batch_fn(global_batch, step)`; (losses,
    parameter snapshots (rank 0: before and after every step), the collectives of step
    `count_step` with their groups as ranks)."""
    from meshplan.runtime import CollectiveCounter

    states = [runner.full_state_dict()]
    losses, records = [], []
    for step in range(steps):
        x, y = batch_fn(global_batch, step)
        if step == count_step:
            with CollectiveCounter() as counter:
                losses.append(runner.step(x, y))
            records = by_ranks(counter.records)
        else:
            losses.append(runner.step(x, y))
        states.append(runner.full_state_dict())
    return losses, states, records


def run_all(plans):
    """Inside a rank: `distributed_run` of every plan, by name."""
    return {name: distributed_run(plan) for name, plan in plans.items()}


def distributed_run(
    plan,
    steps: int = STEPS,
    count_step: int | None = COUNT_STEP,
    apply_kw: dict | None = None,
    **model_kw,
):
    """Inside a rank: apply the plan, train, return losses, snapshots (rank 0) and the
    collectives of step `count_step` (see `COUNT_STEP`)."""
    from meshplan.runtime import apply

    t0 = time.perf_counter()
    model = build_model(**model_kw)
    runner = apply(model, plan, loss_fn, sgd, **(apply_kw or {}))
    losses, states, records = train(runner, plan.parallel.global_batch, steps, count_step)
    return {
        "losses": losses,
        "states": states,
        "records": records,
        "coords": runner.ctx.coords,
        "plan_rank": runner.ctx.assignment.rank,
        "groups": group_names(runner),
        "seconds": time.perf_counter() - t0,
    }


def attention_checks(cp, layouts) -> list[tuple]:
    """`cp.attention` (a `ContextParallel` over the whole world) against SDPA on the whole
    sequence: outputs and q/k/v gradients, causal and not, zig-zag (2 tokens per chunk) and
    contiguous (3 per rank) splits, for each (query heads, K/V heads) of `layouts`. Returns
    the cases checked. Run inside every rank of a launch."""
    import torch.distributed as dist

    size, cases = dist.get_world_size(), []
    for causal in (True, False):
        for seq in (4 * size, 3 * size):
            for heads, kv_heads in layouts:
                g = torch.Generator().manual_seed(seq * 10 + heads + kv_heads)
                q, k, v = (
                    torch.randn(2, n, seq, 8, generator=g) for n in (heads, kv_heads, kv_heads)
                )
                w = torch.randn(2, heads, seq, 8, generator=g)
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(
                    *full, is_causal=causal, scale=0.3, enable_gqa=True
                )
                (ref * w).sum().backward()
                pos = cp.positions(seq // size)
                mine = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
                got = cp.attention(*mine, is_causal=causal, scale=0.3, enable_gqa=True)
                (got * cp.shard(w, dim=2)).sum().backward()
                case = f"causal={causal} seq={seq} heads={heads} kv={kv_heads}"
                torch.testing.assert_close(
                    got, ref.detach().index_select(2, pos), msg=lambda m, c=case: f"{c}: {m}"
                )
                for x, a, b in zip("qkv", mine, full):
                    torch.testing.assert_close(
                        a.grad,
                        b.grad.index_select(2, pos),
                        msg=lambda m, c=case, x=x: f"{c}: d{x}: {m}",
                    )
                cases.append((causal, seq, heads, kv_heads))
    return cases


def rank_key(group) -> str:
    """A process group (or its name) as the global ranks it spans ("0,1"): torch names groups
    by creation order, and a DeviceMesh may reuse an earlier mesh's group for the same ranks
    (FSDP2 x TP's 2-D parameter mesh does), so ranks are what identifies an axis."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = group if isinstance(group, dist.ProcessGroup) else _resolve_process_group(group)
    return ",".join(map(str, dist.get_process_group_ranks(pg)))


def by_ranks(records):
    """`CollectiveRecord`s with their group given as `rank_key` (unresolvable names kept)."""
    out = []
    for r in records:
        try:
            out.append(dataclasses.replace(r, group=rank_key(r.group)))
        except Exception:
            out.append(r)
    return out


def group_names(runner) -> dict[str, str]:
    """The `rank_key` of each mesh axis's group, of the gradient reduction ("grad": dp, or dp
    x cp merged) and of the world (a mesh axis spanning every rank is the world)."""
    import torch.distributed as dist

    names = {a: rank_key(runner.ctx.group(a)) for a in ("pp", "dp", "cp", "tp")}
    names["grad"] = rank_key(runner.dp_ctx.group("dp"))
    names["world"] = rank_key(dist.group.WORLD)
    if runner.ep is not None:  # the ep group, and the ranks holding the same experts
        names["ep"] = rank_key(runner.ep.groups.ep_group)
        rep = runner.ep.groups.replica_group
        names["replica"] = rank_key(rep) if rep is not None else ""
    return names


# -- the collectives of one step, from the cost model -------------------------------------------

FP32 = 4


def rank_ranges(plan, pp_rank: int) -> list[tuple[int, int]]:
    """Unit ranges of the chunk-stages pipeline rank `pp_rank` runs."""
    from meshplan.runtime.pipeline_parallel import chunk_ranges, rank_chunks

    ranges = chunk_ranges(plan)
    return [ranges[c] for c in rank_chunks(plan, pp_rank)]


def _composition(costs, ranges):
    counts: Counter = Counter()
    for a, b in ranges:
        for key, n in costs.composition(a, b):
            counts[key] += n
    return tuple(sorted(counts.items()))


def expected_tp(
    plan, graph_, pp_rank: int, m: int, *, vocab_parallel: bool = True, cp_rank: int = 0
) -> Counter:
    """(kind, elements) -> count of the collectives on the tp group in one step of a rank of
    pipeline rank `pp_rank` running m micro-batches, as the cost model prices them: per
    micro-batch each unit's `tp_collectives` (with or without SP; layers' forward ones again
    under full recompute), with the loss's `loss_collectives` (vocab-parallel or gathered),
    and per step `Pricer.sp_grad_sync`.

    Under EP x TP (ep > 1) the MoE experts' region moves routed rows whose counts depend on
    the routing (uneven all-to-alls on the tp group, checked by volume in
    test_parity_moe_tp.py); left out here, replaced by what stays exact: per MoE layer and
    forward, one all-gather of the E per-expert row counts (tp x E values).

    Under asymmetric CP (`cp_shares`) a rank's activations are its own share of the
    sequence (`StageConfig.seq_div` of its `cp_rank`), not 1/cp."""
    from meshplan.cost_model.graph_costs import loss_collectives, model_costs
    from meshplan.cost_model.pricer import pricer_for
    from meshplan.passes.sharding import is_lm_head

    p = plan.parallel
    if p.tp == 1:
        return Counter()
    seq_div = dataclasses.replace(p.stage(), cp_ranks=(cp_rank,)).seq_div
    costs = model_costs(graph_)
    scale = p.micro_batch / costs.traced_micro_batch
    ranges = rank_ranges(plan, pp_rank)
    want: Counter = Counter()
    for a, b in ranges:
        for key in costs.unit_keys[a:b]:
            facts = costs.facts[key]
            colls = list(facts.tp_collectives)
            if not vocab_parallel:
                for op in costs.blocks[key].ops:
                    if facts.kind != "layer" and is_lm_head(op, costs.hidden):
                        for c in loss_collectives(op, vocab_parallel=True):
                            colls.remove(c)
                        colls += loss_collectives(op, vocab_parallel=False)
            again = 2 if facts.kind == "layer" and p.recompute == "full" else 1
            if p.ep > 1 and any(c.experts for c in colls):
                colls = [c for c in colls if not c.experts]
                want[("all_gather", p.tp * graph_.info.experts)] += m * again
            for c in colls:
                numel = round(c.size_bytes * scale / (seq_div * FP32))
                for kind in c.with_sp if p.sequence_parallel else c.without_sp:
                    want[(str(kind), numel)] += m * (again if c.phase == "fwd" else 1)
    pricer = pricer_for(graph_, plan.cluster, dtype="float32")
    comp = _composition(costs, ranges)
    reductions = m if p.zero == 3 and p.dp * p.cp > 1 else 1
    sync = pricer.sp_grad_sync(comp, tp=p.tp, sp=bool(p.sequence_parallel), reductions=reductions)
    for kind, size, _ in sync:
        want[(str(kind), round(size / pricer.precision.grad_bytes))] += 1
    return want


def expected_loss_sync() -> Counter:
    """The step's scalar loss all-reduce over all ranks (`LOSS_SYNC_BYTES` of float64)."""
    from meshplan.cost_model.pricer import LOSS_SYNC_BYTES

    return Counter({("all_reduce", LOSS_SYNC_BYTES // 8): 1})


def expected_dp_volume(plan, graph_, pp_rank: int, *, experts: bool = False) -> Counter:
    """kind -> elements the gradient group moves in one step of pipeline rank `pp_rank`: the
    cost model's `dp_traffic` over dp x cp, times its occurrences per step (m under ZeRO-3,
    else 1). Dense parameters, or (`experts`) the expert parameters, which move on their own
    replica group (the dp x cp / ep ranks holding the same experts)."""
    from meshplan.cost_model.graph_costs import model_costs
    from meshplan.cost_model.pricer import pricer_for

    p = plan.parallel
    costs = model_costs(graph_)
    pricer = pricer_for(graph_, plan.cluster, dtype="float32")
    comp = _composition(costs, rank_ranges(plan, pp_rank))
    traffic = pricer.dp_traffic(comp, p.stage(), dp=p.dp, zero=p.zero)
    rep = p.num_microbatches if p.zero == 3 else 1
    group = p.dp * p.cp // p.ep if experts else p.dp * p.cp
    want: Counter = Counter()
    for (kind, size, n), times in zip(traffic.collectives, traffic.times, strict=True):
        if n != group or (not experts and p.ep > 1 and n == p.dp * p.cp // p.ep):
            continue
        prec = pricer.precision  # bytes per parameter (fp32 here)
        per = prec.weight_bytes if str(kind) == "all_gather" else prec.grad_bytes
        # ZeRO-3: one collective per FSDP unit, `times` of them per micro-batch
        want[str(kind)] += rep * times * round(size / per)
    return want


def check_step_collectives(
    name: str,
    plan,
    graph_,
    result,
    *,
    m: int | None = None,
    vocab_parallel: bool = True,
    ignore_kinds: frozenset = frozenset({"send", "recv"}),
    extra: dict[str, Counter] | None = None,
) -> None:
    """Every collective one rank ran in the counted step on its tp, gradient and world groups
    against the cost model: the tp group's (kind, elements) multiset exactly (`expected_tp`),
    the gradient group's elements by kind (`expected_dp_volume`: DDP buckets and FSDP groups
    split the volume into calls the cost model does not model), the world's loss all-reduce.
    Axes that share one process group (a mesh axis spanning every rank is the world) are
    compared together. `ignore_kinds`: point-to-point traffic, checked per pipeline layout in
    test_parity_pipeline.py (and the EP all-to-alls, whose token volumes depend on the routing:
    test_parity_cp_ep.py). `extra`: more exact (kind, elements) counts by axis (CP's)."""
    p = plan.parallel
    groups = result["groups"]
    pp_rank, cp_rank = result["coords"][0], result["coords"][2]
    m = p.num_microbatches if m is None else m
    exact: dict[str, Counter] = {}
    volume: dict[str, Counter] = {}
    if p.tp > 1:
        exact.setdefault(groups["tp"], Counter()).update(
            expected_tp(plan, graph_, pp_rank, m, vocab_parallel=vocab_parallel, cp_rank=cp_rank)
        )
    exact.setdefault(groups["world"], Counter()).update(expected_loss_sync())
    for axis, counts in (extra or {}).items():
        exact.setdefault(groups[axis], Counter()).update(counts)
    if p.dp * p.cp > 1:
        volume[groups["grad"]] = expected_dp_volume(plan, graph_, pp_rank)
    if p.ep > 1 and p.dp * p.cp // p.ep > 1:
        experts = expected_dp_volume(plan, graph_, pp_rank, experts=True)
        volume.setdefault(groups["replica"], Counter()).update(experts)
    for group in set(exact) | set(volume):
        recs = [
            r
            for r in result["records"]
            if r.group == group and r.group_size > 1 and r.kind not in ignore_kinds
        ]
        if group in volume:
            got: Counter = Counter()
            for r in recs:
                got[r.kind] += r.numel
            want = Counter(volume[group])
            for (kind, numel), n in exact.get(group, Counter()).items():
                want[kind] += numel * n
            assert got == want, (
                f"{name}: group {group} volume by kind {dict(got)}, plan {dict(want)}"
            )
        else:
            got = Counter((r.kind, r.numel) for r in recs)
            want = exact[group]
            assert got == want, (
                f"{name}: group {group}: missing {dict(want - got)}, unexpected {dict(got - want)}"
            )


def assert_parity(name, ref, results, atol=2e-5, rtol=1e-4):
    """Losses equal on every rank and equal to the reference; rank 0's parameter snapshots
    (and so the gradients of every step) equal the reference's."""
    ref_losses, ref_states = ref
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(r["losses"]),
            torch.tensor(ref_losses),
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"{name}: rank {rank} losses differ: {m}",
        )
    states = results[0]["states"]
    assert len(states) == len(ref_states)
    for i, (got, want) in enumerate(zip(states, ref_states)):
        assert set(got) == set(want), f"{name}: parameter names differ: {set(got) ^ set(want)}"
        for k in want:
            torch.testing.assert_close(
                got[k],
                want[k],
                atol=atol,
                rtol=rtol,
                msg=lambda m: f"{name}: {k} after step {i}: {m}",
            )
    # Gradients of each step, recovered from the SGD update, compared explicitly.
    for i in range(1, len(states)):
        for k in ref_states[i]:
            g_ref = (ref_states[i - 1][k] - ref_states[i][k]) / LR
            g_got = (states[i - 1][k] - states[i][k]) / LR
            torch.testing.assert_close(
                g_got,
                g_ref,
                atol=atol * 4,
                rtol=rtol * 10,
                msg=lambda m: f"{name}: gradient of {k} at step {i}: {m}",
            )
