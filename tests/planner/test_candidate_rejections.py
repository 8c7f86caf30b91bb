"""Unit tier: when no configuration is left, the planner names the first constraint that left
nothing, in the enumeration's order (pinned values refused on their own, then
`solver_candidates.CONSTRAINTS`: world size, ep divides dp, ep with tp needs SP, batch,
schedule, ZB-V without ZeRO-3), then memory (the screen). Not the last rejection the loops saw:
a configuration rejected late does not hide that an earlier constraint passed nothing.

Each row's expected constraint is worked out by hand in its `why`; all on synthetic graphs,
8 H100s (one node of 8), no processes."""

from __future__ import annotations

import dataclasses

import pytest
from meshplan.ir import Parallel
from meshplan.solver import InfeasibleError, solve
from meshplan.solver_candidates import CONSTRAINTS, _Funnel

from tests.synthetic import H100, h100_cluster, transformer_graph

DENSE = transformer_graph(4, 512, 8, 8, 2048, 8000, 1024, 1, name="dense")  # 8 heads, 4 layers
WIDE = transformer_graph(4, 512, 16, 16, 2048, 8000, 1024, 1, name="wide")  # 16 heads
MOE = transformer_graph(2, 512, 8, 8, 2048, 8000, 1024, 1, experts=8, top_k=2, name="moe")
TINY_GPU = dataclasses.replace(H100, memory_bytes=2**30)  # 1 GiB: not even the embedding fits

# (graph, gpu, pinned, global_batch, expected text, why: the constraint, derived by hand)
ROWS = [
    (
        WIDE,
        H100,
        Parallel(tp=16),
        8,
        "tp=16 does not divide gpus_per_node=8",
        "tp divides the GPUs per node: 16 heads allow tp=16, but nodes hold 8 GPUs",
    ),
    (
        DENSE,
        H100,
        Parallel(tp=3),
        8,
        "tp=3 does not divide the model's heads (8)",
        "model fact: tp divides the 8 heads",
    ),
    (
        DENSE,
        H100,
        Parallel(ep=2),
        8,
        "ep=2 but the model has no experts",
        "model fact: a dense model has no experts to shard",
    ),
    (
        DENSE,
        H100,
        Parallel(dp=8),
        4,
        "global_batch=4 is not divisible by dp=8",
        "batch: 8 replicas cannot share 4 sequences",
    ),
    (
        DENSE,
        H100,
        Parallel(dp=16),
        16,
        "tp*pp*cp*dp = 1*1*1*16 = 16 GPUs in whole TP groups, but the cluster holds 8",
        "world size: even tp = pp = cp = 1 needs 16 GPUs for dp=16 (the loops' last rejection "
        "names tp=8, pp=4: not the smallest)",
    ),
    (
        DENSE,
        H100,
        Parallel(tp=8, pp=4),
        8,
        "tp*pp*cp = 8*4*1 = 32 GPUs for one pipeline in whole TP groups, but the cluster holds 8",
        "world size: one pipeline of 4 stages at tp=8 needs 32 GPUs, whatever dp",
    ),
    (
        MOE,
        H100,
        Parallel(dp=2, ep=4),
        8,
        "ep=4 does not divide dp=2",
        "ep divides dp: dp=2 fits (tp <= 2 at pp=2, tp <= 4 at pp=1), and no ep=4 group forms "
        "in 2 DP ranks (the loops' last rejection is tp=8, pp=2 not fitting: world size)",
    ),
    (
        MOE,
        H100,
        Parallel(ep=2, tp=2, sequence_parallel=False),
        8,
        "ep > 1 with tp > 1 needs sequence parallelism",
        "ep with tp needs SP: dp=2 (4 GPUs at tp=2) passes ep divides dp; SP is pinned off",
    ),
    (
        DENSE,
        H100,
        Parallel(pp=4, schedule="1f1b"),
        2,
        "schedule '1f1b' needs at least pp=4 micro-batches per pipeline (torch's Schedule1F1B), "
        "got 2",
        "schedule: 2 sequences give at most 2 micro-batches per pipeline, 1F1B needs pp=4 "
        "(the first rejected: dp=1, micro_batch=1, 2 micro-batches)",
    ),
    (
        DENSE,
        H100,
        Parallel(dp=8, schedule="zero_bubble"),
        8,
        "zero_bubble (ZB-V) needs pp >= 2 with 2*pp dividing the 4 layers and at least "
        "2*pp - 1 micro-batches (pp=1, 1 micro-batches)",
        "schedule: dp=8 fills the 8 GPUs only at tp = pp = cp = 1, and ZB-V needs pp >= 2 (the "
        "loops' last rejection is tp=8, pp=4 not fitting: world size)",
    ),
    (
        DENSE,
        H100,
        Parallel(zero=3, schedule="zero_bubble"),
        8,
        "schedule zero_bubble with ZeRO-3 gives wrong gradients",
        "ZB-V without ZeRO-3: pp=2 (2*pp = 4 divides the 4 layers; m = 8 >= 3 at dp=1) passes "
        "the schedule, then ZeRO-3 is pinned (the loops' last rejection is a schedule's: pp=1 "
        "at tp=8)",
    ),
    (
        DENSE,
        TINY_GPU,
        Parallel(),
        8,
        "no plan fits: the smallest configuration needs ",
        "memory: every constraint of the enumeration passes, and 1 GiB GPUs hold no stage",
    ),
]


@pytest.mark.parametrize(
    ("graph", "gpu", "pinned", "global_batch", "expected", "why"),
    ROWS,
    ids=[f"{i}-{row[5].split(':')[0]}" for i, row in enumerate(ROWS)],
)
def test_infeasible_names_the_first_constraint_that_left_nothing(
    graph, gpu, pinned, global_batch, expected, why
):
    with pytest.raises(InfeasibleError) as err:
        solve(graph, h100_cluster(1, gpu=gpu), pinned, global_batch=global_batch, time_limit_s=5)
    msg = str(err.value)
    assert "\n" not in msg
    assert expected in msg, why


def test_the_funnel_reports_the_first_constraint_nothing_passed():
    """A later constraint's rejection (recorded last) does not replace an earlier one's: the
    first constraint with no survivor is reported, with its first rejection."""
    funnel = _Funnel()
    for constraint in CONSTRAINTS[: CONSTRAINTS.index("ep divides dp")]:
        funnel.keep(constraint)
    funnel.reject("ep divides dp", "first ep reason")
    funnel.reject("ep divides dp", "second ep reason")
    funnel.reject("schedule", "a later reason")
    assert funnel.why_none() == "first ep reason"
    for constraint in CONSTRAINTS[:-1]:
        funnel.keep(constraint)
    funnel.reject("zb without zero3", "the last constraint's reason")
    assert funnel.why_none() == "the last constraint's reason"
    # nothing passed and nothing rejected: the enumeration found no configuration at all
    assert _Funnel().why_none() == "no configuration fits the cluster's GPU count"
