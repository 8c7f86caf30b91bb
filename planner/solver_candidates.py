"""Step 1 of the search (`meshplan.solver`): candidate configurations c in C (their layer
splits L(c) are `solver_splits`).

Sets
    c in C      candidate global configurations (tp, pp, dp, cp, ep, micro_batch, ZeRO stage,
                recomputation, schedule with its virtual stages v: 1F1B, interleaved 1F1B,
                zero-bubble ZB-V with v = 2; sequence parallel),
                `enumerate_candidates`

Divisibility (in `enumerate_candidates`, each with its own InfeasibleError message): tp divides
heads, kv_heads and the GPUs per node (or NVLink domain) of some group; cp divides seq_len / 2
(load-balanced causal chunks) with at least MIN_CP_TOKENS tokens per rank; ep divides the
experts and dp (expert ranks reuse data-parallel ranks, Megatron-Core's expert-data-parallel
layout with expert-tensor-parallel = tp: the dp ranks of a stage form dp / ep expert-DP groups
of ep ranks), and ep > 1 with tp > 1 only under sequence parallelism (Megatron-Core's rule; the
runtime's EP x TP dispatch routes each sequence shard); pp <= layers; dp * micro_batch divides
the global batch; interleaved 1F1B needs
pp >= 2, v divides layers / pp and pp divides the micro-batch count (Megatron-LM's rule);
every pipeline's micro-batch count, uneven shares included, is one torch's schedule runs
(`ir.microbatch_problem`: 1F1B at least pp, GPipe in its place below that when unpinned).

Per-group TP (`_per_group_tp_candidates`, `Candidate.group_tp`): a configuration may run its
group-pure pipelines in two groups a and b at different TP degrees tp_a != tp_b (each must
divide its own group's GPUs per node or NVLink domain: a wide TP on 8-GPU NVLink nodes next to
2-GPU nodes, or memory-tight GPUs that need a wider TP than the others). Its tables are each
group's own at its tp (`cost_model.tables.hetero_tables`) with the cross-group gradient average of
`Pricer.dp_cross_hetero`; it has only group-pure placements (n_a, n_b >= 1 pipelines, shares
as in `solver_screen`, equal shares allowed even where the warm-up depth is not saturated), so
its bounds are the share bounds. ZeRO-0 and no EP (what the runtime executes: replicas whose TP
shards differ cannot share ZeRO shards). Pipelines with per-stage TP degrees (one pipeline
crossing groups of different tp, handed over by `runtime.pipeline_handoff`) are a family of
their own, searched by step 2b (`solver_layouts`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from meshplan.cost_model.simulate import SUPPORTED_SCHEDULES
from meshplan.ir import (
    Cluster,
    Graph,
    Parallel,
    Recompute,
    Schedule,
    StageConfig,
)
from meshplan.ir.facts import blocked_dimension, without_blocked
from meshplan.ir.parallel import chunks_of
from meshplan.ir.rules import (
    batch_split_problem,
    cp_head_degree_problem,
    cp_heads_problem,
    cp_sequence_problem,
    cp_usp_problem,
    ep_dp_problem,
    ep_experts_problem,
    ep_tp_problem,
    microbatch_problem,
    pp_layers_problem,
    schedule_problem,
    tp_heads_problem,
    usp_degree,
    zero_bubble_problem,
    zero_bubble_zero3_problem,
)
from meshplan.passes.partition import (
    chunk_layout_problem,
    replica_capacity,
    tp_domain_problem,
)

# Largest micro-batch the planner tries unless pinned. Assumption: costs scale linearly with
# the micro-batch (cost_model), so past a few sequences a larger one only saves kernel floors
# and the host's issue time (`cost_model.host`) while it lengthens the pipeline fill and
# raises activation memory.
MAX_MICRO_BATCH = 16
# Without a pipeline there is no fill to lengthen: micro-batches up to this one are tried
# too (small models under FSDP amortise per-kernel and per-collective overheads over them;
# llm-foundry's published MPT runs use up to 128).
MAX_MICRO_BATCH_NO_PIPELINE = 128
# Most model chunks per pipeline rank the planner tries for interleaved 1F1B (Megatron-LM
# runs use 2-6; past that the p2p term m v P dominates what the bubble saves).
MAX_VIRTUAL_STAGES = 8
# Context parallelism keeps at least this many tokens per CP rank (shorter chunks leave the
# attention GEMMs too small to run efficiently; assumption) and at most MAX_CP ranks.
MIN_CP_TOKENS = 1024
MAX_CP = 32


_ZB = Schedule.ZERO_BUBBLE  # a module constant: enum attribute access is slow in hot loops


def _tp_of(tp: int, group_tp: tuple[tuple[str, int], ...], group: str) -> int:
    """The TP degree of `group`'s replicas: its own under per-group TP, else `tp`."""
    for g, t in group_tp:
        if g == group:
            return t
    return tp


