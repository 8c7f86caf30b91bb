"""Step 2 of the search (`meshplan.solver`): the screen's queue (`solver_screen._screen`), the
typed entries of its heap and their order.

The screen's queue: best-first over candidates, then over their splits. Candidates that
differ only in ZeRO stage and schedule form a family (`_Family`: a `Family` as
`enumerate_families` yields it), queued under its loosest
member's bound and expanded into its members (`_Unsplit`) at the front; a candidate is queued
under a bound that holds for every split and expanded into (candidate, split) pairs (`_Pair`)
with their own bounds at the front; a pair is priced in full at the front (`_price`).

Each entry names what it holds (`_Queued.item`: a `_Family`, an `_Unsplit` candidate or a
`_Pair`), so no slot of a tuple changes meaning with the kind of entry. The bounds they are
queued under, `_ScreenMemo.family_bound` (`solver_bounds._split_free_bound`) and
`_ScreenMemo.pair_bound`, and `_price` are `solver_screen`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .solver_candidates import Candidate, Family


@dataclass(frozen=True, slots=True)
class _Family:
    """A `Family` of candidates (every knob but ZeRO stage and schedule shared) on the heap,
    bounded once by its loosest member (`Family.loosest`)."""

    family: Family
    # Set once the family was bounded again with `_multi_group_bound` (`_ScreenMemo.refined`):
    # `floor` then bounds every member, its splits and its priced pairs.
    refined: bool = False
    floor: float = 0.0

    @property
    def members(self) -> tuple[tuple[int, Candidate], ...]:
        """(enumeration index, candidate) of every member, in enumeration order."""
        return self.family.members


@dataclass(frozen=True, slots=True)
class _Unsplit:
    """A candidate under its split-free bound (`_split_free_bound`), not yet expanded into its
    splits: member `k` of `family`, built when it reaches the front (`cand`)."""

    family: Family
    k: int
    factor: float  # score per second of step time at best (`_Scorer.factor`)
    floor: float = 0.0  # a bound of every split inherited from its family (`_Family.floor`)

    @property
    def cand(self) -> Candidate:
        """The candidate (built anew at each call)."""
        return self.family.member(self.k)


@dataclass(frozen=True, slots=True)
class _Pair:
    """A (candidate, split) pair under its own bound (`_ScreenMemo.pair_bound`, then
    `pair_bound_with_traffic`; a Megatron-style warm start under -1), not yet priced."""

    cand: Candidate
    split: tuple[int, ...]
    factor: float
    floor: float = 0.0  # inherited from its candidate (`_Unsplit.floor`)
    # Set once the pair was bounded again with the traffic every placement carries
    # (`_ScreenMemo.traffic_floor`), when it first reached the top of the heap.
    refined: bool = False


class _Queued(NamedTuple):
    """One entry of the screen's heap, ordered by (bound, index, split): the smallest score
    bound first (warm starts at -1), ties in enumeration order (`index`: the candidate's, a
    family's first member's), then by split (() for a family or an unsplit candidate: a
    candidate before its pairs; a family and its members are never queued together). No two
    entries share all three, so the entry itself (`item`, which has no order) is never
    compared; a named tuple, so the heap compares in C (~1e6 comparisons per plan)."""

    bound: float
    index: int
    split: tuple[int, ...]
    item: _Family | _Unsplit | _Pair
