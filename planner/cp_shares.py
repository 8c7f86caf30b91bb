"""Asymmetric context-parallel shares (HexiSeq): how many tokens of a sequence, and under
head-parallel attention how many query heads, each cp rank takes when its cp group spans
GPUs of different speeds.

HexiSeq (PAPERS.md) solves the split as a constrained optimisation over each device's
compute, memory and links. Here the step is lock-step: every attention's collectives wait
for the slowest cp rank, so the split that minimises the step equalises the ranks' times.
A rank's time is linear in its share (the uneven zig-zag keeps its causal attention work in
proportion to its tokens, `runtime.context_parallel.sequence_positions`), so each device
group g is measured at two shares with the cost model itself (`Pricer.stage_time` of the
stage's blocks, the rank's cp collectives included): t_g(x) = a_g x + b_g. Equal times T
with every token placed,

    sum_g c_g (T - b_g) / a_g = S   (c_g: cp ranks in group g, S: tokens per sequence),

give each group's share x_g = (T - b_g) / a_g: the continuous optimum of min max_g t_g. It
is rounded to even token counts (the zig-zag halves) by largest remainder, tokens moved two
at a time so the counts add up to S exactly, at least 2 per rank. Head shares under "heads"
are whole heads, the same count on every rank of a group: each such split is tried with the
tokens solved around it (a rank's attention core scales with its heads, the rest with its
tokens; `StageConfig.attention_div`), and the fastest kept.

Memory caps the shares as in HexiSeq: a rank's peak memory is linear in its share too
(its activations), so two probes of `Pricer.stage_memory` give the most tokens each group's
ranks hold; a group the balance would overfill is held at that many and the others share the
rest (when the caps add up to less than the sequence, no split fits and `predict` says so).
Which GPUs join the cp group is the planner's choice (`spanning_search`, below, step 5 of
`meshplan.solver`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from meshplan.cost_model import predict
from meshplan.cost_model.compression import CommOptions
from meshplan.cost_model.engine import EAGER, Engine
from meshplan.cost_model.memory import in_flight_microbatches
from meshplan.cost_model.pricer import pricer_for
from meshplan.ir import (
    Cluster,
    Graph,
    Parallel,
    Prediction,
    Recompute,
    Schedule,
    StageConfig,
    StagePlacement,
)
from meshplan.ir.parallel import span_config
from meshplan.passes.partition import place_stages, replica_capacity


def _rounded(weights: list[float], total: int, step: int, least: int) -> list[int]:
    """Integers in multiples of `step`, each >= `least`, adding up to `total`, in proportion
    to `weights` (largest remainder)."""
    units, floor = total // step, least // step
    weights = [max(w, 1e-12) for w in weights]
    raw = [w / sum(weights) * units for w in weights]
    out = [max(floor, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(out) < units:
        out[order[i % len(order)]] += 1
        i += 1
    while sum(out) > units:  # the floors took more than their share: take from the largest
        j = max(range(len(out)), key=lambda k: out[k] - raw[k])
        if out[j] <= floor:
            raise ValueError(f"cannot split {total} into {len(weights)} shares of >= {least}")
        out[j] -= 1
    return [u * step for u in out]


def balanced_cp_shares(
    graph: Graph,
    cluster: Cluster,
    parallel: Parallel,
    stage: StagePlacement,
    *,
    dtype: str | None = None,
    engine: Engine = EAGER,
) -> Parallel:
    """`parallel` with `cp_shares` (and, under "heads", `cp_head_shares`) that equalise the
    cp ranks' times on `stage`, whose cp groups span device groups (`stage.cp_groups`); see
    the module docstring. `parallel` is complete and its shares unset. Under pipeline
    parallelism (every stage spanning alike) `stage` is the first, which holds the most
    micro-batches in flight: its memory caps the shares."""
    if not stage.cp_groups:
        raise ValueError("asymmetric cp shares need a cp group spanning device groups")
    p = parallel
    seq, cp = graph.info.seq_len, p.cp
    if not seq:
        raise ValueError("asymmetric cp shares need the model's sequence length")
    pricer = pricer_for(graph, cluster, dtype, None, engine)
    comp = pricer.costs.composition(stage.first_unit, stage.last_unit)
    span = stage.cp_groups
    pp = p.pp or 1
    streams = p.tp * p.dp * pp  # cp groups crossing the groups' link at once

    def config(i: int, shares: list[float], heads: list[float] | None = None) -> StageConfig:
        """A rank of group i under token `shares` (per cp rank, summing to seq) and head
        shares `heads` (None: equal)."""
        cfg = dataclasses.replace(
            p.stage(),
            cp_shares=tuple(shares),
            cp_head_shares=tuple(heads) if heads is not None else None,
        )
        return span_config(cfg, span, span[i][0], streams)

    starts = [sum(c for _, c in span[:i]) for i in range(len(span))]
    ranks = [tuple(range(at, at + c)) for at, (_, c) in zip(starts, span)]  # per group

    heads_total = graph.info.heads // p.tp if graph.info.heads else 0

    def group_time(i: int, shares: list[float], heads: list[float] | None) -> float:
        """A rank of group i's time (`config`)."""
        return pricer.stage_time(comp, span[i][0], config(i, shares, heads)).total

    # The most tokens a rank of each group holds in its memory: activations grow linearly
    # with the share, so two probes give the line (`Pricer.stage_memory`, one stage; inf when
    # the share does not move the peak).
    def peak(i: int, x: float) -> float:
        c = span[i][1]
        rest = (seq - c * x) / (cp - c)  # the shares add up to the sequence
        shares = [x if r in ranks[i] else rest for r in range(cp)]
        cfg = config(i, shares)
        mem = pricer.stage_memory(comp, cfg, dp=p.dp, zero=p.zero, stage=stage.index, num_stages=pp)
        return mem.peak(in_flight)[0]

    in_flight = in_flight_microbatches(p.schedule, stage.index, pp, p.num_microbatches, p.chunks)
    caps = []
    for i, (g, c) in enumerate(span):
        x0, x1 = seq / cp, seq / cp * (1 + (cp - c) / (2 * cp))
        m0, m1 = peak(i, x0), peak(i, x1)
        slope = (m1 - m0) / (x1 - x0)
        room = pricer.groups[g].gpu.memory_bytes - (m0 - slope * x0)
        # less the 2 tokens rounding to even counts may add to a rank; at least the 2 every
        # rank holds (a group that cannot hold even those does not fit at all: `predict`
        # says so)
        caps.append(max(2.0, room / slope - 2) if slope > 0 else math.inf)

    def solve(heads_of) -> list[float]:
        """Token shares (floats, adding up to seq) equalising the groups' times, each rank's
        head shares given by `heads_of(token shares)`."""
        equal = seq / cp

        def probe(i: int, x: float) -> list[float]:
            """Group i's ranks at x tokens, the others' even, adding up to seq."""
            c = span[i][1]
            rest = (seq - c * x) / (cp - c)
            return [x if r in ranks[i] else rest for r in range(cp)]

        def time_at(i: int, shares: list[float]) -> float:
            return group_time(i, shares, heads_of(shares))

        # Slopes from two shares each, both below what puts the others at zero tokens.
        slopes = []
        for i, (_, c) in enumerate(span):
            x1 = equal * (1 + (cp - c) / (2 * cp))
            t0, t1 = time_at(i, probe(i, equal)), time_at(i, probe(i, x1))
            slopes.append(max(1e-12, (t1 - t0) / (x1 - equal)))
        # Intercepts at the solution (the cp collectives' padding follows the largest
        # share): solve, re-measure each group at the shares found, solve again. A group
        # whose share would not fit its memory is held at the most it holds (`caps`) and the
        # others share the rest.
        shares = [equal] * cp
        for _ in range(2):
            lines = [
                (a, time_at(i, shares) - a * shares[ranks[i][0]], c)
                for i, (a, (_, c)) in enumerate(zip(slopes, span))
            ]
            held: dict[int, float] = {}
            while True:
                free = [i for i in range(len(span)) if i not in held]
                left = seq - sum(span[i][1] * x for i, x in held.items())
                if not free or left <= 0:
                    break
                a_b_c = [lines[i] for i in free]
                big_t = (left + sum(c * b / a for a, b, c in a_b_c)) / sum(
                    c / a for a, _, c in a_b_c
                )
                over = {
                    i: caps[i] for i, (a, b, _) in zip(free, a_b_c) if (big_t - b) / a > caps[i]
                }
                if not over:
                    for i, (a, b, _) in zip(free, a_b_c):
                        held[i] = max(2.0, (big_t - b) / a)
                    break
                held.update(over)
            per_group = [held.get(i, 2.0) for i in range(len(span))]
            shares = [per_group[i] for i, (_, c) in enumerate(span) for _ in range(c)]
            shares = [x * seq / sum(shares) for x in shares]
        return shares

    heads = None
    if p.cp_mode == "heads" and heads_total:
        # Whole heads, the same count on every rank of a group: every such split (with the
        # tokens solved around it) is priced, and the one whose slowest group is fastest
        # kept. A few splits: the counts add up to a tp rank's heads.
        best = None
        for split in _head_splits([c for _, c in span], heads_total):
            per_rank = [h for h, (_, c) in zip(split, span) for _ in range(c)]
            shares = solve(lambda _, h=per_rank: h)
            rounded = _rounded(shares, seq, 2, 2)
            slowest = max(group_time(i, rounded, per_rank) for i in range(len(span)))
            if best is None or slowest < best[0]:
                best = (slowest, per_rank, shares)
        if best is None:  # no such split: the heads stay equal, the tokens balance alone
            shares = solve(lambda _: None)
        else:
            _, per_rank, shares = best
            heads = tuple(per_rank)
    else:
        shares = solve(lambda _: None)
    tokens = tuple(_rounded(shares, seq, 2, 2))
    return dataclasses.replace(p, cp_shares=tokens, cp_head_shares=heads)


