"""What the search (`meshplan.solver`) optimises, what it may spend and what it returns.

Objectives (`Objective`, in numbers `_Scorer`): "throughput" (default) minimises the step time.
"cost" minimises dollars per token = step time x the hourly price of the GPUs the plan uses
(from `DeviceGroup.price_per_gpu_hour` or `Objective.prices`); bounds are the step bound times
the cheapest GPUs that could hold the configuration (`_Scorer.factor`), placements are scored
by their cost (`_Scorer.score`), and the placement model (which minimises T) is used as one
more placement to score, so on clusters whose groups differ in price the status is "optimal"
only when the bounds close the search. "min_gpus" returns the fastest plan on the fewest GPUs
(tp * pp * cp * dp) whose throughput meets `target_tokens_per_s`: GPU counts are tried in
increasing order, each a throughput search restricted to that count, skipped when its
memory-free bound already misses the target (`solver._min_gpus`).

Budget (`_Work`): deterministic work, not seconds. Each step of the screen is charged its
calibrated cost (`WORK_COSTS`: bounds, memory checks, table cells priced, placements scored,
model cells built) and each CP-SAT solve its deterministic time, so identical inputs give
identical plans on an idle and on a loaded machine, also when the budget cuts the search
short. The wall clock is only a safety net (WALL_SAFETY_FACTOR x the budget): a search it stops
is reported (`SolveResult.wall_clock_hit`, `WALL_CLOCK_NOTE` in the plan's notes).

Result (`SolveResult`): the plan and how the search went. A placement (`Placement`) is, per
stage, its replicas per device group: [[(group, n), ...], ...].
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from meshplan.ir import Cluster, Parallel, Prediction, StagePlacement

from .solver_candidates import Candidate

OBJECTIVES = ("throughput", "cost", "min_gpus")

# CPython's cyclic collector runs a young-generation pass every 700 net allocations of
# container objects (its default threshold). A search allocates ~1e6 small long-lived ones
# (families, cache keys, priced stage configs), so it ran thousands of passes that find
# almost nothing (the search makes little cyclic garbage): ~20% of Llama-3-70B's solve on 512
# mixed GPUs (`benchmarks/planner_speed.py`; 5.4-6.3 s -> 4.4-4.6 s with this threshold).
# `rarer_collections` raises it for the length of a solve; collections still run, and the
# plan does not depend on them.
GC_YOUNG_THRESHOLD = 100_000


def rarer_collections(fn: Callable) -> Callable:
    """`fn` run with the young-generation collection threshold at least GC_YOUNG_THRESHOLD,
    restored afterwards."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = gc.get_threshold()
        gc.set_threshold(max(before[0], GC_YOUNG_THRESHOLD), *before[1:])
        try:
            return fn(*args, **kwargs)
        finally:
            gc.set_threshold(*before)

    return run


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
    # a configuration enumerated (`enumerate_families`): measured directly, not in the fit
    # above (the fit cannot tell it from "bound"); 403,590 of llama3-70b on 512 H100 + A100
    # took 0.47-0.56 CPU s once the enumeration yielded families (session 21; 5.0e-6 before)
    "candidate": 1.3e-6,
    # a configuration's split-free bound (`_split_free_bound`): measured directly, not in the
    # fit above (session 21: 8.3-10.6 us per family in the screen's first pass with a cold
    # pricer, 3.2-5.1 us per member later, on llama3-70b on 512 and llama3-8b on 16,384
    # mixed GPUs; `benchmarks/work_costs.py` cannot tell it from the screen's other
    # per-family work; 2.0e-5 before)
    "bound": 1.0e-5,
    "split": 2.6e-5,  # a (configuration, split) pair's memory-free bound
    "memory": 8.5e-5,  # a memory check (`_split_free_memory` or `_largest_stage`)
    # the check before it (`memory.summed_states` over a configuration's ranks:
    # `_ScreenMemo.fits_nowhere`, a group of `_single_group_seed`), or four stages of a layout's
    # (`_Layouts.may_hold`): not in the fit above; llama3-70b on 32 A100-40GB + 32 V100-16GB +
    # 32 T4 made 64,875 of the first at 3.3 us and 28,314 of the second at 0.66 us per stage
    # (session 32)
    "aggregate": 3.0e-6,
    "cell": 1.1e-4,  # one (stage, group) cell of a pair's priced tables (`plan_tables`)
    "placement": 3.2e-4,  # one placement scored (`evaluate`: warm starts and shares)
    "model": 3.9e-4,  # one replica variable of a placement model, built and solved
    # one layout of step 2b bounded (`solver_layouts`, numpy over each (k_a, k_b) grid):
    # not in the fit above; 2.71M layouts of llama3-70b on 512 H100 + A100 took 0.26 CPU s
    # (session 19; 6.0e-7 before, measured on the slower code of session 17)
    "layout": 1.0e-7,
    # one family bounded again by `solver_bounds._multi_group_bound` (`_ScreenMemo.refined`):
    # not in the fit above; 24,206 of llama3-70b on 512 H100 + A100 took 1.67 CPU s
    "refine": 7.0e-5,
    # one of a cluster's configurations checked against one group (`solver._one_group`):
    # not in the fit above; 403,590 of llama3-70b on 512 H100 + A100 took 0.02-0.05 CPU s
    # per group once it checked whole families (session 21; 0.2 s and 5.0e-7 before)
    "filter": 1.0e-7,
    # one split of dp over three or more host groups priced for its shares
    # (`solver_placements._support_shares`): not in the fit above; 3,000 splits of dp 192 over
    # three groups took 31 us each with no plan in hand (session 31), less once one is
    "share_split": 1.0e-5,
    # one split enumerated for it (`_splits_over`, `_integer_bounds`, their sort; numpy):
    # 118,518 splits of dp 640 over three groups of 400 took 0.30 CPU s. GPT-3 2.7B on 128
    # A100 + 128 V100 + 128 T4 listed 47,682 and priced 3,106 in 0.15 CPU s (session 31)
    "share_listed": 2.5e-6,
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


Placement = list[list[tuple[str, int]]]


class _Scorer:
    """The objective in numbers: a placement's score (step seconds, or dollars per step for
    "cost") and the factor that turns a step-time bound into a score bound."""

    def __init__(self, objective: Objective, cluster: Cluster, equal_shares: bool = False) -> None:
        # Every replica runs the same number of micro-batches (no uneven DP shares): the
        # runtime assumption of planners without them (Sailor), for a like-for-like comparison.
        self.equal_shares = equal_shares
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
    # The least score any plan of the search space can have, as the search proved, in the
    # search's own units (`_Scorer.score`: seconds per step for throughput and min_gpus,
    # step seconds times the plan's price per hour for cost; so objective_value (1 - gap) only
    # for throughput, where the two agree). The single-group seeds' floor reads it
    # (throughput). 0: nothing proven.
    bound: float = 0.0


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
