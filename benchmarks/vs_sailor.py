"""Sailor's published plan against meshplan's, on Sailor's own scenario (docs/planner.md).

Sailor (Strati et al., SOSP'25) plans GPT-Neo-2.7B (global batch 2048 sequences of 2048
tokens) on 32 A100-40GB + 96 V100-16GB, 4 GPUs per node, as one pipeline of 6 stages x DP 9:
stages 0-1 on V100s at TP 4, stages 2-4 on A100s at TP 1, and stage 5 mixing three A100
replicas (TP 1) with six V100 replicas (TP 4). This script encodes that plan as a stage list
(`StagePlacement.group_tp` per stage), prices it with meshplan's cost model
(`cost_model.predict`), plans the same model on the same cluster with `meshplan.plan`, and
prints both side by side: predicted step time, tokens/s, peak memory per rank, the ratio.

    python benchmarks/vs_sailor.py                    # meshplan's runtime (mixed precision)
    python benchmarks/vs_sailor.py --sailor-runtime   # Sailor's: fp32 + TF32, ZeRO-0, ...
    python benchmarks/vs_sailor.py --scenario 128+384 # Sailor's other two: 128+384, 256+256

Every scenario also prints the best pipeline of Sailor's shape (first stages on one GPU type
at one TP degree, the next on the other at another, optionally one stage mixing replicas of
both: last as Sailor's, first, or between the two runs) under meshplan's model: the family
`meshplan.solver_layouts` searches (`sailor_shaped`), searched to the end. For 32+96 it also
checks that Sailor's published layout is a member of that family at Sailor's batch
(`in_family`). Sailor's own plans for 128+384 and 256+256 are
not encoded (their layouts are not published).

What is assumed, since the plan as published leaves it open:
- the layer split: the one that minimises the slowest stage of Sailor's layout under
  meshplan's model among the splits that fit (`best_split`), the most favourable reading;
- the micro-batch (`--micro-batch`, default 1); 2048 sequences over DP 9 is not whole, so
  each pipeline runs ceil(2048 / (9 mb)) micro-batches (lock-step replicas wait for the
  busiest one): the plan is priced at that batch, 2052 sequences at mb 1, and its tokens/s
  counts the 2048 it trains;
- the network: one NIC per node at `--gbps` (default 50 Gb/s, about the 6 GB/s Ethernet
  of that scenario), Ethernet latency and efficiency defaults
  (`ir.hardware.DEFAULT_LATENCY` / `DEFAULT_EFFICIENCY`), NVLink inside nodes;
- V100-16GB: the GPU table's `V100-16GB` (NVIDIA Tesla V100 datasheet, SXM2 16 GB: the
  same 125 / 15.7 TFLOP/s, 900 GB/s HBM2 and NVLink2 300 GB/s as the 32 GB part; its kernel
  efficiencies are the V100's).

`--sailor-runtime` plans under Sailor's runtime assumptions where the API has a switch:
fp32 training with TF32 where the GPU has it (`precision="tf32"`: PyTorch's `allow_tf32`,
TF32 tensor cores on the A100s, CUDA-core FP32 on the V100s, which have no TF32 units;
`ir.devices.matmul_dtype`; plain FP32 on both before session 29), ZeRO-0, no sequence parallelism,
no recomputation, and equal micro-batches per replica (`equal_shares=True`: no uneven DP
shares between the A100 and V100 pipelines). The GPT-Neo model is the zoo's GPT style at
GPT-Neo-2.7B's shape (EleutherAI/gpt-neo-2.7B config.json on the Hugging Face hub:
num_layers 32, hidden_size 2560, num_heads 20, vocab_size 50257, max_position_embeddings
2048, intermediate_size null = 4 x hidden, tied embeddings); GPT-Neo's local attention
(window 256 on every other layer) is priced as full causal attention.
"""

from __future__ import annotations

import argparse
import math
import time