# `Candidate.stage_of`'s shared StageConfigs, by the fields `Parallel.stage` reads (a
# StageConfig is frozen, so one instance serves every candidate that has its value); cleared
# when it reaches _STAGES_MAX entries, which bounds its memory.
_STAGES: dict[tuple, StageConfig] = {}
_STAGES_MAX = 200_000


class InfeasibleError(ValueError):
    """No configuration fits; the message names the binding constraint and its numbers."""


@dataclass(frozen=True, slots=True)
class Candidate(Parallel):
    """One global configuration c (everything but the stage split and the placement): a
    complete `Parallel`, the global batch included, with per-group TP on top. Built by
    `enumerate_candidates` (`candidate`), so every field is set and normalised as `Parallel`
    writes it; `parallel()` is the plain Parallel a plan records.

    The fields every candidate sets are redeclared here without None and without a default
    (a redeclared dataclass field keeps its place, so the order is `Parallel`'s). The three
    where None means off keep `Parallel`'s None default: `virtual_stages` (None but under a
    chunked schedule), `quantize_activations` (None when off) and `cp_mode` (None without
    CP)."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    micro_batch: int
    global_batch: int
    recompute: Recompute
    zero: int
    schedule: Schedule
    sequence_parallel: bool

    # Per-group TP (`StagePlacement.group_tp`): ((group a, tp_a), (group b, tp_b)) for
    # group-pure pipelines in two groups at their own degrees; `tp` is then tp_a. Empty: every
    # replica at `tp`.
    group_tp: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        """Not validated again: `candidate` builds it from validated pins and enumerated
        degrees, tens of thousands per plan."""

    def tp_of(self, group: str) -> int:
        """The TP degree of `group`'s replicas."""
        return _tp_of(self.tp, self.group_tp, group)

    def sp_of(self, group: str) -> bool:
        """Sequence parallelism on `group`'s replicas (off where a per-group tp is 1)."""
        return bool(self.sequence_parallel) and (not self.group_tp or self.tp_of(group) > 1)

    def stage_of(self, group: str | None = None) -> StageConfig:
        """What one rank of `group` runs per micro-batch (`Parallel.stage`): at the group's
        own tp under per-group TP; None: at `tp`. One shared instance per distinct value
        (`_STAGES`: the search asks for ~1e6 of them, of ~1e4 distinct ones)."""
        tp = None if group is None or not self.group_tp else self.tp_of(group)
        key = (self.tp, self.cp, self.ep, self.sequence_parallel, self.micro_batch,
               self.recompute, self.quantize_activations, self.cp_mode, self.cp_shares,
               self.cp_head_shares, self.cp_head_degree, tp)  # fmt: skip
        got = _STAGES.get(key)
        if got is None:
            if len(_STAGES) >= _STAGES_MAX:
                _STAGES.clear()
            got = _STAGES[key] = self.stage(tp)
        return got

    def view(self, group: str) -> Candidate:
        """The homogeneous candidate `group`'s pipelines run (its tp, no per-group TP)."""
        if not self.group_tp:
            return self
        return dataclasses.replace(
            self, tp=self.tp_of(group), sequence_parallel=self.sp_of(group), group_tp=()
        )

    def parallel(self) -> Parallel:
        """The complete `Parallel` of this candidate (per-group TP lives in the stages)."""
        return Parallel(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Parallel)})

    @property
    def fill(self) -> float:
        """Coefficient of (S - U) in the pipeline term: 1 / v, 0 under ZB-V (`PlanTables.fill`)."""
        return _fill(self.schedule, self.virtual_stages)

    @property
    def gpus(self) -> int:
        """GPUs the configuration occupies: tp * pp * cp * dp."""
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        """One line for messages: `tp=8, pp=4, dp=2, micro_batch=1, full recompute, ZeRO-3`."""
        rc = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}[
            self.recompute.value
        ]
        tp = f"tp={self.tp}"
        if self.group_tp:
            tp = "tp " + "/".join(f"{g}={t}" for g, t in self.group_tp)
        parts = [tp, f"pp={self.pp}", f"dp={self.dp}"]
        if self.cp > 1:
            mode = self.cp_mode or ""
            if self.cp_head_degree:
                mode += f" u={self.cp_head_degree}"
            parts.append(f"cp={self.cp}" + (f" ({mode})" if mode else ""))
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += [f"micro_batch={self.micro_batch}", rc, f"ZeRO-{self.zero}"]
        if self.schedule == Schedule.INTERLEAVED_1F1B:
            parts.append(f"interleaved 1F1B v={self.virtual_stages}")
        elif self.schedule == Schedule.ZERO_BUBBLE:
            parts.append("zero-bubble (ZB-V)")
        elif self.schedule != Schedule.ONE_F_ONE_B:
            parts.append(self.schedule.value)
        if self.quantize_activations:
            parts.append("AGoQ-quantized activations")
        return ", ".join(parts)

    @property
    def sort_key(self) -> tuple:
        """A total order for deterministic tie-breaking."""
        return (
            self.tp,
            self.pp,
            self.dp,
            self.cp,
            self.ep,
            self.micro_batch,
            self.zero,
            self.recompute.value,
            self.schedule.value,
            self.virtual_stages or 1,
            self.sequence_parallel,
            bool(self.quantize_activations),
            self.group_tp,
        )


