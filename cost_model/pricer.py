"""`Pricer`: the pricing pieces of one graph on one cluster for one compute dtype, cached.

A stage's time per micro-batch on one device group (`StageTime`: compute, recomputation and
its tensor-, context- and expert-parallel traffic), its memory, the optimizer update and the
per-step synchronisations. Each parallel dimension's traffic is a base of `Pricer`, one
module each: tp_traffic.py (`TensorParallelTraffic`), cp_traffic.py
(`ContextParallelTraffic`), ep_traffic.py (`ExpertParallelTraffic`, `EpSpan`), pp_traffic.py
(`PipelineTraffic`: pipeline point-to-point sends) and dp_traffic.py (`DataParallelTraffic`).
simulate.py composes these into the step time.
"""

from __future__ import annotations

import dataclasses
import functools
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
    Collective,
    CrossPath,
    Path,
    collective_time,
    group_collective_time,
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
from .compute import kernel_efficiency, weight_quantize_time
from .cp_traffic import ContextParallelTraffic
from .dp_traffic import CrossTraffic, DataParallelTraffic, DpTraffic
from .engine import EAGER, Engine
from .ep_traffic import EpSpan, ExpertParallelTraffic
from .graph_costs import CACHE_SIZE, Composition, ModelCosts, model_costs
from .host import default_node_s, host_exposed, host_times
from .memory import (
    StageMemory,
    precision_for,
    stage_memory,
)
from .pp_traffic import PipelineTraffic
from .recompute import SelectivePolicy, recompute_forward_time
from .tp_traffic import TensorParallelTraffic

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
    # `tables.plan_tables`, 0 otherwise.
    dp_edge: float = 0.0
    # The part of forward + backward spent waiting for the host (`cost_model.host`): inside
    # `forward` and `backward`, reported apart in the breakdown.
    host: float = 0.0

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


