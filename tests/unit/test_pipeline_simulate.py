"""The simulator held to the published bubble formulas, transfers, and a timeline the observe/ plot draws.

Cost convention: every stage costs the same; ``Costs.uniform(forward, backward)`` with B = I + W and
I = W = B/2 unless given. For interleaved schedules the costs are per chunk (a chunk is 1/v of a rank's
layers), so a rank's compute per micro-batch is v times a chunk's. Bubble = idle / total over ranks.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from shardwise.pipeline.actions import parse_actions
from shardwise.pipeline.schedules import build, stage_placement
from shardwise.pipeline.simulate import Costs, Timeline, format_timeline, simulate
from shardwise.pipeline.validate import ScheduleError

EQUAL = Costs.uniform(forward=1.0, backward=1.0)  # F = B
DOUBLE = Costs.uniform(forward=1.0, backward=2.0)  # F = I = W, B = 2F: the usual ratio


def run(name: str, pp: int, virtual: int, m: int, costs: Costs) -> Timeline:
    return simulate(build(name, pp, virtual, m), stage_placement(name, pp, virtual), costs)


@pytest.mark.parametrize("costs", [EQUAL, DOUBLE], ids=["F=B", "B=2F"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name: str, pp: int, costs: Costs) -> None:
    """Huang et al. 2019 (GPipe, arXiv:1811.06965): (p-1)/(m+p-1), for every m, fewer than p included."""
    for m in range(1, 17):
        assert run(name, pp, 1, m, costs).bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("costs", [EQUAL, DOUBLE], ids=["F=B", "B=2F"])
@pytest.mark.parametrize("virtual", [2, 3, 4])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_interleaved_bubble_is_divided_by_v(pp: int, virtual: int, costs: Costs) -> None:
    """Narayanan et al. 2021 (arXiv:2104.04473), section 2.2.2: bubble time / ideal time = (p-1)/(v m), i.e.
    idle / total = (p-1)/(v m + p-1), when p divides m."""
    for m in (pp, 2 * pp, 3 * pp):
        expected = (pp - 1) / (virtual * m + pp - 1)
        assert run("interleaved", pp, virtual, m, costs).bubble == pytest.approx(expected, abs=1e-12)


def test_interleaved_beats_1f1b_from_two_microbatches() -> None:
    """Chunks cost 1/v of a stage (the same work per rank). One micro-batch crosses every layer in turn
    under any schedule; from two on, interleaving shortens the step for every m, not only multiples of p."""
    half = Costs.uniform(forward=0.5, backward=1.0)
    for pp in (2, 3, 4):
        assert run("interleaved", pp, 2, 1, half).makespan == run("1f1b", pp, 1, 1, DOUBLE).makespan
        for m in range(2, 13):
            assert run("interleaved", pp, 2, m, half).makespan < run("1f1b", pp, 1, m, DOUBLE).makespan


@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 1.5, 1.0)])
@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_zb_h1_bubble_formula(pp: int, f: float, i: float, w: float) -> None:
    """Qi et al. 2023 (arXiv:2401.10241), section 3.1: ZB-H1's bubble is (p-1)(F+I-W) against 1F1B's
    (p-1)(F+I+W), for m >= p; a third of it when F = I = W."""
    costs = Costs.uniform(forward=f, backward=i + w, input_grad=i, weight_grad=w)
    for m in (pp, pp + 1, 2 * pp, 3 * pp + 1):
        bubble = (pp - 1) * (f + i - w)
        expected = bubble / (m * (f + i + w) + bubble)
        assert run("zb", pp, 1, m, costs).bubble == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_zero_bubble_schedules_below_1f1b(pp: int) -> None:
    for m in range(1, 3 * pp):
        one = run("1f1b", pp, 1, m, DOUBLE).bubble
        zb = run("zb", pp, 1, m, DOUBLE).bubble
        assert zb < one
        # ZB-V holds two half-size chunks: no worse than ZB-H1, strictly better once m > p
        half = Costs.uniform(forward=0.5, backward=1.0)
        zbv = run("zbv", pp, 2, m, half).bubble
        assert zbv <= zb + 1e-12
        if m > pp:
            assert zbv < zb


def test_transfer_adds_two_latencies_per_hop_to_gpipe() -> None:
    """Forward wave and backward wave each cross p-1 links: makespan (m+p-1)(F+B) + 2(p-1)t."""
    pp, m, t = 4, 5, 0.25
    costs = Costs.uniform(forward=1.0, backward=2.0, transfer=t)
    assert run("gpipe", pp, 1, m, costs).makespan == pytest.approx((m + pp - 1) * 3.0 + 2 * (pp - 1) * t)


def test_no_transfer_between_stages_on_one_rank() -> None:
    slow = Costs.uniform(forward=1.0, backward=2.0, transfer=5.0)
    assert run("zbv", 1, 2, 3, slow).makespan == run("zbv", 1, 2, 3, DOUBLE).makespan == 18.0


def test_posting_a_send_occupies_its_sender_and_is_not_busy_time() -> None:
    """GPipe, p 2, m 1: 0F0, posting its activation (s), the hop (t), 1F0 1B0, the gradient's post and
    hop, 0B0: makespan F + s + t + F + B + s + t + B; the busy time is the compute alone."""
    s, t = 0.5, 0.25
    plain = run("gpipe", 2, 1, 1, Costs.uniform(forward=1.0, backward=2.0, transfer=t))
    posted = run("gpipe", 2, 1, 1, Costs.uniform(forward=1.0, backward=2.0, transfer=t, send=s))
    assert plain.makespan == pytest.approx(6.0 + 2 * t)
    assert posted.makespan == pytest.approx(6.0 + 2 * (s + t))
    assert posted.busy == plain.busy == {0: 3.0, 1: 3.0}
    assert posted.bubble > plain.bubble


def test_posting_delays_the_senders_next_action() -> None:
    """1F1B, p 2, m 2: rank 0 posts 0F0's activation before it starts 0F1, so 0F1 starts at F + s."""
    s = 0.5
    timeline = run("1f1b", 2, 1, 2, Costs.uniform(forward=1.0, backward=2.0, send=s))
    assert [slot.start for slot in timeline.slots[0][:2]] == pytest.approx([0.0, 1.0 + s])
    one_rank = Costs.uniform(forward=1.0, backward=2.0, send=s)
    assert run("zbv", 1, 2, 3, one_rank).makespan == 18.0  # one rank posts nothing


