"""Tracing without importing the compiler (`ir.trace.without_compiler`, `models.SkipInitOnMeta`).

`meshplan plan` never compiles, and importing torch._dynamo costs ~1 s of the command on the
2-core machine. These tests run in a fresh interpreter (the test process may have imported
torch._dynamo already) and check what the stand-in must not change: the traced graph, and a
torch.compile afterwards.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import meshplan
import pytest
import torch
from meshplan.models import SkipInitOnMeta
from meshplan.models.transformer import Transformer

REPO = Path(__file__).resolve().parents[2]


def _fresh(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_trace_leaves_the_compiler_unimported_and_the_graph_unchanged():
    out = _fresh(
        """
        import sys
        import torch
        import meshplan
        from meshplan.ir import trace

        def traced(name):
            model, inputs = meshplan.models.get(name, seq_len=256)
            return trace(model, *inputs)

        before = {n: traced(n) for n in ("llama3-8b", "tiny-moe", "gpt3-1.3b")}
        # a user's file building its model on meta, through `load_model` as the CLI does
        user = meshplan.load_model("examples/models/gpt_neo.py:gpt_neo_27b", seq_len=256)
        trace(user[0], *user[1])
        print("dynamo imported:", "torch._dynamo" in sys.modules)
        import torch._dynamo  # the real package, adopting the settings module loaded alone
        print("config adopted:", torch._dynamo.config is sys.modules["torch._dynamo.config"])
        after = {n: traced(n) for n in before}
        for n in before:
            print(n, "same graph:", before[n].fingerprint() == after[n].fingerprint()
                  and before[n].blocks == after[n].blocks)

        @torch.compile(backend="eager")
        def f(x):
            return torch.sin(x) * 2 + 1

        x = torch.linspace(0, 1, 5)
        print("compile works:", torch.equal(f(x), torch.sin(x) * 2 + 1))
        """
    )
    assert "dynamo imported: False" in out
    assert "config adopted: True" in out
    assert out.count("same graph: True") == 3, out
    assert "compile works: True" in out


def test_a_trace_needing_more_of_the_compiler_runs_again_with_it():
    # A plain tensor attribute (not a buffer) is converted to a fake tensor through
    # torch._dynamo.source: the stand-in stops the trace, which runs again with the real
    # package; the graph is the one traced with the package loaded, and torch.compile works.
    out = _fresh(
        """
        import sys
        import torch
        from torch import nn
        from meshplan.ir import trace

        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)
                self.scale = torch.ones(8)

            def forward(self, x):
                return (self.lin(x) * self.scale).sum()

        torch.manual_seed(0)
        model = Scaled()
        first = trace(model, torch.randn(2, 8))
        print("real package:", type(sys.modules["torch._dynamo"]).__name__ == "module"
              and hasattr(sys.modules["torch._dynamo"], "optimize"))
        again = trace(model, torch.randn(2, 8))
        print("same graph:", first.fingerprint() == again.fingerprint())

        @torch.compile(backend="eager")
        def f(x):
            return x * 2 + 1

        print("compile works:", torch.equal(f(torch.ones(3)), torch.full((3,), 3.0)))
        """
    )
    assert "real package: True" in out, out
    assert "same graph: True" in out
    assert "compile works: True" in out


def test_the_stand_in_answers_only_the_first_call_question():
    from meshplan.ir.trace import _CompilerStandIn, _NeedsCompiler

    stand_in = _CompilerStandIn([])

    def fn():
        return 1

    assert stand_in.disable(fn, True, wrapping=False) is fn  # `_disable_dynamo`'s question
    for call in (
        lambda: stand_in.disable(fn),  # torch._dynamo.disable as a user calls it
        lambda: stand_in.disable(fn, reason="why", wrapping=False),
        lambda: stand_in.disable(recursive=False),  # decorator form
        lambda: stand_in.optimize,
    ):
        with pytest.raises(_NeedsCompiler):
            call()
    assert stand_in.needed


def test_a_trace_after_the_compiler_is_imported_is_the_same():
    # The stand-in is a no-op once the real package is loaded: the graph is the one traced
    # in a fresh interpreter with the stand-in.
    out = _fresh(
        """
        import meshplan
        from meshplan.ir import trace
        model, inputs = meshplan.models.get("tiny", seq_len=128)
        print(trace(model, *inputs).fingerprint())
        """
    )
    import torch._dynamo  # noqa: F401  (loaded here whatever ran before)
    from meshplan.ir import trace

    model, inputs = meshplan.models.get("tiny", seq_len=128)
    assert trace(model, *inputs).fingerprint() == out.strip()


def test_initialisers_are_skipped_on_meta_only():
    cfg = meshplan.models.config("tiny-moe")
    with torch.device("meta"), SkipInitOnMeta():
        meta = Transformer(cfg)
    reference = Transformer(cfg)  # the same modules on the CPU, as torch initialises them
    got = dict(meta.named_parameters())
    for name, p in reference.named_parameters():
        assert got[name].is_meta
        assert (got[name].shape, got[name].dtype, got[name].requires_grad) == (
            p.shape, p.dtype, p.requires_grad,
        )  # fmt: skip
    # On the CPU the mode changes nothing: the same draws from the same seed.
    torch.manual_seed(3)
    with SkipInitOnMeta():
        a = Transformer(cfg)
    torch.manual_seed(3)
    b = Transformer(cfg)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_models_unlike_the_zoo_trace_the_same_without_the_compiler():
    # Written in styles the zoo lacks (tests/runtime/user_models.py): ALiBi per-head values
    # (which needs the compiler midway and is traced again with it), an encoder-decoder, a
    # CNN, a user MoE and nanoGPT; built on meta with initialisers skipped, as `load_model`
    # does. Oracle: the same models traced here, with the real package loaded first.
    names = ("alibi", "enc-dec", "convnet", "user-moe", "nanogpt")
    out = _fresh(
        f"""
        import sys
        from meshplan.ir import trace
        from meshplan.models import SkipInitOnMeta
        from tests.runtime.user_models import MODELS

        for name in {names!r}:
            um = MODELS[name]
            with SkipInitOnMeta():
                model = um.build("meta")
            args, kwargs = um.example(model)
            print(name, trace(model, *args, kwargs=kwargs or None).fingerprint())
        print("compiler loaded:", "torch._dynamo" in sys.modules)
        """
    )
    import torch._dynamo  # noqa: F401
    from meshplan.ir import trace

    from tests.runtime.user_models import MODELS

    for name in names:
        um = MODELS[name]
        model = um.build("meta")
        args, kwargs = um.example(model)
        assert f"{name} {trace(model, *args, kwargs=kwargs or None).fingerprint()}" in out, name
    assert "compiler loaded: True" in out  # ALiBi's trace ran again with the compiler
