"""Peak memory of one rank: model states by ZeRO stage, activations by schedule and recompute.

Model states (bytes per parameter held by the rank, mixed-precision Adam; d = data-parallel
shards; Rajbhandari et al., "ZeRO", SC'20, section 5.1):

    ZeRO-0 (DDP)          2 weights + 2 grads + 12 optimizer    = 16
    ZeRO-1 (optimizer)    2 + 2 + 12/d                          = 4 + 12/d
    ZeRO-2 (+ gradients)  2 + (2 + 12)/d                        = 2 + 14/d
    ZeRO-3 (+ weights)    (2 + 2 + 12)/d + the largest gathered layer

Convention chosen for bf16/fp16 models (`MIXED`): bf16 weights and bf16 gradients
(`GRAD_BYTES = 2`) with an fp32 master copy, momentum and variance (`OPTIMIZER_BYTES = 12`),
which is the ZeRO paper's (the table above). The ZeRO-1 figure often quoted instead,
"6 + 12/DP", is Megatron-LM's distributed optimizer with *fp32* main gradients (its "bf16
param, fp32 grads: 18 bytes non-distributed, 6 + 12/d distributed"); set `GRAD_BYTES = 4` to
model that convention for every stage. A float32 model trains in plain fp32 (`FP32`: 4 + 4 + 8, no
master copy); `precision_for` picks by the traced parameters' dtype. Parameters a rank holds:
the stage's parameters / tp (norm weights are replicated), expert parameters / (tp * ep);
expert states are sharded over the dp / ep ranks that hold the same experts.

Activations (per in-flight micro-batch): the tracer's `saved_bytes` (what autograd keeps) of
the stage's ops, scaled linearly to the micro-batch, divided by cp, and by tp for ops that TP
shards; ops TP does not shard (norms, and in the prologue/epilogue everything but the
vocab-parallel embedding, head and loss) are divided by tp only under sequence parallelism.
Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022) give
s*b*h*(34 + 5*a*s/h) per layer without TP and s*b*h*(10 + 24/t + 5*a*s/(h*t)) with TP and no
SP: our per-op split gives (4 + 30/t) instead of (10 + 24/t) for the s*b*h term, because the
replicated inputs of the column-parallel linears and the dropout masks after the row-parallel
ones are counted as sharded (documented approximation; with SP both are exactly /t).
Recompute: selective (op-level, `compute.kept_by_selective`; the other documented policies,
e.g. torchtitan's every-other-matmul, are in `meshplan.cost_model.recompute`) keeps each
layer's input and the outputs of its linear layers, fused attention and experts, and
recomputes the rest (norms, activations, RoPE, an unfused attention's scores/softmax/dropout);
full keeps only each
layer's input (`Block.inputs`). Either adds one layer's recomputed activations while that
layer's backward runs. Prologue/epilogue blocks are never recomputed.

Schedules: 1F1B stage i of p holds min(p - i, m) micro-batches, GPipe all m (hardware.md).
On top: ZeRO-3's gathered layer, a temporary buffer (twice the largest op output, e.g.
output + gradient of the logits), the CUDA context/NCCL workspace and an allocator margin.
The peak is the larger of two moments (`StageMemory.peak`): the start of backward (all saved
activations + the temporary buffer) and, with recomputation, a recomputed layer's backward
(the epilogue's activations already freed, the layer's rebuilt ones, twice its largest
output). Both are checked against torch's own allocation profile of a CPU training step.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshplan.ir import Block, OpKind, Recompute

from .compute import (
    LABEL_BYTES,
    LSE_BYTES,
    kept_by_selective,
    logits_of,
    loss_chain,
    splits_with_tp,
)
from .recompute import kept_ops

WEIGHT_BYTES = 2  # bf16 weights (hardware.md)
GRAD_BYTES = 2  # bf16 gradients (ZeRO paper convention, see the module docstring)
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam momentum + variance (hardware.md)


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per parameter of the model states under one training precision."""

    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


