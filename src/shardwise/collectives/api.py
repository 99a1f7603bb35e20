"""The one communication layer: every strategy in shardwise talks through a ``Comm``.

A ``Comm`` wraps one process group. Each call either goes to the backend's own collective
("native", gloo on CPU, nccl on GPU) or to one of our explicit algorithms built on send/recv
(ring, tree, recursive halving-doubling, naive through a root). The layer counts the bytes each
rank sends and receives and the time it spends blocked, which is what the metrics and benchmarks
report. For native calls the bytes are those of the ring algorithm the backends use for large
messages (an estimate; the explicit algorithms count exactly: every message they really send).

Explicit algorithms (``algorithm=`` per call, else ``Comm.algorithm``; "auto" asks the cost model):
with ``async_op=True`` they run on the Comm's communication thread (``comm_thread``), in issue order,
and the call returns at once, so they overlap the caller's work as native collectives do; a
synchronous call runs on the caller's thread when nothing is queued, else after what is. An algorithm
without a variant of its own for an op runs the one in ``explicit.ALGORITHM_FOR``.
``avg`` is a sum followed by a division (floor division for integer tensors). bf16 and fp16 are reduced
in their own dtype, so their sums may differ from the backend's by rounding.

On a GPU (``device_type = "cuda"``, a ``cpu:gloo,cuda:nccl`` group): the explicit algorithms are refused
(``check_algorithm``: they tell messages apart by tag, which NCCL ignores, pairing a peer's sends and
receives in order) and ``auto`` means native. NCCL's ``wait()`` only makes the current stream wait, so
the time a call blocks is measured there, with CUDA events around the wait, settled when the stats are
read (once a step); and the call stays known to the hang watchdog until its work completes.

Message tags: a caller's own ``send``/``recv`` use tags below ``p2p.TAG_BASE``; each ``Comm`` built on a
process group takes the next tag slot of that group (``tag_slot``), and its algorithms' messages carry
tags inside it, so two ``Comm``s on one group (the world and a data-parallel axis as wide as the world,
say) never pair each other's messages. Slots are handed out in construction order, so every rank of a
group must build its ``Comm``s on that group in the same order: the mesh builds them all, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardwise.collectives import cost, explicit
from shardwise.collectives.comm_thread import CommThread
from shardwise.collectives.explicit import EXPLICIT, divide
from shardwise.collectives.p2p import MAX_SLOTS, P2P, TAG_BASE, Done, Work
from shardwise.config import ConfigError
from shardwise.observe.monitor import MONITOR, Call

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class _Then:
    """Backend work followed by a local step (averaging) once it completes."""

    def __init__(self, work: dist.Work, after: Callable[[], None]) -> None:
        self._work, self._after, self._done = work, after, False

    def wait(self) -> bool:
        if not self._done:
            self._work.wait()
            self._after()
            self._done = True
        return True


@dataclass
class CommStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    blocked_s: float = 0.0  # time spent inside synchronous calls and waits
    ops: dict[str, int] = field(default_factory=dict)  # calls that communicated, by op ("all_reduce", ...)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # CUDA: (before, after) events around each wait on the stream, added to blocked_s when read
    _events: list[tuple[Any, Any]] = field(default_factory=list, repr=False, compare=False)

    def add_stream_wait(self, before: Any, after: Any) -> None:
        """A wait on a GPU stream, between two recorded CUDA events (timed when the stats are read)."""
        with self._lock:
            self._events.append((before, after))

    def _settle(self) -> None:
        """Turn the recorded stream waits into seconds (waits for the last one: once per read)."""
        with self._lock:
            events, self._events = self._events, []
        if events:
            events[-1][1].synchronize()
            self.add(blocked_s=sum(a.elapsed_time(b) for a, b in events) / 1000.0)

    def add(self, sent: int = 0, received: int = 0, blocked_s: float = 0.0) -> None:
        """Count from any thread (the communication thread counts its messages here too)."""
        with self._lock:
            if sent:
                self.bytes_sent += sent
            if received:
                self.bytes_received += received
            if blocked_s:
                self.blocked_s += blocked_s

    def snapshot(self) -> CommStats:
        self._settle()
        return CommStats(self.calls, self.bytes_sent, self.bytes_received, self.blocked_s, dict(self.ops))

    def since(self, earlier: CommStats) -> CommStats:
        self._settle()
        return CommStats(
            self.calls - earlier.calls,
            self.bytes_sent - earlier.bytes_sent,
            self.bytes_received - earlier.bytes_received,
            self.blocked_s - earlier.blocked_s,
            {op: n - earlier.ops.get(op, 0) for op, n in self.ops.items() if n != earlier.ops.get(op, 0)},
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_SLOTS: dict[tuple[int, ...], int] = {}  # a group's global ranks -> Comms built on it so far


def next_tag_slot(group: dist.ProcessGroup | None) -> int:
    """The tag slot of the next ``Comm`` on ``group`` (the same on every rank that builds them in order)."""
    key = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    count = _SLOTS.get(key, 0)
    _SLOTS[key] = count + 1
    return count % MAX_SLOTS


def check_algorithm(algorithm: str, device_type: str) -> None:
    """The explicit algorithms run on tagged point-to-point messages; NCCL ignores tags (it pairs a
    peer's sends and receives in order), so on CUDA they are refused in one line."""
    if device_type == "cuda" and algorithm in EXPLICIT:
        raise ConfigError(
            f"comm.algorithm = {algorithm} runs on tagged send/recv, which NCCL does not keep apart: on "
            "cuda use native (or auto, which is native there), or run with --device cpu"
        )


def _caller_tag(tag: int) -> int:
    if not 0 <= tag < TAG_BASE:
        raise ValueError(f"send/recv tags must be in [0, {TAG_BASE}); higher ones belong to the algorithms")
    return tag


class CommSettings(Protocol):
    """What a ``Comm`` reads from the config (``config.CommConfig``)."""

    @property
    def algorithm(self) -> str: ...

    @property
    def profile(self) -> str: ...


MAX_PROFILE_BYTES = 1 << 20  # a profile `shardwise bench comm` writes is a few kB


def load_profile(path: str) -> cost.CostProfile | None:
    """The cost-model profile at ``path``; with no path, the one ``shardwise bench comm`` saved here, if any.

    A path that was named but does not exist, or a file that is no profile (not a regular file, not
    JSON, a value of the wrong kind), is a one-line ``ConfigError`` naming it (``preflight`` calls this
    before any rank starts).
    """
    where = Path(path or cost.DEFAULT_PROFILE_PATH)
    named = f"comm.profile {path}" if path else f"the saved comm profile {where}"
    if not where.exists():
        if path:
            raise ConfigError(f"comm.profile {path} does not exist; `shardwise bench comm` makes one")
        return None
    if not where.is_file():  # a folder, /dev/zero, a pipe: nothing to read, or no end to it
        raise ConfigError(f"{named} is not a regular file; give the JSON file `shardwise bench comm` writes")
    if where.stat().st_size > MAX_PROFILE_BYTES:
        raise ConfigError(
            f"{named} has {where.stat().st_size} bytes, more than a profile's {MAX_PROFILE_BYTES}; "
            "give the JSON file `shardwise bench comm` writes"
        )
    try:
        profile = cost.CostProfile.load(str(where))
        numbers = [getattr(profile, f.name) for f in fields(profile) if f.type in (float, "float")]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise TypeError("a constant is not a number")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__  # one line, whatever json says
        raise ConfigError(
            f"{named} is not a cost profile ({reason}); run `shardwise bench comm` again, or give "
            "another comm.profile"
        ) from None
    return profile


class Comm:
    """Collectives over one process group, with byte and time accounting.

    ``algorithm`` is the default for calls that do not name one: ``native``, one of the explicit
    algorithms (``ring``, ``tree``, ``halving_doubling``, ``naive``) or ``auto`` (the one the cost
    model, with ``profile``, predicts fastest for the size and world size).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        algorithm: str = "native",
        profile: cost.CostProfile | None = None,
        name: str = "",
        device_type: str = "cpu",
    ) -> None:
        self.group = group
        self.name = name or "world"  # the mesh axis, for messages
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device_type = device_type  # where its heavy tensors live: cuda means NCCL (module doc)
        check_algorithm(algorithm, device_type)
        self.algorithm = self._check(algorithm)
        self.profile = profile or cost.CostProfile()
        self.stats = CommStats()
        self.tag_slot = next_tag_slot(group)
        self._p2p = P2P(group, self.stats, self.tag_slot)
        self._thread = CommThread()
        self.seq = 0  # calls issued on this group: the watchdog's and the trace's numbering

    @classmethod
    def from_config(
        cls, group: dist.ProcessGroup | None, config: CommSettings, name: str = "", device_type: str = "cpu"
    ) -> Comm:
        """A ``Comm`` from a ``CommConfig``: its algorithm, and for "auto" the profile named there, else
        the one ``shardwise bench comm`` saved on this machine, else the built-in constants."""
        return cls(group, config.algorithm, load_profile(config.profile), name, device_type)

    @staticmethod
    def _check(algorithm: str) -> str:
        if algorithm not in ("native", "auto", *EXPLICIT):
            raise ValueError(f"unknown algorithm {algorithm!r}; expected native, auto, {', '.join(EXPLICIT)}")
        return algorithm

    def resolve(self, op: str, nbytes: int, algorithm: str | None = None) -> str:
        """The algorithm a call of ``op`` on ``nbytes`` runs: "native" or an explicit one."""
        name = self._check(algorithm or self.algorithm)
        if self.device_type == "cuda":
            check_algorithm(name, "cuda")  # named per call: refused here too
            return "native"  # auto: the cost model's profile is gloo's; NCCL runs its own algorithms
        if name == "auto":
            return cost.choose(op, nbytes, self.world_size, self.profile)
        return name

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, sent: float, received: float) -> None:
        self.stats.calls += 1
        self.stats.add(int(sent), int(received))

    def _issue(self, op: str, label: str = "", peer: int | None = None) -> Call:
        self.seq += 1
        self.stats.ops[op] = self.stats.ops.get(op, 0) + 1
        return MONITOR.issue(self.name, op, self.seq, label, peer)

    def _finish(
        self,
        work: dist.Work | None,
        async_op: bool,
        after: Callable[[], None] | None,
        call: Call,
        tensor: torch.Tensor,
    ) -> Work:
        if work is None:
            return Done()
        watched = _Watched(_Then(work, after) if after else work, self.stats, call, tensor.is_cuda, work)
        if async_op:
            return watched
        watched.wait()
        return Done()

    def _explicit(self, run: Callable[[], None], async_op: bool, call: Call) -> Work:
        """Run an explicit algorithm (its P2P counts the bytes): queued when asked to be asynchronous
        or when others are still queued, else here and now."""
        self.stats.calls += 1
        if async_op or not self._thread.idle():
            pending = _Watched(self._thread.submit(run), self.stats, call)
            if async_op:
                return pending
            pending.wait()
            return Done()
        _Watched(_Inline(run), self.stats, call).wait()
        return Done()

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str = "sum",
        async_op: bool = False,
        algorithm: str | None = None,
        label: str = "",
    ) -> Work:
        """Reduce ``tensor`` in place over the group."""
        n, size = self.world_size, _nbytes(tensor)
        name = self.resolve("all_reduce", size, algorithm)
        if n == 1:
            self.stats.calls += 1
            return Done()
        call = self._issue("all_reduce", label)
        if name != "native":
            return self._explicit(lambda: explicit.all_reduce(tensor, self._p2p, op, name), async_op, call)
        self._count(2 * (n - 1) / n * size, 2 * (n - 1) / n * size)
        work = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True)
        after = (lambda: divide(tensor, n)) if op == "avg" else None
        return self._finish(work, async_op, after, call, tensor)

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int = 0,
        async_op: bool = False,
        algorithm: str | None = None,
        label: str = "",
    ) -> Work:
        """Send ``tensor`` from group rank ``src`` to every rank."""
        size = _nbytes(tensor)
        name = self.resolve("broadcast", size, algorithm)
        if self.world_size == 1:
            self.stats.calls += 1
            return Done()
        call = self._issue("broadcast", label)
        if name != "native":
            return self._explicit(lambda: explicit.broadcast(tensor, self._p2p, src, name), async_op, call)
        self._count(size if self.rank == src else 0, 0 if self.rank == src else size)
        work = dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True)
        return self._finish(work, async_op, None, call, tensor)

    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int = 0,
        op: str = "sum",
        async_op: bool = False,
        algorithm: str | None = None,
        label: str = "",
    ) -> Work:
        """Reduce ``tensor`` onto group rank ``dst``; every other rank's ``tensor`` is left unchanged."""
        n, size = self.world_size, _nbytes(tensor)
        name = self.resolve("reduce", size, algorithm)
        if n == 1:
            self.stats.calls += 1
            return Done()
        call = self._issue("reduce", label)
        if name != "native":
            return self._explicit(lambda: explicit.reduce(tensor, self._p2p, dst, op, name), async_op, call)
        self._count(0 if self.rank == dst else size, (n - 1) * size if self.rank == dst else 0)
        target = tensor if self.rank == dst else tensor.clone()
        work = dist.reduce(target, dst=self.global_rank(dst), op=_OPS[op], group=self.group, async_op=True)
        after = (lambda: divide(tensor, n)) if op == "avg" and self.rank == dst else None
        return self._finish(work, async_op, after, call, tensor)

    def all_gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        async_op: bool = False,
        algorithm: str | None = None,
        label: str = "",
    ) -> Work:
        """Concatenate every rank's ``shard`` (equal sizes) into ``output`` along dim 0."""
        n, size = self.world_size, _nbytes(shard)
        name = self.resolve("all_gather", _nbytes(output), algorithm)
        if n == 1:
            self.stats.calls += 1
            output.copy_(shard.reshape(output.shape))
            return Done()
        call = self._issue("all_gather", label)
        if name != "native":
            return self._explicit(lambda: explicit.all_gather(output, shard, self._p2p, name), async_op, call)
        self._count((n - 1) * size, (n - 1) * size)
        work = dist.all_gather_single(output, shard, group=self.group, async_op=True)
        return self._finish(work, async_op, None, call, output)

    def reduce_scatter(
        self,
        shard: torch.Tensor,
        full: torch.Tensor,
        op: str = "sum",
        async_op: bool = False,
        algorithm: str | None = None,
        label: str = "",
    ) -> Work:
        """Reduce ``full`` over the group and leave this rank's equal slice of it in ``shard``."""
        n, size = self.world_size, _nbytes(shard)
        name = self.resolve("reduce_scatter", _nbytes(full), algorithm)
        if n == 1:
            self.stats.calls += 1
            shard.copy_(full.reshape(shard.shape))
            return Done()
        call = self._issue("reduce_scatter", label)
        if name != "native":
            return self._explicit(
                lambda: explicit.reduce_scatter(shard, full, self._p2p, op, name), async_op, call
            )
        self._count((n - 1) * size, (n - 1) * size)
        work = dist.reduce_scatter_single(shard, full, op=_OPS[op], group=self.group, async_op=True)
        after = (lambda: divide(shard, n)) if op == "avg" else None
        return self._finish(work, async_op, after, call, shard)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Non-blocking send; bytes are counted when posted. ``wait()`` raises if the peer is gone."""
        self._count(_nbytes(tensor), 0)
        call = self._issue("send", peer=dst)
        work = _required(dist.isend(tensor, self.global_rank(dst), group=self.group, tag=_caller_tag(tag)))
        return _Watched(work, self.stats, call, tensor.is_cuda, work)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Non-blocking receive from group rank ``src``; bytes are counted when posted."""
        self._count(0, _nbytes(tensor))
        call = self._issue("recv", peer=src)
        work = _required(dist.irecv(tensor, self.global_rank(src), group=self.group, tag=_caller_tag(tag)))
        return _Watched(work, self.stats, call, tensor.is_cuda, work)

    def barrier(self, label: str = "") -> None:
        if self.world_size > 1:
            call = self._issue("barrier", label)
            work = dist.barrier(group=self.group, async_op=True)
            _Watched(_required(work), self.stats, call).wait()


