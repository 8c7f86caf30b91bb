"""Starting ranks: torchrun commands from a plan, and a fast local launcher for CPU runs.

`torchrun_commands(plan, program)` gives each node's torchrun command line (processes per
node from the plan's ranks on that node, node count, node rank, rendezvous endpoint), with
`MESHPLAN_PLAN` pointing the program at the plan file. `check_machine` compares the plan with
the machine before anything starts. `launch` is what `meshplan launch` runs; it can hold back
torch's own log (`TorchLog`: torchrun's warnings and its traceback of a failed rank, the
ranks' c10d lines) so that the ranks' output and meshplan's one-line account stay readable.

`run_local(fn, world_size)` runs `fn` on `world_size` CPU ranks of one process tree: torch
is imported once and each rank is a `fork` of the caller (a torchrun start costs ~10 s for 2
ranks and ~29 s for 8 on a 2-core machine, mostly `import torch`; forking costs a fraction).
Every rank gets a process-group timeout and a `faulthandler` watchdog, so a deadlock ends in
a traceback instead of a hung CI job, and a failing rank is reported by number.

This module must not import the planner or the solver: the runtime reads a Plan, nothing else.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshplan.ir.plan import Plan

from .errors import RankExit, RankFailure, RuntimePlanError
from .watchdog import REPORT_DIR_ENV, culprits, is_peer_error, split_culprits

PLAN_ENV = "MESHPLAN_PLAN"
DEFAULT_PORT = 29500


# -- torchrun commands ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeCommand:
    """What one node runs: its torchrun argv and the environment it adds."""

    node_rank: int
    nproc: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return f"{env} {shlex.join(self.argv)}".strip()


def nodes_of(plan: Plan) -> list[tuple[int, int]]:
    """(node, active ranks on it) for every node that runs something, in node order.

    torchrun numbers ranks node by node in node-rank order, which is the order
    `meshplan.runtime.mesh.active_ranks` expects; the plan's ranks must therefore be
    node-major (they are: `assign_ranks` walks the cluster's ranks in order)."""
    counts: dict[int, int] = {}
    for r in plan.ranks:
        if r.coords is not None:
            counts[r.node] = counts.get(r.node, 0) + 1
    return sorted(counts.items())


def torchrun_commands(
    plan: Plan,
    program: Sequence[str],
    *,
    plan_path: str | os.PathLike,
    rdzv_endpoint: str | None = None,
) -> list[NodeCommand]:
    """One torchrun command per node of the plan that runs ranks.

    `program` is the user's command (`python train.py ARGS`); a leading `python` is dropped
    because torchrun runs the script itself (`-m module` is kept as `--module`). Nodes are
    renumbered 0..n-1 over the nodes that hold active ranks (idle nodes start nothing).
    """
    program = list(program)
    if not program:
        raise RuntimePlanError(
            "launch: no program given (meshplan launch plan.json -- python train.py)"
        )
    if Path(program[0]).name.startswith("python"):
        program = program[1:]
    module = False
    if program and program[0] == "-m":
        module, program = True, program[1:]
    if not program:
        raise RuntimePlanError("launch: the program names no script")
    nodes = nodes_of(plan)
    nnodes = len(nodes)
    host, port = parse_endpoint(rdzv_endpoint or f"localhost:{DEFAULT_PORT}")
    if nnodes > 1 and rdzv_endpoint is None:
        raise RuntimePlanError(
            f"launch: the plan spans {nnodes} nodes; give --rdzv-endpoint HOST:PORT of node 0"
        )
    out = []
    for node_rank, (_, nproc) in enumerate(nodes):
        argv = [
            "torchrun",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--master-addr={host}",
            f"--master-port={port}",
        ]
        if module:
            argv.append("--module")
        argv += program
        env = ((PLAN_ENV, str(Path(plan_path).resolve())),)
        out.append(NodeCommand(node_rank, nproc, tuple(argv), env))
    return out


def parse_endpoint(text: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets, `[::1]:29500`) as (host, port), or a one-line
    `RuntimePlanError` saying what is wrong with it."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    why = ""
    if not sep or not host:
        why = "is not HOST:PORT"
    elif not port.isdigit() or not 1 <= int(port) <= 65535:
        why = f"has port {port!r}; a port is a number from 1 to 65535"
    elif any(c.isspace() or c in "/@" for c in host) or (":" in host and "[" not in text):
        why = f"has host {host!r}; give a host name or address (IPv6 in brackets: [::1]:29500)"
    if why:
        raise RuntimePlanError(
            f"launch: --rdzv-endpoint {text!r} {why} (e.g. node0:{DEFAULT_PORT}: node 0's "
            "address and a free port)"
        )
    return host, int(port)


def check_node_rank(plan: Plan, node_rank: int) -> None:
    """Fail with one line when `node_rank` is not one of the plan's nodes."""
    nodes = nodes_of(plan)
    if not 0 <= node_rank < len(nodes):
        raise RuntimePlanError(
            f"launch: --node-rank {node_rank} but the plan runs on {len(nodes)} node(s) "
            f"(node ranks 0..{len(nodes) - 1})"
        )


def check_machine(plan: Plan, node_rank: int, *, device_count: int | None = None) -> None:
    """Fail with one line when this machine cannot run node `node_rank` of the plan.

    CPU plans run anywhere (ranks are processes). A GPU plan needs at least as many visible
    CUDA devices as the node's ranks.
    """
    check_node_rank(plan, node_rank)
    nodes = nodes_of(plan)
    if plan.world_size != sum(n for _, n in nodes):
        raise RuntimePlanError("launch: the plan's ranks do not add up to its world size")
    if all(g.gpu.name.upper() == "CPU" for g in plan.cluster.groups):
        return
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    need = nodes[node_rank][1]
    if device_count < need:
        raise RuntimePlanError(
            f"launch: node {node_rank} of the plan runs {need} ranks but this machine has "
            f"{device_count} CUDA device(s)"
        )


# -- torch's own log --------------------------------------------------------------------------

# A line of torch's logging (Python `torch.*` loggers under torchrun's format, and c10's C++
# glog lines, bracketed and maybe prefixed `[rank0]:`): level letter, MMDD time, pid, source.
_TORCH_LOG_LINE = re.compile(
    r"^(?:\[rank\d+\]:)?\[?(?P<level>[DIWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"
)
# torchrun's own traceback: the last thing it prints when a rank failed (ChildFailedError).
_TORCHRUN_TRACEBACK_FRAME = re.compile(
    r'^  File ".*[/\\](torchrun|torch[/\\]distributed[/\\]run\.py)"'
)
_LEVELS = {"D": "debug", "I": "info", "W": "warning", "E": "error", "F": "fatal"}


@dataclass(slots=True)
class TorchLog:
    """Sorts torchrun's stderr, line by line, into torch's own log (held back) and the
    ranks' output (passed on). Held back: lines in torch's log format (`_TORCH_LOG_LINE`)
    and torchrun's traceback, from its first frame to the end (torchrun prints it last, once
    every rank has exited). Everything else is the ranks' and goes to `passed` as it comes."""

    passed: Callable[[str], None]
    held: list[str] = field(default_factory=list)
    levels: dict[str, int] = field(default_factory=dict)
    traceback: str | None = None  # the exception line of torchrun's traceback
    _pending: str | None = None  # a "Traceback" line whose first frame is not read yet

    def feed(self, line: str) -> None:
        """Take one line (with its newline)."""
        if self.traceback is not None:  # inside torchrun's traceback: to the end
            self.held.append(line)
            if not line.startswith((" ", "Traceback")) and self.traceback == "":
                self.traceback = line.strip()
            return
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if _TORCHRUN_TRACEBACK_FRAME.match(line):
                self.held += [pending, line]
                self.traceback = ""
                return
            self.passed(pending)
        if line.startswith("Traceback (most recent call last):"):
            self._pending = line
            return
        if m := _TORCH_LOG_LINE.match(line):
            self.held.append(line)
            level = _LEVELS[m["level"]]
            self.levels[level] = self.levels.get(level, 0) + 1
            return
        self.passed(line)

    def close(self) -> None:
        """End of the stream: a held "Traceback" line that was not torchrun's goes on."""
        if self._pending is not None:
            self.passed(self._pending)
            self._pending = None

    def summary(self) -> str | None:
        """One line saying what was held back, or None when nothing was."""
        if not self.held:
            return None
        parts = [f"{n} {level} line{'s' * (n != 1)}" for level, n in self.levels.items()]
        if self.traceback is not None:
            what = self.traceback.split(":")[0].rsplit(".", 1)[-1] or "its"
            parts.append(f"torchrun's {what} traceback")
        return f"held back {len(self.held)} lines of torch's own log ({', '.join(parts)})"


def _pump(stream, log: TorchLog) -> None:
    """Feed `stream` (torchrun's stderr) to `log` line by line until it closes."""
    for raw in iter(stream.readline, b""):
        log.feed(raw.decode(errors="replace"))
    log.close()


def launch(
    plan_path: str | os.PathLike,
    program: Sequence[str],
    *,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    dry_run: bool = False,
    echo: Callable[[str], None] = print,
    on_failure: Callable[[str], None] | None = None,
    torch_log: Callable[[TorchLog], None] | None = None,
) -> int:
    """`meshplan launch`: check the machine and run this node's torchrun (exit status back).

    The plan is loaded as `Plan.from_json` loads it (a plan that does not mean what it says
    is refused), checked by the runtime's `check_plan`, and the node rank and rendezvous
    endpoint are checked, all before anything starts and under `dry_run` too. With
    `dry_run`, print every node's command and start nothing.

    While torchrun runs, the ranks' watchdogs (`runtime/watchdog.py`) leave their one-line
    causes in a report directory (`MESHPLAN_REPORT_DIR`); a rank they name as stopped is
    killed here (torchrun's SIGTERM does not end a stopped process; it waits 30 s before
    SIGKILL). On a non-zero exit `on_failure` gets the line that explains the run
    (`failure_summary`).

    With `torch_log`, torchrun's stderr is read through a `TorchLog`: torch's own lines are
    held back and `torch_log` gets them once torchrun has exited, before `on_failure`; the
    ranks' own stderr passes through as it comes. Without it, stderr is left alone.
    """
    import subprocess

    from .apply import check_plan  # imports torch; only here

    plan = Plan.from_json(plan_path)
    check_plan(plan)  # a plan the runtime would refuse fails here, before any process starts
    commands = torchrun_commands(plan, program, plan_path=plan_path, rdzv_endpoint=rdzv_endpoint)
    check_node_rank(plan, node_rank)
    if dry_run:
        for c in commands:
            echo(f"# node {c.node_rank}: {c.nproc} rank(s)")
            echo(c.shell())
        return 0
    check_machine(plan, node_rank)
    cmd = commands[node_rank]
    env = dict(os.environ)
    env.update(dict(cmd.env))
    reports = Path(tempfile.mkdtemp(prefix="meshplan-launch-"))
    env[REPORT_DIR_ENV] = str(reports)
    try:
        stderr = subprocess.PIPE if torch_log is not None else None
        with subprocess.Popen(list(cmd.argv), env=env, stderr=stderr) as proc:
            log = TorchLog(passed=lambda line: (sys.stderr.write(line), sys.stderr.flush()))
            pump = None
            if proc.stderr is not None:
                pump = threading.Thread(target=_pump, args=(proc.stderr, log), daemon=True)
                pump.start()
            try:
                code, first_gone = _supervise(proc, reports)
            except BaseException:  # Ctrl-C reaches torchrun too; do not leave it behind
                proc.kill()
                raise
            if pump is not None:  # a rank's orphan could hold the pipe: do not wait on it
                pump.join(timeout=5.0)
        if torch_log is not None:
            torch_log(log)
        if code and on_failure is not None:
            line = failure_summary(reports)
            if line is None and first_gone is not None:
                line = (
                    f"rank {first_gone} ended first, without a report (killed by a signal: "
                    "SIGKILL, the OOM killer?); torchrun then stopped the others"
                )
            if line is not None:
                on_failure(line)
        return code
    finally:
        shutil.rmtree(reports, ignore_errors=True)


def _supervise(proc, reports: Path, grace_s: float = 2.0) -> tuple[int, int | None]:
    """Wait for torchrun; once a rank reports that a peer on this node stopped arriving,
    give it `grace_s`, then kill that peer (a stopped process ignores torchrun's SIGTERM).
    Returns torchrun's exit status and the local rank whose process ended first while the
    others still ran (None when none did alone)."""
    first: float | None = None
    killed = False
    running: dict[int, int] = {}  # local rank -> pid, from the ranks' pid files
    first_gone: int | None = None
    while (code := proc.poll()) is None:
        time.sleep(0.1)
        if first_gone is None:
            for path in reports.glob("*.pid"):
                rank = int(path.stem)
                if rank not in running:
                    try:
                        running[rank] = int(path.read_text().split()[0])
                    except (OSError, ValueError, IndexError):
                        continue
            gone = [r for r, pid in running.items() if not _process_running(pid)]
            if len(gone) == 1 and len(running) > 1:
                first_gone = gone[0]
            elif gone:
                first_gone = -1  # several at once: no first
        if killed:
            continue
        if first is None and any(reports.glob("*.err")):
            first = time.monotonic()
        if first is not None and time.monotonic() > first + grace_s:
            killed = True
            for rank in {r for line in _report_lines(reports).values() for r in culprits(line)}:
                _kill_local_rank(reports, rank)
    return code, (first_gone if first_gone is not None and first_gone >= 0 else None)


def _process_running(pid: int) -> bool:
    """False once `pid` has exited (a zombie not yet reaped by torchrun counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _report_lines(reports: Path) -> dict[int, str]:
    """Reporting rank -> the first line of its report, in the order they were written."""
    out = []
    for path in reports.glob("*.err"):
        try:
            line = path.read_text().partition("\n")[0]
            out.append((path.stat().st_mtime, int(path.stem), line))
        except (OSError, ValueError):
            continue
    return {rank: line for _, rank, line in sorted(out)}


def _kill_local_rank(reports: Path, rank: int) -> None:
    try:
        pid, host = (reports / f"{rank}.pid").read_text().split()
        if host == socket.gethostname():
            os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def failure_summary(reports: Path) -> str | None:
    """The report line that explains a failed run: a rank's own error first, then a line
    naming a stopped or dead peer, then any other (earliest of each kind); None without
    reports."""
    lines = _report_lines(reports)
    if not lines:
        return None
    reported = set(lines)
    order = sorted(lines.items(), key=lambda kv: _failure_class(*kv, reported))  # time order
    return order[0][1]


# -- local fork launcher ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    threads_per_rank: int = 1,
) -> list[object]:
    """Run `fn(*args)` on `world_size` forked CPU ranks joined in a gloo process group.

    Returns each rank's result (pickled back). Raises `RankFailure` naming the first rank
    that failed (by time) with its exception, or the signal that killed it (named before the
    peers failing on it with a lost connection or a collective timeout); the other ranks are
    killed so nothing hangs. When the only failures are peers timing out while a rank is
    still running (it never reached the collective they wait in), that rank is named ("never
    arrived"). A rank that finished leaves through `mesh.shutdown_distributed` (after a
    barrier, no gloo thread left running) before `os._exit`.
    Each rank sees RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* like under torchrun.
    """
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="meshplan-ranks-"))
    try:
        return _fork_ranks(
            fn, args, world_size, port, workdir, timeout_s, collective_timeout_s, threads_per_rank
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _fork_ranks(
    fn, args, world_size, port, workdir, timeout_s, collective_timeout_s, threads_per_rank
) -> list[object]:
    pids: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # child: never return into the caller's stack (e.g. pytest)
            code = 1
            try:
                code = _rank_main(
                    fn,
                    args,
                    rank,
                    world_size,
                    port,
                    workdir,
                    timeout_s,
                    collective_timeout_s,
                    threads_per_rank,
                )
            finally:
                # os._exit skips Python's exit: flush what the rank printed ourselves
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(code)
        pids[pid] = rank
    failures: list[tuple[float, int, str, str]] = []
    exits: list[RankExit] = []
    deadline = time.monotonic() + timeout_s
    # After a first failure, how long the others get to report theirs (a peer blocked on the
    # failed rank fails within one collective timeout; the watchdog makes every rank leave
    # within one beat of the first) before they are killed.
    grace_s = min(10.0, collective_timeout_s + 2.0)
    alive = dict(pids)
    try:
        while alive:
            pid, status = os.waitpid(-1, os.WNOHANG) if time.monotonic() < deadline else (0, 0)
            if pid == 0:
                if time.monotonic() >= deadline:
                    for p, r in alive.items():
                        failures.append(
                            (time.monotonic(), r, f"timed out after {timeout_s:.0f} s", "")
                        )
                    break
                if failures and time.monotonic() > failures[0][0] + grace_s:
                    break  # the rest are blocked on the failed peer: stop waiting
                if failures and set(alive.values()) <= {
                    r for f in failures for r in culprits(f[2])
                }:
                    break  # only ranks named as stopped are left: they report nothing
                time.sleep(0.02)
                continue
            if pid not in alive:
                continue
            rank = alive.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                cause, detail = _read_error(workdir, rank, code)
                failures.append((time.monotonic(), rank, cause, detail))
                exits.append(RankExit(rank, time.time(), cause))
    finally:
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    if failures:
        killed = tuple(sorted(alive.values()))
        reported = {f[1] for f in failures if (workdir / f"{f[1]}.err").exists()}
        failures.sort(key=lambda f: (_failure_class(f[1], f[2], reported), f[0]))
        _, rank, cause, detail = failures[0]
        named, rest = split_culprits(cause)
        if named and rank not in named:
            # A peer's watchdog (or error path) named the rank that stopped arriving
            raise RankFailure(named[0], rest, detail, tuple(exits), killed)
        stuck = sorted(r for r in alive.values() if not any(f[1] == r for f in failures))
        if stuck and is_peer_error(cause):
            # The failures are peers timing out on a rank that never arrived: name that rank.
            raise RankFailure(
                stuck[0],
                f"never arrived: still running after rank {rank} gave up waiting for its "
                f"peers ({cause})",
                detail,
                tuple(exits),
                killed,
            )
        raise RankFailure(rank, cause, detail, tuple(exits), killed)
    results = []
    for rank in range(world_size):
        with open(workdir / f"{rank}.out", "rb") as f:
            results.append(pickle.load(f))
    return results


def _failure_class(rank: int, cause: str, reported: set[int]) -> int:
    """Which failure explains a run: 0 a rank's own error or a signal that killed it, 1 a
    peer's report naming another rank (the watchdog's "rank R stopped arriving"), 2 a peer
    that only saw a connection close or a timeout. A report naming a rank that left a
    report of its own (`reported`: it ended by itself, it did not stop) counts as 2."""
    named = culprits(cause)
    if named:
        if rank in named:
            return 0
        return 2 if set(named) & reported else 1
    return 2 if is_peer_error(cause) else 0


def _rank_main(
    fn, args, rank, world_size, port, workdir, timeout_s, coll_timeout_s, threads
) -> int:
    import faulthandler

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{REPORT_DIR_ENV: str(workdir)},  # the watchdog leaves `<rank>.err` here
    )
    # A rank stuck past the deadline dumps every thread's stack and exits.
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from .mesh import bound_process_groups, shutdown_distributed

        torch.set_num_threads(threads)  # ranks share the host's cores
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=coll_timeout_s)
        )
        bound_process_groups(coll_timeout_s)  # every group bounded; the heartbeat watchdog
        result = fn(*args)
        # A rank that finished leaves only when every rank has, and with no gloo thread left
        # (`mesh.shutdown_distributed`). One that failed exits at once (below): its peers
        # fail on their next collective, within the collective timeout, and are reported.
        shutdown_distributed()
        with open(workdir / f"{rank}.out", "wb") as f:
            pickle.dump(result, f)
        return 0
    except BaseException as e:  # report, then exit non-zero: the parent names this rank
        from .watchdog import failure_line

        # This rank's own error, or, when it failed because a peer stopped or died, the
        # line naming that peer (the watchdog's diagnosis)
        line = failure_line(e, rank)
        own = f"rank {rank} failed: "
        # Written whole, then renamed: this rank's watchdog may `os._exit` it at any moment
        # (it fires on the same peer), and a report cut after `open` truncated it reads as
        # an empty cause that blames this rank. (Not the watchdog's `<rank>.err.tmp`.)
        tmp = workdir / f"{rank}.err.main.tmp"
        tmp.write_text(
            (line[len(own) :] if line.startswith(own) else line) + "\n" + traceback.format_exc()
        )
        os.replace(tmp, workdir / f"{rank}.err")
        sys.stderr.write(f"[rank {rank}] {traceback.format_exc()}")
        return 1


def _read_error(workdir: Path, rank: int, code: int) -> tuple[str, str]:
    path = workdir / f"{rank}.err"
    if path.exists():
        text = path.read_text()
        first, _, rest = text.partition("\n")
        return first, rest
    if code < 0:
        return f"killed by signal {-code}", ""
    return f"exited with status {code}", ""
