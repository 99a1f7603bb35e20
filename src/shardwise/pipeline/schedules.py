"""Pipeline schedules as pure functions: ``(pp, virtual, microbatches) -> {rank: [Action]}``.

``pp`` ranks hold ``pp * virtual`` stages; ``microbatches`` (>= 1, any number, fewer than the stages
included) go through every stage forward then backward. Bubble fractions below are idle time over
total time with equal costs per stage and no transfer time (``simulate.py`` computes them; the unit
tests hold it to these formulas):

- ``gpipe``: every forward, then every backward (Huang et al. 2019, GPipe, arXiv:1811.06965).
  Bubble ``(p-1)/(m+p-1)``; a rank holds all ``m`` micro-batches' activations.
- ``1f1b``: ``p-1-r`` warm-up forwards on rank ``r``, then one forward one backward, then the
  remaining backwards (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503; Megatron's default).
  Same bubble as GPipe, at most ``min(m, p-r)`` micro-batches in flight on rank ``r``.
- ``interleaved``: ``v >= 2`` chunks per rank placed round-robin (stage ``s`` on rank ``s mod p``),
  micro-batches taken in rounds of ``p`` (torch's flexible rounds: ``max(1, m // p)`` rounds), depth
  first (Narayanan et al. 2021, Megatron-LM, arXiv:2104.04473). Bubble ``(p-1)/(v*m+p-1)`` when ``p``
  divides ``m`` (costs per chunk, a chunk being 1/v of a rank's layers): the ramp is ``p-1`` chunk-steps
  of ``1/v`` the cost. Where the rounds do not divide ``m`` (torch refuses) the last round is short.
- ``zb``: ZB-H1 (Qi et al. 2023, Zero Bubble Pipeline Parallelism, arXiv:2401.10241): 1F1B with B
  split into I and W; rank ``r`` defers ``r`` weight gradients to fill its cool-down, at 1F1B's peak
  memory. Bubble ``(p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W))`` for ``m >= p``: a third of 1F1B's when
  F = I = W.
- ``interleaved-zb``: the interleaved placement with the zero-bubble split and a warm-up of
  ``(v-1)*round + p-1-r`` (the ZB1P schedule of the same paper, as torch's
  ``ScheduleInterleavedZeroBubble``).
- ``zbv``: ZB-V (same paper, section 6): two stages per rank in a V, rank ``r`` holds stages ``r`` and
  ``2p-1-r``; at 1F1B's peak activation memory (2p half-size chunks), below ZB-H1's bubble once
  ``m > p`` (the simulator's result, held by the unit tests; what is left is the ramp at the start).
- ``dualpipev``: DualPipeV (DeepSeek-V3 report, arXiv:2412.19437, the V-shaped "cut in half"
  DualPipe): the same V placement; forward of one chunk paired with backward of the other in the
  steady state (listed F then B here; a runtime may overlap the pair).

Fewer micro-batches than a schedule's pattern needs (torch refuses 1F1B with ``m < p`` and DualPipeV
with ``m < 2p``): the pattern is built for enough micro-batches and the extra ones are dropped.
Dependencies only join actions of the same micro-batch, so dropping whole micro-batches from a
schedule that runs cannot make it deadlock; ``validate.py`` checks every result anyway. Pure: no
processes, no torch. ``python -m shardwise.pipeline.schedules 1f1b 4 1 8`` prints one.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shardwise.pipeline.actions import Action, Kind, Schedule, format_schedule

# the paper's letters (Qi et al. 2023): I is the input gradient
F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD  # noqa: E741


class ScheduleConfigError(ValueError):
    """A (schedule, pp, virtual, micro-batches) that cannot run; the message shows the arithmetic."""


# ------------------------------------------------------------------------------------------ placement


def placement(style: str, pp: int, virtual: int) -> tuple[int, ...]:
    """``placement[stage]`` = the rank holding it. "loop": round-robin; "v": down then back up."""
    stages = pp * virtual
    if style == "loop":
        return tuple(stage % pp for stage in range(stages))
    if style == "v":
        # chunk c runs down the ranks when c is even and back up when odd: rank r holds r and 2p-1-r
        return tuple(
            (stage % pp) if (stage // pp) % 2 == 0 else pp - 1 - stage % pp for stage in range(stages)
        )
    raise ValueError(f"unknown placement style {style!r}: use 'loop' or 'v'")


# ------------------------------------------------------------------------------- the 1F1B family


def _one_f_one_b(
    rank: int, pp: int, virtual: int, microbatches: int, *, warmup_factor: int, zero_bubble: bool
) -> list[Action]:
    """1F1B, interleaved 1F1B and their zero-bubble forms on round-robin placement.

    Forwards run depth first in rounds of ``per_round`` micro-batches: chunk 0 for the round, chunk 1
    for the round, ...; backwards the same with the chunks reversed. Rank ``r`` first runs
    ``(v-1)*per_round + warmup_factor*(p-1-r)`` forwards, then alternates a forward and a backward,
    then runs the backwards left. With ``zero_bubble`` each backward is I, and the weight gradient of
    the oldest I follows once ``r`` of them are pending (ZB-H1: the deferred W's fill the cool-down).
    """
    # torch's flexible rounds: max(1, m // p) of them; where they do not divide m (torch refuses), each
    # holds ceil(m / rounds) and the micro-batches past m are dropped, leaving the last round short
    rounds = max(1, microbatches // pp)
    per_round = microbatches if virtual == 1 else -(-microbatches // rounds)
    built = rounds * per_round if virtual > 1 else microbatches
    total = built * virtual
    warmup = min((virtual - 1) * per_round + warmup_factor * (pp - 1 - rank), total)

    def at(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // per_round) % virtual
        if backward:
            chunk = virtual - 1 - chunk
        microbatch = (k // (per_round * virtual)) * per_round + k % per_round
        return chunk * pp + rank, microbatch

    ops: list[Action] = []
    pending: deque[tuple[int, int]] = deque()

    def forward(k: int) -> None:
        stage, mb = at(k, False)
        ops.append(Action(stage, F, mb))

    def backward(k: int) -> None:
        stage, mb = at(k, True)
        if not zero_bubble:
            ops.append(Action(stage, B, mb))
            return
        ops.append(Action(stage, I, mb))
        pending.append((stage, mb))
        if k >= rank:
            w_stage, w_mb = pending.popleft()
            ops.append(Action(w_stage, W, w_mb))

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    while pending:
        stage, mb = pending.popleft()
        ops.append(Action(stage, W, mb))
    return [op for op in ops if op.microbatch < microbatches]


def _gpipe_rank(rank: int, pp: int, virtual: int, microbatches: int) -> list[Action]:
    forwards = [Action(rank, F, mb) for mb in range(microbatches)]
    return forwards + [Action(rank, B, mb) for mb in range(microbatches)]


def _1f1b_rank(rank: int, pp: int, virtual: int, microbatches: int) -> list[Action]:
    return _one_f_one_b(rank, pp, 1, microbatches, warmup_factor=1, zero_bubble=False)


def _interleaved_rank(rank: int, pp: int, virtual: int, microbatches: int) -> list[Action]:
    return _one_f_one_b(rank, pp, virtual, microbatches, warmup_factor=2, zero_bubble=False)


def _zb_rank(rank: int, pp: int, virtual: int, microbatches: int) -> list[Action]:
    return _one_f_one_b(rank, pp, virtual, microbatches, warmup_factor=1, zero_bubble=True)


# ------------------------------------------------------------------------------------ V schedules


class _Counter:
    """Next micro-batch per (stage, kind), and the weight gradients waiting for their turn."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, Kind], int] = {}
        self.ops: list[Action] = []
        self.weights: deque[Action] = deque()

    def add(self, stage: int, kind: Kind) -> None:
        # B, I and W share one backward counter per stage: each micro-batch gets one B or one I+W
        key = (stage, F if kind is F else B)
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        self.ops.append(Action(stage, kind, mb))
        if kind is I:
            self.weights.append(Action(stage, W, mb))

    def weight(self) -> None:
        if self.weights:
            self.ops.append(self.weights.popleft())

    def count(self, stage: int, kind: Kind) -> int:
        return self.next.get((stage, kind), 0)


def _zbv_rank(rank: int, pp: int, virtual: int, microbatches: int) -> list[Action]:
    """ZB-V: warm up down the V, then F/I/W on both chunks in turn, cool down with the W's deferred."""
    n = max(microbatches, 2 * pp - 1)  # the pattern fills the pipeline at 2p-1; extras dropped
    down, up = rank, 2 * pp - 1 - rank
    c = _Counter()
    for _ in range(2 * (pp - rank) - 1):
        c.add(down, F)
    for _ in range(rank):
        c.add(up, F)
        c.add(down, F)
    for _ in range(pp - rank):
        c.add(up, F)
        c.add(up, I)
        c.weight()
    while c.count(up, F) < c.count(down, F) or c.count(down, F) < n:
        if c.count(down, F) < n:
            c.add(down, F)
        c.add(down, I)
        c.weight()
        c.add(up, F)
        c.add(up, I)
        c.weight()
    # cool-down: input gradients first (they feed the other ranks), weight gradients after
    for _ in range(rank):
        c.add(down, I)
        c.add(up, I)
    for _ in range(pp - rank):
        c.add(down, I)
        _weight_of_stage(c, down)
    c.ops.extend(w for w in c.weights if w.stage == up)
    c.ops.extend(w for w in c.weights if w.stage == down)
    return [op for op in c.ops if op.microbatch < microbatches]


def _weight_of_stage(c: _Counter, stage: int) -> None:
    """The oldest pending W of ``stage`` (the other chunk's wait for the end of the cool-down)."""
    for index, action in enumerate(c.weights):
        if action.stage == stage:
            del c.weights[index]
            c.ops.append(action)
            return


def _dualpipev_rank(rank: int, pp: int, virtual: int, microbatches: int) -> list[Action]:
    """DualPipeV's eight phases (DeepSeek's reference order); an overlapped pair is listed F then B."""
    n = max(microbatches, 2 * pp)  # the pattern needs 2p micro-batches; extras dropped
    down, up = rank, 2 * pp - 1 - rank
    c = _Counter()
    for _ in range((pp - rank - 1) * 2):  # 1: forwards down the V
        c.add(down, F)
    for _ in range(rank + 1):  # 2: both chunks' forwards
        c.add(down, F)
        c.add(up, F)
    for _ in range(pp - rank - 1):  # 3: zero-bubble backward of the up chunk, then its forward
        c.add(up, I)
        c.weight()
        c.add(up, F)
    for _ in range(n - 2 * pp + rank + 1):  # 4: the steady state, forward of one chunk with the other's B
        c.add(down, F)
        c.add(up, B)
        c.add(up, F)
        c.add(down, B)
    for _ in range(pp - rank - 1):  # 5: backward up, forward up with backward down
        c.add(up, B)
        c.add(up, F)
        c.add(down, B)
    split = False
    for i in range(rank + 1):  # 6: backwards of both chunks; the second half split into I and W
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        c.add(up, I if split else B)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        c.add(down, I if split else B)
    for _ in range(pp - rank - 1):  # 7: a deferred W, then the next backward down
        c.weight()
        c.add(down, I if split else B)
    while c.weights:  # 8: the W's left
        c.weight()
    return [op for op in c.ops if op.microbatch < microbatches]


# --------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its per-rank builder, stage placement and the virtual stages it accepts."""

    name: str
    build_rank: Callable[[int, int, int, int], list[Action]]  # (rank, pp, virtual, microbatches)
    style: str  # placement style: "loop" or "v"
    virtual: str  # "1", ">=2" or "2": what --virtual-stages must be
    torch_class: str | None  # the torch.distributed.pipelining class it is measured against
    splits_backward: bool  # whether it uses I and W (zero bubble) instead of B


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", _gpipe_rank, "loop", "1", "ScheduleGPipe", False),
        ScheduleSpec("1f1b", _1f1b_rank, "loop", "1", "Schedule1F1B", False),
        ScheduleSpec("interleaved", _interleaved_rank, "loop", ">=2", "ScheduleInterleaved1F1B", False),
        ScheduleSpec("zb", _zb_rank, "loop", "1", None, True),
        ScheduleSpec("interleaved-zb", _zb_rank, "loop", ">=2", "ScheduleInterleavedZeroBubble", True),
        ScheduleSpec("zbv", _zbv_rank, "v", "2", "ScheduleZBVZeroBubble", True),
        ScheduleSpec("dualpipev", _dualpipev_rank, "v", "2", "ScheduleDualPipeV", True),
    )
}


