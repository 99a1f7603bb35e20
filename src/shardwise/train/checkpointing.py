"""Checkpoints in the train loop: resume at start, save every ``checkpoint.every`` steps and at the end.

A checkpoint named ``step-<k>`` holds the state after k completed steps: the engine's tensors
(``Engine.state_pieces``), each rank's RNG states (Python, NumPy, torch: dropout continues exactly),
and in its meta the sampler position, the first loss and the evaluations so far, so a resumed run
reports what an uninterrupted one would. Batches are a pure function of (seed, step), so restoring
the step restores the data order.

Communication: on resume, rank 0 broadcasts the list of complete checkpoints (so every rank tries the
same ones, whatever its view of a shared file system), then per candidate one all-reduce of per-rank
failure flags, so all ranks fall back together and the lowest failing rank names the damaged file in
one line. Saving is the writer's: one tiny broadcast and two barriers (asynchronous mode: one
broadcast; a background thread writes while training goes on).

A save that cannot be written (a full disk, say) stops the run with one line naming the checkpoint
and the reason (``CheckpointWriteError``); the half-written folder is never published, so the
previous checkpoint stays the newest, and the next start removes the leftovers.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from shardwise.checkpoint import CheckpointError, CheckpointWriter, SaveReport, capture_rng, restore_rng
from shardwise.checkpoint.format import Manifest, ManifestError
from shardwise.checkpoint.layout import clean_tmp, list_steps, step_dir_name
from shardwise.checkpoint.manager import AsyncSaveError
from shardwise.checkpoint.reader import verify_checkpoint
from shardwise.checkpoint.rng import torch_rng_name
from shardwise.collectives.api import Comm
from shardwise.config import ConfigError, TrainConfig, to_dict
from shardwise.device import HOST
from shardwise.engine.full_state import FolderReader
from shardwise.launcher import restart_count
from shardwise.train.metrics import StepRecord

# Config keys a resumed run must share with the run that saved (anything else may change: the
# strategy, the world size, the data weights, the number of steps).
MUST_MATCH = ("model", "dtype", "seed", "optim", "data.global_batch", "data.corpus_bytes")


def checkpoint_root(config: TrainConfig) -> str | None:
    """Where this run's checkpoints live, or None when checkpointing is off (no dir and every = 0)."""
    ckpt = config.checkpoint
    if not ckpt.dir and ckpt.every <= 0:
        return None
    return ckpt.dir or str(Path(config.run_dir) / "checkpoints")


def write_pid_file(run_dir: str, rank: int) -> Path:
    """``<run_dir>/pids/rank<r>.<attempt>`` holding this process's pid (to watch or signal a rank)."""
    path = Path(run_dir) / "pids" / f"rank{rank}.{restart_count()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    return path


def agreed_restart_count(comm: Comm) -> int:
    """The most restarts any rank's agent has made (a replaced host's agent counts from 0 again)."""
    count = torch.tensor([restart_count()], dtype=torch.int64, device=HOST)  # host bookkeeping: gloo
    comm.all_reduce(count, "max")
    return int(count.item())


