"""The command line as a user meets it: the main job, verify, and errors that fit on one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.launcher import LaunchError, init_distributed, launch_local

from .cli_helpers import last_json, refusal, shardwise
from .verify_worlds import check_cases


@pytest.mark.slow
def test_train_two_ranks_learns_and_reports(tmp_path) -> None:
    result = shardwise(
        "train",
        "--nproc",
        "2",
        "--steps",
        "20",
        "--preset",
        "tiny",
        "--eval-every",
        "10",
        "--run-dir",
        str(tmp_path),
        "--json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result)
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["tokens_per_s"] > 0 and summary["peak_rss_mb"] > 0
    assert len(summary["peak_rss_mb_by_rank"]) == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    assert [r["step"] for r in rows if r["eval_loss"] is not None] == [9, 19]


@pytest.mark.slow
def test_verify_ddp_uneven_passes() -> None:
    """``shardwise verify --strategy ddp --nproc 2 --data-weights 0.3,0.7``, read by the CLI's parser and
    run in a launched world (the whole command runs in test_pipeline.py): within 1e-10 of one process."""
    check_cases({"ddp-uneven": ["--strategy", "ddp", "--nproc", "2", "--data-weights", "0.3,0.7"]}, 2, 1e-10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nproc", "4", "--set", "parallel.tp=3"],
            "pp(1) x tp(3) = 3 does not divide the world of 4 ranks",
        ),
        (["--steps", "many"], "steps expects int, got 'many'"),
        (["--nproc", "2", "--data-weights", "1,2,3"], "data.weights has 3 entries but there are 2"),
        (["--set", "model.preset=huge"], "unknown gpt preset 'huge'"),
    ],
)
def test_bad_config_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """Refused before any rank starts (``cli.main`` in this process): exit 2, one line."""
    argv = ["train", *args, "--steps" if "--steps" not in args else "--seed", "1"]
    line = refusal(argv, tmp_path / "run", capsys)
    assert message in line, line


def _rank_1_raises() -> None:
    init_distributed(timeout_s=60)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone


def test_a_failing_rank_stops_the_job_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)rank 1 failed.*ValueError: rank 1 cannot go on"):
        launch_local(_rank_1_raises, (), 2)
    assert time.monotonic() - start < 45  # seconds, not gloo's timeout
