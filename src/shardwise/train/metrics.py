"""Per-step figures: time, tokens/s, communication, memory; gathered from every rank to rank 0.

Each step every rank contributes one small float64 vector (its loss share, step time, time blocked in
communication, bytes sent, current and peak RSS, samples, and whether it saw a non-finite value: 0
none, 1 skipped, 2 stop); one all-gather brings them to every rank, which gives the global loss (sum
of shares), per-rank figures, and one verdict on non-finite values for all (ranks whose verdicts may
differ, asynchronous parameter-server workers, thus stop in the same step) at the cost of a single
tiny collective.
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from shardwise.collectives.api import Comm
from shardwise.engine.base import NonFinite
from shardwise.observe.tensorboard import TensorBoard

FIELDS = ("loss_share", "step_s", "comm_s", "bytes_sent", "rss_mb", "peak_rss_mb", "samples", "nonfinite")
# what another rank found not finite, where this one found nothing (asynchronous workers differ)
ELSEWHERE = "a loss or gradient of another worker"


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def rss_mb() -> float:
    """Current resident set size (read before the peak, so the peak is never below it)."""
    return psutil.Process().memory_info().rss / 2**20


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens_per_s: float
    step_s: float  # slowest rank
    comm_s: float  # slowest rank's time blocked on communication
    bytes_sent: list[float]
    step_s_by_rank: list[float]
    comm_s_by_rank: list[float]
    rss_mb_by_rank: list[float]
    peak_rss_mb_by_rank: list[float]
    samples_by_rank: list[int]
    eval_loss: float | None = None
    grad_norm: float | None = None  # the global gradient norm before clipping
    lr: float | None = None  # the learning rate this step's update used
    extra: dict[str, Any] | None = None
    nonfinite: str | None = None  # what was not finite this step ("the loss", "the gradient of ...")
    skipped: bool = False  # the update was skipped for it (on_nonfinite = "skip")


def gather_step(
    comm: Comm, step: int, values: dict[str, float], global_tokens: float, found: NonFinite | None = None
) -> StepRecord:
    """All-gather each rank's figures and combine them (every rank gets the same record).

    ``found``: what this rank saw not finite this step; the record's verdict is the gravest of all.
    """
    values = {**values, "nonfinite": 0 if found is None else 2 if found.stop else 1}
    mine = torch.tensor([float(values[f]) for f in FIELDS], dtype=torch.float64)
    everyone = torch.empty(comm.world_size * len(FIELDS), dtype=torch.float64)
    comm.all_gather(everyone, mine)
    rows = everyone.view(comm.world_size, len(FIELDS)).T.tolist()
    column = dict(zip(FIELDS, rows, strict=True))
    step_s = max(column["step_s"])
    verdict = int(max(column["nonfinite"]))
    return StepRecord(
        step=step,
        loss=sum(column["loss_share"]),
        tokens_per_s=global_tokens / step_s if step_s > 0 else 0.0,
        step_s=step_s,
        comm_s=max(column["comm_s"]),
        bytes_sent=column["bytes_sent"],
        step_s_by_rank=column["step_s"],
        comm_s_by_rank=column["comm_s"],
        rss_mb_by_rank=column["rss_mb"],
        peak_rss_mb_by_rank=column["peak_rss_mb"],
        samples_by_rank=[int(s) for s in column["samples"]],
        nonfinite=(found.what if found else ELSEWHERE) if verdict else None,
        skipped=verdict == 1,
    )


class MetricsWriter:
    """Appends one JSON object per record to ``<run_dir>/metrics.jsonl`` (the reporting rank only),
    and the same scalars to TensorBoard event files when ``tensorboard`` is set."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self._board = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._board = TensorBoard(run_dir) if tensorboard else None

    def write(self, record: StepRecord | dict[str, Any]) -> None:
        if self.enabled:
            row = asdict(record) if isinstance(record, StepRecord) else record
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            if self._board is not None:
                self._board.write(row)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._board is not None:
                self._board.close()
