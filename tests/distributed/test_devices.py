"""Every strategy and layout makes each tensor on its parameters' or batch's device (checked without a GPU).

Each case trains two steps through ``Trainer.fit`` (build, steps, held-out loss, metrics, and for some a
checkpoint saved and resumed) with ``DeviceLess`` active on every rank: a tensor factory called from
shardwise's own source without a ``device`` makes a meta tensor (no data) and is recorded. Model and
data are real CPU tensors, so any such tensor that meets them, a collective or a read fails the case,
and every recorded call fails it by name (file:line), even one a meta tensor would pass. The cases of
one world size run in one launched world. ``tests/unit/test_devices.py`` shows the check fails when one
allocation of the step is changed to ignore the device.

Also here: ``shardwise train --device cpu`` and ``--device auto`` on this machine (no GPU) train as
before: the same run, to the digest.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.config import TrainConfig, load_config
from shardwise.testing import run_on_ranks
from shardwise.testing.devices import DeviceLess, device_less_calls

from .cli_helpers import last_json, shardwise

BASE = {
    "model.preset": "odd-deep",  # 8 blocks: pp 2 x 2 virtual stages fits; heads of 7, tp 2 divides
    "data.global_batch": "12",
    "steps": "2",
    "eval_every": "2",
    "eval_batches": "1",
    "hang_timeout_s": "0",
}
PP = {"parallel.pp": "2", "data.micro_batches": "4"}
BN = {"model.kind": "mlp", "model.preset": "small_bn", "sync_batchnorm": "true"}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "interleaved-zb", "zbv", "dualpipev")
CODECS = ("none", "fp16", "bf16", "int8", "sign", "topk:0.05", "dgc:0.05", "powersgd:2")

WORLD2: dict[str, dict[str, str]] = {
    "ddp": {"strategy": "ddp", "optim.clip_grad_norm": "1", "data.micro_batches": "2"},
    "ddp-ckpt": {"strategy": "ddp", "checkpoint.every": "1"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2", "data.micro_batches": "2"},
    "zero3": {"strategy": "zero3", "parallel.activation_checkpointing": "true"},
    "zero3-ckpt": {"strategy": "zero3", "checkpoint.every": "1"},
    "zero1-offload-cpu": {"strategy": "zero1", "zero.offload": "cpu"},
    "zero2-offload-disk": {"strategy": "zero2", "zero.offload": "disk"},
    "zero3-offload-cpu": {"strategy": "zero3", "zero.offload": "cpu"},
    "zero3-offload-disk": {"strategy": "zero3", "zero.offload": "disk"},
    "ps": {"strategy": "ps"},
    "ps-async-topk": {"strategy": "ps", "ps.mode": "async", "comm.compress": "topk:0.05"},
    "diloco": {"strategy": "diloco", "diloco.sync_every": "1"},
    "ddp-fp16": {"strategy": "ddp", "precision": "fp16"},
    "zero2-fp16": {"strategy": "zero2", "precision": "fp16"},
    "ddp-bf16": {"strategy": "ddp", "precision": "bf16"},
    "zero3-bf16": {"strategy": "zero3", "precision": "bf16"},
    "ps-bf16": {"strategy": "ps", "precision": "bf16"},
    **{f"ddp-{c.split(':')[0]}": {"strategy": "ddp", "comm.compress": c} for c in CODECS},
    "zero2-sign": {"strategy": "zero2", "comm.compress": "sign"},
    "ddp-syncbn": {"strategy": "ddp", **BN},
    "zero2-syncbn": {"strategy": "zero2", **BN},
    "tp2-ddp": {"strategy": "ddp", "parallel.tp": "2"},
    "tp2-zero3-sp": {"strategy": "zero3", "parallel.tp": "2", "parallel.sequence_parallel": "true"},
    **{f"pp2-{s}": {"strategy": "ddp", **PP, "parallel.schedule": s} for s in SCHEDULES},
    "pp2-zero3-1f1b": {"strategy": "zero3", **PP, "parallel.schedule": "1f1b"},
}
WORLD4: dict[str, dict[str, str]] = {
    "hybrid-zero3": {"strategy": "zero3", "parallel.dp_replicate": "2"},
    "hybrid-zero2-tp2": {"strategy": "zero2", "parallel.dp_replicate": "1", "parallel.tp": "2"},
    "ps-2-servers": {"strategy": "ps", "ps.servers": "2"},
    "dp2-pp2-zero1": {"strategy": "zero1", **PP},
}


def _config(overrides: dict[str, str], run_dir: str) -> TrainConfig:
    return load_config(None, {**BASE, **overrides, "run_dir": run_dir})


def _run_cases(rank: int, world_size: int, cases: dict[str, dict[str, str]], root: str) -> dict[str, Any]:
    """Each case's recorded device-less calls and reported loss, on this rank."""
    from shardwise.train.loop import Trainer

    out: dict[str, Any] = {}
    for name, overrides in cases.items():
        config = _config(overrides, str(Path(root) / name))
        with DeviceLess() as found:
            summary = Trainer.build(config).fit(show_progress=False)
            if config.checkpoint.every:  # resumed from the checkpoint of step 2, one more step
                more = load_config(None, {**BASE, **overrides, "run_dir": config.run_dir, "steps": "3"})
                summary = Trainer.build(more).fit(show_progress=False) or summary
        out[name] = {"calls": found.calls, "loss": summary["final_loss"] if summary else None}
    return out


