"""Per-graph pricing facts, computed once per traced graph and GPU-independent.

`ModelCosts` holds, for each block of a traced graph (`ir.Block`), what the step simulator
needs beyond its per-op compute: the tensor-parallel collectives it issues (`TpCollective`),
its boundary activation, KV bytes, router parameters (`BlockFacts`), and per-GPU compute
caches. `model_costs` returns a cached instance per graph.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass

from meshplan.ir import (
    DTYPE_BYTES,
    Block,
    GpuSpec,
    Graph,
    Op,
    OpKind,
)
from meshplan.passes.partition import (
    rank_chunks,
)
from meshplan.passes.sharding import TpRole, tp_sharding

from .collectives import (
    Collective,
)
from .compute import BlockCompute, block_compute
from .engine import EAGER, Engine
from .memory import (
    WEIGHT_BYTES,
    BlockMemory,
    block_memory,
    replicated_params,
)

# ---------------------------------------------------------------------------------------------
# Per-graph facts (computed once per graph, GPU-independent)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TpCollective:
    """One tensor-parallel collective of a block: its phase, full size at the traced
    micro-batch, and the collectives it becomes with and without sequence parallelism."""

    phase: str  # "fwd" or "bwd"
    size_bytes: int
    with_sp: tuple[Collective, ...]
    without_sp: tuple[Collective, ...]
    # The MoE experts' region: under EP x TP it moves the routed rows instead of the block
    # output (`Pricer.tp_collectives`).
    experts: bool = False


@dataclass(frozen=True, slots=True)
class BlockFacts:
    """What the simulator needs of one block besides compute: memory facts and traffic."""

    key: str
    kind: str
    memory: BlockMemory
    tp_collectives: tuple[TpCollective, ...]
    kv_bytes: int  # K and V of every attention op with their KV heads (CP all-gather)
    a2a_bytes: int  # top_k * tokens * hidden * 2 if the block routes tokens to experts
    output_bytes: int  # the activation leaving one instance (pipeline boundary)
    wgrad_fraction: float = 0.0  # share of backward FLOPs that are weight gradients (ZB-V's W)
    replicated_params: tuple[int, ...] = ()  # elements of each TP-replicated parameter (norms)
    # Elements of each MoE router parameter: replicated over tp, with gradients that are
    # partial sums over tp with or without SP (`Pricer.sp_grad_sync`).
    router_params: tuple[int, ...] = ()
    # MoE: token-expert assignments of one traced micro-batch (top_k x tokens) and the expert
    # capacity as a multiple of the balanced load (inf: dropless / not read off the trace).
    assignments: int = 0
    capacity_factor: float = math.inf
    # Queries of every attention op, all heads (head-parallel CP moves them, and the output
    # of the same size, by all-to-all: `Pricer.cp_collectives`).
    q_bytes: int = 0
    # Traced aten nodes of one instance (`Op.fx_nodes`, views included): what the host
    # issues op by op in eager mode (`cost_model.host`).
    host_nodes: int = 0


def _hidden(graph: Graph) -> int:
    if graph.info.hidden:
        return graph.info.hidden
    for _, b in graph.unit_blocks():
        if b.kind == "layer" and b.outputs and b.outputs[0].shape:
            return b.outputs[0].shape[-1]
    return 0


# Bytes per token of the vocab-parallel cross entropy's reductions: the logits are reduced in
# fp32 (Megatron-LM `vocab_parallel_cross_entropy` works on float logits; torch's
# `loss_parallel` computes log-softmax in fp32 for bf16/fp16 inputs).
LOSS_BYTES_PER_TOKEN = 4


def loss_collectives(head: Op, *, vocab_parallel: bool = True) -> tuple[TpCollective, ...]:
    """The TP collectives of the loss on the column-parallel LM head's output (logits sharded
    on the vocabulary, `head.outputs[0]`), per micro-batch.

    `vocab_parallel` (Megatron-LM's `vocab_parallel_cross_entropy`, torchtitan's and
    meshplan's runtime's use of torch's `loss_parallel`): three all-reduces of one fp32 value
    per token in forward (the row max, the sum of exponentials, the target's logit) and none
    in backward; the logits are never gathered. Otherwise (an arbitrary loss function, which
    needs the whole vocabulary): one all-gather of the logits in forward (its backward only
    slices the gradient)."""
    AR, AG = Collective.ALL_REDUCE, Collective.ALL_GATHER
    logits = head.outputs[0]
    if vocab_parallel:
        tokens = logits.numel // max(1, logits.shape[-1])
        size = tokens * LOSS_BYTES_PER_TOKEN
        return (TpCollective("fwd", size, (AR, AR, AR), (AR, AR, AR)),)
    return (TpCollective("fwd", logits.nbytes, (AG,), (AG,)),)


def _tp_collectives(block: Block, hidden: int) -> tuple[TpCollective, ...]:
    """Megatron-LM tensor parallelism (Shoeybi et al. 2019), priced by the role the sharding
    pass gave each op (`passes.sharding.tp_sharding`): every row-parallel projection
    (ROW) all-reduces its output in forward and its
    column-parallel partner's input gradient in backward; MoE experts count their down
    projection once per block (the MoE is one region: its tokens enter and its combined
    output leaves, the size of the block output; under EP x TP see `Pricer.tp_collectives`).
    Sequence parallelism turns each all-reduce into an all-gather
    plus a reduce-scatter of the same volume (Korthikanti et al. 2022). In the prologue the
    vocab-parallel embedding reduces its output (under SP: reduce-scatters it to the sequence
    shards in forward and all-gathers its gradient in backward, Megatron's
    `reduce_scatter_to_sequence_parallel_region`; VOCAB; a replicated table of learned
    positions moves nothing); in the epilogue the column-parallel LM head (LM_HEAD)
    reduces its input gradient (and gathers its sequence-sharded input under SP), and the loss
    runs vocab-parallel on its sharded logits (`loss_collectives`)."""
    AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    out: list[TpCollective] = []
    sharding = tp_sharding(block, hidden)
    if block.kind == "layer":
        experts_counted = False
        for op in sharding.ops(block, TpRole.ROW):
            if op.kind == OpKind.EXPERTS:
                if experts_counted:
                    continue
                experts_counted = True
                size = sum(t.nbytes for t in block.outputs) or op.outputs[0].nbytes
            else:
                size = op.outputs[0].nbytes
            experts = op.kind == OpKind.EXPERTS
            out.append(TpCollective("fwd", size, (AG, RS), (AR,), experts))
            out.append(TpCollective("bwd", size, (AG, RS), (AR,), experts))
        return tuple(out)
    for op in block.ops:
        if not op.params or not op.outputs or not op.outputs[0].shape:
            continue
        role = sharding.roles.get(op.name)
        if role is TpRole.VOCAB:
            out.append(TpCollective("fwd", op.outputs[0].nbytes, (RS,), (AR,)))
            out.append(TpCollective("bwd", op.outputs[0].nbytes, (AG,), ()))
        elif role is TpRole.LM_HEAD:
            out.append(TpCollective("fwd", op.inputs[0].nbytes, (AG,), ()))
            out.append(TpCollective("bwd", op.inputs[0].nbytes, (RS,), (AR,)))
            out += loss_collectives(op)
    return tuple(out)


def _kv_bytes(op: Op) -> int:
    """K and V of one attention op as context parallelism moves them: with the model's KV
    heads. A model that widens grouped-query K/V to the query heads before SDPA (HF's
    `repeat_kv`, which HF runs whenever it passes a mask, as it does under tracing) hands SDPA
    heads / kv_heads copies; the tracer's `kv_heads` attr looks through them, and CP (this
    runtime, Megatron-LM) gathers K/V before the repetition."""
    k_v = op.inputs[1:3]
    full = sum(t.nbytes for t in k_v)
    heads = k_v[0].shape[1] if k_v and len(k_v[0].shape) == 4 else 0
    kv_heads = int(op.attr("kv_heads", heads))
    if heads and 0 < kv_heads < heads and heads % kv_heads == 0:
        return full * kv_heads // heads
    return full


def _block_facts(graph: Graph, block: Block, hidden: int) -> BlockFacts:
    kv = sum(_kv_bytes(op) for op in block.ops_of(OpKind.ATTENTION))
    q = sum(op.inputs[0].nbytes for op in block.ops_of(OpKind.ATTENTION) if op.inputs)
    a2a = assignments = 0
    capacity = math.inf
    experts = block.ops_of(OpKind.EXPERTS)
    if experts:
        info = graph.info
        top_k = max(1, info.top_k)
        tokens = max(1, info.micro_batch) * max(1, info.seq_len)
        assignments = top_k * tokens
        # Tokens travel in the activations' dtype (the block output's).
        elem = DTYPE_BYTES[block.outputs[0].dtype] if block.outputs else WEIGHT_BYTES
        a2a = top_k * tokens * hidden * elem
        # Static-capacity experts run on (experts, capacity, hidden) buffers: capacity over
        # the balanced load top_k * tokens / experts is the capacity factor.
        shape = experts[0].inputs[0].shape if experts[0].inputs else ()
        if len(shape) == 3 and info.experts and shape[0] == info.experts:
            capacity = shape[0] * shape[1] / assignments
    # The weight gradient of an op with parameters (Linear, expert GEMMs, norms, embedding)
    # costs its forward FLOPs (dW = dY^T X); the rest of backward is the input gradient.
    bwd = sum(op.bwd_flops for op in block.ops)
    wgrad = sum(op.fwd_flops for op in block.ops if op.params)
    return BlockFacts(
        key=block.key,
        kind=block.kind,
        memory=block_memory(block),
        tp_collectives=_tp_collectives(block, hidden),
        kv_bytes=kv,
        a2a_bytes=a2a,
        output_bytes=sum(t.nbytes for t in block.outputs),
        wgrad_fraction=min(1.0, wgrad / bwd) if bwd else 0.0,
        replicated_params=replicated_params(block),
        router_params=_router_params(block),
        assignments=assignments,
        capacity_factor=capacity,
        q_bytes=q,
        host_nodes=sum(max(1, len(op.fx_nodes)) for op in block.ops),
    )


def _router_params(block: Block) -> tuple[int, ...]:
    """Elements of each parameter an MoE router op reads (the gate). The router's weights are
    replicated over tp and its gradient is a partial sum over tp: under expert TP the routing
    weights scale the experts' partial outputs; under EP x TP each tp rank routes its own
    sequence shard (`meshplan.runtime.expert_parallel`)."""
    names = {n for op in block.ops if op.kind == OpKind.ROUTER for n in op.params}
    return tuple(p.numel for p in block.params if p.name in names)


def moe_imbalance(assignments: float, ep: int, capacity_factor: float = math.inf) -> float:
    """The busiest expert-parallel rank's tokens over the mean under a balanced top-k router.

    Each of the ep ranks sends `assignments` token-expert pairs spread uniformly over the
    ranks, so a rank receives Binomial(ep * A, 1 / ep) of them: mean A, standard deviation
    sqrt(A (1 - 1/ep)); the expected maximum of ep such loads is about
    mean + sqrt(2 ln ep) standard deviations (the Gaussian extreme-value bound). Static
    capacity drops what exceeds `capacity_factor` times the mean, which caps it. A trained
    router is less balanced than uniform: pass a measured factor as `Engine.moe_imbalance`.
    """
    if ep <= 1 or assignments <= 0:
        return 1.0
    spread = math.sqrt(2 * math.log(ep)) * math.sqrt((1 - 1 / ep) / assignments)
    return min(1.0 + spread, max(1.0, capacity_factor))


Composition = tuple[tuple[str, int], ...]  # (block key, instances) of one stage, sorted


class ModelCosts:
    """Per-graph analysis shared by every configuration: block facts, stage compositions and
    per-GPU compute aggregates (cached). Build once per graph with `model_costs`."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.traced_micro_batch = graph.info.micro_batch or 1
        self.hidden = _hidden(graph)
        self.blocks: dict[str, Block] = dict(graph.blocks)
        self.unit_keys: tuple[str, ...] = tuple(u.block for u in graph.units)
        used = dict.fromkeys(self.unit_keys)
        self.facts: dict[str, BlockFacts] = {
            k: _block_facts(graph, self.blocks[k], self.hidden) for k in used
        }
        self._compute: dict[tuple, BlockCompute] = {}
        self._comps: dict[tuple, Composition | tuple[Composition, ...]] = {}

    def compute(self, key: str, gpu: GpuSpec, dtype: str, engine: Engine = EAGER) -> BlockCompute:
        """Roofline aggregates of block `key` on `gpu` (computed once per GPU type)."""
        # the host's speed does not change the GPU's aggregates (`cost_model.host`)
        ck = (key, gpu, dtype, dataclasses.replace(engine, host_node_s=None))
        got = self._compute.get(ck)
        if got is None:
            got = self._compute[ck] = block_compute(self.blocks[key], gpu, dtype, engine)
        return got

    def composition(self, first: int, last: int) -> Composition:
        """The block keys (and counts) of units [first, last), in a canonical order."""
        ck = (first, last)
        got = self._comps.get(ck)
        if got is None:
            counts: dict[str, int] = {}
            for k in self.unit_keys[first:last]:
                counts[k] = counts.get(k, 0) + 1
            got = self._comps[ck] = tuple(sorted(counts.items()))
        return got

    def chunked_compositions(self, pp: int, chunks: int, v_shape: bool) -> tuple[Composition, ...]:
        """Per pipeline rank, the blocks of every model chunk it runs (`rank_chunks`: interleaved
        1F1B, or ZB-V's V shape, where rank 0 holds both the embedding and the LM head)."""
        ck = ("chunks", pp, chunks, v_shape)
        got = self._comps.get(ck)
        if got is None:
            out = []
            for ranges in rank_chunks(self.graph, pp, chunks, v_shape):
                counts: dict[str, int] = {}
                for a, b in ranges:
                    for k, n in self.composition(a, b):
                        counts[k] = counts.get(k, 0) + n
                out.append(tuple(sorted(counts.items())))
            got = self._comps[ck] = tuple(out)
        return got

    def boundary_key(self, last: int) -> str:
        """The block whose output crosses the boundary after unit `last - 1`."""
        return self.unit_keys[last - 1]


_MODEL_CACHE: OrderedDict[int, tuple[Graph, ModelCosts]] = OrderedDict()
CACHE_SIZE = 8


def model_costs(graph: Graph) -> ModelCosts:
    """The `ModelCosts` of `graph`, cached by identity (the cache holds the graph, so an id is
    never reused while its entry lives)."""
    hit = _MODEL_CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:
        _MODEL_CACHE.move_to_end(id(graph))
        return hit[1]
    costs = ModelCosts(graph)
    _MODEL_CACHE[id(graph)] = (graph, costs)
    while len(_MODEL_CACHE) > CACHE_SIZE:
        _MODEL_CACHE.popitem(last=False)
    return costs
