"""The pipeline runtime: one step runner that executes this rank's action list over the pp axis.

A step (``PipelineRunner.forward_backward``), on every rank of a pipeline:

1. every micro-batch read as its stages will read it (``Split.inputs``: the token ids and the keys
   the blocks use, a key no stage honours refused before any message is sent); ``engine.begin_step``
   (the loss divisor); the tied weight's copy on the last stage refreshed from the first stage (one
   send, when the two ends are on different ranks);
2. every receive of the step posted at once (``irecv``, tagged by the message's key: what, stage,
   micro-batch; ``actions.transfers`` derives them), so a peer's send never waits on this rank;
3. the actions in order, all under ``engine.no_sync()``: ``F`` runs the stage on its input (the
   micro-batch's token ids on the first stage, the received activation elsewhere, a leaf that
   requires grad; every stage also reads the micro-batch's mask, positions and segment ids itself)
   and sends its output asynchronously (``isend``); the last stage's ``F`` computes
   the summed loss / divisor. ``B`` runs backward (``engine.backward`` on the last stage, so the loss
   scale applies; ``torch.autograd.backward(output, received_grad)`` elsewhere) and sends the input's
   gradient back. ``I`` computes only the input's gradient (``torch.autograd.grad(inputs=[input])``,
   the graph retained) and sends it; ``W`` then accumulates the stage's weight gradients
   (``torch.autograd.backward(inputs=weights)``). W walks the graph from the output again rather than
   reusing I's intermediate gradients (torch's ``stage_backward_weight`` keeps them), so a W costs
   about a B here: the order, and so the bubble, is the zero-bubble schedule's, the work per W is not
   yet. A stage's activations are dropped once its B (or W) ran. Each action runs inside
   ``engine.pipeline_stage(the stage's parameters)``: ZeRO-3 gathers them there as they are used and
   releases them after (every replica of a stage runs the same actions, so the dp group's gathers
   match), and keeps the gradients local until ``finish_grads``;
   Each action is one span in the trace (``--trace``: lane "pipeline", named as printed, ``0F1``);
4. the tied weight's copy sends its gradient to the first stage, which adds it to the parameter's
   (every backward ran under ``no_sync``, so the gradient is still local); then ``finish_grads``: the
   data-parallel exchange, once per step, each stage over its own dp group.

Empty micro-batches (a dp rank's share smaller than the micro-batch count) are skipped by every stage
alike: each pp rank draws the same micro-batches (the samplers shard by dp rank; a user's own
``batches=`` stream must be the same on the pp ranks of one pipeline), so only activations and their
gradients travel. The loss exists on the last stage only; that rank
returns its share and every other rank 0, so the shares still sum, over all ranks that train, to the
global mean (``Engine.loss_comm`` is the group they sum over). Communication: point-to-point between
adjacent stages' ranks over the pp axis (Narayanan et al. 2021, arXiv:2104.04473; Qi et al. 2023,
arXiv:2401.10241 for I and W).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from shardwise.collectives.api import Comm
from shardwise.collectives.p2p import Done, Work
from shardwise.engine.loss import rows
from shardwise.observe.monitor import MONITOR
from shardwise.pipeline.actions import Action, Kind, Transfer, transfers
from shardwise.pipeline.split import Split, StageInputs

if TYPE_CHECKING:
    from shardwise.engine.base import Engine

_TIE_TAG = (1 << 20) - 1  # the tied weight's own messages, apart from every keyed one


def message_tag(transfer: Transfer, microbatches: int) -> int:
    """A tag unique to a message's key (what, stage, micro-batch) within a step."""
    return ((transfer.stage * microbatches + transfer.microbatch) * 2) + (transfer.what == "gradient")


