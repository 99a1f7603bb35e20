"""An engine's update: the step's norm, its non-finite verdict, the optimizers and the schedulers.

``Engine`` (``engine/base.py``) inherits this. The update runs in one place, ``optimizer_step``:
``prepare_update`` (False skips the step, e.g. an fp16 overflow), then ``run_optimizers`` (each
unit's ``optimizer.step()`` inside that unit's ``unit_update`` context: offload maps the shard in,
ZeRO sets the shard's gradient), then ``after_update``. ``update`` comes first: it takes the norm's
share (``grad_norm_sq``: every element of every trainable parameter counted once over the job) and
agrees over the ranks that step on whether anything was not finite, then steps or skips
(``skip_update``); a pipeline's rank whose own gradients are finite may update while that agreement
is in flight (``updates_early``). A strategy declares what its optimizers update
(``optimizer_units``) and answers for what it holds (``held_norm_sq``, ``nonfinite_grad``,
``held_grads``); the optimizers are built outside (``engine.optim.attach_optimizers``).

Communication: one all-reduce (sum) of the norm's share over ``trainers`` (at the step's boundary
with the loss shares and their finiteness, where there are further axes: ``post_boundary_sums``);
the non-finite agreement's all-reduce where something may not be finite (``agree_nonfinite``);
whatever a strategy's ``unit_update`` does (ZeRO's gathers).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, cast, final

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.collectives.api import Comm
from shardwise.device import HOST
from shardwise.engine.axis import Axis
from shardwise.engine.nonfinite import (
    BoundarySums,
    NonFinite,
    agree_nonfinite,
    first_nonfinite,
    post_boundary_sums,
)
from shardwise.engine.precision import LossScaler

if TYPE_CHECKING:
    from shardwise.engine.base import Engine
    from shardwise.engine.step import StepRunner

NamedTensors = list[tuple[str, torch.Tensor]]  # what one optimizer updates, by name
NORM_LABEL = "grad norm"  # the one all-reduce a step's gradient norm costs (counted by its Comm's stats)


def trainable(model: nn.Module) -> NamedTensors:
    """The model's trainable parameters by name (a tied weight once): a whole-model optimizer unit."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def grad_sq_sum(tensors: Sequence[torch.Tensor], device: torch.device = HOST) -> torch.Tensor:
    """Sum of squared gradient elements of ``tensors`` (missing gradients count zero), as float64."""
    return sq_sum([t.grad for t in tensors if t.grad is not None], device)


