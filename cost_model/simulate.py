"""Step-time simulator: prices a placed parallel configuration (`predict`).

The step of one optimizer update of `global_batch` sequences, for a configuration with
pipeline depth pp, m = global_batch / (dp * micro_batch) micro-batches per pipeline, is

    step = (m - 1) * U + sum_s u_s + (m + pp - 1) * P      pipeline (1F1B or GPipe)
         + rep * max_s (C_s - eta * min(C_s, W_s))          exposed data-parallel traffic
         + O                                                optimizer update

- u_s: forward + backward time of one micro-batch on stage s (compute, recomputation, TP, CP
  and EP communication, which sit on the critical path), the maximum over the device groups
  that hold replicas of s (replicas of one stage run in lock-step). U = max_s u_s. With equal
  stages the pipeline term is (m + pp - 1) * (U + P): the classic 1F1B/GPipe bubble of
  (pp - 1) stage times (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21); with unequal stages the fill and drain pass every stage
  once, so the bubble is sum_s u_s - U + (pp - 1) * P.
- EP across device groups: an expert-parallel group is ep consecutive dp ranks, so where a
  stage's replicas are split over groups (dp indices in placement order) an ep group can
  hold ranks of several groups; its all-to-alls then send the share of their bytes that goes
  to the other groups over those groups' path (NICs, and a shared GroupLink such as a WAN),
  not over the group's own (`Pricer.ep_span_all_to_all`). `evaluate` prices the spanning
  ep groups of the placement it is given; the per-(stage, group) tables, which the CP-SAT
  model reads, hold for a group too small for a whole ep group the cheapest such span.
- P: the point-to-point time of one micro-batch's boundary activation (forward send plus
  backward send) over the slowest stage boundary, on the link between the two stages' groups;
  each TP rank sends 1/tp of it (Megatron's scatter/gather, Narayanan et al. sec. 4.1).
- Interleaved 1F1B with v model chunks per rank (`Parallel.virtual_stages`): the fill and
  drain shrink by v, so the bubble
  is (sum_s u_s - U) / v + (pp - 1) * P, a fraction (p - 1) / (v m + p - 1) for equal stages,
  and every chunk boundary sends, so the p2p term is m * v * P.
- Zero bubble (`Schedule.ZERO_BUBBLE`): ZB-V (Qi et al., "Pipeline Parallelism with
  Controllable Memory", 2024; torch's `ScheduleZBVZeroBubble`, what the runtime runs). Each rank
  holds two chunks in a V; backward is split into B (input gradient) and W (weight gradient),
  and W fills the bubbles. With per-chunk times f, b, w (half the stage's forward,
  backward-for-inputs incl. recomputation, weight gradient; communication split evenly between
  forward and backward) the pipeline term is m U + (pp - 1) Z + (2 m + pp - 1) P with
  Z = max_s max(f_s, b_s, 2 (b_s - w_s)). The form was fitted to an event simulation of torch's
  own ZB-V action order (tests/cost_model/test_zero_bubble.py): exact for f = b = w, within 4%
  of the pipeline time for b / f in 0.8-2.5 and w / f in 0.1-1.2 (transformer layers: w ~ f,
  b >= f); it under-prices W much larger than B, which layers do not have. W is the weight-gradient
  share of backward: dW costs the forward FLOPs of every op with parameters (`BlockFacts`).
- Uneven DP batch shares across GPU types (`StagePlacement.microbatches`): the pipelines are
  group-pure (every stage has the same replicas per group) and each replica in group g runs
  m_g micro-batches, sum_g n_g m_g = dp * m. The pipeline term is then the maximum over the
  groups of the formula above with m_g and group g's own stage times and boundaries (HetPipe /
  Whale-style load balancing); ZeRO-3 is excluded (its per-micro-batch gathers are lock-step).
- C_s: the data-parallel traffic of stage s, W_s: the compute it overlaps with. ZeRO 0-2
  reduce gradients once per step (all-reduce, or reduce-scatter + all-gather), overlapped with
  the last micro-batch's forward + backward (rep = 1; ZeRO-0 only its backward: the gradient
  all-reduce; ZeRO-1/2 also all-gather the updated weights under the next step's first
  forward, Megatron-LM `--overlap-param-gather`). ZeRO-3 all-gathers the weights in forward and in
  backward and reduce-scatters gradients for every micro-batch, overlapped with that
  micro-batch's forward + backward (rep = m). eta = `OVERLAP_EFFICIENCY`: overlap hides at
  most that fraction of the traffic, and only as much as fits in the window; the rest is
  exposed, i.e. C - eta * min(C, W) = max(C - eta * W, (1 - eta) * C). Echo and dPRO
  (shared/reference/PAPERS.md) find that the hard part of simulating training is precisely
  that overlap is neither free nor fully exposed (communication slows the compute it overlaps
  with), so even fully overlapped traffic costs (1 - eta) of itself here.
- O: the Adam update, memory-bound (`OPTIMIZER_BYTES_PER_PARAM`), slowest rank, plus the
  once-per-step synchronisations that run exposed around it (`Pricer.step_sync_time`): under
  sequence parallelism the all-reduce over tp of each norm weight's gradient, and the scalar
  loss all-reduce over all ranks. The breakdown reports them under "optimizer".

The traced graph's costs are for `graph.info.micro_batch` sequences; a configuration's
micro-batch scales every compute and activation cost linearly (compute.py, memory.py).

`PlanTables` holds, for one configuration and stage split, every number above per (stage,
group) or (boundary, group pair), so that `evaluate` prices any placement with a handful of
max/sum operations; the CP-SAT planner (`meshplan.planner.solver`) encodes exactly the same
formula over the same tables, so that a plan and its `predict` agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from meshplan.ir import (
    DTYPE_BYTES,
    Block,
    Cluster,
    DeviceGroup,
    GpuSpec,
    Graph,
    Op,
    OpKind,
    Parallel,
    Prediction,
    RankMemory,
    Recompute,
    Schedule,
    StagePlacement,
    group_tp_problem,
)
from meshplan.passes.partition import (
    layer_counts,
    rank_chunks,
    rank_layers,
    replica_capacity,
    tp_domain_problem,
)
from meshplan.passes.sharding import row_parallel_ops

from .collectives import (
    BASE_LATENCY_S,
    Collective,
    CrossPath,
    Path,
    bus_factor,
    collective_time,
    cross_group_path,
    group_collective_time,
    group_path,
    inter_node_path,
    intra_node_path,
)
from .compression import (
    CommChoice,
    CommOptions,
    choose,
    coded_cross,
    quantize_time,
    quantized_block_memory,
    quantized_share,
    tensor_of,
)
from .compute import BlockCompute, block_compute, kernel_efficiency
from .engine import EAGER, Engine
from .memory import (
    WEIGHT_BYTES,
    BlockMemory,
    StageMemory,
    block_memory,
    in_flight_microbatches,
    precision_for,
    replicated_params,
    stage_memory,
)
from .recompute import SelectivePolicy, recompute_forward_time

# Fraction of overlapped communication that is actually hidden behind compute (the rest slows
# the compute down or waits). Assumption (Echo / dPRO, PAPERS.md: overlapped communication
# slows the compute it overlaps with), calibrated in issue 3.
OVERLAP_EFFICIENCY = 0.8


def exposed(comm: float, window: float, eta: float = OVERLAP_EFFICIENCY) -> float:
    """Seconds of `comm` left exposed when it overlaps `window` seconds of compute:
    C - eta * min(C, W), i.e. at least (1 - eta) C (the module docstring's rule)."""
    return comm - eta * min(comm, window)


# The runner's per-step loss all-reduce: one float64 (meshplan.runtime.Runner._global_mean).
LOSS_SYNC_BYTES = 8

# Bytes the Adam update streams per parameter it owns: read fp32 master/momentum/variance and
# the bf16 gradient, write the three fp32 states back and the new bf16 weight, about 16 + 4.
# Assumption (fused multi-tensor Adam is memory-bound), calibrated in issue 3.
OPTIMIZER_BYTES_PER_PARAM = 20

# Schedules the planner searches (the CP-SAT model encodes their step formula) and `predict`
# prices.
SUPPORTED_SCHEDULES = (
    Schedule.ONE_F_ONE_B,
    Schedule.GPIPE,
    Schedule.INTERLEAVED_1F1B,
    Schedule.ZERO_BUBBLE,
)
PRICED_SCHEDULES = SUPPORTED_SCHEDULES

BREAKDOWN_PARTS = (
    "compute",
    "recompute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pp_p2p",
    "pp_bubble",
    "dp_comm_exposed",
    "optimizer",
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
    """Megatron-LM tensor parallelism (Shoeybi et al. 2019): every row-parallel projection
    (`meshplan.passes.sharding.row_parallel_ops`) all-reduces its output in forward and its
    column-parallel partner's input gradient in backward; MoE experts count their down
    projection once per block (the MoE is one region: its tokens enter and its combined
    output leaves, the size of the block output; under EP x TP see `Pricer.tp_collectives`).
    Sequence parallelism turns each all-reduce into an all-gather
    plus a reduce-scatter of the same volume (Korthikanti et al. 2022). In the prologue the
    vocab-parallel embedding reduces its output (under SP: reduce-scatters it to the sequence
    shards in forward and all-gathers its gradient in backward, Megatron's
    `reduce_scatter_to_sequence_parallel_region`); in the epilogue the column-parallel LM head
    reduces its input gradient (and gathers its sequence-sharded input under SP), and the loss
    runs vocab-parallel on its sharded logits (`loss_collectives`)."""
    AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    out: list[TpCollective] = []
    if block.kind == "layer":
        experts_counted = False
        for op in row_parallel_ops(block, hidden):
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
        if op.kind == OpKind.EMBEDDING:
            out.append(TpCollective("fwd", op.outputs[0].nbytes, (RS,), (AR,)))
            out.append(TpCollective("bwd", op.outputs[0].nbytes, (AG,), ()))
        elif is_lm_head(op, hidden):
            out.append(TpCollective("fwd", op.inputs[0].nbytes, (AG,), ()))
            out.append(TpCollective("bwd", op.inputs[0].nbytes, (RS,), (AR,)))
            out += loss_collectives(op)
    return tuple(out)


def is_lm_head(op: Op, hidden: int) -> bool:
    """True for a column-parallel projection outside the layers that maps the hidden state to
    another width (the LM head, vocab-parallel under TP)."""
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
        ck = (key, gpu, dtype, engine)
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
_CACHE_SIZE = 8


def model_costs(graph: Graph) -> ModelCosts:
    """The `ModelCosts` of `graph`, cached by identity (the cache holds the graph, so an id is
    never reused while its entry lives)."""
    hit = _MODEL_CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:
        _MODEL_CACHE.move_to_end(id(graph))
        return hit[1]
    costs = ModelCosts(graph)
    _MODEL_CACHE[id(graph)] = (graph, costs)
    while len(_MODEL_CACHE) > _CACHE_SIZE:
        _MODEL_CACHE.popitem(last=False)
    return costs


# ---------------------------------------------------------------------------------------------
# Pricing pieces (per graph x cluster x dtype, cached)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EpSpan:
    """An expert-parallel group whose ranks sit in several device groups.

    `members`: (group, ranks of the ep group in it) in rank order, at least two groups.
    `streams`: how many such ep groups cross a shared GroupLink at once (tp * cp per spanning
    chunk of dp ranks, summed over the pipeline stages, which run concurrently).
    """

    members: tuple[tuple[str, int], ...]
    streams: int = 1

    def __post_init__(self) -> None:
        if len({g for g, _ in self.members}) < 2 or any(n < 1 for _, n in self.members):
            raise ValueError(f"EpSpan needs ranks in at least two groups, got {self.members}")
        if self.streams < 1:
            raise ValueError(f"EpSpan streams must be >= 1, got {self.streams}")

    @property
    def ranks(self) -> int:
        """The ep group's size."""
        return sum(n for _, n in self.members)


def ep_spans(replicas: Sequence[tuple[str, int]], ep: int) -> tuple[list[tuple], set[str]]:
    """The ep groups of one stage's replicas (group, count) in placement (dp index) order:
    ([members of each ep group that spans groups], {groups holding a whole ep group}).

    An ep group is ep consecutive dp indices (`meshplan.runtime.mesh`), and dp indices are
    numbered across the groups in placement order (`meshplan.ir.plan.assign_ranks`)."""
    spanning: list[tuple] = []
    whole: set[str] = set()
    chunk: list[list] = []
    left = ep
    for group, count in replicas:
        while count > 0:
            take = min(count, left)
            if chunk and chunk[-1][0] == group:
                chunk[-1][1] += take
            else:
                chunk.append([group, take])
            count, left = count - take, left - take
            if left == 0:
                if len(chunk) > 1:
                    spanning.append(tuple((g, n) for g, n in chunk))
                else:
                    whole.add(chunk[0][0])
                chunk, left = [], ep
    return spanning, whole


@dataclass(frozen=True, slots=True)
class StageTime:
    """One micro-batch (forward + backward) of one stage on one rank of a device group (s)."""

    forward: float  # forward compute
    backward: float  # backward compute
    recompute: float  # recomputed forward (compute and its TP/CP/EP traffic)
    tp_comm: float
    cp_comm: float
    ep_comm: float
    wgrad: float = 0.0  # the weight-gradient part of `backward` (ZB-V's W)

    @property
    def compute(self) -> float:
        """Forward + backward compute."""
        return self.forward + self.backward

    @property
    def zb_bubble(self) -> float:
        """ZB-V's per-rank bubble unit max(f, b, 2 (b - w)) over the rank's two chunks (half the
        stage each), communication split evenly between forward and backward."""
        comm = (self.tp_comm + self.cp_comm + self.ep_comm) / 2
        f = self.forward + comm
        w = self.wgrad
        b = self.backward - w + self.recompute + comm
        return max(f, b, 2 * (b - w)) / 2

    @property
    def total(self) -> float:
        """The stage's time per micro-batch on the critical path (u in the docstring)."""
        return self.compute + self.recompute + self.tp_comm + self.cp_comm + self.ep_comm


@dataclass(frozen=True, slots=True)
class DpTraffic:
    """The data-parallel collectives of one stage per occurrence: (kind, per-rank bytes, ranks)."""

    collectives: tuple[tuple[Collective, float, int], ...]

    @property
    def volume(self) -> float:
        """sum S * f(n): bytes one rank moves per occurrence (the alpha-free part)."""
        return sum(s * bus_factor(k, n) for k, s, n in self.collectives if n > 1)

    @property
    def count(self) -> int:
        """Collectives that move data (each pays one latency)."""
        return sum(1 for _, s, n in self.collectives if n > 1 and s > 0)


@dataclass(frozen=True, slots=True)
class CrossTraffic:
    """Data-parallel traffic of a stage whose replicas span two groups: with k stages crossing
    between groups at once, time(k) = max(unshared, latency + per_stage * k)."""

    unshared: float
    latency: float
    per_stage: float | None  # None when no shared GroupLink bounds it
    # The same traffic coded (lossless / int8 gradients, `compression.coded_cross`), in the
    # same form; `time` takes the faster of the two.
    coded: CrossTraffic | None = None

    def raw_time(self, crossing_stages: int) -> float:
        """Seconds uncoded when `crossing_stages` stages' DP rings cross at once."""
        if self.per_stage is None:
            return self.unshared
        return max(self.unshared, self.latency + self.per_stage * max(1, crossing_stages))

    def time(self, crossing_stages: int) -> float:
        """Seconds when `crossing_stages` stages' DP rings cross between groups at once."""
        raw = self.raw_time(crossing_stages)
        return raw if self.coded is None else min(raw, self.coded.raw_time(crossing_stages))


class Pricer:
    """Caches the pricing pieces of one graph on one cluster for one compute dtype."""

    def __init__(
        self,
        costs: ModelCosts,
        cluster: Cluster,
        dtype: str = "bfloat16",
        comm: CommOptions | None = None,
        selective_policy: str = "keep_linear",
        engine: Engine = EAGER,
    ) -> None:
        self.costs = costs
        # How the step executes beyond the configuration (fused kernels, Float8, TP overlap).
        self.engine = engine
        self.cluster = cluster
        self.dtype = dtype
        # How Recompute.SELECTIVE keeps outputs (recompute.SelectivePolicy): meshplan's and
        # Megatron's keep-every-linear by default; torchtitan's op or layer policies on request.
        self.selective_policy = SelectivePolicy(selective_policy).value
        # What the planner may do to traffic (compression.py): every collective is priced at
        # its fastest allowed method (raw, lossless, int8 gradients). None: raw only.
        self.comm = comm
        # Bytes per parameter of weights, gradients and optimizer states (memory.Precision).
        self.precision = precision_for(dtype)
        self.groups: dict[str, DeviceGroup] = {g.name: g for g in cluster.groups}
        self._time: dict[tuple, StageTime] = {}
        self._block_time: dict[tuple, StageTime] = {}
        self._mem: dict[tuple, StageMemory] = {}
        self._cross: dict[tuple, CrossPath] = {}
        self._sync: dict[tuple, float] = {}  # step_sync_time's SP gradient part

    # -- per (stage composition, group) --------------------------------------------------------
    def stage_time(
        self,
        comp: Composition,
        group: str,
        *,
        tp: int,
        cp: int,
        ep: int,
        sp: bool,
        micro_batch: int,
        recompute: Recompute,
        quantize: bool = False,
        span: EpSpan | None = None,
    ) -> StageTime:
        """Forward/backward/recompute compute and TP/CP/EP traffic of one micro-batch: the sum
        over the stage's blocks of `block_time` times their instance counts. `quantize`: saved
        activations are quantized (AGoQ), which adds quantize/dequantize time. `span`: the
        rank's ep group spans device groups (`EpSpan`); None: it lies inside `group`."""
        key = (comp, group, tp, cp, ep, sp, micro_batch, recompute, quantize, span)
        got = self._time.get(key)
        if got is None:
            parts = [0.0] * 7
            for bkey, count in comp:
                t = self.block_time(
                    bkey,
                    group,
                    tp=tp,
                    cp=cp,
                    ep=ep,
                    sp=sp,
                    micro_batch=micro_batch,
                    recompute=recompute,
                    quantize=quantize,
                    span=span,
                )
                for i, v in enumerate(
                    (t.forward, t.backward, t.recompute, t.tp_comm, t.cp_comm, t.ep_comm, t.wgrad)
                ):
                    parts[i] += count * v
            got = self._time[key] = StageTime(*parts)
        return got

    def block_time(
        self,
        bkey: str,
        group: str,
        *,
        tp: int,
        cp: int,
        ep: int,
        sp: bool,
        micro_batch: int,
        recompute: Recompute,
        quantize: bool = False,
        span: EpSpan | None = None,
    ) -> StageTime:
        """One instance of block `bkey`, one micro-batch, on one rank of `group` (`span`: its
        ep group spans device groups, see `stage_time`)."""
        key = (bkey, group, tp, cp, ep, sp, micro_batch, recompute, quantize, span)
        got = self._block_time.get(key)
        if got is not None:
            return got
        g = self.groups[group]
        scale = micro_batch / self.costs.traced_micro_batch
        facts = self.costs.facts[bkey]
        bc = self.costs.compute(bkey, g.gpu, self.dtype, self.engine)
        fwd, bwd, sel = bc.times(tp=tp, cp=cp, sequence_parallel=sp, scale=scale)
        t_fwd, t_bwd = self._tp_traffic(
            facts, tp, cp, sp, scale, intra_node_path(self.cluster, g), g.gpu, ep=ep
        )
        if self.engine.tp_overlap and tp > 1:  # decomposed GEMMs hide part of the TP traffic
            g_fwd, g_bwd = bc.gemm_times(tp=tp, cp=cp, scale=scale)
            t_fwd, t_bwd = exposed(t_fwd, g_fwd), exposed(t_bwd, g_bwd)
        c_fwd, c_bwd = self._cp_traffic(facts, g, tp, cp, scale)
        e_fwd, e_bwd = self._ep_traffic(facts, g, tp, cp, ep, sp, scale, span)
        rc = 0.0
        policy = self.selective_policy
        if facts.kind == "layer" and recompute == Recompute.SELECTIVE:
            if policy == SelectivePolicy.EVERY_OTHER_LAYER:  # half the layers: full recompute
                rc = 0.5 * (fwd + t_fwd + c_fwd + e_fwd)
            elif policy == SelectivePolicy.TORCHTITAN_OP:  # its recomputed mms: no TP traffic
                rc = recompute_forward_time(
                    self.costs.blocks[bkey],
                    g.gpu,
                    self.dtype,
                    policy,
                    tp=tp,
                    cp=cp,
                    sequence_parallel=sp,
                    scale=scale,
                )
            else:
                rc = sel  # the attention core only: no TP traffic inside it
        elif facts.kind == "layer" and recompute == Recompute.FULL:
            rc = fwd + t_fwd + c_fwd + e_fwd  # the whole forward again, traffic included
        if quantize:  # AGoQ: quantize what is saved in forward, dequantize it in backward
            share, calls = quantized_share(self.costs.blocks[bkey])
            saved = facts.memory.activations(
                tp=tp, cp=cp, sequence_parallel=sp, scale=scale, recompute=recompute
            )
            q_fwd, q_bwd = quantize_time(saved * share, g.gpu, calls)
            fwd, bwd = fwd + q_fwd, bwd + q_bwd
        got = self._block_time[key] = StageTime(
            fwd, bwd, rc, t_fwd + t_bwd, c_fwd + c_bwd, e_fwd + e_bwd, bwd * facts.wgrad_fraction
        )
        return got

    def comm_choice(
        self,
        kind: Collective,
        size: float,
        n: int,
        path: Path,
        gpu: GpuSpec,
        tensor: str,
        axis: str,
    ) -> CommChoice:
        """`kind` of `size` bytes over n ranks of mesh `axis` on `path`, at its fastest
        allowed method (`CommOptions.axes`: only the axes the runtime codes)."""
        return choose(
            kind,
            size,
            n,
            lambda x: collective_time(kind, x, n, path),
            self.comm,
            gpu,
            self.dtype,
            tensor,
            axis,
        )

    def tp_collectives(
        self, facts: BlockFacts, *, tp: int, cp: int, ep: int, sp: bool, scale: float
    ) -> tuple[tuple[str, Collective, float], ...]:
        """(phase, kind, bytes) of every TP collective of one instance of a block and one
        micro-batch: `facts.tp_collectives` at the micro-batch's size over cp, with or without
        SP. Under EP x TP (ep > 1, tp > 1; Megatron-Core requires SP there) the MoE experts'
        region moves the routed rows instead of the block output: each rank all-gathers over
        tp the rows its tp peers received from the ep all-to-all and reduce-scatters their
        partial outputs back, in forward and again (swapped) in backward. The rows a rank
        receives are its sequence shard's top_k x tokens / (cp x tp), at the busiest rank's
        load (`moe_load_factor`, as `_ep_traffic`); gathered over tp that is
        top_k x tokens / cp x hidden, i.e. `a2a_bytes` x scale / cp x the load factor."""
        if tp <= 1:
            return ()
        out = []
        for c in facts.tp_collectives:
            if c.experts and ep > 1 and facts.a2a_bytes:
                load = self.moe_load_factor(facts, tp=tp, cp=cp, ep=ep, sp=True, scale=scale)
                size = facts.a2a_bytes * scale / cp * load
                kinds = c.with_sp
            else:
                size = c.size_bytes * scale / cp
                kinds = c.with_sp if sp else c.without_sp
            out += [(c.phase, kind, size) for kind in kinds]
        return tuple(out)

    def _tp_traffic(
        self, facts, tp, cp, sp, scale, intra: Path, gpu: GpuSpec | None = None, ep: int = 1
    ) -> tuple[float, float]:
        out = {"fwd": 0.0, "bwd": 0.0}
        for phase, kind, size in self.tp_collectives(
            facts, tp=tp, cp=cp, ep=ep, sp=sp, scale=scale
        ):
            if self.comm is None or gpu is None:
                out[phase] += collective_time(kind, size, tp, intra)
            else:
                out[phase] += self.comm_choice(
                    kind, size, tp, intra, gpu, "activations", "tp"
                ).time_s
        return out["fwd"], out["bwd"]

    def _cp_traffic(self, facts, g: DeviceGroup, tp, cp, scale) -> tuple[float, float]:
        """Context parallelism: all-gather K and V in forward, reduce-scatter their gradients in
        backward, over cp ranks strided by tp (heads are TP-sharded, so /tp). Not overlapped
        with attention (ring attention would hide part: assumption, calibrated in issue 3)."""
        if cp <= 1 or not facts.kv_bytes:
            return 0.0, 0.0
        size = facts.kv_bytes * scale / tp
        path = group_path(self.cluster, g, cp, max(1, g.domain_gpus // tp))
        return (
            self.comm_choice(
                Collective.ALL_GATHER, size, cp, path, g.gpu, "activations", "cp"
            ).time_s,
            self.comm_choice(
                Collective.REDUCE_SCATTER, size, cp, path, g.gpu, "activations", "cp"
            ).time_s,
        )

    def moe_load_factor(
        self, facts: BlockFacts, *, tp: int, cp: int, ep: int, sp: bool, scale: float
    ) -> float:
        """The busiest expert-parallel rank's routed rows over the mean: `Engine.moe_imbalance`
        (capped by the capacity factor), else the balanced router's bound `moe_imbalance` for
        the assignments of one rank's tokens (its sequence shard under SP)."""
        share = scale / (cp * (tp if sp else 1))
        factor = self.engine.moe_imbalance
        if factor is None:
            return moe_imbalance(facts.assignments * share, ep, facts.capacity_factor)
        return min(factor, max(1.0, facts.capacity_factor))

    def _ep_traffic(
        self, facts, g: DeviceGroup, tp, cp, ep, sp, scale, span: EpSpan | None = None
    ) -> tuple[float, float]:
        """Expert parallelism: dispatch + combine all-to-alls of top_k * tokens * hidden in
        forward and again in backward, over ep ranks strided by tp * cp, at the busiest rank's
        load: the mean times the routing imbalance (`Engine.moe_imbalance`, else the balanced
        router's bound `moe_imbalance`, capped by the capacity factor). Inside group g, or,
        with `span`, over the groups the ep group spans (`ep_span_all_to_all`, raw)."""
        if ep <= 1 or not facts.a2a_bytes:
            return 0.0, 0.0
        share = scale / (cp * (tp if sp else 1))
        factor = self.moe_load_factor(facts, tp=tp, cp=cp, ep=ep, sp=sp, scale=scale)
        size = facts.a2a_bytes * share * factor
        if span is not None:
            t = self.ep_span_all_to_all(size, span, tp=tp, cp=cp)
            return 2 * t, 2 * t
        path = group_path(self.cluster, g, ep, max(1, g.domain_gpus // (tp * cp)))
        t = self.comm_choice(
            Collective.ALL_TO_ALL, size, ep, path, g.gpu, "activations", "ep"
        ).time_s
        return 2 * t, 2 * t

    def ep_span_all_to_all(self, size: float, span: EpSpan, *, tp: int, cp: int) -> float:
        """One all-to-all of `size` bytes per rank (`size / n` to each of the n ranks, itself
        included) over an ep group that spans device groups (seconds).

        Derivation. Let the n = sum_g c_g ranks sit c_g in group g. A rank of g sends
        (c_g - 1) size / n to the other ranks of g and c_h size / n to each group h != g: in
        all (n - 1) size / n, NCCL's all-to-all bus factor. Between groups g and h the link
        carries, in each direction, c_g c_h size / n bytes per ep group (c_g ranks sending
        c_h size / n each); with `span.streams` ep groups crossing at once, streams times that.
        For two groups split a | b, 2 a b size / n bytes cross (a b size / n each way) of the
        (n - 1) size the all-to-all moves in all: a fraction 2 a b / (n (n - 1)), e.g. 16/31
        for 16 | 16. The transfers run concurrently (one latency step, as inside a group), so
        the time is the base latency plus one step at the slowest path's latency plus the
        largest of

        - c_g's own part: (c_g - 1) size / n over the group's path for c_g ranks (`group_path`,
          as the all-to-all inside a group);
        - a rank's part leaving its group: sum_h c_h size / n over its NIC share towards h
          (`cross_group_path` with one rank per node: every rank drives its own share);
        - a shared GroupLink between g and h (a WAN): streams c_g c_h size / n over the whole
          link's bandwidth.

        Raw traffic only (lossless coding of a spanning all-to-all is not priced)."""
        n = span.ranks
        per_byte, latency = 0.0, 0.0
        for i, (a, ca) in enumerate(span.members):
            ga = self.groups[a]
            if ca > 1:
                inside = group_path(self.cluster, ga, ca, max(1, ga.domain_gpus // (tp * cp)))
                per_byte = max(per_byte, (ca - 1) / n / inside.bandwidth)
                latency = max(latency, inside.latency)
            out = 0.0
            for j, (b, cb) in enumerate(span.members):
                if b == a:
                    continue
                cross = self.cross_path(a, b, 1, 1)
                out += cb / n / cross.bandwidth
                latency = max(latency, cross.latency)
                if j > i and cross.shared_bandwidth is not None:
                    shared = span.streams * ca * cb / n / cross.shared_bandwidth
                    per_byte = max(per_byte, shared)
            per_byte = max(per_byte, out)
        return BASE_LATENCY_S + latency + size * per_byte

    # -- per stage composition (group-independent) ---------------------------------------------
    def stage_memory(
        self,
        comp: Composition,
        *,
        tp: int,
        cp: int,
        ep: int,
        dp: int,
        zero: int,
        recompute: Recompute,
        sp: bool,
        micro_batch: int,
        quantize: bool = False,
        stage: int = 0,
        num_stages: int = 1,
    ) -> StageMemory:
        """Memory of one rank of a stage, but for the in-flight multiplier (cached).

        `quantize`: saved activations at the AGoQ widths of pipeline stage `stage` of
        `num_stages` (`compression.quantized_block_memory`); stage 0's widths are the
        smallest, so the default is a lower bound for any stage."""
        early = 2 * (num_stages - stage) > num_stages  # attention at 4 bits (compression.py)
        key = (comp, tp, cp, ep, dp, zero, recompute, sp, micro_batch, quantize and early)
        key += (quantize,)
        got = self._mem.get(key)
        if got is None:
            blocks = [(self.costs.facts[k].memory, n) for k, n in comp]
            if quantize:
                blocks = [
                    (quantized_block_memory(self.costs.blocks[k], b, stage, num_stages), n)
                    for (b, n), (k, _) in zip(blocks, comp)
                ]
            got = self._mem[key] = stage_memory(
                blocks,
                tp=tp,
                cp=cp,
                ep=ep,
                dp=dp,
                zero=zero,
                recompute=recompute,
                sequence_parallel=sp,
                scale=micro_batch / self.costs.traced_micro_batch,
                policy=self.selective_policy,
                precision=self.precision,
                fused_loss=self.engine.fused_loss,
            )
        return got

    def dp_traffic(
        self, comp: Composition, *, tp: int, ep: int, dp: int, zero: int, cp: int = 1
    ) -> DpTraffic:
        """Per-occurrence DP collectives of a stage (gradients and weights at the training
        precision's bytes per parameter, `memory.Precision`: bf16 under mixed precision):
        ZeRO-0 all-reduces gradients; ZeRO-1/2 reduce-scatter
        gradients and all-gather updated weights; ZeRO-3 (per micro-batch) all-gathers weights
        for forward and for backward and reduce-scatters gradients. Context-parallel ranks hold
        the same weights and their gradients are reduced with the data-parallel ones, so the
        group is dp * cp ranks (Megatron-LM's data-parallel group "with CP", torchtitan's FSDP
        mesh dp_shard x cp). Expert parameters use the dp * cp / ep ranks that hold the same
        experts."""
        facts = [(self.costs.facts[k].memory, n) for k, n in comp]
        dense = sum(n * (b.params_tp / tp + b.params_rep) for b, n in facts)
        experts = sum(n * b.params_expert / (tp * ep) for b, n in facts)
        AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
        out: list[tuple[Collective, float, int]] = []
        dcp = dp * cp
        g_bytes, w_bytes = self.precision.grad_bytes, self.precision.weight_bytes
        if self.engine.float8_all_gather:  # FSDP gathers the FP8 weights (1 byte each)
            w_bytes = 1
        for params, n in ((dense, dcp), (experts, dcp // ep if dcp >= ep else 1)):
            if params <= 0 or n <= 1:
                continue
            if zero == 0:
                out.append((AR, params * g_bytes, n))
            elif zero in (1, 2):
                out += [(RS, params * g_bytes, n), (AG, params * w_bytes, n)]
            else:
                out += [(AG, params * w_bytes, n)] * 2 + [(RS, params * g_bytes, n)]
        return DpTraffic(tuple(out))

    def dp_single(self, traffic: DpTraffic, group: str, *, tp: int, cp: int) -> float:
        """DP traffic time when all replicas of the stage sit in one group, packed into NVLink
        domains (nodes)."""
        return sum(c.time_s for c in self.dp_single_choices(traffic, group, tp=tp, cp=cp))

    def dp_single_choices(
        self, traffic: DpTraffic, group: str, *, tp: int, cp: int
    ) -> list[CommChoice]:
        """The priced methods of each collective of `dp_single` (gradients reduced, weights
        gathered)."""
        g = self.groups[group]
        # The DP x CP group's ranks in one NVLink domain (node): every rank of the domain
        # outside TP (cp sits inside dp in the mesh order pp, dp, cp, ep, tp).
        per_node = max(1, g.domain_gpus // tp)
        return [
            choose(
                k,
                s,
                n,
                lambda x, k=k, n=n: group_collective_time(
                    k, x, self.cluster, g, n, min(n, per_node)
                ),
                self.comm,
                g.gpu,
                self.dtype,
                tensor_of(k),
            )
            for k, s, n in traffic.collectives
        ]

    def cross_path(self, a: str, b: str, ranks_a: int, ranks_b: int) -> CrossPath:
        """`collectives.cross_group_path`, cached."""
        key = (a, b, ranks_a, ranks_b)
        got = self._cross.get(key)
        if got is None:
            got = self._cross[key] = cross_group_path(self.cluster, a, b, ranks_a, ranks_b)
        return got

    def dp_cross(self, traffic: DpTraffic, a: str, b: str, *, tp: int, cp: int) -> CrossTraffic:
        """DP traffic time of a flat ring spanning groups a and b (replicas packed in nodes).
        Each crossing stage has tp rings (one per TP rank, each over the dp * cp ranks that
        hold the same weights) on a shared GroupLink."""
        # Ranks of one DP ring per NVLink domain (node): the replicas a domain holds, at most
        # dp. Placement-independent on purpose (the planner prices it before placing):
        # optimistic when one side holds fewer replicas than fit in a domain.
        dp = max((n for _, _, n in traffic.collectives), default=1)
        ga, gb = self.groups[a], self.groups[b]
        path = self.cross_path(
            a,
            b,
            max(1, min(dp, ga.domain_gpus // tp)),
            max(1, min(dp, gb.domain_gpus // tp)),
        )
        vol, alpha = traffic.volume, traffic.count * path.latency
        per_stage = None
        if path.shared_bandwidth is not None:
            per_stage = vol * tp / path.shared_bandwidth
        coded = coded_cross(
            traffic.collectives,
            Path(path.bandwidth, path.latency),
            path.shared_bandwidth,
            tp,
            self.comm,
            _slower_gpu(ga.gpu, gb.gpu),
            self.dtype,
        )
        return CrossTraffic(
            alpha + vol / path.bandwidth,
            alpha,
            per_stage,
            CrossTraffic(*coded) if coded is not None else None,
        )

    def hetero_dp_traffic(
        self, comp: Composition, tp_by_group: Mapping[str, int], *, dp: int, cp: int = 1
    ) -> dict[str, DpTraffic]:
        """Per-group TP (`StagePlacement.group_tp`): the gradient reduction of a stage whose
        replicas use different TP degrees, per rank of each group, as the runtime runs it
        (`meshplan.runtime.data_parallel.HeteroGradients`).

        Every TP-sharded parameter (and stacked expert weight) is cut into L = lcm(tp_g)
        pieces along its sharded dim; a rank of group g holds L / tp_g consecutive pieces.
        Piece j is all-reduced over the dp * cp ranks that hold it (one per replica and cp
        rank), together with the stage's TP-replicated parameters (norms), which every rank
        holds whole. So a rank of group g runs L / tp_g all-reduces of (P_tp / L + P_rep)
        gradients each, n = dp * cp ranks: ZeRO-0 only (the replicas' optimizers cannot
        share shards of different shapes)."""
        facts = [(self.costs.facts[k].memory, n) for k, n in comp]
        sharded = sum(n * (b.params_tp + b.params_expert) for b, n in facts)
        replicated = sum(n * b.params_rep for b, n in facts)
        pieces = math.lcm(*tp_by_group.values())
        piece = (sharded / pieces + replicated) * self.precision.grad_bytes
        ranks = dp * cp
        if ranks <= 1:
            return {g: DpTraffic(()) for g in tp_by_group}
        return {
            g: DpTraffic(((Collective.ALL_REDUCE, piece, ranks),) * (pieces // t))
            for g, t in tp_by_group.items()
        }

    def dp_cross_hetero(
        self,
        comp: Composition,
        a: str,
        b: str,
        tp_by_group: Mapping[str, int],
        *,
        dp: int,
        cp: int = 1,
    ) -> CrossTraffic:
        """`hetero_dp_traffic` of a stage with pipelines in groups a and b, priced like
        `dp_cross`: the piece rings cross the groups' link; the slower side (the group with
        the smaller tp moves more pieces) sets the unshared time, and the link carries
        L pieces per stage when a shared GroupLink bounds it. Raw: the runtime does not code
        these reductions."""
        traffic = self.hetero_dp_traffic(comp, tp_by_group, dp=dp, cp=cp)
        ga, gb = self.groups[a], self.groups[b]
        ta, tb = tp_by_group[a], tp_by_group[b]
        path = self.cross_path(
            a,
            b,
            max(1, min(dp, ga.domain_gpus // ta)),
            max(1, min(dp, gb.domain_gpus // tb)),
        )
        unshared = max(
            traffic[g].count * path.latency + traffic[g].volume / path.bandwidth for g in (a, b)
        )
        latency = max(traffic[g].count for g in (a, b)) * path.latency
        per_stage = None
        if path.shared_bandwidth is not None:
            pieces = math.lcm(*tp_by_group.values())
            one = traffic[a].collectives[:1]  # one piece's ring
            per_stage = pieces * DpTraffic(one).volume / path.shared_bandwidth
        return CrossTraffic(unshared, latency, per_stage, None)

    def p2p(self, size: float, a: str, b: str, streams: int) -> float:
        """Forward send + backward send of one boundary activation of `size` bytes per rank
        between a stage on group a and the next on group b; `streams` ranks send at once."""
        return 2 * self.p2p_choice(size, a, b, streams).time_s

    def p2p_choice(self, size: float, a: str, b: str, streams: int) -> CommChoice:
        """One boundary send of `p2p` at its fastest allowed method."""
        if a == b:
            g = self.groups[a]
            if g.domains == 1:
                path = intra_node_path(self.cluster, g)
            else:
                # Consecutive stages sit in different NVLink domains (nodes): stages fill
                # domains in order.
                path = inter_node_path(self.cluster, g)
        else:
            path = self.cross_path(a, b, 1, 1).path(streams)
        gpu = _slower_gpu(self.groups[a].gpu, self.groups[b].gpu)
        return self.comm_choice(Collective.P2P, size, 2, path, gpu, "activations", "pp")

    def optimizer_time(
        self, comp: Composition, group: str, *, tp: int, ep: int, dp: int, zero: int
    ) -> float:
        """Adam update of the parameters this rank owns (all it holds under ZeRO-0, 1/dp of
        them under ZeRO >= 1), streaming OPTIMIZER_BYTES_PER_PARAM bytes per parameter."""
        facts = [(self.costs.facts[k].memory, n) for k, n in comp]
        dense = sum(n * (b.params_tp / tp + b.params_rep) for b, n in facts)
        experts = sum(n * b.params_expert / (tp * ep) for b, n in facts)
        if zero >= 1:
            dense /= dp
            experts /= max(1, dp // ep)
        gpu = self.groups[group].gpu
        hbm = gpu.hbm_bandwidth * kernel_efficiency(gpu).memory
        return (dense + experts) * OPTIMIZER_BYTES_PER_PARAM / hbm

    # -- once per step, outside the pipeline and the DP overlap window -------------------------
    def sp_grad_sync(
        self, comp: Composition, *, tp: int, sp: bool, reductions: int = 1
    ) -> tuple[tuple[Collective, float, int], ...]:
        """The gradient all-reduces over tp of replicated parameters whose gradients are
        partial sums over tp, at each of the step's `reductions` gradient reductions (1; m
        under ZeRO-3, which reduce-scatters every micro-batch's gradients), as (kind, bytes,
        ranks): one all-reduce per parameter of
        - under sequence parallelism, each TP-replicated parameter
          (`BlockFacts.replicated_params`: norm weights, whose gradients are partial sums of
          each rank's tokens);
        - with or without SP, each MoE router parameter (`BlockFacts.router_params`: under
          expert TP the routing weights scale the experts' partial outputs, under EP x TP each
          tp rank routes its own sequence shard).
        torch's FSDP2 and `replicate` reduce each such `Partial` DTensor gradient before their
        own reduction, and meshplan's runtime does the same when there is no data parallelism
        (`runtime.tensor_parallel.reduce_partial_gradients`); Megatron-LM coalesces them into
        one all-reduce per step (`_allreduce_layernorm_grads`, the same volume)."""
        if tp <= 1:
            return ()
        out = []
        for key, count in comp:
            facts = self.costs.facts[key]
            numels = (facts.replicated_params if sp else ()) + facts.router_params
            for numel in numels:
                out += [(Collective.ALL_REDUCE, numel * self.precision.grad_bytes, tp)] * (
                    count * reductions
                )
        return tuple(out)

    def loss_sync_time(self, group: str, world: int, groups: Sequence[str] = ()) -> float:
        """The step's scalar loss all-reduce over all `world` ranks (`LOSS_SYNC_BYTES`; the
        runner returns the global mean loss on every rank, Megatron-LM averages it over the
        data-parallel ranks every step): latency-bound, NCCL's tree over `group`'s nodes, plus
        up and down the slowest link between the plan's `groups` when it spans several."""
        g = self.groups[group]
        n = min(world, g.num_gpus)
        t = group_collective_time(
            Collective.ALL_REDUCE, LOSS_SYNC_BYTES, self.cluster, g, n, g.domain_gpus
        )
        others = [b for b in groups if b != group]
        if others and world > n:
            t += 2 * max(self.cross_path(group, b, 1, 1).latency for b in others)
        return t

    def step_sync_time(
        self,
        comp: Composition,
        group: str,
        *,
        tp: int,
        sp: bool,
        world: int,
        groups: Sequence[str] = (),
        reductions: int = 1,
    ) -> float:
        """Seconds of the per-step synchronisations that run exposed around the optimizer
        update: `sp_grad_sync` on the intra-node tp path and `loss_sync_time`."""
        key = (comp, group, tp, sp, reductions)
        t = self._sync.get(key)
        if t is None:
            path = intra_node_path(self.cluster, self.groups[group])
            sync = self.sp_grad_sync(comp, tp=tp, sp=sp, reductions=reductions)
            t = self._sync[key] = sum(collective_time(k, size, n, path) for k, size, n in sync)
        return t + self.loss_sync_time(group, world, groups)


def _slower_gpu(a: GpuSpec, b: GpuSpec) -> GpuSpec:
    """The GPU with less streaming bandwidth (the codec's end that sets its speed)."""
    return a if a.hbm_bandwidth <= b.hbm_bandwidth else b


_PRICER_CACHE: OrderedDict[tuple, tuple[Graph, Cluster, Pricer]] = OrderedDict()


def compute_dtype(graph: Graph) -> str:
    """The dtype a model trains in: that of its floating-point parameters (what the runtime
    runs; the zoo builds bf16 models), bf16 when it has none."""
    for p in graph.params:
        if p.dtype in ("bfloat16", "float16", "float32", "float64"):
            return p.dtype
    return "bfloat16"


def pricer_for(
    graph: Graph,
    cluster: Cluster,
    dtype: str | None = None,
    comm: CommOptions | None = None,
    selective_policy: str = "keep_linear",
    engine: Engine = EAGER,
) -> Pricer:
    """A cached `Pricer` for (graph, cluster, dtype, comm, selective policy, engine), by
    identity (entries hold both objects). `dtype` None: the graph's own (`compute_dtype`)."""
    dtype = dtype or compute_dtype(graph)
    key = (id(graph), id(cluster), dtype, comm, selective_policy, engine)
    hit = _PRICER_CACHE.get(key)
    if hit is not None and hit[0] is graph and hit[1] is cluster:
        _PRICER_CACHE.move_to_end(key)
        return hit[2]
    pricer = Pricer(model_costs(graph), cluster, dtype, comm, selective_policy, engine)
    _PRICER_CACHE[key] = (graph, cluster, pricer)
    while len(_PRICER_CACHE) > _CACHE_SIZE:
        _PRICER_CACHE.popitem(last=False)
    return pricer


# ---------------------------------------------------------------------------------------------
# Tables of one configuration, and the step-time formula over a placement
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PlanTables:
    """Every number of the step-time formula for one complete `Parallel` and stage split, per
    stage and device group (the groups in `groups`). Built by `plan_tables`; priced for a
    placement by `evaluate`. Times in seconds, memory in bytes."""

    parallel: Parallel
    ranges: tuple[tuple[int, int], ...]
    groups: tuple[str, ...]
    m: int
    rep: int  # how often the DP traffic occurs per step (m for ZeRO-3, else 1)
    time: list[dict[str, StageTime]]  # [stage][group]
    window: list[dict[str, float]]  # [stage][group] overlap window of the DP traffic
    optimizer: list[dict[str, float]]  # [stage][group]
    memory: list[tuple[int, tuple[tuple[str, int], ...]]]  # [stage] (peak, breakdown)
    fits: list[dict[str, bool]]  # [stage][group]
    replica_capacity: dict[str, int]  # replicas of tp*cp GPUs each group can hold
    dp_single: list[dict[str, float]]  # [stage][group]: all replicas in that group
    dp_cross: list[dict[tuple[str, str], CrossTraffic]]  # [stage][(a, b)], a before b
    p2p: list[dict[tuple[str, str], float]] = field(default_factory=list)  # [boundary][(a, b)]
    chunks: int = 1  # model chunks per pipeline rank (interleaved 1F1B, ZB-V), else 1
    zero_bubble: bool = False  # ZB-V: the fill is (pp - 1) Z, not (S - U) / v
    # Per-group TP (`hetero_tables`): each group's tp, and each stage's (peak, breakdown) per
    # group (`memory` then holds the larger of the groups' peaks per stage). Empty otherwise.
    group_tp: dict[str, int] = field(default_factory=dict)
    group_memory: list[dict[str, tuple[int, tuple[tuple[str, int], ...]]]] = field(
        default_factory=list
    )
    # EP on several groups: (stage, group, EpSpan) -> the StageTime of a rank of that group
    # whose ep group spans groups (`Pricer.stage_time` with `span`). None: no EP all-to-all or
    # one group. `time[s][g]` of a group that cannot hold a whole ep group already holds the
    # cheapest span (`_ep_floor`); `evaluate` prices the placement's own spans with this.
    ep_span: Callable[[int, str, EpSpan], StageTime] | None = None

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return len(self.ranges)

    @property
    def fill(self) -> float:
        """Coefficient of (S - U) in the pipeline term: 1 / v, or 0 under ZB-V."""
        return 0.0 if self.zero_bubble else 1.0 / self.chunks

    def bubble_unit(self, s: int, g: str) -> float:
        """ZB-V's z[s, g] (0 for other schedules): the fill is (pp - 1) max_s z[s, g]."""
        return self.time[s][g].zb_bubble if self.zero_bubble else 0.0


def _dp_window(t: StageTime, zero: int) -> float:
    """Compute that the stage's DP traffic overlaps with (one micro-batch): ZeRO-3 gathers and
    reduces around every micro-batch's forward and backward; ZeRO-0 reduces gradients during
    the last backward; ZeRO-1/2 reduce-scatter during the last backward and all-gather the
    updated weights under the next step's first forward (Megatron-LM `--overlap-param-gather`,
    FSDP/ZeRO prefetch)."""
    if zero == 3 or zero in (1, 2):
        return t.compute + t.recompute
    return t.backward + t.recompute


def plan_tables(
    pricer: Pricer,
    parallel: Parallel,
    ranges: Sequence[tuple[int, int]],
    groups: Sequence[str] | None = None,
    *,
    max_microbatches: int | None = None,
) -> PlanTables:
    """Price every (stage, group) and (boundary, group pair) of a complete configuration.

    `max_microbatches` (uneven DP shares: the largest per-replica share) sizes the in-flight
    activations of the memory check; default the configuration's num_microbatches."""
    p = parallel
    names = tuple(groups) if groups is not None else tuple(pricer.groups)
    tp, cp, ep, dp, mb = p.tp, p.cp, p.ep, p.dp, p.micro_batch
    sp, zero, rc = bool(p.sequence_parallel), p.zero, Recompute(p.recompute)
    quant = bool(p.quantize_activations)
    m = p.global_batch // (dp * mb)
    pp = len(ranges)
    world = pp * dp * cp * tp
    rep = m if zero == 3 else 1  # gradient reductions (and ZeRO-3 gathers) per step
    reductions = rep if dp * cp > 1 else 1  # of the SP norm gradients (`sp_grad_sync`)
    costs = pricer.costs
    if pp > 1 and p.chunks > 1:  # each rank runs its chunks (ranges is the even split)
        comps = list(costs.chunked_compositions(pp, p.chunks, p.schedule == Schedule.ZERO_BUBBLE))
    else:
        comps = [costs.composition(a, b) for a, b in ranges]
    uniq: dict[Composition, dict] = {}
    for comp in comps:
        if comp in uniq:
            continue
        traffic = pricer.dp_traffic(comp, tp=tp, ep=ep, dp=dp, zero=zero, cp=cp)
        times = {
            g: pricer.stage_time(
                comp, g, tp=tp, cp=cp, ep=ep, sp=sp, micro_batch=mb, recompute=rc, quantize=quant
            )
            for g in names
        }
        cross = {}
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                cross[(a, b)] = pricer.dp_cross(traffic, a, b, tp=tp, cp=cp)
        uniq[comp] = {
            "time": times,
            "window": {g: _dp_window(t, zero) for g, t in times.items()},
            # The optimizer update, and the step's exposed syncs around it (SP gradients of
            # the replicated parameters, the loss all-reduce).
            "opt": {
                g: pricer.optimizer_time(comp, g, tp=tp, ep=ep, dp=dp * cp, zero=zero)
                + pricer.step_sync_time(
                    comp, g, tp=tp, sp=sp, world=world, groups=names, reductions=reductions
                )
                for g in names
            },
            "single": {g: pricer.dp_single(traffic, g, tp=tp, cp=cp) for g in names},
            "cross": cross,
            "mem": pricer.stage_memory(
                comp, tp=tp, cp=cp, ep=ep, dp=dp, zero=zero, recompute=rc, sp=sp, micro_batch=mb
            ),
        }
    capacity = {g: replica_capacity(pricer.groups[g], tp, cp) for g in names}
    ep_span = None
    moe = any(costs.facts[k].a2a_bytes for comp in comps for k, _ in comp)
    if ep > 1 and len(names) > 1 and moe:
        kw = dict(tp=tp, cp=cp, ep=ep, sp=sp, micro_batch=mb, recompute=rc, quantize=quant)

        def ep_span(s: int, g: str, span: EpSpan) -> StageTime:
            return pricer.stage_time(comps[s], g, **kw, span=span)

        for comp, u in uniq.items():
            for g in names:
                if capacity[g] < ep:  # every ep group with ranks here spans groups
                    floor = _ep_floor(pricer, comp, g, names, capacity, kw)
                    if floor is not None:
                        u["time"][g] = floor
                        u["window"][g] = _dp_window(floor, zero)
    time, window, opt, memory, fits, single, cross = [], [], [], [], [], [], []
    peaks: dict[tuple, tuple] = {}
    for s, comp in enumerate(comps):
        u = uniq[comp]
        held = in_flight_microbatches(p.schedule, s, pp, max_microbatches or m, p.chunks)
        # Quantized activations: the AGoQ widths depend on the stage (early: attention 4 bits).
        early = quant and 2 * (pp - s) > pp
        got = peaks.get((comp, held, early))
        if got is None:
            mem = u["mem"]
            if quant:
                mem = pricer.stage_memory(
                    comp,
                    tp=tp,
                    cp=cp,
                    ep=ep,
                    dp=dp,
                    zero=zero,
                    recompute=rc,
                    sp=sp,
                    micro_batch=mb,
                    quantize=True,
                    stage=s,
                    num_stages=pp,
                )
            peak = mem.peak(held)
            fit = {g: peak[0] <= pricer.groups[g].gpu.memory_bytes for g in names}
            got = peaks[(comp, held, early)] = (peak, fit)
        time.append(u["time"])
        window.append(u["window"])
        opt.append(u["opt"])
        memory.append(got[0])
        fits.append(got[1])
        single.append(u["single"])
        cross.append(u["cross"])
    scale = mb / costs.traced_micro_batch
    streams = tp * cp * dp
    by_boundary: dict[str, dict[tuple[str, str], float]] = {}
    p2p = []
    for s in range(pp - 1):
        bkey = costs.boundary_key(ranges[s][1])
        row = by_boundary.get(bkey)
        if row is None:
            # Megatron's scatter/gather optimisation (Narayanan et al. SC'21, sec. 4.1; also what
            # a sequence-parallel boundary sends): each TP rank sends 1/tp of the activation.
            size = costs.facts[bkey].output_bytes * scale / (cp * tp)
            row = by_boundary[bkey] = {
                (a, b): pricer.p2p(size, a, b, streams) for a in names for b in names
            }
        p2p.append(row)
    return PlanTables(
        parallel=p,
        ranges=tuple(ranges),
        groups=names,
        m=m,
        rep=rep,
        time=time,
        window=window,
        optimizer=opt,
        memory=memory,
        fits=fits,
        replica_capacity=capacity,
        dp_single=single,
        dp_cross=cross,
        p2p=p2p,
        chunks=p.chunks if pp > 1 else 1,
        zero_bubble=p.schedule == Schedule.ZERO_BUBBLE and pp > 1,
        ep_span=ep_span,
    )


def _ep_floor(
    pricer: Pricer,
    comp: Composition,
    g: str,
    names: Sequence[str],
    capacity: Mapping[str, int],
    kw: Mapping,
) -> StageTime | None:
    """A rank of group g whose ep group cannot fit in g (capacity[g] < ep replicas): the
    cheapest `EpSpan` it can be part of, over a partner group h and g's share c of the ep
    ranks (c <= capacity[g], ep - c <= capacity[h]), with the fewest streams (tp * cp: one
    spanning chunk). A lower bound on what `evaluate` charges any placement (exact for two
    groups split at one chunk); None when no partner can hold the rest."""
    ep, lanes = kw["ep"], kw["tp"] * kw["cp"]
    best: StageTime | None = None
    for h in names:
        if h == g:
            continue
        for c in range(max(1, ep - capacity[h]), min(capacity[g], ep - 1) + 1):
            span = EpSpan(((g, c), (h, ep - c)), streams=lanes)
            t = pricer.stage_time(comp, g, **kw, span=span)
            if best is None or t.total < best.total:
                best = t
    return best


def hetero_tables(
    pricer: Pricer,
    parallel: Parallel,
    ranges: Sequence[tuple[int, int]],
    group_tp: Mapping[str, int],
    *,
    max_microbatches: int | None = None,
) -> PlanTables:
    """`plan_tables` of a configuration whose device groups use their own TP degrees
    (`StagePlacement.group_tp`: group-pure pipelines, ZeRO-0).

    Each group's entries (stage times, overlap windows, optimizer, memory, fits, replica
    capacity, boundaries inside the group) come from `plan_tables` at that group's tp
    (sequence parallelism where its tp > 1); the DP traffic of every stage spans the groups
    and is `Pricer.dp_cross_hetero`. Boundaries between different groups are infinite: a
    pipeline never leaves its group. `evaluate` prices these tables as any other."""
    names = tuple(group_tp)
    per: dict[str, PlanTables] = {}
    for g, tp in group_tp.items():
        p_g = dataclasses.replace(
            parallel, tp=tp, sequence_parallel=bool(parallel.sequence_parallel) and tp > 1
        )
        per[g] = plan_tables(pricer, p_g, ranges, (g,), max_microbatches=max_microbatches)
    first = per[names[0]]
    pp = first.pp
    costs = pricer.costs
    if pp > 1 and first.chunks > 1:
        comps = list(
            costs.chunked_compositions(pp, first.chunks, parallel.schedule == Schedule.ZERO_BUBBLE)
        )
    else:
        comps = [costs.composition(a, b) for a, b in ranges]
    cross: list[dict[tuple[str, str], CrossTraffic]] = []
    made: dict[Composition, dict] = {}
    for comp in comps:
        row = made.get(comp)
        if row is None:
            row = made[comp] = {
                (a, b): pricer.dp_cross_hetero(
                    comp, a, b, group_tp, dp=parallel.dp, cp=parallel.cp or 1
                )
                for i, a in enumerate(names)
                for b in names[i + 1 :]
            }
        cross.append(row)
    group_memory = [{g: per[g].memory[s] for g in names} for s in range(pp)]
    # The step's scalar loss all-reduce crosses between the groups (up and down the link).
    hop = {
        g: 2 * max((pricer.cross_path(g, o, 1, 1).latency for o in names if o != g), default=0.0)
        for g in names
    }
    p2p = [
        {(a, b): (per[a].p2p[s][(a, a)] if a == b else math.inf) for a in names for b in names}
        for s in range(pp - 1)
    ]
    return PlanTables(
        parallel=parallel,
        ranges=tuple(ranges),
        groups=names,
        m=first.m,
        rep=first.rep,
        time=[{g: per[g].time[s][g] for g in names} for s in range(pp)],
        window=[{g: per[g].window[s][g] for g in names} for s in range(pp)],
        optimizer=[{g: per[g].optimizer[s][g] + hop[g] for g in names} for s in range(pp)],
        memory=[max(row.values(), key=lambda x: x[0]) for row in group_memory],
        fits=[{g: per[g].fits[s][g] for g in names} for s in range(pp)],
        replica_capacity={g: per[g].replica_capacity[g] for g in names},
        dp_single=[{g: math.inf for g in names} for _ in range(pp)],
        dp_cross=cross,
        p2p=p2p,
        chunks=first.chunks,
        zero_bubble=first.zero_bubble,
        group_tp=dict(group_tp),
        group_memory=group_memory,
    )


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The step time of one placement and its breakdown (seconds)."""

    step_time_s: float
    breakdown: tuple[tuple[str, float], ...]
    bottleneck_stage: int
    bottleneck_group: str


Placement = Sequence[Sequence[tuple[str, int]]]  # [stage] -> ((group, replicas), ...)


def _pipeline(
    tables: PlanTables, stage_u: list[float], m: int, p2p: float, z: float = 0.0
) -> float:
    """m U + (sum_s u_s - U) / v + (pp - 1) Z + (m v + pp - 1) P: the pipeline term of one
    pipeline (Z, ZB-V's bubble unit, is 0 for the other schedules and 1/v is then 0)."""
    v, big_u = tables.chunks, max(stage_u)
    fill = (sum(stage_u) - big_u) * tables.fill + (tables.pp - 1) * z
    return m * big_u + fill + (m * v + tables.pp - 1) * p2p


def evaluate(
    tables: PlanTables, placement: Placement, shares: Mapping[str, int] | None = None
) -> Evaluation:
    """Price `placement` with the step-time formula of the module docstring.

    `shares` (group -> micro-batches per replica, uneven DP batch shares) prices group-pure
    pipelines: each group's pipelines run the formula with their own m_g over their own stage
    times, and the slowest group sets the pipeline term; DP traffic and the optimizer are as
    without shares (all replicas reduce together once their micro-batches are done)."""
    pp = tables.pp
    used = [[g for g, n in reps if n > 0] for reps in placement]
    if len(used) != pp or any(not u for u in used):
        raise ValueError("placement must give every stage at least one replica")
    if shares:
        # Group-pure pipelines: the slowest group's pipeline (with its own m_g) is the step's.
        def group_term(g: str) -> float:
            us = [tables.time[s][g].total for s in range(pp)]
            p = max((tables.p2p[s][(g, g)] for s in range(pp - 1)), default=0.0)
            z = max(tables.bubble_unit(s, g) for s in range(pp))
            return _pipeline(tables, us, shares[g], p, z)

        slow = max(sorted(shares), key=group_term)
        m = shares[slow]
        used_pipe = [[slow] for _ in range(pp)]
    else:
        m = tables.m
        used_pipe = used
    times = tables.time if shares else _span_times(tables, placement)
    stage_u, stage_g = [], []
    for s in range(pp):
        g = max(used_pipe[s], key=lambda x: times[s][x].total)
        stage_g.append(g)
        stage_u.append(times[s][g].total)
    s_star = max(range(pp), key=lambda s: stage_u[s])
    big_u = stage_u[s_star]
    p2p = max(
        (
            tables.p2p[s][(a, b)]
            for s in range(pp - 1)
            for a in used_pipe[s]
            for b in used_pipe[s + 1]
        ),
        default=0.0,
    )
    crossing = sum(1 for u in used if len(u) > 1)
    exposed = 0.0
    for s in range(pp):
        if len(used[s]) == 1:
            comm = tables.dp_single[s][used[s][0]]
        else:
            order = [g for g in tables.groups if g in used[s]]
            comm = max(
                tables.dp_cross[s][(a, b)].time(crossing)
                for i, a in enumerate(order)
                for b in order[i + 1 :]
            )
        window = max(tables.window[s][g] for g in used[s])
        exposed = max(exposed, comm - OVERLAP_EFFICIENCY * min(comm, window))
    optimizer = max(tables.optimizer[s][g] for s in range(pp) for g in used[s])
    t = times[s_star][stage_g[s_star]]
    v = tables.chunks
    z = max(
        times[s][g].zb_bubble if tables.zero_bubble else 0.0
        for s in range(pp)
        for g in used_pipe[s]
    )
    parts = {
        "compute": m * t.compute,
        "recompute": m * t.recompute,
        "tp_comm": m * t.tp_comm,
        "cp_comm": m * t.cp_comm,
        "ep_comm": m * t.ep_comm,
        "pp_p2p": m * v * p2p,
        "pp_bubble": (sum(stage_u) - big_u) * tables.fill + (pp - 1) * (z + p2p),
        "dp_comm_exposed": tables.rep * exposed,
        "optimizer": optimizer,
    }
    breakdown = tuple((k, parts[k]) for k in BREAKDOWN_PARTS)
    return Evaluation(sum(parts.values()), breakdown, s_star, stage_g[s_star])


def _span_times(tables: PlanTables, placement: Placement) -> list[dict[str, StageTime]]:
    """Per (stage, group) the StageTime a rank there takes under `placement`: the table's,
    but where the stage's ep groups span device groups (`ep_spans`), the slowest of the
    spanning ep groups the group takes part in, priced with every spanning ep group of the
    step crossing at once (tp * cp per spanning chunk, over all stages)."""
    ep = tables.parallel.ep or 1
    if ep <= 1 or tables.ep_span is None:
        return tables.time
    per_stage = [ep_spans([(g, n) for g, n in reps if n > 0], ep) for reps in placement]
    chunks = sum(len(spanning) for spanning, _ in per_stage)
    if not chunks:
        return tables.time
    streams = chunks * (tables.parallel.tp or 1) * (tables.parallel.cp or 1)
    out = []
    for s, (spanning, whole) in enumerate(per_stage):
        row = dict(tables.time[s])
        priced: set[str] = set(whole)  # groups whose row already holds a time that applies
        for members in spanning:
            span = EpSpan(members, streams)
            for g, _ in members:
                t = tables.ep_span(s, g, span)
                # without a whole ep group in g, the table's time (in-group EP) does not apply
                if g not in priced or t.total > row[g].total:
                    row[g] = t
                priced.add(g)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# Public entry
# ---------------------------------------------------------------------------------------------


def check_parallel(
    graph: Graph, cluster: Cluster, parallel: Parallel, stages: Sequence[StagePlacement]
) -> None:
    """Raise ValueError (one line) when `parallel` and `stages` do not describe a valid step."""
    p = parallel
    if not p.is_complete:
        missing = [
            k
            for k in Parallel.__dataclass_fields__
            if getattr(p, k) is None and k != "virtual_stages"
        ]
        raise ValueError(f"predict needs a complete Parallel; missing {', '.join(missing)}")
    if p.schedule not in PRICED_SCHEDULES:
        raise ValueError(
            f"schedule {p.schedule.value!r} is not modelled yet; use "
            + " or ".join(repr(s.value) for s in PRICED_SCHEDULES)
        )
    if p.global_batch % (p.dp * p.micro_batch):
        raise ValueError(
            f"global_batch={p.global_batch} is not divisible by dp*micro_batch="
            f"{p.dp}*{p.micro_batch}={p.dp * p.micro_batch}"
        )
    if p.ep > 1 and p.dp % p.ep:
        raise ValueError(f"ep={p.ep} must divide dp={p.dp} (expert ranks reuse DP ranks)")
    if p.schedule == Schedule.ZERO_BUBBLE and p.num_microbatches < 2 * p.pp - 1:
        raise ValueError(
            f"schedule 'zero_bubble' (ZB-V) needs at least 2*pp - 1 = {2 * p.pp - 1} "
            f"micro-batches, got {p.num_microbatches}; raise global_batch or lower micro_batch"
        )
    if len(stages) != p.pp:
        raise ValueError(f"pp={p.pp} but {len(stages)} stage placements were given")
    shares = stages[0].microbatches if stages else ()
    if shares or any(st.microbatches for st in stages):
        if any(
            (st.replicas, dict(st.microbatches)) != (stages[0].replicas, dict(shares))
            for st in stages
        ):
            raise ValueError(
                "uneven micro-batch shares need group-pure pipelines: every stage must have "
                "the same replicas and shares"
            )
        if p.zero == 3:
            raise ValueError(
                "uneven micro-batch shares need ZeRO <= 2 (ZeRO-3 gathers weights in lock-step "
                "for every micro-batch)"
            )
        total = sum(n * dict(shares)[g] for g, n in stages[0].replicas)
        if total != p.dp * p.num_microbatches:
            raise ValueError(
                f"micro-batch shares add up to {total} micro-batches, but dp * num_microbatches "
                f"= {p.dp}*{p.num_microbatches} = {p.dp * p.num_microbatches}"
            )
    if any(st.group_tp for st in stages) and (why := group_tp_problem(p, tuple(stages))):
        raise ValueError(why)
    if p.pp > 1 and p.chunks > 1:
        counts = layer_counts(graph, [(st.first_unit, st.last_unit) for st in stages])
        want = rank_layers(sum(counts), p.pp, p.chunks, p.schedule == Schedule.ZERO_BUBBLE)
        if counts != want:
            raise ValueError(
                f"schedule {p.schedule.value!r} runs {p.chunks} chunks per rank: its chunk "
                f"layout (`partition.chunk_layers`) gives the ranks {list(want)} layers, but "
                f"the stages hold {list(counts)}"
            )
    expect = 0
    for i, st in enumerate(stages):
        if st.index != i or st.first_unit != expect:
            raise ValueError(f"stage {i} must start at unit {expect}, got {st.first_unit}")
        if st.dp != p.dp:
            raise ValueError(f"stage {i} has {st.dp} replicas but dp={p.dp}")
        expect = st.last_unit
    if expect != len(graph.units):
        raise ValueError(f"stages cover units [0, {expect}) of {len(graph.units)}")
    used: dict[str, int] = {}
    known = {g.name: g for g in cluster.groups}
    for st in stages:
        for g, n in st.replicas:
            if g not in known:
                raise ValueError(f"stage {st.index}: unknown device group {g!r}")
            used[g] = used.get(g, 0) + n
    for g, n in used.items():
        tp = stages[0].tp_of(g, p.tp)
        cap = replica_capacity(known[g], tp, p.cp)
        if (why := tp_domain_problem((known[g],), tp)) is not None:
            raise ValueError(why)
        if n > cap:
            raise ValueError(
                f"group {g}: {n} replicas of tp*cp={tp * p.cp} GPUs need "
                f"{n * tp * p.cp} GPUs, it has {known[g].num_gpus}"
            )


def predict(
    graph: Graph,
    cluster: Cluster,
    parallel: Parallel,
    stages: Sequence[StagePlacement],
    *,
    dtype: str | None = None,
    comm: CommOptions | None = None,
    selective_policy: str = "keep_linear",
    engine: Engine = EAGER,
) -> Prediction:
    """Predict step time, throughput, MFU and per-(stage, group) peak memory of a placed config.

    `parallel` must be complete; `stages` give each pipeline stage's unit range and replicas
    per device group (`meshplan.passes.partition.place_stages` makes the default one). The
    graph's costs are for `graph.info.micro_batch` sequences of `graph.info.seq_len` tokens;
    `parallel.micro_batch` scales them linearly. MFU counts the model's FLOPs
    (`graph.total_flops(training=True)`, scaled to the global batch, recomputation excluded)
    over the dense peak of every GPU the plan uses, in `dtype` (None: the model's own,
    `compute_dtype`: a bf16 model trains in bf16 mixed precision, an fp32 one in fp32).
    `comm` (compression.CommOptions): what
    may be done to traffic (lossless coding, int8 gradients), each collective at its fastest
    allowed method; None prices raw collectives (what published runs did).
    `selective_policy` (`meshplan.cost_model.recompute.SelectivePolicy`): how selective
    recomputation keeps outputs; the default is meshplan's (keep every linear). `engine`
    (`cost_model.engine.Engine`): fused kernels, Float8 and TP overlap as other stacks run
    them; the default is meshplan's eager runtime.
    """
    check_parallel(graph, cluster, parallel, stages)
    p = parallel
    pricer = pricer_for(graph, cluster, dtype, comm, selective_policy, engine)
    dtype = pricer.dtype
    ranges = [(st.first_unit, st.last_unit) for st in stages]
    names = tuple(
        g.name for g in cluster.groups if any(g.name == r for st in stages for r, _ in st.replicas)
    )
    shares = stages[0].shares
    most = max(shares.values()) if shares else None
    if stages[0].group_tp:
        group_tp = {g: stages[0].tp_of(g, p.tp) for g in names}
        tables = hetero_tables(pricer, p, ranges, group_tp, max_microbatches=most)
    else:
        tables = plan_tables(pricer, p, ranges, names, max_microbatches=most)
    placement = [st.replicas for st in stages]
    ev = evaluate(tables, placement, shares or None)

    traced_mb = pricer.costs.traced_micro_batch
    model_flops = graph.total_flops(training=True) * p.global_batch / traced_mb
    peak_flops = sum(
        n * st.tp_of(g, p.tp) * p.cp * pricer.groups[g].gpu.peak(dtype)
        for st in stages
        for g, n in st.replicas
    )
    tokens = p.global_batch * (graph.info.seq_len or 1)

    def stage_memory_of(s: int, g: str) -> tuple[int, tuple[tuple[str, int], ...]]:
        return tables.group_memory[s][g] if tables.group_memory else tables.memory[s]

    memory = tuple(
        RankMemory(
            stage=st.index,
            group=g,
            peak_bytes=stage_memory_of(st.index, g)[0],
            capacity_bytes=pricer.groups[g].gpu.memory_bytes,
            breakdown=stage_memory_of(st.index, g)[1],
        )
        for st in stages
        for g, _ in st.replicas
    )
    notes = []
    if not graph.info.micro_batch:
        notes.append("graph.info.micro_batch is unknown: costs taken as one sequence")
    elif p.micro_batch != traced_mb:
        notes.append(
            f"costs scaled linearly from the traced micro-batch {traced_mb} to {p.micro_batch}"
        )
    if not graph.info.seq_len:
        notes.append("graph.info.seq_len is unknown: tokens/s counts sequences")
    notes += graph.info.assumptions  # what the trace assumed about the data (`ir.trace`)
    for st in stages if p.ep > 1 else ():
        for members in ep_spans(st.replicas, p.ep)[0]:
            split = " | ".join(f"{n} in {g}" for g, n in members)
            notes.append(
                f"stage {st.index}: an ep group spans device groups ({split}): its "
                "all-to-alls cross between the groups"
            )
    bottleneck = f"bottleneck: stage {ev.bottleneck_stage} on {ev.bottleneck_group}"
    notes.append(bottleneck)
    latency = _latency_sources([pricer.groups[g].gpu for g in names])
    if not engine.is_eager:
        latency = f"analytic roofline, engine {engine.describe()}"
    notes.append(f"op latency: {latency}")
    step = ev.step_time_s
    return Prediction(
        step_time_s=step,
        tokens_per_s=tokens / step if step > 0 else math.inf,
        mfu=model_flops / (step * peak_flops) if step > 0 and peak_flops > 0 else 0.0,
        model_flops_per_step=float(model_flops),
        peak_memory_bytes=max(r.peak_bytes for r in memory),
        fits=all(r.fits for r in memory),
        breakdown=ev.breakdown,
        memory=memory,
        notes=tuple(notes),
        latency_source=latency,
    )


def _latency_sources(gpus: Sequence[GpuSpec]) -> str:
    """The op-latency model of each GPU type used (one text when they all agree)."""
    from .compute import latency_source

    by_type = {g.name: latency_source(g) for g in gpus}
    if len(set(by_type.values())) == 1:
        return next(iter(by_type.values()))
    return "; ".join(f"{name}: {src}" for name, src in sorted(by_type.items()))
