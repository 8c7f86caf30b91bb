"""Metis's printed plan against meshplan's, on the scenario Metis's planner ships (docs/planner.md).

Metis (Um et al., USENIX ATC'24) plans a GPT model on mixed GPUs and gives each pipeline stage
its own GPU mix, (dp, tp) and layer share. Its paper's evaluation (GPT-3, MoE and
Wide-ResNet on three GPU types) is not public in a form this script can read; its
auto-planner repository (github.com/SamsungLabs/Metis @ 4b24046f) is, with one worked case
and the plans its planner printed for it (`results/hetero_cost_model`):

- model: "GPT 1.5B" (scripts/cost_het_cluster.sh): hidden 4096, 8 transformer blocks (10
  planner layers: embedding, 8 blocks, head), sequence 1024, vocabulary 51200, global batch
  128. The heads (32) are set in the script; the FFN width is not stated (4 x hidden here,
  GPT-3's).
- cluster (that file's hostfile and clusterfile): one node of 4 T4 and three nodes of 4
  A100-80GB, 16 GPUs; bandwidths 50 (T4) and 46 (A100) inside a node, 10 between nodes, in
  the planner's units, which it reads as MiB per ms (~GB/s).
- Metis's best printed plan (rank 1 of 1124, estimated 2396.7 ms per iteration by Metis's own
  cost model): GPU types in the order T4 -> A100, two stages of 8 GPUs, (dp 4, tp 2) each,
  8 micro-batches (micro-batch 128 / 4 / 8 = 4), layers [0, 4, 10]: stage 0 holds the
  embedding and 3 blocks on the 4 T4 and 4 A100 (two TP-2 replicas of each), stage 1 the
  other 5 blocks and the head on 8 A100.

This script encodes that plan as a stage list (`StagePlacement`, both stages at TP 2), prices
it with meshplan's cost model (`cost_model.predict`), plans the same model on the same
cluster with `meshplan.plan`, and prints both side by side: predicted step time, tokens/s,
memory, the ratio. Under Metis's runtime assumptions (`--metis-runtime`: ZeRO-0, no sequence
parallelism, no recomputation, every replica the same micro-batch) meshplan's plan can never
be slower under meshplan's model, since Metis's plan is one of its lock-step placements; the
script checks it.

    python benchmarks/vs_metis.py                  # meshplan's runtime
    python benchmarks/vs_metis.py --metis-runtime  # Metis's assumptions
    python benchmarks/vs_metis.py --three-types [--metis-runtime]  # and 8 V100 added

`--three-types` adds two nodes of 4 V100-16GB to the worked case's cluster and prints the best
pipeline through the three GPU types (each run of stages on one type at its own TP degree,
`meshplan.solver_chains`, searched to the end) beside meshplan's plan; under Metis's runtime
assumptions that pipeline is in meshplan's search space, and the script exits 1 if it were
ever faster.

What is read into the plan, since the printed plan leaves it open:
- Metis splits a mixed stage's micro-batch over its replicas in proportion to their speed
  (its DataLoadBalancer); meshplan's lock-step stages give every replica the same
  micro-batch, so the T4 replicas of stage 0 run as many sequences as the A100 ones: the
  less favourable reading for Metis, stated in the output.
- The network: the planner's figures as GB/s (PCIe-class links inside a node, a 10 GB/s NIC
  per node between nodes), NCCL-like latency and efficiency defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_sailor import describe, plan_row  # noqa: E402  (benchmarks/ is not a package)

GLOBAL_BATCH = 128
SEQ_LEN = 1024

# Metis's rank-1 plan: per stage, ((group, replicas, tp), ...) and its layer count (blocks).
METIS_PLAN: tuple[tuple[tuple[tuple[str, int, int], ...], int], ...] = (
    ((("t4", 2, 2), ("a100", 2, 2)), 3),
    ((("a100", 4, 2),), 5),
)
METIS_MICRO_BATCH = 4  # 128 sequences / dp 4 / 8 micro-batches
METIS_ESTIMATE_S = 2.3967  # Metis's own cost model's estimate, results/hetero_cost_model


def metis_gpt(dtype: str):
    """Metis's "GPT 1.5B" preset on the meta device."""
    import meshplan

    return meshplan.models.transformer(
        layers=8,
        hidden=4096,
        heads=32,
        ffn=4 * 4096,
        vocab=51200,
        seq_len=SEQ_LEN,
        style="gpt",
        dtype=dtype,
    )


