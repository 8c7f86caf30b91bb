"""The launcher (`meshplan launch`), the local fork launcher's failure reporting, and the
one-line errors for a plan that does not match the model or the process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from meshplan.runtime import RankFailure, RuntimePlanError, run_local, torchrun_commands
from meshplan.runtime.launch import check_machine

from tests.runtime.harness import build_model, loss_fn, make_plan, sgd

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from meshplan.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_torchrun_commands_per_node(tmp_path):
    import meshplan

    plan = make_plan(2, tp=2, micro_batch=4, global_batch=8)
    cmds = torchrun_commands(
        plan, ["python", "train.py", "--x", "1"], plan_path=tmp_path / "p.json"
    )
    assert len(cmds) == 1
    argv = cmds[0].argv
    assert argv[0] == "torchrun" and "--nproc-per-node=2" in argv and "--nnodes=1" in argv
    assert argv[-3:] == ("train.py", "--x", "1")
    assert dict(cmds[0].env)["MESHPLAN_PLAN"].endswith("p.json")
    # Two nodes of 4 CPU ranks each: one command per node, rendezvous endpoint required.
    cluster = meshplan.Cluster.preset("cpu", gpus=8)
    two = cluster.to_dict()
    two["groups"][0].update(nodes=2, gpus_per_node=4, inter_link="100gbe")
    from meshplan.ir.cluster_io import cluster_from_dict

    from tests.runtime.harness import graph

    c2 = cluster_from_dict(two, source="test")
    plan2 = meshplan.estimate_plan(
        graph(), cluster=c2, parallel=meshplan.Parallel(dp=4, tp=2, micro_batch=1, global_batch=8)
    )
    with pytest.raises(RuntimePlanError, match="rdzv-endpoint"):
        torchrun_commands(plan2, ["python", "t.py"], plan_path="p.json")
    cmds = torchrun_commands(
        plan2, ["python", "t.py"], plan_path="p.json", rdzv_endpoint="h0:29400"
    )
    assert [c.node_rank for c in cmds] == [0, 1]
    assert all("--nnodes=2" in c.argv and "--nproc-per-node=4" in c.argv for c in cmds)
    assert "--master-addr=h0" in cmds[1].argv and "--node-rank=1" in cmds[1].argv
    with pytest.raises(RuntimePlanError, match="node-rank 5"):
        check_machine(plan2, 5)


def test_launch_dry_run_and_errors(tmp_path):
    plan = make_plan(2, tp=2, micro_batch=4, global_batch=8)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    r = _cli("launch", str(path), "--dry-run", "--", "python", "train.py", "--steps", "2")
    assert r.returncode == 0, r.stderr
    assert "torchrun --nnodes=1 --nproc-per-node=2" in r.stdout and "train.py --steps 2" in r.stdout
    assert f"MESHPLAN_PLAN={path}" in r.stdout
    bad = _cli("launch", str(path), "--node-rank", "3", "--", "python", "train.py")
    assert bad.returncode == 2 and "error:" in bad.stderr and "node-rank 3" in bad.stderr
    (tmp_path / "corrupt.json").write_text("{not json")
    bad = _cli("launch", str(tmp_path / "corrupt.json"), "--", "python", "t.py")
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr


def test_launch_runs_example_and_reports_failing_rank(tmp_path):
    """One real 2-process torchrun of the example; then a program that fails on rank 1."""
    path = tmp_path / "plan.json"
    r = subprocess.run(
        [
            sys.executable,
            "examples/train_llama_cpu.py",
            "--make-plan",
            str(path),
            "--gpus",
            "2",
            "--tp",
            "2",
            "--micro-batch",
            "2",
            "--global-batch",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    from meshplan.runtime.launch import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    r = _cli(
        "launch",
        str(path),
        "--rdzv-endpoint",
        endpoint,
        "--",
        "python",
        "examples/train_llama_cpu.py",
        "--steps",
        "3",
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [
        float(line.rsplit(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("step")
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]
    failing = tmp_path / "fail.py"
    failing.write_text(
        "import os, sys\nif os.environ['RANK'] == '1':\n"
        "    raise SystemExit('rank 1: broken input')\n"
    )
    endpoint = f"127.0.0.1:{free_port()}"
    r = _cli(
        "launch", str(path), "--rdzv-endpoint", endpoint, "--", "python", str(failing), timeout=120
    )
    assert r.returncode != 0
    assert "rank" in (r.stdout + r.stderr) and "training exited with status" in r.stderr


# -- inside ranks -------------------------------------------------------------------------------


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # rank 0 waits for a peer that never arrives: must not hang
    return "unreachable"


def _mismatches(plan_world4, plan_bad_units):
    """Plans that do not fit the process group or the model fail with one line."""
    from meshplan.runtime import apply

    out = []
    for plan in (plan_world4, plan_bad_units):
        try:
            apply(build_model(), plan, loss_fn, sgd)
            out.append("no error")
        except RuntimePlanError as e:
            out.append(str(e))
    return out


def _rank_one_never_arrives():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(120)  # never reaches the barrier
    dist.barrier()  # rank 0 times out here (collective timeout)
    return "unreachable"


def test_peer_that_never_arrives_is_named():
    """Rank 0 times out waiting; the error names rank 1 (still running), not the waiter."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed: never arrived") as err:
        run_local(_rank_one_never_arrives, 2, timeout_s=60, collective_timeout_s=3)
    assert "rank 0 gave up" in str(err.value)
    assert time.monotonic() - t0 < 30  # collective timeout + grace, no hang


