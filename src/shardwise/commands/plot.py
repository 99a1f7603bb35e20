"""``shardwise plot RUN_DIR`` (curves) and ``shardwise plot timeline RUN_DIR`` (a trace's lanes).

Reads the run's files only, so it works on a finished run and on one still running. No processes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shardwise.observe.plots import PlotError, plot_run, plot_timeline


def add_plot_parser(sub: Any) -> None:
    plot = sub.add_parser(
        "plot",
        help="PNG plots of a run: loss, tokens/s, per-rank step time and communication, memory",
        description="shardwise plot RUN_DIR | shardwise plot timeline RUN_DIR",
    )
    plot.add_argument(
        "target", nargs="+", metavar="[timeline] RUN_DIR", help="a --run-dir of shardwise train"
    )
    plot.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots)")
    plot.add_argument("--steps", type=int, default=3, help="timeline: the last N steps (default 3)")
    plot.set_defaults(run=plot_command)


def plot_command(args: argparse.Namespace) -> int:
    timeline = args.target[0] == "timeline"
    folders = args.target[1:] if timeline else args.target
    if len(folders) != 1:
        print(
            "shardwise plot: error: give one run folder: shardwise plot [timeline] RUN_DIR", file=sys.stderr
        )
        return 2
    run_dir = Path(folders[0])
    out = Path(args.out) if args.out else None
    try:
        if timeline:
            written = [plot_timeline(run_dir, out / "timeline.png" if out else None, args.steps)]
        else:
            written = plot_run(run_dir, out)
    except PlotError as err:
        print(f"shardwise plot: error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
