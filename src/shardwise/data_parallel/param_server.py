"""Parameter server: server ranks hold the parameters and the optimizer, workers compute gradients.

Rank layout: the first K global ranks are servers, the rest workers. Trainable parameters are split over
the servers, balanced by bytes (:func:`assign_to_servers`). Workers never talk to each other; every
exchange is point-to-point through ``Comm`` send/recv (Li et al., "Scaling Distributed Machine Learning
with the Parameter Server", OSDI 2014):

    worker w --push(grad shard s, loss, version)--> server s      one message per server per step
    worker w <--pull(weights of s, version, ...)--- server s      one message per server per step

Synchronous mode: server s receives every worker's shard, sums them in worker order (each worker's loss
is already divided by the GLOBAL token count, so the sum is exactly the gradient of one process on the
global batch), steps its optimizer and sends the new weights back. Asynchronous mode: see
:mod:`shardwise.data_parallel.ps_async`. At the end every server sends its shard to every live rank, so
``full_parameters()`` gives the same, final weights on every rank.

Gradient compression (``comm.compress``): a worker's push goes through the codec layer's point-to-point
form (``compression.CompressedComm.pack``: the gradient shard encoded with error feedback, one state per
server, then the uncompressed header), and the server decodes each worker's push by itself
(``unpack``) before summing them in worker order; a push an asynchronous server refuses is taken back
(``undo``: its residual returns). Replies (server -> worker weights) are not compressed: every worker
must hold exactly the servers' weights.

Message layout: :mod:`shardwise.data_parallel.ps_messages`. Roles: servers serve (``serve``), the first
worker reports, the optimizer runs on the servers (``optimizer_runs``) through the same
``Engine.run_optimizers`` every strategy uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm, CommStats
from shardwise.compression import CodecState, CompressedComm, segments_of
from shardwise.config import ConfigError, PSConfig
from shardwise.data_parallel.ps_async import push_until_accepted, serve_async
from shardwise.data_parallel.ps_messages import (
    KIND_DONE,
    KIND_GRAD,
    PUSH_EXTRA,
    REPLY_EXTRA,
    flatten,
    unflatten_into,
)
from shardwise.data_parallel.ps_state import load_ps_state, ps_state_pieces
from shardwise.engine.base import Engine, NamedTensors, Role, StateReader, grad_sq_sum


def assign_to_servers(sizes: Mapping[str, int], servers: int) -> list[list[str]]:
    """Split parameters over ``servers``, balanced by bytes: largest first, into the lightest server.

    Ties (equal sizes, equal loads) go by the mapping's order and the lowest server index, so every rank
    computes the same assignment. Within a server, names keep the mapping's order.
    """
    if servers < 1:
        raise ConfigError(f"the parameter server needs at least one server, got {servers}")
    order = {name: i for i, name in enumerate(sizes)}
    loads = [0] * servers
    chosen: list[list[str]] = [[] for _ in range(servers)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], order[n])):
        lightest = min(range(servers), key=lambda s: (loads[s], s))
        loads[lightest] += sizes[name]
        chosen[lightest].append(name)
    return [sorted(names, key=order.__getitem__) for names in chosen]


class ParamServerEngine(Engine):
    """Parameter-server training; ``is_server`` ranks call :meth:`serve`, workers step as usual.

    ``steps`` is the number of optimizer steps every worker runs; after its last step a worker takes part
    in the final weight distribution by itself (or call :meth:`finish` to stop early). ``share_gradients``
    (sync only, for verification) makes the servers send the summed gradient back so that
    ``full_gradients()`` works on workers; it costs one more message per server per step.
    """

    name = "ps"

    comm: Comm
    optimizer_runs = "servers"

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        config: PSConfig,
        steps: int,
        share_gradients: bool = False,
        server_comm: Comm | None = None,
        compressor: CompressedComm | None = None,
    ) -> None:
        serves = comm.rank < config.servers
        role = Role(
            steps=not serves, serves=serves, reports=comm.rank == config.servers, reporter=config.servers
        )
        super().__init__(model, role)
        if config.mode not in ("sync", "async"):
            raise ConfigError(f"ps.mode must be sync or async, got {config.mode!r}")
        if comm.world_size - config.servers < 1 or config.servers < 1:
            raise ConfigError(
                f"the parameter server needs at least one server and one worker: {comm.world_size} ranks - "
                f"{config.servers} servers = {comm.world_size - config.servers} workers"
            )
        self.comm, self.config, self.steps = comm, config, steps
        self.server_comm = server_comm  # the servers among themselves (the gradient norm's group)
        self.share_gradients = share_gradients and config.mode == "sync"
        self.servers = list(range(config.servers))
        self.workers = list(range(config.servers, comm.world_size))
        self.is_server = comm.rank < config.servers
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        sizes = {n: p.numel() * p.element_size() for n, p in named.items()}
        self.assignment = assign_to_servers(sizes, config.servers)
        self.shards: list[list[nn.Parameter]] = [[named[n] for n in names] for names in self.assignment]
        self._names = {id(p): n for n, p in named.items()}
        # metrics
        self.version = 0  # server: updates applied; worker: the newest version pulled from any server
        self.server_versions = [0] * config.servers  # worker: the version of each server's weights it holds
        self.last_staleness = 0
        self.max_staleness_seen = 0
        self.staleness: list[int] = []
        self.rejected = 0  # async: pushes refused for staleness (server) / refusals received (worker)
        self.dropped_batches = 0  # async, worker: batches given up after MAX_ATTEMPTS refusals
        self.dead_workers: list[int] = []
        self.loss_history: list[float] = []  # server 0 in sync: the global mean loss per step
        self.last_global_loss = float("nan")
        self.step_comm: list[CommStats] = []  # communication of each step (not the start / end transfers)
        self._step_start = comm.stats.snapshot()
        self._steps_done, self._finished = 0, False
        self._micro: Sequence[Any] = ()
        self._global_tokens, self._local_tokens, self._loss_share = 1.0, 0, 0.0
        self._replies: list[torch.Tensor] = []
        self.compressor = compressor
        # a worker's error feedback, one state per server's shard (pushes go to each server)
        self._push_states: list[CodecState] = (
            [self._new_push_state(s) for s in self.servers] if compressor and not self.is_server else []
        )
        # a server decodes pushes laid out as the parameters it serves (no state of its own changes)
        self._serve_state = self._new_push_state(comm.rank) if compressor and self.is_server else None
        self._distribute_initial()

    @property
    def own(self) -> list[nn.Parameter]:
        """The parameters this rank serves (empty on workers)."""
        return self.shards[self.comm.rank] if self.is_server else []

    # -- worker side --------------------------------------------------------------------------------
    def forward_backward(self, micro_batches: Sequence[Any], global_count: float) -> float:
        self._require_worker()
        self._step_start = self.comm.stats.snapshot()
        self._micro, self._global_tokens = micro_batches, global_count
        self._loss_share = self._backward_all()
        self.finish_grads()
        return self._loss_share

    def _backward_all(self) -> float:
        self._local_tokens = sum(self.loss.count(batch) for batch in self._micro)
        share = 0.0
        for batch in self._micro:
            loss = self.compute_loss(batch) / self._global_tokens
            self.backward(loss)
            share += float(loss.detach())
        return share

    def finish_grads(self) -> None:
        self._require_worker()
        if self.config.mode == "sync":
            for s in self.servers:
                self.comm.send(self._push_message(s, scale=1.0), s)
            if self.share_gradients:
                for s in self.servers:
                    self._recv_gradients(s)
        else:
            push_until_accepted(self)

    # -- the update: on the servers (workers pull the result in after_update) -----------------------
    def optimizer_units(self) -> list[NamedTensors]:
        # a server left without parameters (more servers than tensors) only counts versions
        return [[(self._names[id(p)], p) for p in self.own]] if self.own else []

    def grad_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        """On a server, between receiving the summed gradient and stepping: its parameters' share."""
        if not self.is_server:
            raise RuntimeError("the parameter server's gradient norm is taken on the servers, not workers")
        if len(self.servers) > 1 and self.server_comm is None:
            raise RuntimeError("with several parameter servers, build the engine with server_comm")
        return grad_sq_sum(self.own), self.server_comm

    def after_update(self) -> None:
        self._require_worker()
        if self.config.mode == "sync":
            self._replies = []
            for s in self.servers:
                reply = self._reply_buffer(s)
                self.comm.recv(reply, s)
                self._replies.append(reply)
        for s, reply in zip(self.servers, self._replies, strict=True):
            self.load_reply(s, reply)
        self.last_global_loss = float(self._replies[0][-1]) if self._replies else float("nan")
        self.model.zero_grad(set_to_none=True)
        self.step_comm.append(self.comm.stats.since(self._step_start))
        self._steps_done += 1
        if self._steps_done >= self.steps:
            self.finish()

    def _push_message(self, s: int, scale: float) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.shards[s]]
        if self.compressor is not None:
            flat = flatten(grads, 0) * scale
            header = [self._loss_share * scale, self.server_versions[s], KIND_GRAD]
            return self._packed(flat, header, self._push_states[s], feedback=True)
        message = flatten(grads, PUSH_EXTRA)
        if scale != 1.0:
            message.mul_(scale)
        message[-3:] = torch.tensor(
            [self._loss_share * scale, self.server_versions[s], KIND_GRAD], dtype=message.dtype
        )
        return message

    # -- compressed pushes: [codec message (uint8), header (PUSH_EXTRA values, as bytes)] --------------
    def _new_push_state(self, s: int) -> CodecState:
        assert self.compressor is not None
        shapes = [tuple(p.shape) for p in self.shards[s]]
        numel = sum(p.numel() for p in self.shards[s])
        return self.compressor.new_state(numel, self._dtype(), segments_of(shapes))

    def _packed(
        self, flat: torch.Tensor, header: list[float], state: CodecState, feedback: bool
    ) -> torch.Tensor:
        assert self.compressor is not None
        values = torch.tensor(header, dtype=self._dtype())
        return torch.cat([self.compressor.pack(flat, state, feedback), values.view(torch.uint8)])

    def push_buffer(self) -> torch.Tensor:
        """Where a server receives one push for the parameters it serves."""
        n_own = sum(p.numel() for p in self.own)
        if self.compressor is None or self._serve_state is None:
            return torch.zeros(n_own + PUSH_EXTRA, dtype=self._dtype())
        header = PUSH_EXTRA * torch.empty(0, dtype=self._dtype()).element_size()
        return torch.zeros(self.compressor.packed_bytes(self._serve_state) + header, dtype=torch.uint8)

    def decode_push(self, buf: torch.Tensor) -> torch.Tensor:
        """A received push as ``[gradient..., loss, version, kind]`` in the parameters' dtype."""
        if self.compressor is None or self._serve_state is None:
            return buf
        dtype = self._dtype()
        header_bytes = PUSH_EXTRA * torch.empty(0, dtype=dtype).element_size()
        data, header = buf[: buf.numel() - header_bytes], buf[buf.numel() - header_bytes :].clone()
        return torch.cat([self.compressor.unpack(data, self._serve_state), header.view(dtype)])

    def _reply_buffer(self, s: int) -> torch.Tensor:
        numel = sum(p.numel() for p in self.shards[s])
        return torch.zeros(numel + REPLY_EXTRA, dtype=self._dtype())

    def load_reply(self, s: int, reply: torch.Tensor) -> None:
        """Take server ``s``'s weights and header into this worker's model."""
        with torch.no_grad():
            unflatten_into(reply, self.shards[s])
        staleness = int(reply[-3])
        if self._push_states and reply[-2] == 0:  # refused: what that push sent was never applied
            self.compressor.undo(self._push_states[s])  # type: ignore[union-attr]
        self.server_versions[s] = int(reply[-4])
        if s == 0:  # every server holds the global norm (sync); the first one's is reported
            self.last_grad_norm = float(reply[-5])
        self.version = max(self.server_versions)
        self.last_staleness = staleness if s == 0 else max(self.last_staleness, staleness)
        self.max_staleness_seen = max(self.max_staleness_seen, staleness)

    def _recv_gradients(self, s: int) -> None:
        buf = torch.zeros(sum(p.numel() for p in self.shards[s]), dtype=self._dtype())
        self.comm.recv(buf, s)
        grads = [torch.empty_like(p) for p in self.shards[s]]
        unflatten_into(buf, grads)
        for p, grad in zip(self.shards[s], grads, strict=True):
            p.grad = grad

    def finish(self) -> None:
        """Tell the servers this worker is done (async) and receive the final weights. Idempotent."""
        if self._finished or self.is_server:
            return
        self._finished = True
        if self.config.mode == "async":
            for s in self.servers:
                numel = sum(p.numel() for p in self.shards[s])
                if self.compressor is not None:
                    zeros = torch.zeros(numel, dtype=self._dtype())
                    done = self._packed(zeros, [0.0, 0.0, KIND_DONE], self._push_states[s], feedback=False)
                else:
                    done = torch.zeros(numel + PUSH_EXTRA, dtype=self._dtype())
                    done[-1] = KIND_DONE
                self.comm.send(done, s)
        self._distribute_final(dead=())

    def _require_worker(self) -> None:
        if self.is_server:
            raise RuntimeError(f"rank {self.comm.rank} is a parameter server: call serve(), not the step")

    def _dtype(self) -> torch.dtype:
        return next(iter(self.model.parameters())).dtype

    # -- server side --------------------------------------------------------------------------------
    def serve(self, after_step: Callable[[int], None] | None = None) -> None:
        """Run this server until the workers are done, then share the final weights with every rank.

        Sync mode: ``after_step(done)`` runs after each served step (``done`` steps complete), at the
        points where the workers' loop runs its own (the last one after the final weights are shared,
        since a worker receives them within its last step); checkpoints are saved there.
        """
        if not self.is_server:
            raise RuntimeError(f"rank {self.comm.rank} is a worker: it steps, it does not serve")
        if self.config.mode == "sync":
            for done in range(self._steps_done + 1, self.steps + 1):
                self._serve_sync_step()
                self._steps_done = done
                if after_step is not None and done < self.steps:
                    after_step(done)
            dead: Sequence[int] = ()
        else:
            dead = serve_async(self)
        self.dead_workers = sorted(dead)
        self._finished = True
        self._distribute_final(dead)
        if after_step is not None and self.config.mode == "sync" and self.steps > 0:
            after_step(self.steps)

    def _serve_sync_step(self) -> None:
        start = self.comm.stats.snapshot()
        n_own = sum(p.numel() for p in self.own)
        total: torch.Tensor | None = None
        for w in self.workers:
            buf = self.push_buffer()
            self.comm.recv(buf, w)
            buf = self.decode_push(buf)
            if buf[-1] != KIND_GRAD:
                raise RuntimeError(f"worker {w} stopped before step {self.version + 1} in synchronous mode")
            total = buf if total is None else total.add_(buf)
        assert total is not None
        if self.share_gradients:
            for w in self.workers:
                self.comm.send(total[:n_own].clone(), w)
        loss_total = float(total[-3])
        self.loss_history.append(loss_total)
        self.apply_gradient(total)
        reply = self.reply_message(staleness=0, accepted=True, loss_total=loss_total)
        for w in self.workers:
            self.comm.send(reply, w)
        self.step_comm.append(self.comm.stats.since(start))

    def apply_gradient(self, flat: torch.Tensor, lr_scale: float = 1.0) -> None:
        """Set the served parameters' gradients from ``flat`` and step the optimizer at lr x lr_scale."""
        grads = [torch.empty_like(p) for p in self.own]
        unflatten_into(flat, grads)
        for p, grad in zip(self.own, grads, strict=True):
            p.grad = grad
        if self.config.mode == "sync":  # async: each server steps on its own; no norm across servers
            self.clip_gradients()
        self.run_optimizers(lr_scale)
        for p in self.own:
            p.grad = None
        self.version += 1

    def reply_message(self, staleness: int, accepted: bool, loss_total: float = 0.0) -> torch.Tensor:
        message = flatten(list(self.own), REPLY_EXTRA)
        header = [self.last_grad_norm, self.version, staleness, float(accepted), loss_total]
        message[-REPLY_EXTRA:] = torch.tensor(header, dtype=message.dtype)
        return message

    # -- weights at the start and at the end ------------------------------------------------------------
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

    # -- checkpoints (see shardwise.data_parallel.ps_state) ----------------------------------------------
    def state_pieces(self, rank: int, world_size: int) -> list[Piece]:
        return ps_state_pieces(self)

    def load_state(self, read: StateReader) -> None:
        load_ps_state(self, read)

    def resume_at(self, step: int) -> None:
        """Continue after ``step`` completed steps (a checkpoint was loaded): serve / run the rest."""
        self._steps_done = step
        self.version = step if self.config.mode == "sync" else self.version
        self.server_versions = [self.version] * len(self.servers)

    # -- inspection ---------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {
            "version": self.version,
            "staleness": self.last_staleness,
            "max_staleness_seen": self.max_staleness_seen,
            "rejected_pushes": self.rejected,
            "dropped_batches": self.dropped_batches,
        }

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        if self.is_server or not self.share_gradients:
            raise RuntimeError(
                "the global gradient lives on the servers: build the engine with share_gradients=True "
                "(sync mode) and ask a worker"
            )
        return {
            n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }
