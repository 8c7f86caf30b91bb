"""`ir.microbatch_problem`: which micro-batch counts each pipeline schedule runs.

The table states the rule once; the second test builds torch's own schedules (stub stages, no
process group) for every small (pp, chunks, m) and checks that the rule refuses exactly what
their constructors refuse, so a torch upgrade that changes the rule fails here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from meshplan.ir import Schedule, microbatch_problem


@pytest.mark.parametrize(
    "schedule,pp,m,refused",
    [
        ("1f1b", 1, 1, False),  # no pipeline: the runner accumulates micro-batches itself
        ("1f1b", 2, 1, True),  # torch's Schedule1F1B: m < pp
        ("1f1b", 2, 2, False),
        ("1f1b", 4, 3, True),
        ("1f1b", 4, 9, False),
        ("gpipe", 4, 1, False),  # GPipe runs any count
        ("zero_bubble", 4, 1, False),  # ZB-V pads its warm-up and drops the extra actions
        ("interleaved_1f1b", 4, 3, False),  # fewer than pp: one round
        ("interleaved_1f1b", 2, 4, False),
        ("interleaved_1f1b", 2, 5, True),  # 2 rounds, 5 % 2 != 0
        ("interleaved_1f1b", 4, 10, False),  # 2 rounds of 5
        ("interleaved_1f1b", 4, 9, True),
        ("1f1b", 2, 0, True),
    ],
)
def test_microbatch_rule_table(schedule, pp, m, refused):
    why = microbatch_problem(schedule, pp, m)
    assert (why is not None) == refused, why
    if why:
        assert "\n" not in why


def _stub_stages(pp: int, chunks: int, rank: int, v_shape: bool):
    total = pp * chunks
    indices = [rank, 2 * pp - 1 - rank] if v_shape else [rank + k * pp for k in range(chunks)]
    return [
        SimpleNamespace(
            group_size=pp,
            group_rank=rank,
            num_stages=total,
            stage_index=i,
            is_first=i == 0,
            is_last=i == total - 1,
            stage_index_to_group_rank=None,
            submod=torch.nn.Linear(1, 1),
        )
        for i in indices
    ]


def _torch_refuses(schedule: Schedule, pp: int, chunks: int, m: int) -> bool:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    for rank in range(pp):  # every rank builds the whole schedule's order
        stages = _stub_stages(pp, chunks, rank, schedule == Schedule.ZERO_BUBBLE)
        try:
            if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
                cls = ScheduleGPipe if schedule == Schedule.GPIPE else Schedule1F1B
                cls(stages[0], n_microbatches=m, loss_fn=lambda out, y: out)
            else:
                cls = (
                    ScheduleZBVZeroBubble
                    if schedule == Schedule.ZERO_BUBBLE
                    else ScheduleInterleaved1F1B
                )
                cls(stages, n_microbatches=m, loss_fn=lambda out, y: out)
        except ValueError:
            return True
    return False


def test_microbatch_rule_is_what_torch_schedules_refuse():
    layouts = [
        (Schedule.GPIPE, 1),
        (Schedule.ONE_F_ONE_B, 1),
        (Schedule.INTERLEAVED_1F1B, 1),
        (Schedule.INTERLEAVED_1F1B, 2),
        (Schedule.ZERO_BUBBLE, 2),
    ]
    for schedule, chunks in layouts:
        for pp in range(2, 5):
            for m in range(1, 14):
                rule = microbatch_problem(schedule, pp, m) is not None
                assert rule == _torch_refuses(schedule, pp, chunks, m), (schedule, pp, chunks, m)
