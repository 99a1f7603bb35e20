"""The bench's hand-off and gap prices: waits for another rank's message, and the runtime's own time
between two of a rank's actions, read off a step's action spans."""

from __future__ import annotations

import pytest

from shardwise.bench.pipeline_handoff import gap_price, gaps, hand_offs, transfer_price, with_warmup_prices
from shardwise.observe.monitor import Span
from shardwise.pipeline.actions import fuse_schedule
from shardwise.pipeline.schedules import SCHEDULES, build, stage_placement
from shardwise.pipeline.simulate import Costs, simulate


def _step(times: dict[int, list[tuple[str, float, float]]]) -> dict[int, list[Span]]:
    return {r: [Span(n, "compute", "actions", a, b - a) for n, a, b in acts] for r, acts in times.items()}


# two stages on two ranks, two micro-batches; rank 1 is busy with 1B0 when 0F1's activation lands
STEP = _step(
    {
        0: [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 4.5, 6.5), ("0B1", 7.6, 9.6)],
        1: [("1F0", 1.2, 2.2), ("1B0", 2.2, 4.2), ("1F1", 4.3, 5.3), ("1B1", 5.3, 7.3)],
    }
)


def test_only_the_waits_of_an_idle_rank_are_hand_offs() -> None:
    waits = sorted((round(hop, 6), posts) for hop, posts in hand_offs(STEP, [0, 1]))
    # 1F0 after 0F0 (0.2), 0B0 after 1B0 (0.3), 0B1 after 1B1 (0.3); 1F1 started late because rank 1
    # was computing 1B0, not because 0F1's activation was late: not a hand-off
    assert waits == [(0.2, 1), (0.3, 1), (0.3, 1)]


def test_the_price_is_the_mean_wait_less_the_producers_posts() -> None:
    assert transfer_price([STEP], [0, 1], send=0.0) == pytest.approx(0.8 / 3)
    assert transfer_price([STEP, STEP], [0, 1], send=0.1) == pytest.approx(0.8 / 3 - 0.1)
    assert transfer_price([STEP], [0, 1], send=1.0) == 0.0  # never below nothing


def test_no_wait_no_price() -> None:
    one_rank = _step({0: [("0F0", 0.0, 1.0), ("1F0", 1.0, 2.0), ("1B0", 2.0, 4.0), ("0B0", 4.0, 6.0)]})
    assert hand_offs(one_rank, [0, 0]) == []
    assert transfer_price([one_rank], [0, 0], send=0.1) is None
    assert transfer_price([], [0, 1], send=0.1) is None


def test_a_gap_is_time_between_actions_that_waited_for_no_message() -> None:
    # rank 0: 0F1 after 0F0 needs nothing remote (a gap of 0); 0B0 and 0B1 waited for rank 1's B.
    # rank 1: 1B0 follows its own 1F0 (0.0); 1F1 after 1B0: 0F1 ended (2.0) before 1B0 began (2.2),
    # so 0.1; 1B1 follows 1F1 (0.0); 1F0 is its rank's first action: nothing before it. Posts come off:
    # 0F0 sent an activation, 1B0 a gradient
    assert sorted(round(g, 6) for g in gaps(STEP, [0, 1], send=0.0, transfer=0.0)) == [0.0, 0.0, 0.0, 0.1]
    assert sorted(round(g, 6) for g in gaps(STEP, [0, 1], send=0.05, transfer=0.0)) == [-0.05, 0.0, 0.0, 0.05]
    # with a transfer of 2.3, 0F1's activation (2.0 + 2.3) was not in by 1B0's end (4.2): 1F1 waited
    assert sorted(round(g, 6) for g in gaps(STEP, [0, 1], send=0.0, transfer=2.3)) == [0.0, 0.0, 0.0]


def test_the_gap_price_is_the_mean_gap_never_below_nothing() -> None:
    one_rank = _step({0: [("0F0", 0.0, 1.0), ("1F0", 1.1, 2.1), ("1B0", 2.3, 4.3), ("0B0", 4.9, 6.9)]})
    # gaps of 0.1, 0.2 and 0.6: the mean, 0.3, counts the long one (the median would be 0.2)
    assert gap_price([one_rank], [0, 0], send=0.0, transfer=0.0) == pytest.approx(0.3)
    assert gap_price([one_rank], [0, 0], send=1.0, transfer=0.0) == pytest.approx(0.3)  # no posts
    # STEP's gaps less posts of 1.0: -1.0, 0.0, -0.9, 0.0, a mean of -0.475
    assert gap_price([STEP], [0, 1], send=1.0, transfer=0.0) == 0.0
    assert gap_price([], [0, 1], send=0.0, transfer=0.0) is None


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8)])
def test_a_simulated_steps_prices_are_the_transfer_and_gap_it_was_simulated_with(
    pp: int, microbatches: int
) -> None:
    """Every schedule, as the runtime runs it (V turns, split I and W): read back off the simulator's
    own timeline, the prices are the transfer and the gap the simulator charged, its posts taken off
    as it charges them."""
    for name in SCHEDULES:
        virtual = 1 if SCHEDULES[name].virtual == "1" else 2
        placement = stage_placement(name, pp, virtual)
        stages = len(placement)
        costs = Costs(
            forward=tuple(1.0 + 0.1 * s for s in range(stages)),
            backward=tuple(2.0 + 0.3 * s for s in range(stages)),
            input_grad=tuple(1.2 + 0.1 * s for s in range(stages)),
            weight_grad=tuple(0.8 + 0.2 * s for s in range(stages)),
            transfer=0.37,
            send=0.13,
            gap=0.05,
        )
        timeline = simulate(fuse_schedule(build(name, pp, virtual, microbatches)), placement, costs)
        step = {r: [s for s in timeline.spans(r, 1.0) if s.lane == "actions"] for r in timeline.slots}
        assert transfer_price([step], placement, send=0.13) == pytest.approx(0.37), name
        assert gap_price([step], placement, send=0.13, transfer=0.37) == pytest.approx(0.05), name
        priced = with_warmup_prices(Costs(send=0.13), [step], placement)
        assert (priced.transfer, priced.gap) == (pytest.approx(0.37), pytest.approx(0.05)), name


def test_a_step_a_rank_recorded_nothing_of_is_left_out() -> None:
    partial = {0: STEP[0], 1: []}
    missing_producer = {0: STEP[0], 1: STEP[1][1:]}  # 1F0 lost: 1B0 has no forward
    assert transfer_price([partial, missing_producer], [0, 1], send=0.0) is None
    assert transfer_price([partial, STEP], [0, 1], send=0.0) == pytest.approx(0.8 / 3)
    missing_middle = {0: STEP[0], 1: [STEP[1][0], STEP[1][1], STEP[1][3]]}  # 1F1 lost: 1B1 has none
    assert gap_price([partial, missing_producer, missing_middle], [0, 1], send=0.0, transfer=0.0) is None
    assert transfer_price([missing_middle], [0, 1], send=0.0) is None
    # STEP's gaps alone (0.0, 0.0, 0.0, 0.1): missing_middle's are left out
    assert gap_price([missing_middle, STEP], [0, 1], send=0.0, transfer=0.0) == pytest.approx(0.1 / 4)
