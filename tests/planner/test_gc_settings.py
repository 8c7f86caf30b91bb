"""Garbage collection around the `meshplan` script (docs/planner.md, "The whole command"):
importing the package collects nothing while it imports and leaves the caller's setting as it
was, never freezing the caller's objects; the script (`cli.main`) freezes what it imported and
collects the young generation less often. Each case in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return done.stdout.strip()


@pytest.mark.parametrize("enabled", [True, False])
def test_importing_the_package_keeps_the_callers_collector(enabled):
    before = "gc.enable()" if enabled else "gc.disable()"
    out = _run(
        f"import gc; {before}; t = gc.get_threshold(); import meshplan; "
        "print(gc.isenabled(), gc.get_freeze_count(), gc.get_threshold() == t)"
    )
    assert out == f"{enabled} 0 True"


def test_the_script_freezes_what_it_imported():
    out = _run(
        "import gc, meshplan.cli as cli; from meshplan.solver_objective import "
        "GC_YOUNG_THRESHOLD as y; before = cli._AS_SCRIPT; cli._fewer_collections(); "
        "print(before, cli._AS_SCRIPT, gc.get_freeze_count() > 10_000, "
        "gc.get_threshold()[0] == y, gc.isenabled())"
    )
    # `_trace` freezes the traced model only in the script (`_AS_SCRIPT`), never when `app`
    # runs inside someone else's process
    assert out == "False True True True True"
