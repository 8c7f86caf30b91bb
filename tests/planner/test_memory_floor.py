"""The search's first memory check (`memory.summed_states`, `least_peak`, `holds_states`): the
model's states over a configuration's ranks, averaged. It decides without building a stage
that a configuration, a layout of step 2b or a whole device group cannot hold the model, so
it must never turn away what fits. Oracles: the per-stage memory model (`Pricer.stage_memory`)
on every split of the layers, the family's own split search, and the search with the check
switched off."""

from __future__ import annotations

import dataclasses
import itertools
import math

import meshplan.solver as solver_mod
import meshplan.solver_layouts as layouts_mod
import meshplan.solver_screen as screen_mod
import pytest
from meshplan.cost_model import pricer_for
from meshplan.cost_model.memory import holds_states, least_peak, summed_states
from meshplan.ir import Cluster, DeviceGroup, Parallel, Recompute
from meshplan.passes.partition import stages_of
from meshplan.solver import InfeasibleError, solve
from meshplan.solver_bounds import _least_peak
from meshplan.solver_candidates import enumerate_families
from meshplan.solver_layouts import _Layouts, layouts
from meshplan.solver_objective import Objective, _Scorer, _Work
from meshplan.solver_screen import _ScreenMemo

from tests.cost_model.test_stage_tp_layouts import NVLINK2, V100_16
from tests.synthetic import A100_40, IB_HDR, NVLINK3, transformer_graph


def _compositions(graph, pp: int):
    """Every split of the graph's layers into pp stages, as unit ranges."""
    n = len(graph.layer_units)
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        yield stages_of(graph, tuple(b - a for a, b in itertools.pairwise(bounds)))


def _least_fullest(pricer, graph, c) -> int:
    """The memory model's oracle: the least, over every split of the layers, of the peak of
    the split's fullest stage with one micro-batch in flight (the least any schedule holds)."""
    return min(
        max(
            pricer.stage_memory(
                pricer.costs.composition(a, b), c.stage_of(), dp=c.dp, zero=c.zero
            ).peak(1)[0]
            for a, b in split
        )
        for split in _compositions(graph, c.pp)
    )


def _tight_cluster(v100_nodes: int = 2) -> Cluster:
    """One node of 4 A100-40GB beside `v100_nodes` nodes of 4 V100-16GB, one HDR NIC each."""
    return Cluster(
        name="a100x4+v100",
        groups=(
            DeviceGroup("a100", A100_40, 1, 4, "nvlink3", IB_HDR.name, nics_per_node=1),
            DeviceGroup("v100", V100_16, v100_nodes, 4, "nvlink2", IB_HDR.name, nics_per_node=1),
        ),
        links=(NVLINK3, NVLINK2, IB_HDR),
    )


@pytest.mark.parametrize("experts", [0, 4])
def test_least_peak_is_below_the_fullest_stage_of_every_split(experts):
    """For every configuration of the cluster (dense and MoE, every ZeRO stage, TP, CP, EP,
    PP), the bound is at most the peak of the fullest stage of every split of the layers, with
    one micro-batch in flight (the least any schedule holds)."""
    graph = transformer_graph(6, 2048, 16, 16, 8192, 32000, 2048, 1, "float16", experts=experts,
                              top_k=2 if experts else 0)  # fmt: skip
    cluster = _tight_cluster()
    pricer = pricer_for(graph, cluster)
    checked = tight = 0
    for fam in enumerate_families(graph, cluster, Parallel(), 32):
        for _, c in fam.members:
            views = [c.view(g) for g, _ in c.group_tp] or [c]
            for v in views:
                least = _least_peak(pricer, v)
                fullest = _least_fullest(pricer, graph, v)
                assert least <= fullest + 16, (v, least, fullest)
                checked += 1
                tight += least > 0.9 * fullest
    assert checked > 500
    assert tight > 0  # the bound is close somewhere (ZeRO-3, one stage)


