"""How well the search's work charges (`solver_objective.WORK_COSTS`) match the CPU they stand for.

The planner's budget is counted work, not seconds, so that identical inputs give identical
plans on a loaded and an idle machine (`_Work`). Each step of the search is charged a fixed
cost per kind (a bound, a memory check, a priced table cell, ...), fitted once against CPU
time on the 2-core development machine. When the code of a step gets dearer or cheaper, the
charges drift from the CPU and a budget of 10 work units stops meaning about 10 CPU seconds.
This script measures that drift and refits the costs; it changes nothing in the package.

    python benchmarks/work_costs.py          # a few solves, ~2-4 minutes
    python benchmarks/work_costs.py --full   # the 14 solves the shipped costs came from

How: every `_Work` the solves create (the single-group seeds of a mixed cluster included) is
followed; every 200 charges its process time and counts are snapshotted. A nested solve's
CPU is the parent's but not its counts, so a parent's snapshots are cut into segments at each
nested solve it absorbs, each segment measured from its own start. The costs are refitted by
non-negative least squares of the segments' CPU seconds on their counts (scipy's `nnls` when
installed, else an active-set loop on numpy's `lstsq`), and the script prints, per kind, the
shipped cost, the refitted one, the most steps one segment counted and how much of the CPU
each kind took, then charged work against CPU per solve.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SNAPSHOT_EVERY = 200


@dataclass
class _Trace:
    """The snapshots of one `_Work`, cut into segments at each nested solve it absorbs."""

    segments: list[list[tuple[float, dict]]] = field(default_factory=list)
    calls: int = 0


def _install():
    """Wrap `_Work.starting_now`, `charge` and `absorb` (class attributes, so every `_Work`
    the solver makes is followed); returns the registry of traces by work object."""
    from meshplan import solver_objective as so

    traces: dict[int, _Trace] = {}
    start, charge, absorb = so._Work.starting_now.__func__, so._Work.charge, so._Work.absorb

    def starting_now(cls, limit, wall_limit_s=None):
        w = start(cls, limit, wall_limit_s)
        traces[id(w)] = _Trace([[(time.process_time(), {})]])
        return w

    def charged(self, kind, n=1.0):
        charge(self, kind, n)
        t = traces.get(id(self))
        if t is not None:
            t.calls += 1
            if t.calls % SNAPSHOT_EVERY == 0:
                t.segments[-1].append((time.process_time(), dict(self.counts)))

    def absorbed(self, result):
        absorb(self, result)
        t = traces.get(id(self))
        if t is not None:  # the nested solve's CPU is not in these counts: a new segment
            t.segments.append([(time.process_time(), dict(self.counts))])

    so._Work.starting_now = classmethod(starting_now)
    so._Work.charge = charged
    so._Work.absorb = absorbed
    return traces


def _rows(traces: dict[int, _Trace], kinds: list[str]):
    """(X, y): count deltas and CPU seconds of every snapshot from its segment's start."""
    xs, ys = [], []
    for t in traces.values():
        for seg in t.segments:
            t0, c0 = seg[0]
            for ts, counts in seg[1:]:
                xs.append([counts.get(k, 0.0) - c0.get(k, 0.0) for k in kinds])
                ys.append(ts - t0)
    return np.array(xs, dtype=float), np.array(ys, dtype=float)


def nnls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, str]:
    """Non-negative least squares: scipy's when installed, else an active-set loop."""
    try:
        from scipy.optimize import nnls as scipy_nnls

        return scipy_nnls(x, y)[0], "scipy.optimize.nnls"
    except ImportError:
        pass
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return coef, "active-set lstsq (numpy)"