def test_process_group_that_never_forms_names_the_rank():
    """Under torchrun-style env:// rendezvous, a rank whose peers never arrive fails within
    `init_distributed`'s timeout, saying which rank and why (exit status non-zero)."""
    from meshplan.runtime.launch import free_port

    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    code = "import meshplan.runtime as rt; rt.init_distributed(timeout_s=2)"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
    assert "rank 0: a peer never arrived" in r.stderr and "1/2 clients joined" in r.stderr


def test_gpu_plan_on_a_machine_without_enough_devices():
    import meshplan

    from tests.runtime.harness import graph

    plan = meshplan.estimate_plan(
        graph(),
        cluster=meshplan.Cluster.preset("H100", gpus=8),
        parallel=meshplan.Parallel(dp=8, micro_batch=1, global_batch=8),
    )
    check_machine(plan, 0, device_count=8)
    with pytest.raises(RuntimePlanError, match="runs 8 ranks but this machine has 2 CUDA"):
        check_machine(plan, 0, device_count=2)


def test_rank_failure_is_named_and_nothing_hangs():
    with pytest.raises(RankFailure, match="rank 1 failed: ValueError: bad shard on purpose"):
        run_local(_raise_on_rank_one, 2, timeout_s=60, collective_timeout_s=10)


def test_plan_mismatch_errors():
    import dataclasses

    plan4 = make_plan(4, dp=4, micro_batch=2, global_batch=8)
    plan2 = make_plan(2, dp=2, micro_batch=2, global_batch=8)
    # The same number of units as the plan's stages cover, named for another model.
    n = len(plan2.model.units) - 2
    other = ("<prologue>", *(f"blocks.{i}" for i in range(n)), "<epilogue>")
    model = dataclasses.replace(plan2.model, units=other)
    bad_units = dataclasses.replace(plan2, model=model)
    first, second = run_local(_mismatches, 2, plan4, bad_units)[0]
    assert "plan runs on 4 ranks but the process group has 2" in first
    assert "no module 'blocks.0'" in second


# -- leaving: clean exits, and a rank killed mid-run ---------------------------------------------


def _gloo_threads() -> int:
    """This process's gloo threads (process-group workers and socket loops), by name."""
    tasks = Path("/proc/self/task").iterdir()
    names = [(t / "comm").read_text().strip() for t in tasks]
    return sum(n in ("pt_gloo_runloop", "gloo_tcp_loop") for n in names)


