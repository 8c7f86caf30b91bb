"""A user's model as written: HuggingFace `LlamaForCausalLM` (tiny config) trained under plans
traced from the same model, against one process.

The plan is made by `meshplan.trace` of the model (built on meta) and `estimate_plan`; the
runtime matches it to the real model by module path (`model.layers.N` units, placements such
as `layer:self_attn.q_proj.weight`). DP x TP applies torch's parallel styles to HF's own
modules (their forward is unchanged: HF infers head counts from shapes); TP x PP cuts the
model into `HFDecoderStage`s (`pipeline_parallel`). Loss and gradients of 3 SGD steps equal
the single-process run within fp32 tolerance (`harness.assert_parity`).

transformers is imported once in the parent (~8 s on 2 busy cores); the ranks are forks.
"""

from __future__ import annotations

import meshplan
import pytest
import torch
import torch.nn.functional as F
from meshplan.runtime import run_local

from tests.runtime.harness import LR, STEPS, assert_parity

transformers = pytest.importorskip("transformers")

SEQ, VOCAB = 8, 128
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    use_cache=False,
)


def build(device: str = "cpu"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    with torch.device(device):
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def loss_fn(out, targets):
    """Next-token cross entropy on the logits (HF output object, or a pipeline stage's logits)."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def batch(global_batch: int, step: int):
    g = torch.Generator().manual_seed(2000 + step)
    return (
        torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
        torch.randint(0, VOCAB, (global_batch, SEQ), generator=g),
    )


def make_plan(world: int, **parallel):
    model = build("meta")
    ex = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    graph = meshplan.trace(model, ex, kwargs={"labels": ex, "use_cache": False})
    cluster = meshplan.Cluster.preset("cpu", gpus=world)
    return meshplan.estimate_plan(graph, cluster=cluster, parallel=meshplan.Parallel(**parallel))


def reference(global_batch: int, micro_batches: int):
    model = build()
    opt = sgd(model.parameters())
    losses, states = [], [{k: v.detach().clone() for k, v in model.named_parameters()}]
    for step in range(STEPS):
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


def _run(plans):
    from meshplan.runtime import apply
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, plan in plans.items():
        runner = apply(build(), plan, loss_fn, sgd)
        sharded = sum(
            isinstance(q, DTensor) and any(isinstance(pl, Shard) for pl in q.placements)
            for m in runner.modules
            for q in m.parameters()
        )
        states, losses = [runner.full_state_dict()], []
        for step in range(STEPS):
            losses.append(runner.step(*batch(plan.parallel.global_batch, step)))
            states.append(runner.full_state_dict())
        kinds = sorted({type(m).__name__ for m in runner.modules})
        out[name] = {"losses": losses, "states": states, "sharded": sharded, "kinds": kinds}
    return out


def test_hf_llama_parity_four_ranks():
    plans = {
        # HF derives positions from the hidden state's length: no sequence parallelism.
        "hf-dpxtp": make_plan(
            4, dp=2, tp=2, micro_batch=1, global_batch=4, sequence_parallel=False
        ),
        "hf-tpxpp": make_plan(
            4, tp=2, pp=2, micro_batch=1, global_batch=4, sequence_parallel=False
        ),
    }
    assert plans["hf-dpxtp"].model.units[1] == "model.layers.0"
    results = run_local(_run, 4, plans, timeout_s=240)
    for name, plan in plans.items():
        p = plan.parallel
        ref = reference(p.global_batch, p.global_batch // p.micro_batch)
        assert_parity(name, ref, [r[name] for r in results])
    # TP really sharded HF's projections (all 7 per layer, embedding, LM head), and PP ran
    # HF stages of the model.
    assert results[0]["hf-dpxtp"]["sharded"] == 7 * 2 + 2
    assert results[0]["hf-tpxpp"]["kinds"] == ["HFDecoderStage"]
