"""The tracer copies the backward of a layer identical to an earlier one instead of running it
(`ir.trace`, module docstring). Oracle: the same model traced with every backward run
(`DEDUPE_BACKWARD = False`) gives an equal Graph, op for op, on users' models in many styles,
the zoo's presets and models written to defeat the copy (glue that reads a layer's input
again, a layer called twice, an auxiliary loss stashed on a module, checkpointing inside a
layer, layers that differ by index)."""

from __future__ import annotations

import importlib

import meshplan
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.runtime.user_models import MODELS

T = importlib.import_module("meshplan.ir.trace")


def _both(model, *args, kwargs=None, monkeypatch):
    """(graph with the copy, graph without, layers skipped in the first trace run)."""
    skipped: list[int] = []
    copy = T._Capture.copy_skipped

    def counting(self):
        skipped.append(len(self.skipped))
        return copy(self)

    monkeypatch.setattr(T._Capture, "copy_skipped", counting)
    monkeypatch.setattr(T, "DEDUPE_BACKWARD", True)
    fast = meshplan.trace(model, *args, kwargs=kwargs)
    n = skipped[0] if skipped else 0
    monkeypatch.setattr(T, "DEDUPE_BACKWARD", False)
    full = meshplan.trace(model, *args, kwargs=kwargs)
    return fast, full, n


@pytest.mark.parametrize("name", sorted(MODELS))
def test_users_models_trace_the_same(name, monkeypatch):
    um = MODELS[name]
    model = um.build("meta")
    args, kwargs = um.example(model)
    fast, full, _ = _both(model, *args, kwargs=kwargs, monkeypatch=monkeypatch)
    assert fast == full


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_zoo_presets_trace_the_same_and_skip(preset, monkeypatch):
    model, inputs = meshplan.models.get(preset)
    fast, full, n = _both(model, *inputs, monkeypatch=monkeypatch)
    assert fast == full
    layers = sum(1 for u in full.units if not u.name.startswith("<"))
    assert n == layers - 1  # every layer after the first copies its backward


class _Block(nn.Module):
    def __init__(self, d: int, index: int = 0, ckpt: bool = False, window: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.index, self.ckpt, self.window = index, ckpt, window
        self.aux = None

    def _mlp(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))))

    def forward(self, x):
        if self.ckpt:
            y = checkpoint(self._mlp, x, use_reentrant=False, preserve_rng_state=False)
        else:
            y = self._mlp(x)
        if self.window and self.index % 2:  # layers that differ by index
            y = y * 0.5
        self.aux = y.float().pow(2).mean()  # stashed, read by the model's loss
        return x + y


class _Net(nn.Module):
    """Four blocks; `style` picks how the model defeats a naive copy."""

    def __init__(self, style: str, d: int = 16, n: int = 4):
        super().__init__()
        self.style = style
        self.emb = nn.Embedding(32, d)
        self.layers = nn.ModuleList(
            _Block(d, i, ckpt=style == "checkpoint", window=style == "by-index") for i in range(n)
        )
        self.head = nn.Linear(d, 32)
        if style == "frozen":  # a frozen layer computes no weight gradients
            self.layers[1].requires_grad_(False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for i, layer in enumerate(self.layers):
            if self.style == "glue":
                h = layer(h) + 0.5 * h  # the layer's input read again outside it
            elif self.style == "twice" and i == 2:
                h = layer(layer(h))  # one layer called twice
            else:
                h = layer(h)
        loss = self.head(h).float().logsumexp(-1).mean()
        if self.style == "aux":
            loss = loss + sum(layer.aux for layer in self.layers)
        return loss


@pytest.mark.parametrize(
    "style", ["plain", "glue", "twice", "aux", "checkpoint", "by-index", "frozen"]
)
def test_models_written_to_defeat_the_copy_trace_the_same(style, monkeypatch):
    with torch.device("meta"):
        model = _Net(style)
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    fast, full, n = _both(model, tokens, monkeypatch=monkeypatch)
    assert fast == full
    if style == "plain":
        assert n == 3


def test_first_layer_without_input_gradient_keeps_its_own_backward(monkeypatch):
    """The first of three Linear layers reads an input that needs no gradient, so it computes
    no input gradient; the copy must not give it (or take from it) the others' backward."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    fast, full, n = _both(model, torch.empty(4, 8, device="meta"), monkeypatch=monkeypatch)
    assert fast == full
    assert n == 1  # layer 2 copies layer 1, layer 0 is its own


def _hf_model(kind: str):
    tf = pytest.importorskip("transformers")
    small = dict(vocab_size=128)
    configs = {
        # OPT's layers end in a view: the stand-in must carry the views behind its output
        # (found in session 23: the final norm's folded node names moved).
        "opt": (tf.OPTConfig, tf.OPTForCausalLM, dict(num_hidden_layers=4, hidden_size=64,
                num_attention_heads=4, ffn_dim=128, max_position_embeddings=64,
                word_embed_proj_dim=64)),
        "falcon": (tf.FalconConfig, tf.FalconForCausalLM, dict(num_hidden_layers=4,
                   hidden_size=64, num_attention_heads=4)),
        "gptj": (tf.GPTJConfig, tf.GPTJForCausalLM, dict(n_layer=4, n_embd=64, n_head=4,
                 n_positions=64, rotary_dim=8)),
        "t5": (tf.T5Config, tf.T5ForConditionalGeneration, dict(num_layers=4,
               num_decoder_layers=4, d_model=64, d_kv=16, num_heads=4, d_ff=128)),
        "bert": (tf.BertConfig, tf.BertForMaskedLM, dict(num_hidden_layers=4, hidden_size=64,
                 num_attention_heads=4, intermediate_size=128)),
    }  # fmt: skip
    config_cls, model_cls, kw = configs[kind]
    config = config_cls(**small, **kw)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = model_cls(config)
    x = torch.zeros(1, 16, dtype=torch.long, device="meta")
    kwargs = {"labels": x}
    if kind == "t5":
        kwargs["decoder_input_ids"] = x
    if kind in ("opt", "falcon", "gptj"):
        kwargs["use_cache"] = False
    return model, x, kwargs


@pytest.mark.parametrize("kind", ["opt", "falcon", "gptj", "t5", "bert"])
def test_hf_families_beyond_the_matrix_trace_the_same(kind, monkeypatch):
    model, x, kwargs = _hf_model(kind)
    fast, full, _ = _both(model, x, kwargs=kwargs, monkeypatch=monkeypatch)
    assert fast == full
