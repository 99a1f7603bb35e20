"""The data-parallel layer's interface: one step's forward, backward, gradient exchange and update.

Every strategy (all-reduce DP, ZeRO, the parameter server, ...) is an ``Engine``. The train loop,
``shardwise verify``, checkpoints and the benchmarks drive engines only through this interface, so a
new strategy plugs into all of them at once, and they never ask which strategy they hold.

What an engine owns, and what it does not:

- It owns gradient reduction and, where it shards, which slice of the parameters a rank holds. It
  declares what this rank's optimizer updates (``optimizer_units``: one list of named tensors per
  unit; ZeRO has one unit per flat group, a parameter server's worker none). The optimizers are built
  outside it, by one factory (``engine.optim.attach_optimizers``), and handed to it.
- The update runs in one place, ``optimizer_step``: ``prepare_update`` (False skips the step, e.g. an
  fp16 overflow), then ``run_optimizers`` (each unit's ``optimizer.step()`` inside that unit's
  ``unit_update`` context: offload maps the shard in, ZeRO sets the shard's gradient), then
  ``after_update``. A parameter server's servers call ``run_optimizers`` from their serving loop.
- ``grad_norm_sq`` gives this rank's share of the squared global gradient norm (every element of
  every trainable parameter counted exactly once over the job) and the ``Comm`` to sum the shares
  over, so clipping and monitoring need no strategy-specific code.
- ``role`` says whether this rank steps, reports (writes metrics, returns the summary) or serves.
- Non-finite values: ``nonfinite_grad`` names the first parameter whose gradient, as this rank holds
  it after ``finish_grads``, has a NaN or inf (whole tensors here; ZeRO checks its shards). The loop
  agrees on it over the ranks that step and then runs ``optimizer_step`` or ``skip_update``. Where the
  optimizer runs on servers, they check the summed gradient themselves and the ranks that step read
  their verdict (``servers_nonfinite``). Under a dynamic loss scale, overflow is the scaler's
  business (``scaler_owns_overflow``).

Loss convention (exact averaging over uneven shares): each rank's loss is the *sum* of its token
losses divided by the number of tokens in the *global* batch, and gradients are *summed* over ranks.
The sum over ranks then equals the mean loss of one process on the whole global batch, whatever
share of it each rank drew.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.checkpoint.boxes import Box
from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.device import HOST, to_device
from shardwise.engine.loss import Loss, TokenLoss, check_summed, run_model
from shardwise.engine.precision import LossScaler, resolve_precision
from shardwise.engine.step import MicroBatchLoop, StepRunner

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (batch, seq) long, targets (batch, seq) long
# what a rank asks a checkpoint for: a flat range [start, stop) of a global tensor, an n-d Box of it,
# or None for the whole tensor
Span = tuple[int, int] | Box | None
NamedTensors = list[tuple[str, torch.Tensor]]  # what one optimizer updates, by name


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


class StateReader(Protocol):
    """What an engine reads its state through when a checkpoint is loaded (see ``Engine.load_state``).

    ``shapes`` lists every saved tensor with its global shape; calling the reader with
    ``{name: span}`` returns, per name, the whole tensor at its global shape (span None), a flat range
    as a 1-D tensor, or a ``Box`` at the box's shape, whichever layout wrote it. It raises
    ``CheckpointError`` when a file is damaged; the caller then falls back to an older checkpoint and
    calls ``load_state`` again.
    """

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]: ...

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class NonFinite:
    """What was found not finite (NaN or inf) in one step, and whether the run stops on it."""

    what: str  # "the loss" | "the gradient of <parameter>"
    stop: bool  # False: the step's update is skipped and training goes on (on_nonfinite = "skip")

    def message(self, step: int) -> str:
        """The one line a stopped run ends with."""
        verb = "are" if " and " in self.what else "is"
        return (
            f"step {step}: {self.what} {verb} not finite (NaN or inf), so training stopped; lower the "
            "learning rate (--lr), or pass --on-nonfinite skip to skip such steps"
        )


class NonFiniteStop(RuntimeError):
    """Raised where a run stops on a non-finite value (``on_nonfinite = "stop"``): on every rank that
    steps in the same step, and on the servers that found it. The run ends on its one line."""

    def __init__(self, step: int, found: NonFinite) -> None:
        super().__init__(found.message(step))
        self.step, self.found = step, found

    @classmethod
    def from_message(cls, message: str) -> NonFiniteStop:
        """The exception back from its one line (what a rank reports to the launcher)."""
        match = re.match(r"step (\d+): (.+?) (?:is|are) not finite", message)
        if match is None:
            raise ValueError(f"not a non-finite stop: {message!r}")
        return cls(int(match[1]), NonFinite(match[2], stop=True))


def describe_nonfinite(loss_ok: bool, grad_name: str | None) -> str:
    """What was not finite, in words: the loss, a parameter's gradient, or both."""
    parts = ([] if loss_ok else ["the loss"]) + ([f"the gradient of {grad_name}"] if grad_name else [])
    return " and ".join(parts) or "the loss"


