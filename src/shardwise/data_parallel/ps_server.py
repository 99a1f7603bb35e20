"""The parameter server's server side: serving a synchronous step, the checks on a push, the update
and the reply, and the weights every rank starts and ends from. ``ParamServerEngine``
(``param_server.py``) is this class with the worker's side, checkpoints and metrics; the asynchronous
loop is :mod:`shardwise.data_parallel.ps_async`.

Communication: with the workers point-to-point through ``Comm`` (send/recv, on the host over gloo);
among several servers, all-reduces over ``server_comm`` (or, built without one, a min through server
0). A synchronous step: server s receives one push from every worker (in worker order), optionally
sends each the summed gradient back (``share_gradients``), agrees with the other servers on the
step's finiteness (an all-reduce of two integers), sums its share of the gradient norm with theirs
(``clip_gradients``: an all-reduce of one float64) and sends every worker one reply (its weights and
header). Asynchronous: after the loop the servers agree on whether any stopped the run (an
all-reduce, max). At the start each server sends its shard to every worker; at the end to every
other live rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from shardwise.collectives.api import Comm, CommStats
from shardwise.config import PSConfig
from shardwise.data_parallel.ps_async import serve_async
from shardwise.data_parallel.ps_codec import SYNC, PSCodec
from shardwise.data_parallel.ps_messages import (
    FINITE,
    KIND_GRAD,
    REPLY_EXTRA,
    SKIPPED,
    STOPPED,
    flatten,
    push_numel,
    unflatten_into,
    used_flags,
)
from shardwise.device import HOST
from shardwise.engine.base import Engine
from shardwise.engine.nonfinite import NonFinite, NonFiniteStop, describe_nonfinite, first_nonfinite

if TYPE_CHECKING:
    from shardwise.data_parallel.param_server import ParamServerEngine


class ServerSide(Engine):
    """What a parameter server does (``ParamServerEngine`` sets these attributes up; see its doc)."""

    comm: Comm
    config: PSConfig
    server_comm: Comm | None  # the servers among themselves (the gradient norm's group)
    servers: list[int]
    workers: list[int]
    is_server: bool
    steps: int
    on_nonfinite: str
    share_gradients: bool
    shards: list[list[nn.Parameter]]  # server -> the parameters it serves
    trainable_names: list[str]  # a parameter's index here names it in replies
    _names: dict[int, str]  # id(parameter) -> its name
    codec: PSCodec | None
    version: int
    nonfinite_updates: int
    loss_history: list[float]
    step_comm: list[CommStats]
    dead_workers: list[int]
    _found: NonFinite | None
    _steps_done: int
    _finished: bool

    @property
    def own(self) -> list[nn.Parameter]:
        """The parameters this rank serves (empty on workers)."""
        return self.shards[self.comm.rank] if self.is_server else []

    # -- serving --------------------------------------------------------------------------------
    def serve(self, after_step: Callable[[int], None] | None = None) -> None:
        """Run this server until the workers are done, then share the final weights with every rank.

        Sync mode: ``after_step(done)`` runs after each served step (``done`` steps complete), at the
        points where the workers' loop runs its own (the last one after the final weights are shared,
        since a worker receives them within its last step); checkpoints are saved there.
        """
        if not self.is_server:
            raise RuntimeError(f"rank {self.comm.rank} is a worker: it steps, it does not serve")
        first = self._steps_done  # resumed: steps already done; == steps when nothing is left to serve
        if self.config.mode == "sync":
            for done in range(first + 1, self.steps + 1):
                found = self._serve_sync_step()
                self._steps_done = done
                if found is not None and found.stop:
                    raise NonFiniteStop(done - 1, found)  # the workers stop on this step's replies
                if after_step is not None and done < self.steps:
                    after_step(done)
            dead: Sequence[int] = ()
        else:
            dead = serve_async(cast("ParamServerEngine", self), after_step)
        self.dead_workers = sorted(dead)
        self._finished = True
        stop = self._agreed_stop() if self.config.mode == "async" else None
        self._distribute_final(dead)
        if stop is not None:
            raise NonFiniteStop(self._steps_done, stop)  # after the final weights the workers wait for
        if after_step is not None and first < self.steps:  # a complete run saved its last step already
            after_step(self.steps)

    def _serve_sync_step(self) -> NonFinite | None:
        """Sum the workers' pushes, apply the sum unless it is not finite, reply; return the verdict."""
        start = self.comm.stats.snapshot()
        n_own = sum(p.numel() for p in self.own)
        total: torch.Tensor | None = None
        for w in self.workers:
            buf = self.recv_push(w)
            if buf[-1] != KIND_GRAD:
                raise RuntimeError(f"worker {w} stopped before step {self.version + 1} in synchronous mode")
            total = buf if total is None else total.add_(buf)
        assert total is not None
        if self.share_gradients:
            for w in self.workers:
                self.comm.send(total[:n_own].clone(), w)
        loss_total = float(total[-3])
        self.loss_history.append(loss_total)
        loss_ok, first = self._agree_among_servers(*self.check_push(total, loss_total))
        status = self._status(loss_ok, first)
        if status == FINITE:
            self.apply_gradient(total)
        else:
            self.version += 1  # a served step all the same (sync versions count steps)
            self.nonfinite_updates += 1
        reply = self.wire_reply(SYNC, self.reply_message(0, True, loss_total, status, first))
        for w in self.workers:  # one message for all: they pull in lock-step
            self.comm.send(reply, w)
        self.step_comm.append(self.comm.stats.since(start))
        if status == FINITE:
            return None
        name = self.trainable_names[first] if first < len(self.trainable_names) else None
        return NonFinite(describe_nonfinite(loss_ok, name), stop=status == STOPPED)

    def push_buffer(self) -> torch.Tensor:
        """Where one push to this server is received (its size never changes)."""
        if self.codec is None:
            return torch.zeros(push_numel(self.own), dtype=self._dtype(), device=HOST)
        return torch.zeros(self.codec.push_bytes(self.comm.rank), dtype=torch.uint8, device=HOST)

    def decode_push(self, worker: int, received: torch.Tensor) -> torch.Tensor:
        """A received push as the dense ``[grads..., used..., loss, version, kind]``."""
        if self.codec is None:
            return received
        return self.codec.decode_push(worker, self.comm.rank, received)

    def recv_push(self, worker: int) -> torch.Tensor:
        buf = self.push_buffer()
        self.comm.recv(buf, worker)
        return self.decode_push(worker, buf)

    def wire_reply(self, key: int, reply: torch.Tensor) -> torch.Tensor:
        """A dense reply as it travels to ``key`` (a worker; SYNC: every worker, the same message)."""
        return self.codec.encode_reply(key, reply, self.comm.rank) if self.codec is not None else reply

    def check_push(self, flat: torch.Tensor, loss: float) -> tuple[bool, int]:
        """Whether ``loss`` is finite, and the index (trainable order) of the first served parameter
        whose gradient in ``flat`` is not (``len(trainable_names)``: none)."""
        views, offset = [], 0
        for p in self.own:
            views.append((self._names[id(p)], flat[offset : offset + p.numel()]))
            offset += p.numel()
        bad = first_nonfinite(views)  # read once, not once per parameter
        first = len(self.trainable_names) if bad is None else self.trainable_names.index(bad)
        return math.isfinite(loss), first

    def _status(self, loss_ok: bool, first: int) -> int:
        if loss_ok and first == len(self.trainable_names):
            return FINITE
        return STOPPED if self.on_nonfinite == "stop" else SKIPPED

    def _agree_among_servers(self, loss_ok: bool, first: int) -> tuple[bool, int]:
        """Sync: one verdict for all servers (each sees only its parameters): a min over them."""
        if len(self.servers) == 1:
            return loss_ok, first
        flags = torch.tensor([int(loss_ok), first], dtype=torch.int64, device=HOST)
        if self.server_comm is not None:
            self.server_comm.all_reduce(flags, "min")
        else:  # built without the servers' group (unit tests): through server 0
            self._min_through_server0(flags)
        return bool(flags[0]), int(flags[1])

    def _min_through_server0(self, flags: torch.Tensor) -> None:
        if self.comm.rank != self.servers[0]:
            self.comm.send(flags, self.servers[0])
            self.comm.recv(flags, self.servers[0])
            return
        other = torch.empty_like(flags)
        for s in self.servers[1:]:
            self.comm.recv(other, s)
            torch.minimum(flags, other, out=flags)
        for s in self.servers[1:]:
            self.comm.send(flags, s)

    def _agreed_stop(self) -> NonFinite | None:
        """Async, after the loop: whether any server stopped the run (each saw only its own pushes)."""
        stopped = torch.tensor([int(self._found is not None)], dtype=torch.int64, device=HOST)
        if len(self.servers) > 1:
            if self.server_comm is not None:
                self.server_comm.all_reduce(stopped, "max")
            else:
                stopped.neg_()  # a max is a min of negatives
                self._min_through_server0(stopped)
                stopped.neg_()
        if not int(stopped.item()):
            return None
        return self._found or NonFinite("a loss or gradient another server received", stop=True)

    def apply_gradient(self, flat: torch.Tensor, lr_scale: float = 1.0) -> None:
        """Set the served parameters' gradients from a push (or a sum of pushes) ``flat`` and step the
        optimizer at lr x lr_scale; a parameter no push used keeps ``grad = None``: the optimizer skips it."""
        grads = [torch.empty_like(p) for p in self.own]
        unflatten_into(flat, grads)
        for p, grad, used in zip(self.own, grads, used_flags(flat, self.own), strict=True):
            p.grad = grad if used else None
        # async: each server steps on its own, no norm across servers; sync: every server sums its
        # share of the norm with the others (needs server_comm when there are several)
        if self.config.mode == "sync" and (len(self.servers) == 1 or self.server_comm is not None):
            self.clip_gradients()
        elif 0 < self.clip_grad_norm < float("inf"):
            raise RuntimeError("clipping with several parameter servers needs the engine's server_comm")
        self.run_optimizers(lr_scale)
        for p in self.own:
            p.grad = None
        self.version += 1

    def reply_message(
        self, staleness: int, accepted: bool, loss_total: float = 0.0, status: int = FINITE, bad: int = -1
    ) -> torch.Tensor:
        """This server's weights and header; ``bad`` (a parameter index) only counts with a status."""
        message = flatten(list(self.own), REPLY_EXTRA)
        bad = bad if status != FINITE and bad < len(self.trainable_names) else -1
        header = [self.last_grad_norm, status, bad, self.version, staleness, float(accepted), loss_total]
        message[-REPLY_EXTRA:] = torch.tensor(header, dtype=message.dtype, device=HOST)
        return message

    # -- weights at the start and at the end ------------------------------------------------------------
    def _start_codec(self) -> None:
        """Worker copies equal the servers' weights (the start, a resume): pulls restart from them."""
        if self.codec is None:
            return
        if self.is_server:
            keys = [SYNC] if self.config.mode == "sync" else self.workers
            self.codec.start_pulls(self.comm.rank, keys)
        else:
            self.codec.hold_pulled()

    def _distribute_initial(self) -> None:
        """Servers send their shard to every worker, so all start from the servers' weights."""
        for s in self.servers:
            flat = flatten(list(self.shards[s]), 0) if self.shards[s] else None
            if flat is None:
                continue
            if self.comm.rank == s:
                for w in self.workers:
                    self.comm.send(flat, w)
            elif not self.is_server:
                self.comm.recv(flat, s)
                with torch.no_grad():
                    unflatten_into(flat, self.shards[s])

    def _distribute_final(self, dead: Sequence[int]) -> None:
        """Every server sends its shard to every other live rank, one server after the other."""
        for s in self.servers:
            if not self.shards[s]:
                continue
            flat = flatten(list(self.shards[s]), 0)
            if self.comm.rank == s:
                for r in range(self.comm.world_size):
                    if r != s and r not in dead:
                        self.comm.send(flat, r)
            else:
                self.comm.recv(flat, s)
                with torch.no_grad():
                    unflatten_into(flat, self.shards[s])

    def _dtype(self) -> torch.dtype:
        return next(iter(self.model.parameters())).dtype
