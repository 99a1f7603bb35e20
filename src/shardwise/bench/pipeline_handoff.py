"""The pipeline bench's hand-off and gap prices: what one message between ranks, and the runtime's
own time between two actions of a rank, cost in the run itself.

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
built schedules (``pipeline/fitting.py``), not the fitted one measured after them. The ``gap`` is read off
the same steps: between two of a rank's actions where the second waited for no message (every
message it needed was in by the first's end, at the transfer just priced), its start less the
first's end and posts; the mean, as the transfer's, for the same reason: a gap is charged once per
action, so its tail adds up over a step, and a median prices the tail at nothing. In one launch of
interleaved-zb alone the measured steps' gaps had a median of 0.087 ms and a mean of 0.273 ms (the
longest 5.3 ms: on 2 cores a rank's thread is sometimes off its core); simulating each of those
steps with its own action times gave a median bubble of 0.239 at the median gap and 0.265 at the
mean, the measured bubble 0.265 (a check in-sample: the gaps priced came from the same steps). Out of
sample, as the bench prices them (from the warm-up steps, against the measured ones): by the median,
the simulated bubble sat under the measured one for every schedule with two stages a rank, by
0.044-0.060 for interleaved-zb in three full runs; by the mean, within -0.026 to +0.039 of it in four
(load 0.24-1.98 before them; mean gaps 0.12-0.30 ms) and within 0.048 in a fifth run beside other
jobs (load 3.6 at its end; mean gaps 0.42-0.89 ms). The mean is sensitive to a few long stalls in
the warm-up steps: a busy machine raises every action's price (README, "Pipeline speed"). A step
whose spans do not make a whole schedule (a rank that recorded none) is left out.
Pure: no torch, no processes. Communication: none (it reads spans).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from shardwise.observe.monitor import Span
from shardwise.pipeline.actions import Action, parse_action, transfers
from shardwise.pipeline.simulate import Costs
from shardwise.pipeline.validate import backward_kinds, dependencies

StepSpans = Mapping[int, Sequence[Span]]  # one step: each rank's action spans


@dataclass(frozen=True)
class _Read:
    """One step read off its spans: each rank's spans and actions in run order, and every action's
    end, rank, producers and count of messages sent to other ranks."""

    runs: dict[int, list[Span]]
    schedule: dict[int, list[Action]]
    ends: dict[Action, float]
    owner: dict[Action, int]
    needs: dict[Action, list[Action]]
    sent: dict[Action, int]


def _read(step: StepSpans, placement: Sequence[int]) -> _Read:
    """``step`` read (``_Read``); ``KeyError`` where an action's producer recorded no span (the spans
    do not make a whole schedule)."""
    runs = {rank: sorted(spans, key=lambda s: s.start) for rank, spans in step.items()}
    schedule = {rank: [parse_action(s.name) for s in spans] for rank, spans in runs.items()}
    ends: dict[Action, float] = {}
    owner: dict[Action, int] = {}
    for rank, spans in runs.items():
        for action, span in zip(schedule[rank], spans, strict=True):
            ends[action], owner[action] = span.start + span.duration, rank
    kinds = backward_kinds(schedule)
    needs = {action: dependencies(action, len(placement), kinds) for action in ends}
    if missing := [need for found in needs.values() for need in found if need not in ends]:
        raise KeyError(missing[0])
    sent = {
        action: len(sends)
        for rank, actions in schedule.items()
        for action, (_, _, sends) in zip(actions, transfers(rank, actions, placement), strict=True)
    }
    return _Read(runs, schedule, ends, owner, needs, sent)


def hand_offs(step: StepSpans, placement: Sequence[int]) -> list[tuple[float, int]]:
    """Every wait for another rank's message in ``step``: (seconds from the producer's end to the
    waiting action's start, how many messages the producer's action sent). Raises ``KeyError`` where
    the spans do not make a whole schedule (an action whose producer is missing)."""
    read = _read(step, placement)
    out: list[tuple[float, int]] = []
    for rank, spans in read.runs.items():
        idle_from: float | None = None  # the end of this rank's previous action
        for action, span in zip(read.schedule[rank], spans, strict=True):
            for need in read.needs[action]:
                if read.owner[need] != rank and (idle_from is None or read.ends[need] > idle_from):
                    out.append((span.start - read.ends[need], read.sent[need]))
            idle_from = span.start + span.duration
    return out


def gaps(step: StepSpans, placement: Sequence[int], send: float, transfer: float) -> list[float]:
    """Every stretch between two of a rank's actions in ``step`` where the second waited for no
    message (each from another rank was in by the first's end: its producer's end, posts at ``send``
    a message and ``transfer``): the second's start less the first's end and the first's posts (as
    ``simulate`` charges them). Raises ``KeyError`` where the spans do not make a whole schedule."""
    read = _read(step, placement)
    out: list[float] = []
    for rank, spans in read.runs.items():
        for k in range(1, len(spans)):
            before = spans[k - 1].start + spans[k - 1].duration
            needs = read.needs[read.schedule[rank][k]]
            arrivals = [
                read.ends[n] + send * read.sent[n] + transfer for n in needs if read.owner[n] != rank
            ]
            if all(arrival <= before for arrival in arrivals):
                out.append(spans[k].start - before - send * read.sent[read.schedule[rank][k - 1]])
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


def gap_price(
    steps: Sequence[StepSpans], placement: Sequence[int], send: float, transfer: float
) -> float | None:
    """The mean over ``steps``' gaps (``gaps``, at least 0); None where there are none. Steps that
    are not a whole schedule are left out."""
    found = []
    for step in steps:
        try:
            found += gaps(step, placement, send, transfer)
        except KeyError:
            continue
    return max(0.0, statistics.fmean(found)) if found else None


def with_warmup_prices(costs: Costs, warmups: Sequence[StepSpans], placement: Sequence[int]) -> Costs:
    """``costs`` with ``transfer`` the price of ``warmups``' hand-offs and ``gap`` that of their gaps
    (each as it was where there was none)."""
    price = transfer_price(warmups, placement, costs.send)
    transfer = costs.transfer if price is None else price
    gap = gap_price(warmups, placement, costs.send, transfer)
    return replace(costs, transfer=transfer, gap=costs.gap if gap is None else gap)
