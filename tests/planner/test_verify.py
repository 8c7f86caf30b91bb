"""`meshplan verify`: a plan's layout at CPU size against one process.

Tiers: `reduced_parallel` and the CLI's usage errors are pure (no processes); the verify runs
are multi-process (2 forked gloo ranks each, a few seconds): a correct TP plan of the zoo's
tiny transformer passes; two models whose code is wrong under tensor parallelism fail, naming
the module: a timm-style fused qkv split `reshape(B, S, 3, heads, head_dim)` (column-sharded,
each rank would hold all of q and part of k), and an MLP that centres its hidden features (a
mean over the features TP splits). The CLI's exit codes 0 / 1 and `launch --verify` run the
installed CLI in child processes (~8 s each, mostly importing torch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import meshplan
import pytest
import torch
import torch.nn.functional as F
from meshplan.cli import app
from meshplan.ir import Cluster, Parallel, Recompute, Schedule
from meshplan.verify import TINY_SEQ, preset_model_fn, reduce_layout, reduced_parallel
from torch import nn
from typer.testing import CliRunner

SEQ, VOCAB, HIDDEN, HEADS = 8, 64, 32, 4


# -- models ----------------------------------------------------------------------------------


class FusedAttention(nn.Module):
    """One qkv projection. `timm=True` splits it as timm does, `(B, S, 3, heads, d)` and
    indexed on the 3: right in one process, wrong when the projection is column-sharded.
    `timm=False` splits it per head (`(B, S, heads, 3 d)`, GPT-NeoX), which TP keeps right:
    the same parameters, so a plan made for it fits the timm model."""

    def __init__(self, timm: bool) -> None:
        super().__init__()
        self.timm, self.heads, self.head_dim = timm, HEADS, HIDDEN // HEADS
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.timm:
            qkv = self.qkv(x).reshape(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
        else:
            qkv = self.qkv(x).view(b, s, self.heads, 3 * self.head_dim).transpose(1, 2)
            q, k, v = qkv.split(self.head_dim, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """`centred=True` subtracts the mean of the hidden features: under TP each rank takes the
    mean of its own shard of them, and nothing in the model's shapes says so."""

    def __init__(self, centred: bool) -> None:
        super().__init__()
        self.centred = centred
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.centred:
            h = h - h.mean(-1, keepdim=True)
        return self.fc2(F.gelu(h))


class Block(nn.Module):
    def __init__(self, timm: bool, centred: bool) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(HIDDEN), FusedAttention(timm)
        self.norm2, self.mlp = nn.LayerNorm(HIDDEN), MLP(centred)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, timm: bool = False, centred: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(timm, centred) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def factory(**kw):
    return lambda: (LM(**kw), (torch.zeros(1, SEQ, dtype=torch.long),))


def tp2_plan(model: nn.Module) -> meshplan.Plan:
    """TP=2 on 2 CPU ranks, as the planner makes it for `model` (SP on)."""
    graph = meshplan.trace(model, torch.zeros(1, SEQ, dtype=torch.long, device="meta"))
    cluster = Cluster.preset("cpu", gpus=2)
    return meshplan.estimate_plan(graph, cluster=cluster, parallel=Parallel(tp=2, global_batch=2))


# -- multi-process: PASS and FAIL -------------------------------------------------------------


def test_correct_tp_plan_of_the_zoo_model_passes():
    """The zoo's Llama shape at verify size under TP=2 + SP: losses and gradients match."""
    layout = Parallel(tp=2, pp=1, dp=1, cp=1, ep=1, micro_batch=1, global_batch=2)
    model_fn = preset_model_fn("llama3-8b", layout)
    model, inputs = model_fn()
    graph = meshplan.trace(model, *inputs)
    plan = meshplan.estimate_plan(graph, cluster=Cluster.preset("cpu", gpus=2), parallel=layout)
    report = meshplan.verify(model_fn, plan)
    assert report.ok, report.summary()
    assert report.world == 2 and report.summary().startswith("PASS (max loss diff")
    assert len(report.reference_losses) == 2 and len(report.rank_losses) == 2
    assert report.max_loss_diff < 1e-4 and report.max_grad_diff < 1e-4
    assert "tp=2" in report.layout and "SP on" in report.layout


