"""Hybrid sharding (``--dp-replicate R``, HSDP): ZeRO within groups of dp / R ranks, R replicas.

Parity with one process through ``shardwise verify``'s path (float64, 2 steps: losses, gradients, the
norm, final parameters; each command line read by the CLI's parser and run in a launched world, see
``verify_worlds``) for ZeRO-3 with 2 replicas of 2 and ZeRO-2 with tensor parallelism on 8 ranks; a
checkpoint written by the first replica holds the whole model (one plain process loads the run's final
parameters, digest equal); a setting that cannot work is one line before any rank starts.
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

from .cli_helpers import last_json, refusal, shardwise
from .verify_worlds import check_cases, world_sizes

pytestmark = pytest.mark.slow

CASES = {
    "zero3-2x2": ["--strategy", "zero3", "--dp-replicate", "2", "--nproc", "4"],
    "zero2-2x2-tp2": ["--strategy", "zero2", "--dp-replicate", "2", "--tp", "2", "--nproc", "8"],
}


WORLDS = world_sizes(CASES)


@pytest.mark.parametrize("world", WORLDS, ids=[f"{n}-ranks" for n in WORLDS])
def test_verify_hybrid_sharding(world: int) -> None:
    """``shardwise verify <case> --steps 2``'s path (one world per size: 4 and 8 ranks): every measure
    within 1e-10 of one process, and the layout verify reports names the shard groups and replicas."""
    cases = {name: [*args, "--steps", "2"] for name, args in CASES.items()}
    for name, report in check_cases(cases, world, 1e-10).items():
        assert "hybrid sharding: " in report["layout"], (name, report["layout"])
        assert "over 2 ranks x 2 replicas" in report["layout"], (name, report["layout"])


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
def test_hybrid_refusals_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    """Refused before any rank starts (``cli.main`` in this process)."""
    argv = ["train", "--nproc", "4", "--steps", "2", *args]
    line = refusal(argv, tmp_path / "run", capsys)
    assert words in line, line
