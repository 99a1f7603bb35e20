"""Resume is exact: interrupted at step k and resumed == uninterrupted, bit for bit, dropout included.

Each worker trains several runs in one 2-rank spawn (each spawn costs seconds): an uninterrupted run
saving every 3 steps, then "interrupted" runs made by deleting the newest checkpoints (what a crash
leaves behind) or damaging them (one flipped byte, a truncated shard) before training again.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.layout import list_steps
from shardwise.config import TrainConfig, load_config
from shardwise.testing import run_on_ranks
from shardwise.train.loop import run_training

STEPS = 8


def _config(run_dir: Path, dtype: str, **extra: str) -> TrainConfig:
    return load_config(
        None,
        {
            "dtype": dtype,
            "steps": str(STEPS),
            "model.preset": "odd",
            "model.dropout": "0.2",
            "data.global_batch": "6",
            "data.corpus_bytes": "200000",
            "eval_every": "4",
            "checkpoint.every": "3",
            "run_dir": str(run_dir),
            **extra,
        },
    )


def _run(config: TrainConfig) -> dict | None:
    return run_training(config, show_progress=False)


def _rank0_shard(step_dir: str) -> Path:
    return Path(step_dir) / "rank0.safetensors"


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    middle = 8 + header + (len(data) - 8 - header) // 2
    data[middle] ^= 0x01
    path.write_bytes(bytes(data))


def _resume_cases(rank: int, world_size: int, root: str, dtype: str, async_save: str) -> dict:
    """Rank 0 damages files between runs; every rank trains (they wait for each other in collectives)."""
    import torch.distributed as dist

    base = Path(root) / dtype
    out: dict = {}

    def _run(config: TrainConfig) -> dict | None:
        ckpt = replace(config.checkpoint, async_save=async_save == "true")
        return run_training(replace(config, checkpoint=ckpt), show_progress=False)

    full = _run(_config(base / "full", dtype))
    if rank == 0:
        out["full"] = full
        shutil.copytree(base / "full" / "checkpoints", base / "cut" / "checkpoints")
        shutil.copy(base / "full" / "metrics.jsonl", base / "cut" / "metrics.jsonl")
        steps = list_steps(str(base / "cut" / "checkpoints"))
        shutil.rmtree(steps[-1][1])  # keep step 3 and 6: a crash after step 7 loses step 8
        shutil.rmtree(steps[-2][1])  # and step 6: resume from step 3
    dist.barrier()
    cut = _run(_config(base / "cut", dtype))
    if rank == 0:
        out["cut"] = cut
        out["cut_metrics_steps"] = [
            json.loads(x)["step"] for x in (base / "cut" / "metrics.jsonl").read_text().splitlines()
        ]
        newest = list_steps(str(base / "full" / "checkpoints"))[-1][1]
        _flip_middle_byte(_rank0_shard(newest))
    dist.barrier()
    out_flip = _run(_config(base / "full", dtype))
    if rank == 0:
        out["flip"] = out_flip
        newest = list_steps(str(base / "full" / "checkpoints"))[-1][1]  # step 8 again, rewritten
        shard = Path(newest) / "rank1.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
    dist.barrier()
    out_trunc = _run(_config(base / "full", dtype))
    if rank == 0:
        out["trunc"] = out_trunc
        for _, step_dir in list_steps(str(base / "full" / "checkpoints")):
            (Path(step_dir) / "manifest.json").write_text("{not json")
    dist.barrier()
    out_none = _run(_config(base / "full", dtype))
    if rank == 0:
        out["none"] = out_none
    return out


@pytest.mark.parametrize(("dtype", "async_save"), [("float64", "false"), ("float32", "true")])
def test_resume_is_exact_and_damaged_checkpoints_fall_back(tmp_path, capfd, dtype: str, async_save) -> None:
    results = run_on_ranks(_resume_cases, 2, str(tmp_path), dtype, async_save, timeout_s=240)[0]
    full = results["full"]
    assert full["checkpoint"]["resumed_from"] is None and full["checkpoint"]["saves"] == 3  # 3, 6, 8
    assert full["steps"] == STEPS and full["restarts"] == 0
    assert full["checkpoint"]["async"] == (async_save == "true")

    cut = results["cut"]
    assert cut["checkpoint"]["resumed_at_step"] == 3
    assert cut["final_param_digest"] == full["final_param_digest"]
    for key in ("initial_loss", "final_loss", "eval_loss", "eval_losses", "steps"):
        assert cut[key] == full[key], key
    assert results["cut_metrics_steps"] == list(range(STEPS))  # rows after step 3 replaced, not repeated

    for case in ("flip", "trunc"):
        got = results[case]
        assert got["checkpoint"]["resumed_at_step"] == 6, case  # fell back from step 8 to step 6
        assert got["final_param_digest"] == full["final_param_digest"], case
        assert got["eval_losses"] == full["eval_losses"], case

    none = results["none"]  # every checkpoint damaged: said in one line, trained from the start
    assert none["checkpoint"]["resumed_from"] is None
    assert none["final_param_digest"] == full["final_param_digest"]

    err = capfd.readouterr().err.splitlines()
    lines = [x for x in err if "is damaged" in x]
    assert len(lines) == 5, lines  # one line per damaged checkpoint, from one rank
    assert "step-00000008/rank0.safetensors: crc32 mismatch" in lines[0]
    assert "step-00000008/rank1.safetensors" in lines[1] and "truncated" in lines[1]
    told = [x for x in err if "could be read" in x]
    assert len(told) == 1 and told[0].startswith("shardwise: none of the 3 checkpoints under "), told
    assert told[0].endswith("could be read; training starts from step 0 (move them away to keep them)")


def test_resume_with_a_different_model_is_refused(tmp_path) -> None:
    from shardwise.config import ConfigError
    from shardwise.testing import RankFailure

    run_on_ranks(_run_once, 1, _config(tmp_path, "float64", steps="2"), timeout_s=120)
    with pytest.raises(RankFailure, match="comes from another run"):
        run_on_ranks(_run_once, 1, _config(tmp_path, "float64", steps="3", seed="7"), timeout_s=120)
    assert ConfigError  # the worker raises ConfigError; RankFailure carries its message


def _run_once(rank: int, world_size: int, config: TrainConfig) -> dict | None:
    return _run(config)


def test_full_state_names_and_shapes_follow_the_engine_contract() -> None:
    """Names: model/<param>, optim/<key>/<param> at the parameter's shape, optim/step/<param> scalar."""
    run_on_ranks(_check_names, 2, timeout_s=120)


