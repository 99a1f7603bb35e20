"""What this rank is doing right now, and (when tracing) what it did: one recorder per process.

Every ``Comm`` call is issued here with its group's sequence number (``issue``) and every wait on one
is bracketed (``wait_start`` / ``wait_end``); the train loop says which step and phase it is in
(``set_phase``). The hang watchdog (``observe.watchdog``) publishes ``snapshot()`` to the job's store
and reads the other ranks'; the tracer (``observe.trace``) takes the spans recorded while
``tracing`` is on. No communication here: plain attribute writes on the hot path (a few hundred
nanoseconds per call), read by the watchdog's thread without locks (a torn read only ever shows a
state one call old).

On a GPU, NCCL's ``wait()`` returns at once (the stream waits, not the host), so a call that never
completes would leave no trace of it where the host later blocks (reading the loss, say). Such calls
are kept ``in_flight`` with their backend work until it reports completion (``is_completed``, a query
of a CUDA event: no synchronisation); while the main thread is not blocked in a wait of its own, the
oldest call still in flight is what the snapshot says this rank waits in, so the watchdog still names
the stuck rank and collective.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

# phases spent waiting for other ranks rather than computing: drawn as communication in timelines
WAITING_PHASES = {"gradient sync": "comm", "metrics": "comm"}


@dataclass
class Call:
    """One collective or point-to-point call on a group, numbered in issue order within the group."""

    group: str
    op: str
    seq: int
    label: str = ""  # what it carries: "bucket 2", "zero group 3", ...
    peer: int | None = None  # point-to-point: the other rank (in the group)
    issued: float = 0.0  # time.monotonic()

    def describe(self) -> str:
        where = f" from/to rank {self.peer}" if self.peer is not None else ""
        label = f" ({self.label})" if self.label else ""
        return f"{self.op} #{self.seq} on {self.group}{where}{label}"


@dataclass
class Span:
    """A Chrome-trace complete event: ``name`` from ``start`` for ``duration`` seconds on ``lane``."""

    name: str
    category: str  # compute | comm | step | checkpoint | eval
    lane: str
    start: float
    duration: float
    args: dict[str, Any] = field(default_factory=dict)


class Monitor:
    """The per-process recorder (see the module docstring); use the module's ``MONITOR``."""

    def __init__(self) -> None:
        self.step = -1
        self.phase, self.phase_since = "start", time.monotonic()
        self.last: dict[str, Call] = {}  # group -> the newest call issued on it
        self.blocked: Call | None = None  # the call the main thread waits in, if any
        self.blocked_since = 0.0
        self.pending: list[tuple[Call, Any]] = []  # GPU calls waited for but not yet complete (doc)
        self.step_times: list[float] = []
        self.tracing = False
        self.spans: list[Span] = []
        self._main = threading.main_thread().ident

    # -- the hot path -------------------------------------------------------------------------------
    def issue(self, group: str, op: str, seq: int, label: str = "", peer: int | None = None) -> Call:
        call = Call(group, op, seq, label, peer, time.monotonic())
        self.last[group] = call
        return call

    def wait_start(self, call: Call) -> None:
        if threading.get_ident() == self._main:
            self.blocked, self.blocked_since = call, time.monotonic()

    def wait_end(self, call: Call) -> None:
        now = time.monotonic()
        if self.blocked is call:
            self.blocked = None
        if self.tracing:
            self.spans.append(
                Span(call.describe(), "comm", f"comm {call.group}", call.issued, now - call.issued)
            )

    def in_flight(self, call: Call, work: Any) -> None:
        """A call whose ``wait()`` returned before it completed (NCCL): kept until ``work`` says it did.
        The completed ones are dropped here, on the main thread, so the list stays short."""
        if work is None or not hasattr(work, "is_completed"):
            return
        self.pending = [(c, w) for c, w in self.pending if not w.is_completed()] + [(call, work)]

    def _oldest_in_flight(self) -> Call | None:
        """The oldest call still running on the GPU (read from the watchdog's thread: a copy)."""
        for call, work in list(self.pending):
            if not work.is_completed():
                return call
        return None

    def set_phase(self, phase: str, step: int | None = None) -> None:
        """Enter ``phase`` (forward, backward, optimizer, checkpoint, eval, ...) of ``step``."""
        now = time.monotonic()
        if self.tracing and self.phase not in ("start", "idle"):
            category = WAITING_PHASES.get(self.phase, "compute")
            self.spans.append(Span(self.phase, category, "compute", self.phase_since, now - self.phase_since))
        if step is not None:
            self.step = step
        self.phase, self.phase_since = phase, now

    def span(self, name: str, category: str, lane: str, start: float, **args: Any) -> None:
        if self.tracing:
            self.spans.append(Span(name, category, lane, start, time.monotonic() - start, args))

    # -- read by the watchdog's thread -----------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready picture of this rank now (its main thread's innermost frames included)."""
        now = time.monotonic()
        blocked, since = self.blocked, self.blocked_since
        if blocked is None and (stuck := self._oldest_in_flight()) is not None:
            blocked, since = stuck, stuck.issued  # NCCL: the host went on, the collective did not
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "step": self.step,
            "phase": self.phase,
            "phase_for_s": round(now - self.phase_since, 3),
            "blocked": _call_json(blocked) if blocked else None,
            "blocked_for_s": round(now - since, 3) if blocked else 0.0,
            "last": {group: _call_json(call) for group, call in list(self.last.items())},
            "frame": self.main_frame(),
        }

    def main_frame(self, depth: int = 3) -> str:
        """The main thread's innermost frames, ``file:line in function`` (where it is stuck); nothing
        when asked on the main thread itself (it would only show itself asking)."""
        frame = sys._current_frames().get(self._main or -1)
        if frame is None or threading.get_ident() == self._main:
            return ""
        frames = traceback.extract_stack(frame)[-depth:]
        return " <- ".join(
            f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in reversed(frames)
        )


def _call_json(call: Call) -> dict[str, Any]:
    return {"group": call.group, "op": call.op, "seq": call.seq, "label": call.label, "peer": call.peer}


MONITOR = Monitor()
