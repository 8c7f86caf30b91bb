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


def _both(model, *args, kwargs=None, monkeypatch, forward=None):
    """(graph with the copies, graph without, layers whose backward the first trace run
    copied). `forward`, a list, gets the number of layers whose forward it copied."""
    skipped: list[int] = []
    copy = T._Capture.copy_skipped

    def counting(self):
        skipped.append(len(self.skipped))
        if forward is not None and len(forward) == 0:
            forward.append(len(self.fwd_copied))
        return copy(self)

    monkeypatch.setattr(T._Capture, "copy_skipped", counting)
    monkeypatch.setattr(T, "DEDUPE_BACKWARD", True)
    fresh = model if not isinstance(model, nn.Module) else (lambda: model)
    fast = meshplan.trace(fresh(), *args, kwargs=kwargs)
    n = skipped[0] if skipped else 0
    monkeypatch.setattr(T, "DEDUPE_BACKWARD", False)
    full = meshplan.trace(fresh(), *args, kwargs=kwargs)
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
    forward: list[int] = []
    fast, full, n = _both(model, *inputs, monkeypatch=monkeypatch, forward=forward)
    assert fast == full
    layers = sum(1 for u in full.units if not u.name.startswith("<"))
    assert n == layers - 1  # every layer after the first copies its backward
    # ... and its forward (an MoE layer's priced routing with it)
    assert forward == [layers - 1]


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


# -- forward copies ---------------------------------------------------------------------------
# A layer's forward is copied from an earlier layer called the same way (`_Capture._call_key`).
# These models make layers that look alike run differently, through what the key must see.
_MODE = 0  # a global the "global" style's layers read, set by the model before each call
_MASKS: dict = {}  # a module-level cache the "global-cache" style fills on its first call


class _Holder:
    """A plain object shared by every layer (not a module): a cache of sorts."""

    def __init__(self) -> None:
        self.calls = 0


_ARGUMENT = _Holder()  # handed to every layer by the "object" style


class _Same(nn.Module):
    """A block with no per-layer attribute: its forward can be copied unless `style` says."""

    calls = 0  # bumped by the "class" style

    def __init__(self, d: int, style: str, holder: _Holder):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.style, self.holder = style, holder

    def forward(self, x, scale=None, log=None):
        if self.style == "inplace":
            x.mul_(0.5)  # changes its argument in place
        y = self.fc2(torch.relu(self.fc1(self.norm(x))))
        if self.style == "class":
            type(self).calls += 1
            if type(self).calls % 2 == 0:
                y = y * 0.5
        if self.style == "global" and _MODE:
            y = y.tanh()
        if self.style == "global-cache":
            if x.shape[1] not in _MASKS:  # built once, by the first layer
                _MASKS[x.shape[1]] = torch.ones(x.shape[1], 1, device=x.device).cumsum(0)
            y = y * _MASKS[x.shape[1]]
        if self.style == "holder":
            self.holder.calls += 1
            if self.holder.calls == 1:
                y = y.sigmoid()
        if self.style == "cache" and getattr(self, "table", None) is None:
            self.table = torch.ones(x.shape[-1], device=x.device)  # built on first call
        if self.style == "cache":
            y = y * self.table
        if scale is not None:
            y = y * scale
        if self.style == "param-shape":
            y = y * self.gain
        if log is not None:
            log.calls += 1
        if self.style == "returns-input":
            return x + y, x
        return x + y


class _SameNet(nn.Module):
    def __init__(self, style: str, d: int = 16, n: int = 4):
        super().__init__()
        holder = _Holder()
        self.style = style
        self.emb = nn.Embedding(32, d)
        self.layers = nn.ModuleList(_Same(d, style, holder) for _ in range(n))
        self.head = nn.Linear(d, 32)
        if style == "frozen":  # one layer frozen: no weight gradients
            self.layers[2].requires_grad_(False)
        if style == "param-shape":  # a gain per feature on odd layers, one scalar on even
            for i, layer in enumerate(self.layers):
                layer.gain = nn.Parameter(torch.ones(d if i % 2 else 1))

    def forward(self, tokens):
        global _MODE
        h = self.emb(tokens)
        for i, layer in enumerate(self.layers):
            if self.style == "global":
                _MODE = i % 2
            if self.style == "kwarg":
                h = layer(h, scale=2.0 if i % 2 else None)
            elif self.style == "no-grad" and i == 0:
                with torch.no_grad():
                    h = layer(h)
            elif self.style == "checkpoint-some" and i % 2 == 0:
                h = checkpoint(layer, h, use_reentrant=False, preserve_rng_state=False)
            elif self.style == "object":
                h = layer(h, log=_ARGUMENT)
            elif self.style == "returns-input":
                h = layer(h)[0]
            else:
                h = layer(h)
        _MODE = 0
        return self.head(h).float().logsumexp(-1).mean()


@pytest.mark.parametrize(
    ("style", "copied"),
    [
        ("plain", 3),
        ("inplace", 0),  # changes its argument in place: never copied
        ("frozen", None),  # a frozen layer among trainable ones
        ("param-shape", None),  # parameters of another shape, no attribute saying so
        ("class", None),  # a class attribute the forward bumps and branches on
        ("global", None),  # a module global the model sets before each call
        ("global-cache", None),  # a module-level cache the first layer fills
        ("holder", None),  # a shared plain object the forward changes
        ("cache", None),  # a tensor attribute built on the first call
        ("kwarg", None),  # some layers called with another keyword argument
        ("no-grad", None),  # the first layer under torch.no_grad
        ("checkpoint-some", None),  # every other layer checkpointed by the model
        ("object", 0),  # an object argument the layer may change: never copied
        ("returns-input", 0),  # hands its argument back: never copied
    ],
)
def test_forward_copies_only_where_the_call_is_the_same(style, copied, monkeypatch):
    def fresh():  # state the forward changes starts over for each trace
        _Same.calls = 0
        _MASKS.clear()
        with torch.device("meta"):
            return _SameNet(style)

    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    forward: list[int] = []
    fast, full, _ = _both(fresh, tokens, monkeypatch=monkeypatch, forward=forward)
    assert fast == full
    if copied is not None:
        assert forward == [copied]
    else:
        assert forward[0] < 3  # something differed between the calls


def test_a_call_key_that_cannot_be_read_runs_the_layer(monkeypatch):
    """Whatever `_call_key` cannot read (here: every value) makes the layer run its own
    forward: the trace is the full one, never an error."""

    def unreadable(v, depth=0):
        raise RuntimeError("unreadable")

    monkeypatch.setattr(T, "_plain", unreadable)
    with torch.device("meta"):
        model = _SameNet("plain")
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    forward: list[int] = []
    fast, full, _ = _both(model, tokens, monkeypatch=monkeypatch, forward=forward)
    assert fast == full and forward == [0]


def test_moe_layers_copy_their_routing(monkeypatch):
    """Mixtral's original per-expert loop (`torch.where`, sized at the balanced load): the
    second layer copies the first's forward, routing included, and the graph (its note
    naming both MoE modules among them) equals the one traced layer by layer."""
    um = MODELS["sparse-moe"]
    model = um.build("meta")
    args, kwargs = um.example(model)
    forward: list[int] = []
    fast, full, _ = _both(model, *args, kwargs=kwargs, monkeypatch=monkeypatch, forward=forward)
    assert fast == full and forward == [1]
    assert fast.info.assumptions and "2 MoE modules" in fast.info.assumptions[0]
