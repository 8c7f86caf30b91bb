"""Errors the runtime raises: each carries a one-line message that names the cause."""

from __future__ import annotations


class RuntimePlanError(ValueError):
    """The plan does not match the model, the process group or the machine (one line)."""


class RankFailure(RuntimeError):
    """A rank of a local multi-process run failed: names the rank and its error."""

    def __init__(self, rank: int, cause: str, detail: str = "") -> None:
        self.rank, self.cause, self.detail = rank, cause, detail
        super().__init__(f"rank {rank} failed: {cause}")