def truncate_metrics(path: Path, next_step: int) -> None:
    """Drop rows for steps at or after ``next_step`` (run again after resuming), keep the rest."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and _row_step(line) < next_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _row_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError):
        return -1


def check_resume_meta(manifest: Manifest, step_dir: str) -> None:
    """The training position a resume reads: an integer ``meta.sampler.step`` (``read_manifest`` has
    checked that it equals the manifest's step, the steps done); without it the checkpoint is not one a
    run can continue from, and is passed over like a damaged one."""
    sampler = manifest.meta.get("sampler")
    step = sampler.get("step") if isinstance(sampler, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        raise ManifestError(
            f"{os.path.join(step_dir, 'manifest.json')}: meta.sampler.step is {step!r}, not the step to "
            "resume from; the manifest is corrupt"
        )


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names it, the reason, and what is kept."""


@dataclass
class Resumed:
    path: str
    next_step: int
    initial_loss: float | None
    eval_losses: list[tuple[int, float]]
    last_record: StepRecord | None
    skipped_steps: list[int] = field(default_factory=list)  # updates skipped on a non-finite value


@dataclass
class TrainCheckpoints:
    """One per rank: loads the newest usable checkpoint and saves new ones during training."""

    trainer: Any  # train.loop.Trainer (not imported: loop imports this module)
    root: str
    rank: int
    world_size: int
    writer: CheckpointWriter
    reports: list[SaveReport] = field(default_factory=list)
    resumed: Resumed | None = None
    initial_loss: float | None = None

    @classmethod
    def create(cls, trainer: Any, rank: int, world_size: int) -> TrainCheckpoints | None:
        config: TrainConfig = trainer.config
        root = checkpoint_root(config)
        if root is None:
            return None
        ckpt = config.checkpoint
        writer = CheckpointWriter(
            root, trainer.world_comm, keep=ckpt.keep, async_save=ckpt.async_save, timeout_s=config.timeout_s
        )
        return cls(trainer, root, rank, world_size, writer)

    # -- resume ------------------------------------------------------------------------------------
    def resume(self) -> Resumed | None:
        """Load the newest checkpoint every rank can read (or None); damaged ones are named and skipped."""
        if not self.trainer.config.checkpoint.resume:
            return None
        if self.rank == 0:
            clean_tmp(self.root)  # half-written folders of a killed attempt: no save is in flight now
        candidates = self._candidates()
        for step_dir in reversed(candidates):
            error = self._try_load(step_dir)
            flags = torch.zeros(self.world_size, dtype=torch.int64, device=HOST)
            flags[self.rank] = int(error is not None)
            self.trainer.world_comm.all_reduce(flags, "sum")
            if not int(flags.sum()):
                return self.resumed
            if error is not None and self.rank == int(flags.nonzero()[0]):
                print(f"shardwise: checkpoint {step_dir} is damaged ({error}); trying the previous one",
                      file=sys.stderr, flush=True)  # fmt: skip
        if candidates and self.rank == 0:
            told = f"none of the {len(candidates)} checkpoints under {self.root} could be read"
            print(f"shardwise: {told}; training starts from step 0 (move them away to keep them)",
                  file=sys.stderr, flush=True)  # fmt: skip
        return None

    def _candidates(self) -> list[str]:
        steps = [s for s, _ in list_steps(self.root)] if self.rank == 0 else []
        count = torch.tensor([len(steps)], dtype=torch.int64, device=HOST)
        comm = self.trainer.world_comm
        comm.broadcast(count, src=0)
        values = (
            torch.tensor(steps, dtype=torch.int64, device=HOST)
            if self.rank == 0
            else torch.empty(int(count), device=HOST)
        )
        values = values.to(torch.int64)
        if int(count):
            comm.broadcast(values, src=0)
        return [os.path.join(self.root, step_dir_name(int(s))) for s in values.tolist()]

    def _try_load(self, step_dir: str) -> CheckpointError | None:
        try:
            manifest = verify_checkpoint(step_dir)  # readable manifest, every file at its size
            check_resume_meta(manifest, step_dir)
            check_same_run(manifest, self.trainer.config)
            reader = FolderReader(step_dir, manifest)
            rng_name = torch_rng_name(self.rank)
            rng_tensors = reader({rng_name: None}) if rng_name in reader.shapes else {}
            self.trainer.engine.load_state(reader)
        except CheckpointError as err:
            return err
        meta = manifest.meta
        self.trainer.sampler.load_state_dict(meta["sampler"])
        rank_meta = manifest.rank_meta[self.rank] if self.rank < len(manifest.rank_meta) else {}
        if rng_tensors and "rng" in rank_meta:
            restore_rng(rank_meta["rng"], rng_tensors, self.rank)
        last = meta.get("last_record")
        self.resumed = Resumed(
            path=step_dir,
            next_step=int(meta["sampler"]["step"]),
            initial_loss=meta.get("initial_loss"),
            eval_losses=[(int(s), float(v)) for s, v in meta.get("eval_losses", [])],
            last_record=StepRecord(**last) if last else None,
            skipped_steps=[int(s) for s in meta.get("skipped_steps", [])],
        )
        self.initial_loss = self.resumed.initial_loss
        return None

    # -- save --------------------------------------------------------------------------------------
    def after_step(
        self, record: StepRecord, eval_losses: list[tuple[int, float]], skipped: list[int] | None = None
    ) -> None:
        """Save when ``checkpoint.every`` steps have completed since the start, and after the last step."""
        if self.initial_loss is None:
            self.initial_loss = record.loss
        if self._due(record.step + 1):
            self.save(record, eval_losses, skipped or [])

    def serve_step(self, done: int) -> None:
        """A parameter server after ``done`` served steps: take part in the save the workers make now."""
        if self._due(done):
            self._write(done, None)

    def _due(self, done: int) -> bool:
        every = self.trainer.config.checkpoint.every
        return (every > 0 and done % every == 0) or done == self.trainer.config.steps

    def save(
        self, record: StepRecord, eval_losses: list[tuple[int, float]], skipped: list[int] | None = None
    ) -> SaveReport:
        meta = {
            "sampler": self.trainer.sampler.state_dict(),
            "initial_loss": self.initial_loss,
            "eval_losses": [list(e) for e in eval_losses],
            "last_record": asdict(record),
            "restarts": restart_count(),
            "skipped_steps": list(skipped or []),
        }
        self.trainer.engine.before_checkpoint(record.step + 1)  # serving ranks on their own time join
        return self._write(record.step + 1, meta)

    def _write(self, step: int, meta: dict[str, Any] | None) -> SaveReport:
        trainer, config = self.trainer, self.trainer.config
        reporter = trainer.engine.role.reporter
        if reporter != 0:  # rank 0 publishes the manifest: it needs the reporting rank's meta
            meta = _broadcast_json(trainer.world_comm, meta, src=reporter)
        rng_state, rng_pieces = capture_rng(self.rank)
        try:
            report = self.writer.save(
                step,
                trainer.engine.state_pieces(self.rank, self.world_size) + rng_pieces,
                meta=meta,
                rank_meta={"rng": rng_state},
                strategy=config.strategy,
                mesh=trainer.mesh.describe(),
                config=to_dict(config),
            )
        except (OSError, CheckpointError) as err:  # CheckpointError: an asynchronous save that failed
            # an earlier asynchronous save surfaces here, while ``step`` is being saved: name its step
            self._raise_write_error(err, err.step if isinstance(err, AsyncSaveError) else step)
        self.reports.append(report)
        return report

    def close(self) -> None:
        """Wait for an asynchronous save still being written."""
        try:
            self.writer.wait()
        except CheckpointError as err:
            self._raise_write_error(err, err.step if isinstance(err, AsyncSaveError) else None)

    def _raise_write_error(self, err: BaseException, step: int | None) -> NoReturn:
        """One line for a save that failed on its way to the disk; anything else as it was."""
        cause = err if isinstance(err, OSError) else err.__cause__
        if not isinstance(cause, OSError):
            raise err
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT)
        reason = "no space left on device" if full else (cause.strerror or str(cause))
        what = f"a checkpoint in {self.root}"
        if step is not None:
            what = os.path.join(self.root, step_dir_name(step))
        done = list_steps(self.root)
        kept = f"{done[-1][1]} is kept" if done else "there is no earlier checkpoint"
        raise CheckpointWriteError(
            f"rank {self.rank} could not write {what} ({reason}); {kept}; "
            "free space there or choose another --checkpoint-dir"
        ) from None

    def summary(self) -> dict[str, Any]:
        """Figures for the run summary: saves, time blocked, this rank's write throughput."""
        blocked = [r.blocked_s for r in self.reports]
        rates = [r.throughput_mb_s for r in self.reports if r.write_s > 0]
        return {
            "dir": str(Path(self.root).resolve()),
            "saves": len(self.reports),
            "async": self.writer.async_save,
            "blocked_s_total": float(sum(blocked)),
            "blocked_s_median": float(np.median(blocked)) if blocked else 0.0,
            "write_mb_s_median_rank0": float(np.median(rates)) if rates else 0.0,
            "resumed_from": self.resumed.path if self.resumed else None,
            "resumed_at_step": self.resumed.next_step if self.resumed else None,
        }


