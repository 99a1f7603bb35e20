"""The pipeline runtime: one step runner that executes this rank's action list over the pp axis.

A step (``PipelineRunner.forward_backward``), on every rank of a pipeline:

1. every micro-batch read as its stages will read it (``Split.inputs``: the token ids and the keys
   the blocks use, a key no stage honours refused before any message is sent); ``engine.begin_step``
   (the loss divisor); the tied weight's values sent from the first stage to the last stage's copy
   (``pipeline/tied.py``: posted right after the step's first activation where that goes to the
   copy's rank, else first; waited for where the last stage's first F reaches its head);
2. the actions in order, all under ``engine.no_sync()``, with this rank's messages posted at the
   boundaries between them in the step's one order (``pipeline/messages.py``: the same order on both
   ends of every pair, one tag for all, as NCCL needs): a send as soon as its action produced it, a
   receive as early as that order allows, and over gloo every receive at once, at the step's start
   or, on the first stage's rank, right after its first action's sends (``Comm.receives_stand_aside``;
   each direction's order kept); an action waits only for the
   messages it reads. The compute thread posts them itself, between its actions: a thread of their
   own (which let a gloo send to a peer already waiting for it run beside the next action) made
   every schedule of the pipeline bench 2-6% slower on a quiet 2-core machine, each message paying
   a hand-over to it; over NCCL posting only queues the op on a stream, after the stream that made
   the tensor. ``F`` runs
   the stage on its input (the micro-batch's token ids on the first stage, the received activation
   elsewhere, a leaf that requires grad; every stage also reads the micro-batch's mask, positions and
   segment ids itself); the last stage's ``F`` computes the summed loss / divisor. ``B`` runs backward
   (``engine.backward`` on the last stage, so the loss scale applies; ``torch.autograd.backward(output,
   received_grad)`` elsewhere) and sends the input's gradient back. ``I`` is the same backward with the
   stage's ``WeightGradStore`` collecting: every linear layer's weight gradient is kept as its
   (input, output gradient) instead of computed (``engine/linear.py``; the split patches the stage's
   linear layers), everything else gets its gradient, the graph is freed. ``W`` computes the kept
   weight gradients (a matmul each, accumulated through the weights' gradient accumulators) and
   nothing else: no graph walked again, no block recomputed under activation checkpointing. A stage's
   activations are dropped once its B or I ran, its kept ones once its W ran. Each action runs inside
   ``engine.pipeline_stage(the stage's parameters)``: ZeRO-3 gathers them there as they are used and
   releases them after (a W uses none: the weight gradient needs no weight), and keeps the gradients
   local until ``finish_grads``. Each action is one span in the trace (``--trace``: lane "pipeline",
   named as printed, ``0F1``);
3. the tied weight's copy sends its gradient to the first stage as soon as the last stage's last B
   or I has made it whole (its head keeps its dW in I) and the messages with that rank before it are
   posted; the first stage posted its receive early and adds it to the parameter's
   (``pipeline/tied.py``; every backward ran under ``no_sync``, so the gradient is still local), so
   the first stage's update never waits for the last stage's deferred W passes; then
   ``finish_grads``: the
   data-parallel exchange, once per step, each stage over its own dp group.

Empty micro-batches (a dp rank's share smaller than the micro-batch count) are skipped by every stage
alike: each pp rank draws the same micro-batches (the samplers shard by dp rank; a user's own
``batches=`` stream must be the same on the pp ranks of one pipeline), so only activations and their
gradients travel, and the messages of an empty micro-batch are dropped at both ends. The loss exists
on the last stage only; that rank returns its share and every other rank 0, so the shares still sum,
over all ranks that train, to the global mean (``Engine.trainers`` is the group they sum over).
Communication: point-to-point between adjacent stages' ranks over the pp axis (Narayanan et al. 2021,
arXiv:2104.04473; Qi et al. 2023, arXiv:2401.10241 for I and W).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from shardwise.collectives.api import Comm
from shardwise.collectives.p2p import Work
from shardwise.engine.linear import DeferredWeightGrad, WeightGradStore, apply_weight_grads
from shardwise.engine.loss import rows
from shardwise.observe.monitor import MONITOR
from shardwise.pipeline.actions import Action, Kind, Transfer, fuse_schedule
from shardwise.pipeline.deferred import defer_stage_weight_grads
from shardwise.pipeline.fitting import ScheduleFitter
from shardwise.pipeline.messages import MessageKey, plan
from shardwise.pipeline.split import Split, StageInputs
from shardwise.pipeline.tied import TAG, TiedExchange

if TYPE_CHECKING:
    from shardwise.engine.base import Engine

Schedule = Mapping[int, Sequence[Action]]


class PipelineRunner:
    """Runs ``schedule(microbatches)[this rank]`` on this pp rank; see the module docstring."""

    def __init__(
        self, split: Split, comm: Comm, placement: Sequence[int], schedule: Callable[[int], Schedule],
        split_backward: bool = False, fit: bool = True,
    ) -> None:  # fmt: skip
        self.split, self.comm, self.placement = split, comm, tuple(placement)
        self.schedule = schedule  # microbatches -> every rank's [Action]
        self.last_stage = len(self.placement) - 1
        self.weight_grads = WeightGradStore() if split_backward else None
        if self.weight_grads is not None:  # the I passes keep each linear layer's dW for the W pass
            # but the tied copy's head's: the copy's gradient leaves after the last I (``TiedExchange``)
            defer_stage_weight_grads(split, self.weight_grads)
        self._plans: dict[tuple[int, str], _Plan] = {}
        self._microbatches = 0  # the last step's count (``early_update``)
        self.tied = TiedExchange(split, comm, self.placement)
        # the first stage's I followed by its W is one B; a split schedule is then fitted to the run
        self.fitter = ScheduleFitter(
            lambda m: fuse_schedule(schedule(m)),
            self.placement,
            len(self.placement),
            fit,
        )

    def step_plan(self, microbatches: int) -> _Plan:
        """This rank's actions, the messages it posts before each (and after the last) and the one the
        tied weight's values follow (``TiedExchange.values_anchor``), cached per micro-batch count
        and ``ScheduleFitter`` phase (every rank is in the same one)."""
        key = (microbatches, self.fitter.phase(microbatches))
        if key not in self._plans:
            every = self.fitter.schedule(*key)
            actions = list(every[self.comm.rank])
            if self.weight_grads is None and any(a.kind is Kind.INPUT_GRAD for a in actions):
                raise ValueError("a schedule with I and W actions needs PipelineRunner(split_backward=True)")
            early = self.comm.receives_stand_aside  # gloo: every receive at once, as soon as useful
            plans = plan(every, self.placement, early)
            anchor = self.tied.values_anchor(plans.get(self.placement[0]))
            gradient = self.tied.send_boundary(actions, plans[self.comm.rank], self.last_stage)
            self._plans[key] = _Plan(actions, plans[self.comm.rank], anchor, gradient)
        return self._plans[key]

    # -- the step -------------------------------------------------------------------------------
    def forward_backward(self, engine: Engine, micro_batches: Sequence[Any], global_count: float) -> float:
        # read (and checked) before any message: every pp rank refuses the same batch at the same place
        given = [self.split.inputs(batch) for batch in micro_batches]
        divisor = engine.begin_step(micro_batches, global_count)
        actions, posts, anchor, tied_send = self.step_plan(len(micro_batches))
        self._microbatches = len(micro_batches)  # the update after it is timed by this count's fit
        empty = {i for i, batch in enumerate(micro_batches) if rows(batch) == 0}
        state = _StepState(given, _dtype(engine), self.split.hidden_size, engine.device)
        state.split = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.INPUT_GRAD}
        state.timing = self.fitter.timing(len(micro_batches))
        state.anchor = anchor
        if anchor is None:
            self._post_values(engine, state)
        tied_receive = self.tied.receive_boundary(posts)
        with engine.no_sync():
            for index, (action, boundary) in enumerate(zip(actions, posts, strict=False)):
                self._post(engine, boundary, empty, state)
                if index == tied_receive:
                    self.tied.post_receive()
                if index == tied_send:
                    self._post_gradient(state)
                if action.microbatch not in empty:
                    # before its span: the span is its compute (and, in the last stage's first F,
                    # any wait for the tied values, at its head: none where they came during its blocks)
                    self._receive(action, state)
                    self._run(engine, action, micro_batches[action.microbatch], divisor, state)
        self._post(engine, posts[-1], empty, state)
        if tied_receive == len(actions):
            self.tied.post_receive()
        if tied_send == len(actions):
            self._post_gradient(state)
        for work in state.sends:
            work.wait()
        self.tied.wait_values()  # every micro-batch empty: no F waited for them
        self.tied.add_gradient()
        MONITOR.set_phase("gradient sync")
        engine.finish_grads()
        self.fitter.step_done(len(micro_batches), engine.trainers)
        return engine.step_loss(state.share)  # the last stage reports it (``PipelineAxis``)

    def report(self) -> dict[str, Any]:
        """For the run's summary: every stage's blocks (``pipeline_stages``, the cut that ran, balanced
        or named) and its pp rank (``pipeline_placement``), and what each fit of a split schedule kept
        (``pipeline_fit``: ``adapt.fit_report``)."""
        out: dict[str, Any] = {
            "pipeline_stages": [list(blocks) for blocks in self.split.assignment],
            "pipeline_placement": list(self.placement),
        }
        if reports := self.fitter.reports:
            out["pipeline_fit"] = {str(m): r for m, r in reports.items()}
        return out

    def take_notes(self) -> list[str]:
        """What each fit since the last call kept, in words (the train loop prints them once)."""
        return self.fitter.take_notes()

    def early_update(self, engine: Engine) -> AbstractContextManager[object]:
        """Around this rank's update before the step's verdict: timed while the fitter times (the
        rank's share of the step's end, which ``adapt.fit_schedule`` weighs)."""
        if not self.fitter.timing_update(self._microbatches):
            return nullcontext()
        stages = tuple(s for s, rank in enumerate(self.placement) if rank == self.comm.rank)
        return self.fitter.timed_update(stages, engine.device)

    def _post(self, engine: Engine, boundary: list[Transfer], empty: set[int], state: _StepState) -> None:
        """This boundary's sends and receives, in the step's one order (``pipeline/messages.py``),
        posted in that order (module docstring)."""
        for t in boundary:
            if t.microbatch not in empty:  # else dropped at both ends alike
                if t.op == "send":
                    tensor = state.outbox.pop(t.key)
                    state.sends.append(self.comm.isend(tensor, t.peer, TAG))
                else:
                    buffer = state.buffer(t.microbatch)
                    state.pending[t.key] = (buffer, self.comm.irecv(buffer, t.peer, TAG))
            if t.key == state.anchor:  # the tied weight's values follow this message at both ends
                self._post_values(engine, state)

    def _post_gradient(self, state: _StepState) -> None:
        if (sent := self.tied.post_gradient()) is not None:
            state.sends.append(sent)

    def _post_values(self, engine: Engine, state: _StepState) -> None:
        if (sent := self.tied.post_values(engine, state.dtype)) is not None:
            state.sends.append(sent)

    def _run(self, engine: Engine, action: Action, batch: Any, divisor: float, state: _StepState) -> None:
        started = time.monotonic()
        split = (action.stage, action.microbatch) in state.split
        if self.weight_grads is not None:  # the split's path only for a micro-batch whose backward splits
            self.weight_grads.armed = split
        timed = self.fitter.timed(action, split, engine.device) if state.timing else nullcontext()
        # ZeRO-3: the stage's parameters gathered as they are used, released after
        with timed, engine.pipeline_stage(self.split.params[action.stage], action.kind is Kind.INPUT_GRAD):
            if action.kind is Kind.FORWARD:
                MONITOR.set_phase("forward")
                self._forward(engine, action, batch, divisor, state)
            elif action.kind is Kind.WEIGHT_GRAD:
                MONITOR.set_phase("backward")
                apply_weight_grads(state.kept.pop((action.stage, action.microbatch)))
            else:
                MONITOR.set_phase("backward")
                self._backward(engine, action, state)
        if self.weight_grads is not None:  # outside the actions (evaluation, a user's call) the plain op
            self.weight_grads.armed = False
        # one span per action (with --trace): what observe.plots and the pipeline bench read as busy time
        MONITOR.span(
            str(action), "compute", "actions", started,
            stage=action.stage, kind=action.kind.value, microbatch=action.microbatch,
        )  # fmt: skip

    def _receive(self, action: Action, state: _StepState) -> None:
        """Wait for the message ``action`` reads, if it comes from another rank."""
        if action.kind is Kind.FORWARD:
            key = ("activation", action.stage - 1, action.microbatch)
        elif action.kind is Kind.WEIGHT_GRAD:
            return
        else:
            key = ("gradient", action.stage + 1, action.microbatch)
        if action.kind is Kind.FORWARD and action.stage == self.last_stage and not self.tied.waits_in_head:
            self.tied.wait_values()  # the tied weight's values, before the head uses them
        if key in state.pending:
            buffer, work = state.pending.pop(key)
            work.wait()
            state.local[key] = buffer

    def _incoming(self, what: str, producer: int, microbatch: int, state: _StepState) -> torch.Tensor | None:
        """The message ``(what, producer, mb)`` an action reads (received, or handed over on this rank)."""
        return state.local.pop((what, producer, microbatch), None)

    def _hand_on(
        self, what: str, stage: int, microbatch: int, tensor: torch.Tensor, state: _StepState
    ) -> None:
        """What an action produced for the next (F) or previous (B, I) stage: kept for the boundary's
        send, or handed over in place where that stage is on this rank (the turn of a V)."""
        consumer = stage + 1 if what == "activation" else stage - 1
        key = (what, stage, microbatch)
        if self.placement[consumer] == self.comm.rank:
            state.local[key] = tensor
        else:  # in the dtype the receiver's buffer has (a no-op unless a stage ends in another)
            state.outbox[key] = tensor.to(state.dtype).contiguous()

    def _forward(self, engine: Engine, action: Action, batch: Any, divisor: float, state: _StepState) -> None:
        stage = self.split.stages[action.stage]
        key = (action.stage, action.microbatch)
        given = state.given[action.microbatch]
        if stage.first:
            x = given.ids
        else:
            received = self._incoming("activation", action.stage - 1, action.microbatch, state)
            assert received is not None, f"no activation for {action}"
            x = received.detach().requires_grad_(True)
        with engine.autocast():
            out = stage(x, given)
        state.inputs[key] = x
        if stage.last:
            self.tied.check_values_read()
            loss = engine.loss(out, batch) / divisor
            state.share += loss.detach().to(torch.float64)
            state.outputs[key] = loss
        else:
            state.outputs[key] = out
            self._hand_on("activation", action.stage, action.microbatch, out.detach(), state)

    def _backward(self, engine: Engine, action: Action, state: _StepState) -> None:
        """B, or I with the stage's weight gradients kept for its W (the same backward otherwise)."""
        key = (action.stage, action.microbatch)
        out, inp = state.outputs.pop(key), state.inputs.pop(key)
        grad = self._incoming("gradient", action.stage + 1, action.microbatch, state)
        store = self.weight_grads if action.kind is Kind.INPUT_GRAD else None
        collecting: Any = store.collect() if store is not None else nullcontext([])
        with collecting as kept:
            if self.split.stages[action.stage].last:
                engine.backward(out)  # the loss scale applies
            else:
                torch.autograd.backward(out, grad)
        if store is not None:
            state.kept[key] = kept
        if action.stage > 0:
            assert inp.grad is not None, f"no input gradient in {action}"
            self._hand_on("gradient", action.stage, action.microbatch, inp.grad, state)

    # -- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, engine: Engine, batches: Sequence[Any]) -> tuple[float, int]:
        """The summed loss and the items it counts over ``batches``, forward only, stage after stage
        (the same on every pp rank: the last stage's sum is all-reduced over the pp axis)."""
        given = [self.split.inputs(batch) for batch in batches]  # checked before any message
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        items = 0
        self.tied.values_now(engine, _dtype(engine))  # the update since the step began changed them
        with torch.no_grad():
            for batch, inputs in zip(batches, given, strict=True):
                total += self._evaluate_one(engine, batch, inputs)
                items += engine.loss.count(batch)
        self.comm.all_reduce(total)
        return float(total), items

    def _evaluate_one(self, engine: Engine, batch: Any, given: StageInputs) -> torch.Tensor:
        hidden: torch.Tensor | None = None
        sends: list[Work] = []
        loss = torch.zeros((), dtype=torch.float64, device=engine.device)
        me = self.comm.rank
        for s in range(self.last_stage + 1):
            if self.placement[s] != me:
                continue
            stage = self.split.stages[s]
            if stage.first:
                x = given.ids
            elif self.placement[s - 1] == me and hidden is not None:
                x = hidden
            else:
                x = _hidden_buffer(given.ids, self.split.hidden_size, _dtype(engine), engine.device)
                self.comm.recv(x, self.placement[s - 1], TAG)
            with engine.autocast(), engine.pipeline_stage(self.split.params[s]):
                hidden = stage(x, given)
            if stage.last:
                loss = engine.loss(hidden, batch).detach().to(torch.float64)
            elif self.placement[s + 1] != me:
                outgoing = hidden.to(_dtype(engine)).contiguous()  # the receiver's buffer's dtype
                sends.append(self.comm.isend(outgoing, self.placement[s + 1], TAG))
        for work in sends:
            work.wait()
        return loss


