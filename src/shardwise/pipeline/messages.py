"""When each rank posts each of a pipeline's messages: one order per step, the same on both peers.

NCCL ignores tags and runs a pair's sends and receives in the order they are posted (one stream per
communicator), so a pipeline whose ranks post them in different orders deadlocks there, or delivers a
gradient into an activation's buffer. Every message of a step therefore gets one global rank: the time
its producing action ends on the schedule's earliest-start timeline with unit costs (F 1, B 2, I 1,
W 1; ``simulate.simulate``), ties broken by (stage, micro-batch, what). Each rank posts its own sends
and receives in that order and no other, so the ops of every pair of ranks come in the same order on
both ends (``check_same_order`` holds every schedule to it), and the runtime uses one tag for all.

Where in a rank's action list each op is posted (``post_plan``; boundary ``i`` is just before the
rank's action ``i``, boundary ``len(actions)`` after its last): a send as soon as its producing
action ended (the boundary after it); a receive as early as the order allows, i.e. together with the
send before it in the order (at the step's start if none), so the buffer is there well before the
data and no peer's send waits on this rank. Both ends posting in one total order that the timeline
makes causal (a message ranks after every message its producer needed) is deadlock-free even when
each op runs to completion alone in that order, as NCCL's stream runs them: the pending op of
lowest rank is always posted at both of its ends. The runtime waits for a receive only right
before the action that reads it, and for its sends at the end of the step.

Over gloo (``post_plan(early=True)``) every receive is posted at once instead, still in that order
among themselves, at the step's start, or on a rank whose first action reads nothing (the first
stage's) right after that action's sends, so the next stage is not kept waiting for posts that
nothing can arrive for yet: gloo matches each direction of a pair by order alone and a posted
receive holds up no other op. A gloo send whose receive is already posted is written by the sender's
own thread as it is posted; one posted first waits for the receiver's notice, which gloo's
event-loop threads relay, and on a busy 2-core machine such a hand-off took 1-6 ms. An in-launch A/B
of the pipeline bench (ours early, ours in the one order, torch's class, steps rotating; 3 launches
of 40 steps) gave zbv +5-7%, interleaved-zb +4%, dualpipev +2%, interleaved +1%, the
one-stage-a-rank schedules from -1% to +2%. The price: the buffers of every message the step receives
exist from its start (per stage boundary crossed, one activation and one gradient per micro-batch),
small beside the activations each stage keeps. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardwise.pipeline.actions import Action, Transfer, transfers
from shardwise.pipeline.simulate import Costs, simulate
from shardwise.pipeline.validate import ScheduleError

MessageKey = tuple[str, int, int]  # (what, producing stage, micro-batch)
_UNIT = Costs.uniform(forward=1.0, backward=2.0)


def message_order(
    schedule: Mapping[int, Sequence[Action]], placement: Sequence[int]
) -> dict[MessageKey, tuple[float, int, int, str]]:
    """Every message's rank in the step's one order (smaller first), from the unit-cost timeline."""
    timeline = simulate(schedule, placement, _UNIT)
    order: dict[MessageKey, tuple[float, int, int, str]] = {}
    for rank, slots in timeline.slots.items():
        actions = [slot.action for slot in slots]
        for slot, (_, _, sends) in zip(slots, transfers(rank, actions, placement), strict=True):
            for t in sends:
                order[t.key] = (slot.end, t.stage, t.microbatch, t.what)
    return order


def post_plan(
    rank: int,
    actions: Sequence[Action],
    placement: Sequence[int],
    order: Mapping[MessageKey, tuple[float, int, int, str]],
    early: bool = False,
) -> list[list[Transfer]]:
    """The ops ``rank`` posts at each boundary of its list (``len(actions) + 1`` of them), in order.

    ``early`` (only where a posted receive holds up no other op: ``Comm.receives_stand_aside``):
    every receive at once (``_first_post``: the step's start, or on a rank whose first action reads
    nothing right after that action's sends), still in the one order among themselves, which is all
    a backend that matches each pair's messages by their order (gloo) needs (module docstring)."""
    ops: list[tuple[int, Transfer]] = []  # (the index of the action that sends or reads it, op)
    for index, (_, recvs, sends) in enumerate(transfers(rank, actions, placement)):
        ops.extend((index, t) for t in recvs + sends)
    ops.sort(key=lambda item: order[item[1].key])
    posts: list[list[Transfer]] = [[] for _ in range(len(actions) + 1)]
    boundary = 0
    for index, t in ops:
        if t.op == "send":
            boundary = max(boundary, index + 1)  # after the action that produced it
        elif boundary > index:  # cannot happen for a timeline's order: a message ranks after everything
            raise ScheduleError(  # its producer needed, so before anything its reader sends
                f"rank {rank} would post its receive of {t.what} {t.stage}:{t.microbatch} after the "
                f"action that reads it ({actions[index]})"
            )
        if not (early and t.op == "recv"):
            posts[boundary].append(t)
    if early:
        receives = [t for _, t in ops if t.op == "recv"]
        posts[_first_post(ops)].extend(receives)  # after that boundary's sends
    return posts


def _first_post(ops: Sequence[tuple[int, Transfer]]) -> int:
    """Where a gloo plan posts all its receives: at the first boundary with a send (after the sends),
    or before the first action that reads a message if that comes sooner. A first stage's rank thus
    runs its first forward and sends its output before anything else: the next stage waits on that
    send, and nothing can arrive for it sooner."""
    firsts = [index + 1 if t.op == "send" else index for index, t in ops]
    return min(firsts, default=0)


def plan(
    schedule: Mapping[int, Sequence[Action]], placement: Sequence[int], early: bool = False
) -> dict[int, list[list[Transfer]]]:
    """Every rank's ``post_plan``."""
    order = message_order(schedule, placement)
    return {rank: post_plan(rank, actions, placement, order, early) for rank, actions in schedule.items()}


def check_same_order(plans: Mapping[int, Sequence[Sequence[Transfer]]], directed: bool = False) -> int:
    """Raise ``ScheduleError`` unless every pair of ranks posts its messages in the same order at both
    ends (each one's send where the other has its receive); returns how many messages were checked.
    ``directed``: each direction of a pair on its own, all that gloo's matching needs (``early``)."""
    seen: dict[tuple[int, int], dict[int, list[MessageKey]]] = {}
    for rank, posts in plans.items():
        for t in (t for boundary in posts for t in boundary):
            if directed:  # (sender, receiver)
                pair = (rank, t.peer) if t.op == "send" else (t.peer, rank)
            else:
                pair = (min(rank, t.peer), max(rank, t.peer))
            seen.setdefault(pair, {}).setdefault(rank, []).append(t.key)
    for (a, b), ends in sorted(seen.items()):
        mine, theirs = ends.get(a, []), ends.get(b, [])
        if mine != theirs:
            at = next((i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y), None)
            where = f"message {at}: rank {a} posts {mine[at]}, rank {b} {theirs[at]}" if at is not None else (
                f"rank {a} posts {len(mine)} messages, rank {b} {len(theirs)}"
            )
            raise ScheduleError(f"ranks {a} and {b} post their messages in different orders ({where})")
    return sum(len(ends.get(a, [])) for (a, _), ends in seen.items())