def _check_names(rank: int, world_size: int) -> None:
    from shardwise.train.loop import Trainer

    config = _config(Path("/nonexistent"), "float64", steps="1").validate(world_size)
    trainer = Trainer.build(config)
    trainer.step(0)
    pieces = trainer.engine.state_pieces(rank, world_size)
    everyone: list = [None] * world_size
    import torch.distributed as dist

    dist.all_gather_object(everyone, [(p.name, p.global_shape) for p in pieces])
    names = dict(x for mine in everyone for x in mine)
    assert sum(len(m) for m in everyone) == len(names), "a tensor is written by two ranks"
    assert all(len(m) > 0 for m in everyone), "one rank writes everything"
    params = dict(trainer.engine.model.named_parameters())
    for name, p in params.items():
        assert names[f"model/{name}"] == tuple(p.shape)
        if p.requires_grad:
            assert names[f"optim/exp_avg/{name}"] == tuple(p.shape)
            assert names[f"optim/step/{name}"] == ()
    assert torch.is_tensor(pieces[0].tensor)
    trainer.engine.close()


# -- compressed runs: each rank's error-feedback state is in the checkpoint ---------------------------
COMPRESSED = {  # strategy -> extra config; topk:0.05 leaves most of each bucket in the residual
    "ddp": {},
    "zero2": {},
    "diloco": {"diloco.sync_every": "3"},
}


def _compressed_config(run_dir: Path, strategy: str, **extra: str) -> TrainConfig:
    overrides = {"strategy": strategy, "steps": "6", "eval_every": "0", "comm.compress": "topk:0.05"}
    return _config(run_dir, "float64", **{**overrides, **COMPRESSED[strategy], **extra})


