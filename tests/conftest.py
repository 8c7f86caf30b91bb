"""Test tiers (tests/README.md): the `multiprocess` marker goes on every test of the files
that start gloo ranks (`meshplan.runtime.run_local`, `meshplan launch`, `meshplan.verify`,
`meshplan calibrate`), listed here once, so `-m multiprocess` / `-m "not multiprocess"`
select the tiers. tests/test_markers.py checks the list against the files that call
`run_local` themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

# Relative to tests/; a glob may name several files.
MULTIPROCESS = (
    "runtime/test_parity*.py",
    "runtime/test_launch.py",
    "runtime/test_no_hang.py",
    "runtime/test_model_matrix.py",
    "runtime/test_compressed.py",
    "runtime/test_quantize.py",
    "runtime/test_hybrid_precision.py",
    "runtime/test_master_weights.py",
    "runtime/test_edited_plans.py",
    "measure/test_calibrate.py",
    "planner/test_verify.py",
)


def multiprocess_files() -> set[Path]:
    """The test files of the multi-process tier."""
    return {p.resolve() for pattern in MULTIPROCESS for p in ROOT.glob(pattern)}


def pytest_collection_modifyitems(config, items):
    files = multiprocess_files()
    for item in items:
        if Path(str(item.fspath)).resolve() in files:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture
def gpu_time_only(monkeypatch):
    """Price the GPU's time alone (`MESHPLAN_HOST_US=0`, `cost_model.host`): for tests of
    GPU-side pricing whose models are so small that the host would hold the GPU up and mask
    what they check. tests/cost_model/test_host.py tests the host term itself."""
    monkeypatch.setenv("MESHPLAN_HOST_US", "0")
