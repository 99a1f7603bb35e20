"""Check a schedule without processes: complete, well ordered, deadlock-free; and its activation memory.

Rules, for ``S`` stages placed on ranks by ``placement`` and ``m`` micro-batches:

1. every rank 0..p-1 has a list, and each action runs on the rank that holds its stage;
2. every (stage, micro-batch) has exactly one F and either one B or one I and one W, nothing twice;
3. dependencies: F of stage s needs F of s-1 (the activation); B or I of stage s needs F of s and the
   B or I of s+1 (the gradient); W needs the I of the same stage and micro-batch. When both ends of a
   dependency are on one rank, the list must already have them in order ("wrong order");
4. no deadlock: the ranks are run in order, each blocking until what its next action needs was
   produced (a blocking receive). If no rank can move, the ranks wait on each other in a cycle, which
   the error names, rank by rank, with the action each is stuck at and the one it waits for;
5. messages: derived from the list (``actions.transfers``), so once rule 2 holds every send meets
   exactly one receive by construction; ``Report.messages`` counts them. The order the runtime posts
   them in (the same at both ends of every pair, as NCCL needs) is ``messages.plan``'s, checked by
   ``messages.check_same_order``. The model has sends never block (the runtime's are asynchronous);
   only a receive waits.

Memory: ``peak_in_flight[r]`` is the most (stage, micro-batch) pairs rank r holds between F and B/I
(activations waiting for their backward); ``peak_held[r]`` keeps a pair until its W as well.
Between I and W a pair no longer holds its activations, only what W reads (each linear layer's input
and output gradient, ``engine/linear.py``): ``peak_activations`` weighs the two spans apart. Each
pair is one stage's activations for one micro-batch; with v chunks per rank a stage is 1/v of the
rank's layers. Communication: none (pure).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardwise.pipeline.actions import Action, Kind, transfers

# the paper's letters (Qi et al. 2023): I is the input gradient
F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD  # noqa: E741
_SHOWN = 6  # how many offending actions an error lists


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the ranks and actions at fault."""


@dataclass(frozen=True)
class Report:
    """What a valid schedule costs in memory and messages."""

    peak_in_flight: dict[int, int]  # rank -> most (stage, mb) between F and B/I
    peak_held: dict[int, int]  # rank -> most (stage, mb) between F and B/W
    messages: int  # point-to-point messages per step, all ranks


def validate(schedule: Mapping[int, Sequence[Action]], placement: Sequence[int], microbatches: int) -> Report:
    """Raise ``ScheduleError`` naming the fault, or return the schedule's memory and message counts."""
    _check_ranks(schedule, placement, microbatches)
    backward_kind = _check_complete(schedule, len(placement), microbatches)
    _check_order_and_deadlock(schedule, placement, backward_kind)
    sends = [t for r, acts in schedule.items() for _, _, out in transfers(r, acts, placement) for t in out]
    return Report(
        peak_in_flight={r: _peak(acts, frees=(B, I)) for r, acts in schedule.items()},
        peak_held={r: _peak(acts, frees=(B, W)) for r, acts in schedule.items()},
        messages=len(sends),
    )


def dependencies(action: Action, stages: int, backward_kind: Mapping[tuple[int, int], Kind]) -> list[Action]:
    """The actions that must finish before ``action`` can start (on any rank)."""
    s, mb = action.stage, action.microbatch
    if action.kind is F:
        return [Action(s - 1, F, mb)] if s > 0 else []
    if action.kind is W:
        return [Action(s, I, mb)]
    needs = [Action(s, F, mb)]
    if s < stages - 1:
        needs.append(Action(s + 1, backward_kind[(s + 1, mb)], mb))
    return needs


def backward_kinds(schedule: Mapping[int, Sequence[Action]]) -> dict[tuple[int, int], Kind]:
    """(stage, mb) -> B or I: which action sends that micro-batch's gradient to the previous stage."""
    return {(a.stage, a.microbatch): a.kind for acts in schedule.values() for a in acts if a.sends_backward}


def _check_ranks(
    schedule: Mapping[int, Sequence[Action]], placement: Sequence[int], microbatches: int
) -> None:
    pp = max(placement) + 1 if placement else 0
    if sorted(schedule) != list(range(pp)):
        raise ScheduleError(
            f"the schedule has ranks {sorted(schedule)}, but the placement uses ranks 0..{pp - 1}"
        )
    for rank, actions in schedule.items():
        for action in actions:
            if not 0 <= action.stage < len(placement):
                raise ScheduleError(f"rank {rank} runs {action}, but stages are 0..{len(placement) - 1}")
            if not 0 <= action.microbatch < microbatches:
                raise ScheduleError(f"rank {rank} runs {action}, but micro-batches are 0..{microbatches - 1}")
            if placement[action.stage] != rank:
                raise ScheduleError(
                    f"rank {rank} runs {action}, but stage {action.stage} is placed on rank "
                    f"{placement[action.stage]}"
                )


