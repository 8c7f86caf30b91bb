"""Each validity rule once: every layer that asks a rule reports the rule's own words.

`meshplan.ir.rules` states every rule that makes a configuration impossible as one function
returning the reason. Four layers ask them: the solver's candidate enumeration
(`enumerate_candidates`, via `meshplan.plan`), `estimate`'s `check_config`, the simulator's
`check_parallel` (`predict`) and the runtime's `check_plan` (a plan file). Each row below is
one rule: a configuration that breaks it (and only it, for the layers listed), the reason the
rule gives for it, checked first against a hand-written expectation (the oracle: the rule's
arithmetic done by hand), then against what each layer that asks the rule raises. A layer
that stops asking a rule, or words it its own way, fails its row.

Unit tier: one small synthetic model, no ranks.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import meshplan
import pytest
from meshplan.cost_model.simulate import check_parallel
from meshplan.ir import Parallel, rules
from meshplan.runtime import RuntimePlanError, check_plan
from meshplan.solver import InfeasibleError

from tests.synthetic import h100_cluster, transformer_graph

# 4 layers, 8 heads, 4 K/V heads, sequence 1024; the MoE has 8 experts.
DENSE = transformer_graph(4, 512, 8, 4, 2048, 8000, 1024, 1, name="dense")
SIX = transformer_graph(4, 384, 6, 6, 1536, 8000, 1024, 1, name="six")  # 6 heads
MOE = transformer_graph(4, 512, 8, 4, 2048, 8000, 1024, 1, experts=8, top_k=2, name="moe")
CLUSTER = h100_cluster(1)  # 8 GPUs in one node
GLOBAL_BATCH = 16


@cache
def _plan(pins: Parallel, moe: bool = False):
    """A real plan on 8 H100s (its runtime check passes), to edit one field of."""
    graph = MOE if moe else DENSE
    plan = meshplan.plan(graph, cluster=CLUSTER, global_batch=GLOBAL_BATCH, parallel=pins)
    check_plan(plan)
    return plan


def _edited(pins: Parallel, moe: bool = False, **change):
    """The plan of `pins` with fields of its Parallel changed (`seq_len`: its model's)."""
    plan = _plan(pins, moe)
    model = plan.model
    if "seq_len" in change:
        model = dataclasses.replace(model, seq_len=change.pop("seq_len"))
    parallel = dataclasses.replace(plan.parallel, **change)
    return dataclasses.replace(plan, model=model, parallel=parallel)


def _full(**kw) -> Parallel:
    """A complete configuration on the 8 GPUs: dp 8 unless changed."""
    base = dict(
        dp=8,
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        micro_batch=1,
        global_batch=GLOBAL_BATCH,
        recompute="none",
        zero=0,
        schedule="1f1b",
        sequence_parallel=False,
    )
    return Parallel(**{**base, **kw})


# Layers: "plan" = the candidate enumeration (meshplan.plan with the pins), "estimate" =
# check_config, "predict" = check_parallel, "runtime" = check_plan of an edited real plan.
ROWS = [
    dict(
        rule=lambda: rules.tp_heads_problem(3, 8, 4),
        reason="tp=3 does not divide the model's heads (8)",
        plan=(DENSE, Parallel(tp=3)),
        estimate=(DENSE, Parallel(global_batch=GLOBAL_BATCH, tp=3, dp=2, pp=1, cp=1)),
    ),
    dict(
        rule=lambda: rules.tp_heads_problem(8, 8, 4),
        reason="tp=8 does not divide the model's kv_heads (4)",
        plan=(DENSE, Parallel(tp=8)),
        estimate=(DENSE, Parallel(global_batch=GLOBAL_BATCH, tp=8, dp=1, pp=1, cp=1)),
    ),
    dict(
        rule=lambda: rules.ep_experts_problem(2, 0),
        reason="ep=2 but the model has no experts",
        plan=(DENSE, Parallel(ep=2)),
        estimate=(DENSE, Parallel(global_batch=GLOBAL_BATCH, ep=2, dp=8, tp=1, pp=1, cp=1)),
    ),
    dict(
        rule=lambda: rules.ep_experts_problem(3, 8),
        reason="ep=3 does not divide the model's experts (8)",
        plan=(MOE, Parallel(ep=3)),
        estimate=(MOE, Parallel(global_batch=GLOBAL_BATCH, ep=3, dp=6, tp=1, pp=1, cp=1)),
    ),
    dict(
        rule=lambda: rules.cp_sequence_problem(3, 1024),
        reason="cp=3 does not divide the sequence length (1024)",
        plan=(DENSE, Parallel(cp=3)),
        estimate=(DENSE, Parallel(global_batch=GLOBAL_BATCH, cp=3, dp=2, tp=1, pp=1)),
    ),
    dict(
        rule=lambda: rules.cp_sequence_problem(4, 1022),
        reason="cp=4 does not divide the sequence length (1022)",
        runtime=(Parallel(cp=4, dp=2, tp=1), False, dict(seq_len=1022)),
    ),
    dict(
        rule=lambda: rules.cp_heads_problem(6, 4),
        reason="cp attention 'heads' needs the query heads divisible by cp, got heads=6, cp=4",
        plan=(SIX, Parallel(cp=4, cp_mode="heads")),
        estimate=(
            SIX,
            Parallel(global_batch=GLOBAL_BATCH, cp=4, dp=2, tp=1, pp=1, cp_mode="heads"),
        ),
    ),
    dict(
        rule=lambda: rules.cp_usp_problem(6, 4, 4),
        reason="cp_head_degree=4 must divide cp=4 and lie strictly between 1 and cp",
        plan=(SIX, Parallel(cp=4, cp_mode="usp", cp_head_degree=4)),
        estimate=(
            SIX,
            Parallel(
                global_batch=GLOBAL_BATCH,
                cp=4,
                dp=2,
                tp=1,
                pp=1,
                cp_mode="usp",
                cp_head_degree=4,
            ),
        ),
    ),
    dict(
        rule=lambda: rules.cp_usp_problem(0, 4, 3),
        reason="cp_head_degree=3 must divide cp=4",
        runtime=(Parallel(cp=4, dp=2, tp=1), False, dict(cp_mode="usp", cp_head_degree=3)),
    ),
    dict(
        rule=lambda: rules.cp_head_degree_problem(
            Parallel(cp=4, cp_mode="heads", cp_head_degree=2), 8
        ),
        reason="cp_head_degree needs cp attention 'usp'",
        estimate=(
            DENSE,
            Parallel(
                global_batch=GLOBAL_BATCH,
                cp=4,
                dp=2,
                tp=1,
                pp=1,
                cp_mode="heads",
                cp_head_degree=2,
            ),
        ),
        runtime=(Parallel(cp=4, dp=2, tp=1), False, dict(cp_mode="heads", cp_head_degree=2)),
    ),
    dict(
        rule=lambda: rules.cp_shares_problem((600, 400), 2, 1024),
        reason="cp_shares [600, 400] sum to 1000 tokens, not the sequence length (1024)",
        estimate=(
            DENSE,
            Parallel(global_batch=GLOBAL_BATCH, cp=2, dp=4, tp=1, pp=1, cp_shares=(600, 400)),
        ),
        predict=(DENSE, _full(dp=4, cp=2, cp_shares=(600, 400))),
        runtime=(Parallel(cp=2, dp=4, tp=1), False, dict(cp_shares=(600, 400))),
    ),
    dict(
        rule=lambda: rules.cp_head_shares_problem((3, 2), 2, 8),
        reason="cp_head_shares [3, 2] sum to 5, not the 8 query heads",
        estimate=(
            DENSE,
            Parallel(
                global_batch=GLOBAL_BATCH,
                cp=2,
                dp=4,
                tp=1,
                pp=1,
                cp_mode="heads",
                cp_head_shares=(3, 2),
            ),
        ),
        predict=(DENSE, _full(dp=4, cp=2, cp_mode="heads", cp_head_shares=(3, 2))),
    ),
    dict(
        rule=lambda: rules.cp_split_problem(
            Parallel(cp=2, cp_mode="ring", cp_shares=(600, 424)), 1024, 8
        ),
        reason=(
            "cp_shares with cp attention 'ring' is not run (ring chunks travel in equal "
            "buffers); use cp attention 'allgather' or 'heads'"
        ),
        estimate=(
            DENSE,
            Parallel(
                global_batch=GLOBAL_BATCH,
                cp=2,
                dp=4,
                tp=1,
                pp=1,
                cp_mode="ring",
                cp_shares=(600, 424),
            ),
        ),
        predict=(DENSE, _full(dp=4, cp=2, cp_mode="ring", cp_shares=(600, 424))),
        runtime=(
            Parallel(cp=2, dp=4, tp=1),
            False,
            dict(cp_mode="ring", cp_shares=(600, 424)),
        ),
    ),
    dict(
        rule=lambda: rules.pp_layers_problem(8, 4),
        reason="pp=8 exceeds the model's 4 layers (pp <= layers)",
        plan=(DENSE, Parallel(pp=8)),
        estimate=(DENSE, Parallel(global_batch=GLOBAL_BATCH, pp=8, dp=1, tp=1, cp=1)),
    ),
    dict(
        rule=lambda: rules.batch_split_problem(16, 8, 4),
        reason="global_batch=16 is not divisible by dp*micro_batch = 8*4 = 32",
        plan=(DENSE, Parallel(dp=8, micro_batch=4)),
        estimate=(
            DENSE,
            Parallel(global_batch=GLOBAL_BATCH, dp=8, micro_batch=4, tp=1, pp=1, cp=1),
        ),
        predict=(DENSE, _full(micro_batch=4)),
        runtime=(Parallel(dp=8, tp=1), False, dict(micro_batch=4)),
    ),
    dict(
        rule=lambda: rules.batch_split_problem(16, 3),
        reason="global_batch=16 is not divisible by dp=3",
        plan=(DENSE, Parallel(dp=3)),
    ),
    dict(
        rule=lambda: rules.ep_dp_problem(4, 2),
        reason="ep=4 does not divide dp=2 (expert ranks reuse dp ranks)",
        plan=(MOE, Parallel(ep=4, dp=2, tp=1)),
        estimate=(MOE, Parallel(global_batch=GLOBAL_BATCH, ep=4, dp=2, tp=1, pp=1, cp=1)),
        predict=(MOE, _full(ep=4, dp=2)),
        runtime=(Parallel(dp=2, tp=4), False, dict(ep=4)),
    ),
    dict(
        rule=lambda: rules.ep_tp_problem(2, 2, False),
        reason="ep > 1 with tp > 1 needs sequence parallelism (each tp rank routes its own tokens)",
        plan=(MOE, Parallel(ep=2, tp=2, sequence_parallel=False)),
        estimate=(
            MOE,
            Parallel(
                global_batch=GLOBAL_BATCH, ep=2, tp=2, dp=4, pp=1, cp=1, sequence_parallel=False
            ),
        ),
        predict=(MOE, _full(ep=2, tp=2, dp=4)),
        runtime=(Parallel(dp=4, tp=2), False, dict(ep=2, sequence_parallel=False)),
    ),
    dict(
        rule=lambda: rules.microbatch_problem("1f1b", 4, 2),
        reason="schedule '1f1b' needs at least pp=4 micro-batches per pipeline",
        plan=(DENSE, Parallel(pp=4, dp=2, tp=1, cp=1, micro_batch=4, schedule="1f1b")),
        estimate=(
            DENSE,
            Parallel(
                global_batch=GLOBAL_BATCH, pp=4, dp=2, tp=1, cp=1, micro_batch=4, schedule="1f1b"
            ),
        ),
        runtime=(Parallel(pp=4, dp=2, tp=1, schedule="1f1b"), False, dict(micro_batch=4)),
    ),
    dict(
        rule=lambda: rules.zero_bubble_problem("zero_bubble", 2, 2),
        reason="schedule 'zero_bubble' (ZB-V) needs at least 2*pp - 1 = 3 micro-batches",
        estimate=(
            DENSE,
            Parallel(
                global_batch=GLOBAL_BATCH,
                pp=2,
                dp=4,
                tp=1,
                cp=1,
                micro_batch=2,
                schedule="zero_bubble",
            ),
        ),
        predict=(DENSE, _full(pp=2, dp=4, micro_batch=2, schedule="zero_bubble")),
    ),
    dict(
        rule=lambda: rules.zero_bubble_zero3_problem("zero_bubble", 2, 3),
        reason="schedule zero_bubble with ZeRO-3 gives wrong gradients",
        plan=(DENSE, Parallel(pp=2, dp=4, tp=1, zero=3, schedule="zero_bubble")),
        runtime=(Parallel(pp=2, dp=4, tp=1, zero=0, schedule="zero_bubble"), False, dict(zero=3)),
    ),
    dict(
        rule=lambda: rules.schedule_problem(Parallel(pp=1, schedule="zero_bubble")),
        reason="schedule zero_bubble needs a pipeline (pp >= 2), got pp=1",
        plan=(DENSE, Parallel(pp=1, schedule="zero_bubble")),
        estimate=(
            DENSE,
            Parallel(global_batch=GLOBAL_BATCH, pp=1, dp=8, tp=1, cp=1, schedule="zero_bubble"),
        ),
        runtime=(Parallel(dp=8, tp=1), False, dict(schedule="zero_bubble")),
    ),
    dict(
        rule=lambda: rules.schedule_problem(Parallel(virtual_stages=2, schedule="1f1b")),
        reason="virtual_stages=2 needs schedule interleaved_1f1b, got 1f1b",
        plan=(DENSE, Parallel(virtual_stages=2, schedule="1f1b")),
        estimate=(
            DENSE,
            Parallel(
                global_batch=GLOBAL_BATCH, pp=2, dp=4, tp=1, cp=1, virtual_stages=2, schedule="1f1b"
            ),
        ),
        runtime=(Parallel(pp=2, dp=4, tp=1, schedule="1f1b"), False, dict(virtual_stages=2)),
    ),
]
LAYERS = ("plan", "estimate", "predict", "runtime")


def _ids():
    return [row["reason"].split(" (")[0][:48] for row in ROWS]


@pytest.mark.parametrize("row", ROWS, ids=_ids())
def test_the_rule_gives_its_reason(row):
    """The oracle: the reason written by hand from the rule's arithmetic."""
    assert row["rule"]().startswith(row["reason"])


@pytest.mark.parametrize(
    "row,layer",
    [
        pytest.param(row, layer, id=f"{name}-{layer}")
        for row, name in zip(ROWS, _ids())
        for layer in LAYERS
        if layer in row
    ],
)
def test_every_layer_that_asks_the_rule_reports_its_words(row, layer):
    reason = row["rule"]()
    if layer == "plan":
        graph, pins = row[layer]
        with pytest.raises(InfeasibleError) as e:
            meshplan.plan(graph, cluster=CLUSTER, global_batch=GLOBAL_BATCH, parallel=pins)
        assert str(e.value) == f"no plan: {reason}"
    elif layer == "estimate":
        graph, p = row[layer]
        with pytest.raises(ValueError) as e:
            meshplan.estimate(graph, cluster=CLUSTER, parallel=p)
        assert str(e.value) == reason
    elif layer == "predict":
        graph, p = row[layer]
        with pytest.raises(ValueError) as e:
            check_parallel(graph, CLUSTER, p, ())
        assert str(e.value) == reason
    else:
        pins, moe, change = row[layer]
        with pytest.raises(RuntimePlanError) as e:
            check_plan(_edited(pins, moe, **change))
        assert str(e.value) == f"runtime: {reason}"


def test_every_rule_of_the_module_has_a_row():
    """A rule added to `ir.rules` without a row here fails."""
    named = {
        name for name in dir(rules) if name.endswith("_problem") and callable(getattr(rules, name))
    }
    # the rule each row's lambda calls
    covered = {n for row in ROWS for n in row["rule"].__code__.co_names if n.endswith("_problem")}
    assert named == covered, named ^ covered


def test_a_cluster_given_where_the_inputs_go_is_refused():
    """`plan(graph, cluster)` would plan on the default cluster (a Graph ignores its inputs)."""
    for call in (meshplan.plan, meshplan.estimate):
        with pytest.raises(ValueError, match="pass the cluster as cluster="):
            call(DENSE, CLUSTER)
