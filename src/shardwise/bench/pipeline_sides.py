"""The pipeline bench's launched side: our runtime and torch's schedule class, step by step in one world.

One launch builds both sides on every rank from the same seed (two copies of the same stage modules):
ours through ``parallelize`` (its own groups on the pp axis), torch's as ``PipelineStage`` + the
schedule class over the default group, with the tied embedding and head's gradient and values
exchanged by hand as its users must (``_TiedByHand``). The sides take turns of ``BLOCK`` steps
back to back (ours then torch's, then torch's then ours, ...), so each of our steps has a torch
step near it in time: whatever the machine does to one (another process, a clock change) it does to
the other, and the ratio of a pair cancels it. A turn of several steps is a loop's steady state: a
rank whose step ends later than the others' (the last stage's deferred W's and update, say) overlaps
that tail with the next step's start there, and only a turn's last step carries it, where one step
a turn would charge it to every step. A turn's first step follows another side's turn (or the
profile's repeats), not a step of its own, so it runs and is not timed (``measured_steps``): in turns
of 12 steps (6 launches) ours over torch's 1F1B read 1.016 on a turn's first step and 1.076 from its
fourth. Turns of one step, the profile's barriers only every 4, were
tried again and not kept (README, "Pipeline speed"): two identical 1F1B instances paired step by
step agreed within 0.96-1.02x over 20 steps against 0.91-1.05x in turns of 4, but what a step leaves
to the next then falls on the next side's step, and zb against torch's 1F1B read 1.07-1.08x with the
sides' order reversed every step (zb then follows itself half the time, torch never) and 1.01-1.02x
with it rotated (each a third). zb's launches run our 1F1B as a third side in the same rounds
of turns (``plain``; torch's turn runs between the two), so zb's tokens/s is also paired with our
1F1B's, step k with step k, and the bench's 1f1b row is measured there (``bench/pipeline.py``). The same
processes run the stage profile the simulator is fed with (``pipeline_profile.StageProfile``): one
repeat after each measured step, the rest after the steps. A launch where torch's side (or that
profile) hangs or fails falls back to ours alone (``ours_worker``), so our row still has its
figures. Communication:
whatever each side does; ours point-to-point through ``Comm``; the profile's barriers and relay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from shardwise.bench.pipeline_profile import PROFILE_REPEATS, StageProfile, bench_data, split_stage_modules
from shardwise.config import TrainConfig
from shardwise.observe.monitor import Span
from shardwise.pipeline.fitting import FIT_STEPS
from shardwise.pipeline.schedules import stage_placement
from shardwise.pipeline.split import Split

WARMUP_STEPS = FIT_STEPS  # a split schedule runs its fit's timed steps first (pipeline/fitting.py)
ACTION_LANE = "actions"  # the lane the runtime records each action's span in
TIE_TAG = 7  # the tied weight's messages on torch's side, apart from its schedule's
BLOCK = 4  # steps a side runs back to back before the next side's turn (see the module docstring)
OUR_SIDES = frozenset({"ours", "plain"})  # our runtime's sides: their steps' action spans are kept

Step = Callable[[int], None]


def paired_worker(
    rank: int, world: int, config: TrainConfig, torch_class: str, plain: TrainConfig | None = None
) -> dict[str, Any]:
    """Both sides on this rank, their steps alternating: ``{"ours": ..., "torch": ...}``, each with
    its measured step times in the order they ran (step k of one beside step k of the other); with
    ``plain`` (zb's: our own 1F1B) a third side ``"plain"`` in the same turns; then, in the same
    processes, the stage profile (``"profile"``: ``pipeline_profile.StageProfile``, a repeat after each
    measured step)."""
    from shardwise.launcher import threads_per_rank

    config = config.validate(world)
    profile = StageProfile(rank, world, config, threads_per_rank(world))
    sides = {"ours": _ours_step(config), "torch": _torch_step(config, world, rank, torch_class)}
    if plain is not None:
        sides["plain"] = _ours_step(plain.validate(world))
    out = _alternate(config, sides, between=profile.repeat)
    while profile.repeats <= PROFILE_REPEATS:  # the first warms up
        profile.repeat()
    return {**out, "profile": profile.result()}


def ours_worker(rank: int, world: int, config: TrainConfig) -> dict[str, Any]:
    """Our runtime alone on this rank (the fallback when torch's side cannot run)."""
    config = config.validate(world)
    return _alternate(config, {"ours": _ours_step(config)})["ours"]


def _alternate(
    config: TrainConfig, sides: dict[str, Step], between: Callable[[], None] | None = None
) -> dict[str, Any]:
    """``config.steps`` steps of every side, in turns of ``BLOCK`` steps (the order of the sides
    reverses every turn); per side the times of its measured steps (``measured_steps``), and for our
    sides (``OUR_SIDES``) their action spans and those of the warm-up steps but the first
    (``warmup_spans``: ``pipeline_handoff`` prices a message from them). ``between``: called once
    per measured step index, after every side has run its turn (the stage profile's repeat)."""
    from shardwise.observe.monitor import MONITOR

    names = list(sides)
    out: dict[str, dict[str, list[Any]]] = {name: {"step_s": []} for name in names}
    for name in OUR_SIDES.intersection(names):
        out[name]["spans"] = []
    kept = measured_steps(config.steps)
    MONITOR.tracing = True
    for first in range(0, config.steps, BLOCK):
        block = range(first, min(first + BLOCK, config.steps))
        for name in names if first // BLOCK % 2 == 0 else names[::-1]:
            for step in block:
                MONITOR.spans.clear()
                started = time.perf_counter()
                sides[name](step)
                out[name]["step_s"].append(time.perf_counter() - started)
                if name in OUR_SIDES:
                    out[name]["spans"].append([_plain(s) for s in MONITOR.spans if s.lane == ACTION_LANE])
        if between is not None:
            for _ in range(sum(step in kept for step in block)):
                between()
    MONITOR.tracing = False
    measured = {
        name: {key: [values[k] for k in kept] for key, values in got.items()} for name, got in out.items()
    }
    for name in OUR_SIDES.intersection(names):  # the hand-offs' price
        measured[name]["warmup_spans"] = out[name]["spans"][1:WARMUP_STEPS]
    return measured


def measured_steps(steps: int) -> list[int]:
    """The step indices whose times count: after the warm-up, and not a turn's first step, which
    follows another side's turn (or the profile's repeats), not a step of its own as in a loop (a
    rank's tail then lands on it, or is spared it: the module docstring). Ours alone
    (``ours_worker``) keeps the same steps, so a row measured that way counts what the others do."""
    return [k for k in range(WARMUP_STEPS, steps) if k % BLOCK]


def _plain(span: Span) -> tuple[str, float, float, dict[str, Any]]:
    return (span.name, span.start, span.duration, dict(span.args))


def _ours_step(config: TrainConfig) -> Step:
    """One training step of our runtime (``Engine.train_step``) on step ``k``'s micro-batches."""
    from shardwise.mesh import build_mesh
    from shardwise.models import build_model
    from shardwise.parallelism import parallelize
    from shardwise.train.loop import seed_everything

    seed_everything(config.seed)
    engine = parallelize(build_model(config.model), build_mesh(config), config)
    sampler, _ = bench_data(config)

    def step(k: int) -> None:
        engine.train_step(sampler.local_micro_batches(k, config.data.micro_batches))

    return step


def _torch_step(config: TrainConfig, world: int, rank: int, torch_class: str) -> Step:
    """One step of torch's ``torch_class`` over the same stage modules, and the same optimizer."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    from shardwise.engine.loss import loss_sum
    from shardwise.engine.optim import build_optimizer
    from shardwise.models import build_model
    from shardwise.train.loop import seed_everything

    seed_everything(config.seed)
    name, virtual = config.parallel.schedule, config.parallel.stages_per_rank
    placement = stage_placement(name, world, virtual)
    modules, split = split_stage_modules(build_model(config.model), placement, rank)
    tie = _TiedByHand(split, placement)
    stages = [
        pipelining.PipelineStage(module, index, len(placement), torch.device("cpu"), group=dist.group.WORLD)
        for index, module in sorted(modules.items())
    ]
    sampler, tokens = bench_data(config)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_sum(output, target) / tokens

    cls = getattr(pipelining, torch_class)
    m = config.data.micro_batches
    schedule = cls(stages[0] if virtual == 1 else stages, n_microbatches=m, loss_fn=loss_fn)
    # a weight tied across two stages of this rank (the V schedules' embedding and head) once
    unique = {id(p): (n, p) for mod in modules.values() for n, p in mod.named_parameters()}
    optimizer = build_optimizer(list(unique.values()), config.optim)
    holds_first, holds_last = 0 in modules, len(placement) - 1 in modules

    def step(k: int) -> None:
        inputs, targets = sampler.local_batch(k)
        schedule.step(*((inputs,) if holds_first else ()), target=targets if holds_last else None)
        tie.gradient()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tie.values()

    return step


class _TiedByHand:
    """What a user of torch's schedules writes for a weight tied across two ranks' stages (GPT's
    embedding and head; torch's pipelining leaves it to them): the last stage's gradient sent to the
    first stage's weight before the update (without waiting for it there), the updated values sent
    back after. Without it the two ends would train apart and the sides would not train one model."""

    def __init__(self, split: Split, placement: list[int] | tuple[int, ...]) -> None:
        self.owner, self.tied = split.tied_owner, split.tied
        self.first, self.last = placement[0], placement[-1]
        self._sent: Any = None

    def gradient(self) -> None:
        import torch.distributed as dist

        if self.owner is not None:
            incoming = torch.empty_like(self.owner)
            dist.recv(incoming, self.last, tag=TIE_TAG)
            self.owner.grad = incoming if self.owner.grad is None else self.owner.grad.add_(incoming)
        elif self.tied is not None:
            grad = self.tied.copy.grad
            grad = grad if grad is not None else torch.zeros_like(self.tied.copy)
            self._sent = dist.isend(grad, self.first, tag=TIE_TAG)
            self.tied.copy.grad = None

    def values(self) -> None:
        import torch.distributed as dist

        if self.owner is not None:
            dist.send(self.owner.detach(), self.last, tag=TIE_TAG)
        elif self.tied is not None:
            self._sent.wait()
            dist.recv(self.tied.copy.data, self.first, tag=TIE_TAG)
