"""How local rank processes start: forked from a server that has already imported torch.

Python's ``spawn`` starts every rank as a fresh interpreter that imports torch again, about 1.5 s of
CPU per rank, and serially once ranks outnumber cores (8 ranks on 2 cores: several seconds before the
first step). multiprocessing's *forkserver* imports the modules in ``PRELOAD`` once; each rank is then a
fork of that clean, single-threaded process (never of the launcher, whose store and agent threads make
a plain fork unsafe). What a rank sees is otherwise what ``spawn`` gave it: it imports the caller's
main module by path or name, so functions are pickled by reference exactly as before.

Three things differ, and are mended here. The forkserver keeps the environment it started with, so the
launcher's environment is sent along and ``adopt_environment`` puts it in place in each rank. It keeps
the standard output and error it started with too (a test's capture that has since ended, say), so
``Stdio`` sends the launcher's present ones with each rank, which writes there. And it would share the
terminal's process group while it imports torch, where a Ctrl-C would print a traceback:
``start_early`` starts it with SIGINT ignored (it ignores SIGINT itself once running; ranks set their
own handlers).

No communication: process start-up only.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from multiprocessing import reduction
from typing import Any

# SHARDWISE_START_METHOD=spawn starts every rank as a fresh interpreter again (slower; an escape hatch)
START_METHOD = os.environ.get("SHARDWISE_START_METHOD", "forkserver")
# what every rank imports anyway; anything else a rank needs it imports itself (transformers, say).
# torch._dynamo: torch's Optimizer.__init__ imports it on first use, 1.7-2.5 s of CPU per rank
# (measured in a rank building our 1F1B engine: 2.3 s before, 0.19 s with it preloaded)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "shardwise.parallelism", "shardwise.train.loop")


def start_early() -> None:
    """Start the forkserver now (no-op once running), so its imports overlap the caller's own."""
    if START_METHOD != "forkserver":
        return
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


Context = multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext


def context() -> Context:
    """The context ranks are started from (the forkserver, started if it is not yet)."""
    start_early()
    ctx = multiprocessing.get_context(START_METHOD)
    if not isinstance(ctx, Context):
        raise ValueError(f"SHARDWISE_START_METHOD={START_METHOD}: use forkserver or spawn")
    return ctx


def adopt_environment(env: Mapping[str, str], keep: Callable[[str], bool] = lambda _: False) -> None:
    """Make this rank's environment ``env`` (the launcher's at launch), except the names ``keep``
    accepts (what the rank's starter set for it alone: its rank, its world size)."""
    for name in [n for n in os.environ if n not in env and not keep(n)]:
        del os.environ[name]
    os.environ.update({name: value for name, value in env.items() if not keep(name)})


class Stdio:
    """The starting process's file descriptors 1 and 2, sent with a rank as it starts (pickled by
    multiprocessing while it starts a process, which passes the descriptors along); ``apply`` in the
    rank makes them its own standard output and error."""

    def __init__(self) -> None:
        self.fds: tuple[Any, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {"fds": (reduction.DupFd(1), reduction.DupFd(2))}

    def apply(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for target, received in zip((1, 2), self.fds, strict=True):
            fd = received.detach()
            os.dup2(fd, target)
            os.close(fd)


def is_rank_process(parent_pid: int, launcher_pid: int, cmdline: str) -> bool:
    """Whether a process below the launcher is a rank: a fork of its forkserver, so a grandchild with
    the forkserver's command line (the forkserver and the resource tracker are the launcher's own
    children), or under ``spawn`` a child running ``spawn_main``."""
    if parent_pid == launcher_pid:
        return "spawn_main" in cmdline
    return "forkserver" in cmdline
