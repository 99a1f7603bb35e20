"""Rank 0's progress bar on stderr: step, loss, held-out loss, tokens/s, communication share."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from shardwise.train.metrics import StepRecord


class Progress:
    """A bar that is a no-op on ranks other than 0 (or when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: RichProgress | None = None
        if not enabled:
            return
        self._bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("eval {task.fields[eval]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("comm {task.fields[comm]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task("train", total=total, loss="-", eval="-", tps="-", comm="-")
        self._bar.start()

    def update(self, record: StepRecord) -> None:
        if self._bar is None:
            return
        fields = {
            "loss": f"{record.loss:.3f}",
            "tps": f"{record.tokens_per_s:,.0f}",
            "comm": f"{100 * record.comm_s / record.step_s:.0f}%" if record.step_s else "-",
        }
        if record.eval_loss is not None:
            fields["eval"] = f"{record.eval_loss:.3f}"
        self._bar.update(self._task, advance=1, **fields)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