# Mixed precision (bf16/fp16 compute): the ZeRO paper's 2 + 2 + 12 (see the module docstring).
MIXED = Precision(WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES)
# Plain fp32 training (no master copy): fp32 weights and gradients, Adam's fp32 momentum and
# variance (torch.optim.Adam/AdamW state `exp_avg`, `exp_avg_sq`): 4 + 4 + 8.
FP32 = Precision(4, 4, 8)


def precision_for(dtype: str) -> Precision:
    """The model-state precision of a model whose parameters (and compute) are `dtype`:
    plain fp32 for float32/float64 models (and TF32 compute: fp32 storage), bf16/fp16 mixed
    precision otherwise."""
    return FP32 if dtype in ("float32", "float64", "tfloat32") else MIXED


# CUDA context, cuBLAS workspace and NCCL buffers per rank. Assumption (commonly 0.5-1.5 GiB
# on H100 with NCCL), not fitted; checked against published peak memory (docs/fidelity.md).
CONTEXT_BYTES = 2**30
# Caching-allocator fragmentation and short-lived tensors not modelled above, as a fraction of
# everything else. Assumption, not fitted; checked as CONTEXT_BYTES above.
ALLOCATOR_MARGIN = 0.10
# Temporary buffer: the largest op output twice (the output and its gradient coexist).
TEMP_OUTPUTS = 2


