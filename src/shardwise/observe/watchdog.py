"""The hang watchdog: when a rank has waited in a call too long, name the rank that holds it up.

Pattern: every rank runs one daemon thread. Every ``interval_s`` it publishes this rank's monitor
snapshot (step, phase, the call it waits in, the newest call on each group, its innermost frames) to
the job's store under ``watchdog/rank<r>``: one small ``set`` per second, no collective. When the
main thread has been blocked in one call for longer than ``timeout_s``, the thread reads every rank's
snapshot and :func:`diagnose` names the culprit in one line:

- a rank whose snapshot has not changed for a while stopped (SIGSTOP, a debugger, a dead host): its
  last snapshot says where it was;
- a rank that has not yet issued the call the others wait in (it is behind: still computing, or
  stuck elsewhere): its phase, step and frames say where;
- a rank that waits in a *different* call on the same group at the same sequence number: mismatched
  collectives (a rank skipped or reordered one).

The first rank to see the hang (an atomic ``add`` on the store) prints the line and ends the ranks of
its host that stopped responding (a stopped process ignores the launcher's SIGTERM); every rank that
sees it then exits with ``HANG_EXIT_CODE``, so the launcher stops the job, or restarts it under
``--max-restarts``. PyTorch's flight recorder dumps per-rank rings for offline analysis; this names
the rank while the job runs. ``timeout_s`` of the process group stays the backstop behind it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from shardwise.observe.monitor import MONITOR, Monitor

HANG_EXIT_CODE = 86
# set by shardwise's launcher: the file the line also goes to, so the launcher knows why the job ended
HANG_REPORT_ENV = "SHARDWISE_HANG_REPORT"
STALE_AFTER_INTERVALS = 4  # a snapshot this many publishing intervals old: the rank has stopped


class Store(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...


State = Mapping[str, Any]  # one rank's published snapshot (Monitor.snapshot) with its age_s


def diagnose(me: int, mine: State, states: Mapping[int, State | None], stale_s: float) -> str:
    """One line naming why rank ``me`` (``mine``: its snapshot) has waited so long.

    ``states`` holds every rank's newest snapshot (None: never published) with ``age_s``, the seconds
    since that rank last published. Pure, so it is tested on made-up states.
    """
    waiting = mine["blocked"]
    call = f"{waiting['op']} #{waiting['seq']} on {waiting['group']}" + _label(waiting)
    where = f"rank {me} has waited {mine['blocked_for_s']:.0f} s in {call} (step {mine['step']})"
    for rank, state in sorted(states.items()):
        if rank == me:
            continue
        if state is None:
            return f"hang: rank {rank} never published its state (it stopped or died at start-up); {where}"
        if state["age_s"] > stale_s:
            return (
                f"hang: rank {rank} stopped responding {state['age_s']:.0f} s ago (stopped or dead); "
                f"it was {_doing(state)}; {where}"
            )
    for rank, state in sorted(states.items()):
        if rank == me or state is None:
            continue
        theirs = state["last"].get(waiting["group"])
        if theirs is None or theirs["seq"] < waiting["seq"]:
            return f"hang: rank {rank} has not entered {call}; it is {_doing(state)}; {where}"
        if theirs["seq"] == waiting["seq"] and theirs["op"] != waiting["op"]:
            return (
                f"hang: mismatched collectives on {waiting['group']}: rank {me} is in {call}, rank {rank} in "
                f"{theirs['op']} #{theirs['seq']}{_label(theirs)}; {_doing(state)}"
            )
    return f"hang: every rank has entered {call}, yet it does not complete (the network?); {where}"


def _label(call: Mapping[str, Any]) -> str:
    return f" ({call['label']})" if call.get("label") else ""


def _doing(state: Mapping[str, Any]) -> str:
    """``in backward of step 120 since 45 s, waiting in all_gather #9 on trainers (at loop.py:140 ...)``."""
    text = f"in {state['phase']} of step {state['step']} since {state['phase_for_s']:.0f} s"
    blocked = state.get("blocked")
    if blocked:
        text += f", waiting in {blocked['op']} #{blocked['seq']} on {blocked['group']}{_label(blocked)}"
    if state.get("frame"):
        text += f" (at {state['frame']})"
    return text


