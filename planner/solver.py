"""The planner's optimisation model: choose a parallel configuration and place it (OR-Tools CP-SAT).

The model is written down with the step that uses it, one module per step:

    solver_candidates   step 1: the set C (configurations, `Candidate`), the validity rules
                        it asks (`ir.rules`), per-group TP
    solver_splits       step 1: the layer splits L(c) of a configuration
    solver_bounds       the lower bounds of step 2, before and after a pair's tables
    solver_screen       step 2: the screen (bound, price, greedy and uneven-share placements)
    solver_queue        step 2: the screen's queue, the typed entries of its heap and their order
    solver_layouts      step 2b: pipelines that change device group and TP degree between
                        stages (Sailor's plan shape), bounded and priced in bound order
    solver_model        step 3: the CP-SAT placement model of one (c, l): sets, data, variables,
                        constraints (one method per family), objective
    solver_objective    what is optimised (`Objective`), the work budget (`_Work`), the result
    solver (this one)   the search over steps 2-3 (`_search`), step 4 (`_decode`) and `solve`

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
   (`_Screen`), or two thirds of the work left are spent;
3. for each surviving (c, l) whose lock-step greedy placement does not already meet its bound,
   build the placement model (`_PlacementModel`: variables -> constraints -> objective), hint
   the greedy placement (`AddHint`), cut off at the incumbent, solve; when the screen stopped
   at its share and work is left, steps 2 and 3 go on where they stopped (`_search`), so
   the work the models did not need is the screen's;
2b. on a cluster of several device groups (throughput objective), bound every pipeline of
   `solver_layouts`' family (first stages on one group at one TP degree, the rest on another
   at another) and price them in bound order until the bound passes the best plan so far;
   one that beats it is the plan (`_layouts`), and the family's unpriced bounds count in the
   gap like the placement models' open ones;
4. decode the best placement into `Parallel` + `StagePlacement`s and re-price it with
   `predict`. The plan is "optimal" when every (c, l) was either bounded out or solved to
   optimality, else "feasible" with the relative gap to the smallest open bound.
5. spanning cp groups (HexiSeq; throughput objective, several device groups; `solve` over
   `_solve_in_groups`, `cp_shares.spanning_search`): the configurations whose replicas fit
   no group whole, each replica's cp group taking cp ranks from several groups
   (`StagePlacement.cp_groups`, `passes.partition.place_stages`), are priced exhaustively
   with balanced token (and head) shares (`cp_shares.balanced_cp_shares`; equal shares
   with `equal_shares`, or where the balanced ones do not fit). Constraints: pp in 1, 2, 4,
   8 (at most the layers; the even split; every stage spanning the groups alike, so each cp
   rank's hand-offs stay in its group; 1F1B, or GPipe with fewer micro-batches than
   stages); ep any degree dividing dp and the experts (an ep group is ep replicas at one cp
   index, inside one group: `ir.parallel.cp_span_problem`); tp divides the heads and every group's
   NVLink domain; cp from `cp_options`; whole groups hold fewer than dp x pp replicas,
   dp <= world / (tp cp pp); dp x
   micro-batch divides the global batch, micro-batch 1 unless pinned; recompute any; ZeRO 1
   or 3 unless pinned; the cp modes `cp_mode_options` allows. The faster of this family's
   best and step 4's plan is returned; its bound is the smaller of the two (the family has
   no gap), so a spanning plan below the search's bound is optimal.

Objectives (`Objective`, `solver_objective`): "throughput" (default) minimises the step time,
"cost" dollars per token, "min_gpus" returns the fastest plan on the fewest GPUs meeting
`target_tokens_per_s` (`_min_gpus`). On a mixed cluster the best single-group plan
(`_single_group_seed`) is the first incumbent.

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

The names of the step modules that callers use (`enumerate_candidates`, `Objective`,
`InfeasibleError`, the search's limits and budget constants, ...) are importable from here.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshplan.cost_model.compression import CommOptions
from meshplan.cost_model.engine import EAGER, Engine
from meshplan.cost_model.memory import holds_states, summed_states
from meshplan.cost_model.pricer import Pricer, compute_dtype, pricer_for
from meshplan.cost_model.simulate import evaluate, predict
from meshplan.ir import (
    Cluster,
    DeviceGroup,
    Graph,
    Parallel,
    Prediction,
    Recompute,
    StagePlacement,
)
from meshplan.passes.partition import replica_capacity, tp_domain_problem
from ortools.sat.python import cp_model

from .solver_candidates import (
    MAX_CP,
    MAX_MICRO_BATCH,
    MAX_MICRO_BATCH_NO_PIPELINE,
    MAX_VIRTUAL_STAGES,
    MIN_CP_TOKENS,
    Candidate,
    Family,
    InfeasibleError,
    count,
    cp_options,
    enumerate_candidates,
    enumerate_families,
    flatten,
    micro_batch_options,
    schedule_options,
)
from .solver_layouts import layout_plan
from .solver_model import UNITS_PER_STEP, _PlacementModel, _Scale
from .solver_objective import (
    CPSAT_DETERMINISTIC_PER_WORK,
    CPSAT_MIN_DETERMINISTIC,
    OBJECTIVES,
    WALL_CLOCK_NOTE,
    WALL_SAFETY_FACTOR,
    WALL_SAFETY_MIN_S,
    WORK_COSTS,
    Objective,
    Placement,
    SolveResult,
    _Scorer,
    _Work,
    rarer_collections,
)
from .solver_placements import _pair_shares
from .solver_screen import MIN_SCREEN_EXTENSION, _needs_model, _Priced, _Screen
from .solver_splits import EXHAUSTIVE_SPLITS

# What callers import from here: the entry points and the step modules' names they use
# (`_pair_shares`: the unit test of the share search).
__all__ = [
    "CPSAT_DETERMINISTIC_PER_WORK",
    "CPSAT_MIN_DETERMINISTIC",
    "EXHAUSTIVE_SPLITS",
    "GiB",
    "MAX_CP",
    "MAX_MICRO_BATCH",
    "MAX_MICRO_BATCH_NO_PIPELINE",
    "MAX_VIRTUAL_STAGES",
    "MIN_CP_TOKENS",
    "OBJECTIVES",
    "UNITS_PER_STEP",
    "WALL_CLOCK_NOTE",
    "WALL_SAFETY_FACTOR",
    "WALL_SAFETY_MIN_S",
    "WORK_COSTS",
    "Candidate",
    "Family",
    "InfeasibleError",
    "Objective",
    "Placement",
    "Progress",
    "SolveResult",
    "cp_options",
    "enumerate_candidates",
    "enumerate_families",
    "flatten",
    "export_model",
    "micro_batch_options",
    "schedule_options",
    "solve",
    "_pair_shares",
]


GiB = 2**30

Progress = Callable[[str], None] | None


# ---------------------------------------------------------------------------------------------
# Steps 2-3: screen every (configuration, split), then solve the placement models left
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
    turned_away: bool = False  # the states check turned a configuration away (`_Screen`)


def _search(
    pricer: Pricer,
    graph: Graph,
    cands: list[Family],
    global_batch: int,
    work: _Work,
    scorer: _Scorer,
    say,
    limit: float = math.inf,
    incumbent: float = math.inf,
    single_floor: float = 0.0,
    states_check: bool = True,
) -> _Outcome:
    """Steps 2-3 of the module docstring over the candidates of `cands`: screen, then
    placement models, until `work` is spent. `incumbent`: the score of a plan known from elsewhere
    (`_single_group_seed`); only pairs that can beat it are priced, and `best` stays None when
    none does. `single_floor`: no placement inside one device group scores below it (the
    screen then bounds the rest by what crossing between groups costs). The screen gets two
    thirds of the work left and the placement models of the pairs it kept the rest; but the
    screen goes on until it has found some plan (or shown that none fits), and when it stopped
    at its share with work left after the models, both go on, two thirds at a time."""
    screen = _Screen(
        pricer, graph, cands, global_batch, work, scorer, limit, say, incumbent, single_floor,
        states_check,
    )  # fmt: skip
    best: tuple[float, _Priced, Placement, dict | None] | None = None

    def better(score: float, pr: _Priced) -> bool:
        """Better, or as good (to 1e-9) with less memory (e.g. ZeRO-2 over ZeRO-1)."""
        if best is None or score < best[0] * (1 - 1e-9):
            return True
        return score <= best[0] * (1 + 1e-9) and _peak(pr) < _peak(best[1])

    all_kept: list[_Priced] = []
    open_bounds: list[float] = []
    models = 0
    seed = incumbent
    while True:
        kept, cut = screen.run(
            work.spent + work.left() * 2 / 3, best[0] if best is not None else math.inf
        )
        all_kept += kept
        for pr in kept:
            if pr.best is not None and pr.best[0] < seed and better(pr.best[0], pr):
                best = (pr.best[0], pr, pr.best[1], pr.best[2])
        open_bounds += [pr.share_open for pr in kept]
        for i, pr in enumerate(kept):
            incumbent = min(best[0] if best else math.inf, seed)
            if pr.lower >= incumbent * (1 - 1e-9):
                break  # sorted by bound: nothing further can win
            if not _needs_model(pr, incumbent):
                continue  # only share placements could win (searched), or the warm start wins
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
        if not math.isfinite(cut) or work.left() <= MIN_SCREEN_EXTENSION or work.past_deadline():
            break
    lowest_open = min([cut, *open_bounds])
    return _Outcome(
        best, lowest_open, screen.pairs, screen.priced, models, screen.smallest, all_kept,
        screen.memo.turned_away,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Step 4: decode the best placement and re-price it
# ---------------------------------------------------------------------------------------------


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
    # Shares, equal ones too, mean group-pure pipelines, priced as such (`evaluate(...,
    # shares)`: each pipeline's hand-offs inside its group); dropping equal ones would price a
    # lock-step placement whose hand-offs may cross groups, not the plan the screen scored.
    order = [g.name for g in cluster.groups]
    stages = []
    for s, (a, b) in enumerate(pr.tables.ranges):
        reps = tuple(sorted(placement[s], key=lambda gn: order.index(gn[0])))
        micro = tuple((g, shares[g]) for g, _ in reps) if shares else ()
        tps = tuple((g, pr.cand.tp_of(g)) for g, _ in reps) if group_tp else ()
        stages.append(StagePlacement(s, a, b, reps, micro, group_tp=tps))
    parallel = pr.cand.parallel()
    prediction = predict(
        graph, cluster, parallel, tuple(stages), dtype=dtype, comm=comm, engine=engine
    )
    assert prediction.fits, "solver placed a stage where it does not fit"
    return parallel, tuple(stages), prediction


# ---------------------------------------------------------------------------------------------
# The entry point: objectives, the single-group seed, min_gpus, messages
# ---------------------------------------------------------------------------------------------


def check_budget(value: object, name: str) -> None:
    """A solver budget (work seconds) must be a positive finite number: ValueError naming
    `name` otherwise (0 or -1 would plan as if unbudgeted, nan stop at once)."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of work seconds, got {value!r}")


