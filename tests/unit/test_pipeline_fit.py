"""Fitting a split schedule to measured costs (``pipeline/adapt.py``, ``pipeline/fitting.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardwise.pipeline.actions import Kind, format_actions, fuse_schedule
from shardwise.pipeline.adapt import (
    describe_fit,
    fit_report,
    fit_schedule,
    fully_fused,
    fuse_one,
    measured_costs,
    split_by_parity,
    splits,
)
from shardwise.pipeline.fitting import BUILT, FIT_STEPS, FITTED, TIMED, TIMED_STEPS, ScheduleFitter
from shardwise.pipeline.schedules import build, stage_placement
from shardwise.pipeline.simulate import Costs, simulate, step_time

# the small GPT's two stages on this machine, in ms: the split costs the last stage about 1.7 ms a
# micro-batch over its B (bench pipeline's profile under load)
COSTLY_SPLIT = measured_costs(
    [
        {"F": 3.7, "B": 5.9, "Fs": 4.0, "I": 4.5, "W": 2.8},
        {"F": 6.8, "B": 9.2, "Fs": 7.2, "I": 6.4, "W": 4.5},
    ]
)


def test_a_costly_split_is_kept_only_where_it_fills_a_bubble() -> None:
    """ZB-H1 on 2 ranks with the split's cost: only the last stage's last backward stays split (its W
    runs while the first stage does its last backward), and the step is shorter than 1F1B's."""
    placement = stage_placement("zb", 2, 1)
    built = fuse_schedule(build("zb", 2, 1, 4))
    fitted, kept = fit_schedule(built, placement, COSTLY_SPLIT)
    assert kept == 1
    assert format_actions(fitted[1]) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1I3 1W3"
    span = {name: simulate(s, placement, COSTLY_SPLIT).makespan for name, s in
            [("fitted", fitted), ("built", built), ("1f1b", build("1f1b", 2, 1, 4))]}  # fmt: skip
    assert span["fitted"] < span["1f1b"] < span["built"], span


def test_a_free_split_keeps_the_zero_bubble_schedule_s_step() -> None:
    """Where I + W cost what B does, the fit never lengthens the step and keeps splits that fill bubbles."""
    costs = Costs.uniform(1.0, 2.0)
    placement = stage_placement("zb", 4, 1)
    built = build("zb", 4, 1, 8)
    fitted, kept = fit_schedule(built, placement, costs)
    assert kept > 0
    assert simulate(fitted, placement, costs).makespan <= simulate(built, placement, costs).makespan
    assert (
        simulate(fitted, placement, costs).makespan < simulate(fully_fused(built), placement, costs).makespan
    )


# the bench's small GPT (zb, 2 stages) as its profile timed it, in ms
BENCH = {"forward": (3.41, 4.62), "backward": (4.85, 6.23), "input_grad": (3.12, 4.75)}
BENCH_W, BENCH_LINK = (1.56, 2.27), {"transfer": 0.487, "send": 0.1}


def test_a_step_ends_with_each_rank_s_update_after_its_own_last_action() -> None:
    placement = stage_placement("1f1b", 2, 1)
    schedule = build("1f1b", 2, 1, 4)
    plain = simulate(schedule, placement, Costs.uniform())
    ends = {rank: slots[-1].end for rank, slots in plain.slots.items()}
    assert step_time(plain, placement, Costs.uniform()) == plain.makespan == max(ends.values())
    costs = Costs(1.0, 2.0, 1.0, 1.0, update=(0.5, 3.0))
    timeline = simulate(schedule, placement, costs)
    assert step_time(timeline, placement, costs) == max(ends[0] + 0.5, ends[1] + 3.0)
    # two stages on one rank (zbv's V): the rank's update is both stages'
    v_placement = stage_placement("zbv", 2, 2)
    v = simulate(build("zbv", 2, 2, 4), v_placement, Costs.uniform())
    stage_updates = (1.0, 2.0, 4.0, 8.0)
    v_costs = Costs(1.0, 2.0, 1.0, 1.0, update=stage_updates)
    v_ends = {rank: slots[-1].end for rank, slots in v.slots.items()}
    held = {r: sum(u for s, u in enumerate(stage_updates) if v_placement[s] == r) for r in v_ends}
    assert step_time(v, v_placement, v_costs) == max(v_ends[r] + held[r] for r in v_ends)
    # a rank the timeline has no slots for still updates
    only_rank_0 = type(plain)({0: plain.slots[0]}, plain.makespan)
    assert step_time(only_rank_0, placement, costs) == max(ends[0] + 0.5, 3.0)


@pytest.mark.parametrize(
    ("update", "kept"), [((0.0, 0.0), [(1, 2), (1, 3)]), ((0.0, 4.0), [(1, 3)]), ((0.0, 6.0), [])]
)
def test_a_rank_s_update_weighs_in_the_fit(update: tuple[float, float], kept: list[tuple[int, int]]) -> None:
    """The last stage's deferred Ws fill its bubble while the first stage does its last backwards, and
    end just before it (0.8 ms here); the longer the last stage's update, the fewer of them pay."""
    placement = stage_placement("zb", 2, 1)
    costs = Costs(**BENCH, weight_grad=BENCH_W, **BENCH_LINK, update=update)
    fitted, _ = fit_schedule(fuse_schedule(build("zb", 2, 1, 4)), placement, costs)
    assert sorted((a.stage, a.microbatch) for a in fitted[1] if a.kind is Kind.INPUT_GRAD) == kept


