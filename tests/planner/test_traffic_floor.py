"""The screen's second bound of a (configuration, split) pair, with the traffic every
placement carries (`solver_screen._ScreenMemo.pair_bound_with_traffic`: the least exposed DP
traffic of its ranks and the least hand-offs of its costliest boundary, added to the
memory-free pipeline bound), never exceeds the price of any placement of the pair.

Oracle: exhaustive enumeration. Every lock-step placement and every group-pure placement with
uneven shares of each pair (tests/planner/test_solver.py's enumerators) priced by
`evaluate` over the pair's tables; on small mixed clusters, one behind a WAN, with slow
Ethernet between nodes (where the traffic dominates and the bound rises most) and with
lossless coding of DP traffic; ZeRO-3 pairs included (their gathers and reduce-scatters
every micro-batch, the first unit's inside the stage time)."""

from __future__ import annotations

import math

import pytest
from meshplan.cost_model import evaluate, plan_tables, pricer_for
from meshplan.cost_model.compression import CommOptions
from meshplan.ir import Parallel
from meshplan.passes.partition import replica_capacity, stages_of
from meshplan.solver_candidates import enumerate_candidates
from meshplan.solver_objective import Objective, _Scorer, _Work
from meshplan.solver_screen import _ScreenMemo

from tests.planner.test_multi_group_bound import mixed_cluster, transformer_graph
from tests.planner.test_solver import _placements, _share_placements
from tests.synthetic import three_type_cluster


@pytest.mark.parametrize(
    "wan, comm, pinned",
    [
        (False, None, Parallel()),
        (True, None, Parallel()),
        (True, CommOptions(lossless=True), Parallel()),
        (True, None, Parallel(pp=2, schedule="interleaved_1f1b", virtual_stages=2)),
        (True, None, Parallel(cp=2)),
        ("three types", None, Parallel()),  # shares over all three groups too
    ],
)
def test_the_traffic_bound_holds_for_every_placement(wan, comm, pinned):
    graph = transformer_graph(4, 512, 8, 8, 2048, 8000, 1024, 1)
    if wan == "three types":
        cluster = three_type_cluster(gpus_per_node=2)
    else:
        cluster = mixed_cluster(2, 2, wan=wan)
    pricer = pricer_for(graph, cluster, comm=comm)
    memo = _ScreenMemo(
        pricer, graph, 16, _Work.starting_now(1e3), _Scorer(Objective(), cluster), math.inf
    )
    checked = raised = checked3 = raised3 = 0
    for c in enumerate_candidates(graph, cluster, pinned, 16):
        if c.group_tp or c.dp > 8:
            continue
        for split in memo.splits(c)[:4]:
            bound = memo.pair_bound_with_traffic(c, split)
            assert bound >= memo.pair_bound(c, split) * (1 - 1e-12)
            tables = plan_tables(pricer, c.parallel(), stages_of(graph, split), memo.groups(c))
            cap = {g: replica_capacity(pricer.groups[g], c.tp, c.cp) for g in tables.groups}
            prices = [evaluate(tables, pl).step_time_s for pl in _placements(tables, cap)]
            prices += [
                evaluate(tables, pl, sh).step_time_s for pl, sh in _share_placements(tables, cap)
            ]
            if not prices:
                continue
            assert bound <= min(prices) * (1 + 1e-9), (c.describe(), split, bound, min(prices))
            lifted = bound > memo.pair_bound(c, split) * (1 + 1e-6)
            checked += 1
            raised += lifted
            if c.zero == 3:
                checked3 += 1
                raised3 += lifted
    assert checked > 20
    assert raised > checked // 4  # the traffic adds to most pairs' bounds here
    # ZeRO-3 gathers and reduces every micro-batch: its bound rises too (it did not before
    # the floor counted them)
    assert checked3 > 5 and raised3 > checked3 // 4, (checked3, raised3)


def test_a_pair_settled_by_its_hand_offs_is_not_priced_further():
    """`enough`: where the hand-offs alone lift the bound to it, the data-parallel part is left
    out (the screen's best plan only improves, so that settles the pair); asking for more
    later gives the whole floor, the same as a fresh memo's."""
    graph = transformer_graph(4, 512, 8, 8, 2048, 8000, 1024, 1)
    cluster = mixed_cluster(2, 2, wan=True)
    pricer = pricer_for(graph, cluster)

    def memo():
        scorer = _Scorer(Objective(), cluster)
        return _ScreenMemo(pricer, graph, 16, _Work.starting_now(1e3), scorer, math.inf)

    lazy, fresh = memo(), memo()
    settled = 0
    for c in enumerate_candidates(graph, cluster, Parallel(pp=2, dp=2), 16):
        if c.group_tp:
            continue
        for split in lazy.splits(c)[:2]:
            whole = fresh.pair_bound_with_traffic(c, split)
            enough = lazy.pair_bound(c, split) * 1.0001  # just above the bound without traffic
            got = lazy.pair_bound_with_traffic(c, split, enough)
            assert got <= whole * (1 + 1e-12)
            if got < whole * (1 - 1e-9):  # settled by the hand-offs: at least `enough`
                assert got >= enough
                settled += 1
            assert lazy.pair_bound_with_traffic(c, split) == whole
    assert settled > 0
