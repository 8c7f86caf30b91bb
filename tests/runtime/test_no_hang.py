"""No hang, ever: a rank stopped (SIGSTOP) or killed (SIGKILL) mid-training makes every other
rank leave non-zero within the timeout and a few seconds, and the report names that rank
(`runtime/watchdog.py`). Multi-process tier: forked gloo ranks (`run_local`); one real
`meshplan launch` (torchrun) in the slow tier.

Each run trains the tiny model; at step 2 the victim signals itself and writes the wall time
it did so. The timeout is 10 s: the bound checked is that time + 10 s + `SLACK_S`.

Compressed collectives (`CODED`: plans that code their data-parallel traffic, lossless or
int8): at step 2 the victim signals itself *inside* the first coded collective, between two of
its exchanges (`_signal_inside_coding`), so its peers wait in the middle of one coded
collective (lossless: in a pipelined round's async all-to-all)."""

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

from tests.runtime.harness import CFG, SEQ, batch, build_model, graph, loss_fn, make_plan, sgd

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


def _signal_inside_coding(method: str, sig: int, mark: str) -> None:
    """Inside the victim: from now on, the first coded collective of `method` it runs makes it
    write the time and signal itself halfway through. Lossless (`compressed._rounds`): as it
    posts a pipelined round's payload all-to-all (the only async collective there), its size
    exchange done, so its peers wait in that round's `Work.wait()`. Int8
    (`quantize.quantized_all_reduce` / `quantized_reduce_scatter`): as it decodes what the
    reduce-scatter's all-to-all brought (`_from_bytes`), its peers gone on to the next
    exchange."""
    import torch.distributed as dist
    from meshplan.runtime import quantize as Q

    module, name = (Q, "_from_bytes") if method == "int8" else (dist, "all_to_all_single")
    original = getattr(module, name)

    def signalled(*args, **kwargs):
        if method == "int8" or kwargs.get("async_op"):
            Path(mark).write_text(str(time.time()))
            os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    setattr(module, name, signalled)


