"""Hybrid sharding (HSDP; ZeRO++'s hpZ): ZeRO within a group of ranks, replicas across groups.

The dp axis is cut into ``dp_shard`` x ``dp_replicate`` (``shardwise.dims``): a ZeRO engine shards over
its shard group (consecutive ranks, a node), so its gathers and reduce-scatters stay inside it; the
groups hold the same shards. ``HybridReplicas`` is the ``dp_replicate`` axis joined to that engine
(``engine/axis.py``), adding what the replicas need (Zhang et al., 2022, PyTorch FSDP's HYBRID_SHARD;
Wang et al., 2023, ZeRO++):

- after the gradient exchange (each shard summed over its group), one all-reduce of each gradient
  shard over the replicas, so every replica steps on the gradient of the whole global batch;
- which parameters got a gradient is agreed over the replicas too (``usage_comms``), so a parameter
  unused on one replica's share is treated alike everywhere;
- the norm: the first replica counts its shard group's share, the others nothing (they hold the same);
- checkpoints: only the first replica writes (the others hold the same shards).

Communication: per step, one all-reduce over ``dp_replicate`` per flat group (the shard's size) and one
small all-reduce of the used flags.
"""

from __future__ import annotations

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.engine.axis import Axis
from shardwise.engine.base import Engine
from shardwise.zero.base import ZeroBase


class HybridReplicas(Axis):
    """``engine`` (sharded over its shard group) as one replica of ``replicate.world_size``."""

    name = "dp_replicate"

    def __init__(self, engine: ZeroBase, replicate: Comm) -> None:
        self.comm, self.zero = replicate, engine
        engine.usage_comms.append(replicate)

    def after_grads(self, engine: Engine) -> None:
        for group in self.zero.groups:
            if group.grad_shard is not None:
                self.comm.all_reduce(group.grad_shard, label="hybrid replicas")

    @property
    def counts_norm(self) -> bool:
        return self.comm.rank == 0

    def pieces(self, pieces: list[Piece]) -> list[Piece]:
        """The first replica's shard group writes; its ranks are numbered within the group."""
        return pieces if self.comm.rank == 0 else []
