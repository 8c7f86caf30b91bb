"""A user's model as written: HuggingFace `LlamaForCausalLM` (tiny config; also Qwen2, Mistral
and the Llama inside a user's module) trained under plans traced from the same model, against
one process.

The plan is made by `meshplan.trace` of the model (built on meta) and `estimate_plan`; the
runtime matches it to the real model by module path (`model.layers.N` units, placements such
as `layer:self_attn.q_proj.weight`). TP applies torch's parallel styles to HF's own modules
(their forward is unchanged: HF infers head counts from shapes); PP cuts the model into
`HFDecoderStage`s (`pipeline_parallel`). Under sequence parallelism and context parallelism
HF would count positions from its sharded hidden state; the runtime gives its rotary module
the positions of the whole sequence (`context_parallel.reposition_hf_decoder`). Loss and
gradients of 3 SGD steps equal the single-process run within fp32 tolerance
(`harness.assert_parity`), and every rank's tp, gradient, cp and world collectives of one step
equal the cost model's for the plan (`harness.check_step_collectives`).

What the runtime cannot give positions to (another HF shape, eager attention, a sliding window
shorter than the sequence) is refused in one line by the runtime and never planned.

transformers is imported once in the parent (~8 s on 2 busy cores); the ranks are forks.
"""

from __future__ import annotations

import time
from collections import Counter

import meshplan
import pytest
import torch
import torch.nn.functional as F
from meshplan.runtime import RuntimePlanError, run_local

from tests.runtime.harness import (
    LR,
    STEPS,
    assert_parity,
    check_step_collectives,
    group_names,
    rank_ranges,
    sgd_reference,
    train,
)

transformers = pytest.importorskip("transformers")

SEQ, VOCAB = 8, 128
FP32 = 4
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


class Wrapped(torch.nn.Module):
    """A user's module around an HF model (the HF model counts the positions inside)."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens, labels=None, use_cache=False):
        return self.lm(input_ids=tokens, labels=labels, use_cache=use_cache)


# kind -> (config class, model class): the Llama family's shapes (Qwen2: q/k/v biases;
# Mistral: a sliding window, 4096 tokens by default, longer than the sequence)
KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build(
    device: str = "cpu",
    attn: str = "sdpa",
    wrapped: bool = False,
    kind: str = "llama",
    layers: int = CONFIG["num_hidden_layers"],
    heads: int | None = None,
):
    torch.manual_seed(0)
    config_cls, model_cls = (getattr(transformers, n) for n in KINDS[kind])
    shape = {}
    if heads is not None:  # head_dim 8 as in CONFIG (hidden / heads), 2 K/V heads
        shape = {"num_attention_heads": heads, "hidden_size": 8 * heads}
    cfg = config_cls(**{**CONFIG, "num_hidden_layers": layers, **shape})
    with torch.device(device):
        lm = model_cls._from_config(cfg, attn_implementation=attn)
    return Wrapped(lm) if wrapped else lm


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


def trace_hf(model):
    ex = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return meshplan.trace(model, ex, kwargs={"labels": ex, "use_cache": False})


_GRAPHS: dict = {}


def hf_graph(**model_kw):
    """The plans' graph: the model (`build(**model_kw)`) traced once on meta."""
    key = tuple(sorted(model_kw.items()))
    if key not in _GRAPHS:
        _GRAPHS[key] = trace_hf(build("meta", **model_kw))
    return _GRAPHS[key]


def make_plan(world: int, model_kw: dict | None = None, **parallel):
    cluster = meshplan.Cluster.preset("cpu", gpus=world)
    return meshplan.estimate_plan(
        hf_graph(**(model_kw or {})), cluster=cluster, parallel=meshplan.Parallel(**parallel)
    )


def reference(global_batch: int, micro_batches: int, **model_kw):
    return sgd_reference(build(**model_kw), batch, loss_fn, global_batch, micro_batches, STEPS)


