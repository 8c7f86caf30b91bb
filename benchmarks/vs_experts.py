"""meshplan's plan against the experts' published configurations (docs/planner.md).

For every row of the table of published runs (`--csv`, the CSV `benchmarks/fidelity.py` reads)
that gives a full parallel configuration (the rows `benchmarks/fidelity.py` prices, counted or
shown apart), plan the same model on the same cluster and GPU count with the same global
batch and sequence length, and compare the two *under meshplan's own cost model*, both priced
as the row's training stack runs (`fidelity.interpret`'s engine: fused kernels, Float8,
flash-attn kernel and fused loss): ratio = predicted step of the published configuration /
predicted step of meshplan's plan (>= 1: meshplan's plan is at least as fast).

    python benchmarks/vs_experts.py --cache /tmp/fid          # traced graphs shared with fidelity
    python benchmarks/vs_experts.py --rows 3,4 --time-limit 10

The planner may use fewer GPUs than the row (it never needs to use them all) and may pick any
dimension; the dtype is the row's (fp16 for the V100 rows). Rows and their reading come from
`benchmarks/fidelity.py` (`interpret`, `build_cluster`, `graph_for`), so both benchmarks price
the same thing.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402  (the row -> model/cluster helpers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", type=Path, default=fidelity.DEFAULT_CSV)
    ap.add_argument("--cache", type=Path, help="directory to keep traced graphs in")
    ap.add_argument("--rows", help="comma-separated row numbers (default: all with a config)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="solver seconds per row")
    args = ap.parse_args(argv)
    from meshplan.api import check_config, complete_parallel, default_stages
    from meshplan.cost_model import predict
    from meshplan.cost_model.engine import Engine
    from meshplan.ir import Parallel
    from meshplan.passes.partition import place_stages
    from meshplan.solver import solve

    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    cases = [fidelity.interpret(i + 1, r) for i, r in enumerate(rows)]
    cases = [c for c in cases if c.status != "excluded"]
    if args.rows:
        keep = {int(x) for x in args.rows.split(",")}
        cases = [c for c in cases if c.row in keep]
    ratios = []
    print(
        f"{'row':>4} {'model':24s} {'GPUs':>5} {'published':38s} {'pub s':>8} {'plan s':>8} "
        f"{'ratio':>6}  meshplan's plan"
    )
    for c in cases:
        graph = fidelity.graph_for(c.arch, c.seq_len, args.cache)
        cluster = fidelity.build_cluster(c.cluster, c.gpus)
        pub = complete_parallel(graph, cluster, Parallel(**c.parallel))
        check_config(graph, cluster, pub, Parallel(**c.parallel))
        stages = place_stages(cluster, pub, default_stages(graph, pub))
        engine = Engine(**c.engine)  # the row's stack (fused kernels, float8, flash-attn, ...)
        published = predict(graph, cluster, pub, stages, dtype=c.dtype, engine=engine).step_time_s
        t0 = time.perf_counter()
        r = solve(
            graph,
            cluster,
            Parallel(),
            global_batch=pub.global_batch,
            time_limit_s=args.time_limit,
            dtype=c.dtype,
            engine=engine,
        )
        wall = time.perf_counter() - t0
        planned = r.prediction.step_time_s
        ratio = published / planned
        ratios.append(ratio)
        p = r.parallel
        v = f" v{p.virtual_stages}" if p.virtual_stages else ""
        plan = (
            f"tp{p.tp} pp{p.pp} dp{p.dp} cp{p.cp} mb{p.micro_batch} ZeRO-{p.zero} "
            f"{p.recompute.value} {p.schedule.value}{v} ({r.status}, {wall:.1f} s)"
        )
        print(
            f"{c.row:4d} {c.model[:24]:24s} {c.gpus:5d} {fidelity._config_str(c)[:38]:38s} "
            f"{published:8.3f} {planned:8.3f} {ratio:6.3f}  {plan}",
            flush=True,
        )
    if ratios:
        print(
            f"\n{len(ratios)} rows: ratio min {min(ratios):.3f}, median "
            f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}; "
            f"{sum(x >= 1 - 1e-9 for x in ratios)} rows at least as fast as published"
        )
    return 0 if all(x >= 1 - 1e-9 for x in ratios) else 1


if __name__ == "__main__":
    raise SystemExit(main())