def check(name: str, pp: int, virtual: int, microbatches: int) -> ScheduleSpec:
    """The spec of ``name`` if it can run with these sizes; else one line with the arithmetic."""
    if name not in SCHEDULES:
        raise ScheduleConfigError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    spec = SCHEDULES[name]
    if pp < 1 or microbatches < 1:
        raise ScheduleConfigError(
            f"{name} needs pp >= 1 and micro-batches >= 1, got pp {pp} and {microbatches} micro-batches"
        )
    wanted = {"1": virtual == 1, ">=2": virtual >= 2, "2": virtual == 2}[spec.virtual]
    if not wanted:
        why = {
            "1": "holds one stage per rank: --virtual-stages must be 1",
            ">=2": "interleaves chunks: --virtual-stages must be >= 2 (use 1f1b or zb for 1)",
            "2": f"holds two stages per rank in a V (rank r: stages r and 2*{pp}-1-r): "
            "--virtual-stages must be 2",
        }[spec.virtual]
        raise ScheduleConfigError(f"{name} {why}, got {virtual} ({pp} x {virtual} = {pp * virtual} stages)")
    return spec


def build(name: str, pp: int, virtual: int, microbatches: int) -> Schedule:
    """``{rank: [Action]}`` of schedule ``name`` for ``pp`` ranks x ``virtual`` stages each."""
    spec = check(name, pp, virtual, microbatches)
    return {rank: spec.build_rank(rank, pp, virtual, microbatches) for rank in range(pp)}


