"""ZB-V pricing against an event simulation of torch's own ZB-V action order.

The oracle replays `ScheduleZBVZeroBubble`'s per-rank action lists (what the runtime runs)
with fixed forward (F), input-gradient (I) and weight-gradient (W) times per chunk: each
action starts when its rank is free and its inputs exist (F after the previous chunk's F,
I after the next chunk's I and its own F, W after its own I). The cost model's closed form
(`StageTime.zb_bubble`, `cost_model.simulate` docstring) must stay close to it, and its
in-flight activation count must equal the peak the action order implies."""

import random
import types

import pytest
from meshplan.cost_model.memory import in_flight_microbatches
from meshplan.cost_model.pricer import StageTime
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import _ComputationType as CT


def _orders(pp: int, m: int):
    fake = types.SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
    return {
        r: [a for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r) if a]
        for r in range(pp)
    }


def _simulate(pp: int, m: int, f: float, b: float, w: float) -> float:
    """Makespan of torch's ZB-V action order with per-chunk times f, b, w (no p2p cost)."""
    order, n_stages = _orders(pp, m), 2 * pp
    duration = {CT.FORWARD: f, CT.BACKWARD_INPUT: b, CT.BACKWARD_WEIGHT: w}
    done: dict[tuple, float] = {}
    free, pos = [0.0] * pp, [0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while pos[r] < len(order[r]):
                a = order[r][pos[r]]
                s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
                deps = []
                if kind == CT.FORWARD and s > 0:
                    deps.append((s - 1, CT.FORWARD, mb))
                if kind == CT.BACKWARD_INPUT:
                    deps.append((s, CT.FORWARD, mb))
                    if s < n_stages - 1:
                        deps.append((s + 1, CT.BACKWARD_INPUT, mb))
                if kind == CT.BACKWARD_WEIGHT:
                    deps.append((s, CT.BACKWARD_INPUT, mb))
                if any(d not in done for d in deps):
                    break
                free[r] = max([free[r]] + [done[d] for d in deps]) + duration[kind]
                done[(s, kind, mb)] = free[r]
                pos[r] += 1
                moved = True
    assert pos == [len(order[r]) for r in range(pp)], "the action order deadlocked"
    return max(free)


def _closed_form(pp: int, m: int, f: float, b: float, w: float) -> float:
    # a stage (two chunks) runs forward 2f and backward 2(b + w), of which 2w weight gradient
    st = StageTime(2 * f, 2 * (b + w), 0.0, 0.0, 0.0, 0.0, wgrad=2 * w)
    return m * st.total + (pp - 1) * st.zb_bubble


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_equal_f_b_w_matches_torch_order_exactly(pp, m):
    assert _closed_form(pp, m, 1.0, 1.0, 1.0) == pytest.approx(_simulate(pp, m, 1.0, 1.0, 1.0))


def test_closed_form_tracks_torch_order_over_random_chunk_times():
    rng = random.Random(7)
    worst = 0.0
    for _ in range(60):
        pp = rng.choice([2, 3, 4, 6, 8])
        m = rng.choice([2 * pp - 1, 2 * pp, 3 * pp, 4 * pp + 1])
        f, b, w = 1.0, rng.uniform(0.8, 2.5), rng.uniform(0.1, 1.2)
        sim = _simulate(pp, m, f, b, w)
        worst = max(worst, abs(_closed_form(pp, m, f, b, w) - sim) / sim)
    assert worst < 0.04


def test_zero_bubble_beats_1f1b_bubble_by_the_split_backward():
    # 1F1B's bubble is (pp - 1) stage times; ZB-V's with f = b = w is (pp - 1) f: 1/6 of it
    pp, m = 4, 16
    st = StageTime(2.0, 4.0, 0.0, 0.0, 0.0, 0.0, wgrad=2.0)
    assert (pp - 1) * st.zb_bubble == pytest.approx((pp - 1) * st.total / 6)
    assert _simulate(pp, m, 1, 1, 1) < m * st.total + (pp - 1) * st.total


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 7), (4, 16), (8, 32)])
def test_in_flight_activations_match_the_action_order(pp, m):
    for rank, actions in _orders(pp, m).items():
        live = peak = 0
        for a in actions:
            live += {CT.FORWARD: 1, CT.BACKWARD_WEIGHT: -1}.get(a.computation_type, 0)
            peak = max(peak, live)
        # each chunk is half a stage: peak chunk activations / 2 stage micro-batches
        assert in_flight_microbatches("zero_bubble", rank, pp, m, 2) == peak / 2
