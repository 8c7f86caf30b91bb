"""TP placements from the IR, checked against ground truth: simulate the ranks and compare."""

import meshplan
import pytest
import torch
import torch.nn.functional as F
from meshplan.ir.graph import OpKind
from meshplan.ir.placement import Partial, Replicate, Shard, parse_placement
from meshplan.passes.sharding import tp_param_placements


@pytest.mark.parametrize("p", [Shard(0), Shard(3), Replicate(), Partial("sum"), Partial("max")])
def test_placement_strings_round_trip(p):
    assert parse_placement(str(p)) == p


def test_bad_placement_string():
    with pytest.raises(ValueError, match="not a placement"):
        parse_placement("S(x)")


@pytest.fixture(scope="module")
def tiny():
    model, inputs = meshplan.models.get("tiny", seq_len=32, micro_batch=2)
    graph = meshplan.trace(model, *inputs, name="tiny")
    return graph, dict(tp_param_placements(graph))


def test_megatron_rules_on_the_zoo_model(tiny):
    graph, placements = tiny
    layer = next(k for k, b in graph.blocks if b.kind == "layer")
    expect = {
        "attn.q_proj.weight": "S(0)",
        "attn.k_proj.weight": "S(0)",
        "attn.v_proj.weight": "S(0)",
        "attn.o_proj.weight": "S(1)",
        "mlp.gate_proj.weight": "S(0)",
        "mlp.up_proj.weight": "S(0)",
        "mlp.down_proj.weight": "S(1)",
        "attn_norm.weight": "R",
        "mlp_norm.weight": "R",
    }
    for name, placement in expect.items():
        assert placements[f"{layer}:{name}"] == placement, name
    assert any(k.endswith("embed.weight") and v == "S(0)" for k, v in placements.items())
    assert any(k.endswith("lm_head.weight") and v == "S(0)" for k, v in placements.items())


def _shard(t, placement, rank, n):
    if isinstance(placement, Shard):
        return t.chunk(n, dim=placement.dim)[rank]
    return t


def test_placements_reproduce_the_full_layer_on_simulated_ranks(tiny):
    """Run one real layer sharded over 2 simulated ranks by the pass's placements: the sum of
    the row-parallel partial outputs must equal the unsharded layer."""
    graph, placements = tiny
    layer_key = next(k for k, b in graph.blocks if b.kind == "layer")
    torch.manual_seed(0)
    model, _ = meshplan.models.get("tiny", seq_len=32, device="cpu", dtype="float32")
    layer = model.layers[0]
    x = torch.randn(2, 32, model.cfg.hidden)
    attn, mlp = layer.attn, layer.mlp
    full_attn = attn(x, (model.rope_cos, model.rope_sin))
    full_mlp = mlp(x)
    n = 2
    params = dict(layer.named_parameters())

    def w(name, rank):
        return _shard(params[name], parse_placement(placements[f"{layer_key}:{name}"]), rank, n)

    import torch.nn.functional as F
    from meshplan.models.transformer import apply_rope

    out_attn = torch.zeros_like(full_attn)
    out_mlp = torch.zeros_like(full_mlp)
    hd = attn.head_dim
    for r in range(n):
        q = (x @ w("attn.q_proj.weight", r).T).view(2, 32, -1, hd).transpose(1, 2)
        k = (x @ w("attn.k_proj.weight", r).T).view(2, 32, -1, hd).transpose(1, 2)
        v = (x @ w("attn.v_proj.weight", r).T).view(2, 32, -1, hd).transpose(1, 2)
        cos, sin = model.rope_cos[:32], model.rope_sin[:32]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out_attn += o.transpose(1, 2).reshape(2, 32, -1) @ w("attn.o_proj.weight", r).T
        h = F.silu(x @ w("mlp.gate_proj.weight", r).T) * (x @ w("mlp.up_proj.weight", r).T)
        out_mlp += h @ w("mlp.down_proj.weight", r).T
    torch.testing.assert_close(out_attn, full_attn, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_mlp, full_mlp, rtol=1e-4, atol=1e-5)


