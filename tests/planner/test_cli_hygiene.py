"""CLI hygiene (unit tier, no processes started): every user mistake is one `error:` line
and exit status 2, output files behave like output files, launch checks its options, and
`--version` / `--debug` exist. docs/errors.md lists these messages."""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time

import meshplan
import pytest
from meshplan.cli import app
from meshplan.ir.plan import Plan, PlanError, write_text_file
from meshplan.runtime.errors import RuntimePlanError
from meshplan.runtime.launch import parse_endpoint
from typer.testing import CliRunner

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def assert_user_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # exactly one line, never a traceback
    assert lines[0].startswith("error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A one-node plan on 2 CPU ranks for the tiny model."""
    model, inputs = meshplan.models.get("tiny", seq_len=32, micro_batch=1)
    graph = meshplan.trace(model, *inputs, name="tiny")
    plan = meshplan.estimate_plan(
        graph,
        cluster=meshplan.Cluster.preset("cpu", gpus=2),
        parallel=meshplan.Parallel(dp=2, micro_batch=1, global_batch=4),
    )
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.to_json(path)
    return path


@pytest.fixture
def umask():
    """Set the process umask for one test, then put the old one back."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


# -- output files ---------------------------------------------------------------------------


def test_output_to_a_directory_is_one_line(tmp_path):
    for command in ("plan", "estimate"):
        assert_user_error(run(command, "--model", "tiny", "-o", str(tmp_path)), "is a directory")
    assert_user_error(run("calibrate", "-o", str(tmp_path)), "is a directory")
    with pytest.raises(PlanError, match="is a directory"):
        write_text_file(tmp_path, "{}")


def test_plan_files_follow_the_umask(plan_file, tmp_path, umask):
    plan = Plan.from_json(plan_file)
    for mask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        umask(mask)
        path = tmp_path / f"plan-{mask:o}.json"
        plan.to_json(path)
        assert stat.S_IMODE(path.stat().st_mode) == mode, oct(path.stat().st_mode)
    # an existing file keeps its own mode
    path = tmp_path / "kept.json"
    path.write_text("old")
    path.chmod(0o640)
    plan.to_json(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and Plan.from_json(path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_special_files_are_written_not_replaced(plan_file, tmp_path):
    """A FIFO (like /dev/null or /dev/stdout: not a regular file) is written in place; the
    atomic rename would have replaced it with a plain file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    r = run("estimate", "--model", "tiny", "--cluster", "cpu", "--gpus", "2", "-o", str(fifo))
    reader.join(timeout=30)
    assert r.exit_code == 0, r.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert got and got[0].startswith(b"{")
    # a symbolic link is written through, and stays a link
    target = tmp_path / "target.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text_file(link, "{}\n")
    assert link.is_symlink() and target.read_text() == "{}\n"


def test_a_failing_write_is_one_line(monkeypatch, tmp_path):
    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("meshplan.ir.plan.write_text_file", full)
    out = tmp_path / "p.json"
    r = run("estimate", "--model", "tiny", "--cluster", "cpu", "--gpus", "2", "-o", str(out))
    assert_user_error(r, str(out), "No space left on device")


# -- launch ----------------------------------------------------------------------------------


def test_malformed_rendezvous_endpoints(plan_file):
    for bad in ("notahost", "host:", ":29500", "host:http", "host:70000", "a b:1", "::1:29500"):
        with pytest.raises(RuntimePlanError, match="rdzv-endpoint"):
            parse_endpoint(bad)
        r = run("launch", str(plan_file), "--rdzv-endpoint", bad, "--dry-run", "--", "t.py")
        assert_user_error(r, "--rdzv-endpoint", repr(bad))
    assert parse_endpoint("node0:29400") == ("node0", 29400)
    assert parse_endpoint("10.0.0.1:1") == ("10.0.0.1", 1)
    assert parse_endpoint("[::1]:29500") == ("::1", 29500)


def test_unknown_launch_options_are_refused_with_a_suggestion(plan_file):
    r = run("launch", str(plan_file), "--nproc", "2", "--", "python", "train.py")
    assert_user_error(r, "No such option: --nproc", "Did you mean --node-rank?", "after `--`")
    assert_user_error(run("launch", str(plan_file), "--foo", "--", "python", "t.py"), "--foo")
    assert_user_error(run("launch", str(plan_file), "--dryrun", "--", "python"), "--dry-run")
    # after `--` everything is the program's, options included
    r = run("launch", str(plan_file), "--dry-run", "--", "python", "train.py", "--nproc", "2")
    assert r.exit_code == 0, r.stderr
    assert "train.py --nproc 2" in r.stdout and "--nproc-per-node=2" in r.stdout


def test_node_rank_is_checked_under_dry_run(plan_file):
    r = run("launch", str(plan_file), "--node-rank", "3", "--dry-run", "--", "python", "t.py")
    assert_user_error(r, "--node-rank 3", "1 node(s)")


# What torchrun 2.13 wrote on stderr when rank 1 of 4 raised SystemExit('rank 1: broken
# input'), shortened, with a rank's own traceback and a c10d line from a rank added.
TORCHRUN_STDERR = """\
W1126 22:40:51.743000 30104 site-packages/torch/distributed/run.py:874] *****************
W1126 22:40:51.743000 30104 site-packages/torch/distributed/run.py:874] Setting OMP_NUM_THREADS \
environment variable for each process to be 1 in default
W1126 22:40:51.743000 30104 site-packages/torch/distributed/run.py:874] *****************
[rank0]:[W1126 22:40:51.900000 30105 torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:7] Warning: x
Traceback (most recent call last):
  File "/home/me/train.py", line 3, in <module>
    raise SystemExit('rank 1: broken input')
rank 1: broken input
E1126 22:40:51.995000 30104 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] \
failed (exitcode: 1) local_rank: 1 (pid: 30108) of binary: /usr/bin/python3.11
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/usr/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in la
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
  rank      : 1 (local_rank: 1)
============================================================
"""


def test_torch_log_is_held_back_and_summarised(plan_file, tmp_path, monkeypatch, capfd):
    """torchrun's own log and traceback are held back (one note says what); the ranks' own
    output, tracebacks included, passes through; `--debug` passes everything through."""
    fake = tmp_path / "torchrun"  # stands in for torchrun on PATH: prints, then fails
    fake.write_text(
        f"#!{sys.executable}\nimport sys\nsys.stderr.write({TORCHRUN_STDERR!r})\nsys.exit(1)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    r = run("launch", str(plan_file), "--", "python", "train.py")
    assert r.exit_code == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[:4] == [
        "Traceback (most recent call last):",
        '  File "/home/me/train.py", line 3, in <module>',
        "    raise SystemExit('rank 1: broken input')",
        "rank 1: broken input",
    ]
    assert lines[4] == (
        "note: held back 18 lines of torch's own log (4 warning lines, 1 error line, "
        "torchrun's ChildFailedError traceback); `meshplan --debug launch ...` prints it"
    )
    assert lines[5].startswith("error: training exited with status 1") and len(lines) == 6
    capfd.readouterr()
    r = run("--debug", "launch", str(plan_file), "--", "python", "train.py")
    assert r.exit_code == 1 and "note:" not in r.stderr
    assert capfd.readouterr().err == TORCHRUN_STDERR  # torchrun's stderr, untouched


# -- flags, --version, --debug ------------------------------------------------------------------


FACTORY = """\
import pathlib

import torch


def build(n):
    raise RuntimeError(f"cannot build layer {n}")


def factory():
    pathlib.Path(__file__).with_suffix(".called").touch()
    model = torch.nn.Linear(4, 4)
    build(3)
    return model, (torch.randn(2, 4),)
"""


@pytest.fixture
def bad_factory(tmp_path):
    path = tmp_path / "badmodel.py"
    path.write_text(FACTORY)
    return path


def test_enum_flags_are_checked_before_tracing(bad_factory):
    """The factory (and any trace) never runs: the flag is refused while parsing."""
    model = f"{bad_factory}:factory"
    for flag, value, needle in (
        ("--zero", "5", "--zero must be 0, 1, 2 or 3, got 5"),
        ("--schedule", "1f2b", "--schedule must be one of gpipe, 1f1b"),
        ("--recompute", "most", "--recompute must be one of none, selective, full, got 'most'"),
        ("--objective", "fast", "objective must be one of throughput, cost, min_gpus"),
        ("--compress", "zip", "compress must be one of auto, off, got 'zip'"),
        ("--quantize", "fp4", "quantize must be one of off, auto"),
        ("--micro-batch", "0", "--micro-batch must be a positive integer"),
    ):
        assert_user_error(run("plan", "--model", model, flag, value), needle)
    assert_user_error(run("plan", "--model", model, "--objective", "min_gpus"), "target")
    assert_user_error(run("estimate", "--model", model, "--schedule", "x"), "--schedule")
    assert_user_error(run("estimate", "--model", model, "--zero", "4"), "--zero")
    assert_user_error(run("whatif", "--model", model, "--recompute", "x"), "--recompute")
    assert not bad_factory.with_suffix(".called").exists()


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"meshplan {meshplan.__version__}"


def test_user_code_error_names_its_line_and_debug_prints_the_traceback(bad_factory):
    model = f"{bad_factory}:factory"
    line = assert_user_error(run("plan", "--model", model), "RuntimeError: cannot build layer 3")
    assert f"at {bad_factory}:7 in build" in line and "--debug" in line
    started = time.monotonic()
    r = run("--debug", "plan", "--model", model)
    assert r.exit_code == 2 and time.monotonic() - started < 60
    assert "Traceback (most recent call last)" in r.stderr
    assert f'File "{bad_factory}", line 13, in factory' in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error:")


def test_usage_mistakes_are_one_line():
    assert_user_error(run("plann"), "No such command")
    assert_user_error(run("validate"), "Missing argument")
    assert_user_error(run("plan", "--gpus", "many"), "--gpus")


def test_pinned_degrees_beyond_the_cluster_are_named_as_the_user_gave_them():
    """Not a cp nobody asked for, nor "the cluster holds 0 of them"."""
    r = run("plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "16", "--dp", "8",
            "--tp", "4", "--pp", "2")  # fmt: skip
    assert_user_error(r, "dp*tp*pp = 8*4*2 = 64 GPUs pinned", "has 16")
    assert "cp" not in r.output


def test_whatif_mix_without_a_gpu_count_is_a_usage_error():
    assert_user_error(run("whatif", "--mix", "H100:A100=1:3"), "--mix needs a total GPU count")


@pytest.mark.parametrize("limit", ["0", "-1", "nan", "inf"])
def test_a_budget_that_is_not_a_positive_number_is_refused(limit):
    """Found in session 23: 0 and -1 planned as if no budget was given, nan stopped at once."""
    r = run("plan", "--model", "tiny", "--time-limit", limit)
    assert_user_error(r, "must be a positive number")
    r = run("whatif", "--model", "tiny", "--gpus", "8", "--time-limit", limit)
    assert_user_error(r, "--time-limit must be a positive number")


def test_whatif_gpu_count_is_checked_once_not_reported_per_row():
    """`--gpus 0` was an "infeasible" row of the table with exit status 0."""
    assert_user_error(run("whatif", "--model", "tiny", "--gpus", "0"), "--gpus must be a positive")


def test_cost_objective_prints_the_dollar_figure():
    r = run("plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8",
            "--objective", "cost", "--price", "H100=2.5")  # fmt: skip
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("cost: $"))
    gpus = int(line.split("(")[1].split()[0])
    assert f"${gpus * 2.5:,.2f} per hour" in line and "per million tokens" in line


def test_calibrate_sizes_are_checked_before_any_rank_starts(tmp_path):
    r = run("calibrate", "--nproc", "2", "--min-size", "1MiB", "--max-size", "4KiB",
            "-o", str(tmp_path / "p.json"))  # fmt: skip
    assert_user_error(r, "--min-size 1MiB and --max-size 4KiB")
    assert not (tmp_path / "p.json").exists()
