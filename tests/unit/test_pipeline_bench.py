"""The pipeline bench's arithmetic and shapes, without timings: the bubble read off action spans, a
row's JSON, the row of a peer that hangs (a tiny fake), and the two-panel timeline picture."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardwise.bench import pipeline as bench
from shardwise.bench import pipeline_rows as rows
from shardwise.bench.pipeline_profile import median_costs
from shardwise.observe import plots
from shardwise.observe.monitor import Span
from shardwise.pipeline.schedules import build, stage_placement
from shardwise.pipeline.simulate import Costs, simulate

COSTS = Costs((1e-3, 2e-3), (2e-3, 4e-3), (1e-3, 2e-3), (1e-3, 2e-3))


def _action(name: str, start: float, duration: float) -> Span:
    kind = name[1]
    return Span(name, "compute", "actions", start, duration, {"stage": int(name[0]), "kind": kind})


def test_bubble_from_spans_is_idle_over_total() -> None:
    # rank 0 busy 0-1 and 2-3, rank 1 busy 1-3.5: window 0-3.5, busy 4.5 of 7 rank-seconds
    spans = {
        0: [_action("0F0", 10.0, 1.0), _action("0B0", 12.0, 1.0)],
        1: [_action("1F0", 11.0, 2.5)],
    }
    assert rows.bubble_from_spans(spans) == pytest.approx(1 - 4.5 / 7)
    # a rank with nothing recorded is idle the whole window
    assert rows.bubble_from_spans({**spans, 2: []}) == pytest.approx(1 - 4.5 / 10.5)


def test_bubble_from_spans_agrees_with_the_simulator() -> None:
    """The simulator's timeline, read as measured spans, gives the simulator's bubble."""
    schedule = build("1f1b", 2, 1, 4)
    timeline = simulate(schedule, stage_placement("1f1b", 2, 1), COSTS)
    spans = {r: [s for s in timeline.spans(r, 1.0) if s.lane == "actions"] for r in timeline.slots}
    assert rows.bubble_from_spans(spans) == pytest.approx(timeline.bubble)
    assert 0 < timeline.bubble < 1


def _launch(step_s: float, bubble_shift: float) -> list[dict[str, Any]]:
    """One fake launch of two ranks of our side: step times and one measured step's spans."""
    return [
        {"step_s": [step_s], "spans": [[("0F0", 0.0, 1.0, {"kind": "F"}), ("0B0", 2.0, 1.0, {"kind": "B"})]]},
        {"step_s": [step_s * 0.9], "spans": [[("1F0", 1.0, 1.0 + bubble_shift, {"kind": "F"})]]},
    ]


def _launch_running(schedule: dict[int, list[Any]]) -> list[dict[str, Any]]:
    """A fake launch whose one measured step ran ``schedule`` (its spans as the simulator times it)."""
    timeline = simulate(schedule, stage_placement("zb", 2, 1), COSTS)
    return [
        {"step_s": [0.1], "spans": [[(s.name, s.start, s.duration, {}) for s in timeline.spans(r, 1.0)[1:]]]}
        for r in sorted(timeline.slots)
    ]


def test_the_simulated_bubble_is_each_launchs_own_schedule_the_median_over_launches() -> None:
    """A split schedule is fitted to each launch's run, so launches may run different ones: each is
    simulated, not only the last launch's."""
    from shardwise.pipeline.adapt import fully_fused

    split, fused = rows.as_run("zb", 2, 1, 4), fully_fused(build("zb", 2, 1, 4))
    placement = stage_placement("zb", 2, 1)
    split_bubble, fused_bubble = (simulate(s, placement, COSTS).bubble for s in (split, fused))
    assert split_bubble != pytest.approx(fused_bubble)
    theirs = [[{"step_s": [0.1]}, {"step_s": [0.1]}]] * 3
    # the last launch is the odd one out: read alone, it would give the other bubble
    for order, expected in (((split, split, fused), split_bubble), ((fused, fused, split), fused_bubble)):
        ours = [_launch_running(schedule) for schedule in order]
        assert rows.row("zb", 2, 4, 1000, ours, theirs, COSTS)["bubble_simulated"] == pytest.approx(expected)


