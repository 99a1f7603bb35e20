"""Predict a schedule's timeline and bubble from per-stage costs, without processes.

Each rank runs its list in order; an action starts when the rank is free and everything it depends
on (``validate.dependencies``) has finished, plus ``transfer`` when that came from another rank.
Posting a message occupies its sender for ``send`` after the action that produced it (the runtime
posts it at the boundary before its next action; idle, not busy, time), and the message leaves then.
Between two of its actions a rank also spends ``gap`` on the runtime's own bookkeeping (closing one
action's span, finding and opening the next's; idle time too), unless it was waiting for a message
anyway: the wait covers it, and the action starts as the message is in.
Only sends are priced: a receive is posted early, off any action's path, and the tied weight's two
messages per step are not in the schedule. The transfer itself is latency: it occupies neither end
and contends for no link (the runtime sends asynchronously with receives posted ahead). The result
is the earliest-start timeline of the list as written, i.e. a longest path through its dependency
graph.

Bubble fraction = idle time / total time over all ranks = ``1 - sum(busy) / (p * makespan)``, with
every rank's time running from 0 to the last action's end on any rank. With the same costs on every
stage and no transfer time this gives ``(p-1)/(m+p-1)`` for GPipe and 1F1B at any ratio of B to F
(Huang et al. 2019, arXiv:1811.06965: the bubble overhead (K-1)/(M+K-1)); ``(p-1)/(v*m+p-1)`` for
interleaved 1F1B when p divides m (Narayanan et al. 2021, arXiv:2104.04473, section 2.2.2: the bubble
shrinks by v); and for ZB-H1 ``(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))`` when m >= p (Qi et al.
2023, arXiv:2401.10241, section 3.1).

``Timeline.spans`` gives each rank's actions as the trace recorder's spans (``observe.monitor.Span``),
so ``observe.trace.rank_events`` writes them as the Chrome-trace events a run records and
``observe.plots.plot_timeline`` draws a simulated schedule as it draws a measured one. Pure: no torch
(``observe.monitor`` is plain Python), no processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardwise.observe.monitor import Span
from shardwise.pipeline.actions import Action, Kind, transfers
from shardwise.pipeline.validate import backward_kinds, dependencies, validate

PerStage = float | tuple[float, ...]  # one cost for every stage, or one per stage


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action kind, per stage; ``transfer`` per message, ``send``: what
    posting one occupies its sender (module docstring; 0 unless given), ``update``: what each
    stage's update adds to its rank's step after its last action (``step_time``; 0 unless given), and
    ``gap``: the runtime's own time between two of a rank's actions (module docstring; 0 unless given).

    Convention: ``backward`` is a full B; a split backward costs ``input_grad`` (I) and
    ``weight_grad`` (W), which ``uniform`` sets to half of B each unless given.
    """

    forward: PerStage = 1.0
    backward: PerStage = 2.0
    input_grad: PerStage = 1.0
    weight_grad: PerStage = 1.0
    transfer: float = 0.0
    send: float = 0.0
    update: PerStage = 0.0  # the optimizer's update of the stage's parameters (``step_time``)
    gap: float = 0.0  # the runtime's own time between two of a rank's actions (module docstring)

    @classmethod
    def uniform(
        cls,
        forward: float = 1.0,
        backward: float = 2.0,
        input_grad: float | None = None,
        weight_grad: float | None = None,
        transfer: float = 0.0,
        send: float = 0.0,
    ) -> Costs:
        """The same costs on every stage; I and W default to B/2 each."""
        i = backward / 2 if input_grad is None else input_grad
        w = backward - i if weight_grad is None else weight_grad
        return cls(forward, backward, i, w, transfer, send)

    def of(self, action: Action) -> float:
        table = {
            Kind.FORWARD: self.forward,
            Kind.BACKWARD: self.backward,
            Kind.INPUT_GRAD: self.input_grad,
            Kind.WEIGHT_GRAD: self.weight_grad,
        }[action.kind]
        return table if isinstance(table, float | int) else table[action.stage]


