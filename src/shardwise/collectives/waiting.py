"""Waiting on communication, and counting it: what every ``Comm`` call hands back.

``CommStats`` counts a ``Comm``'s calls, bytes and the time it blocked. ``Watched`` wraps the work of
one call: waiting on it is charged to the blocked time and told to the monitor (the hang watchdog's
and the trace's source). On a GPU, NCCL's ``wait()`` returns at once having made the current stream
wait, so the time is the stream's, between CUDA events around the wait (settled when the stats are
read: once a step), and the call stays in flight for the monitor until its work completes. ``Then``
runs a local step once a work completes (averaging; a staged copy back to the GPU). No communication
of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.collectives.p2p import Work
from shardwise.observe.monitor import MONITOR, Call


class Then:
    """Backend work followed by a local step (averaging) once it completes."""

    def __init__(self, work: dist.Work | Work, after: Callable[[], None]) -> None:
        self._work, self._after, self._done = work, after, False

    def wait(self) -> bool:
        if not self._done:
            self._work.wait()
            self._after()
            self._done = True
        return True


@dataclass
class CommStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    blocked_s: float = 0.0  # time spent inside synchronous calls and waits
    ops: dict[str, int] = field(default_factory=dict)  # calls that communicated, by op ("all_reduce", ...)
    labels: dict[str, int] = field(default_factory=dict)  # ... by the label the caller gave ("grad norm")
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # CUDA: (before, after) events around each wait on the stream, added to blocked_s when read
    _events: list[tuple[Any, Any]] = field(default_factory=list, repr=False, compare=False)

    def add_stream_wait(self, before: Any, after: Any) -> None:
        """A wait on a GPU stream, between two recorded CUDA events (timed when the stats are read)."""
        with self._lock:
            self._events.append((before, after))

    def _settle(self) -> None:
        """Turn the recorded stream waits into seconds (waits for the last one: once per read)."""
        with self._lock:
            events, self._events = self._events, []
        if events:
            events[-1][1].synchronize()
            self.add(blocked_s=sum(a.elapsed_time(b) for a, b in events) / 1000.0)

    def add(self, sent: int = 0, received: int = 0, blocked_s: float = 0.0) -> None:
        """Count from any thread (the communication thread counts its messages here too)."""
        with self._lock:
            if sent:
                self.bytes_sent += sent
            if received:
                self.bytes_received += received
            if blocked_s:
                self.blocked_s += blocked_s

    def snapshot(self) -> CommStats:
        self._settle()
        ops, labels = dict(self.ops), dict(self.labels)
        return CommStats(self.calls, self.bytes_sent, self.bytes_received, self.blocked_s, ops, labels)

    def since(self, earlier: CommStats) -> CommStats:
        self._settle()
        return CommStats(
            self.calls - earlier.calls,
            self.bytes_sent - earlier.bytes_sent,
            self.bytes_received - earlier.bytes_received,
            self.blocked_s - earlier.blocked_s,
            _minus(self.ops, earlier.ops),
            _minus(self.labels, earlier.labels),
        )


def _minus(now: dict[str, int], earlier: dict[str, int]) -> dict[str, int]:
    return {key: n - earlier.get(key, 0) for key, n in now.items() if n != earlier.get(key, 0)}


def required(work: dist.Work | None) -> Work:
    if work is None:
        raise RuntimeError("a point-to-point call returned no work: this rank is not in the group")
    return work


class Watched:
    """Waiting on ``work``: the time is charged to the layer's blocked time, and the monitor knows
    which call this rank waits in (the hang watchdog's and the trace's source).

    ``cuda``: the call's tensors are on a GPU, where ``wait()`` returns at once having made the current
    stream wait (NCCL): the time is the stream's, between CUDA events around the wait, and the monitor
    keeps the call in flight until ``backend_work`` reports it completed."""

    def __init__(
        self, work: Work, stats: CommStats, call: Call, cuda: bool = False, backend_work: Any = None
    ) -> None:
        self._work, self._stats, self._call = work, stats, call
        self._cuda, self._backend_work = cuda, backend_work

    def wait(self) -> object:
        start = time.perf_counter()
        MONITOR.wait_start(self._call)
        before = stream_event() if self._cuda else None
        try:
            return self._work.wait()
        finally:
            if before is not None:
                self._stats.add_stream_wait(before, stream_event())
                MONITOR.in_flight(self._call, self._backend_work)
            else:
                self._stats.add(blocked_s=time.perf_counter() - start)
            MONITOR.wait_end(self._call)


def stream_event() -> Any:
    """A timing event recorded now on the current CUDA stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class Inline:
    """An explicit algorithm run on the caller's thread: waiting for it is running it."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run = run

    def wait(self) -> bool:
        self._run()
        return True
