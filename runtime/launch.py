"""Starting ranks: torchrun commands from a plan, and a fast local launcher for CPU runs.

`torchrun_commands(plan, program)` gives each node's torchrun command line (processes per
node from the plan's ranks on that node, node count, node rank, rendezvous endpoint), with
`MESHPLAN_PLAN` pointing the program at the plan file. `check_machine` compares the plan with
the machine before anything starts. `launch` is what `meshplan launch` runs.

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
import shlex
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshplan.ir.plan import Plan

from .errors import RankFailure, RuntimePlanError

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


def launch(
    plan_path: str | os.PathLike,
    program: Sequence[str],
    *,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    dry_run: bool = False,
    echo: Callable[[str], None] = print,
) -> int:
    """`meshplan launch`: check the machine and run this node's torchrun (exit status back).

    The plan is loaded as `Plan.from_json` loads it (a plan that does not mean what it says
    is refused), checked by the runtime's `check_plan`, and the node rank and rendezvous
    endpoint are checked, all before anything starts and under `dry_run` too. With
    `dry_run`, print every node's command and start nothing.
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
    return subprocess.call(list(cmd.argv), env=env)


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
    deadline = time.monotonic() + timeout_s
    # After a first failure, how long the others get to report theirs (a peer blocked on the
    # failed rank fails within one collective timeout) before they are killed.
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
                time.sleep(0.02)
                continue
            if pid not in alive:
                continue
            rank = alive.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                cause, detail = _read_error(workdir, rank, code)
                failures.append((time.monotonic(), rank, cause, detail))
    finally:
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    if failures:
        failures.sort(key=lambda f: (_is_secondary(f[2]), f[0]))
        _, rank, cause, detail = failures[0]
        stuck = sorted(r for r in alive.values() if not any(f[1] == r for f in failures))
        if stuck and _is_secondary(cause):
            # The failures are peers timing out on a rank that never arrived: name that rank.
            raise RankFailure(
                stuck[0],
                f"never arrived: still running after rank {rank} gave up waiting for its "
                f"peers ({cause})",
                detail,
            )
        raise RankFailure(rank, cause, detail)
    results = []
    for rank in range(world_size):
        with open(workdir / f"{rank}.out", "rb") as f:
            results.append(pickle.load(f))
    return results


def _is_secondary(cause: str) -> bool:
    """Errors a rank reports because a *peer* failed (connection closed, timeouts). A rank
    killed by a signal (OOM killer, SIGKILL) is a cause, named before the peers it fails."""
    text = cause.lower()
    return any(k in text for k in ("connection closed", "connection reset", "timed out", "timeout"))


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
    )
    # A rank stuck past the deadline dumps every thread's stack and exits.
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from .mesh import shutdown_distributed

        torch.set_num_threads(threads)  # ranks share the host's cores
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=coll_timeout_s)
        )
        result = fn(*args)
        # A rank that finished leaves only when every rank has, and with no gloo thread left
        # (`mesh.shutdown_distributed`). One that failed exits at once (below): its peers
        # fail on their next collective, within the collective timeout, and are reported.
        shutdown_distributed()
        with open(workdir / f"{rank}.out", "wb") as f:
            pickle.dump(result, f)
        return 0
    except BaseException as e:  # report, then exit non-zero: the parent names this rank
        with open(workdir / f"{rank}.err", "w") as f:
            f.write(f"{type(e).__name__}: {e}".splitlines()[0] + "\n")
            f.write(traceback.format_exc())
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
