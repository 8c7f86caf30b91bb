"""The runtime accepts every plan the planner emits.

`meshplan.runtime.check_plan` runs every refusal the runtime can decide from a plan alone
(uneven shares, schedules, stage widths, EP x TP without SP, per-group TP, the CP split); the
parity tests run the combinations themselves. Here the planner plans many random instances
(dense and MoE models; one group, two GPU types, nodes of different sizes; random pins) and
every plan must pass the check, so no planner output is one the runtime would refuse.
"""

from __future__ import annotations

import random

import meshplan
import pytest
from meshplan.ir import Parallel
from meshplan.runtime import RuntimePlanError, check_plan

from tests.synthetic import (
    A100_40,
    h100_cluster,
    mixed_cluster,
    transformer_graph,
    two_node_sizes_cluster,
)

CLUSTERS = (
    lambda: h100_cluster(2),
    lambda: h100_cluster(4, 4),
    lambda: mixed_cluster(1, 1, gpus_per_node=4),
    lambda: mixed_cluster(1, 3, a100=A100_40, gpus_per_node=4),
    lambda: mixed_cluster(1, 1, wan=True, gpus_per_node=4),
    two_node_sizes_cluster,
)
PINS = (
    Parallel(),
    Parallel(pp=2),
    Parallel(schedule="interleaved_1f1b"),
    Parallel(schedule="zero_bubble"),
    Parallel(zero=0),
    Parallel(recompute="full"),
)


def _instances():
    rng = random.Random(11)
    out = []
    for i in range(24):
        heads = rng.choice([8, 16])
        hidden = heads * 64
        moe = i % 3 == 2
        graph = transformer_graph(
            rng.choice([4, 8]),
            hidden,
            heads,
            rng.choice([heads, heads // 2]),
            4 * hidden,
            8000,
            rng.choice([1024, 4096]),
            1,
            experts=8 if moe else 0,
            top_k=2 if moe else 0,
            name=f"g{i}",
        )
        pins = PINS[i % len(PINS)]
        out.append(
            pytest.param(
                graph, CLUSTERS[i % len(CLUSTERS)], rng.choice([16, 32, 64]), pins, id=f"{i}"
            )
        )
    return out


@pytest.mark.parametrize("graph,make_cluster,global_batch,pins", _instances())
def test_every_planned_configuration_is_one_the_runtime_runs(
    graph, make_cluster, global_batch, pins
):
    try:
        plan = meshplan.plan(
            graph,
            cluster=make_cluster(),
            global_batch=global_batch,
            parallel=pins,
            time_limit_s=5,
        )
    except meshplan.InfeasibleError:
        pytest.skip("nothing fits with these pins")
    check_plan(plan)  # raises RuntimePlanError on a plan the runtime would refuse


def test_check_plan_refuses_what_the_runtime_cannot_run():
    import dataclasses

    from tests.runtime.test_parity_pipeline import uneven_plan

    ok = uneven_plan(2, {"fast": 3, "slow": 1}, dp=2, micro_batch=2, global_batch=8)
    check_plan(ok)
    zero3 = dataclasses.replace(ok, parallel=dataclasses.replace(ok.parallel, zero=3))
    with pytest.raises(RuntimePlanError, match="ZeRO-3"):
        check_plan(zero3)


def test_check_plan_refuses_micro_batch_counts_the_schedule_cannot_run():
    """A hand-edited plan whose pipelines get fewer micro-batches than 1F1B's stages (the
    global batch lowered after planning), or whose uneven shares give one group such a count,
    is refused in one line naming the rule (`ir.microbatch_problem`), before any process
    starts; the same plan under GPipe runs."""
    import dataclasses

    from tests.runtime.harness import make_plan
    from tests.runtime.test_parity_pipeline import uneven_plan

    ok = make_plan(2, pp=2, micro_batch=2, global_batch=4, schedule="1f1b")
    check_plan(ok)
    short = dataclasses.replace(ok, parallel=dataclasses.replace(ok.parallel, global_batch=2))
    rule = r"schedule '1f1b' needs at least pp=2 micro-batches per pipeline"
    with pytest.raises(RuntimePlanError, match=rule) as err:
        check_plan(short)
    assert "\n" not in str(err.value)
    p = dataclasses.replace(short.parallel, schedule="gpipe")
    check_plan(dataclasses.replace(short, parallel=p))
    # uneven shares: the slow group's pipeline runs 1 micro-batch over 2 stages
    pp2 = dict(dp=2, pp=2, micro_batch=1, global_batch=4)
    with pytest.raises(RuntimePlanError, match=rule):
        check_plan(uneven_plan(4, {"fast": 3, "slow": 1}, **pp2))
    check_plan(uneven_plan(4, {"fast": 2, "slow": 2}, **pp2))
    # interleaved 1F1B: 5 micro-batches over pp=2 are 2 rounds and a remainder
    interleaved = dict(pp2, global_batch=8, schedule="interleaved_1f1b")
    with pytest.raises(RuntimePlanError, match="whole rounds"):
        check_plan(uneven_plan(4, {"fast": 5, "slow": 3}, **interleaved))
