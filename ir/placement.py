"""The placement vocabulary: how a tensor lies on one mesh axis.

`Shard(dim)`: split along tensor dim `dim`; `Replicate()`: a full copy on every rank;
`Partial("sum")`: every rank holds a summand. Two renderings: a machine `repr` and a compact
`str` (`S(0)`, `R`, `P(sum)`) that `parse_placement` reads back. These are data: the runtime
maps a change of placement to a collective; nothing here communicates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard: dim must be non-negative, got {self.dim}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"Partial: unknown reduce op {self.reduce_op!r}")

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


Placement = Shard | Replicate | Partial

_SHARD = re.compile(r"^S\((\d+)\)$")
_PARTIAL = re.compile(r"^P\((\w+)\)$")


def parse_placement(text: str) -> Placement:
    """Inverse of `str(placement)`: `S(0)`, `R`, `P(sum)`."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if m := _SHARD.match(text):
        return Shard(int(m.group(1)))
    if m := _PARTIAL.match(text):
        return Partial(m.group(1))
    raise ValueError(f"not a placement: {text!r} (expected S(dim), R or P(op))")