def state_bytes_per_param(
    zero: int, shards: int, precision: Precision = MIXED
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter the rank holds, for a ZeRO stage
    whose sharded states are split `shards` ways."""
    d = max(1, shards)
    w, g, o = precision.weight_bytes, precision.grad_bytes, precision.optimizer_bytes
    if zero == 0:
        return w, g, o
    if zero == 1:
        return w, g, o / d
    if zero == 2:
        return w, g / d, o / d
    if zero == 3:
        return w / d, g / d, o / d
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")


def summed_states(
    dense: float, expert: float, *, shards: int, ep: int, zero: int, precision: Precision = MIXED
) -> float:
    """Bytes of model states that the ranks of a configuration hold between them, whatever the
    split into stages and the TP degree: every parameter's states are held by its `shards`
    (dp * cp) data-parallel copies at the per-rank bytes of `state_bytes_per_param` (expert
    states by shards / ep copies, as `stage_memory` shards them). A replicated parameter
    (norm weights under TP) counts once: a lower bound."""

    def copies(d: int) -> float:  # one parameter's state bytes over its d copies
        return d * sum(state_bytes_per_param(zero, d, precision))

    return dense * copies(max(1, shards)) + expert * copies(max(1, shards // max(1, ep)))


def least_peak(states: float, ranks: int) -> float:
    """A lower bound on the largest peak (`StageMemory.peak`) of `ranks` ranks that hold
    `states` bytes of model states between them (`summed_states`): some rank holds the
    average, and its peak adds the allocator margin and the context (activations only add).
    A cheap first check before the per-stage one: a configuration whose bound passes every
    GPU it may use fits on none."""
    return (1 + ALLOCATOR_MARGIN) * states / max(1, ranks) + CONTEXT_BYTES


def holds_states(states: float, ranks: Iterable[tuple[int, float]]) -> bool:
    """Whether ranks of these capacities ((count, bytes per rank) pairs) can hold `states`
    bytes of model states between them (`summed_states`), each rank's peak with the allocator
    margin and the context within its capacity: `least_peak` for ranks of unequal memory. A
    necessary condition of any split fitting."""
    room = sum(n * (capacity - CONTEXT_BYTES) for n, capacity in ranks)
    return (1 + ALLOCATOR_MARGIN) * states <= room


@dataclass(frozen=True, slots=True)
class BlockMemory:
    """Memory facts of one block instance at the traced micro-batch (GPU-independent).

    Parameter counts are elements; `params_tp` are sharded by TP, `params_rep` replicated (norm
    weights, MoE router gates), `params_expert` sharded by TP and EP. Activation bytes are
    split into the part TP always shards (`*_tp`) and the part only sequence parallelism
    shards (`*_sp`).
    """

    kind: str
    params_tp: int
    params_rep: int
    params_expert: int
    saved_tp: int
    saved_sp: int
    selective_kept_tp: int
    selective_kept_sp: int
    input_bytes: int
    max_output_tp: int
    max_output_sp: int
    # Kept outputs under torchtitan's op-level policy (`recompute.SelectivePolicy`).
    torchtitan_kept_tp: int = 0
    torchtitan_kept_sp: int = 0
    # A fused cross-entropy kernel (`Engine.fused_loss`) in place of the epilogue's loss chain
    # (`compute.loss_chain`): what the chain saves eagerly (taken out), what the fused kernel
    # saves (the logits, an fp32 logsumexp and the label per row; split by TP), the
    # largest output of the other ops, and the logits' gradient the kernel writes.
    loss_saved_tp: int = 0
    loss_saved_sp: int = 0
    fused_loss_saved: int = 0
    fused_loss_max_output_tp: int = 0
    fused_loss_max_output_sp: int = 0
    fused_loss_grad: int = 0

    def params_per_rank(self, tp: int, ep: int) -> float:
        """Parameters of one instance that one rank holds before ZeRO sharding."""
        return self.params_tp / tp + self.params_rep + self.params_expert / (tp * ep)

    def activations(
        self,
        *,
        tp: int,
        cp: int,
        sequence_parallel: bool,
        scale: float,
        recompute: Recompute,
        policy: str = "keep_linear",
        fused_loss: bool = False,
    ) -> float:
        """Saved bytes of one micro-batch of this block on one rank. `policy` says how
        selective recomputation keeps outputs (`meshplan.cost_model.recompute`);
        `fused_loss`: the loss chain is one fused cross-entropy kernel (`Engine.fused_loss`)."""
        r_tp = scale / (tp * cp)
        r_sp = scale / ((tp if sequence_parallel else 1) * cp)
        if self.kind == "layer" and recompute == Recompute.FULL:
            return self.input_bytes * r_sp  # the layer input is sequence-sharded under SP
        saved = self.saved_tp * r_tp + self.saved_sp * r_sp
        if fused_loss and self.fused_loss_saved:
            saved += (self.fused_loss_saved - self.loss_saved_tp) * r_tp
            saved -= self.loss_saved_sp * r_sp
        if self.kind == "layer" and recompute == Recompute.SELECTIVE:
            if policy == "every_other_layer":  # half the layers full, half none
                return 0.5 * (saved + self.input_bytes * r_sp)
            if policy == "torchtitan_op":
                kept = self.torchtitan_kept_tp * r_tp + self.torchtitan_kept_sp * r_sp
            else:
                kept = self.selective_kept_tp * r_tp + self.selective_kept_sp * r_sp
            return min(saved, kept + self.input_bytes * r_sp)
        return saved

    def largest_output(
        self, *, tp: int, cp: int, sequence_parallel: bool, scale: float, fused_loss: bool = False
    ) -> float:
        """Bytes of the largest op output of one micro-batch on one rank (with `fused_loss`,
        of the ops outside the loss chain but the logits, which the loss keeps: their
        gradient is `fused_loss_gradient`)."""
        r_tp = scale / (tp * cp)
        r_sp = scale / ((tp if sequence_parallel else 1) * cp)
        if fused_loss and self.fused_loss_saved:
            return max(self.fused_loss_max_output_tp * r_tp, self.fused_loss_max_output_sp * r_sp)
        return max(self.max_output_tp * r_tp, self.max_output_sp * r_sp)

    def fused_loss_gradient(self, *, tp: int, cp: int, scale: float) -> float:
        """Bytes of the logits' gradient the fused cross-entropy backward writes, one
        micro-batch on one rank (vocab-parallel: split by TP)."""
        return self.fused_loss_grad * scale / (tp * cp)


def replicated_params(block: Block) -> tuple[int, ...]:
    """Elements of each parameter of `block` that tensor parallelism leaves whole (norm
    weights): read only by ops that do not split with TP and not expert weights, the rule
    `block_memory` counts into `params_rep` (which also holds the MoE router's gate, whole on
    every tp rank but listed apart: `graph_costs.BlockFacts.router_params`). Under sequence
    parallelism each TP rank sees only its share of the tokens, so these parameters'
    gradients are partial sums over tp."""
    split: set[str] = set()
    seen: set[str] = set()
    for op in block.ops:
        seen.update(op.params)
        if op.kind == OpKind.EXPERTS or splits_with_tp(op, block.kind):
            split.update(op.params)
    return tuple(p.numel for p in block.params if p.name in seen and p.name not in split)


def block_memory(block: Block) -> BlockMemory:
    """Classify `block`'s parameters and saved activations (one pass over its ops)."""
    sharded: set[str] = set()
    expert: set[str] = set()
    seen: set[str] = set()
    saved = {"tp": 0, "sp": 0}
    kept = {"tp": 0, "sp": 0}
    kept_tt = {"tp": 0, "sp": 0}
    tt_ops = kept_ops(block, "torchtitan_op")
    out_max = {"tp": 0, "sp": 0}
    chain = set(loss_chain(block))
    head = min(chain) - 1 if chain else -1  # the output head: its output is the logits
    loss_saved = {"tp": 0, "sp": 0}
    fused_max = {"tp": 0, "sp": 0}
    for i, op in enumerate(block.ops):
        split = splits_with_tp(op, block.kind)
        cls = "tp" if split else "sp"
        if i in chain:
            loss_saved[cls] += op.saved_bytes
        elif i != head:
            fused_max[cls] = max(fused_max[cls], sum(t.nbytes for t in op.outputs))
        seen.update(op.params)
        if op.kind == OpKind.EXPERTS:
            expert.update(op.params)
        elif split and op.kind != OpKind.ROUTER:  # the router's gate stays whole under TP
            sharded.update(op.params)
        saved[cls] += op.saved_bytes
        if kept_by_selective(op):
            kept[cls] += sum(t.nbytes for t in op.outputs)
        if i in tt_ops:
            kept_tt[cls] += sum(t.nbytes for t in op.outputs)
        out_max[cls] = max(out_max[cls], sum(t.nbytes for t in op.outputs))
    # Stacked expert biases (GPT-style `b_up` (E, 1, f), `b_down` (E, 1, h)) are read by `add`
    # ops, not the expert GEMMs: a 3-D parameter whose leading dim is the expert count is an
    # expert parameter too (EP shards it on dim 0 with the weights).
    logits, rows = logits_of(block)
    lead = {p.shape[0] for p in block.params if p.name in expert and len(p.shape) == 3}
    p_tp = p_rep = p_exp = 0
    for p in block.params:
        if p.name in expert or (len(p.shape) == 3 and p.shape[0] in lead):
            p_exp += p.numel
        elif p.name in sharded or p.name not in seen:  # unread params: assume TP-sharded
            p_tp += p.numel
        else:
            p_rep += p.numel
    return BlockMemory(
        kind=block.kind,
        params_tp=p_tp,
        params_rep=p_rep,
        params_expert=p_exp,
        saved_tp=saved["tp"],
        saved_sp=saved["sp"],
        selective_kept_tp=kept["tp"],
        selective_kept_sp=kept["sp"],
        input_bytes=sum(t.nbytes for t in block.inputs),
        max_output_tp=out_max["tp"],
        max_output_sp=out_max["sp"],
        torchtitan_kept_tp=kept_tt["tp"],
        torchtitan_kept_sp=kept_tt["sp"],
        loss_saved_tp=loss_saved["tp"],
        loss_saved_sp=loss_saved["sp"],
        fused_loss_saved=logits + rows * (LSE_BYTES + LABEL_BYTES) if chain else 0,
        fused_loss_max_output_tp=fused_max["tp"],
        fused_loss_max_output_sp=fused_max["sp"],
        fused_loss_grad=logits,
    )


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Memory of one rank of a pipeline stage, except the in-flight multiplier (bytes).

    `temporary`: short-lived buffers at the start of backward (twice the largest op output,
    e.g. the logits' gradients); `layer_temporary` the same over the recomputed layers only;
    `freed_before_recompute`: activations of one micro-batch released before the first
    recomputed layer's backward (the epilogue's, whose backward runs first).
    """

    weights: float
    grads: float
    optimizer: float
    activations_per_microbatch: float
    recompute_workspace: float
    zero3_gather: float
    temporary: float
    layer_temporary: float = 0.0
    freed_before_recompute: float = 0.0

    def peak(self, in_flight: float) -> tuple[int, tuple[tuple[str, int], ...]]:
        """Peak bytes with `in_flight` micro-batches of activations held, and the breakdown
        of the moment it happens. Two moments compete: the start of backward (every saved
        activation plus `temporary`) and, with recomputation, the backward of a recomputed
        layer (the activations still held, that layer's rebuilt activations and
        `layer_temporary`); the two sets of buffers never coexist. Checked against torch's
        own allocation on CPU (tests/cost_model/test_memory_measured.py). Cached: the planner
        asks for the same ones many times."""
        return _peak(self, in_flight)

    def _peak(self, in_flight: float) -> tuple[int, tuple[tuple[str, int], ...]]:
        acts = self.activations_per_microbatch * in_flight
        moments = [(acts, 0.0, self.temporary)]
        if self.recompute_workspace > 0:
            held = max(0.0, acts - self.freed_before_recompute)
            moments.append((held, self.recompute_workspace, self.layer_temporary))
        held, workspace, temp = max(moments, key=sum)
        parts = {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": held,
            "recompute_workspace": workspace,
            "zero3_gather": self.zero3_gather,
            "temporary": temp,
        }
        subtotal = sum(parts.values())
        parts["overhead"] = ALLOCATOR_MARGIN * subtotal + CONTEXT_BYTES
        breakdown = tuple((k, round(v)) for k, v in parts.items())
        return sum(b for _, b in breakdown), breakdown


@functools.lru_cache(maxsize=1 << 13)
def _peak(memory: StageMemory, in_flight: float) -> tuple[int, tuple[tuple[str, int], ...]]:
    """`StageMemory.peak`, cached (a `StageMemory` is frozen, so its fields are the key; 8,192
    entries, ~12 MB: one 512-GPU plan asks for ~10,000 distinct ones)."""
    return memory._peak(in_flight)


def stage_memory(
    blocks: Sequence[tuple[BlockMemory, int]],
    *,
    tp: int,
    cp: int,
    ep: int,
    dp: int,
    zero: int,
    recompute: Recompute,
    sequence_parallel: bool,
    scale: float,
    policy: str = "keep_linear",
    precision: Precision = MIXED,
    fused_loss: bool = False,
    seq_div: float | None = None,
) -> StageMemory:
    """Memory of one rank of a stage made of `blocks` ((block, instance count) pairs);
    `policy` is the selective-recomputation policy (`meshplan.cost_model.recompute`),
    `precision` the bytes per parameter of the model states (`precision_for`), `fused_loss`
    a fused cross-entropy kernel in place of the eager loss chain (`Engine.fused_loss`).
    `seq_div`: what the rank's share of a sequence divides its activations by (None: cp;
    under asymmetric CP, `StageConfig.seq_div`); `cp` counts the ranks ZeRO shards over."""
    dense = sum(n * (b.params_tp / tp + b.params_rep) for b, n in blocks)
    experts = sum(n * b.params_expert / (tp * ep) for b, n in blocks)
    # ZeRO shards over the dp * cp ranks that hold the same weights (Megatron-LM's distributed
    # optimizer uses the data-parallel group with CP; torchtitan's FSDP mesh is dp_shard x cp).
    dcp = dp * cp
    w_d, g_d, o_d = state_bytes_per_param(zero, dcp, precision)
    w_e, g_e, o_e = state_bytes_per_param(zero, dcp // ep if dcp >= ep else 1, precision)
    share = cp if seq_div is None else seq_div
    act_kw = {"tp": tp, "cp": share, "sequence_parallel": sequence_parallel, "scale": scale}
    per_mb = sum(
        n * b.activations(**act_kw, recompute=recompute, policy=policy, fused_loss=fused_loss)
        for b, n in blocks
    )
    # A layer that is recomputed rebuilds what its policy dropped (a whole layer's worth for
    # the layer-level policy, whose checkpointed layers are fully recomputed).
    rc_kept = Recompute.FULL if policy == "every_other_layer" else recompute
    layers = [b for b, _ in blocks if b.kind == "layer"]
    workspace = 0.0
    if recompute != Recompute.NONE and layers:
        # The layer being recomputed holds what recomputation rebuilt until its backward ends.
        workspace = max(
            b.activations(**act_kw, recompute=Recompute.NONE)
            - b.activations(**act_kw, recompute=rc_kept, policy=policy)
            for b in layers
        )
    gather = 0.0
    if zero == 3 and layers:
        gather = precision.weight_bytes * max(b.params_per_rank(tp, ep) for b in layers)
    temporary = TEMP_OUTPUTS * max(
        (b.largest_output(**act_kw, fused_loss=fused_loss) for b, _ in blocks), default=0.0
    )
    if fused_loss:  # the logits are kept (activations); their gradient is the temporary
        grads = (b.fused_loss_gradient(tp=tp, cp=share, scale=scale) for b, _ in blocks)
        temporary = max(temporary, max(grads, default=0.0))
    layer_temp = TEMP_OUTPUTS * max((b.largest_output(**act_kw) for b in layers), default=0.0)
    freed = sum(
        n * b.activations(**act_kw, recompute=recompute, policy=policy, fused_loss=fused_loss)
        for b, n in blocks
        if b.kind == "epilogue"
    )
    return StageMemory(
        weights=dense * w_d + experts * w_e,
        grads=dense * g_d + experts * g_e,
        optimizer=dense * o_d + experts * o_e,
        activations_per_microbatch=per_mb,
        recompute_workspace=workspace,
        zero3_gather=gather,
        temporary=temporary,
        layer_temporary=layer_temp,
        freed_before_recompute=freed,
    )


def in_flight_microbatches(schedule: str, stage: int, pp: int, m: int, chunks: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of one whole
    micro-batch through the stage (hardware.md): 1F1B stage i of p holds min(p - i, m); GPipe
    runs every forward before any backward and holds m. Interleaved 1F1B with v chunks per
    rank (Megatron-LM `forward_backward_pipelining_with_interleaving`) runs
    2 (p - i - 1) + (v - 1) p warm-up chunk forwards plus the first steady-state one before its
    first backward, each 1/v of the stage's layers: (2 (p - i - 1) + (v - 1) p + 1) / v, at most
    m micro-batches. Interleaving with one chunk is plain 1F1B. ZB-V (`zero_bubble`, torch's
    `ScheduleZBVZeroBubble`) peaks at 2 p chunk activations (half a stage each) on every rank
    (counted over torch's action order: forwards minus weight-gradient steps): p micro-batches,
    at most m."""
    if schedule == "gpipe":
        return m
    if schedule == "zero_bubble":
        return min(pp, m)
    if schedule == "interleaved_1f1b" and chunks > 1:
        warm = 2 * (pp - stage - 1) + (chunks - 1) * pp + 1
        return min(warm, m * chunks) / chunks
    return min(pp - stage, m)
