"""A split backward kept only where it pays: a zero-bubble schedule fitted to measured costs.

A zero-bubble schedule splits each backward into I (the input's gradient, sent on at once) and W
(the weights', run later to fill a bubble). The split is not free: W's matmuls find their operands
out of cache and every deferred layer pays a hook, so I + W costs more than B (by 2-8% per
micro-batch for the small layers of the CPU bench, its F 7% more). Where a W fills no bubble, running it
right after its I, as one B, is then faster. ``fit_schedule`` decides it W by W on the simulator
(``simulate.simulate``) with costs measured on the run itself: each W, in order, is moved next to its
I and the pair made one B wherever that does not lengthen the simulated step. The step a rank
takes ends with its update, which a pipeline's rank starts right after its own last action
(``Engine.updates_early``): so the step is each rank's last action plus its measured update, the
latest of them (``simulate.step_time``), and a W deferred into a rank's tail pays for delaying that
rank's update. Every rank given the same costs makes the same choices, so their plans (and message
orders) agree.

``fully_fused`` is the schedule with every split undone, ``split_by_parity`` the one with every
other micro-batch's split undone, ``measured_costs`` turns a run's per-stage timings into the
simulator's costs, and ``fit_report`` / ``describe_fit`` say what a fit kept; the runtime
(``PipelineRunner``) times ``fitting.TIMED_STEPS`` steps split by parity, agrees on the timings and
runs the fitted one from then on (or, with ``parallel.fit_schedule = false``, the schedule as built
every step). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardwise.pipeline.actions import Action, Kind, Schedule
from shardwise.pipeline.simulate import Costs, simulate, step_time

# what is timed per stage: F and B unsplit, F/I/W of a split one, and U, its share of the rank's update
# where the rank updates before the step's verdict (``Engine.updates_early``; else none is timed)
KINDS = ("F", "B", "Fs", "I", "W", "U")


def fully_fused(schedule: Mapping[int, Sequence[Action]]) -> Schedule:
    """Every W run right after its I, the two as one B."""
    return {rank: _fuse_where(actions, lambda _: True) for rank, actions in schedule.items()}


def split_by_parity(schedule: Mapping[int, Sequence[Action]], parity: int) -> Schedule:
    """Only the backwards of the micro-batches whose index has ``parity`` (0 or 1) split, the others'
    W run right after their I as one B: one step then times F and B beside the split's F, I and W
    (``fitting``), at whatever speed the machine has in that step."""
    return {
        rank: _fuse_where(actions, lambda a: a.microbatch % 2 != parity) for rank, actions in schedule.items()
    }


def _fuse_where(actions: Sequence[Action], fuse: Callable[[Action], bool]) -> list[Action]:
    """``actions`` with each split backward for which ``fuse`` holds made one B (at its I's place)."""
    out = []
    for action in actions:
        if action.kind in (Kind.INPUT_GRAD, Kind.WEIGHT_GRAD) and fuse(action):
            if action.kind is Kind.INPUT_GRAD:
                out.append(Action(action.stage, Kind.BACKWARD, action.microbatch))
            continue
        out.append(action)
    return out


def splits(schedule: Mapping[int, Sequence[Action]]) -> bool:
    """Whether ``schedule`` splits any backward."""
    return any(a.kind is Kind.INPUT_GRAD for actions in schedule.values() for a in actions)


def measured_costs(per_stage: Sequence[Mapping[str, float]]) -> Costs:
    """The simulator's costs from each stage's measured seconds (``KINDS``): F and B unsplit; a split
    micro-batch's I carries what its F cost more than an unsplit one (its layers' deferring path)."""
    forward = tuple(s["F"] for s in per_stage)
    backward = tuple(s["B"] for s in per_stage)
    input_grad = tuple(s["I"] + max(0.0, s["Fs"] - s["F"]) for s in per_stage)
    weight_grad = tuple(s["W"] for s in per_stage)
    update = tuple(s.get("U", 0.0) for s in per_stage)
    return Costs(forward, backward, input_grad, weight_grad, update=update)


def fit_schedule(
    schedule: Mapping[int, Sequence[Action]], placement: Sequence[int], costs: Costs
) -> tuple[Schedule, int]:
    """``schedule`` with each W that fills no bubble run next to its I as one B (module docstring);
    returns it and how many splits it kept."""
    current: Schedule = {rank: list(actions) for rank, actions in schedule.items()}
    best = _step(current, placement, costs)
    candidates = [
        (rank, a) for rank, actions in current.items() for a in actions if a.kind is Kind.WEIGHT_GRAD
    ]
    for rank, weight in candidates:
        trial = {**current, rank: fuse_one(current[rank], weight)}
        length = _step(trial, placement, costs)
        if length <= best:
            current, best = trial, length
    kept = sum(a.kind is Kind.INPUT_GRAD for actions in current.values() for a in actions)
    return current, kept


def _step(schedule: Schedule, placement: Sequence[int], costs: Costs) -> float:
    """The simulated step a fit compares: each rank's update after its own last action (``step_time``)."""
    return step_time(simulate(schedule, placement, costs), placement, costs)


def fuse_one(actions: Sequence[Action], weight: Action) -> list[Action]:
    """``actions`` with ``weight`` (a W) removed and its I made a B: one step of ``fit_schedule``."""
    return _fuse_where(actions, lambda a: (a.stage, a.microbatch) == (weight.stage, weight.microbatch))


def fit_report(
    built: Mapping[int, Sequence[Action]], fitted: Mapping[int, Sequence[Action]],
    per_stage: Sequence[Mapping[str, float]],
) -> dict[str, Any]:  # fmt: skip
    """What a fit chose: how many backwards the schedule splits as built and how many it kept split,
    which (``[stage, micro-batch]``, from 0), and the costs it chose from as timed (ms per
    micro-batch; U, the stage's share of its rank's update, ms per step; a stage that never splits
    has no Fs, I or W)."""
    kept = sorted(
        (a.stage, a.microbatch) for acts in fitted.values() for a in acts if a.kind is Kind.INPUT_GRAD
    )
    return {
        "splits_built": sum(a.kind is Kind.INPUT_GRAD for acts in built.values() for a in acts),
        "splits_kept": len(kept),
        "kept": [list(k) for k in kept],
        "measured_ms": [{k: round(1e3 * v, 3) for k, v in s.items()} for s in per_stage],
    }


def describe_fit(microbatches: int, report: Mapping[str, Any]) -> str:
    """One line for a user: what the fit kept split, and how to keep every split instead."""
    built, kept = report["splits_built"], report["splits_kept"]
    by_stage: dict[int, list[str]] = {}
    for stage, mb in report["kept"]:
        by_stage.setdefault(stage, []).append(str(mb))
    where = "; ".join(f"stage {s}: micro-batch {', '.join(mbs)}" for s, mbs in sorted(by_stage.items()))
    if kept == built:
        every = f"all {built} backwards stay" if built > 1 else "its one split backward stays"
        split = f"{every} split into I and a later W ({where})"
    elif kept:
        split = (
            f"{kept} of {built} backwards stay split into I and a later W ({where}); the other "
            f"{built - kept} run as one B, where their W would fill no bubble"
        )
    else:
        split = f"none of its {built} split backwards pays here: all {built} run as one B"
    return (
        f"the zero-bubble schedule, fitted to this run's timings ({microbatches} "
        f"micro-batch{'es' if microbatches != 1 else ''}), from the "
        f"next step on: {split} "
        "(--set parallel.fit_schedule=false keeps every split as built)"
    )
