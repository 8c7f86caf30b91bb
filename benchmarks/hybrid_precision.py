"""Per-group precision against uneven shares alone (issue 19, docs/hybrid_precision.md).

QSync (Zhao et al., IPDPS'24) trains synchronously across training GPUs and inference GPUs by
running chosen operators of the weaker devices in lower precision. meshplan has two answers to
a slow group: uneven data-parallel shares (the slow replicas run fewer micro-batches) and
per-group precision (`plan(hybrid_precision="auto")`: the slow group's transformer-block
linears as int8 forward GEMMs, or FP8 where its GPU has FP8). This script plans one model on
A100s beside an inference-GPU group (T4: INT8 tensor cores; L4: FP8) four ways, under
meshplan's cost model:

    equal DP     equal shares, data parallelism only (QSync's setting)   without / with
    equal        equal shares (lock-step replicas, as Sailor runs)        without / with
    uneven       uneven shares (meshplan's default)                       without / with

and prints the predicted step times, the ratios, and the share of the step's FLOPs quantized.

    python benchmarks/hybrid_precision.py                 # A100 + T4 and A100 + L4, ~2 min
    python benchmarks/hybrid_precision.py --slow T4       # one pairing
"""

from __future__ import annotations

import argparse
import time

GLOBAL_BATCH = 256


def cluster(slow: str):
    """One DGX A100 (8 x A100-80GB, NVLink3, 8 HDR NICs) beside eight 4-GPU PCIe servers of
    `slow` inference GPUs with one HDR NIC each."""
    from meshplan.ir import Cluster, DeviceGroup
    from meshplan.ir.hardware import gpu_spec, link_tier

    return Cluster(
        name=f"a100x8+{slow.lower()}x32",
        groups=(
            DeviceGroup("a100", gpu_spec("A100-80GB"), 1, 8, "nvlink3", "ib-hdr", 8),
            DeviceGroup(slow.lower(), gpu_spec(slow), 8, 4, "pcie4", "ib-hdr", 1),
        ),
        links=(link_tier("nvlink3"), link_tier("pcie4"), link_tier("ib-hdr")),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slow", choices=["T4", "L4"], action="append", help="slow GPU type(s)")
    ap.add_argument("--model", default="gpt3-1.3b", help="a model preset")
    ap.add_argument("--time-limit", type=float, default=10.0, help="work budget per plan (s)")
    ap.add_argument(
        "--max-quantized-fraction", type=float, default=0.25, help="the accuracy budget"
    )
    args = ap.parse_args(argv)
    import meshplan
    from meshplan.api import as_graph
    from meshplan.ir import Parallel

    model, inputs = meshplan.models.get(args.model)
    graph = as_graph(model, inputs, name=args.model)
    print(f"{args.model}, global batch {GLOBAL_BATCH} x {graph.info.seq_len} tokens")
    for slow in args.slow or ["T4", "L4"]:
        c = cluster(slow)
        print(f"\n{c.name}")
        print(f"  {'shares':8s} {'per-group precision':28s} {'step s':>8} {'vs off':>7}  plan")
        for equal, pins in ((True, Parallel(pp=1, tp=1)), (True, None), (False, None)):
            base = None
            for hybrid in ("off", "auto"):
                t0 = time.perf_counter()
                said: list[str] = []
                plan = meshplan.plan(
                    graph,
                    cluster=c,
                    global_batch=GLOBAL_BATCH,
                    time_limit_s=args.time_limit,
                    equal_shares=equal,
                    parallel=pins,
                    hybrid_precision=hybrid,
                    max_quantized_fraction=args.max_quantized_fraction,
                    compress="off",
                    progress=lambda m, said=said: said.append(m) if "per-group" in m else None,
                )
                wall = time.perf_counter() - t0
                step = plan.predicted.step_time_s
                base = base or step
                what = ", ".join(f"{g} {m}" for g, m in plan.hybrid_precision) or "none"
                frac = next(
                    (n.split(": ", 1)[1] for n in plan.predicted.notes if "per-group" in n), ""
                )
                p = plan.parallel
                shares = plan.stages[0].microbatches
                print(
                    f"  {('equal' if equal else 'uneven') + (' DP' if pins else ''):8s} "
                    f"{what:28s} {step:8.3f} "
                    f"{base / step:6.3f}x  dp{p.dp} tp{p.tp} pp{p.pp} mb{p.micro_batch}"
                    f"{' shares ' + str(dict(shares)) if shares else ''}, "
                    f"{plan.solver.status} (gap {plan.solver.gap:.0%}, {wall:.0f} s)"
                )
                if frac:
                    print(f"  {'':8s} {frac}")
                for m in said if hybrid == "auto" else ():
                    print(f"  {'':8s} {m}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
