"""Hybrid sharding (``--dp-replicate R``, HSDP): ZeRO within groups of dp / R ranks, R replicas.

Parity with one process through ``shardwise verify`` (float64, 5 steps: losses, gradients, the norm,
final parameters) for ZeRO-3 with 2 replicas of 2 and ZeRO-2 with tensor parallelism on 8 ranks; a
checkpoint written by the first replica holds the whole model (one plain process loads the run's final
parameters, digest equal); a setting that cannot work is one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.config import load_config
from shardwise.engine.full_state import load_checkpoint
from shardwise.engine.optim import build_optimizer, named
from shardwise.models import build_model
from shardwise.train.loop import param_digest

from .cli_helpers import last_json, shardwise

pytestmark = pytest.mark.slow

CASES = {
    "zero3-2x2": ["--strategy", "zero3", "--dp-replicate", "2", "--nproc", "4"],
    "zero2-2x2-tp2": ["--strategy", "zero2", "--dp-replicate", "2", "--tp", "2", "--nproc", "8"],
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_verify_hybrid_sharding(case: str) -> None:
    result = shardwise("verify", *CASES[case], "--steps", "2", "--json", timeout_s=480)
    summary = last_json(result)
    assert result.returncode == 0 and summary["ok"], result.stderr[-3000:]
    assert summary["max_param_diff"] <= 1e-10
    assert "hybrid sharding: " in summary["layout"] and "over 2 ranks x 2 replicas" in summary["layout"]


def test_hybrid_checkpoint_loads_in_one_process(tmp_path: Path) -> None:
    args = ["train", "--strategy", "zero3", "--dp-replicate", "2", "--nproc", "4", "--steps", "3"]
    args += ["--dtype", "float64", "--preset", "tiny", "--eval-every", "0", "--checkpoint-every", "3"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"), "--json"]
    result = shardwise(*args, timeout_s=480)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result)
    assert summary["layout"] == "dp4 x pp1 x tp1, hybrid sharding: zero3 over 2 ranks x 2 replicas"
    config = load_config(None, {"model.preset": "tiny", "dtype": "float64"})
    model = build_model(config.model, torch.float64)
    optimizer = build_optimizer(named(model), config.optim)
    assert load_checkpoint(str(tmp_path / "ckpt"), model, optimizer) == 3
    assert param_digest(dict(model.named_parameters())) == summary["final_param_digest"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--strategy", "ddp", "--dp-replicate", "2"], "does not shard: use zero1, zero2 or zero3"),
        (["--strategy", "zero3", "--dp-replicate", "3"], "parallel.dp_replicate = 3 does not divide dp"),
    ],
)
def test_hybrid_refusals_are_one_line(args: list[str], words: str) -> None:
    result = shardwise("train", "--nproc", "4", "--steps", "2", *args, timeout_s=240)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
