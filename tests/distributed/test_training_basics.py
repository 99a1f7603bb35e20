"""Clipping by the global norm and learning-rate schedules, for every strategy, against one process
that uses torch's own ``clip_grad_norm_`` and ``torch.optim.lr_scheduler``."""

from __future__ import annotations

import math

import pytest

from shardwise.commands.verify import VERIFY_DEFAULTS, collect_run, compare_runs, reference_run
from shardwise.config import ConfigError, TrainConfig, load_config
from shardwise.engine.schedule import lr_multiplier
from shardwise.testing import run_on_ranks

TOL = 1e-10


def _config(**overrides: str) -> TrainConfig:
    return load_config(None, {**VERIFY_DEFAULTS, "steps": "6", **overrides})


def _worker(rank: int, world_size: int, configs: list[TrainConfig]):
    return [collect_run(config.validate(world_size)) for config in configs]


SCHEDULES = [
    {
        "optim.clip_grad_norm": "1.5",
        "optim.lr_schedule": "cosine",
        "optim.warmup_steps": "2",
        "optim.lr": "0.02",
    },
    {
        "optim.clip_grad_norm": "inf",
        "optim.lr_schedule": "linear",
        "optim.min_lr": "0.001",
        "optim.lr": "0.01",
    },
    {"optim.clip_grad_norm": "0.05", "optim.name": "sgd", "optim.lr": "0.5"},
]


@pytest.mark.parametrize(
    ("strategy", "world", "extra"),
    [
        ("ddp", 2, {"data.weights": "0.3,0.7"}),
        ("zero1", 2, {}),
        ("zero2", 2, {"data.micro_batches": "2"}),
        ("zero3", 2, {"data.weights": "0.6,0.4"}),
        ("ps", 4, {"ps.servers": "2"}),
    ],
)
def test_clipping_and_schedules_match_one_process(strategy: str, world: int, extra: dict) -> None:
    configs = [_config(strategy=strategy, **extra, **schedule) for schedule in SCHEDULES]
    results = next(r for r in run_on_ranks(_worker, world, configs, timeout_s=240) if r[0] is not None)
    for config, candidate in zip(configs, results, strict=True):
        report = compare_runs(reference_run(config.validate(world)), candidate, TOL)
        assert report["ok"], (strategy, config.optim, report)
        clip = config.optim.clip_grad_norm
        if 0 < clip < math.inf:  # clipping engaged: some norm above the bound
            assert max(report["grad_norm"]) > clip
        expected = [config.optim.lr * lr_multiplier(config.optim, config.steps)(s) for s in range(6)]
        assert report["lr"] == pytest.approx(expected, rel=1e-12)


