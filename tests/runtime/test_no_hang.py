"""No hang, ever: a rank stopped (SIGSTOP) or killed (SIGKILL) mid-training makes every other
rank leave non-zero within the timeout and a few seconds, and the report names that rank
(`runtime/watchdog.py`). Multi-process tier: forked gloo ranks (`run_local`); one real
`meshplan launch` (torchrun) in the slow tier.

Each run trains the tiny model; at step 2 the victim signals itself and writes the wall time
it did so. The timeout is 10 s: the bound checked is that time + 10 s + `SLACK_S`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import meshplan
import pytest
from meshplan.runtime import RankFailure, run_local
from meshplan.runtime.launch import failure_summary
from meshplan.runtime.watchdog import culprits, period_for, split_culprits

from tests.runtime.harness import CFG, SEQ, batch, build_model, loss_fn, make_plan, sgd

_MOE_GRAPHS: dict = {}


def moe_graph(model_kw: dict):
    """The tiny model with `model_kw` (experts), traced once per process."""
    import torch

    key = tuple(sorted(model_kw.items()))
    if key not in _MOE_GRAPHS:
        model, _ = meshplan.models.transformer(
            dtype="float32", micro_batch=1, **{**CFG, **model_kw}
        )
        example = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
        _MOE_GRAPHS[key] = meshplan.trace(model, example, example)
    return _MOE_GRAPHS[key]


ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0
SLACK_S = 4.0  # a beat period, the launcher's poll, a loaded 2-core machine


def _train_until_signalled(plan, victim: int, sig: int, mark: str, model_kw: dict | None = None):
    """Inside a rank: train; at step 2 the victim stops or kills itself. Every rank also
    returns its process groups' timeouts (never reached by a run that goes as planned).
    `model_kw`: the tiny model's overrides (experts for the EP cases)."""
    import torch
    import torch.distributed as dist
    from meshplan.ir.plan import MESH_AXES
    from meshplan.runtime import apply

    runner = apply(build_model(**(model_kw or {})), plan, loss_fn, sgd)
    cpu = torch.device("cpu")
    timeouts = {
        a: runner.ctx.group(a)._get_backend(cpu).options._timeout.total_seconds() for a in MESH_AXES
    }
    if any(t != TIMEOUT_S for t in timeouts.values()):  # a group torch made with 30 min
        raise AssertionError(f"process group timeouts {timeouts}")
    for step in range(10_000):
        if step == 2 and dist.get_rank() == victim:
            Path(mark).write_text(str(time.time()))
            os.kill(os.getpid(), sig)
        runner.step(*batch(plan.parallel.global_batch, step))
    return "unreachable"


# name -> (plan, victim rank, signal); the victim rank 0 hosts the store under run_local
CASES = {
    "tp-stop": (dict(world=2, tp=2, micro_batch=2, global_batch=4), 1, signal.SIGSTOP),
    "dp-stop-store-host": (dict(world=2, dp=2, micro_batch=2, global_batch=8), 0, signal.SIGSTOP),
    "pp-stop": (dict(world=2, pp=2, micro_batch=1, global_batch=4), 1, signal.SIGSTOP),
    "cp-stop": (dict(world=2, cp=2, micro_batch=2, global_batch=4), 1, signal.SIGSTOP),
    "dpxtp-stop": (dict(world=4, dp=2, tp=2, micro_batch=2, global_batch=8), 2, signal.SIGSTOP),
    "ppxdp-stop": (dict(world=4, pp=2, dp=2, micro_batch=1, global_batch=8), 3, signal.SIGSTOP),
    "dp-kill": (dict(world=2, dp=2, micro_batch=2, global_batch=8), 1, signal.SIGKILL),
    "tp-kill": (dict(world=2, tp=2, micro_batch=2, global_batch=4), 1, signal.SIGKILL),
    "cp-kill": (dict(world=2, cp=2, micro_batch=2, global_batch=4), 1, signal.SIGKILL),
    "ppxdp-kill": (dict(world=4, pp=2, dp=2, micro_batch=1, global_batch=8), 1, signal.SIGKILL),
    # expert parallelism: the victim stops inside the MoE layers' all-to-alls
    "epxdp-stop": (dict(world=4, dp=4, ep=2, micro_batch=1, global_batch=4), 3, signal.SIGSTOP),
    "epxdp-kill": (dict(world=4, dp=4, ep=2, micro_batch=1, global_batch=4), 2, signal.SIGKILL),
}
# Model overrides per case (default: the dense tiny model); experts that drop no token.
MODEL = {name: dict(experts=4, top_k=2, capacity_factor=2.0) for name in CASES if "ep" in name}
FAST = {"tp-stop"}


