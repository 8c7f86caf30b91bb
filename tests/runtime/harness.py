"""Shared pieces of the runtime parity tests: a tiny model, plans, a single-process reference.

Every distributed run is compared with one process training the same model (same seed) on
the same global batch with SGD: equal losses per step, equal parameters after each step, and
hence equal gradients (`g = (p_before - p_after) / lr`).
"""

from __future__ import annotations

import dataclasses
import time

import meshplan
import torch
import torch.nn.functional as F
from meshplan.ir.parallel import StagePlacement
from meshplan.ir.plan import assign_ranks

LR = 0.5
STEPS = 3
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


_GRAPH = None


def graph():
    global _GRAPH
    if _GRAPH is None:
        model, _ = meshplan.models.transformer(dtype="float32", micro_batch=1, **CFG)
        _GRAPH = meshplan.trace(model, *_example(model))
    return _GRAPH


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


def reference(global_batch: int, micro_batches: int = 1, steps: int = STEPS, **model_kw):
    """Single-process losses and parameter snapshots (before, after each step)."""
    model = build_model(**model_kw)
    opt = sgd(model.parameters())
    losses, states = [], [{k: v.detach().clone() for k, v in model.named_parameters()}]
    for step in range(steps):
        x, y = batch(global_batch, step)
        total = 0.0
        for xi, yi in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = loss_fn(model(xi), yi) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        states.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return losses, states


def distributed_run(plan, steps: int = STEPS, count_step: int | None = 0, **model_kw):
    """Inside a rank: apply the plan, train, return losses, snapshots (rank 0) and the
    collectives of step `count_step`."""
    from meshplan.runtime import CollectiveCounter, apply

    t0 = time.perf_counter()
    model = build_model(**model_kw)
    runner = apply(model, plan, loss_fn, sgd)
    states = [runner.full_state_dict()]
    losses, records = [], []
    for step in range(steps):
        x, y = batch(plan.parallel.global_batch, step)
        if step == count_step:
            counter = CollectiveCounter()
            with counter:
                losses.append(runner.step(x, y))
            records = counter.records
        else:
            losses.append(runner.step(x, y))
        states.append(runner.full_state_dict())
    return {
        "losses": losses,
        "states": states,
        "records": records,
        "coords": runner.ctx.coords,
        "groups": {a: str(runner.ctx.group(a).group_name) for a in ("pp", "dp", "tp")},
        "seconds": time.perf_counter() - t0,
    }


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
