"""The step spine and its runner: one step's count, passes, exchange and update, outside the engines.

``take_step`` is the one step spine, run by the Trainer and by ``Engine.train_step`` (a hand-written
loop) alike: the global item count (one all-reduce of one number over the batch group), forward and
backward of every micro-batch and the gradient exchange (the step runner's, below), then the update
unless a rank found a loss or gradient not finite (``Engine.update``: every rank that steps agrees,
in the same step, to go on, skip it or stop).

A step on a rank is: ``begin_step`` (the engine's preparation; it returns what each micro-batch's summed
loss is divided by), then forward and backward of every micro-batch, then ``finish_grads`` (the
gradient exchange), then ``step_loss`` (what the step reports). Who runs the micro-batches is the
runner's business, not the engine's:

- :class:`MicroBatchLoop`, the plain loop: micro-batch after micro-batch, each a forward and a backward,
  gradients accumulating locally under ``engine.no_sync()`` for all but the last, so that an engine
  which overlaps its exchange with backward (DDP's buckets) sends once per step.
- a pipeline runtime, which runs this rank's action list over the pp axis and calls the same hooks.

Communication: none here but the count. The runner only calls the engine's hooks; every byte is the
engine's (or, for a pipeline, the runtime's point-to-point transfers).

The loss is accumulated as a tensor and read once per step (no host synchronisation per micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from shardwise.engine.nonfinite import NonFinite
from shardwise.observe.monitor import MONITOR

if TYPE_CHECKING:
    from shardwise.engine.base import Engine


class StepRunner(Protocol):
    """Runs one step's forward and backward passes on an engine; see the module docstring."""

    def forward_backward(self, engine: Engine, micro_batches: Sequence[Any], global_count: float) -> float:
        """Forward and backward of this rank's micro-batches, gradients exchanged on return.

        ``global_count``: the items the loss counts over every micro-batch of every rank this step.
        Returns this rank's share of the global mean loss (the shares sum to the global mean).
        """
        ...

    def report(self) -> dict[str, Any]:
        """What the run's summary should say of how the steps ran (a pipeline's fitted schedule)."""
        ...

    def take_notes(self) -> list[str]:
        """What a user should hear of how the steps run, once each (a pipeline's fit, in words)."""
        ...

    def early_update(self, engine: Engine) -> AbstractContextManager[object]:
        """Around the update a rank runs before the step's verdict (``Engine.updates_early``): a
        pipeline's fit times it, as part of the step's end on that rank."""
        ...


def run_passes(engine: Engine, micro_batches: Sequence[Any], divisor: float) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn, every backward but the last under
    ``no_sync``; returns the sum of the micro-batches' losses divided by ``divisor`` (float64, 0-d)."""
    share = torch.zeros((), dtype=torch.float64, device=engine.device)  # read once, after the step
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        with engine.no_sync() if i < last else nullcontext():
            MONITOR.set_phase("forward")
            loss = engine.compute_loss(batch) / divisor
            MONITOR.set_phase("backward")
            engine.backward(loss)
        share += loss.detach().to(torch.float64)
    return share


class MicroBatchLoop:
    """The plain step: every micro-batch through the whole model on this rank, then the exchange."""

    def forward_backward(self, engine: Engine, micro_batches: Sequence[Any], global_count: float) -> float:
        divisor = engine.begin_step(micro_batches, global_count)
        share = run_passes(engine, micro_batches, divisor)
        MONITOR.set_phase("gradient sync")
        engine.finish_grads()
        return engine.step_loss(share)

    def report(self) -> dict[str, Any]:
        return {}

    def take_notes(self) -> list[str]:
        return []

    def early_update(self, engine: Engine) -> AbstractContextManager[object]:
        return nullcontext()


class StepResult(NamedTuple):
    """What one step gave on this rank."""

    items: float  # what the loss counted this step over the batch group
    loss_share: float  # this rank's share of the global mean loss (the shares sum to it over the trainers)
    found: NonFinite | None  # what a rank found not finite (the same verdict on every rank), or None


def take_step(
    engine: Engine, micro_batches: Sequence[Any], before_update: Callable[[], None] | None = None
) -> StepResult:
    """One step of ``engine`` on this rank's micro-batches: the global item count, forward, backward and
    the gradient exchange (``Engine.forward_backward``); ``before_update()`` (it sees the global
    gradients); then the update, skipped on every rank where any found a non-finite value (under
    "stop", a pipeline's ranks whose own gradients were finite may have applied it:
    ``Engine.updates_early``)."""
    count = engine.global_count(micro_batches)
    share = engine.forward_backward(micro_batches, max(count, 1.0))
    if before_update is not None:
        before_update()
    MONITOR.set_phase("optimizer")
    found = engine.update(share)
    return StepResult(count, share, found)
