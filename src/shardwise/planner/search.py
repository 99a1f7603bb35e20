"""Which layout: enumerate them for a target machine, drop those that do not fit, rank the rest.

No communication; pure functions over :mod:`~shardwise.planner.memory` and
:mod:`~shardwise.planner.time`. For ``devices`` devices, every mesh dp x pp x tp that multiplies to
them (``search_degrees``: tp up to 8, one node's worth, dividing the heads; pp up to the blocks), every
strategy, offload (ZeRO only), activation checkpointing, every micro-batch count that divides a rank's
share of the global batch, and with pp > 1 the schedules of ``PIPELINE_SCHEDULES`` (1F1B, and the
interleaved one at two stages per rank where the blocks allow). A layout whose peak bytes per device
exceed the device's memory is dropped with the figures that say why (its total against the memory, and
its three largest parts); the others are ranked by predicted step time (ties: less memory first), and
the winner is explained against the runner-up and the best layout of every other strategy and mesh
shape: ZeRO trades memory for communication (Rajbhandari et al. 2020), checkpointing memory for a
second forward (Chen et al. 2016; Korthikanti et al. 2023), micro-batches memory for exposed
communication, tensor parallelism memory for exposed activation all-reduces (Shoeybi et al. 2019),
pipelines memory for a bubble (Narayanan et al. 2021).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.collectives.cost import CostProfile
from shardwise.config import ConfigError
from shardwise.planner.calibration import Calibration, Machine
from shardwise.planner.layout import GB, Layout, Training, zero_stage
from shardwise.planner.memory import MemoryEstimate, estimate_memory
from shardwise.planner.model import ModelShape
from shardwise.planner.time import StepTime, step_time

SEARCHED = ("ddp", "zero1", "zero2", "zero3")
# (schedule, stages per rank) searched when pp > 1; the zero-bubble ones are left out: their weight
# gradient walks the graph again here (README, "Pipeline speed"), which the simulator's costs omit
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved", 2))
MAX_TP = 8  # tensor parallelism's all-reduces are on every block's critical path: within one node


@dataclass(frozen=True)
class Candidate:
    """One layout with its predicted memory and, when it fits, its predicted step time."""

    layout: Layout
    memory: MemoryEstimate
    time: StepTime | None  # None: dropped, it does not fit
    reason: str  # why it was dropped, or what it costs

    @property
    def fits(self) -> bool:
        return self.time is not None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layout": self.layout.name(),
            "strategy": self.layout.strategy,
            "dp": self.layout.dp,
            "pp": self.layout.pp,
            "tp": self.layout.tp,
            "micro_batches": self.layout.micro_batches,
            "schedule": self.layout.schedule if self.layout.pp > 1 else None,
            "virtual_stages": self.layout.virtual_stages,
            "activation_checkpointing": self.layout.activation_checkpointing,
            "offload": self.layout.offload,
            "fits": self.fits,
            "memory_bytes": self.memory.total,
            "memory_by_component": dict(self.memory.device),
            "memory_peak_phase": self.memory.peak_phase,
            "memory_largest": list(self.memory.largest(1)[0]) if self.memory.total > 0 else ["none", 0.0],
            "host_bytes": self.memory.host_total,
            "reason": self.reason,
        }
        if self.time is not None:
            out.update(
                step_time_s=self.time.total_s,
                compute_s=self.time.compute_s,
                comm_s=self.time.comm_s,
                exposed_comm_s=self.time.exposed_comm_s,
                optimizer_s=self.time.optimizer_s,
                offload_s=self.time.offload_s,
                bubble_s=self.time.bubble_s,
            )
        return out


@dataclass(frozen=True)
class Plan:
    """Fitting layouts fastest first, the dropped ones, and why the first wins."""

    ranked: list[Candidate]
    dropped: list[Candidate]
    why: str

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def mesh_shapes(
    devices: int, pp_degrees: Sequence[int] = (1,), tp_degrees: Sequence[int] = (1,)
) -> Iterator[tuple[int, int, int]]:
    """(dp, pp, tp) with dp x pp x tp = devices, for the pp and tp degrees asked for."""
    for pp in pp_degrees:
        for tp in tp_degrees:
            if pp >= 1 and tp >= 1 and devices % (pp * tp) == 0:
                yield devices // (pp * tp), pp, tp


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_degrees(model: ModelShape, devices: int) -> tuple[list[int], list[int]]:
    """(pp degrees, tp degrees) worth searching on ``devices``: the divisors of the devices, pp no
    more than the model's blocks, tp no more than ``MAX_TP`` and dividing the query and key-value heads."""
    pp = [d for d in divisors(devices) if d <= model.n_layer]
    tp = [d for d in divisors(devices) if d <= MAX_TP and model.n_head % d == 0 and model.kv_heads % d == 0]
    return pp, tp


