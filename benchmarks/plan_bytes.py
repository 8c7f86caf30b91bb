"""Plan bytes: a fixed list of scenarios planned, and the sha256 of each plan's JSON.

    python benchmarks/plan_bytes.py                     # print one hash per scenario
    python benchmarks/plan_bytes.py -o before.json      # ... and write them to a file
    python benchmarks/plan_bytes.py --compare before.json   # exit 1 when any hash differs

A change that claims to change no behaviour (a module moved, an import cycle broken) keeps
every hash: run it before the change with -o and after it with --compare. The solver's budget
is counted work, not wall time, and the plan JSON records no wall time, so the same inputs
give the same bytes on an idle or a loaded machine. The one field that names a version of the
code, "meshplan_version", is blanked before hashing so a version bump alone keeps the hashes.

Scenarios: `meshplan plan` with its defaults (the CLI, in a subprocess), the solver-speed
presets of benchmarks/planner_speed.py under a small work budget, and a mixed H100 + A100
cluster at two sites with compression and quantization choices on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# The fields of a plan JSON that name the code's version rather than the plan.
VERSION_FIELDS = ("meshplan_version",)

# Work budget of the preset solves (seconds of counted work, not wall time): small, so the
# script runs in a few minutes; any fixed value gives fixed bytes.
BUDGET_S = 2.0


def digest(text: str) -> str:
    """sha256 of a plan JSON's bytes, with the values of the version fields blanked."""
    for key in VERSION_FIELDS:
        text = re.sub(rf'"{key}": "[^"]*"', f'"{key}": ""', text)
    return hashlib.sha256(text.encode()).hexdigest()


def cli_default() -> str:
    """`meshplan plan -o FILE` with every default, run as a user runs it."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "plan.json"
        code = "import sys; from meshplan.cli import main; sys.argv = sys.argv[1:]; main()"
        subprocess.run(
            [sys.executable, "-c", code, "meshplan", "plan", "-o", str(out)],
            check=True,
            capture_output=True,
            env={**os.environ, "COLUMNS": "120"},
        )
        return out.read_text()


def preset(model: str, cluster: Callable, global_batch: int, **kw) -> Callable[[], str]:
    """A plan of one zoo preset on one cluster, through `meshplan.plan`."""

    def run() -> str:
        import meshplan

        m, inputs = meshplan.models.get(model)
        plan = meshplan.plan(
            m, inputs, cluster(), global_batch=global_batch, time_limit_s=BUDGET_S, **kw
        )
        return plan.to_json()

    return run


def _homogeneous(gpus: int):
    from meshplan.ir import Cluster

    return lambda: Cluster.preset("dgx-h100", gpus=gpus)


def _mixed(gpus: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planner_speed import mixed

    return lambda: mixed(gpus)


SCENARIOS: dict[str, Callable[[], str]] = {
    "cli plan (defaults)": cli_default,
    "llama3-8b on 64 H100": preset("llama3-8b", _homogeneous(64), 512),
    "llama3-70b on 512 H100+A100": preset("llama3-70b", _mixed(512), 1024),
    "deepseek-moe-16b on 4096 H100+A100": preset("deepseek-moe-16b", _mixed(4096), 2048),
    "llama3-8b on 128 H100+A100, quantize auto": preset(
        "llama3-8b", _mixed(128), 256, quantize="auto"
    ),
    "llama3-8b on 128 H100+A100, compress off": preset(
        "llama3-8b", _mixed(128), 256, compress="off"
    ),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", type=Path, help="write {scenario: sha256} here")
    ap.add_argument("--compare", type=Path, help="compare with hashes written by -o")
    args = ap.parse_args(argv)
    hashes = {}
    for name, run in SCENARIOS.items():
        hashes[name] = digest(run())
        print(f"{hashes[name]}  {name}", flush=True)
    if args.output:
        args.output.write_text(json.dumps(hashes, indent=1) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        changed = [n for n in hashes if before.get(n) != hashes[n]]
        for n in changed:
            print(f"CHANGED  {n}: {before.get(n)} -> {hashes[n]}")
        print("all plans byte-identical" if not changed else f"{len(changed)} plan(s) changed")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