# name -> (plan fields, apply() keywords[, build() keywords]). SP is on wherever tp > 1 unless
# switched off (the planner's default).
CONFIGS_2 = {
    "hf-tp-sp": (dict(tp=2, micro_batch=1, global_batch=2), {}),
    "hf-cp": (dict(cp=2, micro_batch=1, global_batch=2), {}),
    "hf-cp-ring": (dict(cp=2, micro_batch=2, global_batch=2), {"cp_attention": "ring"}),
    # the HF model inside a user's module: units `lm.model.layers.N`
    "wrapped-hf-tp-sp": (dict(tp=2, micro_batch=1, global_batch=2), {}, {"wrapped": True}),
    "qwen2-tp-sp": (dict(tp=2, micro_batch=1, global_batch=2), {}, {"kind": "qwen2"}),
    "mistral-cp": (dict(cp=2, micro_batch=1, global_batch=2), {}, {"kind": "mistral"}),
}
CONFIGS_4_TP = {
    # SP off: what the planner plans for a model it cannot shard (and all HF ran before)
    "hf-dpxtp": (dict(dp=2, tp=2, micro_batch=1, global_batch=4, sequence_parallel=False), {}),
    "hf-dpxtp-sp": (dict(dp=2, tp=2, micro_batch=1, global_batch=4), {}),
    "hf-cpxtp-sp": (dict(cp=2, tp=2, micro_batch=1, global_batch=2), {}),
    "hf-fsdpxtp-sp-recompute": (
        dict(dp=2, tp=2, zero=3, recompute="full", micro_batch=1, global_batch=4),
        {},
    ),
}
# 6 query heads, which cp 4 does not divide: the two-level "usp" split (heads over 2 cp
# ranks, K/V all-gathered over the other 2) on an HF decoder, its rotary positions given by
# `reposition_hf_decoder`.
CONFIGS_4_USP = {
    "hf-usp": (dict(cp=4, micro_batch=1, global_batch=2, cp_mode="usp"), {}, {"heads": 6}),
}
CONFIGS_4_PP = {
    "hf-tpxpp-sp": (dict(tp=2, pp=2, micro_batch=1, global_batch=4), {}),
    "hf-cpxpp": (dict(cp=2, pp=2, micro_batch=1, global_batch=2), {}),
    # a rank's two chunks share the model's one rotary module (hooked once)
    "hf-tpxinterleaved-sp": (
        dict(tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2, global_batch=4),
        {},
        {"layers": 4},
    ),
}


def _run(plans, configs):
    """Inside a rank: apply each plan to a fresh model, train; losses, snapshots, one step's
    collectives, the groups, what TP sharded and which modules ran. First, `apply` of the
    first SP plan to the model with eager attention, which it must refuse ("refused")."""
    from meshplan.runtime import apply
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    sp_plan = next((p for p in plans.values() if p.parallel.sequence_parallel), None)
    try:
        if sp_plan is not None:
            apply(build(attn="eager"), sp_plan, loss_fn, sgd)
    except RuntimePlanError as e:
        out["refused"] = str(e)
    for name, plan in plans.items():
        t0 = time.perf_counter()
        runner = apply(build(**_model_kw(configs[name])), plan, loss_fn, sgd, **configs[name][1])
        sharded = sum(
            isinstance(q, DTensor) and any(isinstance(pl, Shard) for pl in q.placements)
            for m in runner.modules
            for q in m.parameters()
        )
        losses, states, records = train(runner, plan.parallel.global_batch, batch_fn=batch)
        out[name] = {
            "losses": losses,
            "states": states,
            "records": records,
            "groups": group_names(runner),
            "coords": runner.ctx.coords,
            "sharded": sharded,
            # the modules the chunks run (inside DDP, under CP's dp x cp gradient group)
            "kinds": sorted({type(getattr(m, "module", m)).__name__ for m in runner.modules}),
            "seconds": time.perf_counter() - t0,
        }
    return out


def _model_kw(config) -> dict:
    return config[2] if len(config) > 2 else {}


