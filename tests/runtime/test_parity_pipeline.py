"""Pipeline schedules with several chunks per rank, DDP x PP with 2 micro-batches, and uneven
data-parallel micro-batch shares: parity with one process, and their collectives.

One local launch per world size (`run_local`) runs several plans in turn. For each plan the
losses of 3 SGD steps equal the single-process run on every rank, and rank 0's gathered
parameters after each step (so the gradients, recovered from the SGD update) equal the single
process's within fp32 tolerance (`harness.assert_parity`).

Collectives (counted in step 2, `harness.COUNT_STEP`; every rank's tp, gradient and world
groups against the cost model with `harness.check_step_collectives`, and):
- pipeline point-to-point traffic: per micro-batch, every chunk-stage boundary whose two
  chunks sit on different ranks sends the activation forward and its gradient backward, one
  send and one recv per crossing, so a rank sends m x (forward crossings out of its chunks +
  backward crossings out of its chunks); hand-derived from the layouts in
  `pipeline_parallel` (this is the m * v boundary traffic per rank the cost model prices for
  interleaved 1F1B; ZB-V saves the crossing between the two middle chunks, held by one rank);
- uneven shares: every replica runs the same data-parallel collectives (kinds and sizes)
  whatever its micro-batch count, which is what lets replicas with different counts pair
  up; their volume equals the cost model's `dp_traffic` (ZeRO-1/2 included: one all-gather
  and one reduce-scatter per step, however many micro-batches).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from types import SimpleNamespace

import meshplan
import pytest
from meshplan.ir.parallel import Parallel, StagePlacement
from meshplan.ir.plan import assign_ranks
from meshplan.runtime import RuntimePlanError, run_local
from meshplan.runtime.apply import replica_microbatches
from meshplan.runtime.pipeline_parallel import chunk_ranges, rank_chunks

from tests.runtime.harness import (
    assert_parity,
    check_step_collectives,
    graph,
    make_plan,
    reference,
    run_all,
)


def _schedule(plan, schedule: str, v: int | None):
    p = dataclasses.replace(plan.parallel, schedule=schedule, virtual_stages=v)
    return dataclasses.replace(plan, parallel=p)


def group_cluster(world: int, names=("fast", "slow")):
    """`world` CPU ranks in device groups named `names`, world / len(names) ranks each."""
    from meshplan.ir.cluster_io import cluster_from_dict

    d = meshplan.Cluster.preset("cpu", gpus=world).to_dict()
    groups = [copy.deepcopy(d["groups"][0]) for _ in names]
    for g, name in zip(groups, names):
        g.update(name=name, gpus_per_node=world // len(names))
    d["groups"] = groups
    return cluster_from_dict(d, source="test")


def uneven_plan(world: int, shares: dict[str, int], **parallel):
    """A plan whose replicas sit evenly in the device groups named by `shares` (e.g. half in
    "fast", half in "slow"), with micro-batch shares per group (group-pure pipelines: every
    stage has dp / len(shares) replicas per group)."""
    cluster = group_cluster(world, tuple(shares))
    plan = meshplan.estimate_plan(graph(), cluster=cluster, parallel=Parallel(**parallel))
    p = plan.parallel
    per_group = p.dp // len(shares)
    stages = tuple(
        StagePlacement(
            s.index,
            s.first_unit,
            s.last_unit,
            tuple((g, per_group) for g in shares),
            tuple(shares.items()),
        )
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages, ranks=assign_ranks(cluster, p, stages))


def _plans_2():
    return {
        # the planner's chunks: rank 0 runs (prologue, layers.0) and layers.2, rank 1 the rest
        "interleaved-v2": make_plan(
            2, pp=2, micro_batch=2, global_batch=8, schedule="interleaved_1f1b", virtual_stages=2
        ),
        # a hand-made plan without chunks: 3 chunks of one unit per rank
        "interleaved-v3": _schedule(
            make_plan(2, pp=2, micro_batch=2, global_batch=8), "interleaved_1f1b", 3
        ),
        # 4 layers in 2 x 3 chunks: Megatron's uneven first and last stages (the embedding and
        # the loss count as a layer each, `partition.chunk_layers`): chunk 0 holds only the
        # prologue, chunk 5 only the epilogue
        "interleaved-v3-uneven": make_plan(
            2, pp=2, micro_batch=2, global_batch=8, schedule="interleaved_1f1b", virtual_stages=3
        ),
        "zbv": make_plan(2, pp=2, micro_batch=2, global_batch=8, schedule="zero_bubble"),
        # dp replicas in two groups: 3 and 1 micro-batches of 2 rows (8 rows in all)
        "uneven-dp": uneven_plan(2, {"fast": 3, "slow": 1}, dp=2, micro_batch=2, global_batch=8),
        "uneven-fsdp-zero2": uneven_plan(
            2, {"fast": 5, "slow": 3}, dp=2, zero=2, micro_batch=1, global_batch=8
        ),
    }


def _plans_4():
    pp = dict(dp=2, pp=2, micro_batch=1, global_batch=8)
    return {
        # exactly 2 micro-batches: used to fail inside DDP (see pipeline_parallel._Stage)
        "ddpxpp-2mb": make_plan(4, dp=2, pp=2, micro_batch=2, global_batch=8),
        "interleaved-dp": make_plan(4, **pp, schedule="interleaved_1f1b", virtual_stages=2),
        "zbv-dp": make_plan(4, **pp, schedule="zero_bubble"),
        "zbv-fsdp-zero2": make_plan(4, **pp, schedule="zero_bubble", zero=2),
        "tpxinterleaved": make_plan(
            4,
            tp=2,
            pp=2,
            micro_batch=2,
            global_batch=8,
            schedule="interleaved_1f1b",
            virtual_stages=2,
        ),
        "uneven-dpxpp": uneven_plan(4, {"fast": 3, "slow": 5}, **pp),
        # ZeRO-3 keeps gradients sharded under the schedule too (`pipeline_parallel._Stage`)
        "fsdp-zero3xpp": make_plan(4, **pp, zero=3),
    }


def _check(world, plans):
    results = run_local(run_all, world, plans, timeout_s=240)
    for name, plan in plans.items():
        p = plan.parallel
        # One process over the whole global batch in micro-batches of micro_batch rows.
        ref = reference(p.global_batch, p.global_batch // p.micro_batch)
        assert_parity(name, ref, [r[name] for r in results])
        counts = replica_microbatches(plan)
        for rank, res in enumerate(results):
            r = res[name]
            m = counts[r["coords"][1]]
            check_step_collectives(f"{name} rank {rank}", plan, graph(), r, m=m)
    return results


def test_schedules_and_uneven_shares_two_ranks():
    plans = _plans_2()
    results = _check(2, plans)
    for name in ("interleaved-v2", "interleaved-v3", "zbv"):
        _check_p2p(plans[name], results, name)
    for name in ("uneven-dp", "uneven-fsdp-zero2"):
        _check_uneven_dp(plans[name], results, name)


def test_uneven_shares_over_three_groups():
    """Three device groups with three micro-batch counts (the planner's shares over three or
    more groups, `solver_placements._support_placements`), without and with a pipeline (6
    ranks: dp 3 x pp 2 under 1F1B at 4 / 3 / 2 micro-batches). DDP: ZeRO-1/2 at dp 3 would
    pad this model's dim-0 shards, which the cost model does not price (docs/runtime.md)."""
    shares = {"a": 3, "b": 2, "c": 1}
    plans3 = {"uneven-three-groups": uneven_plan(3, shares, dp=3, micro_batch=2, global_batch=12)}
    assert replica_microbatches(plans3["uneven-three-groups"]) == [3, 2, 1]
    results = _check(3, plans3)
    _check_uneven_dp(plans3["uneven-three-groups"], results, "uneven-three-groups")
    name = "uneven-three-groups-pp2"
    plans6 = {name: uneven_plan(6, {"a": 4, "b": 3, "c": 2}, dp=3, pp=2, global_batch=9)}
    assert replica_microbatches(plans6[name]) == [4, 3, 2]
    results = _check(6, plans6)
    _check_uneven_dp(plans6[name], results, name)
    _check_p2p(plans6[name], results, name)


