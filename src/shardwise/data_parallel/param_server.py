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

Non-finite values: a server checks the loss and the gradient it is about to apply (sync: the sum, so
with several servers they agree through one all-reduce of two integers over the servers each step;
async: each push). A non-finite one is never applied; the reply says so (skipped, or the run stops)
and names the first parameter, and the workers' per-step metrics all-gather spreads the verdict, so
every worker skips or stops in the same step. Under ``stop`` the servers end their loop too (sync: at
once; async: once every worker has said it is done).

Checkpoints: sync servers save after each served step, where the workers save. Async servers have no
common step, so at a checkpoint step each worker, at its step boundary, sends every server a pause
message (``before_checkpoint``) and joins the save; a server takes part in the save once every live
worker has paused (the pauses queue behind the pushes before them, so nothing is lost). Each server
saves its parameters, their optimizer state and its version (``ps/version``); on resume, the servers
load theirs and send every worker their weights and version (``resume_at``).

Compression (``comm.compress``): pushes and pulls go through the codec layer, each message a codec
message with its header beside it; the start, the end and a resume stay uncompressed. See
:mod:`shardwise.data_parallel.ps_codec`: error feedback per worker and server shard for pushes, and
for pulls the update since the last message to that worker (per worker async, per shard sync).

Devices: the traffic stays on the host, over gloo, explicitly. Messages are host tensors (``HOST``): a
worker on a GPU packs its gradients there once per push and unpacks each reply into its parameters; a
server keeps the parameters it serves, and their optimizer, in host memory (``serve_on_host``) and
steps them there. Every send and receive is then a CPU tensor, which a ``cpu:gloo,cuda:nccl`` group
sends over gloo: NCCL has no tags and no any-source receive, and the servers wait on many workers.

