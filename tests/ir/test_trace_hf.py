"""`meshplan.ir.trace` on Hugging Face models built from tiny configs (no download).

Each model is traced on the meta device and checked against the same config instantiated for
real on the CPU: exact parameter count, and training FLOPs against FlopCounterMode (see
tests/ir/test_trace.py for the two oracle set-ups and why both are honest).
"""

from __future__ import annotations

import pytest
import torch
from meshplan.ir import Graph, OpKind, TraceError, trace
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten
# torch's own sdpa formulas on the CPU kernel FlopCounterMode does not register
_FLASH_AS_FLOP_COUNTER = {
    aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *a, out_val=None, **kw: sdpa_flop_count(q, k, v)
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda go, q, k, v, *a, out_val=None, **kw: sdpa_backward_flop_count(go, q, k, v)
    ),
}


def all_ops(graph: Graph):
    return [op for _, block in graph.unit_blocks() for op in block.ops]


def flash_recompute(graph: Graph) -> int:
    """Backward attention FLOPs beyond 2x forward: flash attention's recomputation of QK^T."""
    return sum(
        op.bwd_flops - 2 * op.fwd_flops for op in all_ops(graph) if op.kind == OpKind.ATTENTION
    )


LAYERS, BATCH, SEQ = 3, 2, 16


def _common() -> dict:
    return {
        "num_hidden_layers": LAYERS,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    }


def _config(kind: str):
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=LAYERS,
            n_embd=64,
            n_head=4,
            vocab_size=128,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    common = _common()
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)


def _build(kind: str, device: str, **kw):
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            _config(kind), attn_implementation="sdpa", **kw
        )


# Mixtral's default experts loop is data-dependent; batched_mm is static and made of bmm, which
# FlopCounterMode counts on real tensors.
_EXTRA = {"gpt2": {}, "llama": {}, "mixtral": {"experts_implementation": "batched_mm"}}


def _inputs(device: str):
    ids = torch.randint(0, 128, (BATCH, SEQ)).to(device)
    return ids, {"labels": ids, "use_cache": False}


@pytest.fixture(scope="module", params=["gpt2", "llama", "mixtral"])
def traced(request):
    kind = request.param
    meta_model = _build(kind, "meta", **_EXTRA[kind])
    ids, kwargs = _inputs("meta")
    return kind, meta_model, trace(meta_model, ids, kwargs=kwargs)


def test_param_count_exact(traced):
    _, model, graph = traced
    assert graph.num_params() == sum(p.numel() for p in model.parameters())
    assert sum(b.num_params for _, b in graph.unit_blocks()) == graph.num_params()


def test_blocks_deduplicated(traced):
    kind, _, graph = traced
    assert [k for k, _ in graph.blocks] == ["prologue", "layer", "epilogue"]
    prefix = "transformer.h" if kind == "gpt2" else "model.layers"
    assert [u.name for u in graph.layer_units] == [f"{prefix}.{i}" for i in range(LAYERS)]
    assert graph.info.layers == LAYERS
    kinds = {op.kind for op in all_ops(graph)}
    assert {OpKind.MATMUL, OpKind.ATTENTION, OpKind.NORM, OpKind.EMBEDDING, OpKind.LOSS} <= kinds


def test_training_flops_match_flop_counter(traced):
    kind, _, graph = traced
    model = _build(kind, "cpu", **_EXTRA[kind])
    ids, kwargs = _inputs("cpu")

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, **kwargs).loss.backward()

    ours = graph.total_flops()
    with FlopCounterMode(display=False, custom_mapping=_FLASH_AS_FLOP_COUNTER) as counter:
        step()
    flash = counter.get_total_flops()
    assert abs(ours - flash) <= 0.02 * flash, (ours, flash)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    math = counter.get_total_flops()
    assert abs(ours - flash_recompute(graph) - math) <= 0.02 * math, (ours, math)


