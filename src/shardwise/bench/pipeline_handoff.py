"""The pipeline bench's hand-off price: what one message between ranks costs in the run itself.

The simulator prices a message as ``send`` (posting it, on its sender, after the action that produced
it) plus ``transfer`` (latency). Here ``transfer`` is read off the run's own warm-up steps, never the
measured steps it is compared with: every time an action waited for a message from another rank
(its rank was idle when the action producing it ended), the hand-off is its start less that
producer's end (``time.monotonic``, one clock for every process of a machine); less the producer's
posts (``send`` per message its action sent, as ``simulate`` charges them), that is the transfer the
simulator would have had to charge. The price is the mean over those hand-offs, not the median, a
heuristic for a cost with a long tail: on this bench's 2-rank runs most hand-offs take 0.15-0.5 ms
and a third of those in the ramps 1-6 ms, which lengthen the steps they fall in (the median would
price them at nothing). It is a calibration: the simulated bubble agrees with the measured one in
part because the transfer was fitted to the same launches' warm-up waits (README, "Pipeline
speed"). The tied weight's values are not a hand-off here: the last stage's first F waits for them at
its head, inside its span. Included as they come: a split schedule's warm-up steps run the fit's fused and
built schedules (``pipeline/fitting.py``), not the fitted one measured after them. A step whose
spans do not make a whole schedule (a rank that recorded none) is left out.
Pure: no torch, no processes. Communication: none (it reads spans).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from shardwise.observe.monitor import Span
from shardwise.pipeline.actions import Action, parse_action, transfers
from shardwise.pipeline.simulate import Costs
from shardwise.pipeline.validate import backward_kinds, dependencies

StepSpans = Mapping[int, Sequence[Span]]  # one step: each rank's action spans


def hand_offs(step: StepSpans, placement: Sequence[int]) -> list[tuple[float, int]]:
    """Every wait for another rank's message in ``step``: (seconds from the producer's end to the
    waiting action's start, how many messages the producer's action sent). Raises ``KeyError`` where
    the spans do not make a whole schedule (an action whose producer is missing)."""
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
    out: list[tuple[float, int]] = []
    for rank, spans in runs.items():
        idle_from: float | None = None  # the end of this rank's previous action
        for action, span in zip(schedule[rank], spans, strict=True):
            for need in dependencies(action, len(placement), kinds):
                if owner[need] != rank and (idle_from is None or ends[need] > idle_from):
                    out.append((span.start - ends[need], sent[need]))
            idle_from = span.start + span.duration
    return out


def transfer_price(steps: Sequence[StepSpans], placement: Sequence[int], send: float) -> float | None:
    """The mean over ``steps``' hand-offs of each less its producer's posts (at least 0); None where
    no action waited for a message. Steps that are not a whole schedule are left out."""
    waits = []
    for step in steps:
        try:
            waits += [hop - send * posts for hop, posts in hand_offs(step, placement)]
        except KeyError:  # an action whose producer recorded no span (a rank that recorded none)
            continue
    return max(0.0, statistics.fmean(waits)) if waits else None


def with_warmup_transfer(costs: Costs, warmups: Sequence[StepSpans], placement: Sequence[int]) -> Costs:
    """``costs`` with ``transfer`` the price of ``warmups``' hand-offs (as it was where none waited)."""
    price = transfer_price(warmups, placement, costs.send)
    return costs if price is None else replace(costs, transfer=price)
