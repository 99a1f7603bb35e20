"""``plan --check``: which layouts it runs on N ranks, the overrides that run them, and when the
measured time is declared meaningless (more ranks than cores). Nothing is launched here."""

from __future__ import annotations

import pytest

from shardwise.bench.plan_check import check_layouts, layout_overrides, time_note
from shardwise.config import load_config
from shardwise.models.adapters import preset_shape

LARGE = preset_shape("large", 64)
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


def test_two_ranks_check_each_strategy_with_and_without_checkpointing_on_dp_tp_and_pp() -> None:
    layouts = check_layouts(LARGE, STRATEGIES, 2)
    names = [layout.name() for layout in layouts]
    assert names[:8] == [f"{s} dp2 mb1{c}" for s in STRATEGIES for c in ("", " ckpt")]
    assert names[8:16] == [f"{s} dp1-tp2 mb1{c}" for s in STRATEGIES for c in ("", " ckpt")]
    assert names[16:] == [f"{s} dp1-pp2 mb4{c}" for s in STRATEGIES for c in ("", " ckpt")]  # 1F1B
    assert all(layout.devices == 2 for layout in layouts)
    assert [layout.name() for layout in check_layouts(LARGE, ["ddp"], 2, tp=False, pp=False)] == [
        "ddp dp2 mb1",
        "ddp dp2 mb1 ckpt",
    ]


def test_odd_ranks_or_odd_heads_take_no_tp() -> None:
    assert {(layout.tp, layout.pp) for layout in check_layouts(LARGE, STRATEGIES, 3)} == {(1, 1)}
    odd = preset_shape("odd", 64)
    assert {layout.tp for layout in check_layouts(odd, STRATEGIES, 2)} == {1} or odd.n_head % 2 == 0


def test_overrides_build_the_layouts_mesh() -> None:
    layouts = check_layouts(LARGE, STRATEGIES, 4)
    zero2_tp, ddp_ckpt = layouts[12], layouts[1]
    config = load_config(None, {"model.kind": "gpt", "model.preset": "large", **layout_overrides(zero2_tp)})
    assert (config.strategy, config.parallel.dp, config.parallel.tp) == ("zero2", 2, 2)
    assert not config.parallel.activation_checkpointing
    config = load_config(None, layout_overrides(ddp_ckpt))
    assert config.parallel.activation_checkpointing and (config.parallel.dp, config.parallel.tp) == (4, 1)
    zero1_pp = next(layout for layout in layouts if layout.pp == 2 and layout.strategy == "zero1")
    config = load_config(None, {"model.kind": "gpt", "model.preset": "large", **layout_overrides(zero1_pp)})
    parallel = config.parallel
    assert (parallel.dp, parallel.pp, parallel.schedule, config.data.micro_batches) == (2, 2, "1f1b", 4)


def test_time_is_declared_meaningless_with_more_ranks_than_cores() -> None:
    assert time_note(4, 2) == "time not meaningful: 4 ranks on 2 cores"
    assert time_note(2, 2) == "" and time_note(2, 16) == ""


def test_the_calibration_is_each_rates_best_repeat_pooled_over_the_launches() -> None:
    """Others on a shared machine only slow a probe down: the fastest repeat is the least disturbed."""
    from shardwise.bench.plan_check import calibration_from

    samples = [[1e9, 2e9, 5e9], [3e9, 1e9, 4e9], [2e9, 1.5e9, 6e9]]  # (flops, checkpointed, bytes/s)
    calibration, spread = calibration_from(samples)
    assert (calibration.flops_per_s, calibration.checkpointed_flops_per_s) == (3e9, 2e9)
    assert calibration.memory_bytes_per_s == 6e9 and spread["repeats"] == 3
    assert spread["flops_per_s"] == {"best": 3e9, "median": 2e9, "slowest": 1e9}


def test_a_rows_prediction_never_depends_on_its_own_timings() -> None:
    """The prediction comes from the check's calibration alone; the measured steps only divide it."""
    from shardwise.bench.plan_check import compare
    from shardwise.planner.calibration import Calibration
    from shardwise.planner.layout import Layout, Training

    base, layout = preset_shape("base", 64), Layout("zero3", dp=2, activation_checkpointing=True)
    config = load_config(None, {"model.kind": "gpt", "model.preset": "base", **layout_overrides(layout)})
    calibration = Calibration(flops_per_s=2e10, checkpointed_flops_per_s=2.3e10, memory_bytes_per_s=1e10)
    runs = [
        {"peak_bytes": 1e8, "build_bytes": 5e7, "step_s": [2.0, 1.0, 3.0], "comm_s": [0.1],
         "bytes_sent": 8.6e7},
        {"peak_bytes": 2e8, "build_bytes": 5e7, "step_s": [9.0, 8.0], "comm_s": [0.5], "bytes_sent": 1.0},
    ]
    rows = [compare(base, Training(16, 64), layout, config, run, calibration) for run in runs]
    assert rows[0]["predicted_step_s"] == rows[1]["predicted_step_s"] > 0
    assert rows[0]["predicted_bytes"] == rows[1]["predicted_bytes"]
    assert rows[0]["measured_step_s"] == 1.0 and rows[0]["measured_step_s_median"] == 2.0  # fastest step
    assert rows[0]["time_ratio"] == rows[0]["predicted_step_s"] / 1.0
    faster = compare(base, Training(16, 64), layout, config, runs[0], Calibration(flops_per_s=4e10))
    assert faster["predicted_step_s"] < rows[0]["predicted_step_s"]


def test_more_ranks_than_cores_gives_memory_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No probes and no timed steps were run (``check_worker(timed=False)``): the row has no times."""
    from shardwise.bench import plan_check
    from shardwise.planner.calibration import Calibration
    from shardwise.planner.layout import Layout, Training

    monkeypatch.setattr(plan_check.os, "cpu_count", lambda: 2)
    base, layout = preset_shape("base", 64), Layout("zero2", dp=4)
    config = load_config(None, {"model.kind": "gpt", "model.preset": "base", **layout_overrides(layout)})
    run = {"peak_bytes": 1e8, "build_bytes": 5e7, "step_s": [], "comm_s": [], "bytes_sent": 5.0}
    row = plan_check.compare(base, Training(16, 64), layout, config, run, Calibration())
    assert row["time_note"] == "time not meaningful: 4 ranks on 2 cores"
    assert row["predicted_step_s"] is row["measured_step_s"] is row["time_ratio"] is None
    assert row["memory_ratio"] == row["predicted_bytes"] / 1e8 and row["measured_comm_s"] is None
    assert row["build_ratio"] == row["predicted_build_bytes"] / 5e7
