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
the same steps: between two of a rank's actions where the second waited for no message, its start
less the first's end and posts; the median (in one launch of each schedule on this bench: 0.015-0.02
ms for 1f1b, zb and zbv, 0.05-0.08 ms for interleaved, interleaved-zb and dualpipev, which raised
those three's simulated bubble by 0.006-0.009, the others' by 0.001-0.003). A
step whose spans do not make a whole schedule (a rank that recorded none) is left out.
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


def gaps(step: StepSpans, placement: Sequence[int], send: float) -> list[float]:
    """Every stretch between two of a rank's actions in ``step`` where the second waited for no
    message (each producer on another rank had ended before the first started, so its message had
    the whole first action to come in): the second's start less the first's end and the first's posts
    (``send`` per message it sent, as ``simulate`` charges them). Raises ``KeyError`` where the spans
    do not make a whole schedule."""
    runs = {rank: sorted(spans, key=lambda s: s.start) for rank, spans in step.items()}
    schedule = {rank: [parse_action(s.name) for s in spans] for rank, spans in runs.items()}
    ends = {a: s.start + s.duration for r in runs for a, s in zip(schedule[r], runs[r], strict=True)}
    kinds = backward_kinds(schedule)
    out: list[float] = []
    for rank, spans in runs.items():
        posts = [len(sends) for _, _, sends in transfers(rank, schedule[rank], placement)]
        mine = {s for s, r in enumerate(placement) if r == rank}
        for k in range(1, len(spans)):
            needs = dependencies(schedule[rank][k], len(placement), kinds)
            if all(ends[n] <= spans[k - 1].start for n in needs if n.stage not in mine):
                before = spans[k - 1].start + spans[k - 1].duration
                out.append(spans[k].start - before - send * posts[k - 1])
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


def gap_price(steps: Sequence[StepSpans], placement: Sequence[int], send: float) -> float | None:
    """The median over ``steps``' gaps (``gaps``, at least 0); None where there are none. Steps that
    are not a whole schedule are left out."""
    found = []
    for step in steps:
        try:
            found += gaps(step, placement, send)
        except KeyError:
            continue
    return max(0.0, statistics.median(found)) if found else None


def with_warmup_prices(costs: Costs, warmups: Sequence[StepSpans], placement: Sequence[int]) -> Costs:
    """``costs`` with ``transfer`` the price of ``warmups``' hand-offs and ``gap`` that of their gaps
    (each as it was where there was none)."""
    price = transfer_price(warmups, placement, costs.send)
    gap = gap_price(warmups, placement, costs.send)
    return replace(
        costs,
        transfer=costs.transfer if price is None else price,
        gap=costs.gap if gap is None else gap,
    )