def scenarios(full: bool):
    """(name, model preset, cluster, global batch, budget)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from meshplan.ir import Cluster
    from planner_speed import mixed

    quick = [
        ("llama3-8b on 64 H100", "llama3-8b", lambda: Cluster.preset("dgx-h100", gpus=64), 512, 2),
        ("llama3-8b on 64+64 H100/A100", "llama3-8b", lambda: mixed(128), 512, 3),
        ("llama3-70b on 256+256 H100/A100", "llama3-70b", lambda: mixed(512), 1024, 4),
    ]
    if not full:
        return quick
    more = [
        ("llama3-8b on 32 H100", "llama3-8b", lambda: Cluster.preset("dgx-h100", gpus=32), 256, 1),
        ("llama3-8b on 64+64, budget 10", "llama3-8b", lambda: mixed(128), 512, 10),
        ("llama3-70b on 256+256, budget 10", "llama3-70b", lambda: mixed(512), 1024, 10),
        ("deepseek-moe-16b on 256+256", "deepseek-moe-16b", lambda: mixed(512), 1024, 5),
        ("mixtral-8x7b on 64+64", "mixtral-8x7b", lambda: mixed(128), 512, 5),
        # `meshplan plan`'s default: collectives may be coded (`compress="auto"`)
        ("llama3-70b on 256+256, compress auto", "llama3-70b", lambda: mixed(512), 1024, 10),
        ("llama3-8b on 64+64, compress auto", "llama3-8b", lambda: mixed(128), 512, 5),
    ]
    return quick + more


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the larger set of solves")
    args = ap.parse_args(argv)
    import meshplan
    from meshplan.api import as_graph, comm_options
    from meshplan.ir import Parallel
    from meshplan.solver import solve
    from meshplan.solver_objective import CPSAT_DETERMINISTIC_PER_WORK, WORK_COSTS

    traces = _install()
    graphs: dict[str, object] = {}
    per_solve = []
    for name, preset, make, batch, budget in scenarios(args.full):
        if preset not in graphs:
            model, inputs = meshplan.models.get(preset)
            graphs[preset] = as_graph(model, inputs, name=preset)
        before = set(traces)
        c0 = time.process_time()
        comm = comm_options("auto", "off")[0] if "compress auto" in name else None
        r = solve(
            graphs[preset], make(), Parallel(), global_batch=batch, time_limit_s=budget, comm=comm
        )
        cpu = time.process_time() - c0
        per_solve.append((name, budget, r.work, cpu, r.status, len(set(traces) - before)))
        print(f"{name:36s} budget {budget:4g}  charged {r.work:6.2f}  CPU {cpu:6.2f} s  "
              f"ratio {cpu / max(r.work, 1e-9):5.2f}  {r.status}", flush=True)  # fmt: skip

    kinds = sorted(WORK_COSTS) + ["cpsat"]
    x, y = _rows(traces, kinds)
    shipped = np.array([WORK_COSTS.get(k, 1.0 / CPSAT_DETERMINISTIC_PER_WORK) for k in kinds])
    coef, how = nnls(x, y)
    fitted, charged = x @ coef, x @ shipped

    def rel(pred: np.ndarray) -> np.ndarray:
        return np.abs(pred - y) / np.maximum(y, 1e-3)

    print(f"\n{len(y)} snapshots; refit by {how}")
    print(f"{'kind':12s} {'shipped':>10s} {'refitted':>10s} {'most':>12s} {'CPU share':>10s}")
    total = max(float(coef @ x.sum(axis=0)), 1e-9)
    for k, s, c, n in zip(kinds, shipped, coef, x.max(axis=0), strict=True):
        share = c * x[:, kinds.index(k)].sum() / total
        print(f"{k:12s} {s:10.2e} {c:10.2e} {n:12.0f} {share:10.1%}")
    for label, pred in (("shipped charges", charged), ("refitted charges", fitted)):
        e = rel(pred)
        print(
            f"{label:18s} against CPU: median {np.median(e):.0%}, p90 {np.percentile(e, 90):.0%}"
            f", signed median {np.median((pred - y) / np.maximum(y, 1e-3)):+.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