def _train_until_signalled(
    plan, victim: int, sig: int, mark: str, model_kw: dict | None = None, coded: str = ""
):
    """Inside a rank: train; at step 2 the victim stops or kills itself (`coded`, "lossless"
    or "int8": inside the step's first collective coded so, `_signal_inside_coding`). Every
    rank also checks its process groups' timeouts (never reached by a run that goes as planned).
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
            if coded:
                _signal_inside_coding(coded, sig, mark)
            else:
                Path(mark).write_text(str(time.time()))
                os.kill(os.getpid(), sig)
        if coded and step == 3 and dist.get_rank() == victim:
            raise AssertionError(f"step 2 ran no {coded}-coded collective on the victim")
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
    # compressed collectives (`CODED`); the victim stops or dies inside one
    "ddp-lossless-stop": (dict(world=2, dp=2, micro_batch=2, global_batch=8), 1, signal.SIGSTOP),
    "ddp-lossless-kill": (dict(world=2, dp=2, micro_batch=2, global_batch=8), 1, signal.SIGKILL),
    "ddp-int8-stop": (dict(world=2, dp=2, micro_batch=2, global_batch=8), 1, signal.SIGSTOP),
    "ddp-int8-kill": (dict(world=2, dp=2, micro_batch=2, global_batch=8), 1, signal.SIGKILL),
    "fsdp-zero2-lossless-stop": (
        dict(world=2, dp=2, zero=2, micro_batch=4, global_batch=8),
        1,
        signal.SIGSTOP,
    ),
    "fsdp-zero2-int8-kill": (
        dict(world=2, dp=2, zero=2, micro_batch=4, global_batch=8),
        1,
        signal.SIGKILL,
    ),
    "tpxdp-lossless-stop": (
        dict(world=4, dp=2, tp=2, micro_batch=2, global_batch=8),
        3,
        signal.SIGSTOP,
    ),
    "epxdp-lossless-kill": (
        dict(world=4, dp=4, ep=2, micro_batch=1, global_batch=4),
        2,
        signal.SIGKILL,
    ),
}
# Model overrides per case (default: the dense tiny model); experts that drop no token.
MODEL = {name: dict(experts=4, top_k=2, capacity_factor=2.0) for name in CASES if "ep" in name}
# Coded cases -> the method coding their data-parallel gradients: the plan is the planner's on
# two CPU sites joined by a slow WAN (`test_parity_compression.two_sites`), where coding pays;
# QUANTIZE gives the planner's quantize mode that makes it choose each method.
CODED = {name: m for name in CASES for m in ("lossless", "int8") if f"-{m}-" in name}
QUANTIZE = {"lossless": "off", "int8": "gradients"}
FAST = {"tp-stop"}


def _check_case(name: str, tmp_path: Path) -> None:
    spec, victim, sig = CASES[name]
    spec = dict(spec)
    world = spec.pop("world")
    model_kw = MODEL.get(name)
    if name in CODED:
        from tests.runtime.test_parity_compression import two_sites

        plan = meshplan.plan(
            moe_graph(model_kw) if model_kw else graph(),
            cluster=two_sites(world // 2),
            parallel=meshplan.Parallel(**spec),
            compress="auto",
            quantize=QUANTIZE[CODED[name]],
        )
        methods = {d.method for d in plan.compression.decisions if d.tensor == "gradients"}
        assert methods == {CODED[name]}, (name, methods)  # the planner coded the gradients
    elif model_kw:
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
            CODED.get(name, ""),
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


# -- the coded collectives' own bound ------------------------------------------------------------

# Each collective of `runtime.compressed` and `runtime.quantize` the runtime (or a user) runs,
# on rank 0 of two, while rank 1 never calls it.
CODED_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "int8_all_reduce",
    "int8_reduce_scatter",
    "send",
    "recv",
)
OWN_TIMEOUT_S = 1.5


def _run_coded_op(op: str, group) -> None:
    import torch
    from meshplan.runtime import compressed as cc
    from meshplan.runtime import quantize as Q

    x = torch.randn(6000)
    if op == "all_reduce":  # the DDP hook, `CodedGradients`, the experts' reduction
        cc.all_reduce(x, group, op="avg", chunk_numel=1000)
    elif op == "all_gather":  # `LosslessAllGather`
        cc.all_gather(x, group, chunk_numel=1000, _rounds_hint=6)
    elif op == "reduce_scatter":  # `LosslessReduceScatter`
        cc.reduce_scatter(x, group, op="avg", chunk_numel=1000)
    elif op == "int8_all_reduce":  # the int8 DDP hook
        Q.quantized_all_reduce(x, group)
    elif op == "int8_reduce_scatter":  # `QuantizedReduceScatter`
        Q.quantized_reduce_scatter(x, group)
    elif op == "send":
        cc.send(x, 1, group, chunk_numel=1000)
    else:
        cc.recv(1, group)


def _coded_ops_alone(rank: int, port: int, results, done) -> None:
    """A forked rank of two, without meshplan's watchdog: rank 0 runs every `CODED_OPS` on a
    group of its own (timeout `OWN_TIMEOUT_S`) and reports (op, seconds, error); rank 1 makes
    the groups, then waits without calling anything."""
    from datetime import timedelta

    import torch.distributed as dist

    code = 1
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        timeout = timedelta(seconds=OWN_TIMEOUT_S)
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
        groups = [dist.new_group([0, 1], timeout=timeout) for _ in CODED_OPS]
        if rank == 1:
            done.wait(120)
        else:
            for op, group in zip(CODED_OPS, groups):
                t0 = time.monotonic()
                try:
                    _run_coded_op(op, group)
                    error = ""
                except Exception as e:
                    error = str(e) or type(e).__name__
                results.send((op, time.monotonic() - t0, error))  # a pipe: sent before _exit
        code = 0
    finally:
        os._exit(code)  # no teardown: a group with a timed-out peer may not close cleanly


@pytest.mark.slow
def test_coded_collectives_are_bounded_by_their_group_timeout():
    """The bound under the watchdog: every coded collective raises its group's timeout when a
    peer never arrives (gloo bounds the size exchanges, the pipelined rounds' async
    all-to-alls and their `Work.wait()`, and isend/irecv), with no watchdog running."""
    import multiprocessing

    from meshplan.runtime.launch import free_port

    ctx = multiprocessing.get_context("fork")
    (results, sent), done = ctx.Pipe(duplex=False), ctx.Event()
    port = free_port()
    ranks = [ctx.Process(target=_coded_ops_alone, args=(r, port, sent, done)) for r in (0, 1)]
    for r in ranks:
        r.start()
    got = []
    try:
        while len(got) < len(CODED_OPS) and results.poll(30 + 3 * OWN_TIMEOUT_S):
            got.append(results.recv())
    finally:
        done.set()
        for r in ranks:
            r.join(10)
            if r.is_alive():
                r.kill()
    assert [op for op, _, _ in got] == list(CODED_OPS)
    for op, seconds, error in got:
        assert "timed out" in error.lower(), (op, error)  # it waited for rank 1, and gave up
        assert 0.8 * OWN_TIMEOUT_S <= seconds <= OWN_TIMEOUT_S + 1.5, (op, seconds, error)


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


def test_a_peer_stale_before_the_store_was_lost_is_named_not_the_store_host():
    """The store's host (rank 0) names a stopped rank 3 and leaves; a rank whose collective
    timed out, not having read rank 0's `abort` yet, finds the store gone: it names rank 3,
    whose beat had stopped before, not rank 0. A store lost while every peer beat names its
    host (it was killed or stopped itself)."""
    from meshplan.runtime.watchdog import Watchdog

    w = Watchdog(store=None, rank=1, world=4, timeout_s=10.0, store_host="rank 0")
    now = time.monotonic()
    for r, s in w._seen.items():
        s.value, s.step = f"5 {r}", 1
        s.since = now - 1.0 if r != 3 else now - 9.0  # rank 3's beat stopped 9 s ago
    w._store_ok, w._store_gone = now - 0.5, True  # the last answer, then connections reset
    assert culprits(w.stale_line(3.0)) == [3]
    assert w.stale_line(3.0, gone=False) is None  # the verdict leaves a gone store alone
    w._seen[3].since = now - 1.0  # every peer beat until the store went: its host is named
    line = w.stale_line(3.0)
    assert culprits(line) == [0] and "closed its connections" in line, line
    w._store_gone, w._store_ok = False, now - 5.0  # not answering for 5 s: likewise
    line = w.stale_line(3.0)
    assert culprits(line) == [0] and "not answered" in line, line
    w._store_ok = now  # answering, rank 3 stale for 4 s by now
    w._seen[3].since = now - 4.0
    assert culprits(w.stale_line(3.0)) == [3]


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
