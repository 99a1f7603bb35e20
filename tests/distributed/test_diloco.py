"""DiLoCo / local SGD: equal to DDP at H = 1 (outer SGD lr 1, no momentum), silent between
synchronisations, and resumed exactly from a checkpoint (outer momentum and per-rank inner state)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardwise.checkpoint.layout import list_steps
from shardwise.checkpoint.reader import verify_checkpoint
from shardwise.commands.verify import VERIFY_DEFAULTS, collect_run
from shardwise.config import ConfigError, TrainConfig, load_config
from shardwise.testing import run_on_ranks
from shardwise.testing.parity import compare_tensors
from shardwise.train.loop import Trainer, run_training


def _config(strategy: str, **extra: str) -> TrainConfig:
    return load_config(None, {**VERIFY_DEFAULTS, "strategy": strategy, **extra})


LOCAL_SGD = {
    "optim.name": "sgd",
    "optim.lr": "0.05",
    "optim.weight_decay": "0.01",  # momentum 0.9 (the sgd default): linear too
    "diloco.sync_every": "1",
    "diloco.outer_lr": "1",
    "diloco.outer_momentum": "0",
}


def _pair(rank: int, world_size: int, extra: dict[str, str]) -> Any:
    settings = {**LOCAL_SGD, **extra}
    shared = {k: v for k, v in settings.items() if not k.startswith("diloco.")}  # ddp refuses diloco's
    ddp = collect_run(_config("ddp", **shared).validate(world_size))
    diloco = collect_run(_config("diloco", **settings).validate(world_size))
    return ddp, diloco


@pytest.mark.parametrize(
    ("world", "extra"),
    [(2, {"data.weights": "0.3,0.7"}), (3, {"data.weights": "1,0,2", "data.micro_batches": "2"})],
    ids=["2-uneven", "3-one-empty-micro"],
)
def test_h1_with_plain_outer_sgd_is_ddp(world: int, extra: dict[str, str]) -> None:
    ddp, diloco = run_on_ranks(_pair, world, extra, timeout_s=300)[0]
    assert max(abs(a - b) for a, b in zip(ddp["losses"], diloco["losses"], strict=True)) < 1e-10
    params = compare_tensors(ddp["params"], diloco["params"])
    assert params.max_diff < 1e-10, params
    grads = compare_tensors(ddp["grads"], diloco["grads"])
    assert grads.max_diff < 1e-10, grads


def test_steps_up_to_start_local_step_are_plain_averaging() -> None:
    """Before ``start_local_step`` every step synchronises by averaging: DDP, whatever H and the outer
    optimizer say (here the paper's Nesterov 0.7 / 0.9, which would otherwise change the result)."""
    steps = VERIFY_DEFAULTS["steps"]
    paper = {"diloco.sync_every": "4", "diloco.outer_lr": "0.7", "diloco.outer_momentum": "0.9"}
    extra = {**paper, "diloco.start_local_step": steps, "data.weights": "0.3,0.7"}
    ddp, diloco = run_on_ranks(_pair, 2, extra, timeout_s=300)[0]
    params = compare_tensors(ddp["params"], diloco["params"])
    assert params.max_diff < 1e-10, params
    assert max(abs(a - b) for a, b in zip(ddp["losses"], diloco["losses"], strict=True)) < 1e-10


def _silent(rank: int, world_size: int, compress: str, start_local: int = 0) -> list[dict[str, float]]:
    config = load_config(
        None,
        {
            "strategy": "diloco",
            "steps": "9",
            "diloco.sync_every": "4",
            "model.preset": "tiny",
            "model.seq_len": "32",
            "data.global_batch": "8",
            "data.corpus_bytes": "200000",
            "eval_every": "0",
            "run_dir": "runs/test-diloco",
            "comm.compress": compress,
            "diloco.start_local_step": str(start_local),
        },
    ).validate(world_size)
    trainer = Trainer.build(config)
    try:
        records = [trainer.step(step) for step in range(config.steps)]
    finally:
        trainer.engine.close()
    return [{"loss": r.loss, "bytes": r.bytes_sent[rank]} for r in records]


@pytest.mark.parametrize(("compress", "start_local"), [("", 0), ("topk:0.05", 0), ("", 2)])
def test_nothing_is_sent_between_synchronisations(compress: str, start_local: int) -> None:
    rows = run_on_ranks(_silent, 2, compress, start_local, timeout_s=300)[0]
    # every step's bookkeeping over the ranks that step is a few bytes (whether every value is
    # finite: 16); a synchronisation sends the model (tens of kB): count only those
    assert all(row["bytes"] <= 64 or row["bytes"] > 10_000 for row in rows), rows
    synced = [i for i, row in enumerate(rows) if row["bytes"] > 10_000]
    # every step up to start_local_step, then every 4 steps, and after the last
    assert synced == [i for i in range(start_local)] + [3, 7, 8]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5


def _resume_run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    base = Path(root)

    def config(run_dir: Path) -> TrainConfig:
        return load_config(
            None,
            {
                "strategy": "diloco",
                "steps": "8",
                "diloco.sync_every": "2",
                "dtype": "float64",
                "model.preset": "odd",
                "model.dropout": "0.1",
                "data.global_batch": "6",
                "data.weights": "1,2",
                "data.corpus_bytes": "200000",
                "eval_every": "4",
                "checkpoint.every": "2",
                "run_dir": str(run_dir),
            },
        )

    out: dict[str, Any] = {}
    full = run_training(config(base / "full"), show_progress=False)
    if rank == 0:
        out["full"] = full
        shutil.copytree(base / "full" / "checkpoints", base / "cut" / "checkpoints")
        steps = list_steps(str(base / "cut" / "checkpoints"))
        out["names"] = sorted(verify_checkpoint(steps[-1][1]).tensors)
        for _, path in steps[-2:]:  # a crash after step 7: resume from step 4
            shutil.rmtree(path)
    dist.barrier()
    cut = run_training(config(base / "cut"), show_progress=False)
    if rank == 0:
        out["cut"] = cut
    return out


def test_resume_ends_with_the_uninterrupted_parameters(tmp_path: Path) -> None:
    out = run_on_ranks(_resume_run, 2, str(tmp_path), timeout_s=300)[0]
    full, cut = out["full"], out["cut"]
    assert cut["checkpoint"]["resumed_at_step"] == 4
    assert cut["final_param_digest"] == full["final_param_digest"]
    assert cut["eval_losses"] == full["eval_losses"]
    names = out["names"]
    assert any(n.startswith("outer/momentum_buffer/") for n in names)
    assert any(n.startswith("optim/exp_avg/") for n in names)  # rank 0's inner state
    assert any(n.startswith("inner/rank1/exp_avg/") for n in names)  # rank 1's own


def test_checkpoints_must_fall_on_synchronisations() -> None:
    config = _config("diloco", **{"diloco.sync_every": "4", "checkpoint.every": "6"})
    with pytest.raises(ConfigError, match=r"multiple of diloco.sync_every\(4\)"):
        config.validate(2)
    replace(config, checkpoint=replace(config.checkpoint, every=8)).validate(2)