def _check_case(name: str, tmp_path: Path) -> None:
    spec, victim, sig = CASES[name]
    spec = dict(spec)
    world = spec.pop("world")
    model_kw = MODEL.get(name)
    if model_kw:
        cluster = meshplan.Cluster.preset("cpu", gpus=world)
        plan = meshplan.estimate_plan(moe_graph(model_kw), cluster=cluster,
                                      parallel=meshplan.Parallel(**spec))  # fmt: skip
    else:
        plan = make_plan(world, **spec)
    mark = tmp_path / "stopped_at"
    with pytest.raises(RankFailure) as err:
        run_local(
            _train_until_signalled,
            world,
            plan,
            victim,
            sig,
            str(mark),
            model_kw,
            timeout_s=120,
            collective_timeout_s=TIMEOUT_S,
        )
    stopped_at = float(mark.read_text())
    failure = err.value
    assert failure.rank == victim, str(failure)
    if sig == signal.SIGSTOP:
        assert failure.cause.startswith("stopped arriving"), failure.cause
    # Every other rank left by itself, non-zero, within the bound, and its report names the
    # victim (a killed victim is reported by the launcher as killed by signal 9).
    others = {e.rank: e for e in failure.exits if e.rank != victim}
    assert sorted(others) == [r for r in range(world) if r != victim], failure.exits
    assert set(failure.killed) <= {victim}
    for e in others.values():
        assert e.at - stopped_at <= TIMEOUT_S + SLACK_S, (name, e, e.at - stopped_at)
        if sig == signal.SIGSTOP:
            assert culprits(e.cause) == [victim], e.cause


@pytest.mark.parametrize("name", sorted(FAST))
def test_stopped_rank_is_named_and_the_others_leave(name, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where run_local's dir goes
    _check_case(name, tmp_path)
    assert not list(tmp_path.glob("meshplan-ranks-*"))  # removed, on failure too


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CASES) - FAST))
def test_stopped_or_killed_rank_every_layout(name, tmp_path):
    _check_case(name, tmp_path)


# -- pure pieces --------------------------------------------------------------------------------


def test_report_lines_name_their_culprits(tmp_path):
    assert culprits("rank 3 stopped arriving: no heartbeat for 10 s") == [3]
    assert split_culprits("ranks 1, 3 stopped arriving: x") == ([1, 3], "stopped arriving: x")
    assert culprits("rank 2 failed: ValueError: bad") == [2]
    assert culprits("the launcher's store (h:1) has not answered") == []
    assert period_for(10) == 1.0 and period_for(1) == 0.25 and period_for(300) == 5.0
    # The launcher's summary: a rank's own error, then a named peer, then anything else.
    (tmp_path / "0.err").write_text("rank 0 gave up waiting for its peers (timed out)\n")
    assert failure_summary(tmp_path) == "rank 0 gave up waiting for its peers (timed out)"
    (tmp_path / "2.err").write_text("rank 1 stopped arriving: no heartbeat for 10 s\n")
    assert failure_summary(tmp_path).startswith("rank 1 stopped arriving")
    (tmp_path / "3.err").write_text("rank 3 failed: ValueError: bad\n")
    assert failure_summary(tmp_path) == "rank 3 failed: ValueError: bad"
    assert failure_summary(tmp_path / "none") is None


@pytest.mark.slow
def test_launch_names_the_stopped_rank_in_its_last_line(tmp_path):
    """A real `meshplan launch` (torchrun, 2 processes, TP=2) of a script that stops rank 1
    at step 2: the launcher exits non-zero and its last line names rank 1."""
    from meshplan.runtime.launch import free_port

    path = tmp_path / "plan.json"
    make_plan(2, tp=2, micro_batch=2, global_batch=4).to_json(path)
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal, time, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import meshplan, meshplan.runtime as rt\n"
        "from tests.runtime.harness import batch, build_model, loss_fn, sgd\n"
        f"rt.init_distributed(timeout_s={TIMEOUT_S})\n"
        "plan = meshplan.Plan.from_json(os.environ['MESHPLAN_PLAN'])\n"
        "runner = rt.apply(build_model(), plan, loss_fn, sgd)\n"
        "for step in range(10_000):\n"
        "    if step == 2 and os.environ['RANK'] == '1':\n"
        f"        open({str(tmp_path / 'stopped_at')!r}, 'w').write(str(time.time()))\n"
        "        os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    runner.step(*batch(plan.parallel.global_batch, step))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", "from meshplan.cli import main; main()", "launch", str(path)]
        + ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--", "python", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    ended = time.time()
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "training exited with status" in last and "rank 1 stopped arriving" in last, last
    stopped_at = float((tmp_path / "stopped_at").read_text())
    assert ended - stopped_at <= TIMEOUT_S + SLACK_S + 5, ended - stopped_at  # + torchrun's exit
