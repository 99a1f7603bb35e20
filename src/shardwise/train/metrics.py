"""Per-step figures: time, tokens/s, communication, memory; gathered from every rank to rank 0.

Each step every rank contributes one small float64 vector (its loss share, step time, time blocked in
communication, bytes sent, current and peak RSS, on a GPU the allocator's peaks (``device.memory_mb``),
samples, and whether it saw a non-finite value: 0 none, 1 skipped, 2 stop); one all-gather brings
them to every rank, which gives the global loss (sum of shares), per-rank figures, and one verdict on
non-finite values for all (ranks whose verdicts may differ, asynchronous parameter-server workers,
thus stop in the same step) at the cost of a single tiny collective. These are host figures: the
vector is a host tensor, gathered over gloo.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.collectives.api import Comm
from shardwise.device import HOST
from shardwise.engine.nonfinite import NonFinite
from shardwise.observe.tensorboard import TensorBoard

FIELDS = (
    *("loss_share", "step_s", "comm_s", "bytes_sent", "rss_mb", "peak_rss_mb", "samples", "nonfinite"),
    *("max_memory_allocated_mb", "max_memory_reserved_mb"),  # 0 on the CPU: only a GPU has them
)
# what another rank found not finite, where this one found nothing (asynchronous workers differ)
ELSEWHERE = "a loss or gradient of another worker"


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
    # on a GPU: the caching allocator's peaks per rank (tensors; what it holds); None on the CPU
    max_memory_allocated_mb_by_rank: list[float] | None = None
    max_memory_reserved_mb_by_rank: list[float] | None = None
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
    mine = torch.tensor([float(values.get(f, 0.0)) for f in FIELDS], dtype=torch.float64, device=HOST)
    everyone = torch.empty(comm.world_size * len(FIELDS), dtype=torch.float64, device=HOST)
    comm.all_gather(everyone, mine)
    rows = everyone.view(comm.world_size, len(FIELDS)).T.tolist()
    column = dict(zip(FIELDS, rows, strict=True))
    step_s = max(column["step_s"])
    verdict = int(max(column["nonfinite"]))
    on_gpu = "max_memory_allocated_mb" in values
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
        max_memory_allocated_mb_by_rank=column["max_memory_allocated_mb"] if on_gpu else None,
        max_memory_reserved_mb_by_rank=column["max_memory_reserved_mb"] if on_gpu else None,
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
