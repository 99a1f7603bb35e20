"""The device mesh: named axes dp, pp and tp over ``torch.distributed.DeviceMesh``, one ``Comm`` per axis.

Rank layout: parameter servers, when a job has any, are the first ``servers`` global ranks and stand
outside the mesh; the ranks that train form the mesh, row-major over (dp, pp, tp) with tp varying
fastest, so tensor-parallel peers are neighbours (on one machine when there are several). Each axis
gets its own process group, created once by DeviceMesh, and one ``Comm`` built once over it, from the
run's ``CommConfig`` (its algorithm and, for ``auto``, the saved cost profile). Besides the axes: the
world ``Comm`` (checkpoints, agreement on restarts), the trainers' ``Comm`` (per-step metrics over the
ranks that train) and the servers' ``Comm``.

The mesh is made for the device (``device_type``): ``DeviceMesh("cuda", ...)`` on GPUs, whose groups
inherit the default group's ``cpu:gloo,cuda:nccl`` (``shardwise.device``), and every ``Comm`` knows it
(NCCL refuses the explicit algorithms).

Every rank builds the same groups and ``Comm``s in the same order (process groups and message tag
slots are agreed by order), which is why this module is the one place that builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise.collectives.api import Comm, CommSettings
from shardwise.config import CommConfig, ConfigError, ParallelDims, TrainConfig
from shardwise.device import HOST
from shardwise.device import device_type as resolve_device_type

AXES = ("dp", "pp", "tp")
HYBRID_AXES = ("dp_shard", "dp_replicate")  # the dp axis cut in two for hybrid sharding


@dataclass
class Mesh:
    """The job's communicators. ``comm(axis)`` is only defined on ranks inside the mesh."""

    dims: ParallelDims
    world: Comm
    trainers: Comm | None  # the ranks that train; None on a parameter server
    servers: Comm | None  # the parameter servers; None elsewhere and when there are none
    device_mesh: DeviceMesh
    comms: dict[str, Comm] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def in_mesh(self) -> bool:
        """Whether this rank trains (a parameter server does not)."""
        return bool(self.comms)

    def comm(self, axis: str) -> Comm:
        """The ``Comm`` over ``axis`` (``dp``, ``pp`` or ``tp``) for this rank, built once."""
        if axis not in AXES + HYBRID_AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES + HYBRID_AXES)}")
        if not self.comms:
            raise RuntimeError(
                f"rank {self.rank} is a parameter server, outside the mesh: it has no {axis} axis"
            )
        return self.comms[axis]

    def axis_rank(self, axis: str) -> int:
        """This rank's index along ``axis`` (-1 on a rank outside the mesh)."""
        return self.comm(axis).rank if self.comms else -1

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.axis_rank("pp")

    @property
    def tp_rank(self) -> int:
        return self.axis_rank("tp")

    def describe(self) -> dict[str, int]:
        """The degrees, as checkpoints record them."""
        return {"dp": self.dims.dp, "pp": self.dims.pp, "tp": self.dims.tp, "servers": self.dims.servers}


def build_mesh(
    dims: ParallelDims | TrainConfig,
    comm_config: CommSettings | None = None,
    device_type: str = "cpu",
    dp_replicate: int = 1,
) -> Mesh:
    """Build the mesh over the initialised default process group: from ``ParallelDims`` (which must
    match its size) and ``comm_config``, or from a ``TrainConfig`` (its degrees, ``[comm]`` and
    ``parallel.dp_replicate``). ``dp_replicate`` > 1 also cuts dp into ``dp_shard`` x ``dp_replicate``
    (see ``hybrid_groups``)."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group: call shardwise.init() first")
    world_size = dist.get_world_size()
    if isinstance(dims, TrainConfig):
        comm_config = comm_config or dims.comm
        dp_replicate = dims.parallel.dp_replicate
        device_type = resolve_device_type(dims.device)
        dims = dims.validate(world_size).dims(world_size)
    if dims.world_size != world_size:
        raise ValueError(f"the mesh describes {dims.world_size} ranks, but the world has {world_size}")
    settings = comm_config or CommConfig()
    world = Comm.from_config(None, settings, "world", device_type)
    first = dims.servers
    ranks = torch.arange(first, world_size, device=HOST).view(dims.shape)  # global rank ids
    device_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=AXES)  # every rank builds every group
    trainer_group = dist.new_group(list(range(first, world_size))) if first else None
    server_group = dist.new_group(list(range(first))) if first else None
    rank = dist.get_rank()
    trains = rank >= first
    trainers = (
        (Comm.from_config(trainer_group, settings, "trainers", device_type) if first else world)
        if trains
        else None
    )
    serving = first and not trains
    servers = Comm.from_config(server_group, settings, "servers", device_type) if serving else None
    comms = (
        {axis: Comm.from_config(device_mesh.get_group(axis), settings, axis, device_type) for axis in AXES}
        if trains
        else {}
    )
    if dp_replicate > 1:
        for axis, groups in zip(HYBRID_AXES, hybrid_groups(ranks, dp_replicate), strict=True):
            mine = [dist.new_group(g) for g in groups]  # every rank builds every group, in one order
            for members, group in zip(groups, mine, strict=True):
                if rank in members:
                    comms[axis] = Comm.from_config(group, settings, axis, device_type)
    return Mesh(dims, world, trainers, servers, device_mesh, comms)


def hybrid_groups(ranks: torch.Tensor, replicate: int) -> tuple[list[list[int]], list[list[int]]]:
    """The dp axis of ``ranks`` (dp, pp, tp) cut into shard groups of ``dp / replicate`` consecutive dp
    ranks (neighbours: one node) and replicate groups of the ranks at the same place in each shard
    group; per (pp, tp) position. dp rank = replica index x shard size + shard index."""
    dp = ranks.shape[0]
    if dp % replicate:
        raise ConfigError(f"parallel.dp_replicate = {replicate} does not divide dp = {dp}")
    shard = dp // replicate
    shards, replicas = [], []
    for p in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            column = ranks[:, p, t].tolist()
            shards += [column[r * shard : (r + 1) * shard] for r in range(replicate)]
            replicas += [column[s::shard] for s in range(shard)]
    return shards, replicas
