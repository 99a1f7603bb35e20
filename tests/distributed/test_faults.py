"""Fault suite: runs killed, checkpoints damaged, a disk that fills up; each ends where it should.

- ``kill -9`` of a random rank after a random step (plus a random moment within it), one trial per
  strategy by default (DDP, ZeRO-2, ZeRO-3, sync parameter server), under ``--max-restarts``: every trial
  ends with the uninterrupted run's ``final_param_digest`` and each step in ``metrics.jsonl`` once.
- ``kill -9`` while a checkpoint is being written (its temporary folder is there): the same.
- Truncated, bit-flipped and missing checkpoint files: each damaged checkpoint is named in one line,
  the previous one is used, and the run still ends with the uninterrupted digest.
- A full disk (a small tmpfs for the checkpoints): one line, a non-zero exit, and the previous
  checkpoint kept whole.

The randomness is seeded: ``SHARDWISE_FAULT_SEED`` (default below) and ``SHARDWISE_FAULT_TRIALS``
(trials per strategy). Each trial prints its seed, victim and moment, so a failure can be replayed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from shardwise.checkpoint.layout import list_steps, list_tmp
from shardwise.checkpoint.reader import verify_checkpoint

from .cli_helpers import finished, last_step, metrics_steps, shardwise, start, wait_for

SEED = int(os.environ.get("SHARDWISE_FAULT_SEED", "1729"))
TRIALS = int(os.environ.get("SHARDWISE_FAULT_TRIALS", "1"))  # more: SHARDWISE_FAULT_TRIALS=5
STEPS, EVERY = 10, 3  # checkpoints after steps 3, 6, 9 and 10
NPROC = {"ddp": 2, "zero2": 2, "zero3": 2, "ps": 3}  # ps: one server, two workers

pytestmark = pytest.mark.slow


def _args(strategy: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train", "--strategy", strategy, "--nproc", str(NPROC[strategy]), "--preset", "tiny",
        "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--set", "checkpoint.keep=5",
        "--eval-every", "5", "--max-restarts", "2", "--run-dir", str(run_dir), "--json", *extra,
    ]  # fmt: skip


_REFERENCES: dict[str, tuple[dict[str, Any], Path]] = {}


def _reference(strategy: str, tmp_path_factory: Any) -> tuple[dict[str, Any], Path]:
    """The uninterrupted run (once per strategy): its summary and its run folder."""
    if strategy not in _REFERENCES:
        run_dir = tmp_path_factory.mktemp(f"whole-{strategy}")
        summary, _ = finished(start(_args(strategy, run_dir)))
        assert summary["restarts"] == 0 and metrics_steps(run_dir) == list(range(STEPS))
        _REFERENCES[strategy] = summary, run_dir
    return _REFERENCES[strategy]


def _kill(run_dir: Path, rank: int) -> None:
    os.kill(int((run_dir / "pids" / f"rank{rank}.0").read_text()), signal.SIGKILL)


def _ends_like(reference: dict[str, Any], proc: subprocess.Popen[str], run_dir: Path) -> dict[str, Any]:
    """The killed run restarted, resumed and ended exactly as the uninterrupted one."""
    try:
        summary, _ = finished(proc, timeout_s=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert summary["restarts"] >= 1
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert summary["eval_losses"] == reference["eval_losses"]
    assert metrics_steps(run_dir) == list(range(STEPS)), "a step is missing or written twice"
    return summary


@pytest.mark.parametrize("strategy", list(NPROC))
def test_kill_9_of_a_random_rank_at_a_random_step(tmp_path, tmp_path_factory, strategy: str) -> None:
    reference, _ = _reference(strategy, tmp_path_factory)
    for trial in range(TRIALS):
        seed = f"{SEED}-{strategy}-{trial}"
        rng = random.Random(seed)
        victim, after, delay = rng.randrange(NPROC[strategy]), rng.randrange(0, STEPS - 3), rng.random() / 20
        print(f"fault trial {seed}: kill -9 rank {victim} {delay * 1000:.0f} ms after step {after}")
        run_dir = tmp_path / f"trial{trial}"
        proc = start(_args(strategy, run_dir))
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda m=metrics, a=after: last_step(m) >= a, proc, 120, f"step {after}")
        time.sleep(delay)
        _kill(run_dir, victim)
        summary = _ends_like(reference, proc, run_dir)
        print(f"  resumed at step {summary['checkpoint']['resumed_at_step']}, same digest")


def test_kill_9_while_a_checkpoint_is_written(tmp_path, tmp_path_factory) -> None:
    reference, _ = _reference("ddp", tmp_path_factory)
    rng = random.Random(f"{SEED}-write")
    victim, step = rng.randrange(2), rng.choice([6, 9])
    print(f"fault trial {SEED}-write: kill -9 rank {victim} while step-{step:08d} is being written")
    run_dir = tmp_path / "run"
    tmp_name = f".tmp-step-{step:08d}-"
    root = run_dir / "checkpoints"
    proc = start(_args("ddp", run_dir))

    def writing() -> bool:
        return any(Path(p).name.startswith(tmp_name) for p in list_tmp(str(root)))

    wait_for(writing, proc, 120, f"the write of step {step}", every_s=0.0005)  # it lasts ~10 ms
    _kill(run_dir, victim)
    published = (root / f"step-{step:08d}").exists()  # rank 0 may have finished it in the meantime
    print(f"  killed mid-write; the checkpoint was {'published anyway' if published else 'left half done'}")
    summary = _ends_like(reference, proc, run_dir)
    assert summary["checkpoint"]["resumed_at_step"] in (step - EVERY, step)


def test_damaged_checkpoints_are_named_and_the_previous_used(tmp_path, tmp_path_factory) -> None:
    """Step 10 truncated, step 9 bit-flipped, step 6 missing a file: three lines, resume from step 3."""
    reference, whole = _reference("ddp", tmp_path_factory)
    run_dir = tmp_path / "damaged"
    shutil.copytree(whole, run_dir, ignore=shutil.ignore_patterns("pids"))
    steps = dict(list_steps(str(run_dir / "checkpoints")))
    assert sorted(steps) == [3, 6, 9, 10]
    truncated = Path(steps[10]) / "rank1.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-64])
    flipped = Path(steps[9]) / "rank0.safetensors"
    data = bytearray(flipped.read_bytes())
    data[len(data) - 100] ^= 0x10  # in the tensor bytes, past the header
    flipped.write_bytes(bytes(data))
    missing = Path(steps[6]) / "rank1.safetensors"
    missing.unlink()

    proc = start(_args("ddp", run_dir))
    summary, err = finished(proc, timeout_s=180)
    lines = [x for x in err.splitlines() if "is damaged" in x]
    assert len(lines) == 3, err[-3000:]
    for line, path in zip(lines, (truncated, flipped, missing), strict=True):
        assert str(path.parent) in line and path.name in line, line
    assert summary["checkpoint"]["resumed_at_step"] == 3
    assert summary["final_param_digest"] == reference["final_param_digest"]
    assert metrics_steps(run_dir) == list(range(STEPS))


@pytest.fixture
def small_disk(tmp_path) -> Any:
    """A 3 MiB tmpfs: room for one checkpoint of the tiny model (about 1.6 MB), not two."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"a full disk needs a small tmpfs; mount is not permitted here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_stops_in_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, small_disk, mode: str
) -> None:
    """Asynchronous: step 6's save fails in the background and surfaces at step 9's; the line names
    step 6 (it named step 9, which was never attempted)."""
    root = small_disk / "checkpoints"
    extra = ["--set", "checkpoint.async_save=true"] if mode == "async" else []
    result = shardwise(
        *_args("ddp", tmp_path / "run", "--checkpoint-dir", str(root), "--max-restarts", "0", *extra),
        timeout_s=180,
    )
    assert result.returncode != 0
    errors = [x for x in result.stderr.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "no space left on device" in errors[0] and "step-00000006" in errors[0], errors[0]
    assert f"{root / 'step-00000003'} is kept" in errors[0]
    assert [s for s, _ in list_steps(str(root))] == [3]
    assert verify_checkpoint(str(root / "step-00000003")).step == 3  # whole and readable