def _required(work: dist.Work | None) -> Work:
    if work is None:
        raise RuntimeError("a point-to-point call returned no work: this rank is not in the group")
    return work


class _Watched:
    """Waiting on ``work``: the time is charged to the layer's blocked time, and the monitor knows
    which call this rank waits in (the hang watchdog's and the trace's source).

    ``cuda``: the call's tensors are on a GPU, where ``wait()`` returns at once having made the current
    stream wait (NCCL): the time is the stream's, between CUDA events around the wait, and the monitor
    keeps the call in flight until ``backend_work`` reports it completed."""

    def __init__(
        self, work: Work, stats: CommStats, call: Call, cuda: bool = False, backend_work: Any = None
    ) -> None:
        self._work, self._stats, self._call = work, stats, call
        self._cuda, self._backend_work = cuda, backend_work

    def wait(self) -> object:
        start = time.perf_counter()
        MONITOR.wait_start(self._call)
        before = _stream_event() if self._cuda else None
        try:
            return self._work.wait()
        finally:
            if before is not None:
                self._stats.add_stream_wait(before, _stream_event())
                MONITOR.in_flight(self._call, self._backend_work)
            else:
                self._stats.add(blocked_s=time.perf_counter() - start)
            MONITOR.wait_end(self._call)


def _stream_event() -> Any:
    """A timing event recorded now on the current CUDA stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _Inline:
    """An explicit algorithm run on the caller's thread: waiting for it is running it."""

    def __init__(self, run: Callable[[], None]) -> None:
        self._run = run

    def wait(self) -> bool:
        self._run()
        return True
