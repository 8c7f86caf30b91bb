"""The `meshplan` script leaves without Python's teardown (`cli._leave`): its output must still
be complete, its files written, its exit status the command's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from meshplan import cli

SCRIPT = [sys.executable, "-c", "from meshplan.cli import main; main()"]


def test_piped_output_and_files_are_complete(tmp_path):
    out = tmp_path / "plan.json"
    r = subprocess.run(
        [*SCRIPT, "plan", "-m", "tiny", "--cluster", "cpu", "--gpus", "2", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == f"wrote {out}", r.stdout[-500:]  # flushed to the end
    assert json.loads(out.read_text())["degrees"]


def test_a_user_mistake_keeps_status_2_and_one_line():
    r = subprocess.run([*SCRIPT, "plan", "-m", "no-such-model"], capture_output=True, text=True)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr


@pytest.mark.parametrize(
    ("code", "status", "printed"), [(None, 0, ""), (3, 3, ""), ("bye", 1, "bye")]
)
def test_exit_codes_mean_what_sys_exit_means(monkeypatch, capsys, code, status, printed):
    monkeypatch.delitem(sys.modules, "coverage", raising=False)
    left = []

    def fake_exit(s: int) -> None:
        left.append(s)
        raise SystemExit(s)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        cli._leave(code)
    assert left == [status]
    assert capsys.readouterr().err.strip() == printed