def sq_sum(tensors: Sequence[torch.Tensor], device: torch.device = HOST) -> torch.Tensor:
    """Sum of the squares of every element of ``tensors``, as a float64 scalar on their device.

    Each tensor's norm is taken in its own dtype (no float64 copy of a large gradient), as
    ``torch.nn.utils.clip_grad_norm_`` does; only the per-tensor norms are squared in float64.
    ``device``: where the zero of no tensors lives (the engine's, so that every rank's share is
    summed over the same backend).
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():  # not a detach per tensor: on a GPU at world size 1 a step's ops are its time
        norms = torch._foreach_norm(list(tensors))
        return torch.stack(norms).double().pow(2).sum()  # on the tensors' device: read once, by the caller


class EngineUpdate(ABC):
    """The update of an ``Engine`` (see the module docstring)."""

    name: str
    comm: Comm | None
    axes: list[Axis]
    model: nn.Module
    optimizers: list[Optimizer]
    schedulers: list[LRScheduler]
    trainers: Comm | None
    scaler: LossScaler
    runner: StepRunner
    clip_grad_norm: float
    on_nonfinite: str
    last_grad_norm: float
    _boundary: BoundarySums | None
    _measured: tuple[torch.Tensor, Comm | None] | None
    optimizer_runs: Literal["every_rank", "servers"]
    update_communicates: bool

    # -- the update: one place for every strategy -------------------------------------------------
    @abstractmethod
    def optimizer_units(self) -> list[NamedTensors]:
        """What this rank's optimizers update, one list per optimizer (empty: no optimizer here)."""

    def attach_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Take the optimizers built over ``optimizer_units()`` (one each, in order)."""
        units = self.optimizer_units()
        if len(optimizers) != len(units):
            raise ValueError(
                f"the {self.name} engine has {len(units)} optimizer units, got {len(optimizers)}"
            )
        self.optimizers = list(optimizers)

    @final
    def grad_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        """This rank's share of the squared global gradient norm, and the ``Comm`` to sum shares over.

        Call after ``prepare_update`` (fp16 gradients are unscaled there; for fp32 any time between
        ``finish_grads`` and the update). Summed over the ``Comm`` (no ``Comm``: this rank's share is
        already the whole), every element of every trainable parameter counts once. A 0-d float64
        tensor. Without further axes, the strategy's own answer (``held_norm_sq``); with them, each
        axis takes out what another of its ranks counts, replicas count nothing (a data-parallel
        group whose ranks each hold the whole gradient: its first rank counts it), and the shares are
        summed once over every rank that steps (``trainers``), not once per axis.
        """
        share, comm, _ = self._norm_shares()
        return share, comm

    def _norm_shares(self) -> tuple[torch.Tensor, Comm | None, torch.Tensor]:
        """``grad_norm_sq``'s share and ``Comm``, and this rank's own share of what it holds before any
        axis discounts it (finite: every gradient this rank will apply is finite)."""
        held, comm = self.held_norm_sq()
        if not self.axes:
            return held, comm, held
        share = held
        for axis in self.axes:
            share = axis.norm_share(cast("Engine", self), share)
        replica = comm is None and self.comm is not None and self.comm.rank > 0
        if replica or not all(axis.counts_norm for axis in self.axes):
            share = torch.zeros_like(share)  # not 0 x share: a NaN must not spread from a replica
        return share, self.trainers, held

    @abstractmethod
    def held_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        """The strategy's share of the squared norm of the gradients this rank's model holds, and the
        ``Comm`` to sum shares over so that each element counts once over its data-parallel group
        (None: every rank of the group holds the whole; or there is no group)."""

    def update(self, loss_share: float) -> NonFinite | None:
        """After ``finish_grads``: the step's update (``optimizer_step``), unless a loss or gradient is
        not finite on a rank that steps: then every rank skips it (``skip_update``; under "stop" a
        pipeline's ranks whose own gradients were finite may have applied it: ``updates_early``) and
        gets the same verdict (``engine.nonfinite``; ``on_nonfinite`` says whether the run stops). Where the
        optimizer runs on servers, they check the summed gradient and send the verdict back. With
        further axes and unscaled gradients, the verdict is one all-reduce at the step's boundary
        (``_update_at_boundary``)."""
        if self.optimizer_runs == "servers":
            self.optimizer_step()
            return self.servers_nonfinite()
        self._boundary = self._measured = None
        if self.axes and not self.scaler.enabled:
            return self._update_at_boundary(loss_share)
        finite = False
        if not self.scaler.enabled:  # the norm's share first: the update's clipping reuses it
            share, comm, held = self._norm_shares()
            self._measured = (share, comm)
            finite = math.isfinite(float(held))  # then every gradient this rank holds is (one read)
        found = self._agree_nonfinite(loss_share, grads_finite=finite)
        if found is None:
            self.optimizer_step()
        else:
            self.skip_update()
        return found

    def _update_at_boundary(self, loss_share: float) -> NonFinite | None:
        """The update around one all-reduce of the norm's shares, the loss shares and their finiteness
        (``post_boundary_sums``). Where ``updates_early``, a rank whose own gradients and loss share are
        finite updates while that all-reduce is in flight (a pipeline's last stage, done first, no
        longer waits for the first stage's last backward); should another rank's turn out not finite,
        the run stops on every rank as before, with those ranks' update of the stopped step applied.
        Sums not finite send every rank to the exact check; where that finds nothing (only the norm
        overflowed), the update goes on, once per rank."""
        share, comm, held = self._norm_shares()
        read = post_boundary_sums(comm, share, loss_share, NORM_LABEL, held)
        may = self.updates_early()  # the same on every rank
        early = may and math.isfinite(loss_share) and math.isfinite(float(held))
        if early:
            # a pipeline's fit weighs it (``adapt.fit_schedule``)
            with self.runner.early_update(cast("Engine", self)):
                self.optimizer_step(measure=False)
        sums = read()
        if sums.finite:
            self._boundary = sums
            if early:
                self.last_grad_norm = math.sqrt(sums.norm_sq)
            else:
                self.optimizer_step()
            return None
        found = self._agree_nonfinite(loss_share)
        if found is not None:
            if not early:
                self.skip_update()
        elif not may:
            self.optimizer_step()
        else:  # nothing clips: no rank measures the norm again (a collective early ranks would miss)
            if not early:
                self.optimizer_step(measure=False)
            self.last_grad_norm = math.sqrt(sums.norm_sq)  # inf, or NaN
        return found

    def updates_early(self) -> bool:
        """Whether a rank may update before the step's verdict is in (``_update_at_boundary``): a
        pipeline runs the step (its stages finish their backward at different times; elsewhere the
        ranks finish together and there is nothing to win), the run stops on a non-finite value
        (nothing to undo then), nothing clips (no global norm needed first), and the update
        communicates nothing a skipped one does not (ours; an optimizer from the user's factory that
        communicates in ``step()`` must not be given a pipeline under ``on_nonfinite = "stop"``)."""
        clipping = 0 < self.clip_grad_norm < math.inf
        pipelined = any(axis.step_runner is not None for axis in self.axes)
        return pipelined and self.on_nonfinite == "stop" and not clipping and not self.update_communicates

    def _agree_nonfinite(self, loss_share: float, grads_finite: bool = False) -> NonFinite | None:
        """The exact check, on every rank that steps (``agree_nonfinite``): what was not finite, or None.
        ``grads_finite``: this rank's held gradients are known finite (a finite norm share: a NaN or
        inf would make it not finite), so none of them is looked at one by one."""
        scaled = self.scaler_owns_overflow()
        bad = None if scaled or grads_finite else self.nonfinite_grad()
        names = [name for name, _ in trainable(self.model)] if bad else []  # read only to name ``bad``
        loss_ok = scaled or math.isfinite(loss_share)
        return agree_nonfinite(self.trainers, names, bad, loss_ok, self.on_nonfinite)

    def optimizer_step(self, measure: bool = True) -> None:
        """Apply the update and clear gradients for the next step. ``measure=False``: the norm is not
        taken here (nothing clips; an early update: ``update``)."""
        if self.prepare_update():
            if measure and self.optimizer_runs == "every_rank":  # a parameter server clips on its servers
                self.clip_gradients()
            self.run_optimizers()
        self.after_update()

    def clip_gradients(self) -> float:
        """Measure the global gradient norm (one all-reduce of one number over ``grad_norm_sq``'s
        group) and, when ``clip_grad_norm`` is set, scale every gradient by
        min(1, max_norm / (norm + 1e-6)), as ``torch.nn.utils.clip_grad_norm_`` does. Returns the norm."""
        if self._boundary is not None:  # summed at the step's boundary already
            norm = math.sqrt(self._boundary.norm_sq)
        else:
            share, comm = self._measured or self.grad_norm_sq()  # taken by ``update`` this step
            self._measured = None
            if comm is not None:
                comm.all_reduce(share, label=NORM_LABEL)
            norm = float(share.sqrt())
        self.last_grad_norm = norm
        if 0 < self.clip_grad_norm < float("inf"):
            self.scale_grads(min(1.0, self.clip_grad_norm / (norm + 1e-6)))
        return norm

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient this rank's optimizers will use by ``factor``."""
        for unit in self.optimizer_units():
            for _, tensor in unit:
                if tensor.grad is not None:
                    tensor.grad.mul_(factor)

    def skip_update(self) -> None:
        """Leave parameters and optimizer state as they are (a non-finite step) and clear gradients.

        Every rank that steps calls it in the same step, instead of ``optimizer_step``, but those
        that updated early in a stopped step (``updates_early``).
        """
        self.after_update()

    def nonfinite_grad(self) -> str | None:
        """The first trainable parameter (``named_parameters`` order) whose gradient, as this rank
        holds it after ``finish_grads``, has a NaN or inf; None when all are finite. Local only.

        This default checks whole gradients (every replicated engine); sharded engines check their shard.
        """
        return first_nonfinite([(n, p.grad) for n, p in trainable(self.model)])

    def held_grads(self, names: set[str]) -> list[torch.Tensor]:
        """The part of the gradients of the parameters ``names`` this rank holds after ``finish_grads``,
        as views (writable: a sum over another axis is written back into them). Whole gradients here;
        sharded engines give their shard's ranges. Ranks of one dp group holding the same parameters
        list them in the same order and sizes."""
        return [p.grad for n, p in trainable(self.model) if n in names and p.grad is not None]

    def scaler_owns_overflow(self) -> bool:
        """True while a dynamic loss scale handles non-finite values itself (fp16: it skips the step
        and lowers the scale), so they are not the run's to stop or skip. Same on every rank."""
        return self.scaler.owns_overflow

    def servers_nonfinite(self) -> NonFinite | None:
        """Where the optimizer runs on serving ranks (``optimizer_runs == "servers"``): what they found
        not finite in the step just taken (its update was skipped), or None. Ask after ``optimizer_step``."""
        return None

    def run_optimizers(self, lr_scale: float = 1.0) -> None:
        """Step every optimizer of this rank, each inside its unit's context (lr scaled by
        ``lr_scale``), then every learning-rate scheduler once: one place for every strategy."""
        for index, optimizer in enumerate(self.optimizers):
            rates = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * lr_scale
            try:
                with self.unit_update(index):
                    optimizer.step()
            finally:
                for group, lr in zip(optimizer.param_groups, rates, strict=True):
                    group["lr"] = lr
        for scheduler in self.schedulers:
            scheduler.step()

    def prepare_update(self) -> bool:
        """Before the optimizers run; False skips this step's update (an fp16 overflow, say)."""
        return True

    @contextmanager
    def unit_update(self, index: int) -> Iterator[None]:
        """Around optimizer ``index``'s step: make its tensors and their gradients ready, then tidy up."""
        yield

    def after_update(self) -> None:
        """After the optimizers (or a skipped update): gradients cleared, parameters ready for forward."""
        return None
