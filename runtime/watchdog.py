"""No hang, ever: every wait bounded by the timeout, and the rank that stopped arriving named.

A rank that is stopped (SIGSTOP, a debugger, a swapped-out host) or dead (SIGKILL, the OOM
killer) leaves its peers waiting inside a collective or a receive. Three cheap layers make
every other rank leave within the timeout and say which rank it was:

1. Every process group carries the timeout (`bound_new_groups`). torch gives a group made by
   `new_group` without an explicit timeout c10d's default (30 min on gloo, 10 min on NCCL),
   not the default group's; DeviceMesh makes every sub-mesh group that way (tp, pp, cp, dp
   when it is not the whole world), and DDP, FSDP2, DTensor's redistributions and
   pipelining's batched isend/irecv then run on them. gloo bounds each operation, a
   `Work.wait()` without a timeout included, by its group's timeout.
2. A heartbeat per rank (`Watchdog`, two daemon threads): every `period_s` one writes
   `beat/<rank>` = "<seq> <step> <pid> <host>" into the rendezvous store over its own client
   connection and reads every rank's beat in one `multi_get`; the other judges what was read
   (a store call can block for good, so the judge never makes one). A stopped or killed process
   stops beating (the thread stops with it); a rank blocked in a collective keeps beating
   (gloo's waits and the store's calls release the GIL). A beat unchanged for the timeout
   (by the reader's own clock: no clock is shared) makes the reader print
   `meshplan: rank R stopped arriving: ...`, record it (the store's `abort` key, the
   launcher's report directory) and leave with `os._exit(1)`; every other rank reads the
   abort within one period and leaves with the same line. When the store itself stops
   answering for the timeout, its host is named (rank 0 when ranks rendezvous through
   env:// without torchrun's agent store, as `run_local` does; torchrun's agent otherwise).
3. The error path (`excepthook`, `diagnose`): a collective can raise before the watchdog
   fires (a killed peer closes its connections at once; a wait that began before the peer
   stopped times out first). The line printed last then names the rank whose beat stopped
   (waiting at most a few periods to see it), or a peer's own failure from the `abort` key,
   instead of blaming the rank that merely waited.

Cost: `progress(step)` on the hot path stores an int; per period each rank does one store
`set` and one `multi_get` of world-size keys. The period is a tenth of the timeout,
between 0.25 s and 5 s.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPORT_DIR_ENV = "MESHPLAN_REPORT_DIR"  # where ranks leave `<rank>.pid` and `<rank>.err`
PREFIX = "meshplan/watchdog"
# The first line of a report that names a culprit: "rank 3 stopped arriving: ..." /
# "ranks 1, 3 stopped arriving: ..." / "rank 2 failed: ValueError: ...".
_CULPRIT = re.compile(r"^ranks? (\d+(?:, \d+)*) (stopped arriving|failed)\b")
# A store client's errors (by text) when the store's host closed its connections.
_CLOSED = ("reset", "broken pipe", "refused", "closed")
# Exceptions (by text) a rank raises because a peer failed or never came.
_PEER_ERRORS = (
    "connection closed",
    "connection reset",
    "read error",
    "broken pipe",
    "timed out",
    "timeout",
)

_active: Watchdog | None = None


def culprits(line: str) -> list[int]:
    """The ranks a report line names as the cause (`[]` when it names none)."""
    return split_culprits(line)[0]


def split_culprits(line: str) -> tuple[list[int], str]:
    """(the ranks a report line names, the rest of the line after them): `"rank 3 stopped
    arriving: ..."` -> `([3], "stopped arriving: ...")`; `([], line)` when it names none."""
    m = _CULPRIT.match(line)
    if not m:
        return [], line
    return [int(r) for r in m.group(1).split(", ")], line[m.end(1) + 1 :]


def is_peer_error(text: str) -> bool:
    """True for errors a rank raises because a *peer* failed: a closed or reset connection,
    a timed-out collective or store call."""
    low = text.lower()
    return any(k in low for k in _PEER_ERRORS)


def bound_new_groups(timeout: timedelta) -> None:
    """Make `timeout` the default of every process group created from now on.

    torch reads c10d's module defaults for a `new_group` given no timeout (DeviceMesh passes
    none); there is no public setter, so the defaults are replaced here, once, after the
    default group was made with the same timeout."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
        c10d.default_pg_nccl_timeout = timeout


