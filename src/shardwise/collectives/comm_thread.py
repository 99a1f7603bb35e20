"""The communication thread that lets an explicit collective overlap the caller's work.

Communication pattern: none of its own; it runs explicit collectives (ring, tree, ...), which are
chains of send/recv, on a second thread of the same process, one at a time, in the order they were
issued. Every rank issues its collectives in the same order, so every rank runs them in the same order
too, and their messages pair up. A call made while nothing is queued runs on the caller's thread
instead (no hand-over to pay for); a call made while collectives are queued joins the queue, so the
order holds either way. The thread spends its time blocked in receives, which release the GIL, so a
backward pass on the main thread runs meanwhile: that is the overlap DDP's buckets need.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Pending:
    """An explicit collective queued on the thread: ``wait()`` blocks until it ran, and re-raises."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True


class CommThread:
    """A daemon thread running submitted collectives in order; started on first use."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Pending]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted and not yet finished
        self._thread: threading.Thread | None = None

    def idle(self) -> bool:
        with self._lock:
            return self._queued == 0

    def submit(self, run: Callable[[], None]) -> Pending:
        pending = Pending()
        with self._lock:
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shardwise-comm", daemon=True)
                self._thread.start()
        self._queue.put((run, pending))
        return pending

    def _loop(self) -> None:
        while True:
            run, pending = self._queue.get()
            try:
                run()
            except BaseException as error:  # handed to whoever waits for it
                pending._error = error
            finally:
                with self._lock:
                    self._queued -= 1
                pending._done.set()
