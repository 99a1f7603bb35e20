"""The train command's text summary: the pipeline's stages in a line, none without a pipeline."""

from __future__ import annotations

from typing import Any

import pytest

from shardwise.commands.train import render_summary, stage_blocks


def test_each_stage_is_its_first_and_last_block_and_its_rank() -> None:
    assert stage_blocks([[0, 1, 2], [3, 4]], [0, 1]) == "blocks 0-2 on pp rank 0 | 3-4 on 1"
    # a V schedule: the last stage back on rank 0
    v_line = "blocks 0 on pp rank 0 | 1 on 1 | 2-3 on 1 | 4 on 0"
    assert stage_blocks([[0], [1], [2, 3], [4]], [0, 1, 1, 0]) == v_line


def _summary(**extra: Any) -> dict[str, Any]:
    return {
        "strategy": "ddp", "world_size": 2, "training_ranks": 2, "layout": "dp1 x pp2 x tp1", "steps": 3,
        "initial_loss": 5.0, "final_loss": 4.0, "tokens_per_s": 1000.0, "peak_rss_mb_by_rank": [300, 300],
        "samples_per_step_by_rank": [16, 16], "step_s_median_by_rank": [0.1, 0.1],
        "bytes_sent_per_step_by_rank": [2**20, 2**20], "run_dir": "/tmp/r", **extra,
    }  # fmt: skip


def test_the_line_is_there_with_a_pipeline_and_not_without(capsys: pytest.CaptureFixture[str]) -> None:
    render_summary(_summary(pipeline_stages=[[0, 1, 2], [3, 4]], pipeline_placement=[0, 1]))
    assert "pipeline stages: blocks 0-2 on pp rank 0 | 3-4 on 1" in capsys.readouterr().out
    render_summary(_summary())
    assert "pipeline stages" not in capsys.readouterr().out
