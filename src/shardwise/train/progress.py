"""Progress on stderr from the reporting rank: step, loss, held-out loss, tokens/s, communication share.

On a terminal it is a live bar; when stderr is a file or a pipe (CI logs, ``| tee``) it is one plain
line every tenth of the run, which greps and wraps well.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from shardwise.train.metrics import StepRecord


def _fields(record: StepRecord) -> dict[str, str]:
    fields = {
        "loss": f"{record.loss:.3f}",
        "tps": f"{record.tokens_per_s:,.0f}",
        "comm": f"{100 * record.comm_s / record.step_s:.0f}%" if record.step_s else "-",
        "lr": f"{record.lr:.2e}" if record.lr is not None else "-",
        "norm": f"{record.grad_norm:.3g}" if record.grad_norm is not None else "-",
    }
    if record.eval_loss is not None:
        fields["eval"] = f"{record.eval_loss:.3f}"
    return fields


class Progress:
    """A no-op unless enabled; ``completed`` steps are already done (a resumed run)."""

    def __init__(self, total: int, enabled: bool, completed: int = 0) -> None:
        self._bar: RichProgress | None = None
        self._plain = enabled and not sys.stderr.isatty()
        self._total, self._done, self._eval = total, completed, "-"
        if not enabled or self._plain:
            return
        self._bar = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("eval {task.fields[eval]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("comm {task.fields[comm]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("|g| {task.fields[norm]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task(
            "train", total=total, completed=completed, loss="-", eval="-", tps="-", comm="-", lr="-", norm="-"
        )
        self._bar.start()

    def update(self, record: StepRecord) -> None:
        self._done += 1
        fields = _fields(record)
        if self._bar is not None:
            self._bar.update(self._task, advance=1, **fields)  # type: ignore[arg-type]  # task fields
        elif self._plain:
            self._eval = fields.get("eval", self._eval)
            every = max(1, self._total // 10)
            if self._done % every == 0 or self._done == self._total:
                print(
                    f"step {self._done}/{self._total}  loss {fields['loss']}  eval {self._eval}  "
                    f"{fields['tps']} tok/s  comm {fields['comm']}  lr {fields['lr']}  |g| {fields['norm']}",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
