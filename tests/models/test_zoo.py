"""The model zoo: published parameter counts, meta builds, and MoE dispatch correctness."""

import meshplan.models as models
import pytest
import torch
import torch.nn.functional as F
from meshplan.models.transformer import MoE, TransformerConfig

# Published totals (billions) the presets must reproduce: Llama 3 Herd of Models Table 3
# (8.03B / 70.6B / 405B), Mixtral paper (46.7B), Mixtral 8x22B model card (141B), Llama 2
# paper (6.7B), DeepSeekMoE paper (16.4B).
PUBLISHED_B = {
    "llama3-8b": 8.03,
    "llama3-70b": 70.55,
    "llama3-405b": 405.85,
    "mixtral-8x7b": 46.70,
    "mixtral-8x22b": 140.6,
    "llama2-7b": 6.74,
    "deepseek-moe-16b": 16.4,
    "gpt3-175b": 174.6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_preset_parameter_counts_match_publications(name):
    model, (tokens, targets) = models.get(name)
    n = sum(p.numel() for p in model.parameters())
    assert n == models.config(name).num_params()
    assert abs(n / 1e9 - PUBLISHED_B[name]) / PUBLISHED_B[name] < 0.005
    assert tokens.device.type == "meta" and next(model.parameters()).device.type == "meta"


def test_get_and_transformer_agree():
    a, _ = models.get("tiny", seq_len=128, micro_batch=2)
    cfg = models.config("tiny")
    b, (tok, _) = models.transformer(
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        ffn=cfg.ffn,
        vocab=cfg.vocab,
        seq_len=128,
        micro_batch=2,
    )
    assert tok.shape == (2, 128)
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]


def test_unknown_model_lists_known():
    with pytest.raises(models.UnknownModelError, match="llama3-8b"):
        models.get("llama9-1t")


def test_bad_config_is_one_line_error():
    with pytest.raises(ValueError, match="divisible"):
        models.transformer(layers=2, hidden=100, heads=3, ffn=64, vocab=10)


def _naive_moe(moe: MoE, x_th: torch.Tensor) -> torch.Tensor:
    """Per-token loop over chosen experts: the textbook definition (no capacity limit)."""
    logits = x_th @ moe.router.gate.weight.T
    probs = F.softmax(logits.float(), -1)
    w, idx = torch.topk(probs, moe.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    ex = moe.experts
    out = torch.zeros_like(x_th)
    for t in range(x_th.shape[0]):
        for j in range(moe.top_k):
            e = idx[t, j]
            h = F.silu(x_th[t] @ ex.w_gate[e]) * (x_th[t] @ ex.w_up[e])
            out[t] += w[t, j] * (h @ ex.w_down[e])
    return out


def test_moe_dispatch_matches_naive_loop_when_nothing_is_dropped():
    torch.manual_seed(0)
    cfg = TransformerConfig(2, 32, 4, vocab=50, ffn=16, experts=4, top_k=2, capacity_factor=4.0)
    moe = MoE(cfg)
    x = torch.randn(2, 5, 32)
    got = moe(x).reshape(10, 32)
    torch.testing.assert_close(got, _naive_moe(moe, x.reshape(10, 32)), rtol=1e-5, atol=1e-5)


def test_real_tiny_models_train_on_cpu():
    for name in ("tiny", "tiny-moe"):
        model, (x, y) = models.get(name, device="cpu", dtype="float32", seq_len=32, micro_batch=2)
        loss = model(x, y)
        loss.backward()
        # Untrained: loss near ln(vocab).
        assert abs(loss.item() - torch.log(torch.tensor(1024.0)).item()) < 1.5
        assert all(p.grad is not None for p in model.parameters())