def test_timm_fused_qkv_under_tp_fails_naming_qkv():
    """A plan that column-shards a timm-style fused qkv (made for the per-head twin with the
    same parameters) must not PASS: the planner's own rule refuses the layout for this
    model, or the numbers diverge at the attention."""
    plan = tp2_plan(LM(timm=False))
    report = meshplan.verify(factory(timm=True), plan)
    assert not report.ok
    assert report.summary().startswith("FAIL: ")
    assert "blocks.0.attn" in report.divergence and "qkv" in report.divergence, report.divergence


def test_wrong_numbers_under_tp_name_the_module():
    """A model no rule flags, whose code is wrong under TP: the divergence names the MLP (its
    fc1 output still matches: the first module whose output differs is the MLP itself)."""
    plan = tp2_plan(LM(centred=True))
    report = meshplan.verify(factory(centred=True), plan)
    assert not report.ok
    assert "module blocks.0.mlp (parameters blocks.0.mlp.fc1.weight" in report.divergence, (
        report.divergence
    )
    assert "step 1" in report.divergence
    # The same model under DP is right.
    dp = dataclasses.replace(plan.parallel, tp=1, dp=2, sequence_parallel=False)
    assert meshplan.verify(factory(centred=True), dp).ok


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, sequence_parallel=False),
        dict(pp=2, global_batch=4),
        dict(tp=2, pp=2, dp=1, global_batch=4, sequence_parallel=False),
        dict(tp=2, sequence_parallel=True),
        dict(tp=2, dp=2, zero=3, global_batch=4, sequence_parallel=True),
    ],
    ids=["tp2", "pp2", "tp2xpp2", "tp2+sp", "tp2+sp x fsdp"],
)
def test_tied_embeddings_train_as_one_tensor(layout):
    """GPT-style zoo model (learned positions) with the LM head tied to the embedding. Under
    SP the position table's output is cut to the rank's share of the sequence
    (`PositionsSequenceShard`) to add to the sharded token embedding. TP=2: the runtime keeps the
    tie (one vocab-sharded tensor for both); PP=2: stage 0's embedding and the last stage's
    head are two copies whose gradients are summed over the two stages
    (`TiedGradients`). Losses and gradients equal one process (before the fixes the head was
    a second, separately trained copy: FAIL from step 2). ZB-V, which would hold both copies
    on rank 0, is refused at plan time."""
    kw = dict(layers=4, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, style="gpt")
    layout = {"global_batch": 2, **layout}

    def model_fn():
        torch.manual_seed(0)
        m, _ = meshplan.models.transformer(**kw, tie_embeddings=True, dtype="float32", device="cpu")
        return m, (torch.zeros(1, 8, dtype=torch.long),)

    meta, inputs = meshplan.models.transformer(**kw, tie_embeddings=True, micro_batch=1)
    graph = meshplan.trace(meta, *inputs)
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    cluster = Cluster.preset("cpu", gpus=world)
    plan = meshplan.estimate_plan(graph, cluster=cluster, parallel=Parallel(**layout))
    report = meshplan.verify(model_fn, plan)
    assert report.ok, report.summary()
    if layout.get("pp"):
        zbv = Parallel(pp=2, global_batch=4, schedule=Schedule.ZERO_BUBBLE)
        with pytest.raises(ValueError, match="zero_bubble cannot run on this model: .*tied"):
            meshplan.estimate_plan(graph, cluster=cluster, parallel=zbv)


# -- reduced_parallel: pure -------------------------------------------------------------------

_GRAPHS: dict = {}


def tiny_graph(**kw):
    """The zoo's Llama shape, traced on meta (heads 4, kv 2, seq 16; `kw` overrides)."""
    key = tuple(sorted(kw.items()))
    if key not in _GRAPHS:
        cfg = dict(layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq_len=16)
        model, inputs = meshplan.models.transformer(dtype="float32", **{**cfg, **kw})
        _GRAPHS[key] = meshplan.trace(model, *inputs)
    return _GRAPHS[key]


def full(**kw) -> Parallel:
    base = dict(
        dp=1,
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        micro_batch=1,
        global_batch=64,
        recompute="none",
        zero=0,
        schedule="1f1b",
        sequence_parallel=False,
    )
    return Parallel(**{**base, **kw})


