"""Tensor-parallel sharding read off the operator IR: one rule per op kind, one role per op.

Pass: `tp_sharding(block, hidden) -> BlockSharding`; `tp_param_placements(graph) -> tuple[(key,
  placement), ...]` for every block.
Requires: a traced Graph whose MATMUL/EXPERTS/EMBEDDING ops list the parameters they read and
  whose `info.hidden` is known.
Ensures: every parameterised op of a block gets a `TpRole` and every parameter one placement
  on the tp mesh axis, keyed `"<block>:<param name relative to the unit>"` and rendered
  compactly (`S(0)`, `R`). The cost model prices each role's collectives
  (`cost_model.graph_costs`, `compute`) and the runtime shards by the placements the plan
  records (`runtime.tensor_parallel`): one decision, three readers.

The rules (Shoeybi et al. 2019, "Megatron-LM", Sec. 3), registered per op kind with
`sharding_rule` (in the spirit of DTensor's per-op sharding strategies):

- projections (MATMUL, EXPERTS): inside a layer, those that close a parallel region (attention
  output, MLP down; `row_parallel_ops`) are *row-parallel* (ROW): the weight is split along
  its input features and the output is a partial sum (one all-reduce, or a reduce-scatter
  under sequence parallelism); a bias is added once, after the reduction (replicated). Every
  other projection (q/k/v, MLP up/gate) is *column-parallel* (COLUMN): the weight is split
  along its output features, a bias with it, and no communication is needed. Outside the
  layers a projection from the model width to another width is the LM head (LM_HEAD:
  column-parallel, vocab-sharded logits). A convolution (a patch embedding) is replicated.
  Stacked expert weights `(experts, in, out)` follow the same column/row rule on their last
  two dims (expert parallelism, when used, splits dim 0 on the ep axis).
- embeddings: a vocabulary is split along its rows (VOCAB: the output is a partial sum); a
  table of learned positions, looked up with an arange (`ir.facts`), is replicated
  (POSITIONS).
- an expert bias added by its own ELEMENTWISE op right after a column-parallel expert GEMM
  (GPT-style `b_up`, `(experts, 1, ffn)`) is split with that GEMM's output (its last dim); one
  after a row-parallel expert GEMM (`b_down`) is replicated.
- everything else (norm weights, MoE router gates, biases added by a separate op) is
  replicated.
- a model may declare a projection's role itself (`meshplan_tp_roles`, recorded on its ops as
  `tp_role` by the tracer, `ir.trace.with_declared_tp_roles`): "row", "column" or
  "replicated" then replaces the op-order rule, as torchtitan's per-model plans do.

Which weight dim holds the output features is read from shapes: `nn.Linear` stores
`(out, in)`, GPT-2's `Conv1D` stores `(in, out)`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from meshplan.ir.graph import Block, Graph, Op, OpKind, Param
from meshplan.ir.placement import Placement, Replicate, Shard


class TpRole(enum.StrEnum):
    """What tensor parallelism makes of one parameterised op (module docstring)."""

    COLUMN = "column"  # weight split on its output features; output sharded, no communication
    ROW = "row"  # weight split on its input features; output a partial sum
    LM_HEAD = "lm_head"  # column-parallel outside the layers: vocab-sharded logits
    VOCAB = "vocab"  # embedding split on its vocabulary; output a partial sum
    POSITIONS = "positions"  # a table of learned positions: replicated
    REPLICATED = "replicated"  # convolutions and the rest: replicated, no communication


def row_parallel_ops(block: Block, hidden: int) -> tuple[Op, ...]:
    """The parameterised projections of `block` that are row-parallel under Megatron TP.

    Data flow is not in the IR, so the rule reads op order and widths: the first projection
    after an attention op or an unfused attention's product of activations
    (`_activation_product`: the attention output projection) and any projection whose input
    width is not the model width (the MLP down projection, fed by the FFN width) are
    row-parallel. Each needs one all-reduce of its output in forward and one of its input
    gradient's counterpart in backward.
    """
    rows: list[Op] = []
    after_attention = False
    for op in block.ops:
        if op.kind is OpKind.ATTENTION or _activation_product(op):
            after_attention = True
            continue
        if op.kind not in (OpKind.MATMUL, OpKind.EXPERTS) or not op.params:
            continue
        if after_attention or _input_width(op, hidden) != hidden:
            rows.append(op)
        after_attention = False
    return tuple(rows)


def _activation_product(op: Op) -> bool:
    """A matmul of two activations (no parameter, both at least 3-D): the scores (q @ k^T)
    or the context (probabilities @ v) of an attention written out instead of fused (HF's
    eager attention, a user's own), which runs on the heads a tp rank holds like a fused
    one, so the next projection closes the parallel region."""
    if op.kind is not OpKind.MATMUL or op.params:
        return False
    return sum(1 for t in op.inputs if len(t.shape) >= 3) >= 2


def _input_width(op: Op, hidden: int) -> int:
    """Feature width of a projection's activation input: its first input of two or more dims
    (`addmm` lists the 1-D bias first, then the activation and the weight; `mm` and `bmm` the
    activation first)."""
    for t in op.inputs:
        if t.shape and len(t.shape) >= 2:
            return t.shape[-1]
    return hidden


def _linear_placement(weight: Param, op: Op, row_parallel: bool) -> Placement:
    out_features = op.outputs[0].shape[-1] if op.outputs and op.outputs[0].shape else -1
    last, second_last = len(weight.shape) - 1, len(weight.shape) - 2
    # nn.Linear stores (out, in); Conv1D-style layers store (in, out). A square weight is
    # taken as nn.Linear, the common case.
    out_dim = second_last if weight.shape[second_last] == out_features else last
    in_dim = last if out_dim == second_last else second_last
    return Shard(in_dim) if row_parallel else Shard(out_dim)


@dataclass(frozen=True, slots=True)
class OpSharding:
    """One op's role and the placements of the parameters it decides (others: replicated)."""

    role: TpRole | None  # None: the op decides parameters but has no role of its own
    params: tuple[tuple[str, Placement], ...] = ()


@dataclass(slots=True)
class _Walk:
    """What a rule may read while the ops of one block are walked in order."""

    block: Block
    hidden: int
    rows: frozenset[str]  # names of the row-parallel projections (`row_parallel_ops`)
    params: dict[str, Param]
    decided: dict[str, Placement] = field(default_factory=dict)
    column_experts: Op | None = None  # the op before was a column-parallel expert GEMM


Rule = Callable[[Op, _Walk], OpSharding | None]
RULES: dict[OpKind, Rule] = {}


def sharding_rule(*kinds: OpKind) -> Callable[[Rule], Rule]:
    """Register the rule that shards ops of `kinds` (one rule per kind)."""

    def register(rule: Rule) -> Rule:
        for kind in kinds:
            assert kind not in RULES, f"two sharding rules for {kind}"
            RULES[kind] = rule
        return rule

    return register


def _new_params(op: Op, walk: _Walk) -> list[Param]:
    """The parameters `op` reads that no earlier op of the block decided."""
    return [walk.params[n] for n in op.params if n in walk.params and n not in walk.decided]


@sharding_rule(OpKind.EMBEDDING)
def _embedding(op: Op, walk: _Walk) -> OpSharding:
    """A vocabulary is split on its rows; a table of learned positions is replicated."""
    if op.attr("positions"):
        return OpSharding(
            TpRole.POSITIONS, tuple((p.name, Replicate()) for p in _new_params(op, walk))
        )
    return OpSharding(TpRole.VOCAB, tuple((p.name, Shard(0)) for p in _new_params(op, walk)))


@sharding_rule(OpKind.MATMUL, OpKind.EXPERTS)
def _projection(op: Op, walk: _Walk) -> OpSharding:
    """Row- or column-parallel by `row_parallel_ops`, or as the model declares it (the op's
    `tp_role`, `ir.trace.with_declared_tp_roles`); the LM head; convolutions replicated."""
    new = _new_params(op, walk)
    declared = op.attr("tp_role")
    if declared == "replicated" or op.target.startswith("aten.convolution"):
        return OpSharding(TpRole.REPLICATED, tuple((p.name, Replicate()) for p in new))
    row = declared == "row" if declared else op.name in walk.rows
    if row:
        role = TpRole.ROW
    elif walk.block.kind != "layer" and is_lm_head(op, walk.hidden):
        role = TpRole.LM_HEAD
    else:
        role = TpRole.COLUMN
    out = []
    for p in new:
        if len(p.shape) >= 2:
            out.append((p.name, _linear_placement(p, op, row)))
        elif len(p.shape) == 1:  # a bias: split with a column output, added once after a row
            out.append((p.name, Replicate() if row else Shard(0)))
    return OpSharding(role, tuple(out))


@sharding_rule(OpKind.ELEMENTWISE)
def _bias_after_experts(op: Op, walk: _Walk) -> OpSharding | None:
    """An expert bias added right after a column-parallel expert GEMM: split with its output."""
    if walk.column_experts is None:
        return None
    width = walk.column_experts.outputs[0].shape[-1]
    return OpSharding(
        None,
        tuple(
            (p.name, Shard(len(p.shape) - 1))
            for p in _new_params(op, walk)
            if p.shape and p.shape[-1] == width
        ),
    )


@dataclass(frozen=True, slots=True)
class BlockSharding:
    """`tp_sharding` of one block: each parameterised op's role, each parameter's placement."""

    roles: dict[str, TpRole]  # op name -> role
    placements: dict[str, Placement]  # parameter name -> placement

    def ops(self, block: Block, role: TpRole) -> list[Op]:
        """The ops of `block` with `role`, in block order."""
        return [op for op in block.ops if self.roles.get(op.name) is role]


def tp_sharding(block: Block, hidden: int) -> BlockSharding:
    """Walk `block`'s ops in order, each through the rule registered for its kind (`RULES`)."""
    rows = {op.name for op in row_parallel_ops(block, hidden)}
    for op in block.ops:  # a role the model declares wins over the op-order rule
        if op.attr("tp_role") == "row":
            rows.add(op.name)
        elif op.attr("tp_role") is not None:
            rows.discard(op.name)
    walk = _Walk(block, hidden, frozenset(rows), {p.name: p for p in block.params})
    roles: dict[str, TpRole] = {}
    for op in block.ops:
        rule = RULES.get(op.kind)
        got = rule(op, walk) if rule is not None and op.params else None
        if got is not None:
            if got.role is not None:
                roles[op.name] = got.role
            walk.decided.update(got.params)
        walk.column_experts = (
            op
            if op.kind is OpKind.EXPERTS
            and op.name not in walk.rows
            and op.outputs
            and op.outputs[0].shape
            else None
        )
    placements = {n: walk.decided.get(n, Replicate()) for n in walk.params}
    return BlockSharding(roles, placements)


def is_lm_head(op: Op, hidden: int) -> bool:
    """A projection that maps the hidden state to another width (outside the layers: the LM
    head, vocab-parallel under TP)."""
    return bool(
        op.params
        and op.kind == OpKind.MATMUL
        and op.outputs
        and op.outputs[0].shape
        and op.outputs[0].shape[-1] != hidden
        and op.inputs
        and op.inputs[0].shape
        and op.inputs[0].shape[-1] == hidden
    )


def tp_param_placements(graph: Graph) -> tuple[tuple[str, str], ...]:
    """Placement of every block parameter on the tensor-parallel axis (see module doc)."""
    hidden = graph.info.hidden
    result: dict[str, str] = {}
    for key, block in graph.blocks:
        for name, placement in tp_sharding(block, hidden).placements.items():
            result[f"{key}:{name}"] = str(placement)
    return tuple(sorted(result.items()))
