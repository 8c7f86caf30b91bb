"""`enumerate_families` groups the candidates as the search's queue needs them: every
knob but ZeRO stage and schedule shared within a family (`solver_candidates.Family`).

Oracle: the flat candidate list grouped by hand, by each candidate's stage config, pp, dp
and per-group TP, families in order of their first member, and each family's loosest member
found by building every member."""

from __future__ import annotations

import pytest
from meshplan.ir import Parallel
from meshplan.ir.parallel import chunks_of
from meshplan.solver import enumerate_candidates, enumerate_families, flatten
from meshplan.solver_candidates import count

from tests.planner.test_multi_group_bound import mixed_cluster, transformer_graph


def grouped_by_hand(cands):
    families: dict[tuple, list[tuple[int, object]]] = {}
    for i, c in enumerate(cands):
        families.setdefault((c.stage_of(), c.pp, c.dp, c.group_tp), []).append((i, c))
    return list(families.values())


@pytest.mark.parametrize(
    "pinned, quantize",
    [(Parallel(), False), (Parallel(), True), (Parallel(zero=3), False), (Parallel(pp=2), False)],
)
def test_families_are_the_candidates_grouped_by_every_knob_but_zero_and_schedule(pinned, quantize):
    graph = transformer_graph(4, 512, 8, 8, 2048, 8000, 1024, 1)
    cluster = mixed_cluster(2, 2, wan=True)
    families = enumerate_families(graph, cluster, pinned, 16, quantize=quantize)
    flat = enumerate_candidates(graph, cluster, pinned, 16, quantize=quantize)
    assert flatten(families) == flat
    assert count(families) == len(flat)
    assert [list(f.members) for f in families] == grouped_by_hand(flat)
    assert any(f.group_tp for f in families) == (pinned.zero in (None, 0))
    for f in families:
        members = f.members
        assert [i for i, _ in members] == sorted(i for i, _ in members)
        assert f.first == members[0][0]
        assert len(f.template) == len(members)
        assert f.gpus == members[0][1].gpus
        by_hand = min(members, key=lambda ic: (ic[1].fill, ic[1].zero > 2, ic[0]))[1]
        assert f.loosest() == by_hand
        assert f.knobs == [(c.fill, c.zero) for _, c in members]
        assert [chunks_of(s, v) for _, _, _, s, v in f.template] == [c.chunks for _, c in members]
        assert f.loosest_knobs == (by_hand.fill, by_hand.zero)
        assert all(f.tp_of(g) == members[0][1].tp_of(g) for g in ("a", "b", "h100", "a100"))


@pytest.mark.parametrize("wan", [False, True])
def test_the_screens_batch_bound_equals_each_familys_own(wan):
    # `_ScreenMemo.family_bounds` (the screen's first pass) gives each family exactly the
    # bound `family_bound` gives it alone, which is `free_bound` of its loosest member.
    import math

    from meshplan.cost_model.pricer import pricer_for
    from meshplan.solver_bounds import _split_free_bound
    from meshplan.solver_objective import Objective, _Scorer, _Work
    from meshplan.solver_screen import _ScreenMemo

    graph = transformer_graph(4, 512, 8, 8, 2048, 8000, 1024, 1)
    cluster = mixed_cluster(2, 2, wan=wan)
    families = enumerate_families(graph, cluster, Parallel(), 16)
    pricer = pricer_for(graph, cluster)

    def memo():
        return _ScreenMemo(
            pricer, graph, 16, _Work.starting_now(100.0), _Scorer(Objective(), cluster), math.inf
        )

    batch = memo().family_bounds(families)
    one, each = memo(), []
    for f in families:
        got = one.family_bound(f)
        c = f.loosest()  # the member built, bounded as a candidate
        lb = _split_free_bound(pricer, c, one.groups(c), one.microbatches(c), one.cache)
        by_member = None if math.isinf(lb) else (lb * one.factor(c), one.factor(c))
        assert got == by_member
        if got is not None:
            each.append((got[0], f))
    assert batch == each
    assert len(batch) > 10
