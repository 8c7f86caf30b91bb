"""The collectives the cost model prices beyond the layers' Megatron regions, against hand
counts: the vocab-parallel loss, the embedding's SP backward gather, the SP norm-gradient
all-reduces, the step's loss all-reduce, and which traffic the planner may code.

The runtime side (that `meshplan.runtime.apply` runs exactly these) is checked by the
parity tests in tests/runtime (`harness.check_step_collectives`)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import meshplan
import pytest
import torch
from meshplan import Cluster
from meshplan.cost_model.collectives import Collective
from meshplan.cost_model.compression import RUNTIME_CODED_AXES, CommOptions, choose
from meshplan.cost_model.graph_costs import LOSS_BYTES_PER_TOKEN, loss_collectives, model_costs
from meshplan.cost_model.memory import GRAD_BYTES  # bf16 gradients: the graph is bf16
from meshplan.cost_model.pricer import pricer_for
from meshplan.passes.sharding import is_lm_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from synthetic import transformer_graph  # noqa: E402

LAYERS, HIDDEN, VOCAB, SEQ, MB = 2, 256, 1000, 128, 2
AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(LAYERS, HIDDEN, 4, 4, 1024, VOCAB, SEQ, MB, name="steps")


def _edge(graph, kind):
    costs = model_costs(graph)
    keys = [k for k in costs.unit_keys if costs.facts[k].kind == kind]
    return costs, keys[0]


def test_vocab_parallel_loss_is_three_token_all_reduces(graph):
    costs, key = _edge(graph, "epilogue")
    head = next(op for op in costs.blocks[key].ops if is_lm_head(op, HIDDEN))
    tokens = MB * SEQ
    (vp,) = loss_collectives(head, vocab_parallel=True)
    assert (vp.phase, vp.size_bytes, vp.with_sp, vp.without_sp) == (
        "fwd",
        tokens * LOSS_BYTES_PER_TOKEN,
        (AR, AR, AR),
        (AR, AR, AR),
    )
    (gathered,) = loss_collectives(head, vocab_parallel=False)
    assert gathered.size_bytes == tokens * VOCAB * 2 and gathered.with_sp == (AG,)  # bf16
    # The epilogue prices the vocab-parallel loss (Megatron-LM / torchtitan).
    assert vp in costs.facts[key].tp_collectives


def test_embedding_under_sp_gathers_its_gradient(graph):
    costs, key = _edge(graph, "prologue")
    out = MB * SEQ * HIDDEN * 2
    got = [
        (c.phase, c.size_bytes, c.with_sp, c.without_sp) for c in costs.facts[key].tp_collectives
    ]
    assert got == [("fwd", out, (RS,), (AR,)), ("bwd", out, (AG,), ())]


def test_sp_norm_gradients_are_reduced_per_parameter(graph):
    pricer = pricer_for(graph, Cluster.preset("dgx-h100", gpus=8))
    costs = pricer.costs
    comp = costs.composition(0, len(costs.unit_keys))
    # Two norms per layer and the final norm, each HIDDEN values.
    want = [(AR, HIDDEN * GRAD_BYTES, 8)] * (2 * LAYERS + 1)
    assert list(pricer.sp_grad_sync(comp, tp=8, sp=True)) == want
    assert Counter(pricer.sp_grad_sync(comp, tp=8, sp=True, reductions=3)) == Counter(want * 3)
    assert pricer.sp_grad_sync(comp, tp=8, sp=False) == ()
    assert pricer.sp_grad_sync(comp, tp=1, sp=True) == ()


def test_loss_all_reduce_is_latency_bound(graph):
    one = pricer_for(graph, Cluster.preset("dgx-h100", gpus=64))
    sites = pricer_for(graph, Cluster.preset("two-sites", gpus=64))
    t = one.loss_sync_time("h100", 64)
    # NCCL's tree over 8 nodes: microseconds, not the ring's 2 (n - 1) hops.
    assert 0 < t < 100e-6
    across = sites.loss_sync_time("h100-dc1", 64, ("h100-dc1", "h100-dc2"))
    assert across >= 2 * 1e-3  # up and down the 1 ms WAN


def test_planner_codes_only_the_runtimes_axes():
    """`choose` prices coding only on the axes the options allow (by default the runtime's:
    DP); a what-if option may allow more."""
    assert RUNTIME_CODED_AXES == ("dp",)
    gpu = Cluster.preset("two-sites", gpus=2).groups[0].gpu
    slow = lambda size: size / 1e6  # noqa: E731 (1 MB/s: coding always pays)
    kind, size = Collective.ALL_GATHER, 64e6
    dp = choose(kind, size, 2, slow, CommOptions(), gpu, "bfloat16", "activations", "dp")
    pp = choose(kind, size, 2, slow, CommOptions(), gpu, "bfloat16", "activations", "pp")
    assert dp.method == "lossless" and pp.method == "raw" and pp.lossless_s == float("inf")
    what_if = CommOptions(axes=("dp", "pp"))
    assert choose(kind, size, 2, slow, what_if, gpu, "bfloat16", "activations", "pp").method == (
        "lossless"
    )


def test_moe_router_gradients_are_reduced_over_tp_with_or_without_sp():
    """The router's gate is whole on every tp rank and its gradient is a partial sum over tp
    (expert TP: the routing weights scale partial outputs; EP x TP: each rank routes its own
    sequence shard), so it is all-reduced over tp with or without SP; the norms only under
    SP. Memory counts the gate as replicated."""
    experts = 8
    moe = transformer_graph(
        LAYERS, HIDDEN, 4, 4, 1024, VOCAB, SEQ, MB, name="moe", experts=experts, top_k=2
    )
    pricer = pricer_for(moe, Cluster.preset("dgx-h100", gpus=8))
    costs = pricer.costs
    comp = costs.composition(0, len(costs.unit_keys))
    norm = (AR, HIDDEN * GRAD_BYTES, 8)
    router = (AR, experts * HIDDEN * GRAD_BYTES, 8)
    assert list(pricer.sp_grad_sync(comp, tp=8, sp=False)) == [router] * LAYERS
    with_sp = Counter(pricer.sp_grad_sync(comp, tp=8, sp=True))
    assert with_sp == Counter({norm: 2 * LAYERS + 1, router: LAYERS})
    assert pricer.sp_grad_sync(comp, tp=1, sp=True) == ()
    layer = next(k for k in costs.unit_keys if costs.facts[k].kind == "layer")
    assert costs.facts[layer].memory.params_rep == 2 * HIDDEN + experts * HIDDEN


def test_a_position_table_moves_nothing_under_tp():
    """Only the vocabulary-parallel token embedding reduces its output over tp (Megatron's
    prologue: one all-reduce, or a reduce-scatter under SP, and its backward all-gather); the
    replicated table of learned positions is added after it and moves nothing."""
    cfg = dict(layers=2, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8)
    model, _ = meshplan.models.transformer(style="gpt", dtype="float32", micro_batch=1, **cfg)
    example = torch.zeros(1, 8, dtype=torch.long, device="meta")
    graph = meshplan.trace(model, example, example)
    costs = model_costs(graph)
    prologue = next(k for k, b in graph.blocks if b.kind == "prologue")
    output = 1 * 8 * 32 * 4  # the token embedding's output: batch x seq x hidden, fp32
    got = [(c.phase, c.size_bytes) for c in costs.facts[prologue].tp_collectives]
    assert got == [("fwd", output), ("bwd", output)]