def test_schedules_and_uneven_shares_four_ranks():
    plans = _plans_4()
    results = _check(4, plans)
    p2p = ("ddpxpp-2mb", "interleaved-dp", "zbv-dp", "tpxinterleaved", "uneven-dpxpp")
    for name in (*p2p, "fsdp-zero3xpp"):
        _check_p2p(plans[name], results, name)
    _check_uneven_dp(plans["uneven-dpxpp"], results, "uneven-dpxpp")


# -- collectives --------------------------------------------------------------------------------


def _on(result, axis, kinds):
    group = result["groups"][axis]
    return [r for r in result["records"] if r.group == group and r.kind in kinds]


def _check_p2p(plan, results, name):
    """Sends and recvs on the pp group of step 1 = m x the chunk boundaries crossing ranks
    (see the module docstring), on every rank; the number of micro-batches is the replica's."""
    p = plan.parallel
    counts = replica_microbatches(plan)
    total = len(chunk_ranges(plan))
    owner = {c: r for r in range(p.pp) for c in rank_chunks(plan, r)}
    for rank, res in enumerate(results):
        r = res[name]
        pp_rank, dp_rank = r["coords"][0], r["coords"][1]
        crossings = 0
        for c in rank_chunks(plan, pp_rank):
            crossings += c + 1 < total and owner[c + 1] != pp_rank  # activation forward
            crossings += c > 0 and owner[c - 1] != pp_rank  # gradient backward
        m = counts[dp_rank]
        got = Counter(x.kind for x in _on(r, "pp", {"send", "recv"}))
        assert got == Counter({"send": m * crossings, "recv": m * crossings}) - Counter(), (
            f"{name}: rank {rank} pp traffic {dict(got)}, expected {m * crossings} each"
        )