class PipelineRunner:
    """Runs ``schedule(microbatches)`` on this pp rank; see the module docstring."""

    def __init__(self, split: Split, comm: Comm, placement: Sequence[int], schedule: Any) -> None:
        self.split, self.comm, self.placement = split, comm, tuple(placement)
        self.schedule = schedule  # microbatches -> this rank's [Action]
        self.last_stage = len(self.placement) - 1

    # -- the step -------------------------------------------------------------------------------
    def forward_backward(self, engine: Engine, micro_batches: Sequence[Any], global_count: float) -> float:
        # read (and checked) before any message: every pp rank refuses the same batch at the same place
        given = [self.split.inputs(batch) for batch in micro_batches]
        divisor = engine.begin_step(micro_batches, global_count)
        self._refresh_tied(engine)
        m = len(micro_batches)
        plan = transfers(self.comm.rank, self.schedule(m), self.placement)
        empty = {i for i, batch in enumerate(micro_batches) if rows(batch) == 0}
        pending = self._post_receives(plan, given, empty, engine)
        state = _StepState(pending, given, engine.device)
        with engine.no_sync():
            for action, recvs, sends in plan:
                if action.microbatch in empty:
                    continue
                self._run(engine, action, recvs, sends, micro_batches[action.microbatch], divisor, state)
        for work in state.sends:
            work.wait()
        self._reduce_tied()
        MONITOR.set_phase("gradient sync")
        engine.finish_grads()
        if self.last_stage in self.split.stages:
            return engine.step_loss(float(state.share))
        return 0.0

    def _post_receives(
        self, plan: list[tuple[Action, list[Transfer], list[Transfer]]], given: Sequence[StageInputs],
        empty: set[int], engine: Engine,
    ) -> dict[tuple[str, int, int], tuple[torch.Tensor, Work]]:  # fmt: skip
        dtype = _dtype(engine)
        pending = {}
        for action, recvs, _ in plan:
            if action.microbatch in empty:
                continue
            for t in recvs:
                shape = self._hidden_shape(given[t.microbatch])
                buffer = torch.empty(shape, dtype=dtype, device=engine.device)  # the stage's device
                pending[t.key] = (buffer, self.comm.irecv(buffer, t.peer, message_tag(t, len(given))))
        return pending

    def _hidden_shape(self, given: StageInputs) -> tuple[int, int, int]:
        ids = given.ids
        return (int(ids.shape[0]), int(ids.shape[1]), self.split.hidden_size)  # (batch, seq, hidden)

    def _run(
        self, engine: Engine, action: Action, recvs: list[Transfer], sends: list[Transfer], batch: Any,
        divisor: float, state: _StepState,
    ) -> None:  # fmt: skip
        for t in recvs:  # wait for this action's messages first, so its span below is compute alone
            if t.key in state.pending:
                buffer, work = state.pending[t.key]
                work.wait()
                state.pending[t.key] = (buffer, Done())  # gloo's work hangs if waited for twice
        started = time.monotonic()
        # ZeRO-3: the stage's parameters gathered as they are used, released after
        with engine.pipeline_stage(self.split.params[action.stage], action.kind is Kind.INPUT_GRAD):
            self._compute(engine, action, sends, batch, divisor, state)
        # one span per action (with --trace): what observe.plots and the pipeline bench read as busy time
        MONITOR.span(
            str(action), "compute", "actions", started,
            stage=action.stage, kind=action.kind.value, microbatch=action.microbatch,
        )  # fmt: skip

    def _compute(
        self, engine: Engine, action: Action, sends: list[Transfer], batch: Any, divisor: float,
        state: _StepState,
    ) -> None:  # fmt: skip
        key = (action.stage, action.microbatch)
        if action.kind is Kind.FORWARD:
            MONITOR.set_phase("forward")
            self._forward(engine, action, batch, divisor, state)
            for t in sends:
                out = state.outputs[key]
                state.sends.append(
                    self.comm.isend(out.detach().contiguous(), t.peer, message_tag(t, state.m))
                )
            return
        MONITOR.set_phase("backward")
        if action.kind is Kind.WEIGHT_GRAD:
            self._weights(action, state)
            return
        grad = self._incoming(action, "gradient", action.stage + 1, state)
        inp = state.inputs[key]
        if action.kind is Kind.BACKWARD:
            self._backward(engine, action, grad, state)
            input_grad = inp.grad if inp.requires_grad else None
            state.forget(key)
        else:
            input_grad = self._input_grad(engine, action, grad, state)
        if action.stage > 0:
            assert input_grad is not None
            if self.placement[action.stage - 1] == self.comm.rank:  # the turn of a V: handed over here
                state.local[("gradient", action.stage, action.microbatch)] = input_grad
            for t in sends:
                state.sends.append(self.comm.isend(input_grad.contiguous(), t.peer, message_tag(t, state.m)))

    def _incoming(self, action: Action, what: str, producer: int, state: _StepState) -> torch.Tensor | None:
        """The message ``(what, producer, mb)`` this action consumes: received, or handed over locally."""
        key = (what, producer, action.microbatch)
        if key in state.local:
            return state.local.pop(key)
        if key in state.pending:
            buffer, work = state.pending.pop(key)
            work.wait()
            return buffer
        return None

    def _forward(self, engine: Engine, action: Action, batch: Any, divisor: float, state: _StepState) -> None:
        stage = self.split.stages[action.stage]
        key = (action.stage, action.microbatch)
        given = state.given[action.microbatch]
        if stage.first:
            x = given.ids
        else:
            received = self._incoming(action, "activation", action.stage - 1, state)
            assert received is not None, f"no activation for {action}"
            x = received.detach().requires_grad_(True)
        with _autocast(engine):
            out = stage(x, given)
        state.inputs[key] = x
        if stage.last:
            loss = engine.loss(out, batch) / divisor
            state.share += loss.detach().to(torch.float64)
            state.outputs[key] = loss
        else:
            state.outputs[key] = out
            if self.placement[action.stage + 1] == self.comm.rank:
                state.local[("activation", action.stage, action.microbatch)] = out.detach()

    def _backward(self, engine: Engine, action: Action, grad: torch.Tensor | None, state: _StepState) -> None:
        out = state.outputs[(action.stage, action.microbatch)]
        if self.split.stages[action.stage].last:
            engine.backward(out)  # the loss scale applies
        else:
            torch.autograd.backward(out, grad)

    def _seed(
        self, engine: Engine, action: Action, grad: torch.Tensor | None, state: _StepState
    ) -> torch.Tensor:
        """The gradient backward starts from: the received one, or the loss scale on the last stage."""
        if grad is not None:
            return grad
        out = state.outputs[(action.stage, action.microbatch)]
        scale = engine.scaler.scale if engine.scaler.enabled else 1.0
        return torch.full_like(out, scale)

    def _input_grad(
        self, engine: Engine, action: Action, grad: torch.Tensor | None, state: _StepState
    ) -> torch.Tensor | None:
        key = (action.stage, action.microbatch)
        state.seeds[key] = self._seed(engine, action, grad, state)
        inp = state.inputs[key]
        if not inp.requires_grad:  # the first stage: no input gradient, W does all of the backward
            return None
        (input_grad,) = torch.autograd.grad(state.outputs[key], [inp], state.seeds[key], retain_graph=True)
        return input_grad

    def _weights(self, action: Action, state: _StepState) -> None:
        key = (action.stage, action.microbatch)
        weights: list[torch.Tensor] = list(self.split.params[action.stage])
        tied = self.split.tied
        if tied is not None and self.split.stages[action.stage].last and tied.copy.requires_grad:
            weights.append(tied.copy)
        if weights:
            torch.autograd.backward(state.outputs[key], state.seeds[key], inputs=weights)
        state.forget(key)

    # -- evaluation ---------------------------------------------------------------------------------
    def evaluate(self, engine: Engine, batches: Sequence[Any]) -> tuple[float, int]:
        """The summed loss and the items it counts over ``batches``, forward only, stage after stage
        (the same on every pp rank: the last stage's sum is all-reduced over the pp axis)."""
        given = [self.split.inputs(batch) for batch in batches]  # checked before any message
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        items = 0
        self._refresh_tied(engine)  # the update since the step began changed the first stage's weight
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
                x = torch.empty(self._hidden_shape(given), dtype=_dtype(engine), device=engine.device)
                self.comm.recv(x, self.placement[s - 1], s)
            with _autocast(engine), engine.pipeline_stage(self.split.params[s]):
                hidden = stage(x, given)
            if stage.last:
                loss = engine.loss(hidden, batch).detach().to(torch.float64)
            elif self.placement[s + 1] != me:
                sends.append(self.comm.isend(hidden.contiguous(), self.placement[s + 1], s + 1))
        for work in sends:
            work.wait()
        return loss

    # -- the tied weight ----------------------------------------------------------------------------
    def _tie_peer(self) -> int:
        return self.placement[self.last_stage] if self.split.tied_owner is not None else self.placement[0]

    def _refresh_tied(self, engine: Engine) -> None:
        """The first stage's weight to the last stage's copy (they differ after every update)."""
        if (owner := self.split.tied_owner) is not None:
            with engine.pipeline_stage([owner]):  # ZeRO-3: the owner's values gathered first
                self.comm.send(owner.detach().contiguous(), self._tie_peer(), _TIE_TAG)
        elif self.split.tied is not None:
            self.comm.recv(self.split.tied.copy.data, self._tie_peer(), _TIE_TAG)

    def _reduce_tied(self) -> None:
        """The last stage's gradient of the tied weight added to the first stage's, before the dp exchange."""
        owner, tied = self.split.tied_owner, self.split.tied
        if owner is not None and owner.requires_grad:
            incoming = torch.empty_like(owner)
            self.comm.recv(incoming, self._tie_peer(), _TIE_TAG)
            if owner.grad is None:
                owner.grad = incoming
            else:
                owner.grad.add_(incoming)
        elif tied is not None and tied.copy.requires_grad:
            grad = tied.copy.grad if tied.copy.grad is not None else torch.zeros_like(tied.copy)
            self.comm.send(grad.contiguous(), self._tie_peer(), _TIE_TAG)
            tied.copy.grad = None


class _StepState:
    """What one step keeps between actions: inputs and outputs by (stage, mb), messages, the loss."""

    def __init__(
        self,
        pending: dict[tuple[str, int, int], tuple[torch.Tensor, Work]],
        given: list[StageInputs],
        device: torch.device,
    ) -> None:
        self.pending = pending
        self.given = given  # by micro-batch: the token ids and extras every stage reads of it
        self.m = len(given)
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.seeds: dict[tuple[int, int], torch.Tensor] = {}
        self.sends: list[Work] = []
        self.share = torch.zeros((), dtype=torch.float64, device=device)

    def forget(self, key: tuple[int, int]) -> None:
        """Free a stage's activations for a micro-batch once its backward is done."""
        for store in (self.inputs, self.outputs, self.seeds):
            store.pop(key, None)


def _dtype(engine: Engine) -> torch.dtype:
    if engine.autocast_dtype is not None:
        return engine.autocast_dtype
    return next((p.dtype for p in engine.model.parameters()), torch.float32)


def _autocast(engine: Engine) -> Any:
    if engine.autocast_dtype is None:
        return nullcontext()
    return torch.autocast(next(engine.model.parameters()).device.type, dtype=engine.autocast_dtype)
