"""What step 2b's two families share (`solver_layouts`' pairs of groups, `solver_chains`'
chains through three): the pins that leave them open, the TP degrees a group's stages may
run at, the schedule, a run's even spread of layers over its stages, each stage's groups and
degrees. Moved here word for word from `solver_layouts` (session 30), so that neither family
imports the other's module back."""

from __future__ import annotations

import functools

from meshplan.ir import DeviceGroup, Graph, Parallel, Schedule
from meshplan.ir.rules import microbatch_problem, tp_heads_problem
from meshplan.passes.partition import tp_domain_problem


@functools.cache
def _even_counts(n: int, k: int) -> tuple[int, ...]:
    base, extra = divmod(n, k)
    counts = [base] * k
    order = sorted(range(k), key=lambda s: (min(s, k - 1 - s) == 0, abs(2 * s - (k - 1)), s))
    for s in order[:extra]:
        counts[s] += 1
    return tuple(counts)


def pins_allow(p: Parallel) -> bool:
    """Step 1's pins leave the family (and `solver_chains`') open: no pinned tp, ZeRO-0, no
    EP or CP, a 1F1B or GPipe schedule without virtual stages."""
    return not (
        p.tp is not None
        or p.zero not in (None, 0)
        or p.ep not in (None, 1)
        or p.cp not in (None, 1)
        or p.schedule not in (None, Schedule.ONE_F_ONE_B, Schedule.GPIPE)
        or p.virtual_stages not in (None, 1)
    )


def _degrees(group: DeviceGroup, graph: Graph) -> list[int]:
    """TP degrees a group's stages may run at: dividing its NVLink domain and the heads."""
    info = graph.info
    return [
        t
        for t in range(1, group.domain_gpus + 1)
        if tp_domain_problem((group,), t) is None
        and tp_heads_problem(t, info.heads, info.kv_heads) is None
    ]


def _schedule(pinned: Schedule | None, pp: int, m: int) -> Schedule | None:
    """1F1B, GPipe where 1F1B cannot run m micro-batches (unless pinned), None: neither."""
    for s in (pinned,) if pinned is not None else (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        if microbatch_problem(s, pp, m) is None:
            return s
    return None


def _groups_of(lay) -> list[tuple[tuple[str, int], ...]]:
    """Each stage's (group, degree) pairs of `lay` (a `solver_layouts.Layout` or a
    `solver_chains.Chain`: `on` without the replica counts, which do not enter a stage's time
    or memory)."""
    return [tuple((g, t) for g, _, t in lay.on(s)) for s in range(lay.parallel.pp)]
