"""TensorBoard event files beside ``metrics.jsonl``, with the same scalars (``--tensorboard``).

Written by the reporting rank through tensorboardX (the ``tensorboard`` extra), which needs no
TensorFlow: ``tensorboard --logdir RUN_DIR/tensorboard`` shows them. No communication.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SCALARS = ("loss", "eval_loss", "tokens_per_s", "step_s", "comm_s", "grad_norm", "lr")
PER_RANK = ("step_s_by_rank", "comm_s_by_rank", "rss_mb_by_rank")


def available() -> bool:
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoard:
    """One event-file writer under ``<run_dir>/tensorboard``; ``write(row)`` takes a metrics row."""

    def __init__(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(run_dir / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for name in SCALARS:
            value = row.get(name)
            if isinstance(value, int | float) and math.isfinite(value):
                self._writer.add_scalar(f"train/{name}", value, step)
        for name in PER_RANK:
            for rank, value in enumerate(row.get(name) or []):
                self._writer.add_scalar(f"ranks/{name.removesuffix('_by_rank')}/rank{rank}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
