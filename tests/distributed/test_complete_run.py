"""A run whose checkpoint already holds the last step is complete, whatever the strategy.

Run twice with the same ``--checkpoint-dir``: the second run trains nothing, says the run is complete,
prints the summary with the same ``final_param_digest`` and exits 0 (the parameter server's servers
used to enter their serving loop and die in a gloo traceback).
"""

from __future__ import annotations

import pytest

from .cli_helpers import last_json, shardwise

CASES = [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2), ("ps", 3), ("ps-async", 3)]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "nproc"), CASES)
def test_second_run_of_a_complete_checkpoint_exits_0_with_the_same_digest(tmp_path, strategy, nproc) -> None:
    extra = ["--ps-mode", "async"] if strategy == "ps-async" else []
    args = [
        "train", "--strategy", strategy.removesuffix("-async"), "--nproc", str(nproc), "--preset", "tiny",
        "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--run-dir", str(tmp_path / "run"), "--json", *extra,
    ]  # fmt: skip
    first = shardwise(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    second = shardwise(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert "the checkpoint already holds the last step (4): the run is complete" in second.stderr
    before, after = last_json(first), last_json(second)
    assert after["final_param_digest"] == before["final_param_digest"]
    assert after["checkpoint"]["resumed_at_step"] == 4 and after["checkpoint"]["saves"] == 0
    assert after["steps"] == 4 and after["final_loss"] == before["final_loss"]
