"""Pictures of a run, from its files: curves from ``metrics.jsonl``, lanes from ``trace.json``.

``plot_run`` draws four PNGs (train and held-out loss; tokens/s; per-rank step time with the share of
it spent blocked in communication; per-rank memory) and ``plot_timeline`` one (each rank a lane,
compute and communication in their own rows and colours, the time no span covers shaded as idle, and
a dashed line where each of the rank's steps begins, labelled with the step's number as
``metrics.jsonl`` counts it, from 0).
Both read only what the run wrote, so they work on a finished run and on one still running (a row
still being written is skipped). matplotlib (the ``plot`` extra) is imported only here. No
communication.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLORS = {
    "compute": "#4C72B0",
    "comm": "#DD8452",
    "step": "#BBBBBB",
    "checkpoint": "#55A868",
    "eval": "#8172B3",
}


class PlotError(RuntimeError):
    """Nothing to plot, or matplotlib missing; the message says which and what to do."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("plots need matplotlib: pip install shardwise[plot]") from None
    return plt


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``; a last row still being written is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise PlotError(f"{path} does not exist: is {run_dir} a run folder (shardwise train --run-dir)?")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a row being written right now
    if not rows:
        raise PlotError(f"{path} has no rows yet")
    return rows


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """loss.png, throughput.png, ranks.png and memory.png under ``out_dir`` (default: the run's
    ``plots/``); returns their paths."""
    plt, rows = _pyplot(), read_metrics(run_dir)
    out = out_dir or run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train")
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out")
    _finish(ax, "loss per item", "step", "loss")
    written.append(_save(fig, out / "loss.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["tokens_per_s"] for r in rows])
    _finish(ax, "throughput", "step", "tokens / s")
    written.append(_save(fig, out / "throughput.png"))
    written.append(_ranks(plt, rows, steps, out / "ranks.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    for rank, series in enumerate(zip(*[r["rss_mb_by_rank"] for r in rows], strict=True)):
        ax.plot(steps, series, label=f"rank {rank}")
    _finish(ax, "resident memory", "step", "MB")
    written.append(_save(fig, out / "memory.png"))
    return written


def _ranks(plt: Any, rows: list[dict[str, Any]], steps: list[int], path: Path) -> Path:
    """Per-rank step time (top) and the share of it blocked in communication (bottom)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    by_rank = list(zip(*[r["step_s_by_rank"] for r in rows], strict=True))
    comm = list(zip(*[r["comm_s_by_rank"] for r in rows], strict=True))
    for rank, (times, blocked) in enumerate(zip(by_rank, comm, strict=True)):
        top.plot(steps, [1000 * t for t in times], label=f"rank {rank}")
        bottom.plot(steps, [100 * b / t if t else 0.0 for b, t in zip(blocked, times, strict=True)])
    _finish(top, "step time per rank", None, "ms")
    _finish(bottom, "share of the step blocked in communication", "step", "%", legend=False)
    return _save(fig, path)


def _finish(ax: Any, title: str, xlabel: str | None, ylabel: str, legend: bool = True) -> None:
    ax.set_title(title)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend()


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


SIMULATED = "simulated.json"  # a pipeline run's simulated timeline, beside its trace.json
KIND_COLORS = {"F": "#4C72B0", "B": "#C44E52", "I": "#DD8452", "W": "#55A868"}


def plot_timeline(run_dir: Path, out: Path | None = None, last_steps: int = 3) -> Path:
    """timeline.png: the last ``last_steps`` steps of ``trace.json``, one lane per rank; where the run
    recorded pipeline actions, each action is drawn by kind with its name, the bubble (idle over total
    between the first and the last action) in the title, and when the run folder also holds
    ``simulated.json`` (``bench pipeline --trace``) the simulator's timeline is a second panel below."""
    path = run_dir / "trace.json"
    if not path.exists():
        raise PlotError(f"{path} does not exist: train with --trace to record one")
    panels = [("measured", _events(path))]
    if (run_dir / SIMULATED).exists():
        panels.append(("simulated", _events(run_dir / SIMULATED)))
    plt = _pyplot()
    ranks = sorted({e["pid"] for _, events in panels for e in events})
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(11, len(panels) * (1.2 + 0.9 * len(ranks))), squeeze=False
    )
    for ax, (label, events) in zip(axes[:, 0], panels, strict=True):
        if any(_is_action(e) for e in events):
            _actions_panel(ax, label, events, ranks, last_steps)
        else:
            window = _window(events, last_steps)
            for lane, rank in enumerate(ranks):
                mine = [e for e in events if e["pid"] == rank and window[0] <= e["ts"] <= window[1]]
                _lane(ax, lane, mine, window)
                for x, mark in step_marks(mine, window[0]):
                    ax.vlines(x, lane - 0.45, lane + 0.45, colors="black", linestyles="dashed", linewidth=0.8)
                    ax.text(x, lane - 0.47, f" {mark}", fontsize=7, va="bottom")
            ax.set_title(
                f"timeline of the last {last_steps} steps (blue compute, orange communication, grey idle; "
                "dashed: a step begins)"
            )
        ax.set_yticks(list(range(len(ranks))), [f"rank {r}" for r in ranks])
        ax.set_xlabel("ms")
        ax.invert_yaxis()
    return _save(fig, out or run_dir / "plots" / "timeline.png")


def _events(path: Path) -> list[dict[str, Any]]:
    """The complete spans (``"ph": "X"``) of a Chrome trace at ``path``, each checked for what the
    drawing reads, or a one-line ``PlotError`` saying what is wrong with the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlotError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if not data.strip():
        raise PlotError(f"{path} is empty: nothing to draw; train with --trace to write a trace")
    try:
        document = json.loads(data)
    except ValueError as exc:  # not JSON, not UTF-8, empty, or cut short
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise PlotError(
            f"{path} is not JSON ({str(exc).split(':')[0]}{where}): empty, cut short or not a trace; "
            "train with --trace to write one"
        ) from None
    events = document.get("traceEvents") if isinstance(document, dict) else document  # or a bare array
    if not isinstance(events, list):
        raise PlotError(
            f'{path} is not a trace: "traceEvents" should be a list of events, got {type(events).__name__}'
        )
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    if not spans:
        raise PlotError(f"{path} holds no spans (events with \"ph\": \"X\"): nothing to draw")
    for i, event in enumerate(spans):
        if problem := _span_problem(event):
            raise PlotError(f"{path}: span {i} ({json.dumps(event)[:80]}) {problem}")
    return spans


def _span_problem(event: dict[str, Any]) -> str | None:
    """What a span lacks for the drawing (None: nothing)."""

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value

    if not isinstance(event.get("pid"), int) or isinstance(event.get("pid"), bool):
        return "has no integer pid (the rank)"
    if not number(event.get("ts")) or not number(event.get("dur")) or event["dur"] < 0:
        return "needs numbers ts and dur >= 0 (microseconds)"
    if not isinstance(event.get("name", ""), str) or not isinstance(event.get("args", {}), dict):
        return "needs a string name and an args object"
    kind = event.get("args", {}).get("kind")
    if kind is not None and kind not in KIND_COLORS:
        return f"has a pipeline action of kind {kind!r}; kinds are {', '.join(KIND_COLORS)}"
    return None


def _is_action(event: dict[str, Any]) -> bool:
    return "kind" in event.get("args", {})


def _actions_panel(
    ax: Any, label: str, events: list[dict[str, Any]], ranks: list[int], last_steps: int
) -> None:
    """A pipeline's actions, one lane per rank, coloured by kind and named; idle shaded; the bubble in
    the title (``trace.idle_fraction`` over the actions of the chosen steps)."""
    from shardwise.observe.trace import idle_fraction

    step_window = _window(events, last_steps)
    every = [e for e in events if _is_action(e)]
    actions = [e for e in every if step_window[0] <= e["ts"] <= step_window[1]] or every
    start = min(e["ts"] for e in actions)
    end = max(e["ts"] + e["dur"] for e in actions)
    for lane, rank in enumerate(ranks):
        ax.broken_barh([(0, (end - start) / 1000)], (lane - 0.4, 0.8), color="#EEEEEE")  # idle
        for e in (e for e in actions if e["pid"] == rank):
            left, width = (e["ts"] - start) / 1000, e["dur"] / 1000
            color = KIND_COLORS[e["args"]["kind"]]
            ax.broken_barh([(left, width)], (lane - 0.4, 0.8), color=color, edgecolor="white", linewidth=0.5)
            if width > (end - start) / 1000 / 40:  # a name only where it fits
                ax.text(
                    left + width / 2, lane, e["name"], ha="center", va="center", fontsize=7, color="white"
                )
    busy = {r: [(e["ts"], e["dur"]) for e in actions if e["pid"] == r] for r in ranks}
    ax.set_title(
        f"{label}: bubble {100 * idle_fraction(busy):.1f}% (idle / total; "
        "blue F, red B, orange I, green W, grey idle)"
    )


def step_marks(events: list[dict[str, Any]], start: float) -> list[tuple[float, str]]:
    """(ms from ``start``, "step N") where each step span among a rank's ``events`` begins."""
    steps = sorted((e for e in events if e.get("cat") == "step"), key=lambda e: e["ts"])
    return [((e["ts"] - start) / 1000, e["name"]) for e in steps]


def _window(events: list[dict[str, Any]], last_steps: int) -> tuple[float, float]:
    """From the first rank's start of the last ``last_steps`` steps to the last rank's end of them
    (each rank records its own span of a step: the window counts steps, not spans)."""
    steps = [e for e in events if e.get("cat") == "step"]
    first: dict[str, float] = {}
    for e in steps:
        first[e["name"]] = min(e["ts"], first.get(e["name"], e["ts"]))
    names = sorted(first, key=first.__getitem__)
    chosen = [e for e in steps if e["name"] in names[-last_steps:]] if steps else events
    return min(e["ts"] for e in chosen), max(e["ts"] + e["dur"] for e in chosen)


def _lane(ax: Any, lane: int, events: list[dict[str, Any]], window: tuple[float, float]) -> None:
    """A rank's row: compute above, communication below, idle (no compute span) shaded."""
    start = window[0]
    ax.broken_barh([(0, (window[1] - start) / 1000)], (lane - 0.4, 0.8), color="#EEEEEE")  # idle
    for category, offset in (("compute", -0.4), ("comm", 0.0)):
        spans = [
            ((e["ts"] - start) / 1000, (min(e["ts"] + e["dur"], window[1]) - e["ts"]) / 1000)
            for e in events
            if e.get("cat") == category
        ]
        ax.broken_barh(spans, (lane + offset, 0.4), color=COLORS[category])