def test_model_info(traced):
    kind, _, graph = traced
    info = graph.info
    assert (info.hidden, info.heads, info.head_dim, info.vocab) == (64, 4, 16, 128)
    assert (info.seq_len, info.micro_batch) == (SEQ, BATCH)
    assert info.kv_heads == (4 if kind == "gpt2" else 2)
    assert info.ffn == (256 if kind == "gpt2" else 96)


def test_mixtral_router_and_experts(traced):
    kind, _, graph = traced
    if kind != "mixtral":
        pytest.skip("MoE only")
    layer = graph.block("layer")
    router, experts = layer.ops_of(OpKind.ROUTER), layer.ops_of(OpKind.EXPERTS)
    assert any(op.target.startswith("aten.topk") for op in router)
    assert any(op.module == "mlp.gate" and op.fwd_flops > 0 for op in router)
    assert experts and all(op.module.startswith("mlp.experts") for op in experts)
    assert (graph.info.experts, graph.info.top_k) == (4, 2)


def test_mixtral_eager_experts_loop_is_reported():
    model = _build("mixtral", "meta", experts_implementation="eager")
    ids, kwargs = _inputs("meta")
    with pytest.raises(TraceError, match="data-dependent.*mlp.experts"):
        trace(model, ids, kwargs=kwargs)


def test_sequence_sharding_flag(traced):
    """The tracer marks HF models the runtime cannot run on sequence shards (SP, CP): GPT-2
    counts positions from its hidden state outside the Llama decoder shape; Llama and Mixtral
    (that shape, SDPA) are left unmarked."""
    kind, _, graph = traced
    why = graph.info.no_sequence_sharding
    if kind == "gpt2":
        assert why.startswith("GPT2LMHeadModel is a HuggingFace model outside the Llama decoder")
    else:
        assert why == ""


def test_sequence_sharding_blocker_reasons():
    """Eager attention and a sliding window shorter than the sequence block sequence
    sharding; a window at least as long as the sequence, and non-HF models, do not."""
    from meshplan.ir.trace import sequence_sharding_blocker
    from meshplan.models import transformer

    with torch.device("meta"):
        eager = transformers.AutoModelForCausalLM.from_config(
            _config("llama"), attn_implementation="eager"
        )
        mistral = transformers.MistralForCausalLM._from_config(
            transformers.MistralConfig(**{**_common(), "sliding_window": 8}),
            attn_implementation="sdpa",
        )
    assert "attention implementation 'eager'" in sequence_sharding_blocker(eager, SEQ)
    assert "sliding window of 8 < 16 tokens" in sequence_sharding_blocker(mistral, SEQ)
    assert sequence_sharding_blocker(mistral, 8) == ""
    zoo, _ = transformer(layers=2, hidden=32, heads=4, ffn=64, vocab=64, seq_len=SEQ)
    assert sequence_sharding_blocker(zoo, SEQ) == ""
    # HF models inside a user's module are judged too: a bare LlamaModel is the decoder body.
    with torch.device("meta"):
        gpt2 = transformers.AutoModelForCausalLM.from_config(_config("gpt2"))
        body = transformers.LlamaModel._from_config(_config("llama"), attn_implementation="sdpa")
    wrapper = torch.nn.ModuleDict({"lm": gpt2, "zoo": zoo})
    assert sequence_sharding_blocker(wrapper, SEQ).startswith("GPT2LMHeadModel (at 'lm') is a")
    assert sequence_sharding_blocker(torch.nn.ModuleDict({"body": body}), SEQ) == ""


def test_traced_as_users_do_without_labels():
    """`trace(hf_model, input_ids)`: no loss in the output, so the logits of the ModelOutput
    are differentiated; the same FLOPs as with labels bar the loss's own ops (the LM head's
    GEMM and everything before it are there). A dict output is searched the same way."""
    model = _build("llama", "meta")
    ids, kwargs = _inputs("meta")
    plain = trace(model, ids)
    with_labels = trace(model, ids, kwargs=kwargs)
    matmul = [op.fwd_flops for op in all_ops(plain) if op.kind is OpKind.MATMUL]
    assert matmul == [op.fwd_flops for op in all_ops(with_labels) if op.kind is OpKind.MATMUL]

    class DictOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(128, 16)
            self.head = torch.nn.Linear(16, 128)

        def forward(self, ids):
            return {"hidden": self.emb(ids).detach(), "logits": self.head(self.emb(ids))}

    with torch.device("meta"):
        graph = trace(DictOut(), ids)
    assert graph.num_params() == 128 * 16 + 16 * 128 + 128


