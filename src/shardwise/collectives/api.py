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

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.collectives import cost, explicit
from shardwise.collectives.comm_thread import CommThread
from shardwise.collectives.explicit import EXPLICIT, divide
from shardwise.collectives.p2p import MAX_SLOTS, P2P, TAG_BASE, Done, Work
from shardwise.collectives.profile import CommSettings, load_profile
from shardwise.collectives.waiting import CommStats, Inline, Then, Watched, required
from shardwise.config import ConfigError
from shardwise.device import HOST
from shardwise.observe.monitor import MONITOR, Call

__all__ = ["Comm", "CommSettings", "CommStats", "Work", "check_algorithm", "load_profile", "next_tag_slot"]

# torch 2.13 renamed the flat-tensor collectives (the old names warn there); a GPU image's 2.11 has
# the old names only
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _then(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    """The local steps that are given, run in order once a work completes (None: there are none)."""
    todo = [step for step in steps if step is not None]
    if not todo:
        return None

    def run() -> None:
        for step in todo:
            step()

    return run


def _cuda_backend(group: dist.ProcessGroup | None) -> str:
    """The backend that carries ``group``'s CUDA tensors: nccl under ``cpu:gloo,cuda:nccl``, gloo
    where one backend carries every device (``SHARDWISE_CUDA_BACKEND=gloo``: ranks sharing a GPU)."""
    backend = str(dist.get_backend(group))
    pairs = dict(pair.split(":", 1) for pair in backend.split(",") if ":" in pair)
    return pairs.get("cuda", backend)


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
        self.cuda_over_gloo = device_type == "cuda" and _cuda_backend(group) == "gloo"
        check_algorithm(algorithm, device_type)
        self.algorithm = self._check(algorithm)
        self.profile = profile or cost.CostProfile()
        self.stats = CommStats()
        self.tag_slot = next_tag_slot(group)
        self._p2p = P2P(group, self.stats, self.tag_slot)
        self._thread = CommThread()
        self.seq = 0  # calls issued on this group: the watchdog's and the trace's numbering

    @property
    def receives_stand_aside(self) -> bool:
        """Whether a posted receive holds up none of this group's other ops. Gloo matches each
        direction of a pair by posting order (and tag) and runs every op on its own; NCCL runs a
        pair's ops in posting order on one stream, so a receive posted early stalls the ops behind it."""
        return self.device_type != "cuda" or self.cuda_over_gloo

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
        if label:
            self.stats.labels[label] = self.stats.labels.get(label, 0) + 1
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
        cuda = tensor.is_cuda and not self.cuda_over_gloo  # NCCL: wait() lets the host go on
        watched = Watched(Then(work, after) if after else work, self.stats, call, cuda, work)
        if async_op:
            return watched
        watched.wait()
        return Done()

    def _explicit(self, run: Callable[[], None], async_op: bool, call: Call) -> Work:
        """Run an explicit algorithm (its P2P counts the bytes): queued when asked to be asynchronous
        or when others are still queued, else here and now."""
        self.stats.calls += 1
        if async_op or not self._thread.idle():
            pending = Watched(self._thread.submit(run), self.stats, call)
            if async_op:
                return pending
            pending.wait()
            return Done()
        Watched(Inline(run), self.stats, call).wait()
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
        target, back = self._via_host(target, tensor if self.rank == dst else None)
        work = dist.reduce(target, dst=self.global_rank(dst), op=_OPS[op], group=self.group, async_op=True)
        average = (lambda: divide(tensor, n)) if op == "avg" and self.rank == dst else None
        return self._finish(work, async_op, _then(back, average), call, tensor)

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
        into, back = self._via_host(output, output, fill=False)
        work = _ALL_GATHER_FLAT(into, self._via_host(shard)[0], group=self.group, async_op=True)
        return self._finish(work, async_op, back, call, output)

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
        into, back = self._via_host(shard, shard, fill=False)
        source = self._via_host(full)[0]
        work = _REDUCE_SCATTER_FLAT(into, source, op=_OPS[op], group=self.group, async_op=True)
        average = (lambda: divide(shard, n)) if op == "avg" else None
        return self._finish(work, async_op, _then(back, average), call, shard)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Non-blocking send; bytes are counted when posted. ``wait()`` raises if the peer is gone."""
        self._count(_nbytes(tensor), 0)
        call = self._issue("send", peer=dst)
        data = self._via_host(tensor)[0]
        work = required(dist.isend(data, self.global_rank(dst), group=self.group, tag=_caller_tag(tag)))
        return Watched(work, self.stats, call, data.is_cuda, work)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Non-blocking receive from group rank ``src``; bytes are counted when posted."""
        self._count(0, _nbytes(tensor))
        call = self._issue("recv", peer=src)
        into, back = self._via_host(tensor, tensor, fill=False)
        work = required(dist.irecv(into, self.global_rank(src), group=self.group, tag=_caller_tag(tag)))
        return Watched(Then(work, back) if back else work, self.stats, call, into.is_cuda, work)

    def _via_host(
        self, tensor: torch.Tensor, result: torch.Tensor | None = None, fill: bool = True
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Where gloo carries CUDA tensors (``cuda_over_gloo``), the ops it runs on host memory only
        (all but all-reduce and broadcast) go through a host copy of ``tensor`` (``fill``: with its
        values), copied back into ``result`` once the work completes. Elsewhere ``tensor`` itself."""
        if not (self.cuda_over_gloo and tensor.is_cuda):
            return tensor, None
        host = tensor.to(HOST) if fill else torch.empty_like(tensor, device=HOST)
        if result is None:
            return host, None
        target = result

        def back() -> None:
            target.copy_(host)

        return host, back

    def barrier(self, label: str = "") -> None:
        if self.world_size > 1:
            call = self._issue("barrier", label)
            work = dist.barrier(group=self.group, async_op=True)
            Watched(required(work), self.stats, call).wait()