def _check(results: list[dict[str, Any]], cases: dict[str, dict[str, str]]) -> None:
    for name in cases:
        calls = [c for rank in results for c in rank[name]["calls"]]
        assert not calls, f"{name}: tensors made without a device:\n{device_less_calls(calls)}"
        losses = [rank[name]["loss"] for rank in results if rank[name]["loss"] is not None]
        assert losses and all(math.isfinite(x) for x in losses), (name, losses)


def test_every_layout_names_its_devices_on_two_ranks() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_on_ranks(_run_cases, 2, WORLD2, root, timeout_s=900)
    _check(results, WORLD2)


def test_hybrid_and_wider_layouts_name_their_devices_on_four_ranks() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_on_ranks(_run_cases, 4, WORLD4, root, timeout_s=600)
    _check(results, WORLD4)


def test_the_cases_cover_what_the_issue_lists() -> None:
    """ddp, zero1/2/3 (with offload), ps, tp 2, pp 2 (every schedule), hybrid, fp16, bf16, each codec,
    SyncBN: each is a case above."""
    every = {**WORLD2, **WORLD4}
    values = [dict(v) for v in every.values()]
    for strategy in ("ddp", "zero1", "zero2", "zero3", "ps", "diloco"):
        assert any(v.get("strategy") == strategy for v in values), strategy
    for stage in ("zero1", "zero2", "zero3"):
        assert any(v.get("strategy") == stage and v.get("zero.offload") for v in values), stage
    assert any(v.get("parallel.tp") == "2" for v in values)
    assert {v.get("parallel.schedule") for v in values if v.get("parallel.pp") == "2"} >= set(SCHEDULES)
    assert any(v.get("parallel.dp_replicate") == "2" for v in values)
    assert {v.get("precision") for v in values} >= {"fp16", "bf16"}
    assert {v.get("comm.compress", "").split(":")[0] for v in values} >= {c.split(":")[0] for c in CODECS}
    assert any(v.get("sync_batchnorm") == "true" for v in values)


# -- the command line on a machine without GPUs: --device cpu and --device auto train as before ---------
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has CUDA: --device auto picks the GPU here, not the CPU"
)
@pytest.mark.parametrize("extra", [[], ["--strategy", "zero2"]], ids=["ddp", "zero2"])
def test_train_device_cpu_and_auto_are_the_same_run(extra: list[str], tmp_path: Path) -> None:
    digests = {}
    for device in ("cpu", "auto"):
        args = ["train", "--nproc", "2", "--steps", "3", "--preset", "tiny", "--device", device]
        result = shardwise(*args, *extra, "--run-dir", str(tmp_path / device), "--json")
        assert result.returncode == 0, result.stderr
        summary = last_json(result)
        assert summary["device"] == "cpu" and summary["world_size"] == 2
        digests[device] = summary["final_param_digest"]
    assert digests["cpu"] == digests["auto"]