def metis_cluster():
    """4 T4 + 12 A100-80GB, nodes of 4, the bandwidths of Metis's clusterfile as GB/s."""
    from meshplan.ir import Cluster, DeviceGroup, LinkKind, LinkTier
    from meshplan.ir.hardware import DEFAULT_EFFICIENCY, DEFAULT_LATENCY, gpu_spec

    def tier(name: str, kind: LinkKind, gbytes: float) -> LinkTier:
        return LinkTier(name, kind, gbytes * 1e9, DEFAULT_LATENCY[kind], DEFAULT_EFFICIENCY[kind])

    t4_in = tier("metis-t4-intra", LinkKind.PCIE, 50)
    a100_in = tier("metis-a100-intra", LinkKind.PCIE, 46)
    net = tier("metis-inter", LinkKind.ETHERNET, 10)
    return Cluster(
        name="metis-4t4-12a100",
        groups=(
            DeviceGroup("t4", gpu_spec("T4"), 1, 4, t4_in.name, net.name),
            DeviceGroup("a100", gpu_spec("A100-80GB"), 3, 4, a100_in.name, net.name),
        ),
        links=(t4_in, a100_in, net),
    )


def three_type_cluster():
    """Metis's worked-case cluster with a third GPU type: its 4 T4 and 12 A100-80GB, and two
    nodes of 4 V100-16GB on the same 10 GB/s network (PCIe-class links inside them at the
    A100 nodes' 46 GB/s). Not a Metis scenario (its paper's are not public in readable form):
    the three-type plan shape Metis searches, each stage its own GPU type and TP degree."""
    from meshplan.ir import Cluster, DeviceGroup, LinkKind, LinkTier
    from meshplan.ir.hardware import DEFAULT_EFFICIENCY, DEFAULT_LATENCY, gpu_spec

    base = metis_cluster()
    v100_in = LinkTier(
        "metis-v100-intra", LinkKind.PCIE, 46e9, DEFAULT_LATENCY[LinkKind.PCIE],
        DEFAULT_EFFICIENCY[LinkKind.PCIE],
    )  # fmt: skip
    v100 = DeviceGroup("v100", gpu_spec("V100-16GB"), 2, 4, v100_in.name, "metis-inter")
    return Cluster(
        name="metis-4t4-12a100-8v100",
        groups=(*base.groups, v100),
        links=(*base.links, v100_in),
    )


def metis_shaped(graph, cluster, pinned, dtype):
    """The best pipeline through three GPU types, each run of stages at its own TP degree
    (`meshplan.solver_chains`' family: Metis's per-stage type and degree, equal replicas per
    stage), under meshplan's model: the family priced in bound order to the end, re-priced by
    `predict`; None when no such pipeline fits."""
    import math

    from meshplan.cost_model import predict, pricer_for
    from meshplan.ir import Recompute
    from meshplan.solver_chains import chains, split
    from meshplan.solver_layouts import _Layouts, layout_step

    pricer = pricer_for(graph, cluster, dtype)
    cache = _Layouts(graph, pricer)
    rcs = [Recompute(pinned.recompute)] if pinned.recompute is not None else list(Recompute)
    sp = pinned.sequence_parallel if pinned.sequence_parallel is not None else True
    best = None
    for bound, _, chain in chains(cache, pinned, GLOBAL_BATCH, rcs, sp, math.inf):
        if best is not None and bound >= best[0]:
            break  # bound order: nothing left can win
        counts = split(cache, chain)
        if counts is None:
            continue
        stages = cache.stages(chain, counts)
        step = layout_step(pricer, chain.parallel, stages)
        if step is None:
            continue
        if best is None or step < best[0]:
            best = (step, chain.parallel, stages)
    if best is None:
        return None
    _, parallel, stages = best
    return parallel, stages, predict(graph, cluster, parallel, stages, dtype=dtype)


