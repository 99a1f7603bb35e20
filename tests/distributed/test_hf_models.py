"""Hugging Face causal LMs and a user's factory in every strategy, against one process (float64, 1e-10),
through the path ``shardwise verify`` takes, and from the command line as a user types it (read by the
CLI's parser, run in a launched world: ``verify_worlds``); a bad model is one line before any rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.commands.verify import collect_run, compare_runs, reference_run, verify_defaults
from shardwise.config import TrainConfig, load_config
from shardwise.models.hf import SHIPPED_DIR
from shardwise.testing import run_on_ranks

from .cli_helpers import last_json, refusal, shardwise
from .verify_worlds import check_cases

pytest.importorskip("transformers")

TOL = 1e-10
GPT2 = f"hf:{SHIPPED_DIR / 'tiny-gpt2.json'}"  # a config file by path
LLAMA = "hf:tiny-llama"  # a shipped config by name (grouped-query attention)


def _config(kind: str, **overrides: str) -> TrainConfig:
    # 3 steps of a 6-sequence batch keep the time down; seq_len 32 fits the configs' 128 positions
    small = {"steps": "3", "data.global_batch": "6", "model.seq_len": "32"}
    defaults = {**verify_defaults(kind), "run_dir": "runs/verify", "model.kind": kind}
    return load_config(None, {**defaults, **small, **overrides})


def _many(rank: int, world_size: int, configs: list[TrainConfig]) -> list:
    return [collect_run(config.validate(world_size)) for config in configs]


def _check(configs: list[TrainConfig], results: list, world: int) -> None:
    for config, candidate in zip(configs, results, strict=True):
        report = compare_runs(reference_run(config.validate(world)), candidate, TOL)
        assert report["ok"], (config.model.kind, config.strategy, report)


@pytest.mark.slow
def test_hf_models_match_one_process_in_ddp_and_zero() -> None:
    configs = [
        _config(kind, strategy=strategy, **({"data.weights": "0.3,0.7"} if strategy == "zero2" else {}))
        for kind in (GPT2, LLAMA)
        for strategy in ("ddp", "zero1", "zero2", "zero3")
    ]
    _check(configs, run_on_ranks(_many, 2, configs, timeout_s=240)[0], 2)


@pytest.mark.slow
def test_hf_models_match_one_process_on_the_parameter_server() -> None:
    configs = [_config(kind, strategy="ps") for kind in (GPT2, LLAMA)]
    results = run_on_ranks(_many, 3, configs, timeout_s=240)
    _check(configs, next(r for r in results if r is not None and r[0] is not None), 3)


@pytest.mark.slow
def test_a_users_factory_matches_one_process_in_zero3() -> None:
    """The factory takes the ModelConfig; its blocks (a Sequential) become the ZeRO-3 units."""
    configs = [_config("tests.unit.model_factories:sized_lm", strategy="zero3")]
    _check(configs, run_on_ranks(_many, 2, configs, timeout_s=120)[0], 2)


VERIFY_CASES = {
    # a Hugging Face config by path, as a user types it
    "hf-gpt2-path-zero3": ["--model", GPT2, "--strategy", "zero3", "--nproc", "2"],
    # verify's default frozen ``wpe`` is the built-in GPT's: the MLP has none and must still verify
    "mlp-zero2": ["--model", "mlp", "--strategy", "zero2", "--nproc", "2"],
}


@pytest.mark.slow
def test_verify_command_lines_of_an_hf_config_and_the_mlp() -> None:
    """``shardwise verify <case>`` read by the CLI's parser with verify's defaults for the model (5
    steps), both cases in one world of 2 ranks: every measure within 1e-10 of one process."""
    check_cases(VERIFY_CASES, 2, TOL)


@pytest.mark.slow
def test_train_tiny_llama_with_zero3_learns(tmp_path) -> None:
    result = shardwise(
        "train", "--model", "hf:tiny-llama", "--strategy", "zero3", "--nproc", "2", "--steps", "20",
        "--run-dir", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result)
    assert summary["final_loss"] < summary["initial_loss"] - 1.0, summary


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("hf:no/such/config.json", "no/such/config.json does not exist"),
        ("no_such_pkg.models:make", "cannot import no_such_pkg.models"),
        ("tests.unit.model_factories:not_a_model", "returned a dict, not a torch.nn.Module"),
    ],
)
def test_a_bad_model_is_one_line_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, message: str
) -> None:
    line = refusal(["train", "--model", model, "--nproc", "2", "--steps", "1"], tmp_path / "run", capsys)
    assert message in line, line
