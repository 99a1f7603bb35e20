"""Asynchronous parameter server: each worker's gradient is applied as soon as it arrives.

Pattern: every server runs one listener thread per worker, each blocked in a receive from that worker
(gloo point-to-point work cannot be polled, and a timed-out any-source receive closes every pair, so
blocking per-worker receives in threads are what lets a server notice one dead worker and keep the
others). The main thread takes pushes in arrival order, applies or refuses them, and replies to the
sender with its current weights and version (Recht et al. / Dean et al.'s Downpour SGD, with the bounded
staleness of Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server").

Scaling: a worker's loss is divided by the GLOBAL token count (the engine-wide convention), so its raw
gradient is ``local_tokens / global_tokens`` of a mean gradient. In async mode the worker multiplies its
gradient (and loss) by ``global_tokens / local_tokens`` before pushing: each update is then the mean
gradient over the worker's own tokens, an unbiased estimate of the global-batch mean gradient, applied
with the same learning rate as a synchronous step. Workers with uneven shares take equally sized steps.

Staleness: a push tagged with version v reaching a server at version V has staleness V - v. It is
applied with the learning rate divided by 1 + (V - v) (staleness-aware ASGD, Zhang et al., 2016;
``ps.staleness_lr``): a gradient computed on old weights takes a smaller step. A push more than
``max_staleness`` versions behind is refused: the worker is held back, takes the fresh weights that
come with the refusal and recomputes the gradient of the same batch, then pushes again; after
``MAX_ATTEMPTS`` refusals it gives the batch up (``dropped_batches``). Every applied gradient thus has
staleness <= max_staleness. A worker whose process is gone (its receive or our reply raises) is logged in
one line and left out; the server goes on with the others until every live worker has said it is done.

A push whose loss or gradient is not finite is never applied: the reply says it was skipped (or, under
``on_nonfinite = "stop"``, that the run stops) and the worker does not push it again. Checkpoints: a
worker at a checkpoint step sends a pause message instead of a push; once every live worker has
paused, the server joins their save (``after_step``) and then takes pushes again. A paused worker sends
nothing until the save is done, so the server cannot miss a push, and workers that have not paused yet
are still answered, so they reach the checkpoint step too: no one waits on anyone in a circle.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardwise.data_parallel.ps_messages import (
    FINITE,
    KIND_DONE,
    KIND_PAUSE,
    MAX_ATTEMPTS,
    STOPPED,
)
from shardwise.device import HOST
from shardwise.engine.nonfinite import NonFinite, describe_nonfinite

if TYPE_CHECKING:
    from shardwise.data_parallel.param_server import ParamServerEngine

log = logging.getLogger("shardwise.ps")

Arrival = tuple[int, "torch.Tensor | None", str]  # worker, message (None when it failed), error text


def push_until_accepted(engine: ParamServerEngine) -> None:
    """Worker side of one asynchronous step: push to every server, recompute and re-push when refused."""
    scale = engine._global_tokens / max(engine._local_tokens, 1)
    replies: list[torch.Tensor] = [torch.empty(0, device=HOST)] * len(engine.servers)
    pending, attempts = list(engine.servers), 0
    while pending:
        attempts += 1
        for s in pending:
            engine.comm.send(engine._push_message(s, scale), s)
        refused = []
        for s in pending:
            replies[s] = engine.recv_reply(s)
            if replies[s][-2] == 0:
                refused.append(s)
                engine.undo_push(s)  # its error feedback is taken back: the batch is pushed again or dropped
        engine._replies = replies
        if not refused:
            return
        engine.rejected += len(refused)
        if attempts >= MAX_ATTEMPTS or not engine._micro:
            engine.dropped_batches += 1
            return
        for s in engine.servers:  # held back: catch up with every server, then recompute this batch
            engine.load_reply(s, replies[s])
        engine.recompute()
        pending = refused


def serve_async(engine: ParamServerEngine, after_step: Callable[[int], None] | None = None) -> list[int]:
    """Server side: apply pushes as they arrive until every worker is done or gone; return the gone.

    ``after_step(done)`` runs once every live worker has paused after ``done`` steps (a checkpoint).
    """
    arrivals: queue.Queue[Arrival] = queue.Queue()
    listeners = [
        threading.Thread(target=_listen, args=(engine, w, arrivals), daemon=True)
        for w in engine.workers
    ]
    for thread in listeners:
        thread.start()
    live, dead, paused = set(engine.workers), [], set()
    while live:
        worker, message, error = arrivals.get()
        if worker not in live:
            continue
        if message is None or not _answer(engine, worker, message):
            _report_dead(engine, worker, error or "reply failed", len(live) - 1)
            live.discard(worker)
            dead.append(worker)
        elif message[-1] == KIND_DONE:
            live.discard(worker)
        elif message[-1] == KIND_PAUSE:
            paused.add(worker)
            engine._steps_done = int(message[-2])
        if paused and paused >= live:  # everyone still here is at the checkpoint step: save with them
            paused.clear()
            if after_step is not None:
                after_step(engine._steps_done)
    for thread in listeners:
        thread.join(timeout=1.0)
    return dead


def _answer(engine: ParamServerEngine, worker: int, message: torch.Tensor) -> bool:
    """Apply or refuse one push and reply; False when the worker cannot be reached."""
    if message[-1] in (KIND_DONE, KIND_PAUSE):
        return True
    staleness = engine.version - int(message[-2])
    loss_ok, first = engine.check_push(message, float(message[-3]))
    status = engine._status(loss_ok, first)
    accepted = status != FINITE or staleness <= engine.config.max_staleness
    if status != FINITE:  # never applied; "accepted" so that the worker does not push it again
        engine.nonfinite_updates += 1
        if status == STOPPED and engine._found is None:
            name = engine.trainable_names[first] if first < len(engine.trainable_names) else None
            engine._found = NonFinite(describe_nonfinite(loss_ok, name), stop=True)
    elif accepted:
        engine.apply_gradient(message, 1 / (1 + staleness) if engine.config.staleness_lr else 1.0)
        engine.staleness.append(staleness)
        engine.last_staleness = staleness
        engine.max_staleness_seen = max(engine.max_staleness_seen, staleness)
    else:
        engine.rejected += 1
    reply = engine.reply_message(staleness, accepted, float(message[-3]), status, first)
    try:
        engine.comm.send(engine.wire_reply(worker, reply), worker)
    except RuntimeError:
        return False
    return True


def _listen(engine: ParamServerEngine, worker: int, arrivals: queue.Queue[Arrival]) -> None:
    """Receive one worker's pushes in order until it says it is done or its connection fails; each
    is decoded here (with comm.compress), with this worker's own decoding state."""
    while True:
        received = engine.push_buffer()
        try:
            engine.comm.irecv(received, worker).wait()
        except RuntimeError as exc:
            arrivals.put((worker, None, str(exc).splitlines()[0][:160]))
            return
        message = engine.decode_push(worker, received)
        arrivals.put((worker, message, ""))
        if message[-1] == KIND_DONE:
            return


def _report_dead(engine: ParamServerEngine, worker: int, error: str, remaining: int) -> None:
    log.warning(
        "parameter server rank %d: worker %d is gone (%s); going on with %d other worker(s)",
        engine.comm.rank,
        worker,
        error,
        remaining,
    )