Message layout: :mod:`shardwise.data_parallel.ps_messages`. Roles: servers serve (``serve``: the
server's side is :mod:`shardwise.data_parallel.ps_server`, which this engine extends), the first
worker reports, the optimizer runs on the servers (``optimizer_runs``) through the same
``Engine.run_optimizers`` every strategy uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm, CommStats
from shardwise.compression import CompressedComm
from shardwise.config import ConfigError, PSConfig
from shardwise.data_parallel.ps_async import push_until_accepted
from shardwise.data_parallel.ps_codec import PSCodec
from shardwise.data_parallel.ps_messages import (
    FINITE,
    KIND_DONE,
    KIND_GRAD,
    KIND_PAUSE,
    REPLY_EXTRA,
    STOPPED,
    pack_push,
    push_numel,
    unflatten_into,
)
from shardwise.data_parallel.ps_server import ServerSide
from shardwise.data_parallel.ps_state import load_ps_state, ps_state_pieces
from shardwise.device import HOST
from shardwise.engine.base import Role
from shardwise.engine.nonfinite import NonFinite, describe_nonfinite
from shardwise.engine.state import StateReader
from shardwise.engine.step import run_passes
from shardwise.engine.update import NamedTensors, grad_sq_sum


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


class ParamServerEngine(ServerSide):
    """Parameter-server training; ``is_server`` ranks call :meth:`serve`, workers step as usual.

    ``steps`` is the number of optimizer steps every worker runs; after its last step a worker takes part
    in the final weight distribution by itself (or call :meth:`finish` to stop early). ``share_gradients``
    (sync only, for verification) makes the servers send the summed gradient back so that
    ``full_gradients()`` works on workers; it costs one more message per server per step.
    ``on_nonfinite``: what a non-finite loss or gradient does, ``"stop"`` the run or ``"skip"`` the update.
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
        on_nonfinite: str = "stop",
        compressor: CompressedComm | None = None,
    ) -> None:
        serves = comm.rank < config.servers
        role = Role(
            steps=not serves, serves=serves, reports=comm.rank == config.servers, reporter=config.servers
        )
        if serves:  # a server steps on the host, beside its messages (the module docstring)
            model.to(HOST)
        super().__init__(model, role)
        if config.mode not in ("sync", "async"):
            raise ConfigError(f"ps.mode must be sync or async, got {config.mode!r}")
        if comm.world_size - config.servers < 1 or config.servers < 1:
            raise ConfigError(
                f"the parameter server needs at least one server and one worker: {comm.world_size} ranks - "
                f"{config.servers} servers = {comm.world_size - config.servers} workers"
            )
        self.comm, self.config, self.steps, self.on_nonfinite = comm, config, steps, on_nonfinite
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
        self.trainable_names = list(named)  # a parameter's index here names it in replies
        # metrics
        self.version = 0  # server: updates applied; worker: the newest version pulled from any server
        self.server_versions = [0] * config.servers  # worker: the version of each server's weights it holds
        self.last_staleness = 0
        self.max_staleness_seen = 0
        self.staleness: list[int] = []
        self.rejected = 0  # async: pushes refused for staleness (server) / refusals received (worker)
        self.dropped_batches = 0  # async, worker: batches given up after MAX_ATTEMPTS refusals
        self.dead_workers: list[int] = []
        self.nonfinite_updates = 0  # server: gradients not applied because a value was not finite
        self._found: NonFinite | None = None  # worker: this step's verdict; server: a stop it found
        self.loss_history: list[float] = []  # server 0 in sync: the global mean loss per step
        self.last_global_loss = float("nan")
        self.step_comm: list[CommStats] = []  # communication of each step (not the start / end transfers)
        self._step_start = comm.stats.snapshot()
        self._steps_done, self._finished = 0, False
        self._micro: Sequence[Any] = ()
        self._global_tokens, self._local_tokens, self._loss_share = 1.0, 0.0, 0.0
        self._replies: list[torch.Tensor] = []
        self._loss_sum: torch.Tensor | None = None  # this step's loss share where it was computed
        # comm.compress: pushes and pulls through the codec layer (see ps_codec); None: dense messages
        self.codec = PSCodec(compressor, self.shards, self._dtype()) if compressor is not None else None
        self._distribute_initial()
        self._start_codec()

    # -- worker side --------------------------------------------------------------------------------
    def begin_step(self, micro_batches: Sequence[Any], global_count: float) -> float:
        self._require_worker()
        self._step_start = self.comm.stats.snapshot()
        self._micro, self._global_tokens = micro_batches, global_count
        self._local_tokens = self.local_count  # counted on the host before the batches moved
        self._loss_share = 0.0
        self._loss_sum = None
        return global_count

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        # the push carries it (a recomputed batch: anew); summed where it is, read once at the push
        detached = loss.detach().to(torch.float64)
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached

    def _read_loss(self) -> float:
        """This step's summed loss share, read on the host once (the push needs it)."""
        if self._loss_sum is not None:
            self._loss_share, self._loss_sum = float(self._loss_sum), None
        return self._loss_share

    def loss_share(self, share: float) -> float:
        """The loss of the batch the servers took (an asynchronous push refused and recomputed: the
        recomputed one)."""
        return self._read_loss()

    def recompute(self) -> None:
        """Forward and backward of this step's micro-batches again, on the weights just pulled
        (an asynchronous push the servers refused as too stale)."""
        self.model.zero_grad(set_to_none=True)
        self._loss_share, self._loss_sum = 0.0, None
        run_passes(self, self._micro, self._global_tokens)

    def exchange_grads(self) -> None:
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

    def held_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        """On a server, between receiving the summed gradient and stepping: its parameters' share."""
        if not self.is_server:
            raise RuntimeError("the parameter server's gradient norm is taken on the servers, not workers")
        if len(self.servers) > 1 and self.server_comm is None:
            raise RuntimeError("with several parameter servers, build the engine with server_comm")
        return grad_sq_sum(self.own, self.device), self.server_comm

    def after_update(self) -> None:
        self._require_worker()
        if self.config.mode == "sync":
            self._replies = [self.recv_reply(s) for s in self.servers]
        for s, reply in zip(self.servers, self._replies, strict=True):
            self.load_reply(s, reply)
        self.last_global_loss = float(self._replies[0][-1]) if self._replies else float("nan")
        self._found = self._verdict(self._replies)
        if self._found is not None and self._found.stop and self.config.mode == "sync":
            self._finished = True  # the servers stopped with this step: no final weights come
        self.model.zero_grad(set_to_none=True)
        self.step_comm.append(self.comm.stats.since(self._step_start))
        self._steps_done += 1
        if self._steps_done >= self.steps:
            self.finish()

    def _verdict(self, replies: Sequence[torch.Tensor]) -> NonFinite | None:
        """What the servers found not finite in this step's push (the gravest of their replies)."""
        status = max((int(r[-6]) for r in replies), default=FINITE)
        if status == FINITE:
            return None
        bad = [int(r[-5]) for r in replies if int(r[-5]) >= 0]
        name = self.trainable_names[min(bad)] if bad else None
        loss_ok = math.isfinite(float(replies[0][-1]))
        return NonFinite(describe_nonfinite(loss_ok, name), stop=status == STOPPED)

    def servers_nonfinite(self) -> NonFinite | None:
        return self._found

    def _push_message(self, s: int, scale: float) -> torch.Tensor:
        """This step's push to server ``s``, as it travels (through the codec with comm.compress)."""
        message = pack_push(self.shards[s], self._dtype())
        if scale != 1.0:
            message.mul_(scale)  # the used flags stay non-zero exactly where they were
        message[-3:] = torch.tensor(
            [self._read_loss() * scale, self.server_versions[s], KIND_GRAD], dtype=message.dtype, device=HOST
        )
        return self._wire_push(s, message)

    def _wire_push(self, s: int, dense: torch.Tensor) -> torch.Tensor:
        return self.codec.encode_push(s, dense) if self.codec is not None else dense

    def _notice(self, s: int, kind: float, done: int = 0) -> torch.Tensor:
        """A push without a gradient (done, pause) to server ``s``, as it travels."""
        notice = torch.zeros(push_numel(self.shards[s]), dtype=self._dtype(), device=HOST)
        notice[-2:] = torch.tensor([done, kind], dtype=notice.dtype, device=HOST)
        return self._wire_push(s, notice)

    def undo_push(self, s: int) -> None:
        """Server ``s`` refused this worker's last push (async): take back its error feedback."""
        if self.codec is not None:
            self.codec.undo_push(s)

    def recv_reply(self, s: int) -> torch.Tensor:
        """Receive server ``s``'s reply; returned dense (``[weights..., header]``) whatever travelled."""
        if self.codec is None:
            numel = sum(p.numel() for p in self.shards[s]) + REPLY_EXTRA
            reply = torch.zeros(numel, dtype=self._dtype(), device=HOST)
            self.comm.recv(reply, s)
            return reply
        wire = torch.zeros(self.codec.reply_bytes(s), dtype=torch.uint8, device=HOST)
        self.comm.recv(wire, s)
        return self.codec.decode_reply(s, wire)

    def load_reply(self, s: int, reply: torch.Tensor) -> None:
        """Take server ``s``'s weights and header into this worker's model."""
        with torch.no_grad():
            unflatten_into(reply, self.shards[s])
        staleness = int(reply[-3])
        self.server_versions[s] = int(reply[-4])
        if s == 0:  # every server holds the global norm (sync); the first one's is reported
            self.last_grad_norm = float(reply[-7])
        self.version = max(self.server_versions)
        self.last_staleness = staleness if s == 0 else max(self.last_staleness, staleness)
        self.max_staleness_seen = max(self.max_staleness_seen, staleness)

    def _recv_gradients(self, s: int) -> None:
        buf = torch.zeros(sum(p.numel() for p in self.shards[s]), dtype=self._dtype(), device=HOST)
        self.comm.recv(buf, s)
        grads = [torch.empty_like(p) for p in self.shards[s]]
        unflatten_into(buf, grads)
        for p, grad in zip(self.shards[s], grads, strict=True):
            p.grad = grad

    def before_checkpoint(self, done: int) -> None:
        """Async: pause at this step boundary; the servers save with the workers once all have paused."""
        if self.config.mode != "async" or self.is_server or self._finished:
            return  # sync servers are in step already; after the last step the final save follows
        for s in self.servers:
            self.comm.send(self._notice(s, KIND_PAUSE, done), s)

    def finish(self) -> None:
        """Tell the servers this worker is done (async) and receive the final weights. Idempotent."""
        if self._finished or self.is_server:
            return
        self._finished = True
        if self.config.mode == "async":
            for s in self.servers:
                self.comm.send(self._notice(s, KIND_DONE), s)
        self._distribute_final(dead=())

    def _require_worker(self) -> None:
        if self.is_server:
            raise RuntimeError(f"rank {self.comm.rank} is a parameter server: call serve(), not the step")

    # -- checkpoints (see shardwise.data_parallel.ps_state) ----------------------------------------------
    def held_pieces(self, rank: int, world_size: int) -> list[Piece]:
        return ps_state_pieces(self)

    def load_held(self, read: StateReader) -> None:
        load_ps_state(self, read)

    def resume_at(self, step: int) -> None:
        """Continue after ``step`` completed steps (a checkpoint was loaded): serve / run the rest.

        Sync: versions count steps. Async: each server keeps the version it saved, and sends every
        worker its weights and version (the workers pull), so their first pushes are not stale.
        """
        self._steps_done = step
        self._start_codec()  # every rank has read the servers' weights
        if self.config.mode == "sync":
            self.version = step
            self.server_versions = [step] * len(self.servers)
            return
        for s in self.servers:
            if self.comm.rank == s:
                reply = self.reply_message(0, True)
                for w in self.workers:
                    self.comm.send(self.wire_reply(w, reply), w)
            elif not self.is_server:
                self.load_reply(s, self.recv_reply(s))

    # -- inspection ---------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {
            "version": self.version,
            "staleness": self.last_staleness,
            "max_staleness_seen": self.max_staleness_seen,
            "rejected_pushes": self.rejected,
            "dropped_batches": self.dropped_batches,
        }

    def held_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def held_gradients(self) -> dict[str, torch.Tensor]:
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