def test_fully_fused_undoes_every_split() -> None:
    schedule = fully_fused(build("zbv", 2, 2, 4))
    assert not splits(schedule)
    assert {a.kind for acts in schedule.values() for a in acts} == {Kind.FORWARD, Kind.BACKWARD}


def test_the_fitter_times_steps_split_by_parity_then_runs_the_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    built = fuse_schedule(build("zb", 2, 1, 4))
    fitter = ScheduleFitter(lambda m: built, (0, 1), 2)
    cpu = torch.device("cpu")
    ticks = iter(range(10_000))  # every timed action takes exactly one tick: B costs what I does
    clock = SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr("shardwise.device.time", clock)  # the fitter times with device.Clock
    seen, updates = [], []
    for _ in range(FIT_STEPS + 1):
        phase = fitter.phase(4)
        seen.append((phase, fitter.timing(4)))
        actions = fitter.schedule(4, phase)[1]  # rank 1's actions, as if run
        split = {a.microbatch for a in actions if a.kind is Kind.INPUT_GRAD}
        if phase in TIMED:  # every timed step has split and unsplit backwards side by side
            assert split == {mb for mb in range(4) if mb % 2 == TIMED.index(phase)}
        for action in actions:
            with fitter.timed(action, action.microbatch in split, cpu):
                pass
        fitter.step_done(4, None)
        updates.append(fitter.timing_update(4))
        if updates[-1]:  # the rank's update, as the engine runs it (``Engine.updates_early``)
            with fitter.timed_update((1,), cpu):
                pass
    # timed: the updates of the timed steps but the last (the fit came first); never the warm-up's
    assert updates == [False, True, True, True, False, False]
    in_turn = [TIMED[0], TIMED[1], TIMED[1], TIMED[0]]  # with one micro-batch: split, fused, fused, split
    assert seen == [(BUILT, False), *[(in_turn[k % 4], True) for k in range(TIMED_STEPS)], (FITTED, False)]
    assert FIT_STEPS == 1 + TIMED_STEPS
    # rank 1's B takes one tick and its I and W one each: the split costs a tick and fills nothing
    # here (rank 0 timed none), so the fit undoes it
    assert fitter.schedule(4, FITTED) == fully_fused(built) and fitter.reports[4]["splits_kept"] == 0
    assert fitter.reports[4]["measured_ms"][1] == {k: 1000.0 for k in ("F", "B", "Fs", "I", "W", "U")}


def test_split_by_parity_keeps_every_other_split_in_place() -> None:
    built = build("zb", 2, 1, 4)
    even = split_by_parity(built, 0)
    assert format_actions(even[1]) == "1F0 1I0 1F1 1B1 1W0 1F2 1I2 1F3 1B3 1W2"
    assert fully_fused(split_by_parity(built, 1)) == fully_fused(built)


def test_a_schedule_without_a_split_is_never_fitted() -> None:
    fitter = ScheduleFitter(lambda m: build("1f1b", 2, 1, m), (0, 1), 2)
    for _ in range(4):
        assert fitter.phase(4) == BUILT and not fitter.timing(4)
        fitter.step_done(4, None)
    with pytest.raises(KeyError):
        fitter.schedule(4, FITTED)


def test_a_fit_says_what_it_kept_once() -> None:
    """The report counts the splits built and kept; the note names them and the switch that keeps all."""
    built = fuse_schedule(build("zb", 2, 1, 4))
    fitted = {0: built[0], 1: fuse_one(built[1], next(a for a in built[1] if a.kind is Kind.WEIGHT_GRAD))}
    per_stage = [{"F": 1e-3, "B": 2e-3, "Fs": 1e-3, "I": 1e-3, "W": 1e-3}] * 2
    report = fit_report(built, fitted, per_stage)
    kept = [[a.stage, a.microbatch] for a in fitted[1] if a.kind is Kind.INPUT_GRAD]
    assert report["splits_built"] == 4 and report["splits_kept"] == 3 and report["kept"] == kept
    assert report["measured_ms"][1] == {"F": 1.0, "B": 2.0, "Fs": 1.0, "I": 1.0, "W": 1.0}
    note = describe_fit(4, report)
    assert "3 of 4 backwards stay split" in note and "stage 1: micro-batch 1, 2, 3" in note
    assert "the other 1 run as one B" in note and "parallel.fit_schedule=false" in note
    none_kept = describe_fit(4, fit_report(built, fully_fused(built), per_stage))
    assert "none of its 4 split backwards pays here: all 4 run as one B" in none_kept
    assert "the other" not in none_kept
    every = describe_fit(4, fit_report(built, built, per_stage))
    assert "all 4 backwards stay split" in every and "the other" not in every


def test_fitting_off_runs_the_schedule_as_built_every_step() -> None:
    built = fuse_schedule(build("zb", 2, 1, 4))
    fitter = ScheduleFitter(lambda m: built, (0, 1), 2, fit=False)
    for _ in range(FIT_STEPS + 2):
        assert fitter.phase(4) == BUILT and not fitter.timing(4)
        assert fitter.schedule(4, BUILT) == built
        fitter.step_done(4, None)
    assert fitter.reports == {} and fitter.take_notes() == []