class Pricer(
    TensorParallelTraffic,
    ContextParallelTraffic,
    ExpertParallelTraffic,
    PipelineTraffic,
    DataParallelTraffic,
):
    """Caches the pricing pieces of one graph on one cluster for one compute dtype; each
    dimension's traffic is one of its bases (the module docstring)."""

    def __init__(
        self,
        costs: ModelCosts,
        cluster: Cluster,
        dtype: str = "bfloat16",
        comm: CommOptions | None = None,
        engine: Engine = EAGER,
    ) -> None:
        self.costs = costs
        # How the step executes beyond the configuration (fused kernels, Float8, TP overlap).
        self.engine = engine
        # The host's seconds per traced op where the engine leaves it to the default (read
        # once, when first needed: `MESHPLAN_HOST_US`).
        self.host_default = functools.cache(default_node_s)
        self.cluster = cluster
        self.dtype = dtype
        # How Recompute.SELECTIVE keeps outputs (recompute.SelectivePolicy), set only by the
        # engine (`Engine.selective`, the stack's policy): meshplan's and Megatron's
        # keep-every-linear unless it names torchtitan's op or layer policy.
        self.selective_policy = SelectivePolicy(engine.selective or "keep_linear").value
        # What the planner may do to traffic (compression.py): every collective is priced at
        # its fastest allowed method (raw, lossless, int8 gradients). None: raw only.
        self.comm = comm
        # Bytes per parameter of weights, gradients and optimizer states (memory.Precision).
        self.precision = precision_for(dtype)
        self.groups: dict[str, DeviceGroup] = {g.name: g for g in cluster.groups}
        self._time: dict[tuple, StageTime] = {}
        self._block_time: dict[tuple, StageTime] = {}
        self._compute_times: dict[tuple, tuple[float, float, float]] = {}
        self._mem: dict[tuple, StageMemory] = {}
        self._model_params: tuple[float, float] | None = None  # `model_params`
        self._cross: dict[tuple, CrossPath] = {}
        self._sync: dict[tuple, float] = {}  # step_sync_time's SP gradient part
        self._dp_single: dict[tuple, list] = {}  # dp_single_choices, by what prices them
        self._dp_cross: dict[tuple, CrossTraffic] = {}  # dp_cross, by what prices it
        self._dp_single_time: dict[tuple, float] = {}  # dp_single, by what prices it
        self._dp_traffic: dict[tuple, DpTraffic] = {}  # dp_traffic, by what prices it
        self._p2p: dict[tuple, float] = {}  # p2p, by its arguments
        self._loss_sync: dict[tuple, float] = {}  # loss_sync_time, by what prices it
        self._engines: dict[str, Engine] = {}

    def engine_of(self, group: str) -> Engine:
        """The engine `group`'s ranks compute with: under per-group precision
        (`Engine.hybrid`) its transformer-block linears' forward GEMMs in int8 or FP8
        (`Engine.forward_precision`), every other group as the engine says."""
        got = self._engines.get(group)
        if got is None:
            mode = dict(self.engine.hybrid).get(group)
            low = mode or self.engine.forward_precision
            got = dataclasses.replace(
                self.engine,
                hybrid=(),
                forward_precision=low,
                hybrid_linears=self.engine.hybrid_linears if low else (),
            )
            self._engines[group] = got
        return got

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
        if got is None and len(ranks := cfg.rank_configs()) > 1:  # asymmetric CP shares
            got = self._time[key] = max(
                (self.stage_time(comp, group, c, span) for c in ranks), key=lambda t: t.total
            )
        if got is None:
            parts = [0.0] * 8
            for bkey, count in comp:
                t = self.block_time(bkey, group, cfg, span)
                for i, v in enumerate(
                    (t.forward, t.backward, t.recompute, t.tp_comm, t.cp_comm, t.ep_comm, t.wgrad)
                ):
                    parts[i] += count * v
                parts[7] += count * t.host
            *fields, host = parts
            got = self._time[key] = StageTime(*fields, host=host)
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
        # cp as the divisor of a rank's share of each sequence (`StageConfig.seq_div`: cp
        # under equal shares; the collectives' rank counts use cfg.cp)
        tp, cp, ep, sp = cfg.tp, cfg.seq_div, cfg.ep, cfg.sequence_parallel
        micro_batch, recompute, quantize = cfg.micro_batch, cfg.recompute, cfg.quantize_activations
        g = self.groups[group]
        scale = micro_batch / self.costs.traced_micro_batch
        facts = self.costs.facts[bkey]
        bc = self.costs.compute(bkey, g.gpu, self.dtype, self.engine_of(group))
        # the compute times depend on these alone, not on the rest of cfg (recompute, ep,
        # the cp mode, ...): priced once per key (~half of a large search's pricing)
        tkey = (bkey, group, tp, cp, sp, scale, cfg.attention_div)
        times = self._compute_times.get(tkey)
        if times is None:
            times = self._compute_times[tkey] = bc.times(
                tp=tp, cp=cp, sequence_parallel=sp, scale=scale, attention_div=cfg.attention_div
            )
        fwd, bwd, sel = times
        t_fwd, t_bwd = self._tp_traffic(
            facts, tp, cp, sp, scale, intra_node_path(self.cluster, g), g.gpu, ep=ep
        )
        if self.engine.tp_overlap and tp > 1:  # decomposed GEMMs hide part of the TP traffic
            g_fwd, g_bwd = bc.gemm_times(tp=tp, cp=cp, scale=scale)
            t_fwd, t_bwd = exposed(t_fwd, g_fwd), exposed(t_bwd, g_bwd)
        c_fwd, c_bwd = self._cp_traffic(facts, g, cfg, scale)
        # the ep ranks' stride: tp x the cp degree, or x the cp ranks a spanning cp group has
        # in g (`span_config`); `cp` above is the share divisor, not a rank count
        stride = tp * (len(cfg.cp_ranks) if cfg.cp_span and cfg.cp_ranks else cfg.cp)
        e_fwd, e_bwd = self._ep_traffic(facts, g, tp, cp, ep, sp, scale, span, stride)
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
        wgrad = bwd * facts.wgrad_fraction
        # the host's issue time where the kernels are shorter (`cost_model.host`)
        x_fwd = x_bwd = 0.0
        engine = self.engine_of(group)
        if not g.gpu.is_cpu and facts.host_nodes and not engine.fused:  # compiled: not op by op
            node_s = self.host_default() if engine.host_node_s is None else engine.host_node_s
            # only the repeated layers are checkpointed (runtime.recompute)
            layer_rc = recompute if facts.kind == "layer" else Recompute.NONE
            h_fwd, h_bwd = host_times(
                facts.host_nodes, layer_rc, node_s, tp, sp,
                every_other_layer=policy == SelectivePolicy.EVERY_OTHER_LAYER,
            )  # fmt: skip
            # the GPU's time includes its traffic: the host issues on while NCCL runs
            g_fwd = fwd + t_fwd + c_fwd + e_fwd
            g_bwd = bwd + rc + t_bwd + c_bwd + e_bwd
            x_fwd, x_bwd = host_exposed(g_fwd, g_bwd, h_fwd, h_bwd)
        got = self._block_time[key] = StageTime(
            fwd + x_fwd,
            bwd + x_bwd,
            rc,
            t_fwd + t_bwd,
            c_fwd + c_bwd,
            e_fwd + e_bwd,
            wgrad,
            host=x_fwd + x_bwd,
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

    # -- per stage composition (group-independent) ---------------------------------------------
    def model_params(self) -> tuple[float, float]:
        """(dense, expert) parameters of the whole model as the memory model counts them (a
        replicated parameter once; `memory.least_peak`), computed once."""
        if self._model_params is None:
            comp = self.costs.composition(0, len(self.costs.unit_keys))
            mems = [(self.costs.facts[k].memory, n) for k, n in comp]
            dense = sum(n * (m.params_tp + m.params_rep) for m, n in mems)
            self._model_params = (dense, sum(n * m.params_expert for m, n in mems))
        return self._model_params

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
                seq_div=cfg.seq_div,  # activations: the largest share's
            )
        return got

    def weight_quantize_time(self, comp: Composition, group: str) -> float:
        """Once per step on a rank of `group` under per-group precision: the low-precision
        copies of its forward-quantized linears' weights (`compute.weight_quantize_time`);
        0 for a group without it."""
        engine = self.engine_of(group)
        if not engine.forward_precision:
            return 0.0
        gpu = self.groups[group].gpu
        lin = engine.hybrid_linears
        return sum(
            n * weight_quantize_time(self.costs.blocks[k], gpu, fused=engine.fused, linears=lin)
            for k, n in comp
        )

    def optimizer_time(
        self, comp: Composition, group: str, cfg: StageConfig, *, dp: int, zero: int
    ) -> float:
        """Gradient clipping and the Adam update of the parameters a rank of `cfg` owns (all it
        holds under ZeRO-0, 1/dp of them under ZeRO >= 1; `dp`: the ranks the optimizer state
        is sharded over), streaming GRAD_CLIP_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM bytes
        per parameter at the GPU's achieved bandwidth."""
        tp, ep = cfg.tp, cfg.ep
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
    def loss_sync_time(self, group: str, world: int, groups: Sequence[str] = ()) -> float:
        """The step's scalar loss all-reduce over all `world` ranks (`LOSS_SYNC_BYTES`; the
        runner returns the global mean loss on every rank, Megatron-LM averages it over the
        data-parallel ranks every step): latency-bound, NCCL's tree over `group`'s nodes, plus
        up and down the slowest link between the plan's `groups` when it spans several."""
        g = self.groups[group]
        n = min(world, g.num_gpus)
        others = tuple(b for b in groups if b != group) if world > n else ()
        key = (group, n, others)
        t = self._loss_sync.get(key)
        if t is None:
            t = group_collective_time(
                Collective.ALL_REDUCE, LOSS_SYNC_BYTES, self.cluster, g, n, g.domain_gpus
            )
            if others:
                t += 2 * max(self.cross_path(group, b, 1, 1).latency for b in others)
            self._loss_sync[key] = t
        return t

    def step_sync_time(
        self,
        comp: Composition,
        group: str,
        cfg: StageConfig,
        *,
        world: int,
        groups: Sequence[str] = (),
        reductions: int = 1,
    ) -> float:
        """Seconds of the per-step synchronisations that run exposed around the optimizer
        update of a rank of `cfg`: `sp_grad_sync` on the intra-node tp path (cached) and
        `loss_sync_time`."""
        # what prices it: the blocks, the group's node path, tp, SP and the reductions
        key = (comp, group, cfg.tp, cfg.sequence_parallel, reductions)
        t = self._sync.get(key)
        if t is None:
            path = intra_node_path(self.cluster, self.groups[group])
            sync = self.sp_grad_sync(
                comp, tp=cfg.tp, sp=cfg.sequence_parallel, reductions=reductions
            )
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
    engine: Engine = EAGER,
) -> Pricer:
    """A cached `Pricer` for (graph, cluster, dtype, comm, engine), by
    identity (entries hold both objects). `dtype` None: the graph's own (`compute_dtype`)."""
    dtype = dtype or compute_dtype(graph)
    host = default_node_s() if engine.host_node_s is None else None  # MESHPLAN_HOST_US
    key = (id(graph), id(cluster), dtype, comm, engine, host)
    hit = _PRICER_CACHE.get(key)
    if hit is not None and hit[0] is graph and hit[1] is cluster:
        _PRICER_CACHE.move_to_end(key)
        return hit[2]
    pricer = Pricer(model_costs(graph), cluster, dtype, comm, engine)
    _PRICER_CACHE[key] = (graph, cluster, pricer)
    while len(_PRICER_CACHE) > CACHE_SIZE:
        _PRICER_CACHE.popitem(last=False)
    return pricer
