"""The data-parallel layer's interface: one step's forward, backward, gradient exchange and update.

Every strategy (all-reduce DP, ZeRO, the parameter server, ...) is an ``Engine``. The train loop,
``shardwise verify``, checkpoints and the benchmarks drive engines only through this interface, so a
new strategy plugs into all of them at once, and they never ask which strategy they hold.

What an engine owns, and what it does not:

- It owns gradient reduction and, where it shards, which slice of the parameters a rank holds. It
  declares what this rank's optimizer updates (``optimizer_units``: one list of named tensors per
  unit; ZeRO has one unit per flat group, a parameter server's worker none). The optimizers are built
  outside it, by one factory (``engine.optim.attach_optimizers``), and handed to it.
- The update runs in one place, ``optimizer_step`` (with the norm and the non-finite verdict:
  ``engine/update.py``, which ``Engine`` inherits): ``prepare_update`` (False skips the step, e.g. an
  fp16 overflow), then ``run_optimizers`` (each unit's ``optimizer.step()`` inside that unit's
  ``unit_update`` context: offload maps the shard in, ZeRO sets the shard's gradient), then
  ``after_update``. A parameter server's servers call ``run_optimizers`` from their serving loop.
- ``grad_norm_sq`` gives this rank's share of the squared global gradient norm (every element of
  every trainable parameter counted exactly once over the job) and the ``Comm`` to sum the shares
  over, so clipping and monitoring need no strategy-specific code.
- ``role`` says whether this rank steps, reports (writes metrics, returns the summary) or serves.
- Further axes (tp, pp, hybrid replicas; ``engine/axis.py``): an engine answers for what its rank
  holds over its data-parallel group (the strategy's ``exchange_grads``, ``held_norm_sq``,
  ``held_parameters``, ``held_pieces``, ``load_held``, ``loss_share``), and each axis in
  ``engine.axes`` widens that answer. The public answers (``finish_grads``, ``grad_norm_sq``,
  ``full_parameters``, ``state_pieces``, ``load_state``, ``step_loss``) are final: the strategy's,
  then one loop over the axes (the views and the checkpoint state: ``engine/state.py``, which
  ``Engine`` inherits). No method is replaced at run time.
- Non-finite values: ``nonfinite_grad`` names the first parameter whose gradient, as this rank holds
  it after ``finish_grads``, has a NaN or inf (whole tensors here; ZeRO checks its shards). ``update``
  agrees on it over the ranks that step and then runs ``optimizer_step`` or ``skip_update`` (under a
  pipeline with ``on_nonfinite = "stop"``, no clipping and no ZeRO, a rank whose own gradients are
  finite updates while the agreement is in flight: ``updates_early``). Where the
  optimizer runs on servers, they check the summed gradient themselves and the ranks that step read
  their verdict (``servers_nonfinite``). Under a dynamic loss scale, overflow is the scaler's
  business (``scaler_owns_overflow``).

Loss convention (exact averaging over uneven shares): each rank's loss is the *sum* of its token
losses divided by the number of tokens in the *global* batch, and gradients are *summed* over ranks.
The sum over ranks then equals the mean loss of one process on the whole global batch, whatever
share of it each rank drew.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, final

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.collectives.api import Comm
from shardwise.device import HOST, to_device
from shardwise.engine.axis import Axis
from shardwise.engine.loss import Loss, TokenLoss, check_summed, run_model
from shardwise.engine.nonfinite import BoundarySums, NonFiniteStop
from shardwise.engine.precision import LossScaler, resolve_precision
from shardwise.engine.state import EngineState
from shardwise.engine.step import MicroBatchLoop, StepRunner, take_step
from shardwise.engine.update import EngineUpdate

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (batch, seq) long, targets (batch, seq) long


@dataclass(frozen=True)
class Role:
    """What a rank does in the job; the loop, verify, metrics and checkpoints ask this, not the strategy.

    ``reporter`` (the global rank that reports) is the same on every rank, so any rank can address it.
    """

    steps: bool  # runs forward and backward on its share of each batch
    serves: bool  # runs the optimizer for ranks that step (a parameter server)
    reports: bool  # writes metrics.jsonl and returns the run's summary
    reporter: int

    @staticmethod
    def trainer(rank: int, reporter: int = 0) -> Role:
        return Role(steps=True, serves=False, reports=rank == reporter, reporter=reporter)


class Engine(EngineState, EngineUpdate, ABC):
    """A model with a data-parallel strategy applied; see the module docstring for the contract."""

    name: str = "engine"
    comm: Comm | None = None  # what the strategy communicates over: its bytes and waits are the step's
    # where the optimizer runs: on every rank over what it holds, or on the parameter servers
    optimizer_runs: Literal["every_rank", "servers"] = "every_rank"
    # whether optimizer_units hands out the model's own parameters (False: ZeRO's flat shards)
    units_are_parameters: bool = True
    # whether an update issues collectives a skipped one does not (ZeRO's gathers as groups step): then
    # no rank updates before the step's verdict is in (``updates_early``)
    update_communicates: bool = False

    def __init__(self, model: nn.Module, role: Role | None = None) -> None:
        self.model = model
        self.role = role or Role.trainer(0)
        self.optimizers: list[Optimizer] = []
        self.schedulers: list[LRScheduler] = []  # one per optimizer when the user gives a factory
        self.loss: Loss = TokenLoss()  # the user's loss: a SUM over items and a count (engine.loss)
        self.batch_comm: Comm | None = None  # the batch group (dp x cp): where items are counted
        # every rank that steps: the norm's and the loss's shares are summed over it (None: this rank alone)
        self.trainers: Comm | None = None
        self._boundary: BoundarySums | None = None  # this step's one all-reduce at its boundary, if made
        self._measured: tuple[torch.Tensor, Comm | None] | None = None  # this step's norm share, if taken
        # the further axes the model is cut over, innermost first (engine/axis.py)
        self.axes: list[Axis] = []
        self.clip_grad_norm = 0.0  # 0 or inf: measure the global norm, never clip
        self.on_nonfinite = "stop"  # a NaN/inf loss or gradient: stop, or skip the step's update
        self.steps_taken = 0  # by train_step
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        self.precision = resolve_precision("fp32", dtype)
        self.autocast_dtype: torch.dtype | None = None  # bf16/fp16 compute over fp32 parameters
        self.scaler = LossScaler(False)
        self.last_grad_norm = float("nan")  # the global norm before clipping, of the last update
        self.runner: StepRunner = MicroBatchLoop()  # who runs a step's micro-batches (engine.step)
        self.local_count = 0.0  # the items of this rank's micro-batches this step (forward_backward)

    def join(self, axes: Sequence[Axis]) -> None:
        """Take the model's further axes (tp, cp, ep, pp: ``parallelize``'s order; those that cut the
        model on this rank) outside those the strategy has of its own (hybrid replicas); an axis that
        runs the step's micro-batches (the pipeline) becomes the step runner."""
        joined = [axis for axis in axes if axis.active]  # an axis of one rank adds nothing
        self.axes = [*self.axes, *joined]
        for axis in joined:
            if axis.step_runner is not None:
                self.runner = axis.step_runner

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[Any]) -> float:
        """One whole step on this rank's micro-batches, the Trainer's own spine (``engine.step``): the
        global item count, forward, backward, gradient exchange, the update (skipped on every rank
        where any found a loss or gradient not finite). Returns the global mean loss (every rank; the
        loss shares, read on the host, summed over the ranks that step). Under ``on_nonfinite =
        "stop"`` (the default) a non-finite value raises ``NonFiniteStop`` on every rank."""
        result = take_step(self, micro_batches)
        loss = torch.tensor([result.loss_share], dtype=torch.float64, device=HOST)
        if self._boundary is not None:  # the shares were summed at the step's boundary
            loss.fill_(self._boundary.loss)
        elif self.trainers is not None:  # the ranks that do not report the loss add 0
            self.trainers.all_reduce(loss)
        step, self.steps_taken = self.steps_taken, self.steps_taken + 1
        if result.found is not None and result.found.stop:
            raise NonFiniteStop(step, result.found)
        return float(loss)

    def global_count(self, micro_batches: Sequence[Any]) -> float:
        """Items the loss counts in this step's micro-batches over every rank that shares the batch
        (one all-reduce of one number, before any backward, so every rank divides by the same).
        Counted on the host, before the batches move to the device: host bookkeeping, over gloo."""
        count = torch.tensor(
            [float(sum(self.loss.count(batch) for batch in micro_batches))], dtype=torch.float64, device=HOST
        )
        if self.batch_comm is not None:
            self.batch_comm.all_reduce(count)
        return float(count)

    def forward_backward(self, micro_batches: Sequence[Any], global_count: float) -> float:
        """Run forward and backward on this rank's micro-batches; on return, gradients are global.

        The loop itself is the step runner's (``self.runner``: the plain micro-batch loop, or a
        pipeline's runtime), which calls this engine's hooks: ``begin_step``, per micro-batch
        ``no_sync`` / ``compute_loss`` / ``backward``, then ``finish_grads`` and ``step_loss``.
        ``global_count``: the items counted by the loss over every micro-batch of every rank this
        step. Returns this rank's share of the global mean loss (the shares sum to the global mean).

        The micro-batches are counted here on the host (``local_count``, for engines that divide by
        their own items) and then moved to the engine's device (pinned, without blocking the host).
        """
        self.local_count = float(sum(self.loss.count(batch) for batch in micro_batches))
        device = self.device
        moved = [to_device(batch, device) for batch in micro_batches]
        return self.runner.forward_backward(self, moved, global_count)

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its parameters' device (the CPU for a rank that holds none; the
        meta device for a rank whose parameters all are: ``plan --dry-run``)."""
        first = None
        for p in self.model.parameters():  # the first one that is not meta: no walk past it
            if not p.is_meta:
                return p.device
            first = first if first is not None else p
        return first.device if first is not None else HOST

    def begin_step(self, micro_batches: Sequence[Any], global_count: float) -> float:
        """Before the step's first forward: the engine's preparation (gradient buffers attached,
        buffers broadcast, replicas made). Returns what each micro-batch's summed loss is divided by:
        the global count by default, so that gradients summed over ranks are the global mean's."""
        return global_count

    @final
    def step_loss(self, share: torch.Tensor) -> float:
        """After ``finish_grads``: this rank's share of the global mean loss, given the sum of its
        micro-batches' divided losses (``share``, 0-d, read here only where this rank reports: every
        axis says whether it does, ``Axis.reports_loss``); 0 where another rank reports it."""
        return self.loss_share(float(share)) if self.reports_loss else 0.0

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's loss share counts (the first tp rank's, the last pipeline stage's)."""
        return all(axis.reports_loss for axis in self.axes)

    def loss_share(self, share: float) -> float:
        """The strategy's share of the global mean loss, given the sum of this rank's divided losses:
        the share itself by default."""
        return share

    def compute_loss(self, batch: Any, forward: Callable[[], Any] | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch: ``forward()`` (default: the model on the batch; a
        pipeline's last stage on its input) under ``autocast()``, then ``self.loss`` on its outputs
        (which sums in fp32), checked to be a sum and not a mean."""
        with self.autocast():
            outputs = forward() if forward is not None else run_model(self.model, batch)
        return check_summed(self.loss(outputs, batch))

    def autocast(self) -> AbstractContextManager[Any]:
        """Where forward computes: under ``torch.autocast`` in bf16/fp16 over fp32 parameters, as is
        otherwise (every forward of a step, a pipeline stage's included, runs inside it). On the
        meta device (``plan --dry-run``) there is no autocast: shapes alone, in the parameters' dtype."""
        if self.autocast_dtype is None or self._device_type() == "meta":
            return nullcontext()
        return torch.autocast(self._device_type(), dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this micro-batch's share of the mean loss; fp16 scales it first so that small
        gradients survive (``prepare_update`` unscales)."""
        (loss * self.scaler.scale if self.scaler.enabled else loss).backward()

    def use_precision(self, name: str) -> None:
        """Compute in ``name`` (fp32 | bf16 | fp16) under autocast, parameters and gradients staying in
        their own dtype; fp16 adds a dynamic loss scale. Engines that cast their own compute copies
        (ZeRO) take the precision at construction instead."""
        if name == "fp32":
            return
        self.precision = resolve_precision(name, next(self.model.parameters()).dtype)
        self.autocast_dtype = self.precision.compute
        self.scaler = LossScaler(self.precision.scaled)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward actually compute in (the summary reports it)."""
        return self.autocast_dtype or self.precision.compute

    def _device_type(self) -> str:
        return next(self.model.parameters()).device.type

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without communicating (default: nothing to skip)."""
        yield

    @contextmanager
    def pipeline_stage(self, params: Sequence[nn.Parameter], input_grad_only: bool = False) -> Iterator[None]:
        """Around one pipeline action (F, B, I or W) of a stage whose trainable parameters are ``params``,
        and around any other use of them by a pipeline runtime (evaluation, the tied weight's refresh);
        ``input_grad_only``: the action is a zero-bubble I (a backward that gives no parameter a gradient).

        An engine that shards parameters (ZeRO-3) has them present while they are used and released
        after, and keeps the gradients they get local until ``finish_grads`` (a pipeline's backward
        passes of different micro-batches interleave, so none of them is the step's last). Every rank
        of a stage's dp group runs the same action list, so its collectives come in the same order.
        Nothing by default: the parameters are always whole here."""
        yield

    @final
    def finish_grads(self) -> None:
        """After the last backward of a step: the data-parallel exchange (``exchange_grads``), then
        each axis's own sums (``Axis.after_grads``); on return every gradient is as the update needs it."""
        self.exchange_grads()
        for axis in self.axes:
            axis.after_grads(self)

    @abstractmethod
    def exchange_grads(self) -> None:
        """After the last backward of a step: complete the strategy's gradient communication."""

    # -- roles --------------------------------------------------------------------------------------
    def serve(self, after_step: Callable[[int], None] | None = None) -> None:
        """A serving rank's whole run (the parameter server); ``after_step(done)`` runs where the ranks
        that step finish step ``done`` (checkpoints are saved there). Ranks that step never call it."""
        raise RuntimeError(f"the {self.name} engine has no serving ranks: every rank steps")

    def resume_at(self, step: int) -> None:
        """Continue after ``step`` completed steps (a checkpoint was loaded). Nothing by default."""
        return None

    def before_checkpoint(self, done: int) -> None:
        """On ranks that step, just before the checkpoint after ``done`` steps is saved: bring serving
        ranks that run on their own time (the asynchronous parameter server) to the same point, so
        they save with them. Nothing by default: the other engines are already in step."""
        return None

    def finish(self) -> None:
        """After the last step: anything owed to other ranks (final weights, say). Idempotent."""
        return None

    def metrics(self) -> dict[str, float]:
        """Strategy-specific figures for this rank's metrics (staleness, versions, ...)."""
        return {}

    def close(self) -> None:
        """Release hooks, threads and files (nothing to release by default)."""
        return None