def candidate(
    tp: int,
    pp: int,
    dp: int,
    cp: int,
    ep: int,
    micro_batch: int,
    zero: int,
    recompute: Recompute,
    schedule: Schedule,
    sequence_parallel: bool,
    virtual_stages: int,
    quantize_activations: bool,
    global_batch: int,
    group_tp: tuple[tuple[str, int], ...] = (),
    cp_mode: str | None = None,
    cp_head_degree: int | None = None,
) -> Candidate:
    """A Candidate with its fields written as `Parallel` writes them: `virtual_stages` only
    under interleaved 1F1B or ZB-V, `quantize_activations` only when on."""
    chunked = schedule is _ZB or schedule is Schedule.INTERLEAVED_1F1B
    # positional, in `Parallel`'s field order (the enumeration builds ~1e5 of them)
    return Candidate(
        dp,
        tp,
        pp,
        cp,
        ep,
        micro_batch,
        global_batch,
        recompute,
        zero,
        schedule,
        sequence_parallel,
        virtual_stages if chunked else None,
        quantize_activations or None,
        cp_mode,
        None,  # cp_shares: the search gives equal shares
        None,  # cp_head_shares
        cp_head_degree,
        group_tp,
    )


def priced(c: Candidate, group: str | None = None) -> StageConfig:
    """What the search's bounds and unit costs price a rank of c in `group` at (`stage_of`):
    without AGoQ's quantize and dequantize time, which only adds to a stage's time, so one
    bound holds with quantization on or off."""
    stage = c.stage_of(group)
    if not stage.quantize_activations:  # most candidates: no copy needed
        return stage
    return dataclasses.replace(stage, quantize_activations=False)