def test_per_stage_costs() -> None:
    """An uneven last stage (twice the cost) sets the 1F1B steady-state pace."""
    costs = Costs(forward=(1.0, 2.0), backward=(2.0, 4.0))
    timeline = run("1f1b", 2, 1, 4, costs)
    # stage 1 is busy from t=1 (after 0F0) for 4 * 6 = 24; the last 0B3 follows it
    assert timeline.makespan == pytest.approx(1.0 + 24.0 + 2.0)
    assert timeline.busy == {0: 12.0, 1: 24.0}


def test_timeline_slots_respect_dependencies() -> None:
    timeline = run("interleaved-zb", 3, 2, 5, DOUBLE)
    end = {slot.action: slot.end for slots in timeline.slots.values() for slot in slots}
    start = {slot.action: slot.start for slots in timeline.slots.values() for slot in slots}
    for action, begins in start.items():
        if action.kind.value == "F" and action.stage > 0:
            previous = next(
                a
                for a in end
                if a.stage == action.stage - 1 and a.kind == action.kind and a.microbatch == action.microbatch
            )
            assert begins >= end[previous]
    for slots in timeline.slots.values():
        assert all(a.end <= b.start for a, b in itertools.pairwise(slots))


def test_a_deadlocked_schedule_is_not_simulated() -> None:
    schedule = {0: parse_actions("0F0 0B0 0F1 0B1"), 1: parse_actions("1F1 1B1 1F0 1B0")}
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule, (0, 1), DOUBLE)


def test_text_picture() -> None:
    text = format_timeline(run("1f1b", 2, 1, 2, EQUAL))
    assert text.splitlines() == [
        "makespan 6, bubble 0.3333 (idle / total over ranks)",
        "rank 0: 0F0 0F1 ....0B0 ....0B1 ",
        "rank 1: ....1F0 1B0 1F1 1B1 ....",
    ]


def test_trace_events_match_observe_and_plot(tmp_path: Path) -> None:
    """Spans observe.trace turns into a run's trace events; plot_timeline draws the simulated schedule."""
    from shardwise.observe.trace import rank_events

    timeline = run("1f1b", 2, 1, 3, DOUBLE)
    events = [e for r in (0, 1) for e in rank_events(timeline.spans(r, unit_s=1e-3), r, origin=0.0)]
    complete = [e for e in events if e["ph"] == "X"]
    compute = [e for e in complete if e["cat"] == "compute"]
    assert len(compute) == 12 and {e["pid"] for e in compute} == {0, 1}
    first = next(e for e in compute if e["name"] == "1F0")
    assert first["ts"] == pytest.approx(1000.0) and first["dur"] == pytest.approx(1000.0)  # 1 unit = 1 ms
    assert first["args"] == {"stage": 1, "kind": "F", "microbatch": 0}
    assert sum(e["cat"] == "step" for e in complete) == 2
    assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(first)
    pytest.importorskip("matplotlib")
    from shardwise.observe.plots import plot_timeline

    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    png = plot_timeline(tmp_path, last_steps=1)
    assert png.exists() and png.stat().st_size > 1000


def test_a_gap_comes_between_a_ranks_actions_not_before_its_first_nor_after_a_wait() -> None:
    one_rank = {0: parse_actions("0F0 1F0 1B0 0B0")}
    timeline = simulate(one_rank, [0, 0], Costs(forward=1.0, backward=2.0, gap=0.5))
    assert [(s.start, s.end) for s in timeline.slots[0]] == [(0.0, 1.0), (1.5, 2.5), (3.0, 5.0), (5.5, 7.5)]
    # two ranks: 1F0 waits for 0F0's activation (transfer 1.0 > gap), so no gap is added to the wait
    two = {0: parse_actions("0F0 0B0"), 1: parse_actions("1F0 1B0")}
    timeline = simulate(two, [0, 1], Costs(forward=1.0, backward=2.0, transfer=1.0, gap=0.5))
    assert [(s.start, s.end) for s in timeline.slots[1]] == [(2.0, 3.0), (3.5, 5.5)]
    assert [(s.start, s.end) for s in timeline.slots[0]] == [(0.0, 1.0), (6.5, 8.5)]