def first_nonfinite(named: Sequence[tuple[str, torch.Tensor | None]]) -> str | None:
    """The first name whose tensor has a NaN or inf (a missing tensor counts finite). One flag per
    tensor, stacked where the tensors are and read once (no host synchronisation per tensor)."""
    present = [(name, t) for name, t in named if t is not None and t.numel()]
    if not present:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in present]).tolist()
    return next((name for (name, _), ok in zip(present, finite, strict=True) if not ok), None)


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the tensors' device: every element of every one of ``tensors`` is finite."""
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


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
    norms = torch._foreach_norm([t.detach() for t in tensors])
    return torch.stack(norms).double().pow(2).sum()  # on the tensors' device: read once, by the caller


class Engine(ABC):
    """A model with a data-parallel strategy applied; see the module docstring for the contract."""

    name: str = "engine"
    comm: Comm | None = None  # what the strategy communicates over: its bytes and waits are the step's
    # where the optimizer runs: on every rank over what it holds, or on the parameter servers
    optimizer_runs: Literal["every_rank", "servers"] = "every_rank"
    # whether optimizer_units hands out the model's own parameters (False: ZeRO's flat shards)
    units_are_parameters: bool = True

    def __init__(self, model: nn.Module, role: Role | None = None) -> None:
        self.model = model
        self.role = role or Role.trainer(0)
        self.optimizers: list[Optimizer] = []
        self.schedulers: list[LRScheduler] = []  # one per optimizer when the user gives a factory
        self.loss: Loss = TokenLoss()  # the user's loss: a SUM over items and a count (engine.loss)
        self.count_comm: Comm | None = None  # the ranks that share a batch: where counts are summed
        # where step loss shares are summed to the global mean: count_comm (None) unless a pipeline,
        # whose loss share lives on the last stage only, sums them over every rank that trains
        self.loss_comm: Comm | None = None
        self.clip_grad_norm = 0.0  # 0 or inf: measure the global norm, never clip
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        self.precision = resolve_precision("fp32", dtype)
        self.autocast_dtype: torch.dtype | None = None  # bf16/fp16 compute over fp32 parameters
        self.scaler = LossScaler(False)
        self.last_grad_norm = float("nan")  # the global norm before clipping, of the last update
        self.runner: StepRunner = MicroBatchLoop()  # who runs a step's micro-batches (engine.step)
        self.local_count = 0.0  # the items of this rank's micro-batches this step (forward_backward)

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[Any]) -> float:
        """One whole step on this rank's micro-batches: the global item count (one all-reduce),
        forward, backward, gradient exchange, update. Returns the global mean loss (every rank).
        The count and the loss, read on the host, are summed on the host side (gloo)."""
        count = self.global_count(micro_batches)
        share = torch.tensor(
            [self.forward_backward(micro_batches, max(count, 1.0))], dtype=torch.float64, device=HOST
        )
        loss_comm = self.loss_comm or self.count_comm
        if loss_comm is not None:
            loss_comm.all_reduce(share)
        self.optimizer_step()
        return float(share)

    def global_count(self, micro_batches: Sequence[Any]) -> float:
        """Items the loss counts in this step's micro-batches over every rank that shares the batch
        (one all-reduce of one number, before any backward, so every rank divides by the same).
        Counted on the host, before the batches move to the device: host bookkeeping, over gloo."""
        count = torch.tensor(
            [float(sum(self.loss.count(batch) for batch in micro_batches))], dtype=torch.float64, device=HOST
        )
        if self.count_comm is not None:
            self.count_comm.all_reduce(count)
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
        params = list(self.model.parameters())
        for p in params:
            if not p.is_meta:
                return p.device
        return params[0].device if params else HOST

    def begin_step(self, micro_batches: Sequence[Any], global_count: float) -> float:
        """Before the step's first forward: the engine's preparation (gradient buffers attached,
        buffers broadcast, replicas made). Returns what each micro-batch's summed loss is divided by:
        the global count by default, so that gradients summed over ranks are the global mean's."""
        return global_count

    def step_loss(self, share: float) -> float:
        """After ``finish_grads``: what the step reports as this rank's share of the global mean loss,
        given the sum of its micro-batches' divided losses (``share``). The share itself by default."""
        return share

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The summed loss of one micro-batch: the model on the batch (under autocast when the engine
        computes in bf16/fp16 from fp32 parameters), then ``self.loss`` (which sums in fp32)."""
        if self.autocast_dtype is None:
            return check_summed(self.loss(run_model(self.model, batch), batch))
        with torch.autocast(self._device_type(), dtype=self.autocast_dtype):
            outputs = run_model(self.model, batch)
        return check_summed(self.loss(outputs, batch))

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

    @abstractmethod
    def finish_grads(self) -> None:
        """After the last backward of a step: complete gradient communication."""

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

    @abstractmethod
    def grad_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        """This rank's share of the squared global gradient norm, and the ``Comm`` to sum shares over.

        Call after ``prepare_update`` (fp16 gradients are unscaled there; for fp32 any time between
        ``finish_grads`` and the update). Summed over the ``Comm`` (no ``Comm``:
        this rank's share is already the whole), every element of every trainable parameter counts
        once. A 0-d float64 tensor.
        """

    def optimizer_step(self) -> None:
        """Apply the update and clear gradients for the next step."""
        if self.prepare_update():
            if self.optimizer_runs == "every_rank":  # a parameter server clips on its servers
                self.clip_gradients()
            self.run_optimizers()
        self.after_update()

    def clip_gradients(self) -> float:
        """Measure the global gradient norm (one all-reduce of one number over ``grad_norm_sq``'s
        group) and, when ``clip_grad_norm`` is set, scale every gradient by
        min(1, max_norm / (norm + 1e-6)), as ``torch.nn.utils.clip_grad_norm_`` does. Returns the norm."""
        share, comm = self.grad_norm_sq()
        if comm is not None:
            comm.all_reduce(share)
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

        Every rank that steps calls it in the same step, instead of ``optimizer_step``.
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

    def override(self, methods: Mapping[str, Callable[..., Any]]) -> None:
        """Replace some of this instance's methods: an attachment (``pipeline.engine``,
        ``tensor_parallel.engine``, ``zero.hybrid``) widens what an engine over one axis answers for,
        each wrapper calling the method it replaces. Only methods the interface has can be replaced."""
        for name, method in methods.items():
            if not callable(getattr(type(self), name, None)):
                raise AttributeError(f"{type(self).__name__} has no method {name!r} to override")
            setattr(self, name, method)

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

    # -- inspection (verify, checkpoints, digests) ----------------------------------------------------
    @abstractmethod
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at its global shape, by name, on every rank (a copy)."""

    @abstractmethod
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's global gradient, by name, between ``finish_grads`` and the step."""

    def metrics(self) -> dict[str, float]:
        """Strategy-specific figures for this rank's metrics (staleness, versions, ...)."""
        return {}

    # -- checkpoints -------------------------------------------------------------------------------
    def state_pieces(self, rank: int, world_size: int) -> list[Piece]:
        """What this rank writes into a checkpoint: flat ranges of global tensors (``Piece``).

        Names and global shapes are the same for every strategy, so any layout loads any other:

        - ``model/<name>``: each parameter by its ``model.named_parameters()`` name at its global
          shape (tied weights once), and each floating-point or integer buffer by its
          ``named_buffers()`` name.
        - ``optim/<key>/<name>``: each per-parameter optimizer tensor (``exp_avg``, ``exp_avg_sq``,
          ``momentum_buffer``, ...) at the parameter's global shape, in the optimizer's dtype.
        - ``optim/step/<name>``: the parameter's step count, a scalar (shape ``()``).
        - State only one strategy has goes under its own prefix, and other layouts ignore it:
          ``ps/version`` (each server's version), ``precision/loss_scale`` (fp16's loss scaler).
        - ``codec/<layout>/rank<r>/...``: with ``comm.compress``, each rank's own error-feedback state
          (``engine.codec_state``), loaded back only by a run of the same layout.
        - ``rng/<state>/rank<r>``: with tensor parallelism, each rank's private dropout stream
          (``tensor_parallel.engine.attach_rng_states``), beside the ``rng/torch/rank<r>`` the
          checkpoint writer adds for every rank.

        Every element of every tensor must be written by exactly one rank. Replicated engines (DDP)
        spread whole tensors over ranks (``checkpoint.spread_replicated``), so no rank writes it all.
        A sharded engine writes what it owns, as flat ranges of the global tensors: ZeRO, whose shard
        is a range of the concatenation of flattened parameters, emits for each parameter overlapping
        its shard the piece ``Piece("model/<name>", shape, a, b, shard_view)`` where ``[a, b)`` is the
        overlap in the parameter's own flat numbering (padding is never written), and the same ranges
        for each optimizer state; the scalar ``optim/step/<name>`` goes to the one rank holding the
        parameter's first element. A parameter server writes the ranges its shards hold; workers
        write nothing of the model. Optimizer state a parameter has not got yet (never stepped) is
        simply absent.
        """
        raise NotImplementedError(f"the {self.name} engine cannot save checkpoints yet")

    def load_state(self, read: StateReader) -> None:
        """Replace parameters, buffers and optimizer state with a checkpoint's, read through ``read``.

        The engine asks for exactly the ranges it holds (DDP: whole tensors; ZeRO: its flat shard's
        overlap with each parameter, as ``(a, b)`` spans; a parameter server: its shards), so a
        checkpoint written by any strategy and world size loads. Read everything first and only then
        change the engine, so that a damaged file (``read`` raises) leaves it as it was. Optimizer
        state absent from the checkpoint is cleared (as for a never-stepped parameter).
        """
        raise NotImplementedError(f"the {self.name} engine cannot load checkpoints yet")

    def close(self) -> None:
        """Release hooks, threads and files (nothing to release by default)."""
        return None
