"""How planning time and memory grow (docs/planner.md): the solve against the number of GPUs
(64 to 16,384) and against the number of layers, on homogeneous and mixed clusters.

    python benchmarks/planner_scaling.py                  # both sweeps, table + fitted growth
    python benchmarks/planner_scaling.py --quick          # fewer points (about a minute)
    python benchmarks/planner_scaling.py --plot docs/planner_scaling.png   # needs matplotlib

Each point runs in a fresh Python process (`python -c` of `_point`), so its peak resident
memory (`ru_maxrss`) is that plan's alone: import, trace on fake tensors, solve. Times are
wall seconds of the solve (`meshplan.solver.solve`) and of the whole process; the solver's
budget is deterministic work (`time_limit_s`, default 10 s of the reference machine), so a
point that needs the whole budget reports "feasible" with its gap and its time says what the
budget allows, not what proving optimality would take.

Clusters: DGX H100 nodes (`Cluster.preset("dgx-h100")`), and the mixed cluster of
`benchmarks/planner_speed.py` (half DGX H100, half DGX A100, the halves joined by 100 GbE).
Models: Llama 3 8B for the GPU sweep (global batch: 4 sequences per GPU, so every size has
data parallelism to place), and the Llama 3 70B layer at 16 to 128 layers on 512 GPUs for
the layer sweep. The growth rate printed is the least-squares slope of log(time) against
log(size) over the points that solved to optimality (time ~ size^slope).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time

GPUS = (64, 256, 1024, 4096, 16384)
GPUS_QUICK = (64, 1024, 16384)
LAYERS = (16, 32, 64, 128)
LAYERS_QUICK = (16, 64)
LAYER_GPUS = 512


def _point(kind: str, gpus: int, layers: int | None) -> dict:
    """One plan, inside its own process: the figures of one row."""
    import resource

    t0 = time.perf_counter()
    import meshplan
    from meshplan.api import as_graph
    from meshplan.ir import Parallel
    from meshplan.solver import solve

    sys.path.insert(0, "benchmarks")
    from planner_speed import homogeneous, mixed

    if layers is None:
        model, inputs = meshplan.models.get("llama3-8b")
        name, batch = "llama3-8b", 4 * gpus
    else:
        c = meshplan.models.config("llama3-70b")
        model, inputs = meshplan.models.build(dataclasses.replace(c, layers=layers))
        name, batch = f"llama3-70b-{layers}l", 1024
    t1 = time.perf_counter()
    graph = as_graph(model, inputs, name=name)
    trace_s = time.perf_counter() - t1
    cluster = homogeneous(gpus) if kind == "homogeneous" else mixed(gpus)
    t2 = time.perf_counter()
    r = solve(graph, cluster, Parallel(), global_batch=batch)
    solve_s = time.perf_counter() - t2
    p = r.parallel
    return {
        "kind": kind,
        "gpus": gpus,
        "layers": layers or graph.info.layers,
        "trace_s": trace_s,
        "solve_s": solve_s,
        "process_s": time.perf_counter() - t0,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "status": r.status,
        "gap": r.gap,
        "plan": f"dp{p.dp} tp{p.tp} pp{p.pp} cp{p.cp} z{p.zero} mb{p.micro_batch}",
    }


def run_point(kind: str, gpus: int, layers: int | None) -> dict:
    """`_point` in a fresh interpreter (its own peak memory)."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import planner_scaling as s; "
        f"print(json.dumps(s._point({kind!r}, {gpus}, {layers!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=1200
    )
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"planner_scaling: {kind} {gpus} GPUs {layers} layers failed: {tail[0]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def slope(rows: list[dict], x: str) -> float | None:
    """Least-squares slope of log(solve_s) on log(x) over the optimal rows (None: < 2)."""
    pts = [(math.log(r[x]), math.log(max(r["solve_s"], 1e-3))) for r in rows if r["gap"] == 0]
    if len(pts) < 2:
        return None
    mx = sum(a for a, _ in pts) / len(pts)
    my = sum(b for _, b in pts) / len(pts)
    den = sum((a - mx) ** 2 for a, _ in pts)
    return sum((a - mx) * (b - my) for a, b in pts) / den if den else None


def table(rows: list[dict]) -> str:
    head = "| cluster | GPUs | layers | solve s | process s | peak MiB | status | gap | plan |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['gpus']:,} | {r['layers']} | {r['solve_s']:.2f} | "
            f"{r['process_s']:.1f} | {r['peak_mib']:.0f} | {r['status']} | "
            f"{r['gap'] * 100:.1f}% | {r['plan']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("planner_scaling: --plot needs matplotlib (pip install matplotlib)")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for kind, marker in (("homogeneous", "o"), ("mixed", "s")):
        g = [r for r in rows if r["kind"] == kind and r["sweep"] == "gpus"]
        lay = [r for r in rows if r["kind"] == kind and r["sweep"] == "layers"]
        if g:
            axes[0].plot([r["gpus"] for r in g], [r["solve_s"] for r in g], marker=marker,
                         label=kind)  # fmt: skip
            axes[1].plot([r["gpus"] for r in g], [r["peak_mib"] for r in g], marker=marker,
                         label=kind)  # fmt: skip
        if lay:
            axes[2].plot([r["layers"] for r in lay], [r["solve_s"] for r in lay], marker=marker,
                         label=kind)  # fmt: skip
    axes[0].set(xscale="log", yscale="log", xlabel="GPUs", ylabel="solve s",
                title="Llama 3 8B: solve time")  # fmt: skip
    axes[1].set(xscale="log", xlabel="GPUs", ylabel="peak MiB (process)",
                title="Llama 3 8B: peak memory")  # fmt: skip
    axes[2].set(xscale="log", yscale="log", xlabel="layers", ylabel="solve s",
                title=f"70B layer, {LAYER_GPUS} GPUs: solve time")  # fmt: skip
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--plot", help="write the three panels here (PNG; needs matplotlib)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    gpus = GPUS_QUICK if args.quick else GPUS
    layers = LAYERS_QUICK if args.quick else LAYERS
    rows: list[dict] = []
    for kind in ("homogeneous", "mixed"):
        for n in gpus:
            rows.append(run_point(kind, n, None) | {"sweep": "gpus"})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        for n in layers:
            rows.append(run_point(kind, LAYER_GPUS, n) | {"sweep": "layers"})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    for kind in ("homogeneous", "mixed"):
        for sweep, x in (("gpus", "gpus"), ("layers", "layers")):
            s = slope([r for r in rows if r["kind"] == kind and r["sweep"] == sweep], x)
            shown = "n/a (fewer than two optimal points)" if s is None else f"{s:.2f}"
            print(f"growth of solve time, {kind}, against {x}: time ~ {x}^{shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
