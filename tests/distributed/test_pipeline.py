"""Pipeline parallelism end to end: ``shardwise verify --pp ...`` against one process, float64.

Every schedule at pp 2 (four micro-batches), pp 4, one micro-batch, fewer micro-batches than stages and
empty ones, pp x dp with DDP and ZeRO-1/2 on the dp axis, Hugging Face Llama and GPT-2; evaluation and
the reported loss under a pipeline equal one process's; refusals in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.pipeline.schedules import build

from .cli_helpers import last_json, shardwise

SHORT = ("--steps", "2")  # parity shows in two steps; the suite stays fast


def pp2(schedule: str, virtual: int = 1) -> list[str]:
    """The Must-show form: pp 2 on 2 ranks, four micro-batches."""
    args = ["--pp", "2", "--schedule", schedule, "--micro-batches", "4", "--nproc", "2"]
    return args + (["--virtual-stages", str(virtual)] if virtual > 1 else [])


CASES = {
    "pp2-gpipe": pp2("gpipe"),
    "pp2-1f1b": pp2("1f1b"),
    "pp2-zb": pp2("zb"),
    "pp2-interleaved": pp2("interleaved", 2),
    "pp2-interleaved-zb": pp2("interleaved-zb", 2),
    "pp2-zbv": pp2("zbv", 2),
    "pp2-dualpipev": pp2("dualpipev", 2),
    "pp4-1f1b-m2": ["--pp", "4", "--schedule", "1f1b", "--micro-batches", "2", "--nproc", "4"],
    "pp2-m1": ["--pp", "2", "--micro-batches", "1", "--nproc", "2"],
    "dp2-pp2-ddp": ["--pp", "2", "--nproc", "4", "--strategy", "ddp", "--micro-batches", "4"],
    "dp2-pp2-zero1": ["--pp", "2", "--nproc", "4", "--strategy", "zero1", "--micro-batches", "4"],
    # dp shares of 3 rows cut into 5 micro-batches: two are empty on every rank
    "dp2-pp2-zero2-empty": [
        "--pp", "2", "--schedule", "interleaved-zb", "--virtual-stages", "2", "--micro-batches", "5",
        "--global-batch", "6", "--nproc", "4", "--strategy", "zero2",
    ],
    "pp2-llama": [*pp2("1f1b"), "--model", "hf:tiny-llama"],
    "pp2-gpt2-zb": [*pp2("zb"), "--model", "hf:tiny-gpt2"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("args", list(CASES.values()), ids=list(CASES))
def test_verify_pipeline_equals_one_process(args: list[str]) -> None:
    result = shardwise("verify", *args, *SHORT, "--json", timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result)
    assert report["ok"] is True, report
    assert report["max_param_diff"] <= 1e-10
    assert report["max_grad_diff"] <= 1e-10 and report["max_loss_diff"] <= 1e-10


@pytest.mark.slow
def test_train_pipeline_reports_the_loss_and_evaluates_as_one_process(tmp_path: Path) -> None:
    common = ["--preset", "tiny", "--steps", "3", "--eval-every", "2", "--json"]
    piped = shardwise("train", "--pp", "2", "--nproc", "2", "--run-dir", str(tmp_path / "pp"), *common)
    plain = shardwise("train", "--nproc", "1", "--run-dir", str(tmp_path / "one"), *common)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, b = last_json(piped), last_json(plain)
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-5)
    assert a["initial_loss"] == pytest.approx(b["initial_loss"], rel=1e-5)
    # the evaluation after an update: the last stage's copy of the tied head is refreshed first
    assert [loss for _, loss in a["eval_losses"]] == pytest.approx(
        [loss for _, loss in b["eval_losses"]], rel=1e-5
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "ps", "--servers", "1", "--nproc", "3"], "--strategy ps does not run with pipeline"),
        (["--schedule", "interleaved"], "interleaved interleaves chunks: --virtual-stages must be >= 2"),
        (["--schedule", "zbv", "--virtual-stages", "3"], "zbv holds two stages per rank in a V"),
        (
            ["--pp", "4", "--nproc", "4", "--preset", "tiny"],
            "has 2 blocks, fewer than pp(4) x virtual_stages(1)",
        ),
        (["--precision", "fp16"], "precision = fp16 (each stage would decide an overflow alone)"),
        (["--strategy", "zero3"], "--strategy zero3 does not run with pipeline parallelism"),
    ],
)
def test_pipeline_refusals_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    argv = ["train", "--pp", "2", "--nproc", "2", "--steps", "1", "--run-dir", str(tmp_path), *args]
    result = shardwise(*argv, timeout_s=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("save", "load"),
    [
        (["--pp", "2", "--nproc", "4", "--strategy", "zero1"], ["--nproc", "1"]),
        (["--nproc", "1"], ["--pp", "2", "--nproc", "4", "--strategy", "ddp"]),
    ],
    ids=["pp2-dp2-zero1-to-one", "one-to-pp2-dp2-ddp"],
)
def test_a_pipeline_checkpoint_loads_in_any_layout(tmp_path: Path, save: list[str], load: list[str]) -> None:
    """Each stage writes its own parameters under the model's names (the tied weight once): the
    other layout resumes from them and ends where one process that never stopped ends."""
    common = ["--preset", "tiny", "--dtype", "float64", "--eval-every", "0", "--json"]
    ckpt = ["--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = shardwise("train", *save, "--steps", "2", *ckpt, "--run-dir", str(tmp_path / "a"), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = shardwise("train", *load, "--steps", "4", *ckpt, "--run-dir", str(tmp_path / "b"), *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 2" in resumed.stderr
    plain = shardwise("train", "--nproc", "1", "--steps", "4", "--run-dir", str(tmp_path / "c"), *common)
    a, b = last_json(resumed), last_json(plain)
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-12, abs=0)
    assert a["final_grad_norm"] == pytest.approx(b["final_grad_norm"], rel=1e-10, abs=0)


@pytest.mark.slow
def test_trace_records_every_action_of_every_rank(tmp_path: Path) -> None:
    args = ["--pp", "2", "--nproc", "2", "--steps", "2", "--preset", "tiny", "--micro-batches", "4"]
    result = shardwise("train", *args, "--schedule", "zb", "--trace", "--run-dir", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    actions = [(e["pid"], e["name"]) for e in events if "kind" in e.get("args", {})]  # one span per action
    schedule = build("zb", 2, 1, 4)
    expected = [(rank, str(a)) for rank in (0, 1) for a in schedule[rank]] * 2  # two steps
    assert sorted(actions) == sorted(expected)