def three_types(args) -> int:
    """`--three-types`: meshplan's plan beside the best Metis-shaped three-type pipeline."""
    import meshplan
    from meshplan.api import resolve_precision
    from meshplan.cost_model.engine import EAGER
    from meshplan.ir import Parallel

    model, inputs = metis_gpt("bfloat16")
    graph = meshplan.trace(model, *inputs)
    cluster = three_type_cluster()
    precision, dtype, _, note = resolve_precision(graph, cluster, None, EAGER)
    pins = Parallel(zero=0, sequence_parallel=False, recompute="none")
    t0 = time.perf_counter()
    plan = meshplan.plan(
        graph, cluster=cluster, global_batch=GLOBAL_BATCH,
        parallel=pins if args.metis_runtime else None, time_limit_s=args.time_limit,
        equal_shares=args.metis_runtime,
    )  # fmt: skip
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    shaped = metis_shaped(graph, cluster, pins if args.metis_runtime else Parallel(), dtype)
    t_shaped = time.perf_counter() - t0
    mode = (
        "Metis's runtime (ZeRO-0, no SP, no recompute)"
        if args.metis_runtime
        else "meshplan's runtime"
    )
    print(
        f"Metis's GPT 1.5B, {GLOBAL_BATCH} x {SEQ_LEN} tokens per step, {cluster.name}; {mode}; "
        f"precision {precision}" + (f" ({note})" if note else "")
    )
    tokens = GLOBAL_BATCH * SEQ_LEN
    ours = plan.predicted
    print(f"\n{'plan':44s} {'step s':>8} {'tokens/s':>10} {'GPUs':>5}  peak memory per rank")
    if shaped is not None:
        parallel, stages, pred = shaped
        gpus = sum(n * st.tp_of(g, parallel.tp) for st in stages for g, n in st.replicas)
        print(plan_row("best three-type pipeline (Metis shape)", pred, gpus, tokens, width=44))
    label = f"meshplan.plan ({plan.solver.status})"
    print(plan_row(label, ours, plan.world_size, tokens, width=44))
    if shaped is None:
        print("no three-type pipeline fits")
        return 0
    ratio = shaped[2].step_time_s / ours.step_time_s
    print(f"ratio three-type / meshplan step: {ratio:.3f} (> 1: meshplan's plan is faster)")
    print(f"\nbest three-type pipeline: {shaped[0]}")
    print(describe(shaped[0], shaped[1]))
    print(f"\nmeshplan's plan: {plan.parallel}")
    print(describe(plan.parallel, plan.stages))
    print(
        f"\nwall: meshplan.plan {t_plan:.1f} s, the three-type family to the end {t_shaped:.1f} s"
    )
    if args.metis_runtime and ratio < 1 - 1e-9:
        print(
            "ERROR: the three-type pipeline is in meshplan's search space under these assumptions"
        )
        return 1
    return 0


def metis_parallel(sequence_parallel: bool = False):
    from meshplan.ir import Parallel

    return Parallel(
        dp=4,
        tp=2,
        pp=len(METIS_PLAN),
        cp=1,
        ep=1,
        micro_batch=METIS_MICRO_BATCH,
        global_batch=GLOBAL_BATCH,
        recompute="none",
        zero=0,
        schedule="1f1b",
        sequence_parallel=sequence_parallel,
    )


