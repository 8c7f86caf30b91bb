"""Errors the runtime raises: each carries a one-line message that names the cause."""

from __future__ import annotations

from dataclasses import dataclass


class RuntimePlanError(ValueError):
    """The plan does not match the model, the process group or the machine (one line)."""


class RankFailure(RuntimeError):
    """A rank of a local multi-process run failed: names the rank and its error."""

    def __init__(
        self,
        rank: int,
        cause: str,
        detail: str = "",
        exits: tuple[RankExit, ...] = (),
        killed: tuple[int, ...] = (),
    ) -> None:
        self.rank, self.cause, self.detail = rank, cause, detail
        self.exits = exits  # every rank that ended non-zero by itself, in time order
        self.killed = killed  # ranks the launcher had to kill (still running or stopped)
        super().__init__(f"rank {rank} failed: {cause}")


@dataclass(frozen=True, slots=True)
class RankExit:
    """A rank that ended non-zero by itself: when (`time.time()`), and its one-line cause."""

    rank: int
    at: float
    cause: str
