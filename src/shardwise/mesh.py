"""The device mesh: every group of ``ParallelDims``' table (``dims.GROUPS``) as a process group, one
``Comm`` over each, built once.

Rank layout and groups are the table's (``shardwise.dims``): parameter servers first, outside the mesh;
the ranks that train row-major over (dp_replicate, dp_shard, cp, pp, tp), tp fastest. Each group name
(an axis: ``dp_replicate``, ``dp_shard``, ``cp``, ``ep``, ``pp``, ``tp``; or a group named for its use:
``dp``, ``batch``, ``dense_grads``, ``expert_grads``, ``norm``) maps to this rank's ``Comm``. Names
whose groups hold the same ranks share one process group and one ``Comm`` (at dp_replicate = 1,
``dp_shard`` is ``dp``; at cp = 1, ``batch`` is ``dp``; every axis of degree 1 is this rank alone);
``norm`` (every rank that steps) is the trainers' ``Comm``. Each ``Comm`` is built from the run's
``CommConfig`` (its algorithm and, for ``auto``, the saved cost profile). Besides the groups: the world
``Comm`` (checkpoints, agreement on restarts), the trainers' ``Comm`` (per-step metrics, the norm, the
loss) and the servers' ``Comm``.

The mesh is made for the device (``device_type``): on GPUs the groups inherit the default group's
``cpu:gloo,cuda:nccl`` (``shardwise.device``), and every ``Comm`` knows it (NCCL refuses the explicit
algorithms).

Every rank builds the same groups and ``Comm``s in the same order (process groups and message tag
slots are agreed by order), which is why this module is the one place that builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from shardwise.collectives.api import Comm, CommSettings
from shardwise.config import CommConfig, TrainConfig
from shardwise.device import device_type as resolve_device_type
from shardwise.dims import GROUPS, ParallelDims

NORM = "norm"  # every rank that steps: the trainers' Comm


@dataclass
class Mesh:
    """The job's communicators. ``comm(name)`` is only defined on ranks inside the mesh."""

    dims: ParallelDims
    world: Comm
    trainers: Comm | None  # the ranks that train; None on a parameter server
    servers: Comm | None  # the parameter servers; None elsewhere and when there are none
    comms: dict[str, Comm] = field(default_factory=dict)  # group name -> this rank's Comm over it

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def in_mesh(self) -> bool:
        """Whether this rank trains (a parameter server does not)."""
        return bool(self.comms)

    def comm(self, name: str) -> Comm:
        """This rank's ``Comm`` over the group ``name`` (an axis, or a group named for its use)."""
        if name not in GROUPS:
            raise ValueError(f"unknown mesh group {name!r}; the groups are {', '.join(GROUPS)}")
        if not self.comms:
            raise RuntimeError(
                f"rank {self.rank} is a parameter server, outside the mesh: it has no {name} group"
            )
        return self.comms[name]

    def axis_rank(self, name: str) -> int:
        """This rank's index in its group ``name`` (-1 on a rank outside the mesh)."""
        return self.comm(name).rank if self.comms else -1

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.axis_rank("pp")

    @property
    def tp_rank(self) -> int:
        return self.axis_rank("tp")

    def all_comms(self) -> list[Comm]:
        """Every distinct ``Comm`` this rank has: the world, the trainers, the servers, the groups."""
        found: dict[int, Comm] = {}
        for comm in [self.world, self.trainers, self.servers, *self.comms.values()]:
            if comm is not None:
                found.setdefault(id(comm), comm)
        return list(found.values())

    def describe(self) -> dict[str, int]:
        """The degrees, as checkpoints record them: dp and every axis of the table."""
        return {"dp": self.dims.dp, **self.dims.degrees}


def build_mesh(
    dims: ParallelDims | TrainConfig, comm_config: CommSettings | None = None, device_type: str = "cpu"
) -> Mesh:
    """Build the mesh over the initialised default process group: from ``ParallelDims`` (which must
    match its size) and ``comm_config``, or from a ``TrainConfig`` (its degrees, ``[comm]`` and
    device)."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group: call shardwise.init() first")
    world_size = dist.get_world_size()
    if isinstance(dims, TrainConfig):
        comm_config = comm_config or dims.comm
        device_type = resolve_device_type(dims.device)
        dims = dims.validate(world_size).dims(world_size)
    if dims.world_size != world_size:
        raise ValueError(f"the mesh describes {dims.world_size} ranks, but the world has {world_size}")
    settings = comm_config or CommConfig()
    world = Comm.from_config(None, settings, "world", device_type)
    first, rank = dims.servers, dist.get_rank()
    trainer_group = dist.new_group(list(range(first, world_size))) if first else None
    server_group = dist.new_group(list(range(first))) if first else None
    trains = rank >= first
    trainers = (
        (Comm.from_config(trainer_group, settings, "trainers", device_type) if first else world)
        if trains
        else None
    )
    serving = first and not trains
    servers = Comm.from_config(server_group, settings, "servers", device_type) if serving else None
    comms = _group_comms(dims, rank, settings, device_type)
    if trainers is not None:
        comms[NORM] = trainers
    return Mesh(dims, world, trainers, servers, comms if trains else {})


def _group_comms(dims: ParallelDims, rank: int, settings: CommSettings, device_type: str) -> dict[str, Comm]:
    """This rank's ``Comm`` per group name. Every rank builds every process group, in ``GROUPS``'
    order (a group that holds the same ranks as an earlier one is that one); a ``Comm`` is named
    after the first group name that made its process group ("self" for a rank alone)."""
    built: dict[tuple[tuple[int, ...], ...], Comm | None] = {}
    comms: dict[str, Comm] = {}
    for name in GROUPS:
        if name == NORM:
            continue
        groups = tuple(dims.rank_groups(name))
        if groups not in built:
            label = "self" if len(groups[0]) == 1 else name
            mine = None
            for members in groups:  # every rank builds every group, in one order
                group = dist.new_group(list(members))
                if rank in members:
                    mine = Comm.from_config(group, settings, label, device_type)
            built[groups] = mine
        comm = built[groups]
        if comm is not None:
            comms[name] = comm
    return comms