def test_sliding_window_zero_or_switched_off_is_no_window():
    """HF writes "no window" as `sliding_window=0` or `use_sliding_window=False` (Qwen2):
    neither is read as a window shorter than the sequence."""
    from meshplan.ir.trace import sequence_sharding_blocker

    with torch.device("meta"):
        zero = transformers.Qwen2ForCausalLM._from_config(
            transformers.Qwen2Config(**{**_common(), "sliding_window": 0}),
            attn_implementation="sdpa",
        )
        off = transformers.Qwen2ForCausalLM._from_config(
            transformers.Qwen2Config(
                **{**_common(), "sliding_window": 4, "use_sliding_window": False}
            ),
            attn_implementation="sdpa",
        )
    assert sequence_sharding_blocker(zero, SEQ) == ""
    assert sequence_sharding_blocker(off, SEQ) == ""


def test_moe_experts_that_need_bf16_get_a_one_line_hint():
    """transformers' default `grouped_mm` experts run only in bf16: fp32 tracing fails with
    the fix named (bf16, or experts_implementation='batched_mm')."""
    model = _build("mixtral", "meta")
    with pytest.raises(TraceError, match="experts_implementation='batched_mm'") as err:
        trace(model, _inputs("meta")[0])
    assert "\n" not in str(err.value)


def test_hf_shapes_the_runtime_cannot_run_are_blocked_with_their_reason(traced):
    """GPT-2 (fused c_attn split into q/k/v, eager attention, learned positions; cut into
    stages from its exported graph, but its tied embeddings keep it off ZB-V), Mixtral's
    stacked experts (expert parallelism by token dispatch, but not expert tensor
    parallelism): blocked dimensions, named. Llama runs every dimension."""
    kind, _, graph = traced
    dims = ("tp", "sp", "cp", "pp", "ep", "zb")
    blocked = {d: graph.info.blocker(d) for d in dims if graph.info.blocker(d)}
    if kind == "llama":
        assert blocked == {}
    elif kind == "gpt2":
        assert set(blocked) == {"tp", "sp", "cp", "zb"}
        assert "c_attn" in blocked["tp"] and "tied" in blocked["zb"]
    else:
        assert set(blocked) == {"tp"} and "MixtralExperts" in blocked["tp"]


def test_gradient_checkpointing_inside_the_model_is_traced_as_it_runs():
    """Found in session 23: an HF model with gradient checkpointing on, built on meta, failed
    to trace (its recomputation ran outside the tracer's parameter swap: meta and fake
    tensors mixed), and the tp rehearsal of such models failed the same way. Non-reentrant
    checkpointing now traces: the recomputed forward lands in the backward (at most the
    layers' forward FLOPs more; torch stops the replay once the saved tensors are back),
    fewer activations are saved, and nothing is blocked. Reentrant checkpointing is refused
    in one line with what to do."""
    from tests.runtime.user_models import MODELS

    um = MODELS["hf-llama"]
    model = um.build("meta")
    args, kwargs = um.example(model)
    plain = trace(model, *args, kwargs=kwargs)
    layer_fwd = sum(
        op.fwd_flops for u, b in plain.unit_blocks() if not u.name.startswith("<") for op in b.ops
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ckpt = trace(model, *args, kwargs=kwargs)
    extra = ckpt.total_flops() - plain.total_flops()
    assert 0 < extra <= layer_fwd
    assert ckpt.saved_activation_bytes() < plain.saved_activation_bytes()
    assert ckpt.info.blockers == plain.info.blockers
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(TraceError, match="reentrant activation checkpointing"):
        trace(model, *args, kwargs=kwargs)