def _check_complete(
    schedule: Mapping[int, Sequence[Action]], stages: int, microbatches: int
) -> dict[tuple[int, int], Kind]:
    counts = Counter(a for acts in schedule.values() for a in acts)
    twice = sorted(a for a, n in counts.items() if n > 1)
    if twice:
        raise ScheduleError(f"{len(twice)} actions appear more than once: {_names(twice)}")
    missing: list[str] = []
    mixed: list[str] = []
    for s in range(stages):
        for mb in range(microbatches):
            has = {kind for kind in Kind if Action(s, kind, mb) in counts}
            if F not in has:
                missing.append(str(Action(s, F, mb)))
            if B in has and has & {I, W}:
                mixed.append(f"{s}B{mb} with {s}I{mb}/{s}W{mb}")
            elif B not in has and has & {I, W} != {I, W}:
                gone = [k for k in (I, W) if k not in has] if has & {I, W} else [B]
                missing.extend(str(Action(s, k, mb)) for k in gone)
    if missing:
        raise ScheduleError(f"{len(missing)} actions are missing: {_names(missing)}")
    if mixed:
        raise ScheduleError(f"a micro-batch has both a full backward and a split one: {_names(mixed)}")
    return backward_kinds(schedule)


def _check_order_and_deadlock(
    schedule: Mapping[int, Sequence[Action]],
    placement: Sequence[int],
    backward_kind: Mapping[tuple[int, int], Kind],
) -> None:
    stages = len(placement)
    for rank, actions in schedule.items():
        position = {a: i for i, a in enumerate(actions)}
        for i, action in enumerate(actions):
            for need in dependencies(action, stages, backward_kind):
                if placement[need.stage] == rank and position[need] > i:
                    raise ScheduleError(
                        f"wrong order on rank {rank}: {action} (position {i}) comes before {need} "
                        f"(position {position[need]}), which it needs"
                    )
    heads, done = _run_blocking(schedule, placement, backward_kind)
    if all(heads[r] == len(schedule[r]) for r in schedule):
        return
    raise ScheduleError(_describe_deadlock(schedule, placement, backward_kind, heads, done))


def _run_blocking(
    schedule: Mapping[int, Sequence[Action]],
    placement: Sequence[int],
    backward_kind: Mapping[tuple[int, int], Kind],
) -> tuple[dict[int, int], set[Action]]:
    """Run every rank in order until all finish or none can move; return where each stopped."""
    stages = len(placement)
    heads = {rank: 0 for rank in schedule}
    done: set[Action] = set()
    moved = True
    while moved:
        moved = False
        for rank, actions in schedule.items():
            while heads[rank] < len(actions) and all(
                need in done for need in dependencies(actions[heads[rank]], stages, backward_kind)
            ):
                done.add(actions[heads[rank]])
                heads[rank] += 1
                moved = True
    return heads, done


def _describe_deadlock(
    schedule: Mapping[int, Sequence[Action]],
    placement: Sequence[int],
    backward_kind: Mapping[tuple[int, int], Kind],
    heads: Mapping[int, int],
    done: set[Action],
) -> str:
    """Follow 'rank r waits for rank q' from a stuck rank until it closes a cycle, and name it."""
    waits: dict[int, tuple[Action, Action]] = {}
    for rank, actions in schedule.items():
        if heads[rank] < len(actions):
            stuck = actions[heads[rank]]
            need = next(n for n in dependencies(stuck, len(placement), backward_kind) if n not in done)
            waits[rank] = (stuck, need)
    rank = min(waits)
    path: list[int] = []
    while rank not in path:
        path.append(rank)
        rank = placement[waits[rank][1].stage]
    cycle = path[path.index(rank) :]
    links = ", ".join(
        f"rank {r} waits at {waits[r][0]} for {waits[r][1]} (rank {placement[waits[r][1].stage]})"
        for r in cycle
    )
    return f"deadlock: {links}"


def peak_activations(actions: Sequence[Action], in_flight: float = 1.0, kept: float = 1.0) -> float:
    """The most a rank running ``actions`` holds at once: ``in_flight`` per (stage, micro-batch) pair
    from its F to its B or I (what the stage saved for backward), ``kept`` per pair from its I to its W
    (what the W pass reads); both in the caller's unit (bytes of one stage's pair, or 1)."""
    live: set[tuple[int, int]] = set()
    waiting: set[tuple[int, int]] = set()
    peak = 0.0
    for action in actions:
        key = (action.stage, action.microbatch)
        if action.kind is F:
            live.add(key)
        elif action.kind is I:
            live.discard(key)
            waiting.add(key)
        else:
            live.discard(key)
            waiting.discard(key)
        peak = max(peak, in_flight * len(live) + kept * len(waiting))
    return peak


def _peak(actions: Sequence[Action], frees: tuple[Kind, Kind]) -> int:
    live: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        key = (action.stage, action.microbatch)
        if action.kind is F:
            live.add(key)
            peak = max(peak, len(live))
        elif action.kind in frees:
            live.discard(key)
    return peak


def _names(items: Sequence[object]) -> str:
    shown = ", ".join(str(x) for x in items[:_SHOWN])
    return shown + (f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")
