"""The multi-process tier's marker covers every test file that starts ranks itself."""

from __future__ import annotations

import re

from tests.conftest import MULTIPROCESS, ROOT, multiprocess_files


def test_every_pattern_names_a_file():
    for pattern in MULTIPROCESS:
        assert list(ROOT.glob(pattern)), f"tests/conftest.py: {pattern} matches no file"


def test_files_that_start_ranks_are_marked():
    starts = re.compile(r"\brun_local\(")
    callers = {p.resolve() for p in ROOT.rglob("test_*.py") if starts.search(p.read_text())}
    missing = sorted(str(p.relative_to(ROOT)) for p in callers - multiprocess_files())
    assert not missing, f"start ranks but are not in tests/conftest.py MULTIPROCESS: {missing}"