def _broadcast_json(comm: Comm, value: Any, src: int) -> Any:
    """``value`` of rank ``src`` on every rank, as JSON bytes (two broadcasts)."""
    data = json.dumps(value).encode() if comm.rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=HOST)
    comm.broadcast(size, src=src)
    empty = torch.empty(0, dtype=torch.uint8, device=HOST)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else empty
    if comm.rank != src:
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=HOST)
    comm.broadcast(buf, src=src)
    return json.loads(bytes(buf.tolist()).decode())


def check_same_run(manifest: Manifest, config: TrainConfig) -> None:
    """A ConfigError naming the keys that differ when the checkpoint comes from another kind of run."""
    saved, mine = manifest.config, json.loads(json.dumps(to_dict(config)))  # tuples as saved: lists
    differ = [leaf for key in MUST_MATCH for leaf in _leaves(key, _get(saved, key), _get(mine, key))]
    if differ:
        shown = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in differ[:3])
        raise ConfigError(
            f"the checkpoint {manifest.step} under {config.checkpoint.dir or config.run_dir} comes from "
            f"another run ({shown}); use another --checkpoint-dir or --set checkpoint.resume=false"
        )


def _leaves(key: str, saved: Any, mine: Any) -> list[tuple[str, Any, Any]]:
    """The innermost keys under ``key`` whose values differ, e.g. ``model.seq_len``."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        return [
            leaf
            for k in sorted(set(saved) | set(mine))
            for leaf in _leaves(f"{key}.{k}", saved.get(k), mine.get(k))
        ]
    return [] if saved == mine else [(key, saved, mine)]


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree
