"""The mesh's axes as one table: ``ParallelDims``, a job's degrees and the groups of ranks they make.

Pure arithmetic, no torch: the config, the planner, the launcher and the mesh all read this one table.

Axes. The ranks that train form the mesh, row-major over ``MESH_AXES`` = (dp_replicate, dp_shard, cp,
pp, tp), tp varying fastest, so tensor-parallel peers are neighbours (one machine when there are
several), context-parallel ones next. Parameter servers (``servers``), when a job has any, are the
first global ranks and stand outside the mesh. ``dp`` = dp_replicate x dp_shard is the data-parallel
degree: hybrid sharding shards over ``dp_shard`` (consecutive ranks: one node) and replicates the shard
groups over ``dp_replicate`` (dp rank = replica index x dp_shard + shard index). ``ep`` is no
dimension of its own: experts are spread over groups of ``ep`` consecutive ranks carved from
dp_shard x cp (torchtitan's layout), so it multiplies nothing.

Groups. Each is named for what it is for (``GROUPS``); a group is the ranks that share every
coordinate it does not vary:

- one per axis: ``dp_replicate``, ``dp_shard``, ``cp``, ``pp``, ``tp``, and ``ep`` (carved);
- ``dp``: the data-parallel ranks, dp_replicate x dp_shard (the sampler's shares, BatchNorm's statistics);
- ``batch``: dp x cp, the ranks that split each batch: items counted, loss shares summed;
- ``dense_grads``: dp x cp, over which a dense parameter's gradient is reduced;
- ``expert_grads``: the ranks of dp x cp holding the same experts, over which an expert's gradient is
  reduced (dp x cp / ep of them);
- ``norm``: every rank that steps, over which the shares of the squared gradient norm are summed once.

cp and ep are in the table, and a job asking for them is refused in one line (``parallelism.check``)
until they are built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from shardwise.errors import ConfigError

MESH_AXES = ("dp_replicate", "dp_shard", "cp", "pp", "tp")  # the mesh's dimensions, outermost first
# the same ranks with dp_shard x cp cut into expert groups: "ep" (the place in an expert group) and
# "ep_replica" (which group); a rank's coordinates are given in both systems
EXPERT_AXES = ("dp_replicate", "ep_replica", "ep", "pp", "tp")
AXES = ("dp_replicate", "dp_shard", "cp", "ep", "pp", "tp", "servers")  # every degree of the table

GROUPS: dict[str, tuple[str, ...]] = {  # name -> the coordinates that vary within one such group
    "dp": ("dp_replicate", "dp_shard"),
    "pp": ("pp",),
    "tp": ("tp",),
    "cp": ("cp",),
    "ep": ("ep",),
    "dp_shard": ("dp_shard",),
    "dp_replicate": ("dp_replicate",),
    "batch": ("dp_replicate", "dp_shard", "cp"),
    "dense_grads": ("dp_replicate", "dp_shard", "cp"),
    "expert_grads": ("dp_replicate", "ep_replica"),
    "norm": MESH_AXES,
}


class Degrees(Protocol):
    """What ``ParallelDims.build`` reads of a config's ``[parallel]`` table."""

    @property
    def dp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def dp_replicate(self) -> int: ...


