"""`Pricer`: the pricing pieces of one graph on one cluster for one compute dtype, cached.

A stage's time per micro-batch on one device group (`StageTime`: compute, recomputation and
its tensor-, context- and expert-parallel traffic), its memory, pipeline point-to-point
sends, the optimizer update and the per-step synchronisations. Data-parallel traffic is in
dp_traffic.py (`DataParallelTraffic`, a base of `Pricer`). simulate.py composes these into
the step time.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.ir import (
    Cluster,
    DeviceGroup,
    GpuSpec,
    Graph,
    Recompute,
    StageConfig,
)

from .collectives import (
    BASE_LATENCY_S,
    Collective,
    CrossPath,
    Path,
    collective_time,
    group_collective_time,
    group_path,
    inter_node_path,
    intra_node_path,
)
from .compression import (
    CommChoice,
    CommOptions,
    choose,
    quantize_time,
    quantized_block_memory,
    quantized_share,
)
from .compute import kernel_efficiency
from .dp_traffic import DataParallelTraffic, slower_gpu
from .engine import EAGER, Engine
from .graph_costs import CACHE_SIZE, BlockFacts, Composition, ModelCosts, model_costs, moe_imbalance
from .memory import (
    StageMemory,
    precision_for,
    stage_memory,
)
from .recompute import SelectivePolicy, recompute_forward_time

# Fraction of overlapped communication that is actually hidden behind compute (the rest slows
# the compute down or waits). Assumption (Echo, Feng et al. 2024, and dPRO, Hu et al. MLSys'22:
# overlapped communication slows the compute it overlaps with; cited in full in simulate.py),
# set by hand against the published runs (docs/fidelity.md).
OVERLAP_EFFICIENCY = 0.8


def exposed(comm: float, window: float, eta: float = OVERLAP_EFFICIENCY) -> float:
    """Seconds of `comm` left exposed when it overlaps `window` seconds of compute:
    C - eta * min(C, W), i.e. at least (1 - eta) C (the module docstring's rule)."""
    return comm - eta * min(comm, window)


# The runner's per-step loss all-reduce: one float64 (meshplan.runtime.Runner._global_mean).
LOSS_SYNC_BYTES = 8

# Bytes a fused AdamW step streams per parameter it owns (torch's `fused=True`, apex's and
# Transformer Engine's FusedAdam; torchtitan's default implementation is "fused"): it reads
# the fp32 master weight, the gradient (fp32: Megatron's main grads, FSDP2's sharded fp32
# parameters' gradients; 4), the momentum and the variance, 16, and writes the weight and the
# two states back, 12. Derived from the kernel's operands, not fitted.
OPTIMIZER_BYTES_PER_PARAM = 28
# Bytes the global-norm gradient clipping streams per parameter it owns, every step:
# torchtitan (`training.max_norm` 1.0), Megatron-LM (`--clip-grad` 1.0) and Composer
# (llm-foundry's `gradient_clipping` algorithm) clip by default. The norm reads every fp32
# gradient once (4), the scaling reads and writes it (8; torch's `clip_grads_with_norm_`
# scales whatever the norm, Megatron only above the threshold, counted here as always).
GRAD_CLIP_BYTES_PER_PARAM = 12

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
    # ZeRO-3: the micro-batch's data-parallel collectives that nothing overlaps (the first
    # unit's all-gather and reduce-scatter, `DataParallelTraffic.dp_edge`). Set by
    # `simulate.plan_tables`, 0 otherwise.
    dp_edge: float = 0.0

    @property
    def compute(self) -> float:
        """Forward + backward compute."""
        return self.forward + self.backward

    @property
    def zb_bubble(self) -> float:
        """ZB-V's per-rank bubble unit max(f, b, 2 (b - w)) over the rank's two chunks (half the
        stage each), communication split evenly between forward and backward."""
        comm = (self.tp_comm + self.cp_comm + self.ep_comm + self.dp_edge) / 2
        f = self.forward + comm
        w = self.wgrad
        b = self.backward - w + self.recompute + comm
        return max(f, b, 2 * (b - w)) / 2

    @property
    def total(self) -> float:
        """The stage's time per micro-batch on the critical path (u in the docstring)."""
        return (
            self.compute
            + self.recompute
            + self.tp_comm
            + self.cp_comm
            + self.ep_comm
            + self.dp_edge
        )


class Pricer(DataParallelTraffic):
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
        # The engine's own policy, when it names one, is the stack's (`Engine.selective`).
        self.selective_policy = SelectivePolicy(engine.selective or selective_policy).value
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
        self, comp: Composition, group: str, cfg: StageConfig, span: EpSpan | None = None
    ) -> StageTime:
        """Forward/backward/recompute compute and TP/CP/EP traffic of one micro-batch of `cfg`
        on one rank of `group`: the sum over the stage's blocks of `block_time` times their
        instance counts. `cfg.quantize_activations`: saved activations are quantized (AGoQ),
        which adds quantize/dequantize time. `span`: the rank's ep group spans device groups
        (`EpSpan`); None: it lies inside `group`."""
        key = (comp, group, cfg, span)
        got = self._time.get(key)
        if got is None:
            parts = [0.0] * 7
            for bkey, count in comp:
                t = self.block_time(bkey, group, cfg, span)
                for i, v in enumerate(
                    (t.forward, t.backward, t.recompute, t.tp_comm, t.cp_comm, t.ep_comm, t.wgrad)
                ):
                    parts[i] += count * v
            got = self._time[key] = StageTime(*parts)
        return got

    def block_time(
        self, bkey: str, group: str, cfg: StageConfig, span: EpSpan | None = None
    ) -> StageTime:
        """One instance of block `bkey`, one micro-batch of `cfg`, on one rank of `group`
        (`span`: its ep group spans device groups, see `stage_time`)."""
        key = (bkey, group, cfg, span)
        got = self._block_time.get(key)
        if got is not None:
            return got
        tp, cp, ep, sp = cfg.tp, cfg.cp, cfg.ep, cfg.sequence_parallel
        micro_batch, recompute, quantize = cfg.micro_batch, cfg.recompute, cfg.quantize_activations
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
        c_fwd, c_bwd = self._cp_traffic(facts, g, cfg, scale)
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

    def cp_collectives(
        self, facts: BlockFacts, cfg: StageConfig, scale: float
    ) -> tuple[tuple[str, Collective, float], ...]:
        """(phase, kind, bytes) of one block's context-parallel collectives for one micro-batch
        of `cfg`, over the cp ranks of a tp rank (heads are TP-sharded, so / tp):

        - "allgather" (and "ring", priced alike: its overlap with attention is not modelled,
          an assumption): K and V all-gathered in forward, their gradients reduce-scattered
          in backward; `kv_bytes` at the model's K/V heads.
        - "heads" (DeepSpeed-Ulysses, Jacobs et al. 2023): in forward one all-to-all
          each for q, k and v to head-sharded tensors and one for the output back; in
          backward the same four reversed. Each moves a rank's local tensor (its sequence
          share, / cp). K/V heads are repeated f = cp / gcd(kv heads per tp rank, cp) times
          when cp does not divide them (the runtime's fewest copies). So head-parallel moves
          (h/kv + f) / cp times what the all-gather does: less for full multi-head attention
          and large cp, more for a few K/V heads at small cp."""
        cp, tp = cfg.cp, cfg.tp
        if cp <= 1 or not facts.kv_bytes:
            return ()
        if cfg.cp_mode != "heads":
            size = facts.kv_bytes * scale / tp
            return (("fwd", Collective.ALL_GATHER, size), ("bwd", Collective.REDUCE_SCATTER, size))
        kv_heads = self.costs.graph.info.kv_heads // tp  # per tp rank; 0: not known
        repeat = cp // math.gcd(kv_heads, cp) if kv_heads else 1
        q = facts.q_bytes * scale / (tp * cp)
        kv = facts.kv_bytes * scale / (tp * cp) * repeat / 2  # K, and V alike
        sizes = (q, kv, kv, q)  # q, k, v in; the output (q's size) back
        a2a = Collective.ALL_TO_ALL
        return tuple((phase, a2a, s) for phase in ("fwd", "bwd") for s in sizes)

    def _cp_traffic(self, facts, g: DeviceGroup, cfg: StageConfig, scale) -> tuple[float, float]:
        """Context parallelism (`cp_collectives`) on the cp ranks' path: cp ranks strided by
        tp inside g. Not overlapped with attention (ring attention would hide part:
        an assumption, see the context-parallel rows in docs/fidelity.md)."""
        out = {"fwd": 0.0, "bwd": 0.0}
        collectives = self.cp_collectives(facts, cfg, scale)
        if not collectives:
            return 0.0, 0.0
        path = group_path(self.cluster, g, cfg.cp, max(1, g.domain_gpus // cfg.tp))
        for phase, kind, size in collectives:
            ch = self.comm_choice(kind, size, cfg.cp, path, g.gpu, "activations", "cp")
            out[phase] += ch.time_s
        return out["fwd"], out["bwd"]

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
        cfg: StageConfig,
        *,
        dp: int,
        zero: int,
        stage: int = 0,
        num_stages: int = 1,
    ) -> StageMemory:
        """Memory of one rank of a stage of `cfg` over `dp` replicas at ZeRO stage `zero`, but
        for the in-flight multiplier (cached).

        `cfg.quantize_activations`: saved activations at the AGoQ widths of pipeline stage
        `stage` of `num_stages` (`compression.quantized_block_memory`); stage 0's widths are
        the smallest, so the default is a lower bound for any stage. Only whether the stage
        is in the early half changes the widths, so the cache keys on that, not on `stage`."""
        early = 2 * (num_stages - stage) > num_stages  # attention at 4 bits (compression.py)
        quantize = cfg.quantize_activations
        key = (comp, cfg, dp, zero, quantize and early)
        got = self._mem.get(key)
        if got is None:
            tp, cp, ep, sp = cfg.tp, cfg.cp, cfg.ep, cfg.sequence_parallel
            micro_batch, recompute = cfg.micro_batch, cfg.recompute
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

    def p2p(self, size: float, a: str, b: str, streams: int) -> float:
        """Forward send + backward send of one boundary activation of `size` bytes per rank
        between a stage on group a and the next on group b; `streams` ranks send at once."""
        return 2 * self.p2p_choice(size, a, b, streams).time_s

    def handoff(
        self,
        activation: float,
        a: str,
        tp_a: int,
        b: str,
        tp_b: int,
        *,
        pipelines: int,
        cp: int,
    ) -> float:
        """Forward send + backward send of one micro-batch's boundary activation between a
        stage whose replica sits in group a at degree tp_a and the next stage's in group b at
        degree tp_b (seconds); `activation`: the tensor's bytes for one replica (all its cp
        ranks), `pipelines`: how many pipelines make this hand-off at once.

        Rule (Megatron's scatter/gather, Narayanan et al. SC'21 sec. 4.1, across degrees).
        Each of the tp_a sending ranks holds the activation whole (or, under sequence
        parallelism, its 1/tp_a sequence shard); each of the tp_b receiving ranks needs it
        whole (or its 1/tp_b shard). It crosses once, cut into pieces: every sender sends
        its 1/tp_a and every receiver receives its 1/tp_b, so a rank on the side with fewer
        ranks moves activation / (cp min(tp_a, tp_b)) and sets the time, on the path
        between the groups (`p2p`: the group's own link when a == b, else `cross_path` with
        one rank per node, each driving its NIC share). Streams crossing a shared GroupLink
        at once: pipelines * cp * min(tp_a, tp_b), which together carry pipelines x the
        activation. The all-gather that re-replicates the pieces inside a receiving TP
        group without sequence parallelism runs on that node's own link and is not priced,
        as for equal degrees, where this is the 1/tp per rank of `simulate.plan_tables`. The
        gradient goes back the same way with the same bytes."""
        lanes = min(tp_a, tp_b)
        return self.p2p(activation / (cp * lanes), a, b, pipelines * cp * lanes)

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
        gpu = slower_gpu(self.groups[a].gpu, self.groups[b].gpu)
        return self.comm_choice(Collective.P2P, size, 2, path, gpu, "activations", "pp")

    def optimizer_time(
        self, comp: Composition, group: str, *, tp: int, ep: int, dp: int, zero: int
    ) -> float:
        """Gradient clipping and the Adam update of the parameters this rank owns (all it holds
        under ZeRO-0, 1/dp of them under ZeRO >= 1), streaming GRAD_CLIP_BYTES_PER_PARAM +
        OPTIMIZER_BYTES_PER_PARAM bytes per parameter at the GPU's achieved bandwidth."""
        facts = [(self.costs.facts[k].memory, n) for k, n in comp]
        dense = sum(n * (b.params_tp / tp + b.params_rep) for b, n in facts)
        experts = sum(n * b.params_expert / (tp * ep) for b, n in facts)
        if zero >= 1:
            dense /= dp
            experts /= max(1, dp // ep)
        gpu = self.groups[group].gpu
        hbm = gpu.hbm_bandwidth * kernel_efficiency(gpu).memory
        streamed = OPTIMIZER_BYTES_PER_PARAM + GRAD_CLIP_BYTES_PER_PARAM
        return (dense + experts) * streamed / hbm

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
                out += [(Collective.ALL_REDUCE, numel * self.reduce_bytes, tp)] * (
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
    while len(_PRICER_CACHE) > CACHE_SIZE:
        _PRICER_CACHE.popitem(last=False)
    return pricer
