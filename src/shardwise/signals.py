"""SIGINT and SIGTERM for the command line: exit 130 and 143, in one line, at any moment.

``install`` runs first thing in ``python -m shardwise`` (before torch is imported, which takes
seconds), so a signal during start-up is answered like one during the run: the handler raises
``Interrupted`` (a ``KeyboardInterrupt`` that remembers which signal came), ``finally`` blocks run on
the way out (the launcher stops the ranks there), and the command line turns it into
``128 + signal``, the shell's convention. Nothing heavy is imported here.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A signal asked the process to stop; ``signum`` says which (SIGINT from Ctrl-C, SIGTERM, ...)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def exit_code(exc: BaseException) -> int:
    """128 + the signal's number; a plain ``KeyboardInterrupt`` is Ctrl-C's SIGINT (130)."""
    return 128 + (exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT))


def describe(exc: BaseException) -> str:
    return f"interrupted ({exc.name})" if isinstance(exc, Interrupted) else "interrupted (SIGINT)"


Handlers = dict[signal.Signals, Any]


def _raise(signum: int, frame: FrameType | None) -> None:
    # Only the first signal unwinds: a second one (a cleanup that takes too long) ends the process at
    # once, as the operating system would, still with no traceback and still 128 + signal.
    restore_defaults()
    raise Interrupted(signum)


def install() -> Handlers:
    """Make SIGINT and SIGTERM raise ``Interrupted``; return what it replaced, for ``restore``.

    Already installed (``python -m shardwise`` does it before ``main``): nothing to replace or
    restore. Only the main thread can set handlers; elsewhere nothing changes.
    """
    previous: Handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in HANDLED:
            if signal.getsignal(sig) is not _raise:
                previous[sig] = signal.signal(sig, _raise)
    return previous


def restore(previous: Handlers) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def restore_defaults() -> None:
    """Back to the operating system's handling: a signal ends the process, with no traceback."""
    restore({sig: signal.SIG_DFL for sig in HANDLED})