def _check_uneven_dp(plan, results, name):
    """Replicas with different micro-batch counts run the same collectives on their gradient
    group (kinds and sizes; their volume against `dp_traffic` is `check_step_collectives`')."""
    by_stage: dict[int, list[Counter]] = {}
    for res in results:
        r = res[name]
        recs = _on(r, "grad", {"all_reduce", "all_gather", "reduce_scatter"})
        by_stage.setdefault(r["coords"][0], []).append(Counter((x.kind, x.numel) for x in recs))
    for per_replica in by_stage.values():
        assert all(c == per_replica[0] for c in per_replica), f"{name}: replicas differ"


# -- pure checks (no processes) ------------------------------------------------------------------


def _fake_plan(schedule, pp, v, stage_units, n_units, chunks=None):
    """Just the fields chunk_ranges reads."""
    stages, first = [], 0
    for i, n in enumerate(stage_units):
        listed = tuple(chunks[i]) if chunks else ()
        stages.append(
            SimpleNamespace(
                index=i, first_unit=first, last_unit=first + n, num_units=n, chunks=listed
            )
        )
        first += n
    parallel = SimpleNamespace(pp=pp, schedule=schedule, virtual_stages=v)
    units = ("<prologue>", *[f"layers.{i}" for i in range(n_units - 2)], "<epilogue>")
    return SimpleNamespace(parallel=parallel, stages=stages, model=SimpleNamespace(units=units))


def test_chunk_layouts():
    """Which rank holds which chunk-stage, and the units of each, for both plan records."""
    il = _fake_plan("interleaved_1f1b", 2, 2, (3, 3), 6)
    assert [rank_chunks(il, r) for r in (0, 1)] == [[0, 2], [1, 3]]
    # no chunks recorded: rank 0's 3 units -> chunks 0 (2 units) and 2 (1 unit)
    assert chunk_ranges(il) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    zbv = _fake_plan("zero_bubble", 3, 2, (4, 2, 2), 8)
    assert [rank_chunks(zbv, r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    # rank 0 runs 4 units (chunks 0 and 5, 2 each), ranks 1 and 2 run 2 (1 per chunk)
    assert chunk_ranges(zbv) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 8)]
    # chunks recorded per rank in model order (the planner's StagePlacement.chunks)
    listed = _fake_plan("zero_bubble", 2, 2, (3, 3), 6, chunks=[((0, 2), (5, 6)), ((2, 3), (3, 5))])
    assert chunk_ranges(listed) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    gap = _fake_plan("zero_bubble", 2, 2, (3, 3), 6, chunks=[((0, 2), (5, 6)), ((2, 3), (4, 5))])
    with pytest.raises(RuntimePlanError, match="tile the model"):
        chunk_ranges(gap)
    with pytest.raises(RuntimePlanError, match="fewer than the 3 chunks"):
        chunk_ranges(_fake_plan("interleaved_1f1b", 2, 3, (4, 2), 6))


def test_zbv_zero3_refused():
    from meshplan.runtime.pipeline_parallel import check_schedule

    plan = _schedule(
        make_plan(4, dp=2, pp=2, zero=3, micro_batch=1, global_batch=8), "zero_bubble", 2
    )
    with pytest.raises(RuntimePlanError, match="zero_bubble with ZeRO-3"):
        check_schedule(plan)


def test_uneven_share_refusals():
    """Shares whose collectives could not pair up are refused with one line."""
    ok = uneven_plan(2, {"fast": 3, "slow": 1}, dp=2, micro_batch=2, global_batch=8)
    assert replica_microbatches(ok) == [3, 1]
    zero3 = uneven_plan(2, {"fast": 3, "slow": 1}, dp=2, zero=3, micro_batch=2, global_batch=8)
    with pytest.raises(RuntimePlanError, match="ZeRO-3"):
        replica_microbatches(zero3)
    bad_sum = uneven_plan(2, {"fast": 2, "slow": 1}, dp=2, micro_batch=2, global_batch=8)
    with pytest.raises(RuntimePlanError, match="do not add up"):
        replica_microbatches(bad_sum)