def test_summed_states_by_hand():
    """Hand-derived: 1,000 dense parameters in mixed precision (2 + 2 + 12 bytes) over 4
    data-parallel copies: ZeRO-0 holds 4 x 16, ZeRO-1 4 x 4 + 12, ZeRO-2 4 x 2 + 14, ZeRO-3
    16 bytes each; 800 expert parameters at ep 2 are held by 2 copies."""
    for zero, per in [(0, 64), (1, 28), (2, 22), (3, 16)]:
        assert summed_states(1000, 0, shards=4, ep=1, zero=zero) == 1000 * per
    assert summed_states(0, 800, shards=4, ep=2, zero=0) == 800 * 32
    assert summed_states(0, 800, shards=4, ep=2, zero=3) == 800 * 16
    # 8 ranks holding 16,000 bytes: 1.1 x 2,000 + 1 GiB at least on the fullest
    assert least_peak(16_000, 8) == pytest.approx(1.1 * 2000 + 2**30)
    assert holds_states(1e9, [(2, 2**30 + 0.55e9)])
    assert not holds_states(1e9, [(2, 2**30 + 0.54e9)])


def test_layouts_turned_away_have_no_split_that_fits():
    """Every layout of step 2b's family that `_Layouts.may_hold` turns away has no split
    that fits (the family's own split search, with its per-stage memory checks), and some
    layouts are turned away: a 24-layer 4096-wide model (5.2B parameters, 84 GB of states in
    mixed precision) on 4 A100-40GB and 8 V100-16GB, where a replica needs a good part of
    the cluster."""
    graph = transformer_graph(24, 4096, 32, 32, 4 * 4096, 50257, 2048, 1, "float16")
    pricer = pricer_for(graph, _tight_cluster())
    cache = _Layouts(graph, pricer)
    pins = Parallel(zero=0, sequence_parallel=False, micro_batch=1)
    held = refused = 0
    for _, _, lay in layouts(cache, pins, 32, list(Recompute), sp=False):
        if cache.may_hold(lay):
            held += 1
        else:
            refused += 1
            assert cache.split(lay) is None, lay
    assert refused > 0 and held > 0


def test_search_and_refusal_unchanged_without_the_check(monkeypatch):
    """The check only saves work: with it switched off (every bound 0, every layout and group
    held), the search returns the same plan on a memory-tight mixed cluster where the V100
    group alone cannot hold the model (the 5.2B model above on 4 A100-40GB + 4 V100-16GB), and
    the same refusal, naming the same least need, where nothing fits (1 A100 + 2 V100)."""
    graph = transformer_graph(24, 4096, 32, 32, 4 * 4096, 50257, 2048, 1, "float16")
    cluster = _tight_cluster(v100_nodes=1)
    pricer = pricer_for(graph, cluster)
    least = summed_states(*pricer.model_params(), shards=1, ep=1, zero=3)
    a100, v100 = cluster.groups
    assert holds_states(least, [(a100.num_gpus, a100.gpu.memory_bytes)])
    assert not holds_states(least, [(v100.num_gpus, v100.gpu.memory_bytes)])
    small = dataclasses.replace(
        cluster,
        groups=(
            dataclasses.replace(a100, gpus_per_node=1),
            dataclasses.replace(v100, gpus_per_node=2),
        ),
    )

    def run():
        got = solve(graph, cluster, Parallel(), global_batch=32, time_limit_s=60)
        with pytest.raises(InfeasibleError) as refused:
            solve(graph, small, Parallel(), global_batch=32, time_limit_s=60)
        return got, str(refused.value)

    with_check, refusal = run()
    assert with_check.status == "optimal"
    assert "needs" in refusal
    monkeypatch.setattr(screen_mod, "_least_peak", lambda *a, **k: 0.0)
    monkeypatch.setattr(layouts_mod._Layouts, "may_hold", lambda self, lay: True)
    monkeypatch.setattr(solver_mod, "holds_states", lambda *a: True)
    without, refusal_without = run()
    assert without.status == "optimal"
    assert with_check.work < without.work
    assert with_check.parallel == without.parallel
    assert with_check.stages == without.stages
    assert with_check.prediction.step_time_s == without.prediction.step_time_s
    assert refusal == refusal_without