@dataclass(frozen=True)
class Slot:
    """One action on the timeline."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Each rank's slots in run order, and the bubble they leave."""

    slots: dict[int, list[Slot]]
    makespan: float
    busy: dict[int, float] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """Idle time over total time, all ranks together."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.slots) * self.makespan)

    def spans(self, rank: int, unit_s: float = 1e-3) -> list[Span]:
        """Rank ``rank``'s actions as the trace recorder's spans (``unit_s`` seconds per cost unit).

        ``observe.trace.rank_events(timeline.spans(r), r, origin=0.0)`` turns them into the Chrome-trace
        events a run's ``trace.json`` holds: a ``step`` span over the whole iteration, then one compute
        span per action named like ``0F1``, with its stage, kind and micro-batch in ``args``.
        """
        spans = [Span("simulated step", "step", "step", 0.0, self.makespan * unit_s)]
        for slot in self.slots[rank]:
            action = slot.action
            args = {"stage": action.stage, "kind": action.kind.value, "microbatch": action.microbatch}
            spans.append(
                Span(
                    str(action),
                    "compute",
                    "actions",  # the lane the runtime records its actions in
                    slot.start * unit_s,
                    (slot.end - slot.start) * unit_s,
                    args,
                )
            )
        return spans


def simulate(schedule: Mapping[int, Sequence[Action]], placement: Sequence[int], costs: Costs) -> Timeline:
    """The earliest-start timeline of ``schedule`` (validated first: a bad one raises ``ScheduleError``)."""
    microbatches = 1 + max((a.microbatch for acts in schedule.values() for a in acts), default=0)
    validate(schedule, placement, microbatches)
    backward_kind = backward_kinds(schedule)
    posting = _posts(schedule, placement, costs.send)
    end: dict[Action, float] = {}
    leaves: dict[Action, float] = {}  # when what an action sends to another rank is posted
    slots: dict[int, list[Slot]] = {rank: [] for rank in schedule}
    clock = {rank: 0.0 for rank in schedule}
    moved = True
    while moved:  # a validated schedule finishes: every pass moves some rank
        moved = False
        for rank, actions in schedule.items():
            while len(slots[rank]) < len(actions):
                action = actions[len(slots[rank])]
                needs = dependencies(action, len(placement), backward_kind)
                if any(n not in end for n in needs):
                    break
                ready = [leaves[n] + costs.transfer if placement[n.stage] != rank else end[n] for n in needs]
                start = max([clock[rank] + (costs.gap if slots[rank] else 0.0), *ready])
                end[action] = start + costs.of(action)
                clock[rank] = leaves[action] = end[action] + posting[rank][len(slots[rank])]
                slots[rank].append(Slot(action, start, end[action]))
                moved = True
    busy = {rank: sum(s.end - s.start for s in rank_slots) for rank, rank_slots in slots.items()}
    return Timeline(slots, max(end.values(), default=0.0), busy)


def step_time(timeline: Timeline, placement: Sequence[int], costs: Costs) -> float:
    """The step's length where each rank updates right after its own last action, not waiting for
    the others (a pipeline under ``Engine.updates_early``): over the ranks, the latest of (the rank's
    last action's end + the updates of every stage it holds). The makespan when ``costs.update`` is 0."""
    updates = costs.update
    ends = []
    for rank in sorted(set(placement)):
        stages = [s for s, r in enumerate(placement) if r == rank]
        held = updates * len(stages) if isinstance(updates, float | int) else sum(updates[s] for s in stages)
        ends.append(max((slot.end for slot in timeline.slots.get(rank, [])), default=0.0) + held)
    return max(ends, default=0.0)


def _posts(
    schedule: Mapping[int, Sequence[Action]], placement: Sequence[int], send: float
) -> dict[int, list[float]]:
    """Per rank, per action: the time posting its messages to other ranks occupies the rank."""
    return {
        rank: [send * len(sends) for _, _, sends in transfers(rank, actions, placement)]
        for rank, actions in schedule.items()
    }


def format_timeline(timeline: Timeline) -> str:
    """A text picture: one row per rank, each cost unit a fixed-width cell, idle time as dots."""
    durations = [s.end - s.start for slots in timeline.slots.values() for s in slots if s.end > s.start]
    starts = [s.start for slots in timeline.slots.values() for s in slots]
    unit = min(durations + [x for x in starts if x > 0], default=1.0)
    width = 1 + max((len(str(s.action)) for slots in timeline.slots.values() for s in slots), default=3)
    lines = [f"makespan {timeline.makespan:g}, bubble {timeline.bubble:.4f} (idle / total over ranks)"]
    for rank, slots in sorted(timeline.slots.items()):
        row, now = "", 0.0
        for s in slots:
            row += "." * width * round((s.start - now) / unit)
            row += str(s.action).ljust(width * max(1, round((s.end - s.start) / unit)))
            now = s.end
        row += "." * width * round((timeline.makespan - now) / unit)
        lines.append(f"rank {rank}: {row}")
    return "\n".join(lines)
