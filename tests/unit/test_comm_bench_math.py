"""The comm benchmark's arithmetic: bus bandwidth factors, summaries and the table, on made-up rows."""

from __future__ import annotations

import pytest

from shardwise.collectives.bench import _row, _summaries, bus_factor, format_table
from shardwise.collectives.cost import CostProfile

PROFILE = CostProfile(alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10, source="test")


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("broadcast", 8) == 1.0


def test_row_bandwidths_and_prediction() -> None:
    row = _row("all_reduce", "ring", 1 << 20, 2e-3, 2, PROFILE)
    assert row["algbw_gbps"] == pytest.approx((1 << 20) / 2e-3 / 1e9)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(p-1)/p = 1 at p = 2
    predicted = 2 * 1e-5 + (1 << 20) * 1e-9 + (1 << 20) / 2 * 1e-10
    assert row["predicted_us"] == pytest.approx(predicted * 1e6)
    assert row["model_error"] == pytest.approx(abs(predicted - 2e-3) / 2e-3)


def test_summaries_take_the_worst_case() -> None:
    rows = [
        _row("all_reduce", "native", 16 << 20, 10e-3, 2, PROFILE),
        _row("all_reduce", "ring", 16 << 20, 12.5e-3, 2, PROFILE),
        _row("all_reduce", "native", 64 << 20, 40e-3, 2, PROFILE),
        _row("all_reduce", "ring", 64 << 20, 40e-3, 2, PROFILE),
        _row("all_reduce", "ring", 4096, 1.0, 2, PROFILE),  # below 1 MB: not in the model error
    ]
    summary = _summaries(rows)
    assert summary["ring_vs_native_busbw_16mb_plus"] == pytest.approx(0.8)
    assert summary["model_error_1mb_plus"] == pytest.approx(max(r["model_error"] for r in rows[1::2][:2]))


def test_table_has_one_line_per_row_and_the_summaries() -> None:
    rows = [_row("broadcast", a, 1 << 20, 1e-3, 2, PROFILE) for a in ("native", "tree")]
    result = {"nproc": 2, "backend": "gloo", "timing": "t", "profile": {"source": "test"}, "rows": rows}
    result.update(_summaries(rows))
    table = format_table(result)
    assert sum(line.strip().startswith("broadcast") for line in table.splitlines()) == 2
    assert "worst relative error" in table
