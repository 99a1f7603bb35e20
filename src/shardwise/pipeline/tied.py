"""A weight tied across the pipeline's two ends (GPT's embedding and head): its two messages per step.

The first stage's rank owns the parameter; the last stage's rank computes with a copy
(``split.Tied``). Each step, when the two ends are on different ranks:

1. the owner's values go to the copy (they changed at the last update), posted before any other
   message of the step at both ends and waited for only by the last stage's first F, so neither end
   stalls on it (``post_values``, ``wait_values``);
2. the copy's gradient goes to the owner, which adds it to the parameter's before the data-parallel
   exchange. Both ends see it as the last message between them: the copy's rank sends it after its
   last action; the owner posts its receive right after its last other message with that rank in
   the step's order (``pipeline/messages.py``), well before its own last backward, so the gradient
   arrives while that backward runs (``receive_boundary``, ``post_gradient``, ``add_gradient``).

Every message goes through the runner's posting thread (``Posted``; over NCCL posted at once,
``posting_thread``), in the order the step's other messages keep, as NCCL needs. ``values_now`` is
step 1 waited for at once (evaluation).
Communication: point-to-point between the first and the last stage's ranks over the pp axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from shardwise.collectives.api import Comm
from shardwise.collectives.comm_thread import CommThread, Pending
from shardwise.collectives.p2p import Work
from shardwise.pipeline.actions import Transfer
from shardwise.pipeline.split import Split

if TYPE_CHECKING:
    from shardwise.engine.base import Engine

TAG = 0  # every message of the pipeline: they are matched by their order alone, as NCCL matches them


class Posted:
    """A message posted on the runner's posting thread (``thread``), or at once on the caller's
    (``thread`` None: ``posting_thread``): ``wait()`` waits until it is posted, then until it is done
    (and re-raises what went wrong on either)."""

    def __init__(
        self, thread: CommThread | None, post: Callable[[torch.Tensor, int, int], Work],
        tensor: torch.Tensor, peer: int,
    ) -> None:  # fmt: skip
        self._work: Work | None = None
        self._posted: Pending | None = None
        if thread is None:
            self._work = post(tensor, peer, TAG)
            return

        def run() -> None:
            self._work = post(tensor, peer, TAG)

        self._posted = thread.submit(run)

    def wait(self) -> object:
        if self._posted is not None:
            self._posted.wait()
        assert self._work is not None
        return self._work.wait()


def posting_thread(comm: Comm) -> CommThread | None:
    """Where a pipeline posts its messages over ``comm``: a thread of their own where posting can run
    the transfer (gloo runs a send to a peer already waiting for it on the thread that posts it, so
    on the compute thread the next action would wait for it); None, at once on the compute thread,
    over NCCL, where posting only queues the op on a stream: no host wait for a thread to take off,
    and the op is ordered after the compute stream that made the tensor (the posting thread's current
    stream is its own default one, not the one a user's context set on the compute thread)."""
    return None if comm.device_type == "cuda" and not comm.cuda_over_gloo else CommThread()


class TiedExchange:
    """This rank's end of the tied weight's messages (nothing where it holds both ends or neither)."""

    def __init__(
        self, split: Split, comm: Comm, placement: Sequence[int], posting: CommThread | None
    ) -> None:
        self.owner, self.tied = split.tied_owner, split.tied
        self.comm, self.posting = comm, posting
        self.peer = placement[-1] if self.owner is not None else placement[0]
        self._values: Posted | None = None  # the copy's end: the owner's values on their way
        self._gradient: tuple[torch.Tensor, Posted] | None = None  # the owner's end: the copy's gradient

    # -- 1. the values --------------------------------------------------------------------------
    def post_values(self, engine: Engine, dtype: torch.dtype) -> Posted | None:
        """Step 1, posted; the owner's send comes back (wait for it with the step's sends)."""
        if self.owner is not None:
            with engine.pipeline_stage([self.owner]):  # ZeRO-3: gathered for the copy, released after
                values = self.owner.detach().clone()
            return Posted(self.posting, self.comm.isend, values, self.peer)
        if self.tied is not None:
            self.tied.match(dtype)  # in the owner's dtype (ZeRO's compute copies: the compute one)
            self._values = Posted(self.posting, self.comm.irecv, self.tied.copy.data, self.peer)
        return None

    def wait_values(self) -> None:
        """The copy's values are here (the last stage's first F calls this; the step's end too)."""
        if self._values is not None:
            self._values.wait()
            self._values = None

    def values_now(self, engine: Engine, dtype: torch.dtype) -> None:
        """Step 1, waited for at once."""
        posted = self.post_values(engine, dtype)
        if posted is not None:
            posted.wait()
        self.wait_values()

    # -- 2. the gradient ------------------------------------------------------------------------
    def receive_boundary(self, posts: Sequence[Sequence[Transfer]]) -> int | None:
        """The owner's end: the boundary of its post plan after whose messages it posts its receive
        of the gradient (the one holding its last message with the copy's rank; 0 if none); None
        elsewhere, or where the weight is frozen."""
        if self.owner is None or not self.owner.requires_grad:
            return None
        with_peer = [i for i, boundary in enumerate(posts) for t in boundary if t.peer == self.peer]
        return max(with_peer, default=0)

    def post_receive(self) -> None:
        """The owner's end posts its receive of the copy's gradient (at ``receive_boundary``)."""
        assert self.owner is not None
        incoming = torch.empty_like(self.owner)
        self._gradient = (incoming, Posted(self.posting, self.comm.irecv, incoming, self.peer))

    def post_gradient(self) -> Posted | None:
        """The copy's end, after its last action: its gradient sent (wait for it with the step's sends)."""
        tied = self.tied
        if tied is None or not tied.copy.requires_grad:
            return None
        grad = tied.copy.grad if tied.copy.grad is not None else torch.zeros_like(tied.copy)
        tied.copy.grad = None
        return Posted(self.posting, self.comm.isend, grad.contiguous(), self.peer)

    def add_gradient(self) -> None:
        """The owner's end: the copy's gradient added to the parameter's (before the dp exchange)."""
        if self._gradient is None:
            return
        (incoming, posted), self._gradient = self._gradient, None
        posted.wait()
        assert self.owner is not None
        if self.owner.grad is None:
            self.owner.grad = incoming
        else:
            self.owner.grad.add_(incoming)