def period_for(timeout_s: float) -> float:
    """Seconds between beats: a tenth of the timeout, within [0.25, 5]."""
    return min(5.0, max(0.25, timeout_s / 10.0))


@dataclass(slots=True)
class _Seen:
    """What this rank last read of one peer's beat, and when (this rank's clock)."""

    value: str = ""
    since: float = 0.0
    step: int = -1
    done: bool = False


class Watchdog:
    """The heartbeat of one rank (see the module docstring). `start_watchdog` makes and
    starts the process's one instance; `progress(step)` feeds it the training step.

    Two daemon threads, because a store call can block for good (a stopped store host
    answers nothing, and a client's timeout does not bound every call): the *beat* thread
    does all the store traffic and records what it read; the *judge* thread only reads those
    records and decides, so a blocked store call cannot keep a rank from leaving. Writes made
    on the way out (`publish`, `stop`) are given a bounded time (`_bounded`)."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, store_host: str) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s = timeout_s
        self.period_s = period_for(timeout_s)
        self.store_host = store_host  # "rank 0" or "" (a launcher's store)
        self.step = -1
        self.report_dir = os.environ.get(REPORT_DIR_ENV) or None
        self._seq = 0
        self._seen = {r: _Seen() for r in range(world) if r != rank}
        self._store_ok = time.monotonic()
        self._store_gone = False  # its host closed the connection (exited or was killed)
        self._abort = ""  # the run's cause as last read from the store
        self._published = ""  # the cause this rank published itself (not a reason to leave)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._keys = [f"beat/{r}" for r in range(world)]
        self._present: set[str] = set()
        self._threads = (
            threading.Thread(target=self._beat_loop, name="meshplan-beat", daemon=True),
            threading.Thread(target=self._judge_loop, name="meshplan-watchdog", daemon=True),
        )

    # -- the threads ---------------------------------------------------------------------

    def start(self) -> None:
        now = time.monotonic()
        for s in self._seen.values():
            s.since = now
        self._store_ok = now
        self._beat()
        if self.report_dir:
            _write(Path(self.report_dir) / f"{self.rank}.pid", f"{os.getpid()} {_host()}\n")
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Leave quietly: say so in the store (peers stop expecting beats), end the threads."""
        if self._stop.is_set():
            return
        self._stop.set()
        _bounded(lambda: self.store.set(f"beat/{self.rank}", "done"), self.period_s + 1.0)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._beat()
                self._read()
            except Exception as e:
                # A store whose host is gone refuses or resets at once; one that is stopped
                # answers nothing (its calls block or time out: judged by _judge_loop).
                if any(k in str(e).lower() for k in _CLOSED):
                    with self._lock:
                        self._store_gone = True

    def _judge_loop(self) -> None:
        import torch.distributed as dist

        while not self._stop.wait(self.period_s):
            if not dist.is_initialized():  # the script destroyed its groups: it is leaving
                self.stop()
                return
            line = self._verdict()
            if line is not None and not self._stop.is_set():
                self.fire(line)

    def _beat(self) -> None:
        self._seq += 1
        self.store.set(f"beat/{self.rank}", f"{self._seq} {self.step} {os.getpid()} {_host()}")

    def _read(self) -> None:
        """Read every beat and the abort key; record when each peer's beat last changed."""
        if len(self._present) < len(self._keys):  # multi_get would wait for a missing key
            missing = [k for k in self._keys if k not in self._present]
            self._present |= {k for k in missing if self.store.check([k])}
        keys = [k for k in self._keys if k in self._present]
        values = self.store.multi_get(keys) if keys else []
        abort = self.store.get("abort").decode() if self.store.check(["abort"]) else ""
        now = time.monotonic()
        with self._lock:
            self._store_ok, self._store_gone = now, False
            self._abort = abort
            for key, raw in zip(keys, values):
                seen = self._seen.get(int(key.rsplit("/", 1)[1]))
                value = raw.decode() if isinstance(raw, bytes) else str(raw)
                if seen is None or value == seen.value:
                    continue
                seen.value, seen.since, seen.done = value, now, value == "done"
                parts = value.split()
                if len(parts) >= 2 and parts[1].lstrip("-").isdigit():
                    seen.step = int(parts[1])

    def _verdict(self) -> str | None:
        """The line to leave with, or None while every peer beats and nobody aborted."""
        with self._lock:
            abort = self._abort
        if abort and abort != self._published:
            return abort
        return self.stale_line(self.timeout_s, gone=False)

    def stale_line(self, min_age_s: float, gone: bool = True) -> str | None:
        """A line naming the peers whose beat has not changed for `min_age_s` (or the store's
        host when the store has not answered that long), else None.

        A store whose host is gone (connections reset: it exited or was killed) names its
        host only with `gone` (the error path): the heartbeat verdict leaves that case to
        the collectives, which fail at once on a closed connection, so that a store host
        leaving after its own error (or normally) does not make its peers blame it.

        Once the store is lost (gone, or not answering for `min_age_s`) no beat can be read,
        so beats are judged as of its last answer, and a peer already stale then is named
        before the store's host: the host may have left only because it named that peer
        (its watchdog fired) before this rank read its `abort`."""
        now = time.monotonic()
        with self._lock:
            if self._store_gone and not gone:
                return None
            store_lost = self._store_gone or now - self._store_ok >= min_age_s
            as_of = self._store_ok if store_lost else now
            stale = sorted(
                (r, now - s.since, s.step)
                for r, s in self._seen.items()
                if not s.done and as_of - s.since >= min_age_s
            )
            if not stale and self._store_gone:
                where = _store_address()
                if self.store_host:
                    return (
                        f"{self.store_host} stopped arriving: the store it hosts ({where}) "
                        f"closed its connections (the process is gone); seen by rank "
                        f"{self.rank}"
                    )
                return (
                    f"the launcher's store ({where}) closed its connections: node 0's "
                    f"launcher is gone; seen by rank {self.rank}"
                )
            if not stale and store_lost:
                age = now - self._store_ok
                where = _store_address()
                if self.store_host:
                    return (
                        f"{self.store_host} stopped arriving: the store it hosts ({where}) has "
                        f"not answered for {age:.0f} s (timeout {self.timeout_s:.0f} s); seen "
                        f"by rank {self.rank}"
                    )
                return (
                    f"the launcher's store ({where}) has not answered for {age:.0f} s "
                    f"(timeout {self.timeout_s:.0f} s): node 0's launcher stopped or died; "
                    f"seen by rank {self.rank}"
                )
        if not stale:
            return None
        ranks = ", ".join(str(r) for r, _, _ in stale)
        age = max(a for _, a, _ in stale)
        steps = {st for _, _, st in stale if st >= 0}
        where = f"; last beat in step {min(steps)}" if steps else ""
        return (
            f"{'rank' if len(stale) == 1 else 'ranks'} {ranks} stopped arriving: no heartbeat "
            f"for {age:.0f} s (timeout {self.timeout_s:.0f} s{where}); seen by rank {self.rank}"
        )

    # -- leaving -------------------------------------------------------------------------

    def publish(self, line: str) -> None:
        """Record `line` as the run's cause (the first one published stays) and report it."""
        self._published = line
        _bounded(lambda: self.store.compare_set("abort", "", line), self.period_s + 1.0)
        self.report(line)

    def report(self, line: str, detail: str = "") -> None:
        """Write this rank's one-line cause where the launcher reads it (first write stays)."""
        if self.report_dir:
            path = Path(self.report_dir) / f"{self.rank}.err"
            if not path.exists():
                _write(path, line + "\n" + detail)

    def fire(self, line: str) -> None:
        """Print `line` last, record it, and leave now (the main thread may be blocked)."""
        self.publish(line)
        _say(line)
        os._exit(1)

    def diagnose(self, wait_s: float | None = None) -> str | None:
        """On the error path: a peer's published cause, or the peers whose beat stopped,
        waiting up to `wait_s` (default five periods) for a stopped beat to show. Reads only
        what the beat thread recorded: never blocks on the store."""
        stale_after = min(3 * self.period_s, self.timeout_s)
        # a beat is read up to a period after it was written, and stale one threshold later
        wait_s = stale_after + 2 * self.period_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                abort = self._abort
            line = abort or self.stale_line(stale_after)
            if line or time.monotonic() >= deadline:
                return line or None
            time.sleep(min(0.1, self.period_s / 4))