def _cp_expected(plan, graph, pp_rank: int) -> Counter:
    """The all-gather CP variant's collectives in one step, as the cost model prices them
    (`cp_comm`): per attention and micro-batch one all-gather of K and V (/tp: heads are
    TP-sharded) in forward and one reduce-scatter of their gradients in backward."""
    from meshplan.cost_model.graph_costs import model_costs

    p = plan.parallel
    costs = model_costs(graph)
    scale = p.micro_batch / costs.traced_micro_batch
    want: Counter = Counter()
    for a, b in rank_ranges(plan, pp_rank):
        for key in costs.unit_keys[a:b]:
            kv = costs.facts[key].kv_bytes
            if kv:
                n = round(kv * scale / (p.tp * FP32))
                want[("all_gather", n)] += p.num_microbatches
                want[("reduce_scatter", n)] += p.num_microbatches
    return want


def _check_all(world, configs):
    plans = {name: make_plan(world, _model_kw(c), **c[0]) for name, c in configs.items()}
    # References first, on one intra-op thread (two threads of these tiny ops wait on each
    # other on a shared 2-core machine; see test_parity_cp_ep.py).
    refs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, plan in plans.items():
            p = plan.parallel
            kw = _model_kw(configs[name])
            refs[name] = reference(p.global_batch, p.global_batch // p.micro_batch, **kw)
    finally:
        torch.set_num_threads(threads)
    results = run_local(_run, world, plans, configs, timeout_s=240)
    for name, plan in plans.items():
        assert_parity(name, refs[name], [r[name] for r in results])
        ring = configs[name][1].get("cp_attention") == "ring"
        graph = hf_graph(**_model_kw(configs[name]))
        for rank, r in enumerate(results):
            extra = {}
            if plan.parallel.cp > 1 and not ring and plan.parallel.cp_mode != "usp":
                extra["cp"] = _cp_expected(plan, graph, r[name]["coords"][0])
            check_step_collectives(f"{name} rank {rank}", plan, graph, r[name], extra=extra)
    return plans, results


def test_hf_decoder_parity_two_ranks():
    plans, results = _check_all(2, CONFIGS_2)
    assert plans["hf-tp-sp"].parallel.sequence_parallel
    for r in results:  # `apply` refuses SP for a model with eager attention
        assert "'eager'" in r["refused"] and r["refused"].endswith("sequence_parallel=False")
    # TP sharded all 7 projections per layer, the embedding and the LM head (Qwen2: and the
    # q/k/v biases).
    assert plans["wrapped-hf-tp-sp"].model.units[1] == "lm.model.layers.0"
    for name in ("hf-tp-sp", "wrapped-hf-tp-sp"):
        assert results[0][name]["sharded"] == 7 * 2 + 2
    assert results[0]["qwen2-tp-sp"]["sharded"] == (7 + 3) * 2 + 2
    # Ring CP moved K/V by send/recv on the cp group.
    ring = results[0]["hf-cp-ring"]
    assert any(r.kind == "send" and r.group == ring["groups"]["cp"] for r in ring["records"])


def test_hf_llama_tp_parity_four_ranks():
    plans, results = _check_all(4, CONFIGS_4_TP)
    assert plans["hf-dpxtp"].model.units[1] == "model.layers.0"
    assert not plans["hf-dpxtp"].parallel.sequence_parallel
    assert plans["hf-dpxtp-sp"].parallel.sequence_parallel
    for name in ("hf-dpxtp", "hf-dpxtp-sp"):
        assert results[0][name]["sharded"] == 7 * 2 + 2


def test_hf_llama_usp_parity_four_ranks():
    plans, _ = _check_all(4, CONFIGS_4_USP)
    assert plans["hf-usp"].parallel.cp_head_degree == 2  # gcd(6, 4)


def test_hf_llama_pipeline_parity_four_ranks():
    plans, results = _check_all(4, CONFIGS_4_PP)
    assert plans["hf-tpxpp-sp"].parallel.sequence_parallel
    # PP ran HF stages of the model (with SP, CP, and two chunks per rank).
    for name in CONFIGS_4_PP:
        assert results[0][name]["kinds"] == ["HFDecoderStage"]


def test_hf_models_that_cannot_be_sharded_are_refused_and_not_planned():
    """What the runtime cannot give positions to is refused in one line naming the fix (here:
    eager attention, which would build a mask for the sharded length and which CP cannot
    redirect; a sliding window shorter than the sequence); the tracer records it
    (`ModelInfo.no_sequence_sharding`), and its tensor parallelism is planned without SP."""
    from meshplan.runtime.context_parallel import check_sequence_sharding, reposition_hf_decoder

    eager = build(attn="eager")
    for fields, fix in (
        (dict(tp=2, micro_batch=1, global_batch=2), "plan with sequence_parallel=False"),
        (dict(cp=2, micro_batch=1, global_batch=2), "plan with cp=1"),
    ):
        with pytest.raises(RuntimePlanError, match="attention implementation 'eager'") as err:
            check_sequence_sharding(eager, make_plan(2, **fields))
        assert str(err.value).endswith(fix) and "\n" not in str(err.value)
    no_sp = make_plan(2, tp=2, micro_batch=1, global_batch=2, sequence_parallel=False)
    assert check_sequence_sharding(eager, no_sp) is False
    assert check_sequence_sharding(build(), make_plan(2, cp=2, micro_batch=1, global_batch=2))

    graph = trace_hf(build("meta", attn="eager"))
    assert "'eager'" in graph.info.no_sequence_sharding
    # Tensor parallelism of the eager attention: its output projection is row-parallel
    # (the product of activations before it closes the heads' region, `passes.sharding`),
    # planned without SP. Session 23 refused it at plan time (the projection was planned
    # column-parallel and the ranks failed); tests/runtime/test_parity_hf_families.py runs
    # it against one process.
    cluster = meshplan.Cluster.preset("cpu", gpus=2)
    plan = meshplan.estimate_plan(graph, cluster=cluster, parallel=meshplan.Parallel(tp=2))
    assert plan.parallel.tp == 2 and not plan.parallel.sequence_parallel
    rows = [k for k, v in plan.placements if k.endswith("self_attn.o_proj.weight")]
    assert rows and all(dict(plan.placements)[k] == "S(1)" for k in rows)  # row-parallel

    # The sequence a step really runs is checked against a sliding window too.
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**CONFIG, sliding_window=SEQ // 2)
    mistral = transformers.MistralForCausalLM._from_config(cfg, attn_implementation="sdpa")
    assert reposition_hf_decoder(mistral, 1, None) == 1
    with pytest.raises(RuntimePlanError, match="exceed the model's sliding window"):
        mistral(batch(1, 0)[0])


def logits_loss(out, targets):
    """An HF-natural loss: it reads `out.logits` and has no fallback for a bare tensor. It
    records the class of what it gets (each rank is a fork with its own copy of the set)."""
    _LOSS_INPUTS.add(type(out).__name__)
    return F.cross_entropy(out.logits.float().reshape(-1, VOCAB), targets.reshape(-1))


_LOSS_INPUTS: set[str] = set()


def _run_logits_loss(plan):
    """Inside a rank: `plan` trained with `logits_loss`; losses, snapshots and the classes the
    loss received."""
    from meshplan.runtime import apply

    runner = apply(build(), plan, logits_loss, sgd)
    losses, states, _ = train(runner, plan.parallel.global_batch, count_step=None, batch_fn=batch)
    return {"losses": losses, "states": states, "loss_inputs": sorted(_LOSS_INPUTS)}


def test_loss_gets_the_model_output_under_pipeline_parallelism():
    """The loss gets what the unsplit model returns (`CausalLMOutputWithPast`) under PP too,
    not the last stage's logits tensor (`pipeline_parallel.as_model_output`), so a loss that
    reads `out.logits` trains under pp=2 and matches one process running the same loss."""
    plan = make_plan(2, pp=2, micro_batch=1, global_batch=2)
    p = plan.parallel
    ref = reference(p.global_batch, p.num_microbatches)
    results = run_local(_run_logits_loss, 2, plan, timeout_s=120)
    assert_parity("hf-pp-logits-loss", ref, results)
    # pipeline rank 1 holds the LM head and runs the loss; rank 0 never calls it
    assert [r["loss_inputs"] for r in results] == [[], ["CausalLMOutputWithPast"]]