def stage_placement(name: str, pp: int, virtual: int) -> tuple[int, ...]:
    """Which rank holds each stage under schedule ``name``."""
    return placement(SCHEDULES[name].style, pp, virtual)


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.pipeline.schedules NAME PP VIRTUAL MICROBATCHES``: print, check, simulate."""
    from shardwise.pipeline.messages import check_same_order, plan
    from shardwise.pipeline.simulate import Costs, format_timeline, simulate
    from shardwise.pipeline.validate import ScheduleError, validate

    args = sys.argv[1:] if argv is None else argv
    usage = f"usage: python -m shardwise.pipeline.schedules {{{','.join(SCHEDULES)}}} PP VIRTUAL MICROBATCHES"
    if len(args) != 4:
        print(f"{usage} (got {len(args)} arguments, not 4)", file=sys.stderr)
        return 2
    try:
        names = ("PP", "VIRTUAL", "MICROBATCHES")
        pp, virtual, microbatches = (_count(n, a) for n, a in zip(names, args[1:], strict=True))
        schedule = build(args[0], pp, virtual, microbatches)
        where = stage_placement(args[0], pp, virtual)
        report = validate(schedule, where, microbatches)
    except (ScheduleConfigError, ScheduleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_schedule(schedule))
    sent = check_same_order(plan(schedule, where))
    # a pair is one stage's activations for one micro-batch: with v stages a rank, 1/v of its layers
    print(
        f"most (stage, micro-batch) activations held per rank, F to B/I: {report.peak_in_flight}; "
        f"F to W: {report.peak_held}" + (f" (each 1/{virtual} of the rank's layers)" if virtual > 1 else "")
    )
    print(f"{sent} messages a step, posted in one order at both ends of every pair")
    costs = Costs.uniform(forward=1.0, backward=2.0)
    print(format_timeline(simulate(schedule, where, costs)))
    return 0


def _count(name: str, text: str) -> int:
    """``text`` as an integer >= 1 for the argument ``name``, or a one-line ``ScheduleConfigError``."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ScheduleConfigError(f"{name} must be an integer >= 1, got {text!r}")
    return int(text)


if __name__ == "__main__":
    raise SystemExit(main())