def _head_splits(counts: list[int], heads: int) -> list[tuple[int, ...]]:
    """Every (h_g per group) with h_g >= 1 and sum_g counts[g] h_g = heads."""
    out: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], left: int) -> None:
        g = len(prefix)
        if g == len(counts) - 1:
            if left >= counts[g] and left % counts[g] == 0:
                out.append((*prefix, left // counts[g]))
            return
        rest = sum(counts[g + 1 :])
        for h in range(1, (left - rest) // counts[g] + 1):
            extend((*prefix, h), left - counts[g] * h)

    extend((), heads)
    return out


# -- the planner's search over spanning cp groups ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpanningBest:
    """The fastest configuration of `spanning_search` that fits, and how many it priced."""

    parallel: Parallel
    stages: tuple[StagePlacement, ...]
    prediction: Prediction
    priced: int


def spanning_search(
    graph: Graph,
    cluster: Cluster,
    pinned: Parallel,
    global_batch: int,
    *,
    dtype: str | None = None,
    comm: CommOptions | None = None,
    engine: Engine = EAGER,
    balance: bool = True,
) -> SpanningBest | None:
    """The fastest plan that fits among those whose cp groups span device groups (HexiSeq's
    setting; `meshplan.solver`'s docstring, "Spanning cp groups"), or None when none fits or
    the cluster has one group.

    Enumerated exactly (each priced by `predict` with its balanced shares, `balanced_cp_shares`,
    or equal shares where those do not fit or `balance` is off): pp 1, 2, 4 and 8 (at most
    the layers; the even split, 1F1B, or GPipe with fewer micro-batches than stages; every
    stage spanning the groups alike); ep every degree dividing dp and the experts (MoE);
    tp every degree that divides the heads and every group's NVLink domain; cp every
    `solver_candidates.cp_options` degree above 1; dp every divisor of the global batch with
    dp x tp x cp GPUs in the cluster and replicas that fit no single group whole (otherwise
    the main search covers them: `partition.place_stages` spans only then); micro-batch 1;
    recompute none, selective and full; ZeRO 1 and 3; every cp mode `cp_mode_options`
    allows. Pinned fields restrict each; pinned shares are used as given."""
    from meshplan.ir.facts import blocked_dimension
    from meshplan.ir.rules import (
        cp_split_problem,
        ep_dp_problem,
        ep_experts_problem,
        ep_tp_problem,
        microbatch_problem,
        tp_heads_problem,
    )
    from meshplan.passes.partition import even_stages, tp_domain_problem

    from .solver_candidates import cp_mode_options, cp_options

    info = graph.info
    if len(cluster.groups) < 2 or not info.seq_len:
        return None
    if (pinned.ep or 1) > 1 and not info.experts:
        return None
    if pinned.cp_mode == "usp" or pinned.cp_head_degree:  # "usp" runs equal shares in groups
        return None
    if pinned.schedule not in (None, Schedule.ONE_F_ONE_B) or pinned.virtual_stages:
        return None
    n_layers = len(graph.layer_units) or info.layers or 1
    trial = dataclasses.replace(pinned, cp=2, pp=1, ep=1)
    if blocked_dimension(info, trial) is not None:
        return None
    tps = [pinned.tp] if pinned.tp else [1, 2, 4, 8]
    tps = [
        t
        for t in tps
        if tp_heads_problem(t, info.heads, info.kv_heads) is None
        and all(tp_domain_problem((g,), t) is None for g in cluster.groups)
    ]
    fixed = pinned.cp_shares is not None or pinned.cp_head_shares is not None
    cps = [pinned.cp] if pinned.cp else [c for c in cp_options(info.seq_len) if c > 1]
    if fixed:  # pinned shares: their cp, used as given
        cps = [pinned.cp or len(pinned.cp_shares or pinned.cp_head_shares or ())]
    recomputes = [pinned.recompute] if pinned.recompute else list(Recompute)
    zeros = [pinned.zero] if pinned.zero is not None else [1, 3]
    micro = pinned.micro_batch or 1
    best: SpanningBest | None = None
    priced = 0
    pps = [pinned.pp] if pinned.pp else [q for q in (1, 2, 4, 8) if q <= n_layers]
    for tp, cp, pp in itertools.product(tps, cps, pps):
        most = cluster.world_size // (tp * cp * pp)
        whole = sum(replica_capacity(g, tp, cp) for g in cluster.groups) // pp
        dps = [pinned.dp] if pinned.dp else list(range(whole + 1, most + 1))
        for dp in dps:
            # more replicas than the groups hold whole (else the main search has them)
            if global_batch % (dp * micro) or not whole < dp <= most:
                continue
            # 1F1B, or GPipe where there are fewer micro-batches than stages (as
            # `complete_parallel` picks; the two then take the same time)
            m = global_batch // (dp * micro)
            sched = Schedule.ONE_F_ONE_B
            if microbatch_problem(sched, pp, m):
                sched = Schedule.GPIPE
            base = Parallel(
                dp=dp,
                tp=tp,
                pp=pp,
                cp=cp,
                ep=1,
                micro_batch=micro,
                global_batch=global_batch,
                recompute=Recompute.NONE,
                zero=1,
                schedule=sched,
                sequence_parallel=tp > 1 and not info.blocker("sp"),
            )
            try:
                stages = place_stages(cluster, base, even_stages(graph, pp))
            except ValueError:
                continue
            if not stages[0].cp_groups:
                continue  # the replicas fit groups whole: the main search has them
            # "usp" runs equal shares only (`cp_split_problem`)
            modes = [m for m in cp_mode_options(pinned.cp_mode, info.heads, tp, cp) if m != "usp"]
            # experts: every ep dividing dp and the experts (an ep group is ep replicas at
            # one cp index, inside one device group: `cp_span_problem`)
            eps = [pinned.ep] if pinned.ep else [1]
            if info.experts and not pinned.ep:
                eps = [
                    e
                    for e in range(1, dp + 1)
                    if dp % e == 0
                    and ep_experts_problem(e, info.experts) is None
                    and ep_tp_problem(e, tp, base.sequence_parallel) is None
                    and blocked_dimension(info, dataclasses.replace(base, ep=e)) is None
                ]
            for ep, mode, rc, zero in itertools.product(eps, modes, recomputes, zeros):
                if ep_dp_problem(ep, dp):
                    continue
                p = dataclasses.replace(base, ep=ep, recompute=rc, zero=zero, cp_mode=mode)
                if fixed:
                    p = dataclasses.replace(
                        p, cp_shares=pinned.cp_shares, cp_head_shares=pinned.cp_head_shares
                    )
                    if cp_split_problem(p, info.seq_len, info.heads):
                        continue
                tries = [p]
                if balance and not fixed:
                    try:
                        q = balanced_cp_shares(
                            graph, cluster, p, stages[0], dtype=dtype, engine=engine
                        )
                    except ValueError:  # no even split of the sequence: equal shares only
                        q = None
                    if q is not None:
                        tries.insert(0, q)
                for q in tries:
                    priced += 1
                    pred = predict(graph, cluster, q, stages, dtype=dtype, comm=comm, engine=engine)
                    if pred.fits:
                        if best is None or pred.step_time_s < best.prediction.step_time_s:
                            best = SpanningBest(q, stages, pred, 0)
                        break
    if best is None:
        return None
    return dataclasses.replace(best, priced=priced)