# Sailor's plan for 32 A100 + 96 V100: per stage, (group, replicas, tp).
SAILOR_32_96: tuple[tuple[tuple[str, int, int], ...], ...] = (
    (("v100", 9, 4),),
    (("v100", 9, 4),),
    (("a100", 9, 1),),
    (("a100", 9, 1),),
    (("a100", 9, 1),),
    (("a100", 3, 1), ("v100", 6, 4)),
)

# Sailor's scenarios: A100-40GB + V100-16GB GPUs -> (A100 nodes, V100 nodes), 4 GPUs each.
# Only 32+96's plan is encoded (SAILOR_32_96); for the other two the script prices the best
# pipeline of Sailor's shape that meshplan's own search of that family finds.
SCENARIOS = {"32+96": (8, 24), "128+384": (32, 96), "256+256": (64, 64)}

GLOBAL_BATCH = 2048
SEQ_LEN = 2048
GiB = 2**30


def gpt_neo_27b(dtype: str):
    """GPT-Neo-2.7B's shape in the zoo's GPT style, on the meta device: the factory of
    examples/models/gpt_neo.py (what `meshplan plan -m` runs) at Sailor's sequence length."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "models" / "gpt_neo.py"
    spec = importlib.util.spec_from_file_location("meshplan_example_gpt_neo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gpt_neo_27b(seq_len=SEQ_LEN, dtype=dtype)


def sailor_cluster(gbps: float, a100_nodes: int = 8, v100_nodes: int = 24):
    """A100-40GB and V100-16GB nodes of 4 GPUs, NVLink inside, one `gbps` Ethernet NIC each."""
    from meshplan.ir import Cluster, DeviceGroup, LinkKind, LinkTier
    from meshplan.ir.hardware import (
        DEFAULT_EFFICIENCY,
        DEFAULT_LATENCY,
        gpu_spec,
        link_tier,
    )

    eth = LinkKind.ETHERNET
    net = LinkTier(
        f"eth-{gbps:g}g", eth, gbps * 1e9 / 8, DEFAULT_LATENCY[eth], DEFAULT_EFFICIENCY[eth]
    )
    v100_16 = gpu_spec("V100-16GB")
    return Cluster(
        name=f"sailor-{4 * a100_nodes}a100-{4 * v100_nodes}v100",
        groups=(
            DeviceGroup("a100", gpu_spec("A100-40GB"), a100_nodes, 4, "nvlink3", net.name),
            DeviceGroup("v100", v100_16, v100_nodes, 4, "nvlink2", net.name),
        ),
        links=(link_tier("nvlink3"), link_tier("nvlink2"), net),
    )


def sailor_parallel(layout, micro_batch: int, sequence_parallel: bool = False):
    """Sailor's configuration: dp and pp from the layout, tp of stage 0's first group,
    ZeRO-0, 1F1B, no recomputation, each pipeline running ceil(2048 / (dp mb))
    micro-batches."""
    from meshplan.ir import Parallel

    dp = sum(n for _, n, _ in layout[0])
    m = math.ceil(GLOBAL_BATCH / (dp * micro_batch))
    return Parallel(
        dp=dp,
        tp=layout[0][0][2],
        pp=len(layout),
        cp=1,
        ep=1,
        micro_batch=micro_batch,
        global_batch=dp * micro_batch * m,
        recompute="none",
        zero=0,
        schedule="1f1b",
        sequence_parallel=sequence_parallel,
    )


def sailor_stages(graph, layout, counts):
    """The layout as StagePlacements with `counts[s]` layers on stage s."""
    from meshplan.ir import StagePlacement
    from meshplan.passes.partition import stages_of

    return tuple(
        StagePlacement(
            s,
            a,
            b,
            tuple((g, n) for g, n, _ in row),
            group_tp=tuple((g, t) for g, _, t in row),
        )
        for s, ((a, b), row) in enumerate(zip(stages_of(graph, counts), layout, strict=True))
    )


def best_split(graph, cluster, parallel, layout, dtype):
    """The layer counts minimising the slowest stage time u_s = max over the stage's groups
    (each at its own tp) among the splits whose every (stage, group) fits in memory; the
    slowest-stage minimum over all splits when none fits. A minimax over contiguous splits
    (stage s's cost depends only on its layer count and position)."""
    from meshplan.cost_model import pricer_for
    from meshplan.cost_model.memory import in_flight_microbatches
    from meshplan.passes.partition import stages_of

    pricer = pricer_for(graph, cluster, dtype)
    costs, p = pricer.costs, parallel
    layers, pp = len(graph.layer_units), len(layout)
    groups = {g.name: g for g in cluster.groups}

    def cost(s: int, k: int) -> tuple[float, bool]:
        counts = [1] * pp
        counts[s] = k
        counts[(s + 1) % pp] += layers - k - (pp - 1)  # the rest on another stage
        a, b = stages_of(graph, counts)[s]
        comp = costs.composition(a, b)
        held = in_flight_microbatches(p.schedule, s, pp, p.num_microbatches, 1)
        u, fits = 0.0, True
        for g, _, t in layout[s]:
            cfg = p.stage(t)  # the stage's own tp; sequence parallel only where t > 1
            u = max(u, pricer.stage_time(comp, g, cfg).total)
            mem = pricer.stage_memory(comp, cfg, dp=p.dp, zero=0).peak(held)[0]
            fits = fits and mem <= groups[g].gpu.memory_bytes
        return u, fits

    table = {(s, k): cost(s, k) for s in range(pp) for k in range(1, layers - pp + 2)}
    for need_fit in (True, False):
        # best[s][n]: (the slowest of stages 0..s holding n layers, counts)
        best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{} for _ in range(pp)]
        for k in range(1, layers - pp + 2):
            u, fits = table[(0, k)]
            if fits or not need_fit:
                best[0][k] = (u, (k,))
        for s in range(1, pp):
            for n, (worst, counts) in best[s - 1].items():
                for k in range(1, layers - n - (pp - 1 - s) + 1):
                    u, fits = table[(s, k)]
                    if need_fit and not fits:
                        continue
                    cand = (max(worst, u), (*counts, k))
                    if n + k not in best[s] or cand < best[s][n + k]:
                        best[s][n + k] = cand
        if layers in best[pp - 1]:
            return best[pp - 1][layers][1], need_fit
    raise ValueError("no split of the layers over Sailor's stages")