def _zero3_then_leave(plan):
    """Inside a rank: a short ZeRO-3 run, then `shutdown_distributed`; the gloo threads left
    running before and after it."""
    from meshplan.runtime import shutdown_distributed

    from tests.runtime.harness import distributed_run

    losses = distributed_run(plan, steps=2, count_step=None)["losses"]
    before = _gloo_threads()
    shutdown_distributed()
    return losses, before, _gloo_threads()


def test_zero3_runs_exit_cleanly_every_time():
    """Four short 2-rank FSDP (ZeRO-3) runs: every rank exits 0 each time (`run_local` raises
    `RankFailure` on any other exit), and `shutdown_distributed` leaves no gloo thread
    behind. `destroy_process_group` alone leaves the groups FSDP2's DTensors used alive
    (DTensor's sharding caches hold their meshes), with their threads, to be torn down at
    interpreter exit, where a rank could abort after training."""
    plan = make_plan(2, dp=2, zero=3, micro_batch=2, global_batch=8)
    for _ in range(4):
        results = run_local(_zero3_then_leave, 2, plan, timeout_s=60)
        assert results[0][0] == results[1][0]
        for _, before, after in results:
            assert before > 0 and after == 0, (before, after)


_AT_EXIT = """
import atexit, os, sys
from pathlib import Path

def left():  # registered first, so it runs after the runtime's own exit handler
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip()
             for t in os.listdir("/proc/self/task")]
    n = sum(x in ("pt_gloo_runloop", "gloo_tcp_loop") for x in names)
    print(f"gloo threads at exit: {n}", flush=True)

atexit.register(left)
import meshplan, meshplan.runtime as rt
from tests.runtime.harness import batch, build_model, loss_fn, sgd

def main():
    rt.init_distributed(timeout_s=30)
    plan = meshplan.Plan.from_json(os.environ["MESHPLAN_PLAN"])
    runner = rt.apply(build_model(), plan, loss_fn, sgd)
    runner.step(*batch(plan.parallel.global_batch, 0))
    # no destroy_process_group: a script that forgets it still leaves cleanly

main()
"""


def test_script_that_exits_without_shutting_down_leaves_no_gloo_thread(tmp_path):
    """Under torchrun ranks leave through interpreter exit: `init_distributed` registers
    `shutdown_distributed` to run first, so no gloo thread is left for finalization to tear
    down, even when the script never destroys its process group (2 processes, ZeRO-3; the
    model lives in `main`, as in examples/train_llama_cpu.py: what a script still holds in
    module globals at exit keeps its groups until finalization)."""
    from meshplan.runtime.launch import free_port

    path = tmp_path / "plan.json"
    make_plan(2, dp=2, zero=3, micro_batch=2, global_batch=8).to_json(path)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _AT_EXIT],
            env=dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                MESHPLAN_PLAN=str(path),
                OMP_NUM_THREADS="1",
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "gloo threads at exit: 0" in out, out + err
        assert "terminate called" not in err


def _killed_mid_run(plan, report):
    """Inside a rank: rank 1 is killed (SIGKILL) after a first ZeRO-3 step; rank 0 goes on
    into the next step's collectives, writes the first line of its error to `report`, and
    fails with it."""
    import signal

    import torch.distributed as dist
    from meshplan.runtime import apply

    from tests.runtime.harness import batch

    runner = apply(build_model(), plan, loss_fn, sgd)
    runner.step(*batch(8, 0))
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        runner.step(*batch(8, 1))
    except Exception as e:
        Path(report).write_text(f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    return "unreachable"


def test_rank_killed_mid_run_fails_the_others_within_the_collective_timeout(tmp_path):
    """A rank killed mid-run (SIGKILL: no error of its own) is named, and its peer leaves
    with a one-line error of its own within the collective timeout, nothing hangs."""
    import time

    plan = make_plan(2, dp=2, zero=3, micro_batch=2, global_batch=8)
    report = tmp_path / "rank0.txt"
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed: killed by signal 9"):
        run_local(_killed_mid_run, 2, plan, str(report), timeout_s=60, collective_timeout_s=4)
    assert time.monotonic() - t0 < 30  # startup + one step + the collective timeout
    error = report.read_text()
    assert "\n" not in error and any(k in error.lower() for k in ("closed", "timed out", "reset"))
