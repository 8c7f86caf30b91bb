"""Pipeline stages cut from a model's exported graph (`runtime.graph_stages`), one process.

Oracle: the unsplit model. Running the chunk-stages one after another (each fed what the
previous one returns) must give the model's own output object and, after backward, the same
gradient on every parameter. Multi-process runs of these cuts under the pipeline schedules
are in the model matrix (`test_model_matrix.py`, the `pp` / `tpxpp` / `solver-pp` cells).
"""

from __future__ import annotations

import pytest
import torch
from meshplan.ir.trace import find_layer_container
from meshplan.runtime.errors import RuntimePlanError
from meshplan.runtime.graph_stages import graph_cut
from torch import nn
from torch.utils import _pytree as pytree

from tests.runtime.user_models import MODELS

# Written in styles unlike the zoo: tied embeddings + learned positions, conv patches + cls
# token, skip connection (encoder output read by every decoder layer), MoE; BART writes its
# shifted decoder inputs in place and returns two tensors.
CASES = ["nanogpt", "vit", "enc-dec", "user-moe", "hf-gpt2", "hf-bart"]


def _run_stages(cut, x):
    v = (x,)
    for i, stage in enumerate(cut.stages):
        v = stage(*v)
        if i < len(cut.stages) - 1 and not isinstance(v, tuple):
            v = (v,)
    return cut.model_output(v)


def _loss(out) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return sum(t.float().square().mean() for t in leaves if t.requires_grad)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("layout", ["halves", "edges"])
def test_stages_equal_the_unsplit_model(name, layout):
    um = MODELS[name]
    model = um.build()
    x, _ = um.batch(2, 0)
    _, units = find_layer_container(model)
    n = len(units)
    if layout == "halves":  # two chunks, prologue with the first half, epilogue with the second
        unit_chunk, chunks, epilogue = {u: int(i >= n // 2) for i, u in enumerate(units)}, 2, 1
    else:  # a chunk of only the prologue and one of only the epilogue around the layers
        unit_chunk, chunks, epilogue = {u: min(i + 1, 2) for i, u in enumerate(units)}, 4, 3
        if n > 2:
            pytest.skip("edges layout written for 2 layers")
    ref = model(x)
    _loss(ref).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    cut = graph_cut(model, x, unit_chunk, chunks, epilogue)
    # every parameter lives on the stage(s) whose modules hold it, under its own name
    names = {k for s in cut.stages for k, _ in s.named_parameters(remove_duplicate=False)}
    assert names <= {k for k, _ in model.named_parameters(remove_duplicate=False)}
    out = _run_stages(cut, x)
    assert type(out) is type(ref)
    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    _loss(out).backward()
    got = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


def test_skip_connections_pass_through_the_stages_between():
    """The encoder's output (made on stage 0) is read by decoder layers on stages 1 and 2: it
    travels through stage 1 as an extra output, never straight from 0 to 2."""
    um = MODELS["enc-dec"]
    model = um.build()
    x, _ = um.batch(1, 0)
    _, units = find_layer_container(model)
    cut = graph_cut(model, x, {units[0]: 1, units[1]: 2}, 3, 2)
    sent = [len([n for n in s.graph.nodes if n.op == "placeholder"]) for s in cut.stages]
    assert sent[0] == 1  # the model's input
    assert sent[1] >= 2 and sent[2] >= 2  # the hidden state and the memory, at each stage


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in [*self.layers, self.layers[0]]:
            x = layer(x)
        return x


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            x = x * 2
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_unit_called_twice_is_refused_in_one_line():
    with pytest.raises(RuntimePlanError, match=r"layers\.0.*runs 2 times") as e:
        graph_cut(_Twice(), torch.ones(2, 4), {"layers.0": 0, "layers.1": 1}, 2)
    assert "\n" not in str(e.value)


def test_a_model_export_cannot_capture_is_refused_with_the_reason():
    with pytest.raises(RuntimePlanError, match="torch.export failed") as e:
        graph_cut(_DataDependent(), torch.ones(2, 4), {"layers.0": 0, "layers.1": 1}, 2)
    assert "\n" not in str(e.value) and "pipeline_stage" in str(e.value)


def test_plan_time_blocker_for_units_called_twice():
    """The tracer sees the same call order the cut needs: pp is refused at plan time."""
    import meshplan

    with torch.device("meta"):
        model = _Twice()
    graph = meshplan.trace(model, torch.ones(2, 4, device="meta"))
    assert "runs 2 times" in graph.info.blocker("pp")


def test_plan_time_refusal_when_torch_export_cannot_capture_the_model():
    """The cut is rehearsed when the model is traced, so a plan never asks for it."""
    import meshplan

    graph = meshplan.trace(_ObjectArgument(), torch.ones(2, 4))
    assert "torch.export failed" in graph.info.blocker("pp")
    ok = meshplan.trace(
        MODELS["nanogpt"].build("meta"), MODELS["nanogpt"].batch(1, 0)[0].to("meta")
    )
    assert not ok.info.blocker("pp")


class _Context:
    """A plain Python object handed to every layer (not a tensor, not a pytree)."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale


class _ContextLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, ctx: _Context):
        return self.fc(x) * ctx.scale


class _ObjectArgument(nn.Module):
    """Traces (the tracer runs the Python as written), but its layers take an object
    torch.export cannot flatten into a preserved call signature."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_ContextLayer() for _ in range(2))

    def forward(self, x):
        ctx = _Context(torch.ones((), device=x.device))
        for layer in self.layers:
            x = layer(x, ctx)
        return x


def test_an_export_that_fails_on_fake_tensors_logs_nothing():
    """Found in session 23: planning HF BLOOM (its alibi `baddbmm` fails on the export's fake
    tensors) printed torch's 15-line traceback before the plan; the failure is a one-line pp
    blocker, so torch's own log of it is held back."""
    import logging

    import meshplan

    tf = pytest.importorskip("transformers")
    config = tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=64)
    with torch.device("meta"):
        model = tf.BloomForCausalLM(config)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("torch._subclasses.fake_tensor")
    handler = Keep(level=logging.ERROR)
    log.addHandler(handler)
    try:
        x = torch.zeros(1, 16, dtype=torch.long, device="meta")
        graph = meshplan.trace(model, x, kwargs={"labels": x, "use_cache": False})
    finally:
        log.removeHandler(handler)
    assert "torch.export failed" in graph.info.blocker("pp")
    assert not records, records[0].getMessage()
