"""``shardwise train``: N local ranks through the elastic agent, or one rank of a torchrun job."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from shardwise.commands.output import emit
from shardwise.config import TrainConfig
from shardwise.launcher import LaunchError, launch_local, running_under_torchrun, torchrun_world_size
from shardwise.preflight import preflight
from shardwise.train.loop import train_worker


def train_command(config: TrainConfig, nproc: int, as_json: bool) -> int:
    if running_under_torchrun():
        # torchrun started the ranks: each checks before it joins the group (the same verdict on every
        # rank, and every rank writes into the run's folders), so a bad job stops at once, in one line
        preflight(config, torchrun_world_size())
        summary = train_worker(config, show_progress=True)
        return _finish(summary, as_json) if summary is not None else 0
    preflight(config, nproc)  # a bad config fails here in one line, before any process starts
    try:
        results = launch_local(train_worker, (config, True), nproc, config.max_restarts)
    except LaunchError as exc:
        return exc.report("train")
    return _finish(next(r for r in results.values() if r is not None), as_json)


def _finish(summary: dict[str, Any], as_json: bool) -> int:
    """Print the summary (exit 0), or the one line of a run that stopped on a non-finite value (exit 1).

    Every rank returned normally from such a run, so the agent does not restart it: the same steps
    would diverge again.
    """
    if "error" in summary:
        print(f"shardwise train: error: {summary['error']}", file=sys.stderr, flush=True)
        return 1
    emit(summary, as_json, render_summary)
    return 0


def render_summary(summary: dict[str, Any]) -> None:
    console = Console(soft_wrap=True)  # long lines stay whole in logs and pipes
    console.print(
        f"[bold]{summary['strategy']}[/] on {summary['world_size']} ranks ({summary['layout']}), "
        f"{summary['steps']} steps: "
        f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}"
        + (f", held-out {summary['eval_loss']:.4f}" if summary.get("eval_loss") is not None else "")
        + f", {summary['tokens_per_s']:,.0f} tokens/s"
    )
    label = "worker rank" if summary["strategy"] == "ps" else "rank"
    table = Table(label, "samples/step", "step s (median)", "sent MB/step", "peak RSS MB")
    first = summary["world_size"] - summary["training_ranks"]  # parameter servers come first
    for rank, peak in enumerate(summary["peak_rss_mb_by_rank"]):
        table.add_row(
            str(first + rank),
            str(summary["samples_per_step_by_rank"][rank]),
            f"{summary['step_s_median_by_rank'][rank]:.4f}",
            f"{summary['bytes_sent_per_step_by_rank'][rank] / 2**20:.2f}",
            f"{peak:.0f}",
        )
    console.print(table)
    if stages := summary.get("pipeline_stages"):
        console.print(f"pipeline stages: {stage_blocks(stages, summary['pipeline_placement'])}")
    ckpt = summary.get("checkpoint")
    if ckpt:
        step = ckpt["resumed_at_step"]
        resumed = f", resumed at step {step}" if step is not None else ""
        mode = "async" if ckpt["async"] else "sync"
        console.print(
            f"checkpoints: {ckpt['saves']} saved ({mode}, blocked {ckpt['blocked_s_total']:.2f} s in all) "
            f"in {ckpt['dir']}{resumed}; restarts {summary['restarts']}"
        )
    console.print(f"metrics: {summary['run_dir']}/metrics.jsonl")


def stage_blocks(stages: list[list[int]], placement: list[int]) -> str:
    """Every stage's blocks and pp rank in a line: ``[[0, 1, 2], [3, 4]]`` on ``[0, 1]`` is
    ``blocks 0-2 on pp rank 0 | 3-4 on 1``."""
    cells = [f"{b[0]}-{b[-1]}" if len(b) > 1 else str(b[0]) for b in stages]
    return " | ".join(
        f"blocks {cell} on pp rank {rank}" if k == 0 else f"{cell} on {rank}"
        for k, (cell, rank) in enumerate(zip(cells, placement, strict=True))
    )
