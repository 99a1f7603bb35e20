"""The device mesh: named axes dp, pp and tp over ``torch.distributed.DeviceMesh``.

Rank layout is row-major over (dp, pp, tp): tp varies fastest, so tensor-parallel peers are
neighbours (on one machine when there are several). Each axis gets its own process group, created
once by DeviceMesh; strategies receive a ``Comm`` for the axis they communicate over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.collectives.api import Comm
from shardwise.config import ConfigError, ParallelConfig

AXES = ("dp", "pp", "tp")


@dataclass
class Mesh:
    """A DeviceMesh with shardwise's axis names and one ``Comm`` per axis."""

    device_mesh: DeviceMesh
    parallel: ParallelConfig
    algorithm: str = "native"

    def comm(self, axis: str) -> Comm:
        """The communication layer over ``axis`` (``dp``, ``pp`` or ``tp``) for this rank."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)}")
        if getattr(self.parallel, axis) == dist.get_world_size():
            return Comm(None, self.algorithm)  # the whole world: the default group
        return Comm(self.device_mesh.get_group(axis), self.algorithm)

    def axis_rank(self, axis: str) -> int:
        return self.device_mesh.get_local_rank(axis)

    @property
    def dp_rank(self) -> int:
        return self.axis_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.axis_rank("pp")

    @property
    def tp_rank(self) -> int:
        return self.axis_rank("tp")


def build_mesh(parallel: ParallelConfig, device_type: str = "cpu", algorithm: str = "native") -> Mesh:
    """Build the mesh over the initialised default process group; degrees must multiply to its size."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group (see shardwise.launch)")
    world_size = dist.get_world_size()
    try:
        parallel = parallel.resolve(world_size)
    except ConfigError:
        raise
    shape = (parallel.dp, parallel.pp, parallel.tp)
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
    return Mesh(device_mesh, parallel, algorithm)