def _compressed_resume(rank: int, world_size: int, root: str, strategy: str) -> dict | None:
    """An uninterrupted 6-step run saving at 3 and 6, then one resumed from step 3."""
    import torch.distributed as dist

    base = Path(root) / strategy
    full = _run(_compressed_config(base / "full", strategy))
    if rank == 0:
        shutil.copytree(base / "full" / "checkpoints", base / "cut" / "checkpoints")
        shutil.rmtree(list_steps(str(base / "cut" / "checkpoints"))[-1][1])  # resume from step 3
    dist.barrier()
    cut = _run(_compressed_config(base / "cut", strategy))
    if rank != 0:
        return None
    return {"full": full, "cut": cut, "names": _codec_names(base / "full" / "checkpoints")}


def _codec_names(root: Path) -> list[str]:
    from shardwise.checkpoint.reader import verify_checkpoint

    manifest = verify_checkpoint(list_steps(str(root))[0][1])
    return sorted(n for n in manifest.tensors if n.startswith("codec/"))


@pytest.mark.parametrize("strategy", list(COMPRESSED))
def test_compressed_resume_restores_the_residuals_exactly(tmp_path, strategy: str) -> None:
    out = run_on_ranks(_compressed_resume, 2, str(tmp_path), strategy, timeout_s=240)[0]
    assert out["cut"]["checkpoint"]["resumed_at_step"] == 3
    assert out["cut"]["final_param_digest"] == out["full"]["final_param_digest"]
    assert out["cut"]["final_loss"] == out["full"]["final_loss"]
    layout = f"codec/{strategy}.world2.topk_0.05"
    for rank in (0, 1):  # each rank's own residual, under the layout that wrote it
        assert f"{layout}/rank{rank}/0/residual" in out["names"], out["names"]
        assert f"{layout}/rank{rank}/0/reductions" in out["names"], out["names"]


def _other_world(rank: int, world_size: int, root: str) -> list[str]:
    """Resume the 2-rank DDP checkpoint on one rank: the residuals are dropped with a warning."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = _run(_compressed_config(Path(root) / "ddp" / "cut", "ddp", steps="7"))
    assert summary is not None and summary["checkpoint"]["resumed_at_step"] == 6
    return [str(w.message) for w in caught if "error-feedback" in str(w.message)]


def test_compressed_resume_on_other_ranks_drops_the_residuals_with_a_warning(tmp_path) -> None:
    run_on_ranks(_compressed_resume, 2, str(tmp_path), "ddp", timeout_s=240)
    lines = run_on_ranks(_other_world, 1, str(tmp_path), timeout_s=240)[0]
    assert len(lines) == 1 and "ddp.world2.topk_0.05" in lines[0] and "ddp.world1" in lines[0], lines


def _ps_compressed(rank: int, world_size: int, root: str) -> dict | None:
    """1 server + 2 workers, int8: the workers' push residuals are saved; a resume from step 3 runs."""
    import torch.distributed as dist

    base = Path(root)
    config = partial(_config, dtype="float64", strategy="ps", steps="6", eval_every="0")
    full = _run(config(base / "full", **{"comm.compress": "int8"}))
    if rank == 0:
        shutil.copytree(base / "full" / "checkpoints", base / "cut" / "checkpoints")
        shutil.rmtree(list_steps(str(base / "cut" / "checkpoints"))[-1][1])
    dist.barrier()
    cut = _run(config(base / "cut", **{"comm.compress": "int8"}))
    if full is None or cut is None:
        return None
    return {"full": full, "cut": cut, "names": _codec_names(base / "full" / "checkpoints")}


def test_parameter_server_saves_each_workers_push_residuals(tmp_path) -> None:
    out = next(r for r in run_on_ranks(_ps_compressed, 3, str(tmp_path), timeout_s=240) if r is not None)
    assert out["cut"]["checkpoint"]["resumed_at_step"] == 3 and out["cut"]["steps"] == 6
    # the workers' push residuals (one bucket per server); pulls restart from exact weights on resume,
    # so the resumed run is close to, not equal to, the uninterrupted one
    assert {n.rsplit("/", 3)[1] for n in out["names"] if n.endswith("/residual")} == {"rank1", "rank2"}
    assert abs(out["cut"]["final_loss"] - out["full"]["final_loss"]) < 0.05
