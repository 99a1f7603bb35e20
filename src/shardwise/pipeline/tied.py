"""A weight tied across the pipeline's two ends (GPT's embedding and head): its two messages per step.

The first stage's rank owns the parameter; the last stage's rank computes with a copy
(``split.Tied``). Each step, when the two ends are on different ranks:

1. the owner's values go to the copy (they changed at the last update), waited for only where the
   last stage's first F reaches its head (a forward pre-hook on the module that reads the copy; the
   F itself starts on its activation alone, the values arriving while its blocks run), so neither
   end stalls on it (``post_values``, ``wait_values``). Both ends post
   them right after the step's first message where the owner's first action sends it to the copy's
   rank (``values_anchor``: with two ranks, the first activation; the next stage waits on that one,
   not on these), else before any other message of the step;
2. the copy's gradient goes to the owner, which adds it to the parameter's before the data-parallel
   exchange. Both ends see it as the last message between them: the copy's rank sends it once the
   last stage's last B or I has made it whole (the head that reads the copy keeps its dW in I, never
   deferred to a W: ``pipeline/deferred.py``) and its last other message with the owner's rank is
   posted (``send_boundary``), so a zero-bubble schedule's W passes left at the step's end delay
   neither it nor the owner's update (on the small GPT's zb bench the first stage waited 2.8 ms a
   step for it after the last W); the owner posts its receive right after its last other message
   with that rank in the step's order (``pipeline/messages.py``), well before its own last backward,
   so the gradient arrives while that backward runs (``receive_boundary``, ``post_gradient``,
   ``add_gradient``).

Every message is posted by the compute thread, in the order the step's other messages keep, as NCCL
needs. ``values_now`` is step 1 waited for at once (evaluation).
Communication: point-to-point between the first and the last stage's ranks over the pp axis.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shardwise.collectives.api import Comm
from shardwise.collectives.p2p import Work
from shardwise.pipeline.actions import Action, Kind, Transfer
from shardwise.pipeline.messages import MessageKey
from shardwise.pipeline.split import Split, SplitError

if TYPE_CHECKING:
    from shardwise.engine.base import Engine

TAG = 0  # every message of the pipeline: they are matched by their order alone, as NCCL matches them


class TiedExchange:
    """This rank's end of the tied weight's messages (nothing where it holds both ends or neither)."""

    def __init__(self, split: Split, comm: Comm, placement: Sequence[int]) -> None:
        self.owner, self.tied = split.tied_owner, split.tied
        self.comm = comm
        self.peer = placement[-1] if self.owner is not None else placement[0]
        self._values: Work | None = None  # the copy's end: the owner's values on their way
        self._gradient: tuple[torch.Tensor, Work] | None = None  # the owner's end: the copy's gradient
        user = self.tied.user if self.tied is not None else None
        # the copy's end: its head waits for the values as it starts (``waits_in_head``); the hook
        # holds this exchange weakly and is removed with it
        self.waits_in_head = user is not None
        self._hook = None
        if user is not None:
            mine = weakref.ref(self)
            self._hook = user.register_forward_pre_hook(lambda *_: _wait_values(mine))
            weakref.finalize(self, self._hook.remove)

    # -- 1. the values --------------------------------------------------------------------------
    def post_values(self, engine: Engine, dtype: torch.dtype) -> Work | None:
        """Step 1, posted; the owner's send comes back (wait for it with the step's sends)."""
        if self.owner is not None:
            with engine.pipeline_stage([self.owner]):  # ZeRO-3: gathered for the copy, released after
                values = self.owner.detach().clone()
            return self.comm.isend(values, self.peer, TAG)
        if self.tied is not None:
            self.tied.match(dtype)  # in the owner's dtype (ZeRO's compute copies: the compute one)
            self._values = self.comm.irecv(self.tied.copy.data, self.peer, TAG)
        return None

    def values_anchor(self, owner_posts: Sequence[Sequence[Transfer]] | None) -> MessageKey | None:
        """The message both ends post the values right after (``owner_posts``: the owner's rank's
        post plan): the first its first action sends the copy's rank, which nothing precedes; None
        (post them first) where there is none, or where this rank holds neither end."""
        if owner_posts is None or (self.owner is None and self.tied is None) or len(owner_posts) < 2:
            return None
        copy_rank = self.peer if self.owner is not None else self.comm.rank
        first = [t.key for t in owner_posts[1] if t.op == "send" and t.peer == copy_rank]
        return first[0] if first else None

    def wait_values(self) -> None:
        """The copy's values are here (the head's forward pre-hook calls this, or the last stage's first
        F where no module reads the copy; the step's end too)."""
        if self._values is not None:
            self._values.wait()
            self._values = None

    def check_values_read(self) -> None:
        """After the last stage's F: where the head waits for the values (``waits_in_head``), it did
        (one line otherwise: an adapter's head that reads the copy without calling its module)."""
        if self.waits_in_head and self._values is not None:
            assert self.tied is not None
            raise SplitError(
                f"the last stage's forward ran without calling {type(self.tied.user).__name__}, the module "
                f"that reads the tied weight {self.tied.owner_name!r}'s copy: a family adapter's head() must "
                "call it as a module (models/adapters/)"
            )

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
        self._gradient = (incoming, self.comm.irecv(incoming, self.peer, TAG))

    def send_boundary(
        self, actions: Sequence[Action], posts: Sequence[Sequence[Transfer]], last: int
    ) -> int | None:
        """The copy's end: the boundary of its post plan (``posts[i]`` goes before ``actions[i]``)
        after whose messages it sends the gradient: past its last backward (B or I) of stage ``last``,
        which makes the gradient whole, and past its last other message with the owner's rank, so
        that this is the last message between them at both ends; None elsewhere, or where the weight
        is frozen."""
        if self.tied is None or not self.tied.copy.requires_grad:
            return None
        backwards = (Kind.BACKWARD, Kind.INPUT_GRAD)
        made = [i + 1 for i, a in enumerate(actions) if a.stage == last and a.kind in backwards]
        with_peer = [i for i, boundary in enumerate(posts) for t in boundary if t.peer == self.peer]
        return max([*made, *with_peer], default=len(actions))

    def post_gradient(self) -> Work | None:
        """The copy's end, at ``send_boundary``: its gradient sent (wait for it with the step's sends)."""
        tied = self.tied
        if tied is None or not tied.copy.requires_grad:
            return None
        grad = tied.copy.grad if tied.copy.grad is not None else torch.zeros_like(tied.copy)
        tied.copy.grad = None
        return self.comm.isend(grad.contiguous(), self.peer, TAG)

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


def _wait_values(exchange: weakref.ref[TiedExchange]) -> None:
    """The head's forward pre-hook: the copy's values waited for, while its exchange lives."""
    if (alive := exchange()) is not None:
        alive.wait_values()
