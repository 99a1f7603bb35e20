"""Every piece of state survives a restart: the fp16 loss scale, and the asynchronous parameter server.

fp16: ZeRO-2 with a loss scale that grows every 2 clean steps (so it has moved by the checkpoint),
interrupted after step 3 and resumed, ends with the uninterrupted run's scale and parameters.

Asynchronous parameter server (2 servers, 2 workers): the checkpoint holds every server's parameters,
optimizer state and version; a resumed run starts from exactly those weights (each worker's copy and
each server's version are compared with the checkpoint before it trains), finishes, and writes each
step's metrics row once. Async is not bit-reproducible, so nothing else is compared.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.layout import list_steps
from shardwise.config import TrainConfig, load_config
from shardwise.testing import run_on_ranks


def _config(run_dir: Path, **extra: str) -> TrainConfig:
    return load_config(
        None,
        {
            "model.preset": "tiny",
            "data.global_batch": "4",
            "data.corpus_bytes": "100000",
            "eval_every": "0",
            "run_dir": str(run_dir),
            **extra,
        },
    )


def _cut(full: Path, cut: Path, keep_step: int) -> None:
    """What a crash after ``keep_step`` leaves: its checkpoint and the metrics rows so far (and more)."""
    shutil.copytree(full / "checkpoints", cut / "checkpoints")
    shutil.copy(full / "metrics.jsonl", cut / "metrics.jsonl")
    for step, path in list_steps(str(cut / "checkpoints")):
        if step > keep_step:
            shutil.rmtree(path)


# -- the fp16 loss scale -----------------------------------------------------------------------------
def _fp16_cases(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import shardwise.zero.base as zero_base
    from shardwise.engine.precision import LossScaler
    from shardwise.train.loop import run_training

    zero_base.LossScaler = functools.partial(LossScaler, growth_interval=2)  # type: ignore[misc]
    extra = {"strategy": "zero2", "precision": "fp16", "steps": "7", "checkpoint.every": "3"}
    full = run_training(_config(Path(root) / "full", **extra), show_progress=False)
    if rank == 0:
        _cut(Path(root) / "full", Path(root) / "cut", keep_step=3)
    dist.barrier()
    cut = run_training(_config(Path(root) / "cut", **extra), show_progress=False)
    return {"full": full, "cut": cut}


def test_fp16_loss_scale_is_saved_and_restored(tmp_path) -> None:
    from shardwise.checkpoint.reader import load

    results = run_on_ranks(_fp16_cases, 2, str(tmp_path), timeout_s=240)[0]
    full, cut = results["full"], results["cut"]
    assert cut["checkpoint"]["resumed_at_step"] == 3
    moved = (full["loss_scale"], full["scaler_skipped_steps"]) != (2.0**16, 0)
    assert moved, "the scale never moved: the test would prove nothing"
    assert cut["loss_scale"] == full["loss_scale"]
    assert cut["scaler_skipped_steps"] == full["scaler_skipped_steps"]
    assert cut["final_param_digest"] == full["final_param_digest"]
    step3 = list_steps(str(tmp_path / "full" / "checkpoints"))[0][1]
    saved = load(step3, {"precision/loss_scale": None})["precision/loss_scale"]
    assert saved.tolist() != [2.0**16, 0.0, 0.0]  # the scaler after 3 steps, not a fresh one


# -- the asynchronous parameter server ------------------------------------------------------------------
ASYNC = {
    "strategy": "ps",
    "ps.mode": "async",
    "ps.servers": "2",
    "steps": "6",
    "checkpoint.every": "3",
    "eval_every": "3",
}


def _async_cases(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardwise.train.loop import run_training

    full = run_training(_config(Path(root) / "full", **ASYNC), show_progress=False)
    if rank == 0:
        _cut(Path(root) / "full", Path(root) / "cut", keep_step=3)
    dist.barrier()
    start = _resumed_state(_config(Path(root) / "cut", **ASYNC))
    dist.barrier()
    cut = run_training(_config(Path(root) / "cut", **ASYNC), show_progress=False)
    return {"full": full, "cut": cut, "start": start}


def _resumed_state(config: TrainConfig) -> dict[str, Any]:
    """Resume as the loop does, then report what this rank starts from (no training)."""
    from shardwise.train.checkpointing import TrainCheckpoints
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(config)
    engine = trainer.engine
    ckpt = TrainCheckpoints.create(trainer, engine.comm.rank, engine.comm.world_size)
    assert ckpt is not None
    resumed = ckpt.resume()
    assert resumed is not None
    engine.resume_at(resumed.next_step)
    out = {
        "path": resumed.path,
        "version": engine.version,
        "server_versions": list(engine.server_versions),
        "params": {n: p.detach().clone() for n, p in engine.model.named_parameters()},
    }
    engine.close()
    return out


def test_async_parameter_server_checkpoints_and_resumes(tmp_path) -> None:
    from shardwise.checkpoint.reader import load, verify_checkpoint

    results = run_on_ranks(_async_cases, 4, str(tmp_path), timeout_s=300)
    full, cut = results[2]["full"], results[2]["cut"]  # rank 2: the first worker reports
    assert full["checkpoint"]["saves"] == 2 and cut["checkpoint"]["resumed_at_step"] == 3

    step3 = results[0]["start"]["path"]
    manifest = verify_checkpoint(step3)
    names = set(manifest.tensors)
    versions = load(step3, {"ps/version": None})["ps/version"].tolist()
    assert len(versions) == 2 and all(0 < v <= 2 * 3 for v in versions), versions  # 2 workers, 3 steps
    by_server = [set(), set()]
    for server, name in ((r, n) for r in (0, 1) for n in _served_names(manifest, r)):
        by_server[server].add(name)
        step = load(step3, {f"optim/step/{name}": None})[f"optim/step/{name}"]
        assert int(step) == versions[server], name  # one optimizer step per applied push
        assert f"optim/exp_avg/{name}" in names and f"optim/exp_avg_sq/{name}" in names
    assert by_server[0] and by_server[1] and not by_server[0] & by_server[1]

    saved = load(step3, {f"model/{n}": None for n in results[2]["start"]["params"]})
    for rank in (0, 1):  # each server resumed at its own saved version
        assert results[rank]["start"]["version"] == versions[rank]
    for rank in (2, 3):  # each worker starts from exactly the servers' saved weights and versions
        start = results[rank]["start"]
        assert start["server_versions"] == versions
        for name, value in start["params"].items():
            assert torch.equal(value, saved[f"model/{name}"]), name

    rows = [json.loads(x)["step"] for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(6))  # rows after step 3 replaced, not repeated
    assert cut["steps"] == 6 and cut["eval_losses"][0] == full["eval_losses"][0]


def _served_names(manifest: Any, server: int) -> list[str]:
    """Parameters whose model tensor server ``server`` wrote (its own shard file)."""
    return [
        name[len("model/") :]
        for name, record in manifest.tensors.items()
        if name.startswith("model/") and all(p.file == f"rank{server}.safetensors" for p in record.pieces)
    ]