def metis_stages(graph):
    """Metis's plan as StagePlacements, the layer split as printed."""
    from meshplan.ir import StagePlacement
    from meshplan.passes.partition import stages_of

    counts = tuple(layers for _, layers in METIS_PLAN)
    ranges = stages_of(graph, counts)
    return tuple(
        StagePlacement(s, a, b, tuple((g, n) for g, n, _ in reps))
        for s, ((a, b), (reps, _)) in enumerate(zip(ranges, METIS_PLAN, strict=True))
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--metis-runtime", action="store_true", help="ZeRO-0, no SP/recompute, equal shares"
    )
    ap.add_argument("--time-limit", type=float, default=10.0, help="meshplan's work budget (s)")
    ap.add_argument(
        "--three-types",
        action="store_true",
        help="the worked case's cluster with 8 V100 added: meshplan's plan beside the best "
        "pipeline through the three GPU types (Metis's per-stage type and degree)",
    )
    args = ap.parse_args(argv)
    if args.three_types:
        return three_types(args)
    import meshplan
    from meshplan.api import resolve_precision
    from meshplan.cost_model import predict
    from meshplan.cost_model.engine import EAGER
    from meshplan.ir import Parallel

    t0 = time.perf_counter()
    model, inputs = metis_gpt("bfloat16")
    graph = meshplan.trace(model, *inputs)
    cluster = metis_cluster()
    precision, dtype, _, note = resolve_precision(graph, cluster, None, EAGER)
    t_trace = time.perf_counter() - t0

    parallel, stages = metis_parallel(), metis_stages(graph)
    metis = predict(graph, cluster, parallel, stages, dtype=dtype)

    pins = Parallel(zero=0, sequence_parallel=False, recompute="none")
    t0 = time.perf_counter()
    plan = meshplan.plan(
        graph,
        cluster=cluster,
        global_batch=GLOBAL_BATCH,
        parallel=pins if args.metis_runtime else None,
        time_limit_s=args.time_limit,
        equal_shares=args.metis_runtime,
    )
    t_plan = time.perf_counter() - t0
    ours = plan.predicted

    mode = (
        "Metis's runtime (ZeRO-0, no SP, no recompute, equal shares)"
        if args.metis_runtime
        else "meshplan's runtime"
    )
    print(
        f"Metis's GPT 1.5B (hidden 4096, 8 blocks), {GLOBAL_BATCH} x {SEQ_LEN} tokens per step, "
        f"{cluster.name}; {mode}; precision {precision}" + (f" ({note})" if note else "")
    )
    tokens = GLOBAL_BATCH * SEQ_LEN
    print(f"\n{'plan':40s} {'step s':>8} {'tokens/s':>10} {'GPUs':>5}  peak memory per rank")
    gpus = sum(n * parallel.tp for st in stages for _, n in st.replicas)
    print(plan_row("Metis (printed rank-1 plan)", metis, gpus, tokens))
    print(plan_row(f"meshplan.plan ({plan.solver.status})", ours, plan.world_size, tokens))
    ratio = metis.step_time_s / ours.step_time_s
    print(f"ratio Metis / meshplan step: {ratio:.3f} (> 1: meshplan's plan is faster)")
    if args.metis_runtime and ratio < 1 - 1e-9:
        print("ERROR: Metis's plan is in meshplan's search space under these assumptions")
        return 1
    print(
        f"Metis's own estimate of its plan: {METIS_ESTIMATE_S:.3f} s (its cost model, "
        "profiled on its testbed; not a measurement)"
    )
    print(f"\nMetis's plan: {parallel}")
    print(describe(parallel, stages))
    print(
        "  every replica runs micro-batch 4 (lock-step); Metis's load balancer would give the T4 "
        "replicas of stage 0 fewer sequences"
    )
    print("  breakdown: " + ", ".join(f"{k} {v:.3f}" for k, v in metis.breakdown if v))
    for n in metis.notes:
        if n.startswith("bottleneck"):
            print(f"  note: {n}")
    print(f"\nmeshplan's plan: {plan.parallel}")
    print(describe(plan.parallel, plan.stages))
    print("  breakdown: " + ", ".join(f"{k} {v:.3f}" for k, v in ours.breakdown if v))
    print(f"\nwall: trace {t_trace:.1f} s, meshplan.plan {t_plan:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