def test_schedule_shapes() -> None:
    optim = _config(**SCHEDULES[0]).optim
    multiplier = lr_multiplier(optim, 6)
    assert [multiplier(s) for s in (0, 1)] == [1 / 3, 2 / 3]  # warm-up, never zero
    assert multiplier(2) == 1.0 and multiplier(5) == pytest.approx(0.0)  # cosine down to min_lr = 0
    linear = _config(**SCHEDULES[1]).optim
    assert lr_multiplier(linear, 6)(5) * linear.lr == pytest.approx(linear.min_lr)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("optim.clip_grad_norm", "-1", "optim.clip_grad_norm must be a finite number >= 0"),
        ("optim.clip_grad_norm", "nan", "optim.clip_grad_norm must be a finite number >= 0"),
        ("optim.warmup_steps", "6", "optim.warmup_steps must be in [0, steps(6))"),
        ("optim.lr_schedule", "step", "optim.lr_schedule must be one of constant, linear, cosine"),
    ],
)
def test_bad_schedule_settings_are_one_line(key: str, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _config(**{key: value}).validate(2)


# -- synchronous BatchNorm: the global batch's statistics, running statistics included --------------------
BN = {"model.kind": "mlp", "model.preset": "small_bn", "model.freeze": "", "sync_batchnorm": "true"}


@pytest.mark.parametrize(
    ("strategy", "world", "extra"),
    [
        ("ddp", 3, {"data.weights": "1,0,1"}),  # a rank with an empty share still takes part
        ("ddp", 2, {"data.weights": "0.3,0.7"}),
        ("zero2", 2, {}),
        ("ps", 3, {}),
    ],
)
def test_sync_batchnorm_matches_one_process(strategy: str, world: int, extra: dict) -> None:
    config = _config(strategy=strategy, **BN, **extra)
    results = run_on_ranks(_worker, world, [config], timeout_s=180)
    candidate = next(r[0] for r in results if r[0] is not None)
    report = compare_runs(reference_run(config.validate(world)), candidate, TOL)
    assert report["ok"], report
    assert "blocks.0.norm.running_var" in candidate["buffers"]


def test_plain_batchnorm_differs_from_one_process_and_says_so() -> None:
    config = _config(strategy="ddp", **{**BN, "sync_batchnorm": "false", "data.weights": "0.3,0.7"})
    results = run_on_ranks(_worker, 2, [config], timeout_s=180)
    report = compare_runs(reference_run(config.validate(2)), results[0][0], TOL)
    assert not report["ok"] and report["max_param_diff"] > 1e-6


# -- mixed precision for every strategy ------------------------------------------------------------------
def _summary(rank: int, world_size: int, config: TrainConfig) -> dict | None:
    from shardwise.train.loop import Trainer

    return Trainer.build(config).fit(show_progress=False)


@pytest.mark.parametrize(
    ("strategy", "world", "precision"),
    [("ddp", 2, "bf16"), ("ddp", 2, "fp16"), ("zero2", 2, "bf16"), ("ps", 3, "bf16")],
)
def test_mixed_precision_trains_close_to_fp32(tmp_path, strategy: str, world: int, precision: str) -> None:
    losses = {}
    for name in ("fp32", precision):
        # at lr 1e-3: at the default 3e-3 the tiny GPT's last losses are chaotic for some seeds (from the
        # initial values drawn on the chunk grid, seed 0's fp32 and bf16 runs part at step 14: 3.72 vs
        # 3.45), which says nothing about precision; seeds 1-3 stay within 0.6% there too
        overrides = {
            "strategy": strategy, "precision": name, "model.preset": "tiny", "steps": "25", "optim.lr": "1e-3"
        }  # fmt: skip
        config = load_config(None, {**overrides, "eval_every": "0", "run_dir": str(tmp_path / name)})
        summary = next(s for s in run_on_ranks(_summary, world, config, timeout_s=240) if s)
        losses[name] = summary["final_loss"]
        assert summary["compute_dtype"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[name]
    assert losses[precision] == pytest.approx(losses["fp32"], rel=0.02)


def test_precision_settings_that_cannot_apply_are_refused() -> None:
    with pytest.raises(ConfigError, match="fp16 with the parameter server is not built yet"):
        load_config(None, {"strategy": "ps", "precision": "fp16"}).validate(3)
    with pytest.raises(ConfigError, match="disagree"):
        load_config(None, {"precision": "bf16", "zero.precision": "fp16", "strategy": "zero1"}).validate(2)
    old = load_config(None, {"zero.precision": "bf16", "strategy": "ddp"}).validate(2)
    assert old.compute_precision == "bf16"  # the old key is still read, for every strategy


@pytest.mark.slow
def test_a_checkpoint_mid_schedule_resumes_with_the_same_learning_rate(tmp_path) -> None:
    import json
    import shutil

    from .cli_helpers import last_json, shardwise

    args = ["train", "--nproc", "2", "--preset", "tiny", "--steps", "8", "--lr-schedule", "cosine"]
    args += ["--warmup-steps", "2", "--clip-grad-norm", "1.0", "--eval-every", "0", "--json"]
    args += ["--run-dir", str(tmp_path / "run"), "--checkpoint-every", "5"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt")]

    def lrs() -> list[float]:
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(row)["lr"] for row in rows]

    whole = shardwise(*args)  # uninterrupted: the reference (saving checkpoints changes no number)
    assert whole.returncode == 0, whole.stderr
    whole_lrs = lrs()
    shutil.rmtree(tmp_path / "ckpt" / "step-00000008")  # as if the run had died after step 5
    resumed = shardwise(*args)
    assert resumed.returncode == 0 and "resuming at step 5" in resumed.stderr, resumed.stderr
    assert last_json(resumed)["final_param_digest"] == last_json(whole)["final_param_digest"]
    assert lrs() == whole_lrs and len(whole_lrs) == 8
