"""Model facts (`meshplan.ir.facts`, `meshplan.rehearse`): which parallel dimensions the
runtime cannot run on a model, read off the traced data flow and the module tree.

Each model here is written in a style the zoo does not use; the oracle is what the model's
code does under each dimension, derived by hand in the docstrings: a fused q/k/v projection
split into parts before heads would be column-split wrongly, positions counted from the
held length are wrong under context parallelism, and so on. Pure tests: tracing on meta, no
processes.
"""

from __future__ import annotations

import dataclasses

import meshplan
import pytest
import torch
import torch.nn.functional as F
from meshplan.ir import OpKind, Parallel
from meshplan.ir.facts import blocked_dimension, without_blocked
from meshplan.passes.sharding import tp_param_placements
from torch import nn

H, HEADS, VOCAB, SEQ = 32, 4, 64, 16


# -- attention styles ---------------------------------------------------------------------------
class SplitQKV(nn.Module):
    """nanoGPT: one Linear to 3h, `.split(h, dim=2)`: q, k, v are contiguous parts."""

    def __init__(self):
        super().__init__()
        self.n_head, self.c_attn, self.c_proj = HEADS, nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(H, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class ReshapeQKV(nn.Module):
    """timm: `reshape(b, n, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)`: parts outermost."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.qkv, self.proj = HEADS, nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, H // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


class HeadInterleavedQKV(nn.Module):
    """GPT-NeoX: `view(b, s, heads, 3 * d)` then split the last dim: heads outermost, so a
    column split hands each rank whole heads with their own q, k and v (correct)."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.qkv, self.dense = HEADS, nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.num_heads, 3 * (H // HEADS)).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, -1))


class RopeAttention(nn.Module):
    """q/k/v projections (the runtime wraps it under CP) with RoPE tables held as buffers and
    sliced to the length of the sequence the module holds: positions 0..S/cp on every rank."""

    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(H, H) for _ in range(3))
        self.o_proj = nn.Linear(H, H)
        d = H // HEADS
        angles = torch.outer(torch.arange(SEQ).float(), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = self.cos[:t], self.sin[:t]

        def rot(z):
            z1, z2 = z.chunk(2, dim=-1)
            return z * cos + torch.cat([-z2, z1], dim=-1) * sin

        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class HookedRopeAttention(RopeAttention):
    """The same, declaring it handles context parallelism itself."""

    def context_parallel_attention(self, cp):  # pragma: no cover - not run here
        self.cp = cp


class EagerAttention(nn.Module):
    """Attention written out: softmax(q @ k^T / sqrt(d)) @ v (no SDPA to redirect)."""

    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(H, H) for _ in range(3))
        self.o_proj = nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class TorchMHA(nn.Module):
    """`nn.MultiheadAttention`: its q/k/v weights are one raw parameter, not nn.Linear."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(H, HEADS, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False, is_causal=False)[0]


class UnknownHeadCount(nn.Module):
    """Head count under a name the runtime does not divide by tp, `view(b, t, nh, -1)`: one
    tp rank would run all heads at head_dim / tp (wrong numbers, no error)."""

    def __init__(self):
        super().__init__()
        self.nh = HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(H, H) for _ in range(3))
        self.o_proj = nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.nh, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class FullWidthHeads(UnknownHeadCount):
    """nanoGPT's `C // n_head` with C read off the (full-width) input: fails on shards."""

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            p(x).view(b, t, self.nh, c // self.nh).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class PerHeadSlopes(UnknownHeadCount):
    """ALiBi-style per-head values made from the head count at every forward, from Python
    numbers (`torch.tensor([...])`) or an arange: under tp the runtime divides `heads`, so
    each rank would compute the first heads' values, not its own (silently wrong)."""

    def __init__(self, how: str = "python"):
        super().__init__()
        self.heads, self.how = HEADS, how

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.how == "python":
            slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(self.heads)], device=x.device)
        else:
            slopes = 2.0 ** -torch.arange(1, self.heads + 1, device=x.device).float()
        y = F.scaled_dot_product_attention(q * slopes[:, None, None], k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SlopesByArange(PerHeadSlopes):
    def __init__(self):
        super().__init__("arange")


class EagerHeads(UnknownHeadCount):
    """Attention written out (q @ k^T, mask, softmax, @ v) with a head count the runtime
    divides: its output projection closes the heads' region (row-parallel)."""

    def __init__(self):
        super().__init__()
        self.heads = HEADS

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
        y = scores.softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


# -- MLP styles ---------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class FusedGateUp(nn.Module):
    """Phi-3: one Linear to 2 * ffn, `chunk(2, dim=-1)` into gate and up."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(H, 4 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attention, mlp):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn, self.mlp = attention(), mlp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    """Token embedding (+ learned positions), blocks, a head; no `pipeline_stage` hook."""

    def __init__(self, attention=RopeAttention, mlp=MLP, positions=False, tied=False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, H)
        self.pos = nn.Embedding(SEQ, H) if positions else None
        self.blocks = nn.ModuleList([Block(attention, mlp) for _ in range(2)])
        self.head = nn.Linear(H, VOCAB, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids):
        x = self.tok(ids)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class StagedLM(LM):
    def pipeline_stage(self, first, last, units):  # pragma: no cover - not run here
        raise NotImplementedError


def facts(model: nn.Module) -> dict[str, str]:
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return dict(meshplan.trace(model, ids).info.blockers)


def meta(cls, **kw) -> nn.Module:
    with torch.device("meta"):
        return cls(**kw)


@pytest.mark.parametrize(
    "attention, mlp, fused",
    [
        (SplitQKV, MLP, "blocks.0.attn.c_attn"),
        (ReshapeQKV, MLP, "blocks.0.attn.qkv"),
        (RopeAttention, FusedGateUp, "blocks.0.mlp.gate_up"),
        (HeadInterleavedQKV, MLP, None),
        (RopeAttention, MLP, None),
    ],
)
def test_fused_projections_split_into_parts_block_tensor_parallelism(attention, mlp, fused):
    """A projection whose output is split into parts before heads (contiguous q/k/v, timm's
    reshape-and-unbind, a fused gate/up) blocks TP naming it; GPT-NeoX's per-head interleaved
    layout and separate projections do not."""
    why = facts(meta(LM, attention=attention, mlp=mlp)).get("tp", "")
    if fused is None:
        assert why == ""
    else:
        assert f"fused projection {fused}" in why and "parts" in why


def test_a_blocked_dimension_is_never_planned_and_a_pinned_one_is_refused_with_the_reason():
    model = meta(LM, attention=SplitQKV)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    cluster = meshplan.Cluster.preset("cpu", gpus=4)
    plan = meshplan.plan(model, (ids,), cluster, global_batch=8)
    assert plan.parallel.tp == 1 and plan.parallel.pp == 1 and plan.parallel.cp == 1
    with pytest.raises(meshplan.InfeasibleError, match=r"tp=2 cannot run .*fused projection"):
        meshplan.plan(model, (ids,), cluster, global_batch=8, parallel=Parallel(tp=2))
    graph = meshplan.trace(model, ids)
    with pytest.raises(ValueError, match=r"tp=2 cannot run on this model: fused projection"):
        meshplan.estimate_plan(graph, cluster=cluster, parallel=Parallel(tp=2, dp=2))
    # no hook, not the zoo's or HF's shape: cut from its exported graph (`graph_stages`)
    assert not graph.info.blocker("pp")
    meshplan.estimate_plan(graph, cluster=cluster, parallel=Parallel(pp=2, dp=2))


def test_blocked_dimension_rule_table():
    """`blocked_dimension` names the first dimension turned on that is blocked; unset and off
    fields pass; `without_blocked` turns off only unpinned blocked fields."""
    info = dataclasses.replace(
        meshplan.ir.ModelInfo(), blockers=(("cp", "why cp"), ("tp", "why tp"))
    )
    assert blocked_dimension(info, Parallel()) is None
    assert blocked_dimension(info, Parallel(tp=1, cp=1, pp=4)) is None
    assert "tp=2 cannot run on this model: why tp; use tp=1" == blocked_dimension(
        info, Parallel(tp=2)
    )
    assert "why cp" in blocked_dimension(info, Parallel(dp=2, cp=2))
    free = without_blocked(info, Parallel(pp=2))
    assert (free.tp, free.cp, free.pp, free.sequence_parallel) == (1, 1, 2, None)


def test_learned_positions_are_replicated_and_sequence_parallelism_needs_token_ids():
    """An embedding indexed by an arange is a position table: replicated under TP (not split
    on a 'vocabulary' of positions; the runtime cuts its output to the sequence share under
    SP). SP needs a token embedding to shard the sequence: a model fed vectors has none."""
    model = meta(LM, positions=True)
    graph = meshplan.trace(model, torch.zeros(1, SEQ, dtype=torch.long, device="meta"))
    embeds = [op for _, b in graph.unit_blocks() for op in b.ops if op.kind is OpKind.EMBEDDING]
    assert sorted(bool(op.attr("positions")) for op in embeds) == [False, True]
    placements = dict(tp_param_placements(graph))
    assert placements["prologue:pos.weight"] == "R"
    assert placements["prologue:tok.weight"] == "S(0)"
    assert graph.info.blocker("sp") == ""

    class Vectors(LM):  # inputs are vectors (patches, frames): no token embedding
        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    vectors = meshplan.trace(meta(Vectors), torch.zeros(1, SEQ, H, device="meta"))
    assert "Vectors has no token embedding" in vectors.info.blocker("sp")


def test_positions_counted_from_the_held_length_block_context_parallelism():
    """RoPE tables sliced to the local length put every cp rank at positions 0..S/cp: cp is
    refused naming the module, unless the module takes charge (`context_parallel_attention`)."""
    why = facts(meta(LM)).get("cp", "")
    assert "blocks.0.attn reads positions from the length" in why
    assert "slice of a buffer of 16" in why
    assert "cp" not in facts(meta(LM, attention=HookedRopeAttention))


class PackedInput(LM):
    """Takes (source, target) packed in one (batch, 2 x seq) tensor and uses the target half."""

    def forward(self, ids):
        return super().forward(ids[:, SEQ:])


def test_eager_attention_blocks_context_parallelism_sdpa_anywhere_in_a_layer_does_not():
    assert (
        "without F.scaled_dot_product_attention" in facts(meta(LM, attention=EagerAttention))["cp"]
    )
    # SDPA in a layer without q/k/v projections (the runtime redirects the whole layer's);
    # learned positions looked up with 0..n-1 (re-mapped by the runtime): no blocker.
    assert "cp" not in facts(meta(LM, attention=SplitQKV, positions=True))
    # An input that is not (batch, sequence): the runner could not cut it on dim 1.
    packed = meshplan.trace(
        meta(PackedInput, attention=SplitQKV, positions=True),
        torch.zeros(1, 2 * SEQ, dtype=torch.long, device="meta"),
    )
    assert "input 0 has shape [1, 32], not (batch, 16 tokens" in packed.info.blocker("cp")


def test_multihead_attention_is_refused_for_tp_with_its_real_reason():
    why = facts(meta(LM, attention=TorchMHA))["tp"]
    assert "in_proj_weight" in why and "MultiheadAttention" in why
    assert "experts" not in why


class ReversedLM(LM):
    def forward(self, ids):
        x = self.tok(ids)
        for b in reversed(self.blocks):
            x = b(x)
        return self.head(x)


def test_pipeline_cut_needs_layers_that_run_once_in_order_and_untied_weights_for_zbv():
    assert "pp" not in facts(meta(LM))  # cut from its exported graph (`graph_stages`)
    assert "pp" not in facts(meta(StagedLM))
    assert "run out of order" in facts(meta(ReversedLM))["pp"]
    zoo, inputs = meshplan.models.transformer(
        layers=2,
        hidden=32,
        heads=4,
        kv_heads=2,
        ffn=64,
        vocab=64,
        seq_len=16,
        tie_embeddings=True,
    )
    graph = meshplan.trace(zoo, *inputs)
    why = graph.info.blocker("zb")
    assert graph.info.blocker("pp") == ""  # tied copies: gradients summed over stages
    assert "tied" in why and "embed.weight" in why and "ZB-V" in why


@pytest.mark.parametrize(
    "attention, expected",
    [
        (UnknownHeadCount, "would run 4 heads of 4 features instead of 2 of 8"),
        (FullWidthHeads, "one tp=2 rank cannot run the model's code on its shards"),
        (RopeAttention, ""),
        (PerHeadSlopes, "(a tensor of Python values, shape [4]) whose shape follows its head"),
        (SlopesByArange, "(arange, shape [4]) whose shape follows its head count ([2] under"),
        (EagerHeads, ""),
    ],
)
def test_rehearsed_tensor_parallel_rank_catches_head_counts_the_runtime_cannot_localise(
    attention, expected
):
    """One tp rank traced on its shards (`meshplan.rehearse`): a head count the runtime does
    not divide gives heads of head_dim / tp (silently wrong) or a shape error; both block TP
    at plan time. A head count under a known name (`heads`) rehearses cleanly."""
    why = facts(meta(LM, attention=attention)).get("tp", "")
    assert (expected in why) if expected else why == ""


def test_an_attention_written_out_closes_the_heads_region():
    """q @ k^T and probabilities @ v (matmuls of two activations) stand for the attention op
    an unfused attention lacks: the output projection after them is row-parallel, as after
    SDPA (`passes.sharding.row_parallel_ops`); the MLP keeps its column / row pair."""
    from meshplan.passes.sharding import tp_param_placements

    for attention in (EagerHeads, RopeAttention):
        graph = meshplan.trace(
            meta(LM, attention=attention), torch.zeros(1, SEQ, dtype=torch.long, device="meta")
        )
        placements = dict(tp_param_placements(graph))
        o_proj = [v for k, v in placements.items() if k.endswith("attn.o_proj.weight")]
        q_proj = [v for k, v in placements.items() if k.endswith("attn.q_proj.weight")]
        assert o_proj and set(o_proj) == {"S(1)"}, (attention, placements)
        assert q_proj and set(q_proj) == {"S(0)"}


def test_the_zoo_keeps_every_dimension():
    for kw in ({}, {"experts": 4, "top_k": 2}):
        zoo, inputs = meshplan.models.transformer(
            layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq_len=16, **kw
        )
        assert meshplan.trace(zoo, *inputs).info.blockers == ()


def test_plan_json_carries_the_blockers_and_check_plan_refuses_an_edited_plan(tmp_path):
    """The plan records what the runtime cannot run on its model; a plan edited to use it
    (tp raised by hand) is refused by the runtime's plan-only check, before any process."""
    import json

    from meshplan.runtime import RuntimePlanError, check_plan

    model = meta(LM, attention=SplitQKV)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    plan = meshplan.plan(model, (ids,), meshplan.Cluster.preset("cpu", gpus=2), global_batch=4)
    assert "not planned on this model: tp (fused projection" in plan.explain()
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = meshplan.Plan.from_json(path)
    assert again.model.blockers == plan.model.blockers and again.model.blocker("tp")
    check_plan(again)
    edited = dataclasses.replace(again, parallel=dataclasses.replace(again.parallel, tp=2))
    with pytest.raises(RuntimePlanError, match=r"tp=2 cannot run on this model: fused"):
        check_plan(edited)
    data = json.loads(path.read_text())
    data["model"]["blockers"]["xp"] = "bad"
    path.write_text(json.dumps(data))
    with pytest.raises(meshplan.PlanError, match="blockers"):
        meshplan.Plan.from_json(path)
