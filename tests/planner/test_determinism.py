"""A plan is a function of its inputs: the same bytes on an idle and a loaded machine, and
defaults (the global batch) derived from the model and cluster, small where they must be.

Unit tier (no GPU, one process plus busy-loop subprocesses). The same inputs are planned with
the machine idle and with busy loops on every core, under a budget small enough that the
search stops before it proves optimality (the case where a wall-clock limit made plans
differ run to run); the plan JSON must be the same bytes. Synthetic graphs
(tests/synthetic.py): no tracing, except the CPU training example's tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import meshplan
import pytest
from meshplan.api import MAX_SEQUENCES_PER_DEVICE, complete_parallel, default_global_batch
from meshplan.ir import Cluster, Parallel
from meshplan.solver import WALL_CLOCK_NOTE, solve

from tests.synthetic import A100_40, mixed_cluster, transformer_graph

GRAPH = transformer_graph(32, 4096, 32, 8, 14336, 128256, 4096, 1, name="8b")
# 4 H100 nodes beside 12 A100-40GB nodes at one site: many (configuration, split) pairs whose
# bounds are weak (crossing between the groups is cheap). Within 1.5 work units the search
# prices ~120 pairs and stops in the screen with a gap of ~48% (session 21; the WAN cluster of
# earlier sessions is now proven optimal within 1 unit: its crossing bound prunes it).
CLUSTER = mixed_cluster(4, 12, a100=A100_40)
GLOBAL_BATCH = 512
BUDGET = 1.5
SMALL_BUDGET = 1.0


def _busy_loops(n: int) -> list[subprocess.Popen]:
    """n processes spinning on a core each (the load a shared machine puts on the search)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _plan_bytes() -> tuple[bytes, float]:
    """(plan JSON bytes, wall seconds) of one plan of GRAPH on CLUSTER under BUDGET."""
    t0 = time.perf_counter()
    plan = meshplan.plan(GRAPH, cluster=CLUSTER, global_batch=GLOBAL_BATCH, time_limit_s=BUDGET)
    return plan.to_json().encode(), time.perf_counter() - t0


@pytest.fixture(scope="module")
def idle_plan() -> tuple[bytes, float]:
    return _plan_bytes()


def test_plan_json_has_no_wall_clock_field(idle_plan):
    """Nothing in a plan file records how long the solve took (so bytes can be compared)."""
    text, _ = idle_plan

    def keys(x):
        if isinstance(x, dict):
            for k, v in x.items():
                yield k
                yield from keys(v)
        elif isinstance(x, list):
            for v in x:
                yield from keys(v)

    assert not [k for k in keys(json.loads(text)) if "wall" in k or k.endswith("elapsed_s")]


def test_plan_is_identical_on_an_idle_and_a_loaded_machine(idle_plan):
    idle, idle_s = idle_plan
    loops = _busy_loops(2 * (os.cpu_count() or 2))  # more loops than cores
    try:
        time.sleep(0.2)  # let the loops take the cores
        busy, busy_s = _plan_bytes()
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()
    solver = json.loads(idle)["solver"]
    assert solver["status"] == "feasible" and solver["gap"] > 0, "the budget must cut the search"
    assert busy == idle, f"plans differ (idle {idle_s:.1f} s, loaded {busy_s:.1f} s)"


def test_search_work_is_reproducible():
    """The same solve twice spends the same work and returns the same placement and gap."""
    a = solve(GRAPH, CLUSTER, Parallel(), global_batch=GLOBAL_BATCH, time_limit_s=SMALL_BUDGET)
    b = solve(GRAPH, CLUSTER, Parallel(), global_batch=GLOBAL_BATCH, time_limit_s=SMALL_BUDGET)
    assert a.status == "feasible" and not a.wall_clock_hit
    assert (a.work, a.gap, a.parallel, a.stages) == (b.work, b.gap, b.parallel, b.stages)


@pytest.mark.parametrize("objective", ["throughput", "min_gpus"])
def test_wall_clock_safety_net_is_reported(objective):
    """A search stopped by the wall clock (here at once) still returns a plan, and says that it
    may differ between runs."""
    from meshplan.solver import Objective

    goal = Objective(objective, 1e3 if objective == "min_gpus" else None)
    r = solve(
        GRAPH,
        CLUSTER,
        Parallel(),
        global_batch=GLOBAL_BATCH,
        time_limit_s=SMALL_BUDGET,
        wall_limit_s=0.0,
        objective=goal,
    )
    assert r.wall_clock_hit and r.status == "feasible"
    head = WALL_CLOCK_NOTE.split("{")[0]
    assert any(n.startswith(head) for n in r.prediction.notes)


# -- default global batch ----------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_llama_cpu.py"


def test_default_global_batch_of_the_cpu_example_is_small():
    """The README's CPU example (4 ranks, dp 2 x tp 2, no --global-batch) gets 16 sequences
    (4 per device), not 2M tokens / 32 = 65,536, and `explain()` shows it."""
    spec = importlib.util.spec_from_file_location("train_llama_cpu", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, inputs = meshplan.models.transformer(dtype="float32", **example.MODEL)
    cluster = Cluster.preset("cpu", gpus=4)
    plan = meshplan.estimate_plan(model, inputs, cluster, Parallel(dp=2, tp=2))
    assert plan.parallel.global_batch == 4 * MAX_SEQUENCES_PER_DEVICE == 16
    assert "batch: global 16 = dp 2 x micro-batch 1 x 8 micro-batches" in plan.explain()


def test_default_global_batch_follows_model_and_cluster():
    params = 8_030_261_248  # meshplan.models.get("llama3-8b"), traced
    h100 = Cluster.preset("dgx-h100", gpus=64)
    # Llama 3 8B on 64 H100: 256 x 8192 = 2M tokens, the published range (GPT-3 6.7B-13B: 2M
    # tokens; Llama 2 and Llama 3 405B's first stage: 4M).
    tokens = default_global_batch(8192, h100, params=params) * 8192
    assert 1_000_000 <= tokens <= 4_200_000 and tokens == 2**21
    # a bigger cluster does not raise it past the published batch; a single node lowers it
    assert default_global_batch(8192, Cluster.preset("dgx-h100", gpus=1024), params=params) == 256
    assert default_global_batch(8192, Cluster.preset("dgx-h100", gpus=8), params=params) == 32
    # a model without a sequence gets samples per device, not 2M samples
    assert default_global_batch(1, h100, params=25_000_000) == 64 * MAX_SEQUENCES_PER_DEVICE
    # the floor: a multiple of dp x micro-batch, so every replica runs whole micro-batches
    graph = transformer_graph(32, 4096, 32, 8, 14336, 128256, 8192, 1, name="6b")
    p = complete_parallel(graph, h100, Parallel(tp=1, pp=1, cp=1, micro_batch=8))
    assert p.global_batch == 512 and p.global_batch % (p.dp * p.micro_batch) == 0
