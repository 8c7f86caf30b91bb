"""The model x configuration matrix as a table: users' models under every parallelism.

Each cell (see tests/runtime/test_model_matrix.py) is planned as a user would plan it, trained
3 SGD steps on 2 or 4 forked CPU gloo ranks and compared with one process; it prints
OK (seconds), REFUSED: the plan-time reason, RUNTIME-FAIL: the failing rank's line, or WRONG:
the first divergence. Cells run one at a time.

    python benchmarks/model_matrix.py                                   # every cell
    python benchmarks/model_matrix.py --models nanogpt,hf-llama --configs dp,tp
    python benchmarks/model_matrix.py --json matrix.json                # also the raw cells

Run from the repository root (the models and the cell runner live under tests/runtime/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _matrix():
    """The test module, imported when needed (it lives under tests/, beside its models)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.runtime import test_model_matrix

    return test_model_matrix


def _show(cell, mx) -> str:
    if cell.status == "OK":
        return f"OK ({cell.seconds:.1f} s)"
    if cell.status == "REFUSED" and (unused := mx.blames_unused_axis(cell.reason)):
        return f"REFUSED (inaccurate: blames {unused}): {cell.reason}"
    return f"{cell.status}: {cell.reason}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model names (default: all)")
    parser.add_argument("--configs", help="comma-separated configuration names (default: all)")
    parser.add_argument("--json", help="write every cell as JSON to this file")
    parser.add_argument("--width", type=int, default=160, help="truncate reasons to this width")
    args = parser.parse_args(argv)

    mx = _matrix()
    models = args.models.split(",") if args.models else list(mx.MODELS)
    configs = args.configs.split(",") if args.configs else list(mx.CONFIGS)
    unknown = [m for m in models if m not in mx.MODELS] + [
        c for c in configs if c not in mx.CONFIGS
    ]
    if unknown:
        parser.error(f"unknown model or configuration: {', '.join(unknown)}")
    wanted = [(m, c) for m, c in mx.cells() if m in models and c in configs]

    t0 = time.perf_counter()
    results = []
    for model, config in wanted:
        cell = mx.run_cell(model, config)
        results.append(cell)
        known = " [known]" if (model, config) in mx.KNOWN else ""
        line = f"{model:<14} {config:<10} {_show(cell, mx)}{known}"
        print(line[: args.width], flush=True)
    total = time.perf_counter() - t0

    counts: dict[str, int] = {}
    for cell in results:
        counts[cell.status] = counts.get(cell.status, 0) + 1
    print()
    print("  ".join(f"{k}: {v}" for k, v in sorted(counts.items())), f"  total {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(c) for c in results], indent=1))
    passed = [c.status == "OK" or (c.status == "REFUSED" and not mx.blames_unused_axis(c.reason))
              for c in results]  # fmt: skip
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
