"""The planner's optimisation model: choose a parallel configuration and place it (OR-Tools CP-SAT).

Sets
    c in C      candidate global configurations (tp, pp, dp, cp, ep, micro_batch, ZeRO stage,
                recomputation, schedule with its virtual stages v: 1F1B, interleaved 1F1B,
                zero-bubble ZB-V with v = 2; sequence parallel),
                `enumerate_candidates`
    l in L(c)   per-stage layer counts of c (uneven splits), `_splits`: every split when there
                are at most EXHAUSTIVE_SPLITS, else the even split, one balanced split per device
                group (stages holding the embedding / LM head take fewer layers,
                `passes.partition.balanced_counts`) and, on mixed clusters, splits balanced
                for the groups the stages fill fastest-first and slowest-first (more layers
                on faster GPUs); interleaved 1F1B and ZB-V use the even split only
    s < pp_c    pipeline stages;   g in G  device groups

Data (seconds and bytes, from `meshplan.cost_model.plan_tables`, integerised by `_Scale`)
    u[c,l,s,g]  one micro-batch (fwd + bwd + recompute + TP/CP/EP traffic) of stage s on g
    w, o, q, d, e   DP overlap window, optimizer, boundary p2p, DP traffic in one group / across
                two groups (shared GroupLink divided among k crossing stages), as before
    m_c, v_c, pp_c, rep_c (m_c for ZeRO-3, else 1), R[c,g] replicas of tp*cp GPUs g can hold

Variables (per (c, l); the search fixes (c, l) before building a model, see below)
    n[s,g]      int, replicas of stage s in group g;  b[s,g] = (n[s,g] >= 1)
    cross[s]    bool, stage s spans several groups;  k = sum_s cross[s]
    us[s], U, P, comm[s], W[s], E, O, T

Constraints (each family added by the named method of `_PlacementModel`)
    replicas        `replicas`: sum_g n[s,g] = dp;  b <= n <= min(dp, R[g]) * b
    memory          `variables`: n[s,g] exists only where the stage fits in g's memory
    capacity        `capacity`: sum_s tp * cp * n[s,g] <= gpus(g)  (TP inside an NVLink
                    domain: no variables where tp does not divide domain_gpus(g), a node's
                    GPUs unless the group sets nvlink_domain; `tp_domain_problem`)
    stage_times     `stage_times`: us[s] >= u[s,g] * b[s,g];  U >= us[s]
    boundaries      `boundaries`: P >= q[s,a,b] * (b[s,a] + b[s+1,b] - 1)
    data_parallel   `data_parallel`: cross, k, comm[s] >= d or e(k), W[s] = max_g w b,
                    E >= comm[s] - eta W[s],  E >= (1 - eta) comm[s]
    optimizer       `optimizer`: O >= o[s,g] * b[s,g]
    bubble          `bubble` (ZB-V only): Z >= z[s,g] * b[s,g], z = `StageTime.zb_bubble`
    step_time       `step_time`: v T >= (v m - 1) U + sum_s us[s] + v (m v + pp - 1) P
                                        + v rep E + v O      (interleaved 1F1B: m U +
                    (sum_s us - U) / v + (m v + pp - 1) P; v = 1 is plain 1F1B); ZB-V:
                    T >= m U + (pp - 1) Z + (2 m + pp - 1) P + rep E + O; T <= cutoff
    objective       minimise T (objective "throughput"; "cost" and "min_gpus" below)

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

Uneven data-parallel batch shares (`_share_placements`): besides lock-step placements (every
replica runs m micro-batches, the model above), a configuration with ZeRO <= 2 may run
group-pure pipelines, n_g pipelines wholly inside group g, each running m_g micro-batches,
sum_g n_g m_g = dp m (`StagePlacement.microbatches`). Each group's pipeline term is
f_g(m_g) = m_g (U_g + v P_g) + (S_g - U_g) / v + (pp - 1) P_g and the step takes the max over
groups (`cost_model.simulate.evaluate`). For every pair of host groups and every split
n_a + n_b = dp (a window around the fastest-first split when dp > SHARE_EXHAUSTIVE_DP) the
best integer shares are found exactly: f_a rises and f_b falls with m_a, so the optimum is the
feasible m_a nearest the crossing point on either side. The shares never raise a stage's
in-flight activations (m_g stays where the schedule's warm-up depth is already saturated).

Per-group TP (`_per_group_tp_candidates`, `Candidate.group_tp`): a configuration may run its
group-pure pipelines in two groups a and b at different TP degrees tp_a != tp_b (each must
divide its own group's GPUs per node or NVLink domain: a wide TP on 8-GPU NVLink nodes next to
2-GPU nodes, or memory-tight GPUs that need a wider TP than the others). Its tables are each
group's own at its tp (`cost_model.simulate.hetero_tables`) with the cross-group gradient average of
`Pricer.dp_cross_hetero`; it has only group-pure placements (n_a, n_b >= 1 pipelines, shares
as above, equal shares allowed even where the warm-up depth is not saturated), so its bounds
are the share bounds. ZeRO-0 and no EP (what the runtime executes: replicas whose TP shards
differ cannot share ZeRO shards). Pipelines with per-stage TP degrees (one pipeline crossing
groups of different tp) are not searched: torch.distributed.pipelining pairs exactly one rank
per stage in each pipeline, so stages of different tp cannot hand activations over.

How it is solved (`solve` -> `_search`). The restriction to one (c, l) is a small placement
model and different (c, l) share no variable, so the search branches on (c, l) in lower-bound
order instead of building one model over all of them:

1. enumerate candidates (`enumerate_candidates`) and their splits (`_splits`);
2. bound every (c, l) without memory (`_memory_free_bound`: fastest groups that can hold the
   replicas; with shares: the whole micro-batch count over the best pipeline rate,
   `_share_rate_bound`), price them in bound order (`plan_tables`; stages repeat, so tables
   are built per distinct stage), drop those that fit in no group's memory, bound again with
   memory (`_lower_bound`, `_share_bound`) and place greedily (`_greedy_placements`, the warm
   start, and `_share_placements`) until the bound passes the best plan: nothing left can win
   (`_screen`);
3. for each surviving (c, l) whose lock-step greedy placement does not already meet its bound,
   build the placement model (`_PlacementModel`: variables -> constraints -> objective), hint
   the greedy placement (`AddHint`), cut off at the incumbent, solve;
4. decode the best placement into `Parallel` + `StagePlacement`s and re-price it with
   `predict`. The plan is "optimal" when every (c, l) was either bounded out or solved to
   optimality, else "feasible" with the relative gap to the smallest open bound.

Objectives (`Objective`): "throughput" (default) minimises the step time. "cost" minimises
dollars per token = step time x the hourly price of the GPUs the plan uses (from
`DeviceGroup.price_per_gpu_hour` or `Objective.prices`); bounds are the step bound times the
cheapest GPUs that could hold the configuration, placements are scored by their cost, and the
placement model (which minimises T) is used as one more placement to score, so on clusters
whose groups differ in price the status is "optimal" only when the bounds close the search.
"min_gpus" returns the fastest plan on the fewest GPUs (tp * pp * cp * dp) whose throughput
meets `target_tokens_per_s`: GPU counts are tried in increasing order, each a throughput search
restricted to that count, skipped when its memory-free bound already misses the target.

Structure exploited: identical layers share one block, so stage costs are priced per distinct
stage composition; bounds are keyed without ZeRO (it does not change stage times) and are
linear in m; a homogeneous cluster's bounds are exact, so no placement model is needed at all.
Determinism: the budget is work, not seconds (`_Work`): each step of the screen is charged
its calibrated cost (`WORK_COSTS`: bounds, memory checks, table cells priced, placements
scored, model cells built) and each CP-SAT solve its deterministic time, with one worker and
a fixed seed (`max_deterministic_time`, `num_workers = 1`, `random_seed = 0`: one search
path); candidates and splits are enumerated and sorted in a fixed order. So identical inputs
give identical plans on an idle and on a loaded machine, also when the budget cuts the search
short. The wall clock is only a safety net (WALL_SAFETY_FACTOR x the budget): a search it
stops is reported (`SolveResult.wall_clock_hit`, `WALL_CLOCK_NOTE` in the plan's notes).
`export_model` (or `solve(export_model=path)`) writes the winning placement model.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from meshplan.cost_model.compression import CommOptions
from meshplan.cost_model.engine import EAGER, Engine
from meshplan.cost_model.memory import in_flight_microbatches
from meshplan.cost_model.simulate import (
    OVERLAP_EFFICIENCY,
    SUPPORTED_SCHEDULES,
    PlanTables,
    Pricer,
    evaluate,
    hetero_tables,
    plan_tables,
    predict,
    pricer_for,
)
from meshplan.ir import (
    Cluster,
    Graph,
    Parallel,
    Prediction,
    Recompute,
    Schedule,
    StagePlacement,
    microbatch_problem,
)
from meshplan.ir.facts import blocked_dimension, without_blocked
from meshplan.passes.partition import (
    balanced_counts,
    chunk_layout_problem,
    compositions,
    count_compositions,
    rank_layers,
    replica_capacity,
    stages_of,
    tp_domain_problem,
)
from ortools.sat.python import cp_model

# Largest micro-batch the planner tries unless pinned. Assumption: costs scale linearly with
# the micro-batch (cost_model), so past a few sequences a larger one only saves kernel floors
# while it lengthens the pipeline fill and raises activation memory.
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
# Up to this many splits of the layers over pp stages are searched exhaustively; beyond, the
# structured family of `_splits`.
EXHAUSTIVE_SPLITS = 16
# Uneven DP shares: every split of dp pipelines over two groups is tried up to this dp, a
# window of SHARE_WINDOW splits around the fastest-first one beyond it.
SHARE_EXHAUSTIVE_DP = 64
SHARE_WINDOW = 8

# Integer time unit: the best greedy step time is represented by about this many units, so
# rounding each table entry to a unit costs at most ~1e-7 of the step per term.
UNITS_PER_STEP = 10_000_000

# The search's budget is deterministic work, not seconds (`_Work`), so identical inputs give
# identical plans on an idle and on a loaded machine. One work unit is about one second of
# CPU time of the 2-core development machine the figures of docs/planner.md come from, so
# `time_limit_s` keeps its meaning there ("about this many seconds") and means the same plan
# everywhere; a faster machine finishes sooner, a loaded one later. Each step of the Python
# search is charged its CPU cost (WORK_COSTS); CP-SAT is charged its own deterministic time.
# WORK_COSTS: non-negative least-squares fit of the process time (`time.process_time`) from
# a solve's start against the steps counted so far, over 718 snapshots of 14 solves on that
# machine (Python 3.11, OR-Tools 9.15): llama3-8b on examples/clusters/mixed_h100_a100.yaml,
# two_sites_wan.yaml, dgx-h100 x 32 and x 64 and 64 + 64 H100/A100, mixtral-8x7b on
# mixed_h100_a100.yaml, llama3-70b and deepseek-moe-16b on 256 + 256 H100/A100, budgets of
# 1 to 60. The charged work matches the measured seconds to 7% at the median and 25% at the
# 90th percentile of those solves (the worst, 0.06 s against 0.16, is the smallest).
WORK_COSTS: dict[str, float] = {
    "solve": 8.0e-2,  # a solve's set-up and decoding (`pricer_for`, `predict`)
    "candidate": 5.0e-6,  # a configuration enumerated (`enumerate_candidates`)
    "bound": 2.0e-5,  # a configuration's split-free bound (`_split_free_bound`)
    "split": 2.6e-5,  # a (configuration, split) pair's memory-free bound
    "memory": 8.5e-5,  # a memory check (`_split_free_memory` or `_largest_stage`)
    "cell": 1.1e-4,  # one (stage, group) cell of a pair's priced tables (`plan_tables`)
    "placement": 3.2e-4,  # one placement scored (`evaluate`: warm starts and shares)
    "model": 3.9e-4,  # one replica variable of a placement model, built and solved
}
# CP-SAT deterministic time per work unit. Its unit "is as close as possible to a second"
# (OR-Tools' SatParameters, `max_deterministic_time`); on the reference machine a
# long single-worker search took 1.4 to 2.3 CPU seconds per deterministic second (2.7 and
# 4.7 s for 2.0, two assignment models of 90 and 180 jobs), so one work unit buys half a
# deterministic second. The placement models here are small (about 50 variables, 0.2 ms of
# deterministic time each): their cost is mostly the per-variable charge above.
CPSAT_DETERMINISTIC_PER_WORK = 0.5
# Smallest CP-SAT budget of one placement model (deterministic seconds): enough to read the
# hinted warm start back.
CPSAT_MIN_DETERMINISTIC = 0.05
# The wall-clock safety net: a search still running after this many times its budget in
# seconds (at least WALL_SAFETY_MIN_S more) stops, and the plan says so (`WALL_CLOCK_NOTE`),
# because only then may it depend on the machine's load.
WALL_SAFETY_FACTOR = 5.0
WALL_SAFETY_MIN_S = 30.0
WALL_CLOCK_NOTE = (
    "solver stopped on its wall-clock safety net ({wall:.0f} s) before spending its work "
    "budget (time limit {budget:g}): this plan may differ from run to run; rerun on a less "
    "loaded machine"
)

OBJECTIVES = ("throughput", "cost", "min_gpus")

GiB = 2**30

Progress = Callable[[str], None] | None


_ZB = Schedule.ZERO_BUBBLE  # a module constant: enum attribute access is slow in hot loops


class InfeasibleError(ValueError):
    """No configuration fits; the message names the binding constraint and its numbers."""


@dataclass(frozen=True, slots=True)
class Objective:
    """What the search optimises (see the module docstring).

    `kind`: "throughput" (minimise step time), "cost" (minimise dollars per token) or
    "min_gpus" (fewest GPUs meeting `target_tokens_per_s`). `prices`: $ per GPU-hour by device
    group name or GPU type name, overriding `DeviceGroup.price_per_gpu_hour`."""

    kind: str = "throughput"
    target_tokens_per_s: float | None = None
    prices: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.kind!r}")
        if self.kind == "min_gpus" and not (self.target_tokens_per_s or 0) > 0:
            raise ValueError("objective 'min_gpus' needs a positive target_tokens_per_s")

    def price_per_gpu_s(self, cluster: Cluster) -> dict[str, float]:
        """$ per GPU-second of every group; raises ValueError naming a group without a price."""
        given = dict(self.prices)
        out = {}
        for g in cluster.groups:
            price = given.get(g.name, given.get(g.gpu.name, g.price_per_gpu_hour))
            if price is None:
                raise ValueError(
                    f"objective 'cost' needs a price for group {g.name} ({g.gpu.name}): set "
                    "price_per_gpu_hour in the cluster or pass prices={...}"
                )
            out[g.name] = price / 3600.0
        return out


@dataclass(frozen=True, slots=True)
class Candidate:
    """One global configuration c (everything but the stage split and the placement)."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    micro_batch: int
    zero: int
    recompute: Recompute
    schedule: Schedule
    sequence_parallel: bool
    virtual_stages: int = 1
    quantize_activations: bool = False  # AGoQ widths for saved activations (numerics change)
    # Per-group TP (`StagePlacement.group_tp`): ((group a, tp_a), (group b, tp_b)) for
    # group-pure pipelines in two groups at their own degrees; `tp` is then tp_a. Empty: every
    # replica at `tp`.
    group_tp: tuple[tuple[str, int], ...] = ()

    def tp_of(self, group: str) -> int:
        """The TP degree of `group`'s replicas."""
        for g, t in self.group_tp:
            if g == group:
                return t
        return self.tp

    def sp_of(self, group: str) -> bool:
        """Sequence parallelism on `group`'s replicas (off where a per-group tp is 1)."""
        return self.sequence_parallel and (not self.group_tp or self.tp_of(group) > 1)

    def view(self, group: str) -> Candidate:
        """The homogeneous candidate `group`'s pipelines run (its tp, no per-group TP)."""
        if not self.group_tp:
            return self
        return dataclasses.replace(
            self, tp=self.tp_of(group), sequence_parallel=self.sp_of(group), group_tp=()
        )

    def parallel(self, global_batch: int) -> Parallel:
        """The complete `Parallel` of this candidate."""
        return Parallel(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            micro_batch=self.micro_batch,
            global_batch=global_batch,
            recompute=self.recompute,
            zero=self.zero,
            schedule=self.schedule,
            sequence_parallel=self.sequence_parallel,
            virtual_stages=(
                self.virtual_stages
                if self.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)
                else None
            ),
            quantize_activations=self.quantize_activations or None,
        )

    @property
    def fill(self) -> float:
        """Coefficient of (S - U) in the pipeline term: 1 / v, 0 under ZB-V (`PlanTables.fill`)."""
        return 0.0 if self.schedule is _ZB else 1.0 / self.virtual_stages

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
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
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
            self.virtual_stages,
            self.sequence_parallel,
            self.quantize_activations,
            self.group_tp,
        )