def sailor_shaped(graph, cluster, pinned, dtype):
    """The best pipeline of Sailor's shape (first stages on one GPU type at one TP degree, the
    next on the other at another, optionally one stage mixing both, last, first or between;
    equal replicas per stage) under meshplan's model: `meshplan.solver_layouts`' family
    searched to the end, re-priced by `predict`. None when no such pipeline fits."""
    import math

    from meshplan.cost_model import predict, pricer_for
    from meshplan.ir import Recompute
    from meshplan.solver_layouts import layout_search
    from meshplan.solver_objective import _Work

    pricer = pricer_for(graph, cluster, dtype)
    rcs = [Recompute(pinned.recompute)] if pinned.recompute is not None else list(Recompute)
    work = _Work.starting_now(1e6, None)
    found = layout_search(graph, pricer, pinned, GLOBAL_BATCH, work, math.inf, rcs)
    if found.best is None:
        return None
    _, parallel, stages = found.best
    return parallel, stages, predict(graph, cluster, parallel, stages, dtype=dtype)


def in_family(graph, cluster, pinned, dtype, layout, parallel) -> bool:
    """Whether `layout` (per stage, (group, replicas, tp)) is one of the layouts step 2b
    (`meshplan.solver_layouts.layouts`) enumerates at `parallel`'s batch and micro-batch."""
    from meshplan.cost_model import pricer_for
    from meshplan.ir import Parallel, Recompute
    from meshplan.solver_layouts import _Layouts, layouts

    pricer = pricer_for(graph, cluster, dtype)
    pins = Parallel(zero=0, sequence_parallel=False, micro_batch=parallel.micro_batch)
    every = layouts(_Layouts(graph, pricer), pins, parallel.global_batch, [Recompute.NONE], False)
    want = tuple(tuple(sorted(row)) for row in layout)
    for _, _, lay in every:
        if lay.parallel.dp != parallel.dp or lay.parallel.pp != len(layout):
            continue
        got = tuple(tuple(sorted(lay.on(s))) for s in range(lay.parallel.pp))
        if got == want:
            return True
    return False