def _bounded(call, seconds: float) -> None:
    """Run `call` for at most `seconds` (in a daemon thread left behind if it blocks)."""

    def run():
        try:
            call()
        except Exception:
            pass

    t = threading.Thread(target=run, name="meshplan-store-write", daemon=True)
    t.start()
    t.join(seconds)


def start_watchdog(timeout_s: float) -> Watchdog | None:
    """Start this process's watchdog over the initialised default group (once; None when
    torch.distributed is not initialised or has a single rank)."""
    global _active
    import torch.distributed as dist

    if _active is not None or not dist.is_initialized() or dist.get_world_size() < 2:
        return _active
    store, host = _open_store(timeout_s)
    _active = Watchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s, host)
    _active.start()
    _install_excepthook()
    atexit.register(stop_watchdog)  # a normal exit: peers stop expecting this rank's beat
    return _active


def active() -> Watchdog | None:
    """This process's running watchdog, if any."""
    return _active


def progress(step: int) -> None:
    """Record the training step this rank is in (no I/O: the next beat carries it)."""
    if _active is not None:
        _active.step = step


def stop_watchdog() -> None:
    """Stop this process's watchdog (a rank leaving normally). Safe to call more than once."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def failure_line(exc: BaseException, rank: int) -> str:
    """The one line a rank leaves with after `exc` ended its work: a peer's cause when the
    error is a peer's fault and the watchdog can name it, else this rank's own failure."""
    # torch may wrap the error (pipelining's "Failed to run stage backward" wraps the
    # collective's): a peer's fault anywhere in the chain makes it one
    chain, e = [], exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    peer = next((e for e in chain if is_peer_error(str(e))), None)
    first = _first_line(peer or exc)
    w = _active
    if w is None:
        return f"rank {rank} failed: {first}"
    if peer is not None:
        cause = w.diagnose()
        if cause is not None:
            return cause
        return f"rank {rank} gave up waiting for its peers ({first}); no peer found stopped"
    line = f"rank {rank} failed: {first}"
    w.publish(line)  # peers leave within one period instead of waiting for timeouts
    return line


def _first_line(exc: BaseException) -> str:
    """`Type: first non-empty line of the message`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        w = _active
        if w is None or isinstance(value, KeyboardInterrupt):
            return
        line = failure_line(value, w.rank)
        w.report(line, "".join(traceback.format_exception(kind, value, tb)))
        _say(line)
        if culprits(line) != [w.rank]:
            # A peer is gone or stopped: tearing the groups down could wait on it.
            os._exit(1)

    sys.excepthook = hook


def _say(line: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        os.write(2, f"meshplan: {line}\n".encode())
    except OSError:
        pass


def _open_store(timeout_s: float):
    """A store client of the watchdog's own (so a slow call never holds the process group's
    client) with a short timeout, and who hosts the store ("rank 0" or "": torchrun's agent).
    Falls back to the default group's store when the rendezvous is not env://-style."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    # keys of one run and one torchrun restart: a restarted group never reads old beats
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    run = f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    client_timeout = timedelta(seconds=max(1.0, 2 * period_for(timeout_s)))
    store = None
    if addr and port and port.isdigit():
        try:
            store = dist.TCPStore(
                addr, int(port), is_master=False, timeout=client_timeout, wait_for_workers=False
            )
        except Exception:
            store = None
    if store is None:
        store = c10d._get_default_store()
        agent = True  # unknown host: do not name a rank for it
    return dist.PrefixStore(f"{PREFIX}/{run}", store), ("" if agent else "rank 0")


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _host() -> str:
    return socket.gethostname()


def _write(path: Path, text: str) -> None:
    try:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass
