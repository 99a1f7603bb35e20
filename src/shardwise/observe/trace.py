"""One Chrome-trace / Perfetto JSON for the whole job, every rank a process, clocks aligned.

Each rank records spans in its monitor while ``--trace`` is on (steps; forward, backward, gradient
sync and optimizer phases; each block's forward and backward; every collective from issue to
completion; checkpoints and evaluations) and writes them to ``<run_dir>/trace/rank<r>.json``; rank 0
then merges the files into ``<run_dir>/trace.json`` (open it in https://ui.perfetto.dev or
chrome://tracing). While the run goes, ``LiveTrace`` does the same every few seconds (each rank its
spans so far, rank 0 the merge of the files there are), so the trace of a run still going can be read
(``plot timeline``); every file is replaced whole, so a reader sees one write or the next.
Alignment: every rank takes its time origin right after the same barrier, so timestamps
agree to within that barrier's skew (tens of microseconds on one machine). The pipeline
runtime records a span per action and micro-batch (lane "actions", named like ``0F1``, its stage, kind
and micro-batch in ``args``); ``idle_fraction`` reads a bubble off them. Communication: none here
(the caller's barrier; the live writes go through the run folder).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from shardwise.observe.monitor import Monitor, Span

LANE_ORDER = ("step", "compute", "blocks")  # the rest (comm lanes) sorted after these


def rank_events(spans: Iterable[Span], rank: int, origin: float) -> list[dict[str, Any]]:
    """Chrome trace events (complete events, microseconds) of one rank's spans."""
    lanes: dict[str, int] = {}
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "ts": 0,
            "dur": 0,
            "pid": rank,
            "tid": 0,
            "args": {"name": f"rank {rank}"},
        }
    ]
    for span in spans:
        if span.lane not in lanes:
            lanes[span.lane] = _lane_id(span.lane, len(lanes))
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "ts": 0,
                    "dur": 0,
                    "pid": rank,
                    "tid": lanes[span.lane],
                    "args": {"name": span.lane},
                }
            )
        events.append(
            {
                "name": span.name,
                "cat": span.category,
                "ph": "X",
                "ts": round((span.start - origin) * 1e6, 3),
                "dur": round(max(span.duration, 0.0) * 1e6, 3),
                "pid": rank,
                "tid": lanes[span.lane],
                "args": span.args,
            }
        )
    return events


def idle_fraction(busy: dict[int, list[tuple[float, float]]]) -> float:
    """Idle over total time of ``busy`` ({rank: [(start, duration)]}): ``1 - sum(busy) / (p * window)``,
    the window running from the first start to the last end on any rank (a pipeline's bubble when the
    intervals are its actions; ``pipeline.simulate`` counts the same way). A rank with no interval
    is idle throughout."""
    every = [interval for intervals in busy.values() for interval in intervals]
    if not every:
        raise ValueError("no busy intervals: nothing was recorded")
    start = min(s for s, _ in every)
    window = max(s + d for s, d in every) - start
    if window <= 0:
        return 0.0
    return 1.0 - sum(d for _, d in every) / (len(busy) * window)


def _lane_id(lane: str, seen: int) -> int:
    return LANE_ORDER.index(lane) + 1 if lane in LANE_ORDER else len(LANE_ORDER) + 1 + seen


def write_rank(run_dir: Path, rank: int, monitor: Monitor, origin: float) -> Path:
    path = run_dir / "trace" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rank_events(list(monitor.spans), rank, origin)))  # a copy: spans grow
    os.replace(tmp, path)
    return path


def merge(run_dir: Path, world_size: int) -> Path:
    """``trace.json`` from every rank's file (rank 0, after the others wrote theirs)."""
    events: list[dict[str, Any]] = []
    for rank in range(world_size):
        part = run_dir / "trace" / f"rank{rank}.json"
        if part.exists():
            events.extend(json.loads(part.read_text()))
    out, tmp = run_dir / "trace.json", run_dir / "trace.json.tmp"
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    os.replace(tmp, out)
    return out


LIVE_EVERY_S = 5.0  # the live trace's period, stretched to 10x a write's own time (<= 10% of a core)


class LiveTrace:
    """Writes the trace while the run goes (a thread): every ``every_s`` seconds, or ten times as long
    as the last write took, this rank's spans so far, and on rank 0 the merge of the rank files there
    are. ``stop`` before the final write. A write that fails (a full disk) is left to the final one."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, monitor: Monitor, origin: float) -> None:
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.monitor, self.origin, self.wait_s = monitor, origin, LIVE_EVERY_S
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardwise-live-trace", daemon=True)

    def start(self) -> LiveTrace:
        (self.run_dir / "trace" / f"rank{self.rank}.json").unlink(missing_ok=True)  # a run's before
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.wait_s):
            begun = time.monotonic()
            try:
                write_rank(self.run_dir, self.rank, self.monitor, self.origin)
                if self.rank == 0:
                    merge(self.run_dir, self.world_size)
            except (OSError, ValueError):  # the disk, or a rank file from a run before: the end says
                continue
            self.wait_s = max(LIVE_EVERY_S, 10 * (time.monotonic() - begun))


def trace_blocks(blocks: nn.ModuleList | nn.Sequential | nn.ModuleDict, monitor: Monitor) -> list[Any]:
    """Hooks that record each block's forward and backward as spans; returns their handles. A pipeline
    stage's blocks are a ``ModuleDict`` keyed by the model's block index: spans keep that index."""
    handles = []
    numbered = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    for index, block in numbered:
        started: dict[str, float] = {}

        def before(kind: str, store: dict[str, float] = started) -> None:
            store[kind] = time.monotonic()

        def after(kind: str, index: str | int = index, store: dict[str, float] = started) -> None:
            if kind in store:
                monitor.span(f"block {index} {kind}", "compute", "blocks", store.pop(kind))

        handles.append(block.register_forward_pre_hook(lambda *_, b=before: b("forward")))
        handles.append(block.register_forward_hook(lambda *_, a=after: a("forward")))
        handles.append(block.register_full_backward_pre_hook(lambda *_, b=before: b("backward")))
        handles.append(block.register_full_backward_hook(lambda *_, a=after: a("backward")))
    return handles