def test_stacked_experts_follow_the_column_row_rule_biases_too():
    """GPT-style stacked experts: w_up (E, h, ffn) and its bias b_up (E, 1, ffn) split on the
    ffn dim, w_down (E, ffn, h) on its input dim, b_down replicated; simulated on 2 ranks the
    partial outputs (b_down added once) sum to the unsharded experts' output."""
    cfg = dict(layers=2, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8, experts=4, top_k=2)
    model, _ = meshplan.models.transformer(style="gpt", dtype="float32", micro_batch=1, **cfg)
    example = torch.zeros(1, 8, dtype=torch.long, device="meta")
    graph = meshplan.trace(model, example, example)
    placements = dict(tp_param_placements(graph))
    layer = next(k for k, b in graph.blocks if b.kind == "layer")
    expect = {"w_up": "S(2)", "b_up": "S(2)", "w_down": "S(1)", "b_down": "R"}
    for name, placement in expect.items():
        assert placements[f"{layer}:mlp.experts.{name}"] == placement, name
    assert placements[f"{layer}:mlp.router.gate.weight"] == "R"

    torch.manual_seed(0)
    model, _ = meshplan.models.transformer(style="gpt", dtype="float32", device="cpu", **cfg)
    experts = model.layers[0].mlp.experts
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    x = torch.randn(4, 5, 32)
    full = experts(x)
    params = dict(experts.named_parameters())
    out = torch.zeros_like(full)
    for r in range(2):
        shard = {n: _shard(p, parse_placement(expect[n]), r, 2) for n, p in params.items()}
        act = F.gelu(torch.bmm(x, shard["w_up"]) + shard["b_up"], approximate="tanh")
        out += torch.bmm(act, shard["w_down"]) + (shard["b_down"] if r == 0 else 0)
    torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-4)


def test_each_op_gets_one_role_from_the_rule_of_its_kind():
    """The registry: one rule per op kind. On a GPT-style model (learned positions, tied
    embeddings, biases) the roles are Megatron's, by hand: q/k/v and up column-parallel, the
    attention output and down row-parallel, the token table split on the vocabulary, the
    position table replicated, the tied head vocab-parallel."""
    from meshplan.passes.sharding import RULES, TpRole, tp_sharding

    assert set(RULES) == {OpKind.EMBEDDING, OpKind.MATMUL, OpKind.EXPERTS, OpKind.ELEMENTWISE}
    cfg = dict(layers=2, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8)
    model, _ = meshplan.models.transformer(style="gpt", dtype="float32", micro_batch=1, **cfg)
    example = torch.zeros(1, 8, dtype=torch.long, device="meta")
    graph = meshplan.trace(model, example, example)
    blocks = dict(graph.blocks)
    by_kind = {b.kind: (k, b) for k, b in graph.blocks}

    def roles(kind):
        key, block = by_kind[kind]
        sharding = tp_sharding(blocks[key], graph.info.hidden)
        return [sharding.roles[op.name] for op in block.ops if op.name in sharding.roles]

    C, R = TpRole.COLUMN, TpRole.ROW
    assert roles("layer") == [C, C, C, R, C, R]  # q, k, v, o; up, down
    assert sorted(roles("prologue")) == sorted([TpRole.VOCAB, TpRole.POSITIONS])
    assert roles("epilogue") == [TpRole.LM_HEAD]


def _traced(model, seq=8):
    example = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return meshplan.trace(model, example, example)


def test_a_model_declares_the_roles_the_op_order_rule_cannot_read():
    """An MLP whose inner width is the model width: by op order its down projection looks like
    an input projection (column), which a tp rank cannot run. The zoo declares it row-parallel
    (`meshplan_tp_roles`), and a user model can declare any projection's role the same way."""
    cfg = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=32, vocab=64, seq_len=8)
    model, _ = meshplan.models.transformer(dtype="float32", micro_batch=1, device="meta", **cfg)
    placements = dict(tp_param_placements(_traced(model)))
    assert placements["layer:mlp.down_proj.weight"] == "S(1)"  # row: input features split
    assert placements["layer:mlp.up_proj.weight"] == "S(0)"  # column
    model.meshplan_tp_roles = {"mlp.down_proj.weight": "replicated", "attn.o_proj.*": "row"}
    placements = dict(tp_param_placements(_traced(model)))
    assert placements["layer:mlp.down_proj.weight"] == "R"
    assert placements["layer:attn.o_proj.weight"] == "S(1)"
    model.meshplan_tp_roles = {"mlp.down_proj.weight": "rowwise"}
    with pytest.raises(
        meshplan.ir.TraceError, match=r"meshplan_tp_roles\['mlp.down_proj.weight'\]"
    ):
        _traced(model)