class _Plan(NamedTuple):
    """This rank's step: its actions, its posts at each boundary, the tied values' anchor and the
    boundary after whose posts the tied copy's gradient leaves (``TiedExchange.send_boundary``)."""

    actions: list[Action]
    posts: list[list[Transfer]]
    anchor: MessageKey | None
    tied_send: int | None


class _StepState:
    """What one step keeps between actions: inputs and outputs by (stage, mb), messages, the loss."""

    def __init__(
        self, given: list[StageInputs], dtype: torch.dtype, hidden: int, device: torch.device
    ) -> None:
        self.given = given  # by micro-batch: the token ids and extras every stage reads of it
        self.dtype, self.hidden, self.device = dtype, hidden, device
        self.pending: dict[tuple[str, int, int], tuple[torch.Tensor, Work]] = {}  # receives posted
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # produced, sent at the next boundary
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}  # arrived, or handed over on this rank
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.kept: dict[tuple[int, int], list[DeferredWeightGrad]] = {}  # I's weight gradients, for W
        self.sends: list[Work] = []
        self.split: set[tuple[int, int]] = set()  # (stage, mb) whose backward is an I and a W
        self.timing = False  # this step's actions are timed for the schedule's fit
        self.anchor: MessageKey | None = None  # the message the tied weight's values follow
        self.share = torch.zeros((), dtype=torch.float64, device=device)

    def buffer(self, microbatch: int) -> torch.Tensor:
        """A receive buffer for an activation or gradient of micro-batch ``microbatch``."""
        return _hidden_buffer(self.given[microbatch].ids, self.hidden, self.dtype, self.device)


def _hidden_buffer(ids: torch.Tensor, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A hidden state's buffer for a micro-batch of token ids ``ids``, on the stage's device."""
    return torch.empty((int(ids.shape[0]), int(ids.shape[1]), hidden), dtype=dtype, device=device)


def _dtype(engine: Engine) -> torch.dtype:
    """What crosses a stage boundary is in the parameters' dtype: under autocast the residual stream
    stays in it (the autocast dtype is only the matmuls'), ZeRO's compute copies are in theirs."""
    return next((p.dtype for p in engine.model.parameters()), torch.float32)