@pytest.mark.parametrize(
    "plan, max_ranks, want",
    [
        # dp64 x tp8 x pp4, 1F1B: every degree to 2; 2 micro-batches per pipeline (pp)
        (
            full(dp=64, tp=8, pp=4, global_batch=1024, zero=1, sequence_parallel=True),
            8,
            dict(dp=2, tp=2, pp=2, global_batch=4, zero=1, sequence_parallel=True),
        ),
        # degrees of 1 stay 1; gradient accumulation (32 micro-batches) kept as 2
        (full(dp=8, global_batch=256), 8, dict(dp=2, tp=1, pp=1, global_batch=4)),
        # one micro-batch per replica stays one
        (full(dp=8, global_batch=8), 8, dict(dp=2, global_batch=2)),
        # interleaved 1F1B v=2: pp 2, one round of 2 micro-batches, v kept
        (
            full(pp=8, schedule="interleaved_1f1b", virtual_stages=2, recompute="full"),
            8,
            dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b", global_batch=2),
        ),
        # cp 4 -> 2 (divides the sequence 16); tp 4 -> 2
        (full(cp=4, tp=4, sequence_parallel=True), 8, dict(cp=2, tp=2, global_batch=2)),
        # over 8 ranks (2*2*2*2 = 16): dp dropped first
        (
            full(dp=4, tp=4, pp=4, cp=2, sequence_parallel=True),
            8,
            dict(dp=1, tp=2, pp=2, cp=2, global_batch=2),
        ),
        # at most 4 ranks: then pp (schedule back to 1F1B), keeping tp x cp
        (
            full(dp=4, tp=4, pp=4, cp=2, sequence_parallel=True),
            4,
            dict(dp=1, tp=2, pp=1, cp=2, schedule="1f1b", global_batch=2),
        ),
    ],
)
def test_reduced_parallel(plan, max_ranks, want):
    got = reduced_parallel(plan, tiny_graph(), max_ranks=max_ranks)
    for field, value in want.items():
        assert getattr(got, field) == value, (field, got)
    assert got.micro_batch == 1 and got.recompute == plan.recompute
    assert got.dp * got.tp * got.pp * got.cp <= max_ranks


def test_reduced_parallel_keeps_heads_experts_and_says_what_it_dropped():
    # tp must divide heads 6 and kv_heads 3: 3 (not 2)
    g6 = tiny_graph(hidden=48, heads=6, kv_heads=3)
    assert reduced_parallel(full(tp=8, sequence_parallel=True), g6).tp == 3
    # MoE, ep 8 of dp 32 (4 replicas of each expert shard): ep 2, dp 2 ep = 4
    moe = tiny_graph(experts=4, top_k=2)
    got = reduced_parallel(full(dp=32, ep=8, global_batch=32), moe)
    assert (got.ep, got.dp) == (2, 4)
    # ep = dp: no replicas, dp stays ep
    got = reduced_parallel(full(dp=8, ep=8, global_batch=8), moe)
    assert (got.ep, got.dp) == (2, 2)
    # ZB-V needs 2 layers per rank: pp 2 on 4 layers
    zb = reduced_parallel(full(pp=4, schedule="zero_bubble"), tiny_graph())
    assert (zb.pp, zb.schedule, zb.global_batch) == (2, Schedule.ZERO_BUBBLE, 4)
    # the note names the dropped dimension
    layout = reduce_layout(full(dp=4, tp=4, pp=4, cp=2, sequence_parallel=True), tiny_graph())
    assert any(n.startswith("dp dropped to fit 8 ranks") for n in layout.notes), layout.notes
    # too few layers for the schedule, ep on a dense model: one-line errors
    with pytest.raises(ValueError, match="needs 6 layers"):
        reduced_parallel(
            full(pp=4, schedule="interleaved_1f1b", virtual_stages=3), tiny_graph(layers=2)
        )
    with pytest.raises(ValueError, match="no experts"):
        reduced_parallel(full(dp=2, ep=2, global_batch=2), tiny_graph())
    assert (
        reduced_parallel(full(recompute="selective"), tiny_graph()).recompute == Recompute.SELECTIVE
    )


def test_preset_at_verify_size_holds_the_layout():
    """A zoo preset is built small, of its family, with layers for the pipeline."""
    model, (tokens, _) = preset_model_fn(
        "mixtral-8x7b", full(pp=4, schedule="interleaved_1f1b", virtual_stages=3)
    )()
    assert len(model.layers) == 6 and model.cfg.experts == 4 and model.cfg.num_kv_heads == 2
    assert tokens.shape == (1, TINY_SEQ) and next(model.parameters()).dtype == torch.float32


# -- CLI: usage errors (exit 2, one line) -----------------------------------------------------