def enumerate_layouts(
    model: ModelShape,
    training: Training,
    devices: int,
    strategies: Sequence[str] = SEARCHED,
    pp_degrees: Sequence[int] = (1,),
    tp_degrees: Sequence[int] = (1,),
    checkpointing: Sequence[bool] = (False, True),
    offload: Sequence[str] = ("none", "cpu"),
    bucket_mb: float = 25.0,
    schedules: Sequence[tuple[str, int]] = PIPELINE_SCHEDULES,
) -> list[Layout]:
    """Every layout to consider; meshes the model cannot take (tp not dividing the heads, more
    pipeline stages than blocks, a batch that does not divide) are left out, and so are schedules
    the micro-batch count does not suit (``Layout`` refuses them)."""
    layouts = []
    for dp, pp, tp in mesh_shapes(devices, pp_degrees, tp_degrees):
        if model.n_head % tp or model.kv_heads % tp or pp > model.n_layer or training.global_batch % dp:
            continue
        staged = [(name, v) for name, v in schedules if pp * v <= model.n_layer] if pp > 1 else [("1f1b", 1)]
        for strategy in strategies:
            for where in offload if strategy.startswith("zero") else ("none",):
                for ckpt in checkpointing:
                    for m in divisors(training.global_batch // dp):
                        for schedule, v in staged:
                            if pp > 1 and not _schedule_takes(schedule, pp, v, m):
                                continue
                            layouts.append(
                                Layout(strategy, dp, pp, tp, False, m, ckpt, where, bucket_mb,
                                       schedule=schedule, virtual_stages=v)
                            )  # fmt: skip
    return layouts


def _schedule_takes(schedule: str, pp: int, virtual: int, micro_batches: int) -> bool:
    from shardwise.pipeline.schedules import ScheduleConfigError, check

    try:
        check(schedule, pp, virtual, micro_batches)
    except ScheduleConfigError:
        return False
    return True


def _gb(nbytes: float, digits: int | None = None) -> str:
    """Gigabytes (1e9 bytes), with two decimals below 10 GB so that near misses stay visible."""
    digits = digits if digits is not None else (2 if nbytes < 10 * GB else 1)
    return f"{nbytes / GB:.{digits}f} GB"


def _drop_reason(memory: MemoryEstimate, limit: float) -> str:
    parts = ", ".join(f"{name} {_gb(value)}" for name, value in memory.largest(3))
    near = 3 if memory.total < 1.01 * limit else None  # within 1%: enough digits to see it is over
    return f"needs {_gb(memory.total, near)} per device > {_gb(limit, near)} ({parts})"


def _cost(time: StepTime, memory: MemoryEstimate, limit: float) -> str:
    return (
        f"{time.total_s * 1e3:.1f} ms/step (compute {time.compute_s * 1e3:.1f}, exposed communication "
        f"{time.exposed_comm_s * 1e3:.1f} of {time.comm_s * 1e3:.1f}, optimizer {time.optimizer_s * 1e3:.1f}"
        + (f", offload {time.offload_s * 1e3:.1f}" if time.offload_s else "")
        + (f", bubble {time.bubble_s * 1e3:.1f}" if time.bubble_s else "")
        + f"); {_gb(memory.total)} of {_gb(limit)}"
    )


def plan(
    model: ModelShape,
    training: Training,
    machine: Machine,
    calibration: Calibration | None = None,
    profile: CostProfile | None = None,
    layouts: Sequence[Layout] | None = None,
    algorithm: str = "ring",
) -> Plan:
    """Rank the layouts that fit ``machine`` by predicted step time; explain the winner and the drops."""
    calibration = calibration or Calibration()
    profile = profile or machine.profile()
    if layouts is None:
        layouts = enumerate_layouts(model, training, machine.devices)
    if not layouts:
        raise ConfigError(
            f"no layout of {machine.devices} devices divides global_batch({training.global_batch}); "
            "pick a batch that the number of devices divides"
        )
    ranked, dropped = [], []
    for layout in layouts:
        memory = estimate_memory(model, training, layout, calibration)
        if memory.total > machine.device_memory:
            dropped.append(Candidate(layout, memory, None, _drop_reason(memory, machine.device_memory)))
            continue
        time = step_time(model, training, layout, profile, calibration, algorithm)
        ranked.append(Candidate(layout, memory, time, _cost(time, memory, machine.device_memory)))
    ranked.sort(key=_rank_key)
    return Plan(ranked, dropped, explain(ranked, dropped, machine))


def _rank_key(candidate: Candidate) -> tuple[float, float, int]:
    """Faster first; a tie: less memory first, then the simpler strategy (``SEARCHED``'s order: on a
    dp group of one, DDP and ZeRO-1/2 do the same work, and DDP keeps the least machinery)."""
    simpler = SEARCHED.index(candidate.layout.strategy) if candidate.layout.strategy in SEARCHED else 0
    return candidate.time.total_s if candidate.time else 0.0, candidate.memory.total, simpler


def explain(ranked: Sequence[Candidate], dropped: Sequence[Candidate], machine: Machine) -> str:
    """In words: why the first layout wins, and what was dropped."""
    if not ranked:
        smallest = min(dropped, key=lambda c: c.memory.total)
        return (
            f"nothing fits in {_gb(machine.device_memory)} per device: the smallest layout, "
            f"{smallest.layout.name()}, {smallest.reason}"
        )
    best = ranked[0]
    assert best.time is not None
    lines = [f"{best.layout.name()} wins: {best.reason}."]
    if best.time.comm_s:
        lines.append(f"Compute hides {best.time.hidden_fraction:.0%} of its communication.")
    if len(ranked) > 1 and ranked[1].time is not None:
        lines.append(f"The runner-up, {ranked[1].layout.name()}, {_behind(best, ranked[1])}.")
    groups: list[tuple[str, Callable[[Layout], str]]] = [
        ("", lambda layout: layout.strategy),
        (" mesh", _mesh),
    ]
    for noun, key in groups:
        for value in dict.fromkeys(key(c.layout) for c in (*ranked, *dropped)):
            if value == key(best.layout):
                continue
            fit = [c for c in ranked if key(c.layout) == value]
            if fit and fit[0].time is not None:
                lines.append(
                    f"The best {value}{noun} layout, {fit[0].layout.name()}, {_behind(best, fit[0])}."
                )
            else:
                least = min((c for c in dropped if key(c.layout) == value), key=lambda c: c.memory.total)
                lines.append(f"No {value}{noun} layout fits: even {least.layout.name()} {least.reason}.")
    return " ".join(lines)


def _mesh(layout: Layout) -> str:
    return f"dp{layout.dp}-pp{layout.pp}-tp{layout.tp}"


def _behind(best: Candidate, other: Candidate) -> str:
    """How far ``other`` is behind ``best``, and what makes the difference."""
    assert best.time is not None and other.time is not None
    gap = other.time.total_s / best.time.total_s - 1
    if gap < 5e-4:  # a tie on time: the ranking took the layout that needs less memory, or the simpler
        same = best.layout.dp == other.layout.dp == 1 and best.layout.strategy != other.layout.strategy
        note = (
            f" ({other.layout.strategy} shards nothing over a dp group of one: it does "
            f"{best.layout.strategy}'s work, and the simpler strategy ranks first)"
            if same and zero_stage(other.layout.strategy) in (1, 2)
            else ""
        )
        if other.memory.total == best.memory.total:
            return f"is as fast and needs as much, {_gb(best.memory.total)}" + note
        return f"is as fast and needs {_gb(other.memory.total)} against {_gb(best.memory.total)}" + note
    shown = f"{gap:.1%}" if gap >= 0.01 else f"{gap:.2%}"
    return f"is {shown} slower ({_differs(best, other)})"


def _differs(best: Candidate, other: Candidate) -> str:
    """What makes ``other`` slower than ``best``: the part of the step that grew most."""
    assert best.time is not None and other.time is not None
    parts = {
        "compute": other.time.compute_s - best.time.compute_s,
        "exposed communication": other.time.exposed_comm_s - best.time.exposed_comm_s,
        "optimizer step": other.time.optimizer_s - best.time.optimizer_s,
        "host offload": other.time.offload_s - best.time.offload_s,
        "pipeline bubble": other.time.bubble_s - best.time.bubble_s,
    }
    name, extra = max(parts.items(), key=lambda kv: kv[1])
    if extra <= 0:
        return "the same parts, in sum longer"
    return f"{name} +{extra * 1e3:.1f} ms"