@rarer_collections
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
    equal_shares: bool = False,
    candidates: list[Family] | None = None,
) -> SolveResult:
    """The best configuration and placement that fits, honouring the fields of `pinned`:
    `_solve_in_groups` (every replica inside a device group), and on a cluster of several
    groups under the throughput objective also the cp groups that span them (step 5 of the
    module docstring, `cp_shares.spanning_search`); the faster plan that fits wins. The
    arguments are `_solve_in_groups`'."""
    check_budget(time_limit_s, "time_limit_s (--time-limit)")
    objective = objective or Objective()
    spans = objective.kind == "throughput" and len(cluster.groups) > 1 and candidates is None
    try:
        result = _solve_in_groups(
            graph, cluster, pinned, global_batch=global_batch, time_limit_s=time_limit_s,
            progress=progress, dtype=dtype, export_model=export_model, objective=objective,
            comm=comm, quantize=quantize, per_group_tp=per_group_tp,
            wall_limit_s=wall_limit_s, engine=engine, equal_shares=equal_shares,
            candidates=candidates,
        )  # fmt: skip
    except InfeasibleError:
        if not spans:
            raise
        result, refusal = None, sys.exc_info()[1]
    if not spans:
        return result
    from .cp_shares import spanning_search

    start = time.perf_counter()
    span = spanning_search(
        graph, cluster, pinned, global_batch, dtype=dtype, comm=comm, engine=engine,
        balance=not equal_shares,
    )  # fmt: skip
    if span is None:
        if result is None:
            raise refusal
        return result
    time_s = span.prediction.step_time_s
    if result is not None and result.prediction.step_time_s <= time_s:
        return dataclasses.replace(result, candidates=result.candidates + span.priced)
    # The spanning family is priced exhaustively: the plan is optimal when it is at or below
    # the bound the search in groups proved (nothing fits there: optimal outright).
    bound = time_s
    if result is not None:
        bound = min(time_s, result.prediction.step_time_s * (1 - result.gap))
    gap = (time_s - bound) / time_s
    if progress:
        progress(
            f"a cp group spanning device groups is faster: {time_s:.3f} s/step"
            + (f" (in groups: {result.prediction.step_time_s:.3f})" if result else "")
        )
    return SolveResult(
        parallel=span.parallel,
        stages=span.stages,
        prediction=span.prediction,
        status="optimal" if gap <= 0 else "feasible",
        gap=max(0.0, gap),
        wall_s=(result.wall_s if result else 0.0) + time.perf_counter() - start,
        candidates=(result.candidates if result else 0) + span.priced,
        explored=(result.explored if result else 0) + span.priced,
        placement_models=result.placement_models if result else 0,
        objective=objective.kind,
        objective_value=time_s,
        splits=result.splits if result else 0,
        work=result.work if result else 0.0,
        wall_clock_hit=result.wall_clock_hit if result else False,
        bound=bound,
    )


