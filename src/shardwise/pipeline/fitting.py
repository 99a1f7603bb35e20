"""Fitting a zero-bubble schedule to the run: timed steps, one agreement, the fitted plan.

For a schedule that splits backwards, per micro-batch count: step 0 runs as built (warm-up, not
timed); then ``TIMED_STEPS`` timed steps, each with only every other micro-batch's backward split
(``adapt.split_by_parity``: the even ones, the odd ones, the odd ones, the even ones), so each of them
times F and B (unsplit) beside the split's F, I and W, all at the speed the machine has in that step
(with one micro-batch a step is split or fused whole, in that order, so a steady drift of the machine
weighs on both alike), and, where ranks update before the step's verdict (``Engine.updates_early``),
the update after each timed step but the last, U, shared equally by the rank's stages; then every
rank that steps sums its stages' timings in one all-reduce (each stage's mean over the ranks that
hold it: its dp replicas, its tp shards), so all of them fit the same
schedule (``adapt.fit_schedule``), as their message orders and their dp and tp collectives per action
need, and run it from step ``FIT_STEPS`` on. Timing whole steps fused against whole steps split (pairs
of steps, in turn) left the comparison to the machine's speed from one step to the next, which swings
up to 2x on the 2-core bench machine: five fits of the bench's 2-stage zb kept the last stage's splits
{3}, {3}, all four, {2, 3} and none; timed this way, {2, 3} in four fits of five (all four in the
fifth). The gradients are the same whichever ran (a B is an I and a W at once). A schedule without a
split is run as built from the start, and so is every schedule with ``parallel.fit_schedule = false``.
What a fit kept is said once on the reporting rank's stderr by the train loop (``take_notes``) and in
the run's summary (``pipeline_fit``: ``adapt.fit_report``), so a zb run that became nearly 1F1B says
so.

Timing: ``time.perf_counter`` around each action (and update) on the CPU; on a GPU a pair of CUDA
events for each, read after the timed step's last action (``TIMED_STEPS`` reads in a run).
Communication: one all-reduce (sum) of a (stages x 6 x 2) float64 table over the ranks that step,
once per micro-batch count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardwise.collectives.api import Comm
from shardwise.device import HOST, Clock
from shardwise.pipeline.actions import Action, Kind, Schedule
from shardwise.pipeline.adapt import (
    KINDS,
    describe_fit,
    fit_report,
    fit_schedule,
    measured_costs,
    split_by_parity,
    splits,
)

BUILT, FITTED = "built", "fitted"
TIMED = ("split-even", "split-odd")  # the timed steps' schedules, in turn (``adapt.split_by_parity``)
TIMED_STEPS = 4
FIT_STEPS = 1 + TIMED_STEPS  # the steps before the fitted schedule runs: a warm-up, then the timed


class ScheduleFitter:
    """Which schedule each step runs, and the timings that fit it (module docstring)."""

    def __init__(
        self, build: Callable[[int], Schedule], placement: tuple[int, ...], stages: int, fit: bool = True
    ) -> None:
        self._build, self.placement, self.stages = build, placement, stages
        self.fit = fit  # False (``parallel.fit_schedule``): every step runs the schedule as built
        self.reports: dict[int, dict[str, Any]] = {}  # micro-batch count -> its fit (adapt.fit_report)
        self._notes: list[str] = []  # each fit in words, until taken (``take_notes``)
        self._built: dict[int, Schedule] = {}  # micro-batch count -> the schedule as built
        self._splits: dict[int, bool] = {}  # micro-batch count -> whether it splits any backward
        self._steps: dict[int, int] = {}  # micro-batch count -> steps run with it
        self._fitted: dict[int, Schedule] = {}
        self._timed: list[tuple[int, str, Clock]] = []  # (stage, kind, its clock) this step
        self._updates: list[tuple[tuple[int, ...], Clock]] = []  # (the rank's stages, its clock)
        self._sums = torch.zeros(stages, len(KINDS), 2, dtype=torch.float64, device=HOST)  # seconds, count

    def build(self, microbatches: int) -> Schedule:
        """The schedule as built for ``microbatches`` (built once: a large one takes milliseconds)."""
        if microbatches not in self._built:
            self._built[microbatches] = self._build(microbatches)
            self._splits[microbatches] = splits(self._built[microbatches])
        return self._built[microbatches]

    def take_notes(self) -> list[str]:
        """Each fit since the last call, in words (``adapt.describe_fit``), once: the train loop
        prints them."""
        notes, self._notes = self._notes, []
        return notes

    def splits(self, microbatches: int) -> bool:
        """Whether this schedule is fitted: it splits a backward as built (read once per micro-batch
        count), and fitting is on."""
        self.build(microbatches)
        return self.fit and self._splits[microbatches]

    def phase(self, microbatches: int) -> str:
        """What step ``microbatches`` runs now: ``BUILT``, one of ``TIMED`` or ``FITTED``."""
        if microbatches in self._fitted:
            return FITTED
        done = self._steps.get(microbatches, 0)
        if done == 0 or not self.splits(microbatches):
            return BUILT  # the warm-up, or for good
        timed = done - 1  # even, odd, odd, even: with one micro-batch, whole steps split and fused in turn
        return TIMED[(timed + timed // 2) % 2]

    def schedule(self, microbatches: int, phase: str) -> Schedule:
        if phase == FITTED:
            return self._fitted[microbatches]
        built = self.build(microbatches)
        return split_by_parity(built, TIMED.index(phase)) if phase in TIMED else built

    def timing(self, microbatches: int) -> bool:
        """Whether this step's actions are timed (steps 1 to ``FIT_STEPS - 1`` of a splitting schedule)."""
        return (
            self.phase(microbatches) != FITTED
            and 1 <= self._steps.get(microbatches, 0) < FIT_STEPS
            and self.splits(microbatches)
        )

    @contextmanager
    def timed(self, action: Action, split: bool, device: torch.device) -> Iterator[None]:
        """Time ``action`` (``split``: its micro-batch's backward is an I and a W)."""
        kind = {Kind.FORWARD: "Fs" if split else "F", Kind.BACKWARD: "B"}.get(action.kind, action.kind.value)
        clock = Clock(device).start()
        yield
        clock.stop()
        self._timed.append((action.stage, kind, clock))

    def timing_update(self, microbatches: int) -> bool:
        """Whether the update after this step is timed: those of the timed steps but the last (its
        fit comes first) and never the warm-up's (the optimizer makes its state then)."""
        return (
            microbatches not in self._fitted
            and 2 <= self._steps.get(microbatches, 0) < FIT_STEPS
            and self.splits(microbatches)
        )

    @contextmanager
    def timed_update(self, stages: tuple[int, ...], device: torch.device) -> Iterator[None]:
        """Time the update of the rank holding ``stages`` (each stage is given its equal share, U)."""
        clock = Clock(device).start()
        yield
        clock.stop()
        self._updates.append((stages, clock))

    def step_done(self, microbatches: int, trainers: Comm | None) -> None:
        """After a step: its timings added; after the last timed one, the fit (all ranks at once)."""
        if self.phase(microbatches) == FITTED:
            return
        if self._timed or self._updates:
            self._add_timings()
        done = self._steps[microbatches] = self._steps.get(microbatches, 0) + 1
        if done == FIT_STEPS and self.splits(microbatches):
            self._fit(microbatches, trainers)

    def _add_timings(self) -> None:
        """This step's actions and the last step's update (``timed_update``), one wait for the device."""
        timed = [(stage, kind, clock.seconds()) for stage, kind, clock in self._timed]
        for stages, clock in self._updates:
            timed += [(stage, "U", clock.seconds() / len(stages)) for stage in stages]
        for stage, kind, seconds in timed:
            self._sums[stage, KINDS.index(kind), 0] += seconds
            self._sums[stage, KINDS.index(kind), 1] += 1.0
        self._timed.clear()
        self._updates.clear()

    def _fit(self, microbatches: int, trainers: Comm | None) -> None:
        sums = self._sums.clone()
        if trainers is not None:
            trainers.all_reduce(sums)  # every rank then fits from the same numbers
        seconds, counts = sums[..., 0], sums[..., 1].clamp(min=1.0)
        means = (seconds / counts).tolist()
        timed = [
            {k: means[s][i] for i, k in enumerate(KINDS) if sums[s, i, 1] > 0} for s in range(self.stages)
        ]
        built = self.build(microbatches)
        fitted, _ = fit_schedule(built, self.placement, measured_costs([_stage_costs(t) for t in timed]))
        self._fitted[microbatches] = fitted
        self.reports[microbatches] = fit_report(built, fitted, timed)  # what was timed, nothing filled in
        self._notes.append(describe_fit(microbatches, self.reports[microbatches]))
        self._sums.zero_()


def _stage_costs(got: dict[str, float]) -> dict[str, float]:
    """One stage's costs for ``adapt.measured_costs`` from what was timed of it (a stage that ran no
    split gets I and W of half its B, which nothing reads; no update timed: none before the verdict)."""
    b = got.get("B", got.get("I", 0.0) + got.get("W", 0.0))
    f = got.get("F", got.get("Fs", 0.0))
    i, w = got.get("I", b / 2), got.get("W", b / 2)
    return {"F": f, "B": b, "Fs": got.get("Fs", f), "I": i, "W": w, "U": got.get("U", 0.0)}

