"""The pipeline bench's hand-off price: what one message between ranks costs in the run itself.

The simulator prices a message as ``send`` (posting it, on its sender, after the action that produced
it) plus ``transfer`` (latency). Here ``transfer`` is read off the run's own warm-up steps (never the
measured steps it is compared with): every time an action waited for a message from another rank
(its rank was idle when the action producing it ended), the hand-off is its start less that
producer's end; less the producer's posts (``send`` per message its action sent), that is the
transfer the simulator should have charged. The price is the mean over those hand-offs, not the
median: the simulator is deterministic, so a cost that varies enters a predicted makespan through
its mean, and hand-offs here have a long tail. On the bench's 2-rank runs most take 0.1-0.3 ms and
a third of those in the ramps 1-6 ms (the sender's posting thread and gloo's threads waiting for a
core on a 2-core machine whose two ranks compute), so their mean is 0.25-0.6 ms where the profile's
relay (``pipeline_profile``), whose sender waits instead of computing on, put the median at 0.03-0.24
ms and left the simulator 0.04-0.06 under the measured bubble of schedules with twice the hand-offs.
Pure: no torch, no processes.
Communication: none (it reads spans).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from shardwise.observe.monitor import Span
from shardwise.pipeline.actions import Action, parse_action, transfers
from shardwise.pipeline.simulate import Costs
from shardwise.pipeline.validate import backward_kinds, dependencies

Step = Mapping[int, Sequence[Span]]  # one step: each rank's action spans


def hand_offs(step: Step, placement: Sequence[int]) -> list[tuple[float, int]]:
    """Every wait for another rank's message in ``step``: (seconds from the producer's end to the
    waiting action's start, how many messages the producer's action sent)."""
    runs = {rank: sorted(spans, key=lambda s: s.start) for rank, spans in step.items()}
    schedule = {rank: [parse_action(s.name) for s in spans] for rank, spans in runs.items()}
    ends: dict[Action, float] = {}
    owner: dict[Action, int] = {}
    for rank, spans in runs.items():
        for action, span in zip(schedule[rank], spans, strict=True):
            ends[action], owner[action] = span.start + span.duration, rank
    sent = {
        action: len(sends)
        for rank, actions in schedule.items()
        for action, (_, _, sends) in zip(actions, transfers(rank, actions, placement), strict=True)
    }
    kinds = backward_kinds(schedule)
    out = []
    for rank, spans in runs.items():
        idle_from: float | None = None  # the end of this rank's previous action
        for action, span in zip(schedule[rank], spans, strict=True):
            for need in dependencies(action, len(placement), kinds):
                if need in ends and owner[need] != rank and (idle_from is None or ends[need] > idle_from):
                    out.append((span.start - ends[need], sent[need]))
            idle_from = span.start + span.duration
    return out


def transfer_price(steps: Sequence[Step], placement: Sequence[int], send: float) -> float | None:
    """The mean over ``steps``' hand-offs of each less its producer's posts (at least 0); None where
    no action waited for a message."""
    waits = [hop - send * posts for step in steps for hop, posts in hand_offs(step, placement)]
    return max(0.0, statistics.fmean(waits)) if waits else None


def priced(costs: Costs, warmups: Sequence[Step], placement: Sequence[int]) -> Costs:
    """``costs`` with ``transfer`` the price of ``warmups``' hand-offs (as it was where none waited)."""
    price = transfer_price(warmups, placement, costs.send)
    return costs if price is None else replace(costs, transfer=price)