@dataclass(frozen=True)
class SolveResult:
    """The chosen plan and how the search went."""

    parallel: Parallel
    stages: tuple[StagePlacement, ...]
    prediction: Prediction
    status: str  # "optimal" or "feasible"
    gap: float  # (objective - best bound) / objective
    wall_s: float
    candidates: int  # configurations enumerated and bounded
    explored: int  # (configuration, split) pairs priced in full (tables, bounds, greedy)
    placement_models: int  # CP-SAT placement models solved
    objective: str = "throughput"
    objective_value: float = 0.0  # step s, $ per token or GPUs, by objective
    splits: int = 0  # (configuration, split) pairs bounded
    work: float = 0.0  # deterministic work spent, in work units (`_Work`)
    wall_clock_hit: bool = False  # stopped on the wall-clock safety net: may vary by load


@dataclass(slots=True)
class _Work:
    """The search's budget: deterministic work spent against `limit` (work units, about CPU
    seconds of the reference machine: `WORK_COSTS`), and the wall-clock safety net `deadline`
    (a `time.perf_counter()` value) that stops the search only when the machine is far slower
    or busier than the reference; `wall_hit` records that it did. `counts` is what was charged,
    by kind (calibration and reports)."""

    limit: float
    deadline: float
    safety_s: float  # the safety net in seconds from the start (for messages)
    spent: float = 0.0
    wall_hit: bool = False
    counts: dict[str, float] = field(default_factory=dict)

    @classmethod
    def starting_now(cls, limit: float, wall_limit_s: float | None = None) -> _Work:
        """A budget of `limit` work units whose safety net is `wall_limit_s` seconds from now
        (default: WALL_SAFETY_FACTOR times the budget, at least WALL_SAFETY_MIN_S more)."""
        if wall_limit_s is None:
            wall_limit_s = max(WALL_SAFETY_FACTOR * limit, limit + WALL_SAFETY_MIN_S)
        return cls(limit, time.perf_counter() + wall_limit_s, wall_limit_s)

    def charge(self, kind: str, n: float = 1.0) -> None:
        """Spend n steps of `kind` (a key of WORK_COSTS, or "cpsat": deterministic seconds)."""
        self.counts[kind] = self.counts.get(kind, 0.0) + n
        cost = 1.0 / CPSAT_DETERMINISTIC_PER_WORK if kind == "cpsat" else WORK_COSTS[kind]
        self.spent += n * cost

    def left(self) -> float:
        """Work units left (0 when spent)."""
        return max(0.0, self.limit - self.spent)

    def at_least(self, units: float) -> None:
        """Raise the limit so that at least `units` more may be spent."""
        self.limit = max(self.limit, self.spent + units)

    def absorb(self, result: SolveResult) -> None:
        """Count the work of a nested solve (`_single_group_seed`) as spent here."""
        self.spent += result.work
        self.wall_hit = self.wall_hit or result.wall_clock_hit

    def exhausted(self, until: float | None = None) -> bool:
        """True once `until` work units (default the limit) are spent, or the safety net has
        passed (which sets `wall_hit`: only then does the stop depend on the clock)."""
        if self.spent >= (self.limit if until is None else until):
            return True
        return self.past_deadline()

    def past_deadline(self) -> bool:
        """Whether the wall-clock safety net has passed (sets `wall_hit`)."""
        if time.perf_counter() > self.deadline:
            self.wall_hit = True
        return self.wall_hit

    def seconds_left(self) -> float:
        """Wall-clock seconds to the safety net."""
        return max(0.0, self.deadline - time.perf_counter())


# ---------------------------------------------------------------------------------------------
# Step 1: enumerate candidates and their splits
# ---------------------------------------------------------------------------------------------


