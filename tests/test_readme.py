"""The README's commands run as written. CI (`.ci/run`) runs the blocks after the
`<!-- ci:run -->`, `<!-- ci:train -->` and `<!-- ci:test -->` markers verbatim; here (unit
tier) every `meshplan` line of the README parses against the CLI, and (slow tier) the CPU
training example runs as written, each command within a minute."""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import typer
from meshplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MARKERS = ("<!-- ci:run -->", "<!-- ci:train -->", "<!-- ci:test -->")


def block_after(marker: str) -> list[str]:
    """The lines of the first fenced block after `marker` (what `.ci/run` extracts)."""
    rest = README.split(marker, 1)[1]
    return rest.split("```", 2)[1].split("\n")[1:-1]


def readme_commands() -> list[str]:
    """Every `meshplan ...` line of the README's bash blocks, comments cut off."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines += [ln.split(" #")[0].strip() for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("meshplan ")]


def test_ci_runs_the_marked_blocks():
    script = (ROOT / ".ci" / "run").read_text()
    for marker in MARKERS:
        assert marker in README and marker in script, marker
        assert block_after(marker), marker
    train = block_after("<!-- ci:train -->")
    assert train[0].startswith("python examples/train_llama_cpu.py --make-plan plan.json")
    assert any(c.startswith("meshplan launch plan.json -- python") for c in train)


@pytest.mark.parametrize("line", [c for c in readme_commands() if "..." not in c and "[" not in c])
def test_readme_commands_parse(line):
    """Each names a command and options that exist, with values they accept (placeholders
    like `...` and `[--cluster FILE]` are skipped)."""
    name, *args = shlex.split(line)[1:]
    command = typer.main.get_command(app).commands[name]
    command.make_context(name, args)


@pytest.mark.slow
def test_cpu_training_example_runs_as_written(tmp_path):
    """The ci:train block, verbatim, in a scratch folder that sees examples/ (as `.ci/run`)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for command in block_after("<!-- ci:train -->"):
        t0 = time.monotonic()
        r = subprocess.run(
            command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        took = time.monotonic() - t0
        assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
        assert took < 60, (command, took)
    assert "done:" in r.stdout and "step 4: loss" in r.stdout
