"""A pipeline schedule as data: each rank's ordered list of compute actions, and the messages they imply.

An ``Action`` is one stage's work on one micro-batch: ``F`` forward, ``B`` full backward, or the
zero-bubble split of ``B`` into ``I`` (gradient of the stage's input, on the critical path to the
previous stage) and ``W`` (gradient of the stage's weights, free to run later and fill a bubble;
Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241). Written ``<stage><kind><mb>``:
``0F0 0F1 0B0`` is stage 0's forward of micro-batch 0, forward of 1, backward of 0 (torch's notation).

Communication is derived from the compute list, not listed in it: a schedule names only compute, and
``transfers`` reads the messages off it given the stage placement (stage -> rank). Stage ``s``'s
forward sends its output (an activation) to stage ``s + 1``; stage ``s``'s backward or input-gradient
sends the gradient of its input to stage ``s - 1``; nothing is sent between two stages on the same
rank (the turn of a V). The receive is posted for the action that consumes it, the send issued right
after the action that produces it. Deriving keeps one source of truth (a hand-listed send can no longer
disagree with its compute) and lets the runtime post receives ahead and send asynchronously; messages
are matched by (kind, stage, micro-batch), so the runtime tags them rather than relying on order.
Communication pattern: point-to-point only, between the ranks of adjacent stages.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

Schedule = dict[int, list["Action"]]  # rank -> the actions it runs, in order


class Kind(str, Enum):
    """What an action computes; the value is its letter in the printed form."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    INPUT_GRAD = "I"  # zero-bubble: the input gradient only (sent on to the previous stage)
    WEIGHT_GRAD = "W"  # zero-bubble: the weight gradient only (needs the I of the same micro-batch)


@dataclass(frozen=True, order=True)
class Action:
    """Stage ``stage``'s ``kind`` work on micro-batch ``microbatch``; printed ``<stage><kind><mb>``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def sends_backward(self) -> bool:
        """Whether this action produces the gradient the previous stage waits for (B or I)."""
        return self.kind in (Kind.BACKWARD, Kind.INPUT_GRAD)


def fuse_weight_passes(actions: Sequence[Action]) -> list[Action]:
    """``actions`` with every I of the first stage followed at once by its own W run as one B: the
    same gradients at the same time (the first stage sends no input gradient, so nothing waits on
    the I alone), without keeping the weight gradients' operands in between or paying for the split
    (``engine/linear.py``). Elsewhere an I sends the previous stage its gradient before the W runs,
    so the split stays."""
    out: list[Action] = []
    for action in actions:
        last = out[-1] if out else None
        if (
            action.kind is Kind.WEIGHT_GRAD
            and action.stage == 0
            and last is not None
            and last.kind is Kind.INPUT_GRAD
            and (last.stage, last.microbatch) == (action.stage, action.microbatch)
        ):
            out[-1] = Action(action.stage, Kind.BACKWARD, action.microbatch)
        else:
            out.append(action)
    return out


def fuse_schedule(schedule: Mapping[int, Sequence[Action]]) -> Schedule:
    """``fuse_weight_passes`` on every rank's list: the schedule as the runtime starts it."""
    return {rank: fuse_weight_passes(actions) for rank, actions in schedule.items()}


_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


def parse_action(text: str) -> Action:
    """``"1B3"`` -> ``Action(1, Kind.BACKWARD, 3)``; anything else is refused in one line."""
    match = _ACTION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"bad action {text!r}: write <stage><F|B|I|W><micro-batch>, e.g. 0F1")
    return Action(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


def parse_actions(text: str) -> list[Action]:
    """``"0F0 0F1 0B0"`` -> three actions (whitespace separated)."""
    return [parse_action(word) for word in text.split()]


def format_actions(actions: Iterable[Action]) -> str:
    return " ".join(str(action) for action in actions)


def format_schedule(schedule: Mapping[int, Sequence[Action]]) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"rank {rank}: {format_actions(schedule[rank])}" for rank in sorted(schedule))


def parse_schedule(text: str) -> Schedule:
    """The reverse of ``format_schedule``."""
    schedule: Schedule = {}
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        words = head.split()
        if len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
            raise ValueError(f"bad schedule line {line!r}: write 'rank <r>: 0F0 0F1 ...'")
        schedule[int(words[1])] = parse_actions(body)
    return schedule


@dataclass(frozen=True)
class Transfer:
    """One message: ``op`` is send or recv seen from ``rank``; ``peer`` the other end.

    ``what`` is "activation" (the output of stage ``stage``'s forward, consumed by stage + 1) or
    "gradient" (the input gradient of stage ``stage``'s backward, consumed by stage - 1).
    """

    rank: int
    op: str  # "send" | "recv"
    peer: int
    what: str  # "activation" | "gradient"
    stage: int  # the producing stage
    microbatch: int

    @property
    def key(self) -> tuple[str, int, int]:
        """What the runtime tags the message with, so each send meets exactly its receive."""
        return (self.what, self.stage, self.microbatch)


def transfers(
    rank: int, actions: Sequence[Action], placement: Sequence[int]
) -> list[tuple[Action, list[Transfer], list[Transfer]]]:
    """Each action of ``rank`` with the receives it needs first and the sends it issues after.

    ``placement[stage]`` is the rank holding that stage. Stages next to each other on one rank (the
    turn of a V) exchange nothing.
    """
    last = len(placement) - 1
    out = []
    for action in actions:
        recvs: list[Transfer] = []
        sends: list[Transfer] = []
        s, mb = action.stage, action.microbatch
        if action.kind is Kind.FORWARD:
            if s > 0 and placement[s - 1] != rank:
                recvs.append(Transfer(rank, "recv", placement[s - 1], "activation", s - 1, mb))
            if s < last and placement[s + 1] != rank:
                sends.append(Transfer(rank, "send", placement[s + 1], "activation", s, mb))
        elif action.sends_backward:
            if s < last and placement[s + 1] != rank:
                recvs.append(Transfer(rank, "recv", placement[s + 1], "gradient", s + 1, mb))
            if s > 0 and placement[s - 1] != rank:
                sends.append(Transfer(rank, "send", placement[s - 1], "gradient", s, mb))
        out.append((action, recvs, sends))
    return out
