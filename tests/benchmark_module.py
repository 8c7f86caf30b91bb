"""Load a script of benchmarks/ as a module in tests (benchmarks/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def benchmark_module(stem: str) -> ModuleType:
    """benchmarks/<stem>.py, loaded once per session under a name of its own and registered in
    `sys.modules` before it runs (its dataclasses look their module up while the file runs)."""
    name = f"meshplan_benchmarks_{stem}"
    if name not in sys.modules:
        path = ROOT / "benchmarks" / f"{stem}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
