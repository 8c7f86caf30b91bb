"""Wall time and peak memory of `meshplan.ir.trace` on big zoo models (meta device).

Each model runs in its own subprocess so that peak RSS (getrusage ru_maxrss) belongs to that
model alone. Targets: Llama-3-70B in < 60 s and < 4 GiB RSS, 405B in
< 3 min, on a 2-core CPU.

    python benchmarks/trace_speed.py                       # llama3-8b, -70b, -405b at 8k
    python benchmarks/trace_speed.py llama3-70b --seq-len 4096 --micro-batch 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

DEFAULT_MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")


def run_one(name: str, seq_len: int, micro_batch: int) -> dict[str, object]:
    """Build and trace one preset in this process; returns the measurements."""
    import resource

    t0 = time.perf_counter()
    import torch  # noqa: F401  (import cost reported separately)
    from meshplan import models
    from meshplan.ir import trace

    t1 = time.perf_counter()
    model, inputs = models.get(name, seq_len=seq_len, micro_batch=micro_batch)
    t2 = time.perf_counter()
    graph = trace(model, *inputs)
    t3 = time.perf_counter()
    n_ops = sum(len(b.ops) for _, b in graph.unit_blocks())
    return {
        "model": name,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "import_s": round(t1 - t0, 2),
        "build_s": round(t2 - t1, 2),
        "trace_s": round(t3 - t2, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "params_b": round(graph.num_params() / 1e9, 3),
        "tflop_per_step": round(graph.total_flops() / 1e12, 1),
        "saved_gib": round(graph.saved_activation_bytes() / 2**30, 1),
        "units": len(graph.units),
        "templates": len(graph.blocks),
        "ops": n_ops,
    }


def main() -> None:
    """Trace each requested model in a subprocess and print one table row per model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:  # child: one model, JSON on stdout
        print(json.dumps(run_one(args.models[0], args.seq_len, args.micro_batch)))
        return

    header = (
        f"{'model':<18}{'seq':>6}{'mb':>4}{'build s':>9}{'trace s':>9}{'wall s':>8}"
        f"{'peak RSS MiB':>14}{'params B':>10}{'TFLOP':>10}{'units':>7}{'ops':>9}"
    )
    print(header)
    for name in args.models:
        cmd = [
            sys.executable,
            __file__,
            name,
            "--one",
            "--seq-len",
            str(args.seq_len),
            "--micro-batch",
            str(args.micro_batch),
        ]
        start = time.perf_counter()
        out = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if out.returncode != 0:
            print(f"{name:<18} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{name:<18}{r['seq_len']:>6}{r['micro_batch']:>4}{r['build_s']:>9}{r['trace_s']:>9}"
            f"{wall:>8.1f}{r['peak_rss_mib']:>14}{r['params_b']:>10}{r['tflop_per_step']:>10}"
            f"{r['units']:>7}{r['ops']:>9}"
        )


if __name__ == "__main__":
    main()