class Watchdog:
    """The publishing and checking thread of one rank (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        interval_s: float = 1.0,
        monitor: Monitor = MONITOR,
        on_hang: Callable[[str | None, Mapping[int, State | None], float], None] | None = None,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.interval_s, self.monitor = timeout_s, interval_s, monitor
        self.on_hang = on_hang or _exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardwise-watchdog", daemon=True)
        self._published: dict[int, tuple[str, float]] = {}  # rank -> (snapshot text, first seen)

    def start(self) -> Watchdog:
        self.tick()  # published at once: a rank stopped within its first second is still known
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception as error:  # a store that went away (the job is ending): stop watching
                if not self._stop.is_set():
                    print(f"shardwise: rank {self.rank}: the hang watchdog stopped: {error}", file=sys.stderr)
                return

    def timeout(self) -> float:
        """The configured timeout; -1 (automatic): 5 x the median step time, at least 30 s."""
        if self.timeout_s >= 0:
            return self.timeout_s
        times = sorted(self.monitor.step_times[-50:])
        median = times[len(times) // 2] if times else 0.0
        return max(30.0, 5 * median)

    def tick(self) -> None:
        snapshot = self.publish()
        if snapshot["blocked"] and snapshot["blocked_for_s"] > self.interval_s:
            # watch the others from the start of a long wait, not from the report: a rank's age counts
            # from when this rank first saw its snapshot, so read only at the report it would be the
            # report's few seconds, however long the rank has been gone
            self.states()
        limit = self.timeout()
        if snapshot["blocked"] and limit > 0 and snapshot["blocked_for_s"] > limit:
            self.report(snapshot)

    def publish(self) -> dict[str, Any]:
        snapshot = self.monitor.snapshot()
        snapshot["seq"] = time.monotonic()  # changes every publish: a stopped rank's does not
        self.store.set(f"watchdog/rank{self.rank}", json.dumps(snapshot))
        return snapshot

    def states(self) -> dict[int, dict[str, Any] | None]:
        """Every rank's newest snapshot, with ``age_s``: how long it has stayed the same here."""
        now, out = time.monotonic(), dict[int, dict[str, Any] | None]()
        for rank in range(self.world_size):
            key = f"watchdog/rank{rank}"
            if not self.store.check([key]):
                out[rank] = None
                continue
            text = self.store.get(key).decode()
            previous = self._published.get(rank)
            first_seen = previous[1] if previous and previous[0] == text else now
            self._published[rank] = (text, first_seen)
            out[rank] = {**json.loads(text), "age_s": now - first_seen}
        return out

    def report(self, mine: dict[str, Any]) -> None:
        self.states()
        for _ in range(STALE_AFTER_INTERVALS + 1):  # long enough to tell a stopped rank from a live one
            time.sleep(self.interval_s)
            self.publish()  # this rank is alive: the others, looking too, must see it change
        states = self.states()
        stale_s = self.interval_s * STALE_AFTER_INTERVALS
        line = diagnose(self.rank, mine, states, stale_s)
        first = self.store.add("watchdog/reported", 1) == 1
        self.on_hang(line if first else None, states if first else {}, stale_s)


def _kill_stopped(states: Mapping[int, State | None], stale_s: float) -> None:
    """End this host's ranks that stopped responding (SIGSTOP, a debugger): a stopped process ignores
    the launcher's SIGTERM until someone continues it, which would hold the job's end for long."""
    host, me = socket.gethostname(), os.getpid()
    for state in states.values():
        if (
            state
            and state["age_s"] > stale_s
            and state.get("host") == host
            and state.get("pid") not in (None, me)
        ):
            with contextlib.suppress(OSError):
                os.kill(int(state["pid"]), signal.SIGKILL)


def _exit(line: str | None, states: Mapping[int, State | None], stale_s: float) -> None:
    """Say it once (the first rank that saw it), end this host's stopped ranks, then leave: the
    launcher stops or restarts the job."""
    if line:
        print(f"shardwise: {line}", file=sys.stderr, flush=True)  # now, not when the job has ended
        report = os.environ.get(HANG_REPORT_ENV)
        if report:
            with contextlib.suppress(OSError):
                Path(report).write_text(line + "\n")
        _kill_stopped(states, stale_s)
    else:
        time.sleep(0.5)  # let the first reporter's line out before the agent stops everyone
    os._exit(HANG_EXIT_CODE)
