"""Tensor-parallel parameter placements (Megatron-LM rules) read off the operator IR.

Pass: `tp_param_placements(graph) -> tuple[(key, placement), ...]`
Requires: a traced Graph whose MATMUL/EXPERTS/EMBEDDING ops list the parameters they read and
  whose `info.hidden` is known.
Ensures: one placement on the tp mesh axis for every parameter of every block, keyed
  `"<block>:<param name relative to the unit>"`, rendered compactly (`S(0)`, `R`).

The rules (Shoeybi et al. 2019, "Megatron-LM", Sec. 3): inside a layer, the projections that
close a parallel region (attention output, MLP down; see `row_parallel_ops`) are
*row-parallel*: the weight is
split along its input features and its output is a partial sum (one all-reduce, or a
reduce-scatter under sequence parallelism). Every other projection (q/k/v, MLP up/gate) is
*column-parallel*: its weight is split along its output features and needs no communication.
The embedding and the LM head are split along the vocabulary (a table of learned positions,
an embedding indexed by positions, is replicated, as are convolutions). Norm weights and MoE router
gates are replicated; stacked expert weights `(experts, in, out)` follow the same column/row
rule on their last two dims (expert parallelism, when used, splits dim 0 on the ep axis).
An expert bias added by its own op right after a column-parallel expert GEMM (GPT-style
`b_up`, `(experts, 1, ffn)`) is split with that GEMM's output (its last dim); one after a
row-parallel expert GEMM (`b_down`) is replicated (added once, after the reduction).

Which weight dim holds the output features is read from shapes: `nn.Linear` stores
`(out, in)`, GPT-2's `Conv1D` stores `(in, out)`.
"""

from __future__ import annotations

from meshplan.ir.graph import Block, Graph, Op, OpKind, Param
from meshplan.ir.placement import Placement, Replicate, Shard


def row_parallel_ops(block: Block, hidden: int) -> tuple[Op, ...]:
    """The parameterised projections of `block` that are row-parallel under Megatron TP.

    Data flow is not in the IR, so the rule reads op order and widths: the first projection
    after an attention op (the attention output projection) and any projection whose input
    width is not the model width (the MLP down projection, fed by the FFN width) are
    row-parallel. Each needs one all-reduce of its output in forward and one of its input
    gradient's counterpart in backward.
    """
    rows: list[Op] = []
    after_attention = False
    for op in block.ops:
        if op.kind is OpKind.ATTENTION:
            after_attention = True
            continue
        if op.kind not in (OpKind.MATMUL, OpKind.EXPERTS) or not op.params:
            continue
        if after_attention or _input_width(op, hidden) != hidden:
            rows.append(op)
        after_attention = False
    return tuple(rows)


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


def tp_param_placements(graph: Graph) -> tuple[tuple[str, str], ...]:
    """Placement of every block parameter on the tensor-parallel axis (see module doc)."""
    hidden = graph.info.hidden
    result: dict[str, str] = {}
    for key, block in graph.blocks:
        params = {p.name: p for p in block.params}
        rows = {op.name for op in row_parallel_ops(block, hidden)}
        decided: dict[str, Placement] = {}
        column_experts: Op | None = None  # the last op was a column-parallel expert GEMM
        for op in block.ops:
            for name in op.params:
                p = params.get(name)
                if p is None or name in decided:
                    continue
                if column_experts is not None and op.kind is OpKind.ELEMENTWISE:
                    width = column_experts.outputs[0].shape[-1]
                    if p.shape and p.shape[-1] == width:  # its bias: split with its output
                        decided[name] = Shard(len(p.shape) - 1)
                    continue
                if op.kind is OpKind.EMBEDDING:
                    # A vocabulary is split (vocab-parallel embedding); a table of learned
                    # positions (indexed by an arange, `ir.facts`) is replicated.
                    decided[name] = Replicate() if op.attr("positions") else Shard(0)
                elif op.target.startswith("aten.convolution"):
                    decided[name] = Replicate()  # a convolution (patch embedding): replicated
                elif op.kind in (OpKind.MATMUL, OpKind.EXPERTS) and len(p.shape) >= 2:
                    decided[name] = _linear_placement(p, op, op.name in rows)
                elif op.kind in (OpKind.MATMUL, OpKind.EXPERTS) and len(p.shape) == 1:
                    # A bias: split with the output of a column-parallel projection; added
                    # once after the reduction of a row-parallel one.
                    decided[name] = Replicate() if op.name in rows else Shard(0)
            column_experts = (
                op
                if op.kind is OpKind.EXPERTS
                and op.name not in rows
                and op.outputs
                and op.outputs[0].shape
                else None
            )
        # Biases consumed by a separate add op, norms, router gates: replicated.
        for name in params:
            decided.setdefault(name, Replicate())
        for name in sorted(decided):
            result[f"{key}:{name}"] = str(decided[name])
    return tuple(sorted(result.items()))