def test_row_json_shape() -> None:
    ours = [_launch(0.5, 0.0), _launch(0.7, 0.0), _launch(0.6, 0.0)]
    # each launch's torch steps beside ours (the same launch): step k's time is its slowest rank's
    theirs = [[{"step_s": [1.0]}, {"step_s": [1.1]}], [{"step_s": [1.0]}], [{"step_s": [1.5]}]]
    row = rows.row("1f1b", 2, 4, 1000, ours, theirs, COSTS)
    json.dumps(row)  # JSON-ready
    for key in ("bubble_measured", "bubble_simulated", "bubble_theory", "speed_ratio"):
        assert isinstance(row[key], float), key
    assert row["schedule"] == "1f1b" and row["torch_class"] == "Schedule1F1B"
    assert row["ours"]["step_s"] == pytest.approx(0.6)  # every launch's steps, the slowest rank's
    assert row["torch"]["step_s"] == pytest.approx(3.6 / 3)  # 1.1 (rank 1's), 1.0 and 1.5
    assert row["torch"]["tokens_per_s"] == pytest.approx(1000 / (3.6 / 3))
    # each launch a round here (one pair each: 1.1/0.5, 1.0/0.7, 1.5/0.6), then the median over rounds
    assert row["speed_ratio_rounds"] == pytest.approx([1.1 / 0.5, 1.0 / 0.7, 1.5 / 0.6])
    assert row["speed_ratio"] == pytest.approx(1.1 / 0.5)
    spread = rows.conditions([row], 1.0, 2.0)["ratio_spread"]
    assert spread == pytest.approx((1.5 / 0.6 - 1.0 / 0.7) / (1.1 / 0.5))
    assert row["bubble_measured"] == pytest.approx(1 - 3 / 6)
    assert row["bubble_theory"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    assert rows.row("zb", 2, 4, 1000, ours, theirs, COSTS)["torch_class"] == "Schedule1F1B"
    assert rows.row("zbv", 2, 4, 1000, ours, theirs, Costs.uniform())["bubble_theory"] is None
    # two launches a round: the first round pools the first two launches' pairs, the second has one
    grouped = rows.row("1f1b", 2, 4, 1000, ours, theirs, COSTS, per_round=2)
    first = math.exp((math.log(1.1 / 0.5) + math.log(1.0 / 0.7)) / 2)
    assert grouped["speed_ratio_rounds"] == pytest.approx([first, 1.5 / 0.6])


def test_a_round_ratio_is_the_trimmed_geometric_mean_of_its_launches_pairs() -> None:
    """Step k of each side ran in neighbouring turns: each pair's ratio, pooled over the round's
    launches; a tenth at each end dropped, so a stall on one side's step moves nothing."""
    ours = [
        [{"step_s": [1.0, 3.0, 1.0, 1.0, 1.0]}, {"step_s": [0.9, 2.0, 1.2, 1.0, 1.0]}],
        [{"step_s": [1.0] * 5}],
    ]
    theirs = [
        [{"step_s": [1.1, 1.1, 1.2, 1.1, 1.1]}, {"step_s": [0.5, 0.5, 0.5, 0.5, 9.0]}],
        [{"step_s": [1.1, 1.1, 1.0, 1.1, 1.1]}],
    ]
    # slowest rank's, first launch: ours 1.0, 3.0, 1.2, 1.0, 1.0 and theirs 1.1, 1.1, 1.2, 1.1, 9.0; of
    # the ten pairs the stalled ones (1.1/3.0 and 9.0/1.0) are the lowest and highest: six of 1.1, two of 1
    assert rows.paired_ratio(ours, theirs) == pytest.approx(1.1**0.75)
    assert rows.trimmed_mean([5.0, 1.0, 2.0, 3.0, 4.0, 100.0, 0.0, 2.0, 3.0, 3.0]) == pytest.approx(23 / 8)
    assert rows.trimmed_mean([1.0, 5.0]) == pytest.approx(3.0)  # fewer than ten values: none dropped
    assert rows.rounds_of([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]  # type: ignore[list-item]


def test_when_torch_side_hangs_ours_runs_alone(monkeypatch: Any) -> None:
    """A paired launch that hangs makes torch's side the reason; ours still gets every round."""
    calls: list[str] = []

    def fake_launch(worker: Any, nproc: int, args: tuple[Any, ...], timeout_s: float) -> Any:
        calls.append(worker.__name__)
        if worker is bench.paired_worker:
            return None, "timeout after 5 s"
        return [{"step_s": [0.5], "spans": [[]]}] * nproc, None

    monkeypatch.setattr(bench, "launch", fake_launch)
    run = bench.Rounds(None, "Schedule1F1B")  # type: ignore[arg-type]
    for _ in range(3):
        run.run_one(2, 5.0)
    assert run.theirs == "timeout after 5 s (ours and torch's in one launch)"
    assert isinstance(run.ours, list) and len(run.ours) == 3
    assert calls == ["paired_worker", "ours_worker", "ours_worker", "ours_worker"]
    assert run.profiles == []  # no paired launch: the bench profiles in a launch of its own


def _profiled(rank: int, f: float, transfer: float) -> dict[str, Any]:
    """One rank's ``profile_worker`` result: its one stage (its rank) costs ``f`` a forward."""
    kinds = {"F": f, "B": 2 * f, "Fs": f, "I": f, "W": f}
    return {"costs": {rank: kinds}, "transfer": transfer, "send": transfer / 2}


def test_each_paired_launch_profiles_and_the_costs_are_their_medians(monkeypatch: Any) -> None:
    """The stage profile runs in each paired launch after its steps (the same processes, so the same
    placement on the cores as the steps had); the simulator gets the median of each cost."""
    forwards = iter([(1.0, 3.0), (2.0, 2.0), (4.0, 1.0)])  # per launch: stage 0's F, stage 1's F

    def fake_launch(worker: Any, nproc: int, args: tuple[Any, ...], timeout_s: float) -> Any:
        f0, f1 = next(forwards)
        ours = {"step_s": [0.5], "spans": [[]]}
        return [
            {"ours": ours, "torch": ours, "profile": _profiled(r, f, 0.1 * f0)} for r, f in ((0, f0), (1, f1))
        ], None

    monkeypatch.setattr(bench, "launch", fake_launch)
    run = bench.Rounds(None, "Schedule1F1B")  # type: ignore[arg-type]
    for _ in range(3):
        run.run_one(2, 5.0)
    profiles = run.profiles
    assert [p.forward for p in profiles] == [(1.0, 3.0), (2.0, 2.0), (4.0, 1.0)]
    costs = median_costs(profiles)
    assert costs.forward == (2.0, 2.0) and costs.backward == (4.0, 4.0)  # per stage, not per launch
    assert costs.transfer == pytest.approx(0.2) and costs.send == pytest.approx(0.1)


def hanging_peer(rank: int, world: int) -> None:
    """A peer that never returns, as torch's pipelining has on gloo (pytorch#132644)."""
    time.sleep(3600)


def test_a_hanging_peer_is_a_row_not_a_hung_bench() -> None:
    started = time.monotonic()
    results, problem = bench.launch(hanging_peer, 2, (), timeout_s=5)
    assert results is None and problem == "timeout after 5 s"
    assert time.monotonic() - started < 60
    row = rows.row("gpipe", 2, 4, 1000, [_launch(0.5, 0.0)], problem, COSTS)
    assert row["torch"] == "timeout after 5 s"
    assert row["speed_ratio"] is None and isinstance(row["bubble_measured"], float)
    json.dumps(row)


def test_plot_timeline_draws_measured_beside_simulated(tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("matplotlib")
    timeline = simulate(build("1f1b", 2, 1, 4), stage_placement("1f1b", 2, 1), COSTS)
    measured = {r: [s for s in timeline.spans(r, 1.0) if s.lane == "actions"] for r in timeline.slots}
    for span in measured[1]:
        span.start += 100.0  # any clock: the picture starts at the first action
    row = {"schedule": "1f1b", "pp": 2, "virtual_stages": 1, "microbatches": 4}
    bench.write_traces(tmp_path, measured, row, COSTS)
    panels: list[list[str]] = []
    save = plots._save
    monkeypatch.setattr(
        plots,
        "_save",
        lambda fig, path: (panels.append([a.get_title() for a in fig.axes]), save(fig, path))[1],
    )
    png = plots.plot_timeline(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (titles,) = panels
    assert len(titles) == 2
    assert titles[0].startswith("measured: bubble") and titles[1].startswith("simulated: bubble")
    assert f"{100 * timeline.bubble:.1f}%" in titles[1]


def test_trace_blocks_on_a_pipeline_stage_keeps_the_model_block_index() -> None:
    """After a split the blocks are a ModuleDict keyed by the model's index (train --trace --pp)."""
    import torch
    from torch import nn

    from shardwise.observe.monitor import Monitor
    from shardwise.observe.trace import trace_blocks

    monitor = Monitor()
    monitor.tracing = True
    blocks = nn.ModuleDict({"5": nn.Linear(2, 2), "6": nn.Linear(2, 2)})
    handles = trace_blocks(blocks, monitor)
    blocks["6"](blocks["5"](torch.ones(1, 2, requires_grad=True))).sum().backward()
    for handle in handles:
        handle.remove()
    names = {s.name for s in monitor.spans}
    assert {"block 5 forward", "block 6 forward", "block 5 backward", "block 6 backward"} <= names


def test_zero_bubble_theory() -> None:
    """ZB-H1's formula with the paper's equal costs is a third of 1F1B's ramp; never below 0."""
    value, _ = rows.theory("zb", 4, 1, 8, Costs.uniform(1.0, 2.0))
    assert value == pytest.approx(3 * 1 / (8 * 3 + 3 * 1))
    heavy_w = Costs((1.0, 1.0), (2.0, 2.0), (0.0, 1.0), (3.0, 1.0))  # the first stage: W is all of B
    assert rows.theory("zb", 2, 1, 4, heavy_w)[0] == 0.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--schedules", "1f1b,nope"], "unknown schedule 'nope' in --schedules: choose from gpipe, 1f1b"),
        (["--nproc", "1"], "--nproc must be >= 2, got 1"),
        # these used to fail inside the first launch, a RuntimeError wrapping the rank's error
        (["--micro-batches", "0"], "data.micro_batches must be an integer >= 1, got 0"),
        (
            ["--nproc", "4", "--preset", "tiny", "--schedules", "interleaved"],
            "the gpt preset 'tiny' has 2 blocks, fewer than pp(4) x virtual_stages(2) = 8 stages",
        ),
        (["--schedules", "1f1b,gpipe", "--global-batch", "0"], "data.global_batch must be an integer >= 1"),
        (["--steps", "5"], "needs --steps >= 6 (the first 5 warm up), --rounds >= 1, --launches >= 1"),
        (["--launches", "0"], "got 40, 3, 0, 180"),
        (["--timeout", "0"], "got 40, 3, 5, 0"),
    ],
)
def test_bad_bench_input_is_one_line_before_any_launch(
    flags: list[str], message: str, capsys: Any, monkeypatch: Any
) -> None:
    from shardwise.cli import main

    def no_launch(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rank was launched for a bad input")

    monkeypatch.setattr(bench, "launch", no_launch)
    assert main(["bench", "pipeline", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise bench: error: ") and message in err[0], err


def test_rounds_run_interleaved_across_schedules(monkeypatch: Any) -> None:
    """Round k of every schedule before round k + 1 of any: a drift of the machine weighs on all rows;
    with zb and 1f1b in the bench, the 1f1b row is measured in zb's launches (their third side)."""
    order: list[str] = []
    thirds: list[str | None] = []

    def fake_launch(worker: Any, nproc: int, args: tuple[Any, ...], timeout_s: float) -> Any:
        order.append(args[0].parallel.schedule)
        plain = args[2]  # zb's, where the bench has 1f1b too: our 1F1B, a third side of the same launch
        thirds.append(plain.parallel.schedule if plain else None)
        ours = {**_launch(0.5, 0.0)[0], "warmup_spans": []}
        ours_1f1b = {**_launch(0.6, 0.0)[0], "warmup_spans": []}  # the third side: its own figures
        sides = {"ours": ours, "torch": ours, **({"plain": ours_1f1b} if plain else {})}
        return [{**sides, "profile": _profiled(r, 1e-3, 1e-4)} for r in (0, 1)], None

    monkeypatch.setattr(bench, "launch", fake_launch)
    result = bench.run_pipeline_bench(steps=8, rounds=2, launches=1, schedules=["gpipe", "1f1b", "zb"])
    assert order == ["gpipe", "zb", "gpipe", "zb"] and thirds == [None, "1f1b", None, "1f1b"]
    assert [r["schedule"] for r in result["rows"]] == ["gpipe", "1f1b", "zb"]
    assert [r["launches_of"] for r in result["rows"]] == [None, "zb", None]
    assert result["steps"] == 8 and result["timed_steps"] == 3  # steps 5, 6 and 7 (4 warms up)
    plain_row = result["rows"][1]  # the third side's figures, against the same torch steps
    assert plain_row["ours"]["step_s"] == pytest.approx(0.6) and plain_row["bubble_measured"] is not None
    assert plain_row["speed_ratio_rounds"] == pytest.approx([0.5 / 0.6] * 2)
    gains = ("tokens_per_s", "same_launch_tokens_per_s", "paired")
    assert result["zb_over_1f1b"] == {k: pytest.approx(1.2) for k in gains}
    # no zb: launches of its own
    alone = bench.run_pipeline_bench(steps=8, rounds=1, launches=1, schedules=["1f1b"])
    assert order[4:] == ["1f1b"] and alone["rows"][0]["launches_of"] is None
    bench.run_pipeline_bench(steps=8, rounds=1, launches=1, schedules=["zb"])  # no 1f1b row: no third side
    assert order[5:] == ["zb"] and thirds[4:] == [None, None]


def test_once_torch_fails_the_third_side_runs_alone_and_keeps_its_row(monkeypatch: Any) -> None:
    """zb's launches host the 1f1b row: when torch's side fails there, zb and our 1f1b each run alone
    from then on (as ours does), so the 1f1b row keeps every round; the same launches' figure is read
    from the paired launch only."""
    calls: list[tuple[str, str]] = []
    paired = iter([True, False])

    def fake_launch(worker: Any, nproc: int, args: tuple[Any, ...], timeout_s: float) -> Any:
        name = args[0].parallel.schedule
        calls.append((worker.__name__, name))
        if worker is bench.paired_worker:
            if not next(paired, False):
                return None, "timeout after 5 s"
            sides = {"ours": {**_launch(0.5, 0.0)[0], "warmup_spans": []}, "torch": {"step_s": [0.55]},
                     "plain": {**_launch(0.6, 0.0)[0], "warmup_spans": []}}  # fmt: skip
            return [{**sides, "profile": _profiled(r, 1e-3, 1e-4)} for r in (0, 1)], None
        step = 0.6 if name == "1f1b" else 0.5
        return [{**_launch(step, 0.0)[i], "warmup_spans": []} for i in (0, 1)], None

    monkeypatch.setattr(bench, "launch", fake_launch)
    result = bench.run_pipeline_bench(steps=8, rounds=3, launches=1, schedules=["1f1b", "zb"])
    alone = [("ours_worker", "zb"), ("ours_worker", "1f1b")]
    assert calls == [("paired_worker", "zb"), ("paired_worker", "zb"), *alone, *alone]
    plain_row, zb_row = result["rows"]
    assert plain_row["ours"]["launches"] == 3 and zb_row["ours"]["launches"] == 3
    assert plain_row["torch"].startswith("timeout after 5 s (ours, torch's and our 1f1b in one launch)")
    assert result["zb_over_1f1b"]["same_launch_tokens_per_s"] == pytest.approx(1.2)  # the paired launch


def test_the_third_side_is_a_row_of_its_own_or_says_why_not() -> None:
    """zb's launches hand their third side (our 1F1B) to the 1f1b row: its launches, torch's same
    steps and the profiles; a zb whose launches never ran it leaves the row the reason."""
    plain_launch = [{"step_s": [1.0]}]
    run = bench.Rounds(SimpleNamespace(parallel=SimpleNamespace(schedule="zb")), "Schedule1F1B",  # type: ignore[arg-type]
                       plain=SimpleNamespace(), plains=[plain_launch], theirs=[[{"step_s": [1.0]}]])  # type: ignore[arg-type]  # fmt: skip
    third = run.third_side()
    assert third.ours == [plain_launch] and third.theirs is run.theirs and third.profiles is run.profiles
    assert third.config is run.plain and third.plain is None
    run.plains, run.theirs = [], "timeout after 5 s (ours, torch's and our 1f1b in one launch)"
    assert run.third_side().ours == (
        "measured in the launches of zb, which ran it in none: timeout after 5 s (ours, torch's and our "
        "1f1b in one launch)"
    )


def test_zb_over_1f1b_cancels_each_launch_speed() -> None:
    """The same launches' ratio as given; the rows' tokens/s ratio as measured; the paired one from
    the speed ratios against the same torch class."""

    def made(name: str, tokens_per_s: float, ratio: float | None) -> dict[str, Any]:
        return {"schedule": name, "ours": {"tokens_per_s": tokens_per_s}, "speed_ratio": ratio}

    # zb's launches ran on a slower machine (torch's 1F1B there 10% slower too): paired, zb is 2% ahead
    rows_ = [made("1f1b", 1000.0, 0.95), made("zb", 920.0, 0.969)]
    assert rows.zb_over_1f1b(rows_, 1.03) == {
        "tokens_per_s": pytest.approx(0.92), "same_launch_tokens_per_s": 1.03, "paired": pytest.approx(1.02)
    }  # fmt: skip
    assert rows.zb_over_1f1b([made("1f1b", 1000.0, None), made("zb", 900.0, None)]) == {
        "tokens_per_s": pytest.approx(0.9)
    }
    assert rows.zb_over_1f1b(rows_[:1]) is None
    assert rows.zb_over_1f1b([rows_[0], {"schedule": "zb", "ours": "timeout after 5 s"}]) is None


def test_zb_s_launches_pair_it_with_our_1f1b_step_by_step(monkeypatch: Any) -> None:
    """zb's paired launches run our 1F1B as a third side: its tokens/s over 1F1B's is their turns'
    ratio, read from the paired launches alone; after torch's side failed, ours and the third side
    run alone, and the failure names all three sides."""
    results = iter([[{"ours": {"step_s": [1.0, 2.0, 1.0]}, "torch": {}, "plain": {"step_s": [1.1, 2.2, 1.0]},
                      "profile": _profiled(r, 1e-3, 1e-4)} for r in (0, 1)], None])  # fmt: skip

    def fake_launch(worker: Any, nproc: int, args: tuple[Any, ...], timeout_s: float) -> Any:
        got = next(results, None)
        if worker is bench.paired_worker:
            return (got, None) if got is not None else (None, "timeout after 5 s")
        return [{"step_s": [0.5]}] * nproc, None

    monkeypatch.setattr(bench, "launch", fake_launch)
    run = bench.Rounds(None, "Schedule1F1B", plain=SimpleNamespace())  # type: ignore[arg-type]
    for _ in range(3):
        run.run_one(2, 5.0)
    assert len(run.plains) == 3 and run.paired_plains() == run.plains[:1]
    assert isinstance(run.ours, list) and len(run.ours) == 3
    assert run.theirs == "timeout after 5 s (ours, torch's and our 1f1b in one launch)"
    assert bench.same_launch(run) == pytest.approx((1.1 * 1.1 * 1.0) ** (1 / 3))  # pairs 1.1, 1.1, 1.0
    assert bench.same_launch(bench.Rounds(None, "Schedule1F1B")) is None  # type: ignore[arg-type]


def test_the_sides_take_turns_of_back_to_back_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.bench import pipeline_sides as sides_module

    ran: list[tuple[str, int]] = []
    sides = {name: (lambda k, name=name: ran.append((name, k))) for name in ("ours", "torch", "plain")}
    between: list[int] = []
    steps = sides_module.WARMUP_STEPS + 6  # 11: turns of 4, 4 and 3 steps
    got = sides_module._alternate(SimpleNamespace(steps=steps), sides, lambda: between.append(len(ran)))
    block = sides_module.BLOCK
    turns = [ran[i : i + block] for i in range(0, 3 * 2 * block, block)]  # the two full rounds of turns
    assert [t[0][0] for t in turns] == ["ours", "torch", "plain", "plain", "torch", "ours"]
    assert all(
        len({n for n, _ in t}) == 1 and [k for _, k in t] == list(range(t[0][1], t[0][1] + block))
        for t in turns
    )
    kept = sides_module.measured_steps(steps)
    assert kept == [5, 6, 7, 9, 10]  # after the warm-up; a turn's first step (8) follows another side's turn
    assert len(between) == len(kept)  # one profile repeat per measured step
    for name in ("ours", "plain"):  # our runtime's sides keep their steps' action spans; torch's none
        assert len(got[name]["spans"]) == len(kept) and "warmup_spans" in got[name]
    assert set(got["torch"]) == {"step_s"}
    assert between[0] == 3 * 2 * block and between[-1] == 3 * steps  # after every side's turn
    assert all(len(got[n]["step_s"]) == len(kept) for n in sides)
    clock = [0.0]  # step k takes k seconds by this clock
    monkeypatch.setattr(sides_module.time, "perf_counter", lambda: clock[0])

    def step(k: int) -> None:
        clock[0] += k

    timed = sides_module._alternate(SimpleNamespace(steps=steps), {"a": step})
    assert timed["a"]["step_s"] == kept  # the kept steps' own times


def test_the_profile_keeps_the_tied_copy_s_head_plain_where_the_runtime_does() -> None:
    """The profile defers as the runtime does: the head that reads the tied embedding's copy keeps its
    dW in I where the two ends are on two ranks (zb's placement), and defers it where one rank holds
    both (a V), so its I and W are the runtime's."""
    from shardwise.bench.pipeline_profile import _copy_head
    from shardwise.models import build_model

    model = build_model(bench.bench_config("zb", 2, 4, "tiny", 4, 6).model)
    assert _copy_head(model, stage_placement("zb", 2, 1)) == [model.head]
    assert _copy_head(model, stage_placement("zbv", 2, 2)) == []
