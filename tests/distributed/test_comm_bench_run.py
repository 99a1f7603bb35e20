"""``run_comm_bench`` end to end on two ranks, small sizes only (the full sweep is the CLI's job)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.collectives.bench import (
    ALGORITHMS,
    format_calibration,
    format_table,
    run_calibration,
    run_comm_bench,
)
from shardwise.collectives.calibrate import SIZES
from shardwise.collectives.cost import CostProfile


@pytest.mark.slow
def test_bench_measures_saves_a_profile_and_reports_every_algorithm(tmp_path: Path) -> None:
    profile_path = tmp_path / "profile.json"  # the bench measures the steps beside the algorithms
    sizes = [4096, 1 << 20]
    result = run_comm_bench(2, sizes, profile_path=str(profile_path), ops=["all_reduce"])
    profile = CostProfile.load(profile_path)
    assert profile.alpha_s > 0 and profile.beta_s_per_byte > 0 and profile.gamma_s_per_byte > 0
    assert result["profile"]["alpha_s"] == profile.alpha_s
    measured = result["calibration_points_s"]
    assert [m for m, _ in measured["exchange"]] == [m for m, _ in profile.exchange_points]
    assert all(t > 0 for kind in ("exchange", "one_way", "reduce", "copy") for _, t in measured[kind])
    # the steps were measured at the message sizes the formulas use: n / p and n for each size
    assert [m for m, _ in measured["exchange"]] == [2048, 4096, 1 << 19, 1 << 20]
    # each algorithm's fixed cost per call was found at 4 KB and is part of its predictions
    assert {key for key, _ in profile.call_overheads} == {f"all_reduce/{a}" for a in ALGORITHMS["all_reduce"]}
    rows = result["rows"]
    expected = {(a, n) for a in ALGORITHMS["all_reduce"] for n in sizes}
    assert {(r["algorithm"], r["bytes"]) for r in rows} == expected
    assert all(r["time_us"] > 0 and r["predicted_us"] > 0 for r in rows)
    assert result["ring_vs_native_busbw_16mb_plus"] is None  # nothing measured at 16 MB
    assert result["model_error_1mb_plus"] is not None
    assert "halving_doubling" in format_table(result)


@pytest.mark.slow
def test_calibration_alone_saves_a_profile(tmp_path: Path) -> None:
    result = run_calibration(2, str(tmp_path / "p.json"))
    profile = CostProfile.load(tmp_path / "p.json")
    assert [m for m, _ in profile.one_way_points] == list(SIZES)
    assert "exchange" in format_calibration(result)
