"""Users' MoEs that dispatch tokens with data-dependent shapes (`torch.where` per expert,
boolean masks, `nonzero`) trace on meta with each expert's load priced at its balanced
expectation, tokens x top_k / experts rows, and say so (`ModelInfo.assumptions`, the plan's
notes); outside expert dispatch a data-dependent shape is still refused in one line.

Unit tier: meta tensors only, no processes."""

from __future__ import annotations

import meshplan
import pytest
import torch
import torch.nn.functional as F
from meshplan.ir.graph import OpKind
from meshplan.ir.trace import TraceError, trace
from meshplan.runtime import check_plan
from torch import nn

VOCAB, HIDDEN, FFN, EXPERTS, TOP_K = 64, 16, 32, 4, 2
BATCH, SEQ, LAYERS = 2, 16, 2
TOKENS = BATCH * SEQ


class ExpertMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Linear(HIDDEN, FFN, bias=False)
        self.w_out = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


class WhereMoE(nn.Module):
    """Mixtral's original loop: a one-hot of the choices, `torch.where` per expert, rows
    gathered and scattered back with `index_add_`."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = TOP_K
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(ExpertMLP() for _ in range(EXPERTS))

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, s, h = x_bsh.shape
        x_th = x_bsh.reshape(-1, h)
        weights_tk, chosen_tk = self.gate(x_th).softmax(-1).topk(self.top_k, dim=-1)
        expert_mask_ekt = F.one_hot(chosen_tk, len(self.experts)).permute(2, 1, 0)
        out_th = torch.zeros_like(x_th)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(expert_mask_ekt[e])
            y = expert(x_th[token]) * weights_tk[token, slot, None]
            out_th.index_add_(0, token, y)
        return out_th.reshape(b, s, h)


class BoolMaskMoE(WhereMoE):
    """Boolean-mask indexing: `x[mask]` in, `out[mask] +=` back, per expert."""

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        weights_bsk, chosen_bsk = self.gate(x_bsh).softmax(-1).topk(self.top_k, dim=-1)
        out_bsh = torch.zeros_like(x_bsh)
        for e, expert in enumerate(self.experts):
            hit_bsk = chosen_bsk == e
            mask_bs = hit_bsk.any(-1)
            w_bs = (weights_bsk * hit_bsk).sum(-1)
            out_bsh[mask_bs] += expert(x_bsh[mask_bs]) * w_bs[mask_bs][:, None]
        return out_bsh


class NonzeroMoE(WhereMoE):
    """`mask.nonzero()` and `masked_select` of the routing weights."""

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, s, h = x_bsh.shape
        x_th = x_bsh.reshape(-1, h)
        weights_tk, chosen_tk = self.gate(x_th).softmax(-1).topk(self.top_k, dim=-1)
        out_th = torch.zeros_like(x_th)
        for e, expert in enumerate(self.experts):
            hit_tk = chosen_tk == e
            token = hit_tk.any(-1).nonzero().squeeze(1)
            w = torch.masked_select(weights_tk, hit_tk)
            out_th.index_add_(0, token, expert(x_th[token]) * w[:, None])
        return out_th.reshape(b, s, h)


class Block(nn.Module):
    def __init__(self, moe: type[nn.Module]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = moe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    def __init__(self, moe: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(moe) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


MOES = {"where": WhereMoE, "bool-mask": BoolMaskMoE, "nonzero": NonzeroMoE}
ROWS = TOKENS * TOP_K // EXPERTS  # one expert's balanced load


def _trace(moe: type[nn.Module]):
    with torch.device("meta"):
        model = MoELM(moe)
    return trace(model, torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"))


@pytest.fixture(scope="module", params=sorted(MOES))
def graph(request):
    return _trace(MOES[request.param])


def test_traces_with_the_routing_read_off_the_router(graph):
    info = graph.info
    assert (info.experts, info.top_k, info.layers) == (EXPERTS, TOP_K, LAYERS)
    assert [k for k, _ in graph.blocks] == ["prologue", "layer", "epilogue"]


def test_expert_flops_are_the_balanced_load(graph):
    """Each expert runs on tokens x top_k / experts rows: two GEMMs of 2 x rows x h x ffn
    FLOPs forward, twice that backward (input and weight gradients)."""
    experts = graph.block("layer").ops_of(OpKind.EXPERTS)
    assert len(experts) == 2 * EXPERTS
    assert {op.inputs[0].shape[0] for op in experts} == {ROWS}
    fwd = EXPERTS * 2 * (2 * ROWS * HIDDEN * FFN)
    assert sum(op.fwd_flops for op in experts) == fwd
    assert sum(op.bwd_flops for op in experts) == 2 * fwd


def test_assumption_is_noted(graph):
    (note,) = graph.info.assumptions
    assert note.startswith(
        "expert load priced at its balanced expectation, tokens x top_k / experts rows per "
        f"expert (traced: {TOKENS} tokens x top_k {TOP_K} / {EXPERTS} experts = {ROWS} rows)"
    )
    assert f"{LAYERS} MoE modules ('layers.0.moe' .. 'layers.1.moe')" in note
    assert "router's topk" in note


def test_dense_model_has_no_assumptions():
    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mlp = nn.Embedding(VOCAB, HIDDEN), ExpertMLP()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.embed(ids))

    with torch.device("meta"):
        model = Dense()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    assert trace(model, ids).info.assumptions == ()


def test_top1_by_argmax():
    """A Switch-style top-1 router (argmax) gives k = 1; the expert count is the router's
    width."""

    class ArgmaxMoE(WhereMoE):
        def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
            probs_bse = self.gate(x_bsh).softmax(-1)
            choice_bs = probs_bse.argmax(-1)
            out_bsh = torch.zeros_like(x_bsh)
            for e, expert in enumerate(self.experts):
                mask_bs = choice_bs == e
                out_bsh[mask_bs] = expert(x_bsh[mask_bs]) * probs_bse[..., e][mask_bs, None]
            return out_bsh

    graph = _trace(ArgmaxMoE)
    (note,) = graph.info.assumptions
    assert f"{TOKENS} tokens x top_k 1 / {EXPERTS} experts = {TOKENS // EXPERTS} rows)" in note
    experts = graph.block("layer").ops_of(OpKind.EXPERTS)
    assert {op.inputs[0].shape[0] for op in experts} == {TOKENS // EXPERTS}


def test_without_a_routing_op_the_attributes_decide():
    """Threshold routing (no topk, no argmax): experts from `len(experts)`, top_k from the
    module's `top_k`, tokens from the MoE module's input."""

    class ThresholdMoE(WhereMoE):
        def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
            on_bse = self.gate(x_bsh).sigmoid() > 0.5
            out_bsh = torch.zeros_like(x_bsh)
            for e, expert in enumerate(self.experts):
                out_bsh[on_bse[..., e]] += expert(x_bsh[on_bse[..., e]])
            return out_bsh

    graph = _trace(ThresholdMoE)
    (note,) = graph.info.assumptions
    assert f"{TOKENS} tokens x top_k {TOP_K} / {EXPERTS} experts = {ROWS} rows)" in note
    assert "top_k 2 from its attributes" in note
    experts = graph.block("layer").ops_of(OpKind.EXPERTS)
    assert {op.inputs[0].shape[0] for op in experts} == {ROWS}


def test_plan_notes_the_assumption_and_refuses_ep():
    """Data parallelism plans; expert parallelism is refused at plan time (experts in a
    ModuleList are not a shape the runtime shards, `ir.facts`), and the plan carries the
    assumption."""
    graph = _trace(WhereMoE)
    cluster = meshplan.Cluster.preset("cpu", gpus=2)
    plan = meshplan.plan(graph, cluster=cluster, time_limit_s=2.0)
    assert (plan.parallel.ep, plan.parallel.tp) == (1, 1)
    assert graph.info.assumptions[0] in plan.predicted.notes
    assert "note: expert load priced at its balanced expectation" in plan.explain()
    assert meshplan.Plan.from_json(plan.to_json()).predicted.notes == plan.predicted.notes
    check_plan(plan)  # the runtime takes it
    assert "not of a shape the runtime shards" in graph.info.blocker("ep")
    with pytest.raises(ValueError, match=r"ep=2 cannot run on this model: MoE experts"):
        meshplan.plan(
            graph, cluster=cluster, parallel=meshplan.Parallel(dp=2, ep=2), time_limit_s=2.0
        )


class RowsAbove(nn.Module):
    """Not an MoE: keeps the positive activations (a data-dependent number of them)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if self.how == "nonzero":
            return y.flatten()[(y.flatten() > 0).nonzero().squeeze(1)].sum()
        return y[y > 0].sum()


class Outer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = RowsAbove(how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


@pytest.mark.parametrize(
    ("how", "op"), [("nonzero", "aten.nonzero.default"), ("mask", "aten.index.Tensor")]
)
def test_data_dependent_shape_outside_an_moe_is_refused(how: str, op: str):
    with torch.device("meta"):
        model = Outer(how)
    with pytest.raises(TraceError) as err:
        trace(model, torch.empty(2, 8, device="meta"))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"data-dependent output shape in module 'inner' (RowsAbove) at op {op}")
