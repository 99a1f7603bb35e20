"""Parameters that get no gradient in a step are left alone by ZeRO's optimizers, exactly as in torch.

torch's optimizers skip a parameter whose ``.grad`` is None: no weight decay, no momentum, and its own
step count (Adam's bias correction) does not advance. ZeRO steps one flat master shard per group, so a
group holding such a parameter cannot simply pass None for part of it. Instead, per group:

- which parameters got a gradient this step, on any rank: each rank flags what its backward reached
  (the post-accumulate-grad hooks), and the flags are all-reduced (max) once per step, after the
  gradients (the used-mask of DDP's ``find_unused_parameters``);
- how many optimizer steps each parameter has taken (torch keeps one ``step`` per parameter);
  checkpoints save each parameter's own count and a load restores them (:mod:`shardwise.zero.state`).

The update then runs in passes (:func:`plan_passes`). Commonly every parameter was used and all
share one step count: one plain ``optimizer.step()``, nothing else. If none was used, the shard's
gradient is None and the optimizer skips the group. Otherwise there is one pass per step count among
the used parameters, the optimizer's ``step`` set to that count: each pass copies the ranges it must
not touch (master values and per-element optimizer state, e.g. the unused parameters'), steps, and
copies them back; state the pass created is reset to zero there, which is a fresh parameter's state.
Exact for SGD (with momentum, no dampening), Adam and AdamW; passes beyond the first only happen while
step counts differ.

Communication: one all-reduce (max) of one float per trainable parameter per step (``share``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.optim import Optimizer

from shardwise.collectives.api import Comm
from shardwise.device import HOST
from shardwise.zero.group import FlatGroup

Range = tuple[int, int]  # [start, end) within this rank's shard


@dataclass(frozen=True)
class Pass:
    """One ``optimizer.step()`` of a group: its step count (None: as the optimizer has it) and the shard
    ranges it must leave as they were."""

    count: int | None
    keep: tuple[Range, ...] = ()


@dataclass
class GroupUsage:
    """One group's flags and step counts (the same on every rank once shared)."""

    ranges: dict[int, Range]  # parameter index -> its piece of this rank's shard (absent: none here)
    used: list[bool]
    counts: list[int]  # each parameter's own step count (checkpoints save and restore it)
    shared: list[bool] = field(default_factory=list)  # used on any rank, this step


def group_usage(group: FlatGroup) -> GroupUsage:
    names = {name: j for j, name in enumerate(group.names)}
    ranges = {names[p.name]: (p.shard_start, p.shard_end) for p in group.layout.overlaps(group.comm.rank)}
    n = len(group.params)
    return GroupUsage(ranges, [False] * n, [0] * n)


def share(usages: list[GroupUsage], comm: Comm, *more: Comm) -> None:
    """All-reduce (max) every group's flags over ``comm`` (and then each of ``more``): a parameter is
    used when any rank used it."""
    used = [float(u) for usage in usages for u in usage.used]
    flags = torch.tensor(used, dtype=torch.float32, device=HOST)  # known on the host: over gloo
    for group in (comm, *more):
        group.all_reduce(flags, op="max")
    values, start = flags.tolist(), 0
    for usage in usages:
        usage.shared = [v > 0 for v in values[start : start + len(usage.used)]]
        usage.used = [False] * len(usage.used)
        start += len(usage.used)


def _step_value(state: dict) -> float | None:
    step = state.get("step")
    if torch.is_tensor(step):
        return float(step)
    return float(step) if isinstance(step, int | float) else None


def plan_passes(usage: GroupUsage, state: dict) -> list[Pass]:
    """The passes of this step's update (empty: nothing used, the optimizer skips the group)."""
    used = usage.shared or [True] * len(usage.counts)
    if not any(used):
        return []
    step = _step_value(state)
    counts = {c for c, u in zip(usage.counts, used, strict=True) if u}
    if all(used) and (len(counts) == 1 or step is None):
        return [Pass(None)]
    keys: list[int | None] = [*sorted(counts)] if step is not None else [None]
    passes = []
    for key in keys:  # ascending: the last pass leaves the largest count as the optimizer's step
        members = {j for j, u in enumerate(used) if u and (key is None or usage.counts[j] == key)}
        keep = tuple(r for j, r in sorted(usage.ranges.items()) if j not in members)
        passes.append(Pass(key, keep))
    return passes


def stepped(usage: GroupUsage) -> None:
    """After a group's update: every used parameter took one more step."""
    used = usage.shared or [True] * len(usage.counts)
    usage.counts = [c + int(u) for c, u in zip(usage.counts, used, strict=True)]


def restore(usage: GroupUsage, counts: list[int]) -> None:
    """A checkpoint was loaded: each parameter's own step count, as saved (0: never stepped)."""
    if len(counts) != len(usage.counts):
        raise ValueError(f"{len(counts)} step counts for a group of {len(usage.counts)} parameters")
    usage.counts = list(counts)


@contextmanager
def isolated(one: Pass, optimizer: Optimizer, master: torch.Tensor) -> Iterator[None]:
    """Around one ``optimizer.step()``: its step count set, the ranges in ``one.keep`` restored after."""
    state = optimizer.state.get(master, {})
    existed = set(_elements(state, master))
    saved = {key: _copy(value, one.keep) for key, value in _elements(state, master).items()}
    saved_master = _copy(master.detach(), one.keep)
    if one.count is not None and "step" in state:
        _set_step(state, one.count)
    yield
    with torch.no_grad():
        _paste(master.detach(), one.keep, saved_master)
        for key, value in _elements(optimizer.state.get(master, {}), master).items():
            if key in existed:
                _paste(value, one.keep, saved[key])
            else:  # made by this pass: the kept parameters have no state yet, i.e. zeros
                for a, b in one.keep:
                    value[a:b].zero_()


def _elements(state: dict, master: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape}


def _copy(tensor: torch.Tensor, ranges: tuple[Range, ...]) -> list[torch.Tensor]:
    return [tensor[a:b].clone() for a, b in ranges]


def _paste(tensor: torch.Tensor, ranges: tuple[Range, ...], values: list[torch.Tensor]) -> None:
    for (a, b), value in zip(ranges, values, strict=True):
        tensor[a:b].copy_(value)


def _set_step(state: dict, count: int) -> None:
    if torch.is_tensor(state["step"]):
        state["step"].fill_(count)
    else:
        state["step"] = type(state["step"])(count)