def test_fits_nowhere_only_where_no_split_fits_on_any_gpu_it_may_use():
    """`_ScreenMemo.fits_nowhere` against the memory model: wherever it says so, the fullest
    stage of every split passes the memory of every group the configuration may use (each
    group's own degree under per-group TP, where either group failing rules it out). It
    fires often, and some configurations fit the A100-40GB only: compared with the V100's
    16 GB instead of the largest GPU, it would refuse those. A 4-layer 8192-wide model
    (3.9B parameters) on 4 A100-40GB + 8 V100-16GB."""
    graph = transformer_graph(4, 8192, 64, 8, 28672, 32000, 2048, 1, "float16")
    cluster = _tight_cluster()
    pricer = pricer_for(graph, cluster)
    memo = _ScreenMemo(
        pricer, graph, 32, _Work.starting_now(1e9), _Scorer(Objective(), cluster), math.inf
    )
    memory = {g.name: g.gpu.memory_bytes for g in cluster.groups}
    fired = big_only = 0
    for fam in enumerate_families(graph, cluster, Parallel(), 32):
        for _, c in fam.members:
            views = [(g, c.view(g)) for g, _ in c.group_tp] or [(g, c) for g in memo.groups(c)]
            fits = {}
            for g, v in views:
                fits[g] = _least_fullest(pricer, graph, v) <= memory[g]
            possible = all(fits.values()) if c.group_tp else any(fits.values())
            if memo.fits_nowhere(c):
                fired += 1
                assert not possible, c
            elif not c.group_tp and fits.get("a100") and not fits.get("v100"):
                big_only += 1
    assert fired > 50 and big_only > 0


def test_single_group_seed_skips_exactly_the_groups_that_cannot_hold_the_model():
    """On 4 A100-40GB + 4 V100-16GB with the 5.2B model: the V100 group alone cannot hold
    its states (its own search finds nothing), the A100 group can (its own search finds a
    plan), and the seed is that group's plan."""
    from meshplan.solver import _single_group_seed
    from meshplan.solver_objective import _Work as Work

    graph = transformer_graph(24, 4096, 32, 32, 4 * 4096, 50257, 2048, 1, "float16")
    cluster = _tight_cluster(v100_nodes=1)
    for g in cluster.groups:
        alone = dataclasses.replace(cluster, groups=(g,))
        if g.name == "v100":
            with pytest.raises(InfeasibleError):
                solve(graph, alone, Parallel(), global_batch=32)
        else:
            assert solve(graph, alone, Parallel(), global_batch=32).status == "optimal"
    seed, floor = _single_group_seed(
        graph, cluster, Parallel(), 32, Work.starting_now(60), "float16"
    )
    assert seed is not None and math.isfinite(floor)
    assert {g for st in seed.stages for g, _ in st.replicas} == {"a100"}


def test_chains_turned_away_have_no_split_that_fits():
    """Three groups (step 2b's chains, `Chain`): every chain `may_hold` turns away has no
    split that fits (`solver_chains.split`), on 4 A100-40GB + 8 V100-16GB + 8 T4 with a
    12-layer 6144-wide model in fp32 (5.8B parameters, 93 GB of states a replica), and some
    are turned away."""
    from meshplan.solver_chains import chains
    from meshplan.solver_chains import split as chain_split

    from tests.planner.test_solver_chains import GLOBAL_BATCH, PINS, _three_groups

    _, cluster = _three_groups()
    graph = transformer_graph(12, 6144, 48, 48, 4 * 6144, 50257, 2048, 1)
    cache = _Layouts(graph, pricer_for(graph, cluster, "float32"))
    held = refused = 0
    for _, _, chain in chains(cache, PINS, GLOBAL_BATCH, [Recompute.NONE], False, math.inf):
        if cache.may_hold(chain):
            held += 1
        else:
            refused += 1
            assert chain_split(cache, chain) is None, chain
    assert refused > 0 and held > 0