class Family(NamedTuple):
    """Candidates that differ only in ZeRO stage and schedule (with its v): the unit the
    search queues and bounds (`solver_queue._Family`). `enumerate_families` yields them as
    such, so a member's `Candidate` is built only when the search reaches its family (a large
    cluster has ~1e6 candidates in ~3e5 families, most never expanded). A named tuple: built
    ~1e5 times per plan, at a third of a frozen dataclass's cost.

    The fields up to `cp_mode` are what every member shares, as `candidate` takes them; the
    members (`variants`) are the (ZeRO stage, schedule, v) of `template`, shared by every
    family of one block of the enumeration (`_block_families`), numbered from `base`."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    micro_batch: int
    recompute: Recompute
    sequence_parallel: bool
    quantize_activations: bool
    global_batch: int
    group_tp: tuple[tuple[str, int], ...]
    cp_mode: str | None
    # (offset, V, zero, schedule, v) per member: its enumeration index is
    # base + offset + (V - 1) * step (`_block_families`)
    template: tuple[tuple[int, int, int, Schedule, int], ...]
    base: int
    step: int
    loose: int  # the place in `template` of the loosest member (`loosest`)
    cp_head_degree: int | None = None  # under cp_mode "usp" (`candidate`)

    @property
    def variants(self) -> tuple[tuple[int, int, Schedule, int], ...]:
        """(enumeration index, ZeRO stage, schedule, v) of every member, in enumeration
        order."""
        base, step = self.base, self.step
        return tuple((base + o + (vz - 1) * step, z, s, v) for o, vz, z, s, v in self.template)

    def member(self, k: int) -> Candidate:
        """The candidate of `variants[k]`."""
        _, _, zero, sched, v = self.template[k]
        return candidate(
            self.tp, self.pp, self.dp, self.cp, self.ep, self.micro_batch, zero,
            self.recompute, sched, self.sequence_parallel, v, self.quantize_activations,
            self.global_batch, self.group_tp, self.cp_mode, self.cp_head_degree,
        )  # fmt: skip

    @property
    def members(self) -> tuple[tuple[int, Candidate], ...]:
        """(enumeration index, candidate) of every member, in enumeration order (built anew
        at each call)."""
        return tuple((v[0], self.member(k)) for k, v in enumerate(self.variants))

    @property
    def first(self) -> int:
        """The enumeration index of the first member."""
        o, vz = self.template[0][:2]
        return self.base + o + (vz - 1) * self.step

    @property
    def gpus(self) -> int:
        """GPUs a member occupies: tp * pp * cp * dp."""
        return self.tp * self.pp * self.cp * self.dp

    def tp_of(self, group: str) -> int:
        """`Candidate.tp_of` of the members."""
        return _tp_of(self.tp, self.group_tp, group)

    def loosest(self) -> Candidate:
        """The member whose split-free bound is least (`solver_bounds._split_free_bound` is
        increasing in the schedule's fill and gives only ZeRO <= 2 the share bound): least
        `Candidate.fill`, then ZeRO <= 2, then enumeration order."""
        return self.member(self.loose)

    @property
    def knobs(self) -> list[tuple[float, int]]:
        """(`Candidate.fill`, ZeRO stage) of every member, without building them."""
        return [(_fill(sched, v), zero) for _, _, zero, sched, v in self.template]

    @property
    def loosest_knobs(self) -> tuple[float, int]:
        """(`Candidate.fill`, ZeRO stage) of the loosest member, without building it."""
        _, _, zero, sched, v = self.template[self.loose]
        return _fill(sched, v), zero


def _fill(schedule: Schedule, v: int | None) -> float:
    """`Candidate.fill` of a candidate with this schedule and v: 1 / its chunks per rank
    (`ir.parallel.chunks_of`), 0 under ZB-V."""
    return 0.0 if schedule is _ZB else 1.0 / chunks_of(schedule, v)


def count(families: Sequence[Family]) -> int:
    """Candidates in `families`."""
    return sum(len(f.template) for f in families)


def flatten(families: Sequence[Family]) -> list[Candidate]:
    """Every member of `families`, in enumeration order."""
    pairs = sorted(ic for f in families for ic in f.members)
    return [c for _, c in pairs]


# The constraints of `enumerate_candidates`'s loops, in the order they apply: each sees only the
# partial configurations that passed the ones before it.
CONSTRAINTS = (
    "cp attention",  # a pinned head-parallel CP needs cp to divide each tp rank's heads
    "world size",  # the pp x dp replicas of tp x cp GPUs fit the cluster in whole TP groups
    "ep divides dp",  # expert ranks reuse data-parallel ranks
    "ep with tp needs sp",  # Megatron-Core's rule; the runtime's too
    "batch",  # dp x micro_batch divides the global batch
    "schedule",  # some schedule runs the m micro-batches on pp stages (`schedule_options`)
    "zb without zero3",  # torch's ZB-V with FSDP2 resharding gives wrong gradients
)


@dataclass
class _Funnel:
    """How many partial configurations passed each of CONSTRAINTS, and the first one each
    rejected (the enumeration's first: the smallest degrees). Every constraint sees only what
    passed those before it, so when nothing is left the first constraint that nothing passed is
    the one that left nothing, whatever the later ones would have said."""

    passed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONSTRAINTS, 0))
    example: dict[str, str] = field(default_factory=dict)

    def keep(self, constraint: str, n: int = 1) -> None:
        """`n` partial configurations passed `constraint`."""
        self.passed[constraint] += n

    def reject(self, constraint: str, reason: str) -> None:
        """One partial configuration failed `constraint`, for `reason`."""
        self.example.setdefault(constraint, reason)

    def why_none(self) -> str:
        """The reason of the first constraint that nothing passed."""
        for constraint in CONSTRAINTS:
            if not self.passed[constraint]:
                return self.example.get(constraint, "no configuration fits the cluster's GPU count")
        raise AssertionError("a configuration passed every constraint")


@lru_cache(maxsize=None)
def _all_divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _divisors(n: int) -> list[int]:
    return list(_all_divisors(n))


def _divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in _all_divisors(n) if d <= limit]


def micro_batch_options(per_replica: int, pp: int) -> list[int]:
    """Micro-batches tried for a replica's `per_replica` sequences: every divisor up to
    MAX_MICRO_BATCH, or up to MAX_MICRO_BATCH_NO_PIPELINE without a pipeline (pp == 1)."""
    return _divisors_upto(per_replica, MAX_MICRO_BATCH if pp > 1 else MAX_MICRO_BATCH_NO_PIPELINE)


def cp_options(seq_len: int) -> list[int]:
    """Context-parallel degrees the planner tries: 1 and every cp <= MAX_CP with seq_len
    divisible by 2 * cp (each rank holds two load-balanced chunks of the causal sequence) and
    at least MIN_CP_TOKENS tokens per rank."""
    if not seq_len:
        return [1]
    return [1] + [
        c for c in range(2, MAX_CP + 1) if seq_len % (2 * c) == 0 and seq_len // c >= MIN_CP_TOKENS
    ]


def cp_mode_options(
    pinned: str | None, heads: int, tp: int, cp: int, degree: int | None = None
) -> list[str | None]:
    """How context-parallel attention may exchange the sequence for tp and cp
    (`ir.parallel.CP_MODES`): None without CP; the pinned mode, if it can run; else
    "allgather" and, where cp divides each tp rank's query heads (`cp_heads_problem`),
    "heads" (DeepSpeed-Ulysses: the cheaper one where the K/V heads are few against cp x the
    heads they serve, `Pricer.cp_collectives`), or where it does not but shares a factor
    with them, "usp" (heads over that factor, K/V all-gathered over the rest; its degree
    `ir.rules.usp_degree`). "ring" only when pinned: it is priced as "allgather"."""
    if cp == 1:
        return [None] if degree is None else []  # a pinned degree needs cp > 1
    if pinned is None and degree is not None:  # a pinned head-parallel degree means "usp"
        pinned = "usp"
    per_rank = heads // tp if heads and heads % tp == 0 else 0
    heads_ok = bool(per_rank) and cp_heads_problem(per_rank, cp) is None
    usp_ok = not heads_ok and 1 < usp_degree(per_rank, cp) < cp
    if pinned is not None:
        if pinned == "usp":  # a pinned `degree` (`Parallel.cp_head_degree`) or the largest
            ok = cp_usp_problem(per_rank, cp, degree or usp_degree(per_rank, cp)) is None
        else:
            ok = pinned != "heads" or heads_ok
        return [pinned] if ok else []
    return ["allgather", "heads"] if heads_ok else ["allgather", "usp"] if usp_ok else ["allgather"]


def schedule_options(
    pinned: Parallel, pp: int, n_layers: int, m: int, zero_bubble: bool = True
) -> list[tuple[Schedule, int]]:
    """(schedule, virtual stages) pairs for m micro-batches per pipeline: 1F1B when torch runs
    it (`microbatch_problem`: m >= pp), else GPipe in its place (with m < pp both take the same
    time); interleaved 1F1B with every v in 2..MAX_VIRTUAL_STAGES for which the layers have a
    chunk layout (`partition.chunk_layers`: equal chunks, or Megatron's embedding and loss
    counted as a layer each) when pp >= 2 and pp divides m (Megatron-LM's requirement,
    stricter than torch's whole rounds), and ZB-V (two chunks per rank) when pp >= 2, the
    layers have a two-chunk layout and m >= 2 pp - 1 (the cost model prices ZB-V's full
    warm-up of 2 pp - 1 micro-batches; not when `zero_bubble` is False: the model's "zb"
    blocker, `ir.facts`).
    A pinned schedule or virtual_stages restricts the list (a pinned 1F1B or
    interleaved 1F1B only where `microbatch_problem` accepts m); GPipe otherwise only when
    pinned (it is never faster than 1F1B under this cost model, and holds more activations)."""
    sched, pv = pinned.schedule, pinned.virtual_stages
    if sched == Schedule.GPIPE:
        return [(sched, 1)]
    zb_ok = pp >= 2 and not chunk_layout_problem(n_layers, pp, 2, v_shape=True)
    zb_ok = zb_ok and not zero_bubble_problem(Schedule.ZERO_BUBBLE, pp, m) and pv in (None, 2)
    zb_ok = zb_ok and zero_bubble
    if sched == Schedule.ZERO_BUBBLE:
        return [(sched, 2)] if zb_ok else []
    out: list[tuple[Schedule, int]] = []
    if sched in (None, Schedule.ONE_F_ONE_B) and pv in (None, 1):
        if microbatch_problem(Schedule.ONE_F_ONE_B, pp, m) is None:
            out.append((Schedule.ONE_F_ONE_B, 1))
        elif sched is None:
            out.append((Schedule.GPIPE, 1))
    if sched in (None, Schedule.INTERLEAVED_1F1B) and pp >= 2 and m % pp == 0:
        vs = [pv] if pv else list(range(2, MAX_VIRTUAL_STAGES + 1))
        vs = [v for v in vs if v >= 2 and not chunk_layout_problem(n_layers, pp, v)]
        out += [(Schedule.INTERLEAVED_1F1B, v) for v in vs]
    one_round = microbatch_problem(Schedule.INTERLEAVED_1F1B, pp, m) is None
    if sched == Schedule.INTERLEAVED_1F1B and pv in (None, 1) and one_round:
        out.append((Schedule.INTERLEAVED_1F1B, 1))  # one chunk per rank: 1F1B's timing
    if sched is None and zb_ok:
        out.append((Schedule.ZERO_BUBBLE, 2))
    return out


# `schedule_options` memoised for the enumeration (its arguments repeat over dp and
# micro-batch; the lists it returns are only read)
_schedules = lru_cache(maxsize=65536)(schedule_options)


def enumerate_candidates(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    global_batch: int,
    *,
    quantize: bool = False,
    per_group_tp: bool = True,
) -> list[Candidate]:
    """Every configuration the planner considers, in enumeration order: the members of
    `enumerate_families`, whose arguments these are."""
    return flatten(
        enumerate_families(
            graph, cluster, pinned, global_batch, quantize=quantize, per_group_tp=per_group_tp
        )
    )


def enumerate_families(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    global_batch: int,
    *,
    quantize: bool = False,
    per_group_tp: bool = True,
) -> list[Family]:
    """Every configuration the planner considers, honouring each pinned field of `pinned`,
    grouped into `Family`s (in order of their first member; members numbered in
    enumeration order).

    tp divides heads and kv_heads (0 = unknown) and the GPUs per node of some group; cp from
    `cp_options` (divides the sequence); ep divides the experts and dp (MoE models only);
    pp <= layer units; dp * micro_batch divides global_batch (`micro_batch_options` unless
    pinned); the groups hold pp * dp replicas of tp * cp GPUs (not every GPU must be
    used: the objective prefers configurations that use them); schedules from
    `schedule_options`. ZeRO 1-3 only with dp * cp > 1 (ZeRO shards over the dp x cp ranks that
    hold the same weights; with one such rank they equal ZeRO-0), sequence
    parallel when tp > 1 (and ep > 1 with tp > 1 only with it). With `per_group_tp` on a
    cluster of several groups, also the per-group TP candidates of
    `_per_group_tp_candidates`. Raises InfeasibleError naming the first constraint that
    leaves nothing: a pinned value refused on its own (before any loop), else the first of
    CONSTRAINTS that no configuration passed (`_Funnel`), with its first rejection's reason.
    """
    info = graph.info
    p = pinned
    # Dimensions the runtime cannot run on this model (`ir.facts`): off, or refused if pinned.
    if (why := blocked_dimension(info, p)) is not None:
        raise InfeasibleError(f"no plan: {why}")
    p = without_blocked(info, p)
    zb = not info.blocker("zb")  # ZB-V, unless the model ties weights across its stages
    if p.global_batch is not None and p.global_batch != global_batch:
        raise ValueError(
            f"global_batch={global_batch} conflicts with pinned global_batch={p.global_batch}"
        )
    if p.schedule is not None and p.schedule not in SUPPORTED_SCHEDULES:
        raise InfeasibleError(
            f"no plan: schedule {p.schedule.value!r} is not modelled yet (use "
            + ", ".join(s.value for s in SUPPORTED_SCHEDULES)
            + ")"
        )
    if p.schedule is not None and (why := schedule_problem(p)):
        raise InfeasibleError(f"no plan: {why}")
    if p.cp_head_degree is not None and p.cp_mode not in (None, "usp"):
        raise InfeasibleError(f"no plan: {cp_head_degree_problem(p, 0)}")
    if p.cp_shares is not None or p.cp_head_shares is not None:
        # Replicas inside one group run equal shares; `cp_shares.spanning_search` plans them.
        raise InfeasibleError(
            "no plan: pinned cp_shares / cp_head_shares are planned only for cp groups that "
            "span device groups (none fits here); price them with `meshplan estimate "
            "--cp-shares` or leave them out"
        )
    domain_sizes = sorted({g.domain_gpus for g in cluster.groups})
    n_layers = len(graph.layer_units)

    def tp_ok(t: int) -> str | None:
        return tp_heads_problem(t, info.heads, info.kv_heads) or tp_domain_problem(
            cluster.groups, t
        )

    if p.tp is not None:
        if (why := tp_ok(p.tp)) is not None:
            raise InfeasibleError(f"no plan: {why}")
        tps = [p.tp]
    else:
        tps = [t for t in _divisors(max(domain_sizes)) if tp_ok(t) is None]
    if p.cp is not None:
        if why := cp_sequence_problem(p.cp, info.seq_len):
            raise InfeasibleError(f"no plan: {why}")
        cps = [p.cp]
    else:
        cps = cp_options(info.seq_len)
    if p.ep is not None:
        if why := ep_experts_problem(p.ep, info.experts):
            raise InfeasibleError(f"no plan: {why}")
        eps = [p.ep]
    else:
        eps = _divisors(info.experts) if info.experts else [1]
    # A model without repeated layers (a conv net, one block reused at every depth) is one
    # unit: one pipeline stage (`ModelInfo.blocker("pp")` says so when pp is pinned).
    if p.pp is not None and (why := pp_layers_problem(p.pp, max(1, n_layers))):
        raise InfeasibleError(f"no plan: {why}")
    pps = [p.pp] if p.pp is not None else list(range(1, max(1, n_layers) + 1))
    for dp_, mb_ in ((p.dp, None), (None, p.micro_batch), (p.dp, p.micro_batch)):
        if why := batch_split_problem(global_batch, dp_, mb_):
            raise InfeasibleError(f"no plan: {why}")
    rcs = [Recompute(p.recompute)] if p.recompute is not None else list(Recompute)
    # Activation quantization changes numerics: off unless pinned or `quantize` allows it.
    if p.quantize_activations is not None:
        qas = [bool(p.quantize_activations)]
    else:
        qas = [False, True] if quantize else [False]
    out: list[Family] = []
    n = 0  # enumeration index of the next member
    funnel = _Funnel()
    for tp, cp, pp in itertools.product(tps, cps, pps):
        modes = cp_mode_options(p.cp_mode, info.heads, tp, cp, p.cp_head_degree)
        if not modes:
            why = (
                cp_usp_problem(
                    info.heads // tp, cp, p.cp_head_degree or usp_degree(info.heads // tp, cp)
                )
                if p.cp_mode == "usp" or p.cp_head_degree
                else cp_heads_problem(info.heads // tp, cp)
            )
            funnel.reject("cp attention", why or "")
            continue
        degree = p.cp_head_degree or usp_degree(info.heads // tp, cp) if "usp" in modes else None
        funnel.keep("cp attention")
        sp = p.sequence_parallel if p.sequence_parallel is not None else tp > 1
        replicas = sum(replica_capacity(g, tp, cp) for g in cluster.groups)
        max_dp = replicas // pp
        if p.dp is not None and p.dp > max_dp:
            funnel.reject(
                "world size",
                f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{p.dp} = {tp * pp * cp * p.dp} GPUs in whole "
                f"TP groups, but the cluster holds {max_dp * pp * tp * cp} of them",
            )
            continue
        dps = [p.dp] if p.dp is not None else _divisors_upto(global_batch, max_dp)
        if not dps:
            funnel.reject(
                "world size",
                f"tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} GPUs for one pipeline in whole "
                f"TP groups, but the cluster holds {replicas * tp * cp} of them",
            )
        for dp in dps:
            funnel.keep("world size")
            mbs = (
                [p.micro_batch]
                if p.micro_batch is not None
                else micro_batch_options(global_batch // dp, pp)
            )
            zeros = [p.zero] if p.zero is not None else ([0, 1, 2, 3] if dp * cp > 1 else [0])
            for ep in eps:
                if why := ep_dp_problem(ep, dp):
                    funnel.reject("ep divides dp", why)
                    continue
                funnel.keep("ep divides dp")
                if why := ep_tp_problem(ep, tp, sp):
                    funnel.reject("ep with tp needs sp", why)
                    continue
                funnel.keep("ep with tp needs sp")
                for mb in mbs:
                    # a pinned micro-batch against a free dp
                    if why := batch_split_problem(global_batch, dp, mb):
                        funnel.reject("batch", why)
                        continue
                    funnel.keep("batch")
                    scheds = _schedules(p, pp, n_layers, global_batch // (dp * mb), zb)
                    if not scheds:
                        m_ = global_batch // (dp * mb)
                        funnel.reject(
                            "schedule",
                            (p.schedule and microbatch_problem(p.schedule, pp, m_))
                            or (
                                f"zero_bubble (ZB-V) needs pp >= 2 with 2*pp dividing the "
                                f"{n_layers} layers and at least 2*pp - 1 micro-batches "
                                f"(pp={pp}, {m_} micro-batches)"
                                if p.schedule == Schedule.ZERO_BUBBLE
                                else f"interleaved 1F1B needs pp >= 2 dividing the {n_layers} "
                                f"layers and the micro-batch count (pp={pp}, {m_} micro-batches)"
                            ),
                        )
                        continue
                    funnel.keep("schedule")
                    # Members in the order of product(zeros, rcs, scheds, qas, modes); a
                    # family per (rc, qa, mode), in that order, its members (zero, schedule)
                    # the same in every family of the block: `_block_families`.
                    valid = []
                    for zero, (sched, v) in itertools.product(zeros, scheds):
                        if why := zero_bubble_zero3_problem(sched, pp, zero):
                            funnel.reject("zb without zero3", why)
                        else:
                            valid.append((zero, sched, v))
                    funnel.keep("zb without zero3", len(valid) * len(rcs) * len(qas) * len(modes))
                    head = (tp, pp, dp, cp, ep, mb)
                    out += _block_families(
                        head, rcs, sp, qas, modes, global_batch, (), valid, n, degree
                    )
                    n += len(valid) * len(rcs) * len(qas) * len(modes)
    if per_group_tp and len(cluster.groups) > 1:
        out += _per_group_tp_candidates(
            cluster, p, global_batch, tps, cps, pps, rcs, qas, n_layers, zb, n
        )
    if not out:
        raise InfeasibleError(f"no plan: {funnel.why_none()}")
    return out


def _block_families(
    head: tuple[int, int, int, int, int, int],
    rcs: Sequence[Recompute],
    sp: bool,
    qas: Sequence[bool],
    modes: Sequence[str | None],
    global_batch: int,
    group_tp: tuple[tuple[str, int], ...],
    valid: Sequence[tuple[int, Schedule, int]],
    n: int,
    degree: int | None = None,
) -> list[Family]:
    """The families of one block of the enumeration ((tp, pp, dp, cp, ep, micro_batch) =
    `head`): its members are product(zeros, rcs, scheds, qas, modes) in that order, numbered
    from `n`, `valid` the (zero, schedule, v) that pass; one family per (rc, qa, mode) in
    product order (each family's first member comes in that order), holding every valid
    (zero, schedule, v). A member's index is n + (its zero's offset) + r * V_z * A +
    j * A + q, with A = len(qas) * len(modes), V_z the valid schedules of its zero, j its
    schedule's place among them, r and q the places of its rc and its (qa, mode). `degree`:
    the head-parallel degree of the "usp" families."""
    if not valid:
        return []
    a = len(qas) * len(modes)
    shared, loose = _template(tuple(valid), len(rcs), a)
    tp, pp, dp, cp, ep, mb = head
    return [
        Family(tp, pp, dp, cp, ep, mb, rc, sp, qa, global_batch, group_tp, mode, shared,
               n + q + r * a, r * a, loose, degree if mode == "usp" else None)
        for r, rc in enumerate(rcs)
        for q, (qa, mode) in enumerate(itertools.product(qas, modes))
    ]  # fmt: skip


@lru_cache(maxsize=4096)
def _template(valid: tuple[tuple[int, Schedule, int], ...], n_rcs: int, a: int):
    """(`Family.template`, `Family.loose`) of a block's families (`_block_families`): the
    valid (zero, schedule, v) with each one's offset and its zero's count of valid schedules,
    and the place of the loosest."""
    per_zero: dict[int, int] = {}
    for zero, _, _ in valid:
        per_zero[zero] = per_zero.get(zero, 0) + 1
    offsets, o = {}, 0  # first index of each zero's members
    for zero, vz in per_zero.items():
        offsets[zero] = o
        o += vz * n_rcs * a
    template, seen = [], dict.fromkeys(per_zero, 0)
    for zero, sched, v in valid:
        template.append((offsets[zero] + seen[zero] * a, per_zero[zero], zero, sched, v))
        seen[zero] += 1
    loose = min(range(len(valid)), key=lambda k: (_fill(*valid[k][1:]), valid[k][0] > 2, k))
    return tuple(template), loose


def _per_group_tp_candidates(
    cluster: Cluster,
    p: Parallel,
    global_batch: int,
    tps: Sequence[int],
    cps: Sequence[int],
    pps: Sequence[int],
    rcs: Sequence[Recompute],
    qas: Sequence[bool],
    n_layers: int,
    zb: bool = True,
    n: int = 0,
) -> list[Family]:
    """Per-group TP (`Candidate.group_tp`): for every pair of device groups (a, b) and TP
    degrees tp_a != tp_b (each dividing its group's GPUs per node or NVLink domain, and the
    heads), the configurations whose pipelines run group-pure, n_a >= 1 of them in a at tp_a
    and n_b >= 1 in b at tp_b, dp = n_a + n_b. Only where the runtime executes it: tp not
    pinned, ZeRO-0 (the replicas' gradient shards differ in shape, `Pricer.hetero_dp_traffic`),
    no EP.
    Sequence parallelism where a group's tp > 1 (unless pinned). Members are numbered from
    `n`."""
    if p.tp is not None or p.zero not in (None, 0) or p.ep not in (None, 1):
        return []
    out: list[Family] = []
    for a, b in itertools.combinations(cluster.groups, 2):
        tas = [t for t in tps if tp_domain_problem((a,), t) is None]
        tbs = [t for t in tps if tp_domain_problem((b,), t) is None]
        for ta, tb, cp, pp in itertools.product(tas, tbs, cps, pps):
            if cp > 1 and (p.cp_mode not in (None, "allgather") or p.cp_head_degree):
                continue  # these families attend by K/V all-gather only
            na = replica_capacity(a, ta, cp) // pp
            nb = replica_capacity(b, tb, cp) // pp
            if ta == tb or na < 1 or nb < 1:
                continue
            sp = p.sequence_parallel if p.sequence_parallel is not None else True
            dps = [p.dp] if p.dp is not None else _divisors_upto(global_batch, na + nb)
            for dp in dps:
                if dp < 2 or dp > na + nb or global_batch % dp:
                    continue
                mbs = (
                    [p.micro_batch]
                    if p.micro_batch is not None
                    else micro_batch_options(global_batch // dp, pp)
                )
                for mb in mbs:
                    if global_batch % (dp * mb):
                        continue
                    scheds = _schedules(p, pp, n_layers, global_batch // (dp * mb), zb)
                    group_tp = ((a.name, ta), (b.name, tb))
                    valid = [(0, sched, v) for sched, v in scheds]
                    head = (ta, pp, dp, cp, 1, mb)
                    out += _block_families(
                        head, rcs, sp, qas, (None,), global_batch, group_tp, valid, n
                    )
                    n += len(valid) * len(rcs) * len(qas)
    return out