@dataclass(frozen=True)
class ParallelDims:
    """The validated degrees of a job: ``servers + dp x cp x pp x tp`` ranks (see the module docstring).

    Built from a config with ``build`` (which resolves ``dp = -1`` and checks the arithmetic against
    the world), or directly: ``ParallelDims(dp=4, tp=2)``.
    """

    dp: int
    pp: int = 1
    tp: int = 1
    servers: int = 0
    dp_replicate: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp", "dp_replicate", "cp", "ep"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"parallel.{axis} must be >= 1, got {getattr(self, axis)}")
        if self.servers < 0:
            raise ConfigError(f"the parameter servers must be >= 0, got {self.servers}")
        if self.dp % self.dp_replicate:
            raise ConfigError(f"parallel.dp_replicate = {self.dp_replicate} does not divide dp = {self.dp}")
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"parallel.ep = {self.ep} does not divide dp_shard({self.dp_shard}) x cp({self.cp}) = "
                f"{self.dp_shard * self.cp}: experts are spread over ranks carved from them"
            )

    @classmethod
    def build(cls, parallel: Degrees, world_size: int, servers: int = 0) -> ParallelDims:
        """Resolve ``parallel.dp`` (-1: what the world leaves) and check the arithmetic against a
        world of ``world_size`` ranks, ``servers`` of which serve."""
        for name in ("pp", "tp", "cp", "ep"):
            if getattr(parallel, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(parallel, name)}")
        if parallel.dp < 1 and parallel.dp != -1:
            raise ConfigError(f"parallel.dp must be >= 1, or -1 for what the world leaves; got {parallel.dp}")
        trainers = world_size - servers
        if servers < 0 or trainers < 1:
            raise ConfigError(
                f"the parameter server needs at least one server and one worker: {world_size} ranks - "
                f"{servers} servers = {trainers} workers"
            )
        model = {"cp": parallel.cp, "pp": parallel.pp, "tp": parallel.tp}
        if parallel.cp == 1:
            del model["cp"]  # the arithmetic shows only the axes a job uses besides pp and tp
        model_ranks = math.prod(model.values())
        dp = parallel.dp
        if dp == -1:
            if trainers % model_ranks:
                raise ConfigError(
                    f"{_times(model)} = {model_ranks} does not divide the world of "
                    f"{_ranks(trainers, servers)}; start a multiple of {model_ranks} ranks that train "
                    f"(--nproc), or lower {' or '.join(model)}"
                )
            dp = trainers // model_ranks
        total = dp * model_ranks
        if total != trainers:
            raise ConfigError(
                f"{_times({'dp': dp, **model})} = {total}, but the world has {_ranks(trainers, servers)}; "
                f"start {total} ranks that train (--nproc), or leave dp unset (-1: what the world leaves)"
            )
        return cls(dp, parallel.pp, parallel.tp, servers, parallel.dp_replicate, parallel.cp, parallel.ep)

    # -- the table ----------------------------------------------------------------------------------
    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def degrees(self) -> dict[str, int]:
        """Every axis of the table (``AXES``) and its degree."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The degrees of ``MESH_AXES``, outermost first: the mesh's shape over the ranks that train."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def trainers(self) -> int:
        """The ranks that train (the mesh)."""
        return math.prod(self.mesh_shape)

    @property
    def world_size(self) -> int:
        return self.servers + self.trainers

    @property
    def label(self) -> str:
        """The layout in words: ``dp2 x pp2 x tp2`` (cp and ep where they are more than one, and
        ``+ 2 servers`` for a parameter server)."""
        parts = [f"dp{self.dp}"] + [f"cp{self.cp}"] * (self.cp > 1) + [f"ep{self.ep}"] * (self.ep > 1)
        servers = f" + {self.servers} servers" if self.servers else ""
        return " x ".join([*parts, f"pp{self.pp}", f"tp{self.tp}"]) + servers

    # -- ranks and groups ---------------------------------------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int] | None:
        """Global ``rank``'s place on every axis (both systems: ``MESH_AXES`` and ``EXPERT_AXES``);
        None for a parameter server, which stands outside the mesh."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        if rank < self.servers:
            return None
        index, place = rank - self.servers, {}
        for axis, degree in reversed(list(zip(MESH_AXES, self.mesh_shape, strict=True))):
            index, place[axis] = divmod(index, degree)
        carved = place["dp_shard"] * self.cp + place["cp"]  # dp_shard x cp, row-major, cut by ep
        place["ep_replica"], place["ep"] = divmod(carved, self.ep)
        return place

    def rank_groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group called ``name`` (``GROUPS``) as global ranks, ascending; groups in the order of
        their first rank. Together they cover the mesh once."""
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}; the groups are {', '.join(GROUPS)}")
        varying = GROUPS[name]
        system = MESH_AXES if set(varying) <= set(MESH_AXES) else EXPERT_AXES
        fixed = [axis for axis in system if axis not in varying]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.servers, self.world_size):
            place = self.coordinates(rank)
            assert place is not None
            groups.setdefault(tuple(place[a] for a in fixed), []).append(rank)
        return [tuple(members) for members in groups.values()]

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The group called ``name`` that global ``rank`` belongs to (a rank of the mesh)."""
        return next(group for group in self.rank_groups(name) if rank in group)

    def sizes(self) -> Mapping[str, int]:
        """How many ranks each group has (``GROUPS``)."""
        return {name: len(self.rank_groups(name)[0]) for name in GROUPS}


def _times(degrees: Mapping[str, int]) -> str:
    return " x ".join(f"{axis}({degree})" for axis, degree in degrees.items())


def _ranks(trainers: int, servers: int) -> str:
    if servers:
        return f"{trainers} ranks that train ({trainers + servers} ranks - {servers} servers)"
    return f"{trainers} rank" if trainers == 1 else f"{trainers} ranks"
