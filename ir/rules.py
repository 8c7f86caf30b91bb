"""Validity rules: what makes a parallel configuration one that cannot run or cannot be
priced, each stated once.

Every rule is one function returning the reason in one line, or None. Callers add their own
prefix ("no plan: " in the solver, "runtime: " in the runtime) and decide what to do with it
(reject a candidate, raise a ValueError for `estimate`, refuse a plan file); none rewords a
reason. `tests/ir/test_rules.py` holds one row per rule and checks that every caller that
asks it reports its words.
"""

from __future__ import annotations

from .parallel import Parallel, Schedule


def microbatch_problem(schedule: Schedule | str, pp: int, n_microbatches: int) -> str | None:
    """What keeps torch's pipeline schedule `schedule` from running `n_microbatches`
    micro-batches per pipeline over `pp` pipeline ranks, or None. One rule for every layer:
    the solver's candidates and uneven shares, `estimate`'s `check_config` and the runtime's
    `check_plan` / `build_schedule` all ask it (under uneven shares, for each group's count).

    Exactly what the constructors in torch 2.13's torch/distributed/pipelining/schedules.py
    refuse (checked by building each schedule for pp 1-5, v 1-3, m 1-20):
    - `Schedule1F1B`: raises when `n_microbatches < num_stages`, and a single-stage schedule's
      num_stages is pp;
    - `ScheduleInterleaved1F1B` (any number of chunks per rank): rounds = max(1, m // pp) and
      raises when m % rounds != 0 (so m < pp is one round and runs; m = 5 with pp = 2 does
      not);
    - `ScheduleGPipe`, `ScheduleZBVZeroBubble`: any m >= 1 (ZB-V lays out max(2 pp - 1, m)
      micro-batches and drops the actions of those past m).
    With pp == 1 no schedule runs (the runner accumulates micro-batches itself)."""
    schedule, m = Schedule(schedule), n_microbatches
    if m < 1:
        return f"a pipeline needs at least one micro-batch, got {m}"
    if pp <= 1:
        return None
    if schedule == Schedule.ONE_F_ONE_B and m < pp:
        return (
            f"schedule '1f1b' needs at least pp={pp} micro-batches per pipeline (torch's "
            f"Schedule1F1B), got {m}; use schedule 'gpipe', a larger global_batch or a smaller "
            "micro_batch"
        )
    if schedule == Schedule.INTERLEAVED_1F1B and m % max(1, m // pp):
        rounds = m // pp
        return (
            f"schedule 'interleaved_1f1b' with pp={pp} needs the micro-batches per pipeline in "
            f"whole rounds (torch's ScheduleInterleaved1F1B: m % max(1, m // pp) == 0), got "
            f"{m} ({rounds} rounds)"
        )
    return None


def schedule_problem(parallel: Parallel) -> str | None:
    """What keeps `parallel`'s schedule from describing the pipeline it runs, or None: ZB-V
    needs a pipeline (pp >= 2: its V places two chunks on each of pp ranks); several chunks
    per rank (`virtual_stages` > 1) only under interleaved 1F1B or ZB-V, and only with a
    pipeline to interleave. With pp = 1 no schedule runs (the runner accumulates
    micro-batches), so 1f1b, gpipe and one-chunk interleaved 1F1B (which the planner writes
    when that schedule is pinned) run alike. How many micro-batches a schedule runs is
    `microbatch_problem`."""
    p = parallel
    v = p.virtual_stages or 1
    if p.schedule == Schedule.ZERO_BUBBLE and p.pp < 2:
        return f"schedule zero_bubble needs a pipeline (degrees.pp >= 2), got pp={p.pp}"
    if v > 1 and p.schedule not in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE):
        return f"virtual_stages={v} needs schedule interleaved_1f1b, got {p.schedule}"
    if v > 1 and p.pp < 2:
        return f"virtual_stages={v} needs a pipeline to interleave (degrees.pp >= 2), got pp=1"
    return None