def _stage_memory(pricer, comp, c):
    """Memory of one stage made of `comp` under candidate `c` (all of c's memory knobs)."""
    return pricer.stage_memory(
        comp,
        tp=c.tp,
        cp=c.cp,
        ep=c.ep,
        dp=c.dp,
        zero=c.zero,
        recompute=c.recompute,
        sp=c.sequence_parallel,
        micro_batch=c.micro_batch,
        quantize=c.quantize_activations,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


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
    zb_ok = zb_ok and m >= 2 * pp - 1 and pv in (None, 2)
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


def enumerate_candidates(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    global_batch: int,
    *,
    quantize: bool = False,
    per_group_tp: bool = True,
) -> list[Candidate]:
    """Every configuration the planner considers, honouring each pinned field of `pinned`.

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
    leaves nothing.
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
    if (
        p.virtual_stages
        and p.virtual_stages > 1
        and p.schedule not in (None, Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)
    ):
        raise InfeasibleError(
            f"no plan: virtual_stages={p.virtual_stages} needs schedule 'interleaved_1f1b'"
        )
    domain_sizes = sorted({g.domain_gpus for g in cluster.groups})
    n_layers = len(graph.layer_units)

    def tp_ok(t: int) -> str | None:
        for what, n in (("heads", info.heads), ("kv_heads", info.kv_heads)):
            if n and n % t:
                return f"tp={t} does not divide the model's {what} ({n})"
        return tp_domain_problem(cluster.groups, t)

    if p.tp is not None:
        if (why := tp_ok(p.tp)) is not None:
            raise InfeasibleError(f"no plan: {why}")
        tps = [p.tp]
    else:
        tps = [t for t in _divisors(max(domain_sizes)) if tp_ok(t) is None]
    if p.cp is not None:
        if info.seq_len and info.seq_len % p.cp:
            raise InfeasibleError(f"no plan: cp={p.cp} does not divide seq_len={info.seq_len}")
        cps = [p.cp]
    else:
        cps = cp_options(info.seq_len)
    if p.ep is not None:
        if p.ep > 1 and not info.experts:
            raise InfeasibleError(f"no plan: ep={p.ep} but the model has no experts")
        if info.experts and info.experts % p.ep:
            raise InfeasibleError(f"no plan: ep={p.ep} does not divide experts={info.experts}")
        eps = [p.ep]
    else:
        eps = _divisors(info.experts) if info.experts else [1]
    # A model without repeated layers (a conv net, one block reused at every depth) is one
    # unit: one pipeline stage (`ModelInfo.blocker("pp")` says so when pp is pinned).
    if p.pp is not None and not 1 <= p.pp <= max(1, n_layers):
        raise InfeasibleError(f"no plan: pp={p.pp} but the model has {n_layers} layers")
    pps = [p.pp] if p.pp is not None else list(range(1, max(1, n_layers) + 1))
    pinned_rows = [("dp", p.dp), ("micro_batch", p.micro_batch)]
    if p.dp is not None and p.micro_batch is not None:
        pinned_rows.append(("dp*micro_batch", p.dp * p.micro_batch))
    for what, n in pinned_rows:
        if n is not None and global_batch % n:
            shown = f"{p.dp}*{p.micro_batch}={n}" if what == "dp*micro_batch" else str(n)
            raise InfeasibleError(
                f"no plan: global_batch={global_batch} is not divisible by {what}={shown}"
            )
    rcs = [Recompute(p.recompute)] if p.recompute is not None else list(Recompute)
    # Activation quantization changes numerics: off unless pinned or `quantize` allows it.
    if p.quantize_activations is not None:
        qas = [bool(p.quantize_activations)]
    else:
        qas = [False, True] if quantize else [False]
    out: list[Candidate] = []
    why_none = "no configuration fits the cluster's GPU count"
    for tp, cp, pp in itertools.product(tps, cps, pps):
        sp = p.sequence_parallel if p.sequence_parallel is not None else tp > 1
        max_dp = sum(replica_capacity(g, tp, cp) for g in cluster.groups) // pp
        if p.dp is not None and p.dp > max_dp:
            why_none = (
                f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{p.dp} = {tp * pp * cp * p.dp} GPUs in whole "
                f"TP groups, but the cluster holds {max_dp * pp * tp * cp} of them"
            )
            continue
        dps = [p.dp] if p.dp is not None else _divisors_upto(global_batch, max_dp)
        for dp in dps:
            mbs = (
                [p.micro_batch]
                if p.micro_batch is not None
                else micro_batch_options(global_batch // dp, pp)
            )
            zeros = [p.zero] if p.zero is not None else ([0, 1, 2, 3] if dp * cp > 1 else [0])
            for ep in eps:
                if dp % ep:
                    why_none = f"ep={ep} does not divide dp={dp} (expert ranks reuse DP ranks)"
                    continue
                if ep > 1 and tp > 1 and not sp:  # Megatron-Core's rule; the runtime's too
                    why_none = "ep > 1 with tp > 1 needs sequence parallelism"
                    continue
                for mb in mbs:
                    if global_batch % (dp * mb):  # a pinned micro-batch against a free dp
                        why_none = (
                            f"global_batch={global_batch} is not divisible by "
                            f"dp*micro_batch={dp}*{mb}={dp * mb} for any dp that fits"
                        )
                        continue
                    scheds = schedule_options(p, pp, n_layers, global_batch // (dp * mb), zb)
                    if not scheds:
                        m_ = global_batch // (dp * mb)
                        why_none = (p.schedule and microbatch_problem(p.schedule, pp, m_)) or (
                            f"zero_bubble (ZB-V) needs pp >= 2 with 2*pp dividing the {n_layers} "
                            f"layers and at least 2*pp - 1 micro-batches (pp={pp}, {m_} "
                            "micro-batches)"
                            if p.schedule == Schedule.ZERO_BUBBLE
                            else f"interleaved 1F1B needs pp >= 2 dividing the {n_layers} layers "
                            f"and the micro-batch count (pp={pp}, {m_} micro-batches)"
                        )
                    for zero, rc, (sched, v), qa in itertools.product(zeros, rcs, scheds, qas):
                        if zero == 3 and sched == Schedule.ZERO_BUBBLE:
                            # torch's ZB-V with FSDP2 resharding gives wrong gradients
                            # (measured; the runtime refuses it): not a plan to emit
                            why_none = (
                                "zero_bubble (ZB-V) with ZeRO-3 does not train correctly in "
                                "torch 2.13 (the runtime refuses it); use zero <= 2"
                            )
                            continue
                        out.append(Candidate(tp, pp, dp, cp, ep, mb, zero, rc, sched, sp, v, qa))
    if per_group_tp and len(cluster.groups) > 1:
        out += _per_group_tp_candidates(
            cluster, p, global_batch, tps, cps, pps, rcs, qas, n_layers, zb
        )
    if not out:
        raise InfeasibleError(f"no plan: {why_none}")
    return out


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
) -> list[Candidate]:
    """Per-group TP (`Candidate.group_tp`): for every pair of device groups (a, b) and TP
    degrees tp_a != tp_b (each dividing its group's GPUs per node or NVLink domain, and the
    heads), the configurations whose pipelines run group-pure, n_a >= 1 of them in a at tp_a
    and n_b >= 1 in b at tp_b, dp = n_a + n_b. Only where the runtime executes it: tp not
    pinned, ZeRO-0 (the replicas' gradient shards differ in shape, `Pricer.hetero_dp_traffic`),
    no EP.
    Sequence parallelism where a group's tp > 1 (unless pinned)."""
    if p.tp is not None or p.zero not in (None, 0) or p.ep not in (None, 1):
        return []
    out: list[Candidate] = []
    for a, b in itertools.combinations(cluster.groups, 2):
        tas = [t for t in tps if tp_domain_problem((a,), t) is None]
        tbs = [t for t in tps if tp_domain_problem((b,), t) is None]
        for ta, tb, cp, pp in itertools.product(tas, tbs, cps, pps):
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
                    scheds = schedule_options(p, pp, n_layers, global_batch // (dp * mb), zb)
                    for rc, (sched, v), qa in itertools.product(rcs, scheds, qas):
                        group_tp = ((a.name, ta), (b.name, tb))
                        out.append(
                            Candidate(ta, pp, dp, cp, 1, mb, 0, rc, sched, sp, v, qa, group_tp)
                        )
    return out


def _unit_costs(
    pricer: Pricer, c: Candidate, group: str, cache: dict
) -> tuple[float, float, float]:
    """(mean layer time, time of the units before the first layer, after the last layer) of
    one micro-batch on one rank of `group` under c's degrees (memoised in `cache`)."""
    key = ("unit", group, c.tp_of(group), c.cp, c.ep, c.sp_of(group), c.micro_batch, c.recompute)
    got = cache.get(key)
    if got is None:
        got = cache[key] = _unit_costs_uncached(pricer, c, group)
    return got


def _unit_costs_uncached(pricer: Pricer, c: Candidate, group: str) -> tuple[float, float, float]:
    costs, graph = pricer.costs, pricer.costs.graph
    lookup = dict(graph.blocks)
    kinds = [lookup[k].kind for k in costs.unit_keys]
    layer_pos = [i for i, k in enumerate(kinds) if k == "layer"]

    @functools.cache
    def t(key: str) -> float:
        return pricer.stage_time(
            ((key, 1),),
            group,
            tp=c.tp_of(group),
            cp=c.cp,
            ep=c.ep,
            sp=c.sp_of(group),
            micro_batch=c.micro_batch,
            recompute=c.recompute,
        ).total

    layer = sum(t(costs.unit_keys[i]) for i in layer_pos) / len(layer_pos)
    head = sum(t(costs.unit_keys[i]) for i in range(layer_pos[0]))
    tail = sum(t(costs.unit_keys[i]) for i in range(layer_pos[-1] + 1, len(kinds)))
    return layer, head, tail


def _fill(capacity: dict[str, int], order: Sequence[str], pp: int, dp: int):
    """The groups each stage's replicas land on when stages fill `order` in rank order."""
    free = dict(capacity)
    out = []
    for _ in range(pp):
        want, used = dp, []
        for g in order:
            take = min(want, free[g])
            if take:
                used.append(g)
                free[g] -= take
                want -= take
            if not want:
                break
        if want:
            return None
        out.append(used)
    return out


def _splits(
    pricer: Pricer, c: Candidate, groups: Sequence[str], n_layers: int, cache: dict
) -> list[tuple[int, ...]]:
    """The layer splits searched for c (module docstring, set L(c)); the even split first.
    `cache` memoises per-unit costs and balanced splits within one search."""
    pp = c.pp
    base, extra = divmod(n_layers, pp)
    even = tuple(base + (1 if s < extra else 0) for s in range(pp))
    if pp == 1:
        return [even]
    if c.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE) and c.virtual_stages > 1:
        # the chunk layout fixes each rank's layers (`chunk_layers`: equal chunks, or the
        # embedding and the loss counted as a layer each)
        v_shape = c.schedule == Schedule.ZERO_BUBBLE
        return [rank_layers(n_layers, pp, c.virtual_stages, v_shape)]
    if c.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE):
        return [even]
    if count_compositions(n_layers, pp) <= EXHAUSTIVE_SPLITS:
        return [even] + [x for x in compositions(n_layers, pp) if x != even]
    out = [even]
    per = {g: _unit_costs(pricer, c, g, cache) for g in groups}

    def balanced(stage_groups: Sequence[Sequence[str]]) -> tuple[int, ...]:
        key = ("split", pp, tuple(tuple(gs) for gs in stage_groups), *(per[g] for g in groups))
        got = cache.get(key)
        if got is None:
            layer = [max(per[g][0] for g in gs) for gs in stage_groups]
            fixed = [0.0] * pp
            fixed[0] += max(per[g][1] for g in stage_groups[0])
            fixed[-1] += max(per[g][2] for g in stage_groups[-1])
            got = cache[key] = balanced_counts(n_layers, layer, fixed)
        return got

    for g in groups:
        out.append(balanced([[g]] * pp))
    if len(groups) > 1 and not c.group_tp:  # lock-step fills (per-group TP is group-pure)
        capacity = {g: replica_capacity(pricer.groups[g], c.tp, c.cp) for g in groups}
        fast = sorted(groups, key=lambda g: (per[g][0], g))
        for order in (fast, fast[::-1]):
            filled = _fill(capacity, order, pp, c.dp)
            if filled is not None:
                out.append(balanced(filled))
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------------
# Step 2: screen (bound, price, greedy warm start) before building any model
# ---------------------------------------------------------------------------------------------


def _prefix_time(times: dict[str, float], capacity: dict[str, int], need: int) -> float:
    """The least possible max-time of `need` replicas spread over groups with these per-group
    times and capacities: fill the fastest groups first; the last group touched sets the time."""
    acc = 0
    for g in sorted(times, key=lambda g: (times[g], g)):
        acc += capacity[g]
        if acc >= need:
            return times[g]
    return math.inf


def _stage_bound(
    stage_times: Sequence[dict[str, float]],
    counts: Sequence[int],
    capacity: dict[str, int],
    dp: int,
) -> tuple[float, float]:
    """(U, S): lower bounds on max_s u_s and sum_s u_s over every placement that respects the
    groups' replica capacity, for stages with these per-group times (`stage_times` has one
    entry per distinct stage, `counts` stages each; a group missing from an entry is not
    allowed to that stage).

    Each stage alone: its dp replicas at best fill its fastest groups (`_prefix_time`). All
    stages together: if a set F of the fastest groups holds fewer than the pp * dp replicas,
    at least k = ceil((pp * dp - cap(F)) / dp) stages have a replica outside F, so U is at
    least the k-th smallest outside-F stage time, and S at least the per-stage bounds plus the
    k smallest excesses of outside-F time over them. Infinite when the groups cannot hold it.
    """
    per = [_prefix_time(st, capacity, dp) for st in stage_times]
    big_u = max(per)
    base = sum(n * u for n, u in zip(counts, per))
    total = base
    need = dp * sum(counts)
    speed: dict[str, float] = {}
    for st in stage_times:
        for g, v in st.items():
            speed[g] = min(speed.get(g, math.inf), v)
    held, inside = 0, set()
    for g in sorted(speed, key=lambda g: (speed[g], g)) + [None]:
        if held < need and inside:
            k = -(-(need - held) // dp)
            outside = sorted(
                (min((v for h, v in st.items() if h not in inside), default=math.inf), n, u)
                for st, n, u in zip(stage_times, counts, per)
            )
            seen = 0
            for v, n, _ in outside:
                seen += n
                if seen >= k:
                    big_u = max(big_u, v)
                    break
            excess = sorted((max(0.0, v - u), n) for v, n, u in outside)
            extra, left = 0.0, k
            for e, n in excess:
                take = min(n, left)
                extra += take * e
                left -= take
                if not left:
                    break
            total = max(total, base + extra)
        if g is None:
            break
        held += capacity[g]
        inside.add(g)
    if held < need:
        return math.inf, math.inf
    return big_u, total


def _split_free_bound(
    pricer: Pricer, c: Candidate, groups: Sequence[str], m: int, cache: dict
) -> float:
    """A step-time bound of c that holds for every split and placement (memory ignored):
    stage times add over units, so S >= S_min (every unit on its fastest group) and U >= S / pp
    for lock-step placements; with shares a group's pipelines need at least W_g / pp per
    micro-batch (W_g: the whole model on g), so `_share_rate_bound` applies with U_g = W_g / pp."""
    key = ("free", c.tp, c.cp, c.ep, c.sequence_parallel, c.micro_batch, c.recompute)
    key += (tuple(groups), c.group_tp)
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        counts: dict[str, int] = {}
        for k in costs.unit_keys:
            counts[k] = counts.get(k, 0) + 1
        per = {
            (k, g): pricer.stage_time(
                ((k, 1),),
                g,
                tp=c.tp_of(g),
                cp=c.cp,
                ep=c.ep,
                sp=c.sp_of(g),
                micro_batch=c.micro_batch,
                recompute=c.recompute,
            ).total
            for k in counts
            for g in groups
        }
        s_min = sum(n * min(per[(k, g)] for g in groups) for k, n in counts.items())
        whole = {g: sum(n * per[(k, g)] for k, n in counts.items()) for g in groups}
        got = cache[key] = (s_min, whole)
    s_min, whole = got
    pp = c.pp
    # m U + fill (S - U) with U >= S / pp (increasing in U since m >= fill); per-group TP
    # has group-pure placements only (the share bound below)
    lock = math.inf if c.group_tp else m * s_min / pp + c.fill * s_min * (1 - 1 / pp)
    if c.zero > 2:
        return lock
    rkey = key + (pp, c.dp)  # ZeRO, schedule and m do not change the rate: memoise it
    rate = cache.get(rkey)
    if rate is None:
        capacity = {g: replica_capacity(pricer.groups[g], c.tp_of(g), c.cp) for g in groups}
        per_group = {g: (w / pp, w / pp) for g, w in whole.items()}
        rate = cache[rkey] = _share_rate_bound(per_group, capacity, pp, c.dp)[0]
    return min(lock, c.dp * m / rate) if rate > 0 else lock


def _megatron_seeds(
    cands: list[Candidate], fits: Callable[[Candidate], bool], per_pp: int = 2, most: int = 8
) -> list[Candidate]:
    """Megatron-LM-style warm starts among the candidates: the widest TP, no CP, the most EP,
    micro-batch 1, ZeRO-1 (distributed optimizer), 1F1B, no or selective recompute, the largest
    dp for each of the smallest pipeline depths whose layers can fit (`fits`), `most` in all."""
    pool = [
        c
        for c in cands
        if c.cp == 1
        and not c.group_tp
        and c.micro_batch == 1
        and c.zero in (0, 1)
        and c.schedule == Schedule.ONE_F_ONE_B
        and c.recompute != Recompute.FULL
    ]
    if not pool:
        return []
    tp = max(c.tp for c in pool)
    ep = max(c.ep for c in pool if c.tp == tp)
    by_pp: dict[int, list[Candidate]] = {}
    for c in pool:
        if c.tp == tp and c.ep == ep and (c.zero == 1 or c.dp == 1):
            by_pp.setdefault(c.pp, []).append(c)
    out: list[Candidate] = []
    for pp in sorted(by_pp):
        top = max(c.dp for c in by_pp[pp])
        best = sorted((c for c in by_pp[pp] if c.dp == top), key=lambda c: c.sort_key)
        out += [c for c in best if fits(c)][:per_pp]
        if len(out) >= most:
            break
    return out[:most]


def _split_free_memory(pricer: Pricer, c: Candidate, n_layers: int, cache: dict) -> int:
    """A peak-memory bound of c that holds for every split: some stage holds at least
    ceil(L / pp) consecutive layers and at least one micro-batch in flight, so it needs at least
    the least memory of such a window (over every window of the layer units)."""
    key = ("mem", c.tp, c.cp, c.ep, c.dp, c.zero, c.recompute, c.sequence_parallel)
    key += (c.micro_batch, c.pp, c.quantize_activations)
    got = cache.get(key)
    if got is None:
        costs = pricer.costs
        lookup = dict(costs.graph.blocks)
        layer_pos = [i for i, k in enumerate(costs.unit_keys) if lookup[k].kind == "layer"]
        width = -(-n_layers // c.pp)
        comps = {
            costs.composition(layer_pos[i], layer_pos[i + width - 1] + 1)
            for i in range(len(layer_pos) - width + 1)
            if width
        } or {costs.composition(0, len(costs.unit_keys))}  # no layers: the whole model
        got = cache[key] = min(_stage_memory(pricer, comp, c).peak(1)[0] for comp in comps)
    return got


def _distinct_stage_times(pricer: Pricer, cand: Candidate, ranges, groups, cache: dict):
    """(per distinct stage: {group: u}, how many stages each, {group: (U_g, S_g)}), memoised
    in `cache` (dp and ZeRO do not change stage times)."""
    key = ("times", cand.tp, cand.cp, cand.ep, cand.sequence_parallel, cand.micro_batch)
    key += (cand.recompute, tuple(ranges), tuple(groups), cand.group_tp)
    got = cache.get(key)
    if got is not None:
        return got
    costs = pricer.costs
    distinct: dict = {}
    for first, last in ranges:
        comp = costs.composition(first, last)
        distinct[comp] = distinct.get(comp, 0) + 1
    stage_times = [
        {
            g: pricer.stage_time(
                comp,
                g,
                tp=cand.tp_of(g),
                cp=cand.cp,
                ep=cand.ep,
                sp=cand.sp_of(g),
                micro_batch=cand.micro_batch,
                recompute=cand.recompute,
            ).total
            for g in groups
        }
        for comp in distinct
    ]
    counts = list(distinct.values())
    per_group = {
        g: (max(st[g] for st in stage_times), sum(n * st[g] for st, n in zip(stage_times, counts)))
        for g in groups
    }
    got = cache[key] = (stage_times, counts, per_group)
    return got


def _memory_free_bound(
    pricer: Pricer, cand: Candidate, ranges, groups, cache: dict
) -> tuple[float, float, float, float]:
    """Lower-bound pieces of every placement before any table (memory ignored, capacity
    respected), over the distinct stages: (U, S) of `_stage_bound` for lock-step placements,
    and (rate, fill) of `_share_rate_bound` for group-pure pipelines with uneven shares."""
    stage_times, counts, per_group = _distinct_stage_times(pricer, cand, ranges, groups, cache)
    capacity = {g: replica_capacity(pricer.groups[g], cand.tp_of(g), cand.cp) for g in groups}
    big_u, total = _stage_bound(stage_times, counts, capacity, cand.dp)
    if cand.group_tp:  # group-pure placements only
        big_u = total = math.inf
    rate, fill = _share_rate_bound(per_group, capacity, cand.pp, cand.dp)
    return big_u, total, rate, fill


def _share_rate_bound(
    per_group: Mapping[str, tuple[float, float]],
    capacity: Mapping[str, int],
    pp: int,
    dp: int,
) -> tuple[float, float]:
    """(rate, fill) such that every group-pure placement with uneven shares has a pipeline term
    of at least M / rate + fill * c (M micro-batches in all, c the schedule's fill coefficient,
    `Candidate.fill`): a group's pipelines run at best one micro-batch per U_g (its slowest
    stage), so M <= T * sum_g n_g / U_g, and the best sum_g n_g / U_g over n_g <= R[g] // pp,
    sum_g n_g = dp fills the fastest groups first; every pipeline also pays at least the
    smallest fill (S_g - U_g) c. (0, inf) when the groups cannot hold dp pipelines or fewer
    than two groups can host one."""
    hosts = [g for g in per_group if capacity[g] >= pp and per_group[g][0] > 0]
    if len(hosts) < 2:
        return 0.0, math.inf
    rate, left = 0.0, dp
    for g in sorted(hosts, key=lambda g: (per_group[g][0], g)):
        take = min(left, capacity[g] // pp)
        rate += take / per_group[g][0]
        left -= take
        if not left:
            break
    if left:
        return 0.0, math.inf
    fill = min(per_group[g][1] - per_group[g][0] for g in hosts)
    return rate, fill


def _pipeline_bound(big_u: float, total: float, m: int, fill: float) -> float:
    """m U + fill (S - U) (fill = 1 / v, or 0 under ZB-V), increasing in U and S, so it bounds
    with lower bounds of both (infinite when the groups cannot hold the replicas)."""
    if math.isinf(big_u) or math.isinf(total):
        return math.inf
    return m * big_u + (total - big_u) * fill


def _exposed_and_optimizer(t: PlanTables, allowed: list[list[str]], crossing: int = 0) -> float:
    """Lower bound of rep * exposed DP traffic + optimizer: each at its cheapest allowed group
    (pair). `crossing` > 0: every stage's replicas span two groups, that many stages at once
    (group-pure pipelines in several groups), so only cross-group rings count."""
    dp, cap = t.parallel.dp, t.replica_capacity
    # Stages that must span groups: a group-pure stage needs dp replicas in one group, so at
    # most sum_g floor(R[g] / dp) stages are group-pure and the rest cross (their DP rings
    # share the links between groups: `CrossTraffic.time(k)` rises with k).
    forced = crossing or max(0, t.pp - sum(cap[g] // dp for g in t.groups))
    exposed = 0.0
    crossing_lb: list[float] = []
    for s in range(t.pp):
        window = max(t.window[s][g] for g in allowed[s])

        def expose(comm: float) -> float:
            return comm - OVERLAP_EFFICIENCY * min(comm, window)

        single = math.inf
        if not crossing:
            single = min((t.dp_single[s][g] for g in allowed[s] if cap[g] >= dp), default=math.inf)
        pairs = [(a, b) for a, b in t.dp_cross[s] if a in allowed[s] and b in allowed[s]]
        cross = min((t.dp_cross[s][k].time(max(1, forced)) for k in pairs), default=math.inf)
        comm = min(single, cross)
        if math.isinf(comm):
            return math.inf
        exposed = max(exposed, expose(comm))
        crossing_lb.append(expose(cross))
    if 0 < forced <= t.pp:  # the forced-th cheapest crossing stage is among those that cross
        exposed = max(exposed, sorted(crossing_lb)[forced - 1])
    opt = max(min(t.optimizer[s][g] for g in allowed[s]) for s in range(t.pp))
    return t.rep * exposed + opt


def _lower_bound(t: PlanTables, allowed: list[list[str]]) -> float:
    """A lower bound on `evaluate(t, placement)` over every lock-step placement that respects
    memory and capacity: stage times by `_stage_bound`, boundaries, DP traffic and optimizer
    at their cheapest allowed group (pair)."""
    pp, m, v = t.pp, t.m, t.chunks
    stage_times = [{g: t.time[s][g].total for g in allowed[s]} for s in range(pp)]
    big_u, total = _stage_bound(stage_times, [1] * pp, t.replica_capacity, t.parallel.dp)
    p2p = max(
        (min(t.p2p[s][(a, b)] for a in allowed[s] for b in allowed[s + 1]) for s in range(pp - 1)),
        default=0.0,
    )
    z = max(min(t.bubble_unit(s, g) for g in allowed[s]) for s in range(pp))
    return (
        _pipeline_bound(big_u, total, m, t.fill)
        + (pp - 1) * z
        + (m * v + pp - 1) * p2p
        + _exposed_and_optimizer(t, allowed)
    )


def _share_hosts(t: PlanTables, allowed: list[list[str]]) -> list[str]:
    """Groups that can host whole pipelines: every stage fits and pp replicas fit."""
    return [
        g
        for g in t.groups
        if all(g in allowed[s] for s in range(t.pp)) and t.replica_capacity[g] >= t.pp
    ]


def _share_cap(t: PlanTables) -> int:
    """The largest per-replica micro-batch count that keeps every stage's in-flight activations
    (hence `t.fits`) as they are: unbounded where the schedule's warm-up depth is saturated."""
    p, big = t.parallel, 1 << 30
    same = all(
        in_flight_microbatches(p.schedule, s, t.pp, big, t.chunks)
        == in_flight_microbatches(p.schedule, s, t.pp, t.m, t.chunks)
        for s in range(t.pp)
    )
    return big if same else t.m


def _share_terms(t: PlanTables, g: str) -> tuple[float, float]:
    """(slope, const) of group g's pipeline term f_g(m) = slope * m + const."""
    pp, v = t.pp, t.chunks
    us = [t.time[s][g].total for s in range(pp)]
    p2p = max((t.p2p[s][(g, g)] for s in range(pp - 1)), default=0.0)
    z = max(t.bubble_unit(s, g) for s in range(pp))
    big_u = max(us)
    return big_u + v * p2p, (sum(us) - big_u) * t.fill + (pp - 1) * (p2p + z)


def _share_bound(t: PlanTables, allowed: list[list[str]]) -> float:
    """A lower bound on `evaluate` over group-pure placements with uneven shares (infinite
    when there are none): `_share_rate_bound` over the host groups plus the DP and optimizer
    bounds."""
    if t.parallel.zero == 3 or (_share_cap(t) <= t.m and not t.group_tp):
        return math.inf
    hosts = _share_hosts(t, allowed)
    terms = {g: _share_terms(t, g) for g in hosts}
    per_group = {g: (a, b + a) for g, (a, b) in terms.items()}  # (U_g, S_g) with v = 1
    rate, _ = _share_rate_bound(per_group, t.replica_capacity, t.pp, t.parallel.dp)
    if rate <= 0:
        return math.inf
    fill = min(terms[g][1] for g in hosts)
    return t.parallel.dp * t.m / rate + fill + _exposed_and_optimizer(t, allowed, t.pp)


def _pair_shares(
    fa: tuple[float, float],
    fb: tuple[float, float],
    na: int,
    nb: int,
    total: int,
    cap: int,
    runs: Callable[[int], bool] = lambda m: True,
) -> tuple[int, int] | None:
    """Integer (m_a, m_b) >= 1, <= cap, both counts the schedule runs (`runs`,
    `ir.microbatch_problem`), with na m_a + nb m_b = total minimising max(fa(m_a), fb(m_b))
    for increasing linear fa, fb: the feasible m_a nearest the crossing point on either side
    (divisibility alone repeats every nb / gcd(na, nb); `runs` may skip further)."""
    (sa, ca), (sb, cb) = fa, fb
    lo = max(1, -(-(total - nb * cap) // na))
    hi = min(cap, (total - nb) // na)
    if lo > hi:
        return None
    x = (sb * total / nb + cb - ca) / (sa + sb * na / nb)

    def feasible(ma: int) -> bool:
        rest = total - na * ma
        return rest % nb == 0 and runs(ma) and runs(rest // nb)

    picks = []
    down = min(hi, max(lo, math.floor(x)))
    picks += [next((ma for ma in range(down, lo - 1, -1) if feasible(ma)), None)]
    up = max(lo, min(hi, math.ceil(x)))
    picks += [next((ma for ma in range(up, hi + 1) if feasible(ma)), None)]
    picks = [ma for ma in picks if ma is not None]
    if not picks:
        return None
    ma = min(picks, key=lambda a: (max(sa * a + ca, sb * ((total - na * a) // nb) + cb), a))
    return ma, (total - na * ma) // nb


def _share_placements(t: PlanTables, allowed: list[list[str]], prune: bool = True):
    """Group-pure placements with uneven shares: ([(placement, shares)], exact).

    For every pair of host groups (a, b) and n_a + n_b = dp pipelines, the best shares come
    from `_pair_shares` (counts the schedule runs only). With `prune` (objectives that rank
    by step time) the n_a are visited in order of their continuous bound
    T(n_a) = (M + sum_g n_g c_g / s_g) / (sum_g n_g / s_g)
    and the visit stops once T(n_a) reaches the best integer pipeline term found: exact for
    every pair. Without it (cost: the group mix changes the price) every n_a is tried up to
    dp = SHARE_EXHAUSTIVE_DP, a window around the fastest-first split beyond. `exact` says that
    every group-pure placement was covered (at most two host groups, no window)."""
    if t.parallel.zero == 3:
        return [], True
    cap = _share_cap(t)
    if cap <= t.m and not t.group_tp:  # per-group TP: equal shares (cap = m) still count
        return [], True
    hosts = _share_hosts(t, allowed)
    if len(hosts) < 2:
        return [], True
    dp, pp, total = t.parallel.dp, t.pp, t.parallel.dp * t.m
    terms = {g: _share_terms(t, g) for g in hosts}
    schedule = t.parallel.schedule

    def runs(m: int) -> bool:
        return microbatch_problem(schedule, pp, m) is None

    out = []
    exact = len(hosts) == 2 and (prune or dp <= SHARE_EXHAUSTIVE_DP)
    ep = t.parallel.ep or 1
    for a, b in itertools.combinations(hosts, 2):
        (sa, ca), (sb, cb) = terms[a], terms[b]
        ra, rb = t.replica_capacity[a] // pp, t.replica_capacity[b] // pp
        lo, hi = max(1, dp - rb), min(dp - 1, ra)
        if lo > hi:
            continue
        if prune:
            order = sorted(
                range(lo, hi + 1),
                key=lambda na: (
                    (total + na * ca / sa + (dp - na) * cb / sb) / (na / sa + (dp - na) / sb),
                    na,
                ),
            )
        elif dp <= SHARE_EXHAUSTIVE_DP:
            order = list(range(lo, hi + 1))
        else:
            centre = hi if sa <= sb else lo
            order = list(range(max(lo, centre - SHARE_WINDOW), min(hi, centre + SHARE_WINDOW) + 1))
        best_pipe = math.inf
        for na in order:
            nb = dp - na
            if na % ep:  # an ep group's all-to-alls need one share: inside one group
                continue
            if prune:
                bound = (total + na * ca / sa + nb * cb / sb) / (na / sa + nb / sb)
                if bound >= best_pipe * (1 - 1e-12):
                    break
            got = _pair_shares(terms[a], terms[b], na, nb, total, cap, runs)
            if got is None:
                continue
            pipe = max(sa * got[0] + ca, sb * got[1] + cb)
            if prune and pipe >= best_pipe:
                continue
            best_pipe = min(best_pipe, pipe)
            placement = [[(a, na), (b, nb)] for _ in range(pp)]
            out.append((placement, {a: got[0], b: got[1]}))
    return out, exact


def _largest_stage(pricer: Pricer, c: Candidate, ranges, global_batch: int) -> tuple[int, int]:
    """(peak bytes, stage) of the stage needing the most memory, without building tables: per
    distinct stage composition, its first stage holds the most micro-batches."""
    m = global_batch // (c.dp * c.micro_batch)
    worst, seen = (0, 0), set()
    for s, (first, last) in enumerate(ranges):
        comp = pricer.costs.composition(first, last)
        if comp in seen:
            continue
        seen.add(comp)
        mem = _stage_memory(pricer, comp, c)
        held = in_flight_microbatches(c.schedule, s, len(ranges), m, c.virtual_stages)
        peak, _ = mem.peak(held)
        worst = max(worst, (peak, s))
    return worst


def _greedy_placements(t: PlanTables, allowed: list[list[str]], order: Sequence[str]):
    """Warm-start placements: (1) rank order over the groups as listed, fastest first and
    slowest first (as the splits of `_splits` assume); (2) heaviest stage first, each into its
    fastest group that can hold all its replicas, else split fastest first; (3) everything in
    one group when that group holds it all."""
    dp, pp = t.parallel.dp, t.pp

    def fill(stage_order, group_order_of):
        free = dict(t.replica_capacity)
        out: list[list[tuple[str, int]] | None] = [None] * pp
        for s in stage_order:
            groups = [g for g in group_order_of(s) if g in allowed[s]]
            whole = [g for g in groups if free[g] >= dp]
            if whole:
                out[s] = [(whole[0], dp)]
                free[whole[0]] -= dp
                continue
            want, reps = dp, []
            for g in groups:
                take = min(want, free[g])
                if take:
                    reps.append((g, take))
                    free[g] -= take
                    want -= take
                if not want:
                    break
            if want:
                return None
            out[s] = reps
        return out

    speed = sorted(order, key=lambda g: (sum(t.time[s][g].total for s in range(pp)), g))
    tries = [fill(range(pp), lambda s, o=o: o) for o in (list(order), speed, speed[::-1])]
    heavy = sorted(range(pp), key=lambda s: -max(t.time[s][g].total for g in allowed[s]))
    tries.append(fill(heavy, lambda s: sorted(order, key=lambda g: t.time[s][g].total)))
    for g in order:
        tries.append(fill(range(pp), lambda s, g=g: [g]))
    out = []
    for p in tries:
        if p is not None and p not in out:
            out.append(p)
    return out


Placement = list[list[tuple[str, int]]]


class _Scorer:
    """The objective in numbers: a placement's score (step seconds, or dollars per step for
    "cost") and the factor that turns a step-time bound into a score bound."""

    def __init__(self, objective: Objective, cluster: Cluster) -> None:
        self.cost = objective.kind == "cost"
        self.price = objective.price_per_gpu_s(cluster) if self.cost else {}
        self.uniform = len(set(self.price.values())) <= 1

    def score(self, c: Candidate, step: float, placement: Placement) -> float:
        """Objective value of a placed plan with this step time."""
        if not self.cost:
            return step
        return step * sum(
            c.tp_of(g) * c.cp * n * self.price[g] for reps in placement for g, n in reps
        )

    def factor(self, c: Candidate, capacity: Mapping[str, int]) -> float:
        """Score per second of step time at best: the cheapest GPUs that could hold c."""
        if not self.cost:
            return 1.0
        left, rate = c.pp * c.dp, 0.0
        for g in sorted(capacity, key=lambda g: (self.price[g], g)):
            take = min(left, capacity[g])
            rate += take * c.tp_of(g) * c.cp * self.price[g]
            left -= take
        return rate


@dataclass(slots=True)
class _Priced:
    cand: Candidate
    layers: tuple[int, ...]
    tables: PlanTables
    allowed: list[list[str]]  # [stage] groups whose memory fits and that can hold a replica
    lower: float  # score bound of every placement (lock-step or with shares)
    lock_lower: float  # score bound of lock-step placements
    share_open: float  # score bound of share placements not searched exactly (inf: none)
    greedy_placement: Placement | None  # best lock-step warm start
    greedy_score: float
    best: tuple[float, Placement, dict | None] | None = None  # (score, placement, shares)
    factor: float = 1.0


def _screen(
    pricer: Pricer,
    graph: Graph,
    cands: list[Candidate],
    global_batch: int,
    work: _Work,
    until: float,
    scorer: _Scorer,
    limit: float,
    say,
    incumbent: float = math.inf,
) -> tuple[list[_Priced], int, int, tuple | None, float]:
    """Price (candidate, split) pairs in bound order until the bound passes the best plan.

    Returns (priced pairs that may still win, pairs bounded, pairs priced in full, the
    smallest memory need (bytes, stage, candidate) when nothing fits, the bound of the first
    pair left unpriced when the budget cut the screen short, else infinity). Every step is
    charged to `work`; the screen stops once `until` work units are spent (or at the safety
    net) and some plan is known. Pairs whose bound exceeds `limit` are dropped (min_gpus: the
    target step time)."""
    cluster = pricer.cluster
    order = [g.name for g in cluster.groups]
    n_layers = len(graph.layer_units)
    ranges_of: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
    splits_of: dict[tuple, list[tuple[int, ...]]] = {}
    bound_of: dict[tuple, tuple[float, float, float, float]] = {}
    groups_of: dict[tuple[int, int], list[str]] = {}
    factor_of: dict[tuple, float] = {}
    cache: dict = {}

    def groups_for(c: Candidate) -> list[str]:
        key = (c.tp, c.cp, c.group_tp)
        got = groups_of.get(key)
        if got is None:
            named = dict(c.group_tp)
            got = groups_of[key] = [
                g
                for g in order
                if (not named or g in named)
                and replica_capacity(pricer.groups[g], c.tp_of(g), c.cp)
            ]
        return got

    def capacity_of(c: Candidate) -> dict[str, int]:
        return {g: replica_capacity(pricer.groups[g], c.tp_of(g), c.cp) for g in groups_for(c)}

    def too_big(c: Candidate, need_of: Callable[[Candidate], tuple[int, int]]):
        """(bytes, stage) that c needs where it fits on no GPU it may use, else None;
        `need_of(candidate)` gives a homogeneous candidate's need (per-group TP: each group's
        at its own tp, and both must host pipelines)."""
        if not c.group_tp:
            need = need_of(c)
            top = max(pricer.groups[g].gpu.memory_bytes for g in groups_for(c))
            return need if need[0] > top else None
        for g, _ in c.group_tp:
            need = need_of(c.view(g))
            if need[0] > pricer.groups[g].gpu.memory_bytes:
                return need
        return None

    # Best-first over candidates, then over their splits: a candidate enters with a bound that
    # holds for every split (`_split_free_bound`) and is expanded into (candidate, split) pairs
    # with their own bounds only when it reaches the front.
    # Candidates that differ only in ZeRO stage and schedule form a family, bounded once by its
    # loosest member (the least fill, ZeRO <= 2 when there is one: `_split_free_bound` is
    # increasing in the fill and only ZeRO <= 2 gets the share bound) and expanded into its
    # members when it reaches the front. Ties break by enumeration order (deterministic).
    families: dict[tuple, list[tuple[int, Candidate]]] = {}
    for i, c in enumerate(cands):
        fam = (c.tp, c.cp, c.pp, c.dp, c.ep, c.micro_batch, c.recompute, c.sequence_parallel)
        families.setdefault(fam + (c.quantize_activations, c.group_tp), []).append((i, c))
    heap = []

    def bounded(c: Candidate) -> tuple[float, float] | None:
        """(bound x factor, factor) of c, or None when it cannot win (`limit`)."""
        work.charge("bound")
        groups = groups_for(c)
        m = global_batch // (c.dp * c.micro_batch)
        lb = _split_free_bound(pricer, c, groups, m, cache)
        if math.isinf(lb) or lb > limit * (1 + 1e-9):
            return None
        fkey = (c.tp, c.cp, c.pp, c.dp, c.group_tp)
        factor = factor_of.get(fkey)
        if factor is None:
            factor = factor_of[fkey] = scorer.factor(c, capacity_of(c))
        return lb * factor, factor

    for members in families.values():
        loosest = min(members, key=lambda ic: (ic[1].fill, ic[1].zero > 2, ic[0]))[1]
        got = bounded(loosest)
        if got is not None:
            heap.append((got[0], members[0][0], None, members, got[1]))
    # Megatron-style warm starts go first (bound -1): a strong incumbent early prunes the rest.
    top_memory = max(g.gpu.memory_bytes for g in cluster.groups)

    def may_fit(c: Candidate) -> bool:
        return _split_free_memory(pricer, c, n_layers, cache) <= top_memory

    index = {id(c): i for i, c in enumerate(cands)}
    for c in _megatron_seeds(cands, may_fit):
        base, extra = divmod(n_layers, c.pp)
        even = tuple(base + (1 if s < extra else 0) for s in range(c.pp))
        ranges_of.setdefault(even, stages_of(graph, even))
        fkey = (c.tp, c.cp, c.pp, c.dp, c.group_tp)
        if fkey not in factor_of:
            factor_of[fkey] = scorer.factor(c, capacity_of(c))
        heap.append((-1.0, index[id(c)], even, c, factor_of[fkey]))
    heapq.heapify(heap)
    say(f"bounded {len(cands)} configurations in {len(families)} families; pricing in bound order")
    done: set[tuple[Candidate, tuple[int, ...]]] = set()

    best = incumbent
    kept: list[_Priced] = []
    priced = pairs = 0
    smallest: tuple[int, int, Candidate] | None = None  # (bytes, stage, candidate)
    cut = math.inf
    while heap:
        lb0, sort_key, split, c, factor = heapq.heappop(heap)
        if lb0 > best * (1 + 1e-9):
            break
        # Past the budget, stop once there is a plan to return. Without one, go on: the
        # memory check below makes pricing a candidate that fits nowhere cheap.
        if lb0 >= 0 and math.isfinite(best) and work.exhausted(until):
            cut = lb0
            break
        if split is None:  # a family: bound and queue its members
            for i, member in c:
                got = bounded(member)
                if got is not None:
                    heapq.heappush(heap, (got[0], i, (), member, got[1]))
            continue
        groups = groups_for(c)
        if not split:  # expand the candidate into its splits
            work.charge("memory")
            need = too_big(c, lambda x: (_split_free_memory(pricer, x, n_layers, cache), x.pp - 1))
            if need is not None:
                if smallest is None or need[0] < smallest[0]:
                    smallest = (*need, c)
                continue  # no split fits: some stage holds ceil(L / pp) layers
            skey = (c.tp, c.cp, c.ep, c.sequence_parallel, c.pp, c.dp, c.micro_batch)
            skey += (c.recompute, c.group_tp)
            chunked = c.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)
            # a chunked schedule's split is its chunk layout's (`_splits`): per schedule and v
            skey += ((c.schedule, c.virtual_stages) if chunked else None,)
            splits = splits_of.get(skey)
            if splits is None:
                splits = splits_of[skey] = _splits(pricer, c, groups, n_layers, cache)
            m = global_batch // (c.dp * c.micro_batch)
            for sp_ in splits:
                ranges = ranges_of.get(sp_)
                if ranges is None:
                    ranges = ranges_of[sp_] = stages_of(graph, sp_)
                # zero does not change stage times, and the bound is linear in m
                bkey = (*skey[:-1], sp_)
                ab = bound_of.get(bkey)
                if ab is None:
                    work.charge("split")
                    ab = bound_of[bkey] = _memory_free_bound(pricer, c, ranges, groups, cache)
                big_u, total, rate, fill = ab
                lb = _pipeline_bound(big_u, total, m, c.fill)
                if c.zero <= 2 and rate > 0:
                    lb = min(lb, c.dp * m / rate + fill * c.fill)
                if math.isinf(lb) or lb > limit * (1 + 1e-9):
                    continue
                pairs += 1
                heapq.heappush(heap, (lb * factor, sort_key, sp_, c, factor))
            continue
        if (c, split) in done:
            continue  # a warm start priced already
        done.add((c, split))
        ranges = ranges_of[split]
        work.charge("memory")
        need = too_big(c, lambda x: _largest_stage(pricer, x, ranges, global_batch))
        if need is not None:
            if smallest is None or need[0] < smallest[0]:
                smallest = (*need, c)
            continue  # some stage fits on no GPU: no tables needed to know
        priced += 1
        if c.group_tp:
            t = hetero_tables(pricer, c.parallel(global_batch), ranges, dict(c.group_tp))
        else:
            t = plan_tables(pricer, c.parallel(global_batch), ranges, groups)
        work.charge("cell", t.pp * len(groups))
        allowed = [[g for g in groups if t.fits[s][g]] for s in range(t.pp)]
        if any(not a for a in allowed):
            continue
        # per-group TP: group-pure pipelines only (no lock-step placement)
        lock_lower = math.inf if c.group_tp else _lower_bound(t, allowed) * factor
        share_lower = _share_bound(t, allowed) * factor
        lower = min(lock_lower, share_lower)
        if lower > best * (1 + 1e-9):
            continue
        pr = _Priced(c, split, t, allowed, lower, lock_lower, math.inf, None, math.inf)
        pr.factor = factor
        for pl in [] if c.group_tp else _greedy_placements(t, allowed, order):
            work.charge("placement")
            sc = scorer.score(c, evaluate(t, pl).step_time_s, pl)
            if sc < pr.greedy_score:
                pr.greedy_placement, pr.greedy_score = pl, sc
        if pr.greedy_placement is not None:
            pr.best = (pr.greedy_score, pr.greedy_placement, None)
        if share_lower < (pr.best[0] if pr.best else math.inf) * (1 - 1e-9):
            options, exact = _share_placements(t, allowed, prune=not scorer.cost)
            work.charge("placement", len(options))
            for pl, shares in options:
                sc = scorer.score(c, evaluate(t, pl, shares).step_time_s, pl)
                if pr.best is None or sc < pr.best[0] * (1 - 1e-12):
                    pr.best = (sc, pl, shares)
            if not exact:
                pr.share_open = share_lower
        if pr.best is not None:
            best = min(best, pr.best[0])
        kept.append(pr)
    kept = [k for k in kept if k.lower <= best * (1 + 1e-9)]
    kept.sort(key=lambda k: (k.lower, k.best[0] if k.best else math.inf, k.cand.sort_key))
    return kept, pairs, priced, smallest, cut


# ---------------------------------------------------------------------------------------------
# Steps 3-5: variables, constraints, objective
# ---------------------------------------------------------------------------------------------


class _Scale:
    """Seconds -> integer time units (`UNITS_PER_STEP` units for the reference step time)."""

    def __init__(self, reference_s: float) -> None:
        self.unit = max(reference_s, 1e-12) / UNITS_PER_STEP

    def __call__(self, seconds: float) -> int:
        return max(0, round(seconds / self.unit))


class _PlacementModel:
    """The model of the module docstring restricted to one (candidate, split): lock-step
    placements, objective min T (step seconds)."""

    def __init__(self, pr: _Priced, cluster: Cluster, scale: _Scale, cutoff_s: float) -> None:
        self.m = cp_model.CpModel()
        self.pr, self.t, self.cluster, self.q = pr, pr.tables, cluster, scale
        eta = Fraction(OVERLAP_EFFICIENCY).limit_denominator(1000)
        self.eta_num, self.eta_den = eta.numerator, eta.denominator
        self.hi = self._upper()
        self.variables()
        self.replicas()
        self.capacity()
        t, v = self.t, self.t.chunks
        if t.zero_bubble:  # m U + (pp - 1) Z + (2 m + pp - 1) P + rep E + O, T >= it
            step_v = (
                t.m * self.stage_times()
                + (t.pp - 1) * self.bubble()
                + (t.m * v + t.pp - 1) * self.boundaries()
                + t.rep * self.data_parallel()
                + self.optimizer()
            )
            v = 1
        else:
            step_v = (
                (v * t.m - 1) * self.stage_times()
                + sum(self.us)
                + v * (t.m * v + t.pp - 1) * self.boundaries()
                + v * t.rep * self.data_parallel()
                + v * self.optimizer()
            )
        self.step_time(step_v, cutoff_s, v)
        self.m.Minimize(self.T)

    def _upper(self) -> int:
        """An upper bound on the step time in units (variable domains)."""
        t, q = self.t, self.q
        big_u = max(max(x.total for x in row.values()) for row in t.time)
        p2p = max((max(row.values()) for row in t.p2p), default=0.0)
        comm = 0.0
        for s in range(t.pp):
            comm = max(comm, max(t.dp_single[s].values(), default=0.0))
            comm = max([comm] + [ct.time(t.pp) for ct in t.dp_cross[s].values()])
        opt = max(max(row.values()) for row in t.optimizer)
        pipe = (t.m + t.pp) * big_u + (t.m * t.chunks + t.pp - 1) * p2p
        return q(pipe + t.rep * comm + opt) + 1

    def variables(self) -> None:
        """n[s,g], b[s,g] only where stage s fits in g's memory (the memory family), T."""
        self.n: list[dict[str, cp_model.IntVar]] = []
        self.b: list[dict[str, cp_model.IntVar]] = []
        dp = self.pr.cand.dp
        for s in range(self.t.pp):
            self.n.append(
                {
                    g: self.m.NewIntVar(0, min(dp, self.t.replica_capacity[g]), f"n[{s},{g}]")
                    for g in self.pr.allowed[s]
                }
            )
            self.b.append({g: self.m.NewBoolVar(f"b[{s},{g}]") for g in self.pr.allowed[s]})
        self.T = self.m.NewIntVar(0, self.hi, "T")

    def replicas(self) -> None:
        """sum_g n[s,g] = dp;  b = (n >= 1)."""
        dp = self.pr.cand.dp
        for s, n_s in enumerate(self.n):
            self.m.Add(sum(n_s.values()) == dp).WithName(f"replicas[{s}]")
            for g, n in n_s.items():
                self.m.Add(n >= self.b[s][g])
                self.m.Add(n <= min(dp, self.t.replica_capacity[g]) * self.b[s][g])

    def capacity(self) -> None:
        """sum_s tp * cp * n[s,g] <= GPUs of g."""
        per = self.pr.cand.tp * self.pr.cand.cp
        for g in self.cluster.groups:
            terms = [per * n_s[g.name] for n_s in self.n if g.name in n_s]
            if terms:
                self.m.Add(sum(terms) <= g.num_gpus).WithName(f"capacity[{g.name}]")

    def stage_times(self) -> cp_model.IntVar:
        """us[s] >= u[s,g] * b[s,g];  U >= us[s]. Returns U."""
        t, q, m = self.t, self.q, self.m
        self.us = [m.NewIntVar(0, self.hi, f"us[{s}]") for s in range(t.pp)]
        big_u = m.NewIntVar(0, self.hi, "U")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                m.Add(self.us[s] >= q(t.time[s][g].total) * bv).WithName(f"stage_time[{s},{g}]")
            m.Add(big_u >= self.us[s])
        return big_u

    def bubble(self) -> cp_model.IntVar:
        """ZB-V only: Z >= z[s,g] * b[s,g] (`StageTime.zb_bubble`). Returns Z."""
        t, q, m = self.t, self.q, self.m
        big_z = m.NewIntVar(0, self.hi, "Z")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                v = q(t.bubble_unit(s, g))
                if v:
                    m.Add(big_z >= v * bv).WithName(f"bubble[{s},{g}]")
        return big_z

    def boundaries(self) -> cp_model.IntVar:
        """P >= q[s,a,b] * (b[s,a] + b[s+1,b] - 1). Returns P."""
        t, q, m = self.t, self.q, self.m
        p2p = m.NewIntVar(0, self.hi, "P")
        for s in range(t.pp - 1):
            for a, ba in self.b[s].items():
                for c, bc in self.b[s + 1].items():
                    v = q(t.p2p[s][(a, c)])
                    if v:
                        m.Add(p2p >= v * (ba + bc - 1)).WithName(f"boundary[{s},{a},{c}]")
        return p2p

    def data_parallel(self) -> cp_model.IntVar:
        """cross, k, comm, W and E >= comm - eta * min(comm, W) (see the docstring). Returns E."""
        t, q, m, b = self.t, self.q, self.m, self.b
        cross: list[cp_model.IntVar | None] = []
        for s, b_s in enumerate(b):
            if len(b_s) < 2:
                cross.append(None)
                continue
            cv = m.NewBoolVar(f"cross[{s}]")
            m.Add(cv <= sum(b_s.values()) - 1)
            gs = list(b_s)
            for j, a in enumerate(gs):
                for c in gs[j + 1 :]:
                    m.Add(cv >= b_s[a] + b_s[c] - 1)
            cross.append(cv)
        k = m.NewIntVar(0, t.pp, "k")
        m.Add(k == sum(cv for cv in cross if cv is not None))
        exposed = m.NewIntVar(0, self.hi, "E")
        for s, b_s in enumerate(b):
            comm = m.NewIntVar(0, self.hi, f"comm[{s}]")
            for g, bv in b_s.items():
                v = q(t.dp_single[s][g])
                if v:
                    expr = v * bv - (v * cross[s] if cross[s] is not None else 0)
                    m.Add(comm >= expr).WithName(f"dp_single[{s},{g}]")
            order = [g for g in t.groups if g in b_s]
            for j, a in enumerate(order):
                for c in order[j + 1 :]:
                    ct = t.dp_cross[s][(a, c)]
                    both = b_s[a] + b_s[c] - 1
                    # Raw or coded traffic (`CrossTraffic.coded`): comm covers the one chosen.
                    pieces: list = [(ct, [])]
                    if ct.coded is not None:
                        z = m.NewBoolVar(f"coded[{s},{a},{c}]")
                        pieces = [(ct, [z.Not()]), (ct.coded, [z])]
                    for piece, when in pieces:
                        m.Add(comm >= q(piece.unshared) * both).WithName(
                            f"dp_cross[{s},{a},{c}]"
                        ).OnlyEnforceIf(when)
                        if piece.per_stage is not None:
                            lat, per = q(piece.latency), q(piece.per_stage)
                            big_m = lat + per * t.pp
                            m.Add(comm >= lat + per * k - big_m * (1 - both)).OnlyEnforceIf(when)
            window = m.NewIntVar(0, self.hi, f"W[{s}]")
            m.AddMaxEquality(window, [q(t.window[s][g]) * bv for g, bv in b_s.items()])
            # E >= comm - eta * min(comm, W) = max(comm - eta * W, (1 - eta) * comm)
            m.Add(self.eta_den * exposed >= self.eta_den * comm - self.eta_num * window)
            m.Add(self.eta_den * exposed >= (self.eta_den - self.eta_num) * comm)
        return exposed

    def optimizer(self) -> cp_model.IntVar:
        """O >= o[s,g] * b[s,g]. Returns O."""
        opt = self.m.NewIntVar(0, self.hi, "O")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                self.m.Add(opt >= self.q(self.t.optimizer[s][g]) * bv)
        return opt

    def step_time(self, step_v, cutoff_s: float, v: int) -> None:
        """v T >= v * step time; T <= the incumbent (a placement that cannot beat it is
        useless)."""
        self.m.Add(v * self.T >= step_v).WithName("step_time")
        if math.isfinite(cutoff_s):
            self.m.Add(self.T <= self.q(cutoff_s) + 1).WithName("cutoff")

    def hint(self, placement: Placement) -> None:
        """Warm start from a greedy placement."""
        for s, n_s in enumerate(self.n):
            chosen = dict(placement[s])
            for g, nv in n_s.items():
                self.m.AddHint(nv, chosen.get(g, 0))
                self.m.AddHint(self.b[s][g], 1 if chosen.get(g, 0) else 0)

    def solve(self, work: _Work, share: float):
        """(status, placement or None, lower bound in seconds), spending at most `share` work
        units of `work` (at least CPSAT_MIN_DETERMINISTIC deterministic seconds).

        Deterministic: one worker and a fixed seed make CP-SAT follow one search path, and its
        limit is deterministic time (`max_deterministic_time`), which counts work, not
        seconds; the wall-clock limit is only the budget's safety net."""
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        solver.parameters.max_deterministic_time = max(
            CPSAT_MIN_DETERMINISTIC, share * CPSAT_DETERMINISTIC_PER_WORK
        )
        solver.parameters.max_time_in_seconds = work.seconds_left()
        status = solver.Solve(self.m)
        work.charge("cpsat", solver.deterministic_time)
        if status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
            work.past_deadline()  # stopped on the safety net rather than its own budget?
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            placement = [
                [(g, solver.Value(nv)) for g, nv in n_s.items() if solver.Value(nv)]
                for n_s in self.n
            ]
            return status, placement, solver.BestObjectiveBound() * self.q.unit
        return status, None, solver.BestObjectiveBound() * self.q.unit


# ---------------------------------------------------------------------------------------------
# Steps 3-4: solve the placement models, decode
# ---------------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """What `_search` found: the best (pair, placement, shares) and the search's accounting."""

    best: tuple[float, _Priced, Placement, dict | None] | None
    lowest_open: float
    pairs: int
    priced: int
    models: int
    smallest: tuple | None
    kept: list[_Priced] = field(default_factory=list)


def _search(
    pricer: Pricer,
    graph: Graph,
    cands: list[Candidate],
    global_batch: int,
    work: _Work,
    scorer: _Scorer,
    say,
    limit: float = math.inf,
    incumbent: float = math.inf,
) -> _Outcome:
    """Steps 2-3 of the module docstring over `cands`: screen, then placement models, until
    `work` is spent. `incumbent`: the score of a plan known from elsewhere
    (`_single_group_seed`); only pairs that can beat it are priced, and `best` stays None when
    none does."""
    # The screen gets two thirds of the work left and the placement models the rest; but the
    # screen goes on until it has found some plan (or shown that none fits).
    kept, pairs, priced, smallest, cut = _screen(
        pricer,
        graph,
        cands,
        global_batch,
        work,
        work.spent + work.left() * 2 / 3,
        scorer,
        limit,
        say,
        incumbent,
    )
    best: tuple[float, _Priced, Placement, dict | None] | None = None

    def better(score: float, pr: _Priced) -> bool:
        """Better, or as good (to 1e-9) with less memory (e.g. ZeRO-2 over ZeRO-1)."""
        if best is None or score < best[0] * (1 - 1e-9):
            return True
        return score <= best[0] * (1 + 1e-9) and _peak(pr) < _peak(best[1])

    for pr in kept:
        if pr.best is not None and pr.best[0] < incumbent and better(pr.best[0], pr):
            best = (pr.best[0], pr, pr.best[1], pr.best[2])
    open_bounds: list[float] = [pr.share_open for pr in kept]
    models = 0
    seed = incumbent
    for i, pr in enumerate(kept):
        incumbent = min(best[0] if best else math.inf, seed)
        if pr.lower >= incumbent * (1 - 1e-9):
            break  # sorted by bound: nothing further can win
        if pr.lock_lower >= incumbent * (1 - 1e-9):
            continue  # only share placements could win, and those were searched
        if pr.greedy_placement is not None and pr.greedy_score <= pr.lock_lower * (1 + 1e-9):
            continue  # the warm start already meets this pair's bound
        if work.exhausted():
            open_bounds += [k.lower for k in kept[i:] if k.lower < incumbent]
            break
        if scorer.cost and not scorer.uniform:
            # min T is not min cost when groups differ in price: the warm starts and share
            # placements stand, and what they leave open counts in the gap.
            if pr.best is None or pr.best[0] > pr.lock_lower * (1 + 1e-9):
                open_bounds.append(pr.lock_lower)
            continue
        step_cut = incumbent / pr.factor if scorer.cost else incumbent
        if pr.greedy_placement is not None:
            reference = evaluate(pr.tables, pr.greedy_placement).step_time_s
        else:
            reference = step_cut if math.isfinite(step_cut) else 2 * pr.lock_lower / pr.factor
        # uniform prices: cost = step x price of the candidate's GPUs, so the step cut holds
        sub = _PlacementModel(pr, pricer.cluster, _Scale(reference), step_cut)
        work.charge("model", sum(len(n_s) for n_s in sub.n))
        if pr.greedy_placement is not None:
            sub.hint(pr.greedy_placement)
        status, placement, bound = sub.solve(work, work.left() / 2)
        models += 1
        if placement is not None:
            score = scorer.score(pr.cand, evaluate(pr.tables, placement).step_time_s, placement)
            if better(score, pr) and score < seed:
                best = (score, pr, placement, None)
        if status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
            open_bounds.append(max(pr.lock_lower, bound * pr.factor))
    lowest_open = min([cut, *open_bounds])
    return _Outcome(best, lowest_open, pairs, priced, models, smallest, kept)


def _decode(
    graph: Graph,
    cluster: Cluster,
    out: _Outcome,
    global_batch: int,
    dtype: str,
    comm: CommOptions | None = None,
    engine: Engine = EAGER,
) -> tuple[Parallel, tuple[StagePlacement, ...], Prediction]:
    """The best placement as `Parallel` + `StagePlacement`s, re-priced by `predict`."""
    assert out.best is not None
    _, pr, placement, shares = out.best
    group_tp = pr.cand.group_tp
    if shares and all(k == pr.tables.m for k in shares.values()) and not group_tp:
        shares = None  # equal shares: a lock-step placement
    order = [g.name for g in cluster.groups]
    stages = []
    for s, (a, b) in enumerate(pr.tables.ranges):
        reps = tuple(sorted(placement[s], key=lambda gn: order.index(gn[0])))
        micro = tuple((g, shares[g]) for g, _ in reps) if shares else ()
        tps = tuple((g, pr.cand.tp_of(g)) for g, _ in reps) if group_tp else ()
        stages.append(StagePlacement(s, a, b, reps, micro, group_tp=tps))
    parallel = pr.cand.parallel(global_batch)
    prediction = predict(
        graph, cluster, parallel, tuple(stages), dtype=dtype, comm=comm, engine=engine
    )
    assert prediction.fits, "solver placed a stage where it does not fit"
    return parallel, tuple(stages), prediction


def solve(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    *,
    global_batch: int,
    time_limit_s: float = 10.0,
    progress: Progress = None,
    dtype: str | None = None,
    export_model: str | None = None,
    objective: Objective | None = None,
    comm: CommOptions | None = None,
    quantize: bool = False,
    per_group_tp: bool = True,
    wall_limit_s: float | None = None,
    engine: Engine = EAGER,
) -> SolveResult:
    """The best configuration and placement that fits, honouring the fields of `pinned`.

    `comm`: what may be done to traffic (lossless coding, int8 gradients; each collective
    priced at its fastest allowed method, `cost_model.compression`); None: raw traffic.
    `quantize`: activation quantization (AGoQ) becomes a knob of the search, like recompute.
    `per_group_tp`: on clusters of several device groups, also search group-pure pipelines
    whose groups use different TP degrees (`Candidate.group_tp`). `engine`: price every
    candidate as that training stack runs it (`cost_model.engine`; default meshplan's eager
    runtime).

    `objective` (default throughput) as in the module docstring. Returns the plan re-priced by
    `predict`. `time_limit_s` is the search's work budget, in seconds of the reference
    machine (`_Work`, `WORK_COSTS`): deterministic, so identical inputs give the identical plan
    however loaded the machine is (a faster machine takes less time, a busier one more). It
    bounds the search once some plan is known (the first one is always looked for to the end);
    when it runs out the best plan so far comes back with status "feasible" and its relative
    gap. `wall_limit_s` is the safety net in real seconds (default WALL_SAFETY_FACTOR x
    `time_limit_s`, at least WALL_SAFETY_MIN_S more); a search stopped by it says so
    (`SolveResult.wall_clock_hit` and a note in the prediction: that plan may differ between
    runs). `export_model` writes the winning (configuration, split)'s
    placement model (CP-SAT text proto) for debugging. Raises InfeasibleError with the binding
    constraint and by how much when nothing fits.
    """
    objective = objective or Objective()
    start = time.perf_counter()
    work = _Work.starting_now(time_limit_s, wall_limit_s)
    work.charge("solve")
    say = progress or (lambda _msg: None)
    pricer = pricer_for(graph, cluster, dtype, comm, engine=engine)
    dtype = pricer.dtype  # None: the model's own (`simulate.compute_dtype`)
    cands = enumerate_candidates(
        graph, cluster, pinned, global_batch, quantize=quantize, per_group_tp=per_group_tp
    )
    work.charge("candidate", len(cands))
    say(f"enumerated {len(cands)} candidate configurations")
    tokens = global_batch * (graph.info.seq_len or 1)
    seed: SolveResult | None = None
    if objective.kind == "min_gpus":
        out = _min_gpus(pricer, graph, cands, global_batch, work, say, objective)
    else:
        scorer = _Scorer(objective, cluster)
        if objective.kind == "throughput" and len(cluster.groups) > 1:
            seed = _single_group_seed(
                graph, cluster, pinned, global_batch, work, dtype, comm, quantize
            )
        work.at_least(0.5)  # the main search gets some work whatever the seeds took
        out = _search(
            pricer,
            graph,
            cands,
            global_batch,
            work,
            scorer,
            say,
            incumbent=seed.prediction.step_time_s if seed else math.inf,
        )
    if out.best is None and seed is not None:
        optimal = out.lowest_open >= seed.prediction.step_time_s * (1 - 1e-9)
        gap = 0.0 if optimal else 1 - out.lowest_open / seed.prediction.step_time_s
        prediction = predict(
            graph, cluster, seed.parallel, seed.stages, dtype=dtype, comm=comm, engine=engine
        )
        return dataclasses.replace(
            seed,
            prediction=_with_wall_note(prediction, work, time_limit_s, say),
            status="optimal" if optimal and seed.status == "optimal" else "feasible",
            gap=max(gap, seed.gap),
            wall_s=time.perf_counter() - start,
            candidates=len(cands),
            explored=seed.explored + out.priced,
            placement_models=seed.placement_models + out.models,
            splits=seed.splits + out.pairs,
            work=work.spent,
            wall_clock_hit=work.wall_hit,
        )
    if out.best is None:
        raise InfeasibleError(_why_nothing_fits(out, cluster))
    parallel, stages, prediction = _decode(graph, cluster, out, global_batch, dtype, comm, engine)
    score, pr = out.best[0], out.best[1]
    say(f"priced {out.priced} (configuration, split) pairs, solved {out.models} placement models")
    if export_model and pr.cand.group_tp:
        say("per-group TP plan: group-pure placements have no CP-SAT model to export")
    elif export_model:
        _PlacementModel(pr, cluster, _Scale(prediction.step_time_s), math.inf).m.ExportToFile(
            export_model
        )
    optimal = out.lowest_open >= score * (1 - 1e-9)
    gap = 0.0 if optimal else (score - min(out.lowest_open, score)) / score
    value = {
        "throughput": prediction.step_time_s,
        "cost": score / tokens,
        "min_gpus": float(pr.cand.gpus),
    }[objective.kind]
    wall = time.perf_counter() - start
    say(
        f"{'optimal' if optimal else 'feasible'} plan in {wall:.2f} s ({work.spent:.2f} of "
        f"{time_limit_s:g} work units): {pr.cand.describe()}, "
        f"{prediction.step_time_s:.3f} s/step"
    )
    return SolveResult(
        parallel=parallel,
        stages=stages,
        prediction=_with_wall_note(prediction, work, time_limit_s, say),
        status="optimal" if optimal else "feasible",
        gap=gap,
        wall_s=wall,
        candidates=len(cands),
        explored=out.priced,
        placement_models=out.models,
        objective=objective.kind,
        objective_value=value,
        splits=out.pairs,
        work=work.spent,
        wall_clock_hit=work.wall_hit,
    )


def _with_wall_note(prediction: Prediction, work: _Work, budget: float, say) -> Prediction:
    """The prediction, with `WALL_CLOCK_NOTE` among its notes (so in the plan JSON and
    `Plan.explain()`) when the search stopped on its wall-clock safety net."""
    if not work.wall_hit:
        return prediction
    note = WALL_CLOCK_NOTE.format(wall=work.safety_s, budget=budget)
    say(note)
    return dataclasses.replace(prediction, notes=(*prediction.notes, note))


def _single_group_seed(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    global_batch: int,
    work: _Work,
    dtype: str,
    comm: CommOptions | None = None,
    quantize: bool = False,
) -> SolveResult | None:
    """The best plan inside one device group, over every group: the incumbent of a mixed
    cluster's search. A homogeneous group's bounds are exact, so each of these is quick, and a
    strong first incumbent prunes the (weaker-bounded) mixed placements early."""
    seed = None
    for g in cluster.groups:
        sub = dataclasses.replace(cluster, name=f"{cluster.name}/{g.name}", groups=(g,))
        sub = dataclasses.replace(sub, group_links=())
        try:
            r = solve(
                graph,
                sub,
                pinned,
                global_batch=global_batch,
                time_limit_s=0.6 * work.limit / len(cluster.groups),
                dtype=dtype,
                comm=comm,
                quantize=quantize,
                wall_limit_s=work.seconds_left(),
            )
        except (InfeasibleError, ValueError):
            continue
        work.absorb(r)
        if seed is None or r.prediction.step_time_s < seed.prediction.step_time_s:
            seed = r
    return seed


def _min_gpus(
    pricer: Pricer,
    graph: Graph,
    cands: list[Candidate],
    global_batch: int,
    work: _Work,
    say,
    objective: Objective,
) -> _Outcome:
    """Fewest GPUs meeting the target: a throughput search per GPU count, in increasing order,
    restricted to plans at least as fast as the target step time, all drawing on `work` (each
    count gets at least half a work unit)."""
    tokens = global_batch * (pricer.costs.graph.info.seq_len or 1)
    target_step = tokens / objective.target_tokens_per_s
    scorer = _Scorer(Objective(), pricer.cluster)
    by_gpus: dict[int, list[Candidate]] = {}
    for c in cands:
        if not c.group_tp:  # a per-group TP plan's GPU count depends on its placement
            by_gpus.setdefault(c.gpus, []).append(c)
    fastest: _Outcome | None = None
    pairs = priced = models = 0
    for gpus in sorted(by_gpus):
        work.at_least(0.5)
        out = _search(
            pricer,
            graph,
            by_gpus[gpus],
            global_batch,
            work,
            scorer,
            say,
            limit=target_step,
        )
        pairs, priced, models = pairs + out.pairs, priced + out.priced, models + out.models
        if out.best is not None and out.best[0] <= target_step * (1 + 1e-9):
            say(f"{gpus} GPUs meet {objective.target_tokens_per_s:,.0f} tokens/s")
            # The count is minimal; the step within it is optimal or carries its gap.
            return _Outcome(out.best, out.lowest_open, pairs, priced, models, None, out.kept)
        if out.best is not None and (fastest is None or out.best[0] < fastest.best[0]):
            fastest = out
    # Nothing meets the target: say how far the fastest plan is from it.
    work.at_least(5.0)
    full = _search(pricer, graph, cands, global_batch, work, scorer, say)
    if full.best is None:
        raise InfeasibleError(_why_nothing_fits(full, pricer.cluster))
    reach = tokens / full.best[0]
    need = objective.target_tokens_per_s
    raise InfeasibleError(
        f"no plan meets the target: the fastest plan ({full.best[1].cand.describe()}, "
        f"{full.best[1].cand.gpus} GPUs) reaches {reach:,.0f} tokens/s, "
        f"{(1 - reach / need) * 100:.1f}% short of {need:,.0f} tokens/s; add GPUs or "
        "lower the target"
    )


def export_model(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    path: str,
    *,
    global_batch: int,
    time_limit_s: float = 10.0,
) -> SolveResult:
    """Solve, then write the winning placement model (CP-SAT text proto) to `path`."""
    return solve(
        graph,
        cluster,
        pinned,
        global_batch=global_batch,
        time_limit_s=time_limit_s,
        export_model=path,
    )


def _peak(pr: _Priced) -> int:
    return max(peak for peak, _ in pr.tables.memory)


def _why_nothing_fits(out: _Outcome, cluster: Cluster) -> str:
    """The binding constraint, by how much: memory (the smallest need against the largest GPU)
    or GPU count (the smallest configuration that fits against the large-enough GPUs)."""
    if not out.kept and out.smallest is not None:
        need, stage, c = out.smallest
        biggest = max(cluster.groups, key=lambda g: g.gpu.memory_bytes)
        cap = biggest.gpu.memory_bytes
        hints = []
        if c.recompute != Recompute.FULL:
            hints.append("allow recomputation")
        if c.zero != 3 and c.dp * c.cp > 1:
            hints.append("allow ZeRO-3")
        hints += ["add GPUs", "use a larger-memory GPU type"]
        # GiB, the unit meshplan.ir.hardware stores a datasheet's "80 GB" in, so the capacity
        # shows as the number users know.
        return (
            f"no plan fits: the smallest configuration needs {need / GiB:.1f} GiB per GPU on "
            f"stage {stage} ({c.describe()}) and the largest GPU, {biggest.gpu.name}, has "
            f"{cap / GiB:.1f} GiB ({(need - cap) / GiB:.1f} GiB short); "
            + ", ".join(hints[:-1])
            + f" or {hints[-1]}"
        )
    if out.kept:
        pr = min(out.kept, key=lambda k: (_peak(k), k.cand.sort_key))
        need = _peak(pr)
        big = [g for g in cluster.groups if g.gpu.memory_bytes >= need]
        c = pr.cand
        have = sum(g.num_gpus for g in big)
        return (
            f"no plan fits: the smallest configuration that fits in memory ({c.describe()}) "
            f"needs {c.gpus} GPUs with {need / GiB:.1f} GiB, and the cluster has {have} such "
            f"GPUs ({_capacity_summary(cluster)}), {c.gpus - have} too few; add GPUs or use a "
            "larger-memory GPU type"
        )
    return (
        "no plan fits: no candidate configuration could be placed on the device groups' GPUs "
        f"({_capacity_summary(cluster)})"
    )


def _capacity_summary(cluster: Cluster) -> str:
    return ", ".join(f"{g.name}: {g.num_gpus} x {g.gpu.name}" for g in cluster.groups)
