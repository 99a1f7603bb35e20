"""``shardwise plan --dry-run``: one rank of a 64- to 1,024-device layout run here on the meta device.

The real ``parallelize`` and a training step run in one process that joins torch's fake process group
as one rank of the target world; what that rank holds (by storage, on meta) is compared with the
planner's model state for the same layout. The ZeRO paper's 7.5B row on 64 devices (Rajbhandari et
al., figure 1: 120 / 31.4 / 16.6 / 1.9 GB for DP / ZeRO-1 / 2 / 3) and a 70B Llama on 512 devices at
dp 8 x pp 8 x tp 8 (tests/fixtures/llama-3-70b): the rank's held bytes within 0.97-1.03 of the plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_helpers import last_json, shardwise

PAPER = ("--layers", "36", "--hidden", "4096", "--heads", "32", "--vocab", "50257")
WORKLOAD = ("--global-batch", "64", "--precision", "bf16", "--optimizer", "adam")
LLAMA_70B = Path(__file__).resolve().parents[1] / "fixtures" / "llama-3-70b" / "config.json"


def _dry_run(*args: str) -> dict:
    result = shardwise("plan", "--dry-run", *args, *WORKLOAD, "--json", timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return last_json(result)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,paper_gb", [("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_the_zero_papers_7_5b_row_on_64_devices(strategy: str, paper_gb: float) -> None:
    got = _dry_run("--devices", "64", *PAPER, "--strategies", strategy, "--pp", "1", "--tp", "1")
    assert got["layout"] == f"{strategy} dp64 mb1" and got["rank"] == 0
    assert 0.97 <= got["ratio"] <= 1.03, got
    held = got["held_model_state_bytes"] / 1e9
    assert abs(held - paper_gb) <= 0.03 * paper_gb, got  # the paper's bf16 gradients vs our fp32 shards


@pytest.mark.slow
def test_a_70b_llama_on_512_devices_at_dp_pp_tp() -> None:
    got = _dry_run(
        "--devices", "512", "--model", f"hf:{LLAMA_70B}", "--strategies", "zero1", "--pp", "8", "--tp", "8"
    )  # fmt: skip
    assert got["layout"] == "zero1 dp8-pp8-tp8 mb8"
    # stage 5 of [9, 10, 10, 10, 10, 11, 11, 9] blocks (the head's matrix counted as work on the last,
    # an eleventh block kept off the embedding's stage): the heaviest, tp 0, dp 0
    assert got["rank"] == 40
    assert 0.97 <= got["ratio"] <= 1.03, got
    for part in ("params", "master_params", "grads", "optimizer_state"):
        assert 0.97 <= got["held_bytes"][part] / got["planner_model_state"][part] <= 1.03, part
