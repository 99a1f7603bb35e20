"""``shardwise bench tp`` end to end on 2 ranks with tiny settings: the report's keys, and that our
collectives per block, measured from ``CommStats`` over a step, are Megatron's count (ops and bytes)
with and without sequence parallelism. No timing is asserted."""

from __future__ import annotations

import pytest

from .cli_helpers import last_json, shardwise

pytestmark = pytest.mark.slow


def test_bench_tp_reports_both_sides_and_megatrons_count() -> None:
    args = ["--nproc", "2", "--steps", "1", "--repeats", "1", "--preset", "tiny", "--global-batch", "2"]
    result = shardwise("bench", "tp", *args, "--seq-len", "16", "--json", timeout_s=400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result)
    assert {"nproc", "preset", "steps", "repeats", "load_avg_1m", "rows"} <= set(report)
    assert set(report["rows"]) == {"tp", "tp+sp"}
    for name, row in report["rows"].items():
        for side in ("ours", "dtensor"):
            assert set(row[side]) == {"tokens_per_s", "step_s", "peak_tensor_bytes_per_rank"}
            assert len(row[side]["peak_tensor_bytes_per_rank"]) == 2
            assert all(b > 0 for b in row[side]["peak_tensor_bytes_per_rank"])
        assert row["speed_ratio"] > 0 and row["memory_ratio"] > 0
        blocks = row["collectives_per_block"]
        assert blocks["matches_megatron"], (name, blocks)
        assert blocks["measured"]["ops"] == blocks["megatron"]["ops"]
        assert blocks["measured"]["bytes_sent"] == blocks["megatron"]["bytes_sent"]
    assert report["rows"]["tp"]["collectives_per_block"]["measured"]["ops"] == {"all_reduce": 4}
    sp = report["rows"]["tp+sp"]["collectives_per_block"]["measured"]["ops"]
    assert sp == {"all_gather": 4, "reduce_scatter": 4}