def _solve_in_groups(
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
    equal_shares: bool = False,
    candidates: list[Family] | None = None,
    cutoff: float = math.inf,
    explain: bool = True,
) -> SolveResult:
    """The best configuration and placement that fits with every replica inside a device
    group, honouring the fields of `pinned`.

    `cutoff` (`_single_group_seed`): the step time of a plan known from elsewhere; only plans
    faster than it are searched for, and `_NoneFaster` is raised when none is. `explain`
    False: a refusal is a bare InfeasibleError (the seeds discard it), without the second
    search that names the least memory need.

    `comm`: what may be done to traffic (lossless coding, int8 gradients; each collective
    priced at its fastest allowed method, `cost_model.compression`); None: raw traffic.
    `quantize`: activation quantization (AGoQ) becomes a knob of the search, like recompute.
    `per_group_tp`: on clusters of several device groups, also search group-pure pipelines
    whose groups use different TP degrees (`Candidate.group_tp`). `engine`: price every
    candidate as that training stack runs it (`cost_model.engine`; default meshplan's eager
    runtime). `equal_shares`: every replica runs the same number of micro-batches (no uneven
    DP shares across GPU types; a peer planner's runtime assumption).

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
    dtype = pricer.dtype  # None: the model's own (`pricer.compute_dtype`)
    if candidates is None:
        cands = enumerate_families(
            graph, cluster, pinned, global_batch, quantize=quantize, per_group_tp=per_group_tp
        )
        work.charge("candidate", count(cands))
    else:
        cands = candidates
        if not cands:
            raise InfeasibleError("no plan: no configuration fits this cluster")
    n_cands = count(cands)
    say(f"enumerated {n_cands} candidate configurations")
    tokens = global_batch * (graph.info.seq_len or 1)
    seed: SolveResult | None = None
    floor = 0.0  # no placement inside one group scores below it
    if objective.kind == "min_gpus":
        out = _min_gpus(pricer, graph, cands, global_batch, work, say, objective)
    else:
        scorer = _Scorer(objective, cluster, equal_shares)
        if objective.kind == "throughput" and len(cluster.groups) > 1:
            seed, floor = _single_group_seed(
                graph, cluster, pinned, global_batch, work, dtype, comm, quantize, engine, cands
            )
        if seed is not None and floor >= seed.prediction.step_time_s * (1 - 1e-9):
            # Every group's best plan is proven and none beats the seed: a placement inside
            # one group can at most tie it, so only placements across groups can win.
            floor = math.inf
        work.at_least(0.5)  # the main search gets some work whatever the seeds took
        out = _search(
            pricer,
            graph,
            cands,
            global_batch,
            work,
            scorer,
            say,
            incumbent=seed.prediction.step_time_s if seed else cutoff,
            single_floor=floor,
        )
    if objective.kind == "throughput" and per_group_tp and len(cluster.groups) > 1:
        incumbent = min(
            out.best[0] if out.best is not None else math.inf,
            seed.prediction.step_time_s if seed is not None else math.inf,
        )
        out.lowest_open, found = layout_plan(
            graph, pricer, pinned, global_batch, work, incumbent, out.lowest_open, say
        )
        if found is not None:
            return dataclasses.replace(
                found,
                prediction=_with_wall_note(found.prediction, work, time_limit_s, say),
                wall_s=time.perf_counter() - start,
                candidates=n_cands,
                explored=out.priced + found.explored,
                placement_models=out.models,
                splits=out.pairs,
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
            bound=seed.prediction.step_time_s * (1 - max(gap, seed.gap)),
            wall_s=time.perf_counter() - start,
            candidates=n_cands,
            explored=seed.explored + out.priced,
            placement_models=seed.placement_models + out.models,
            splits=seed.splits + out.pairs,
            work=work.spent,
            wall_clock_hit=work.wall_hit,
        )
    if out.best is None and math.isfinite(cutoff):
        raise _NoneFaster(min(out.lowest_open, cutoff), work.spent, work.wall_hit)
    if out.best is None:
        if out.turned_away and explain:
            # Search again without the states check, so that the refusal names the least
            # need the per-stage checks find (`_why_nothing_fits`), as it always has.
            out = _search(
                pricer, graph, cands, global_batch, work, scorer, say, incumbent=cutoff,
                single_floor=floor, states_check=False,
            )  # fmt: skip
        raise InfeasibleError(_why_nothing_fits(out, cluster) if explain else "no plan fits")
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
        bound=min(out.lowest_open, score),
        wall_s=wall,
        candidates=n_cands,
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


class _NoneFaster(Exception):
    """`_solve_in_groups` with a cutoff: no plan is faster than it. `bound`: the least step
    time a plan there can have, as far as the search proved (the cutoff when it ran to the
    end); `work`, `wall_hit`: what the search spent, as `SolveResult` reports them."""

    def __init__(self, bound: float, work: float, wall_hit: bool) -> None:
        super().__init__(bound)
        self.bound, self.work, self.wall_hit = bound, work, wall_hit


def _single_group_seed(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    global_batch: int,
    work: _Work,
    dtype: str,
    comm: CommOptions | None = None,
    quantize: bool = False,
    engine: Engine = EAGER,
    cands: list[Family] | None = None,
) -> tuple[SolveResult | None, float]:
    """(the best plan inside one device group, over every group: the incumbent of a mixed
    cluster's search; the least step time any plan inside one group can have, as the groups'
    searches proved: the single-group floor of `_search`). A homogeneous group's bounds are
    exact, so each of these is quick, and a strong first incumbent prunes the (weaker-bounded)
    mixed placements early. A group where nothing fits holds no such plan; one whose search
    could not run (a pinned field it refuses) proves nothing, and the floor is 0.

    The groups are searched by their summed peak FLOP/s, most first (ties in cluster order),
    each after the first only for a plan faster than the best so far (`_solve_in_groups`'
    cutoff): a group that holds none proves the cutoff as its floor, usually in a fraction
    of the work of finding its own best plan. Two groups whose best plans are equally fast
    give the first searched one's.

    `cands`: the whole cluster's configurations (`enumerate_candidates`); each group's search
    then takes those that fit the group (`_one_group`) instead of enumerating its own, which
    gives the same list in the same order where every group's NVLink domain divides the
    largest (so the cluster's TP degrees include every degree a group allows)."""
    seed, floor = None, math.inf
    largest = max(g.domain_gpus for g in cluster.groups)
    shared = cands is not None and all(largest % g.domain_gpus == 0 for g in cluster.groups)
    peak_dtype = dtype or compute_dtype(graph)

    def peak(g: DeviceGroup) -> float:
        """The group's summed dense peak at the model's dtype (FP32 where the part lacks it)."""
        table = dict(g.gpu.peak_flops)
        return g.num_gpus * table.get(peak_dtype, table["float32"])

    # The least model states any configuration holds (ZeRO-3: each parameter's once)
    pricer = pricer_for(graph, cluster, dtype, comm, engine)
    least = summed_states(
        *pricer.model_params(), shards=1, ep=1, zero=3, precision=pricer.precision
    )
    for g in sorted(cluster.groups, key=lambda g: -peak(g)):  # ties: cluster order
        work.charge("aggregate")
        if not holds_states(least, [(g.num_gpus, g.gpu.memory_bytes)]):
            continue  # the whole group cannot hold the model's states: no plan inside it
        sub = dataclasses.replace(cluster, name=f"{cluster.name}/{g.name}", groups=(g,))
        sub = dataclasses.replace(sub, group_links=())
        own = _one_group(cands, g) if shared else None
        if own is not None:
            work.charge("filter", count(cands))
        budget = 0.6 * work.limit / len(cluster.groups)
        check_budget(budget, "time_limit_s (--time-limit)")
        try:
            r = _solve_in_groups(
                graph,
                sub,
                pinned,
                global_batch=global_batch,
                time_limit_s=budget,
                dtype=dtype,
                comm=comm,
                quantize=quantize,
                wall_limit_s=work.seconds_left(),
                engine=engine,
                candidates=own,
                cutoff=seed.prediction.step_time_s if seed is not None else math.inf,
                explain=False,
            )
        except _NoneFaster as none:
            work.spent += none.work
            work.wall_hit = work.wall_hit or none.wall_hit
            floor = min(floor, none.bound)
            continue
        except InfeasibleError:
            continue
        except ValueError:
            floor = 0.0
            continue
        work.absorb(r)
        floor = min(floor, r.bound)
        if seed is None or r.prediction.step_time_s < seed.prediction.step_time_s:
            seed = r
    return seed, floor


def _one_group(cands: list[Family], group: DeviceGroup) -> list[Family]:
    """The families of `cands` (a cluster's) that `enumerate_families` gives the cluster of
    `group` alone, in the same order (their members keep the cluster's enumeration indices,
    which order them as the group's own would): no per-group TP, a TP degree the group's
    domain takes and pp * dp replicas it holds."""
    fits: dict[tuple[int, int], int] = {}
    out = []
    for f in cands:
        if f.group_tp:
            continue
        cap = fits.get((f.tp, f.cp))
        if cap is None:
            ok = tp_domain_problem((group,), f.tp) is None
            cap = fits[(f.tp, f.cp)] = replica_capacity(group, f.tp, f.cp) if ok else 0
        if f.pp * f.dp <= cap:
            out.append(f)
    return out


def _min_gpus(
    pricer: Pricer,
    graph: Graph,
    cands: list[Family],
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
    by_gpus: dict[int, list[Family]] = {}
    for f in cands:
        if not f.group_tp:  # a per-group TP plan's GPU count depends on its placement
            by_gpus.setdefault(f.gpus, []).append(f)
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
        if full.turned_away:  # as `_solve_in_groups`: the refusal's least need
            full = _search(
                pricer, graph, cands, global_batch, work, scorer, say, states_check=False
            )
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