def describe(parallel, stages) -> str:
    """One line per stage: layers, and replicas x tp per group."""
    out = []
    for st in stages:
        reps = " + ".join(f"{n} {g} tp{st.tp_of(g, parallel.tp)}" for g, n in st.replicas)
        share = f" shares {dict(st.microbatches)}" if st.microbatches else ""
        out.append(f"    stage {st.index}: units {st.first_unit}-{st.last_unit - 1}: {reps}{share}")
    return "\n".join(out)


def memory_line(prediction) -> str:
    by_group: dict[str, int] = {}
    for r in prediction.memory:
        by_group[r.group] = max(by_group.get(r.group, 0), r.peak_bytes)
    return ", ".join(f"{g} {v / GiB:.1f} GiB" for g, v in sorted(by_group.items()))


def plan_row(label: str, pred, gpus: int, tokens: int, *, width: int = 40, digits: int = 3) -> str:
    """One row of the side-by-side table: step seconds, tokens/s, GPUs, peak memory per rank
    (and a warning when the plan does not fit)."""
    step = pred.step_time_s
    return (
        f"{label:{width}s} {step:8.{digits}f} {tokens / step:10.0f} {gpus:5d}  {memory_line(pred)}"
        + ("" if pred.fits else "  (does NOT fit)")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sailor-runtime", action="store_true", help="fp32 + TF32, ZeRO-0, no SP/recompute"
    )
    ap.add_argument("--micro-batch", type=int, default=1, help="Sailor's plan's micro-batch")
    ap.add_argument("--gbps", type=float, default=50.0, help="Ethernet per node (Gb/s)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="meshplan's work budget (s)")
    ap.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="32+96",
        help="A100-40GB + V100-16GB GPUs (Sailor's three scenarios; the published plan is 32+96's)",
    )
    args = ap.parse_args(argv)
    import meshplan
    from meshplan.api import resolve_precision
    from meshplan.cost_model import predict
    from meshplan.cost_model.engine import EAGER
    from meshplan.ir import Parallel

    t0 = time.perf_counter()
    model_dtype = "float32" if args.sailor_runtime else "bfloat16"
    graph = meshplan.trace(*_flat(gpt_neo_27b(model_dtype)))
    cluster = sailor_cluster(args.gbps, *SCENARIOS[args.scenario])
    precision = "tf32" if args.sailor_runtime else None  # fp32, TF32 where the GPU has it
    precision, dtype, _, note = resolve_precision(graph, cluster, precision, EAGER)
    t_trace = time.perf_counter() - t0

    published = args.scenario == "32+96"
    t0 = time.perf_counter()
    if published:
        layout = SAILOR_32_96
        sailor_p = sailor_parallel(layout, args.micro_batch)
        counts, fits = best_split(graph, cluster, sailor_p, layout, dtype)
        stages = sailor_stages(graph, layout, counts)
        sailor = predict(graph, cluster, sailor_p, stages, dtype=dtype)
        member = in_family(graph, cluster, Parallel(), dtype, layout, sailor_p)
    t_price = time.perf_counter() - t0

    pinned = Parallel(zero=0, sequence_parallel=False, recompute="none")
    t0 = time.perf_counter()
    shaped = sailor_shaped(graph, cluster, pinned if args.sailor_runtime else Parallel(), dtype)
    t_shaped = time.perf_counter() - t0

    t0 = time.perf_counter()
    plan = meshplan.plan(
        graph,
        cluster=cluster,
        global_batch=GLOBAL_BATCH,
        parallel=pinned if args.sailor_runtime else None,
        time_limit_s=args.time_limit,
        precision=precision if args.sailor_runtime else None,
        equal_shares=args.sailor_runtime,
    )
    t_plan = time.perf_counter() - t0
    ours = plan.predicted

    mode = (
        "Sailor's runtime (fp32 with TF32 on the A100s, ZeRO-0, no SP, no recompute, equal shares)"
        if args.sailor_runtime
        else ("meshplan's runtime")
    )
    print(
        f"GPT-Neo-2.7B, {GLOBAL_BATCH} x {SEQ_LEN} tokens per step, {cluster.name} (4 per node, "
        f"{args.gbps:g} Gb/s Ethernet per node); {mode}; precision {precision}"
        + (f" ({note})" if note else "")
    )
    tokens = GLOBAL_BATCH * SEQ_LEN
    print(f"\n{'plan':40s} {'step s':>8} {'tokens/s':>10} {'GPUs':>5}  peak memory per rank")
    gpus_ours = plan.world_size
    if published:
        gpus_sailor = sum(n * st.tp_of(g, sailor_p.tp) for st in stages for g, n in st.replicas)
        print(plan_row("Sailor (published layout)", sailor, gpus_sailor, tokens, digits=2))
    if shaped is not None:
        sp_par, sp_stages, sp_pred = shaped
        gpus_shaped = sum(n * st.tp_of(g, sp_par.tp) for st in sp_stages for g, n in st.replicas)
        print(plan_row("best pipeline of Sailor shape", sp_pred, gpus_shaped, tokens, digits=2))
    print(plan_row(f"meshplan.plan ({plan.solver.status})", ours, gpus_ours, tokens, digits=2))
    if published:
        ratio = sailor.step_time_s / ours.step_time_s
        print(f"ratio Sailor / meshplan step: {ratio:.3f} (> 1: meshplan's plan is faster)")
    if shaped is not None:
        ratio = shaped[2].step_time_s / ours.step_time_s
        print(f"ratio Sailor-shaped / meshplan step: {ratio:.3f} (never < 1: in meshplan's search)")

    if published:
        print(
            f"\nSailor's layout: {sailor_p}, {sailor_p.num_microbatches} micro-batches per "
            f"pipeline ({sailor_p.global_batch} sequences priced), layer split {counts} "
            + ("(minimax stage time among the splits that fit)" if fits else "(nothing fits)")
        )
        print(describe(sailor_p, stages))
        print(
            "  in meshplan's search (step 2b's family at this batch): "
            + ("yes" if member else "NO")
        )
        print("  breakdown: " + ", ".join(f"{k} {v:.2f}" for k, v in sailor.breakdown if v))
        for n in sailor.notes:
            if n.startswith(("bottleneck", "stages at")):
                print(f"  note: {n}")
    if shaped is not None:
        print(f"\nbest pipeline of Sailor's shape: {shaped[0]}")
        print(describe(shaped[0], shaped[1]))
        print("  breakdown: " + ", ".join(f"{k} {v:.2f}" for k, v in shaped[2].breakdown if v))
    print(f"\nmeshplan's plan: {plan.parallel}")
    print(describe(plan.parallel, plan.stages))
    print("  breakdown: " + ", ".join(f"{k} {v:.2f}" for k, v in ours.breakdown if v))
    print(
        f"\nwall: trace {t_trace:.1f} s, Sailor's layout priced and found {t_price:.1f} s, "
        f"Sailor-shaped "
        f"search {t_shaped:.1f} s, meshplan.plan {t_plan:.1f} s"
    )
    return 0


def _flat(model_and_inputs):
    model, inputs = model_and_inputs
    return (model, *inputs)


if __name__ == "__main__":
    raise SystemExit(main())