runner = CliRunner()


def assert_user_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_usage_errors(tmp_path):
    assert_user_error(runner.invoke(app, ["verify", str(tmp_path / "nope.json")]), "nope.json")
    assert_user_error(runner.invoke(app, ["verify"]), "plan file")
    assert_user_error(
        runner.invoke(app, ["verify", "--tp", "2", "--model", "no-such-model"]), "no-such-model"
    )
    assert_user_error(
        runner.invoke(app, ["verify", "--tp", "2", "--model", str(tmp_path / "m.py:make")]),
        "not found",
    )
    plan = tmp_path / "plan.json"
    tp2_plan(LM()).to_json(plan)
    assert json.loads(plan.read_text())["model"]["name"] == "LM"
    assert_user_error(runner.invoke(app, ["verify", str(plan)]), "not a preset", "--model")
    assert_user_error(runner.invoke(app, ["verify", str(plan), "--tp", "2"]), "not both")


def meshplan_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed CLI in a child process: ranks are forks of it, and `faulthandler` in each
    rank needs the real stderr (CliRunner swaps it for a buffer)."""
    return subprocess.run(
        [sys.executable, "-m", "meshplan.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "COLUMNS": "200"},
    )


def test_cli_pass_and_fail_exit_codes(tmp_path):
    """exit 0 and the PASS line for a pinned layout of a zoo preset; exit 1 and the module for a
    plan file with a user's factory whose code is wrong under TP."""
    r = meshplan_cli("verify", "--model", "tiny", "--dp", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify: dp=2" in r.stdout and "\nPASS (max loss diff" in r.stdout
    plan = tmp_path / "plan.json"
    tp2_plan(LM(centred=True)).to_json(plan)
    model = tmp_path / "centred.py"
    model.write_text(
        "from tests.planner.test_verify import factory\nsmall = factory(centred=True)\n"
    )
    r = meshplan_cli("verify", str(plan), "--model", f"{model}:small")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "plan:   tp=2" in r.stdout and "FAIL: module blocks.0.mlp (" in r.stdout, r.stdout
    # launch --verify refuses to start anything on FAIL
    r = meshplan_cli(
        "launch", str(plan), "--verify", "--verify-model", f"{model}:small", "--dry-run", "--",
        "python", "train.py",
    )  # fmt: skip
    assert r.returncode == 1 and "not launching" in r.stderr and "torchrun" not in r.stdout


def test_reduced_parallel_keeps_the_cp_mode_and_an_asymmetric_split():
    """cp attention and asymmetric shares (HexiSeq) reach the reduced layout: cp 2 with the
    plan's largest : smallest ratio (24576 : 8192 tokens -> 12 + 4 of 16; heads 3 : 1 of
    the small model's 4), "heads" kept where cp divides the heads, each with a note."""
    shares = (24576,) * 4 + (8192,) * 4
    plan = full(
        cp=8, global_batch=1, cp_mode="heads", cp_shares=shares, cp_head_shares=(6,) * 4 + (2,) * 4
    )
    layout = reduce_layout(plan, tiny_graph())
    got = layout.parallel
    assert (got.cp, got.cp_mode, got.cp_shares, got.cp_head_shares) == (2, "heads", (12, 4), (3, 1))
    assert any("12 + 4 of 16 tokens" in n for n in layout.notes), layout.notes
    plain = reduced_parallel(full(cp=4, cp_mode="heads"), tiny_graph())
    assert (plain.cp_mode, plain.cp_shares) == ("heads", None)


def test_asymmetric_cp_plan_verifies():
    """A plan of 6 + 2 tokens and 3 + 1 heads on 2 CPU ranks runs as the plan says and
    matches one process (the runtime's uneven split, `tests/runtime/test_parity_cp_shares.py`,
    through `verify`)."""
    layout = Parallel(
        cp=2, dp=1, tp=1, pp=1, ep=1, micro_batch=1, global_batch=1, cp_mode="heads",
        cp_shares=(12, 4), cp_head_shares=(3, 1),
    )  # fmt: skip
    model_fn = preset_model_fn("llama3-8b", layout)
    model, inputs = model_fn()
    graph = meshplan.trace(model, *inputs)
    plan = meshplan.estimate_plan(graph, cluster=Cluster.preset("cpu", gpus=2), parallel=layout)
    report = meshplan.verify(model_fn, plan)
    assert report.ok, report.summary()
