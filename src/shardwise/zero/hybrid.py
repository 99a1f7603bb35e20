"""Hybrid sharding (HSDP; ZeRO++'s hpZ): ZeRO within a group of ranks, replicas across groups.

The dp axis is cut into ``dp_shard`` x ``dp_replicate`` (``mesh.hybrid_groups``): a ZeRO engine shards
over its shard group (consecutive ranks, a node), so its gathers and reduce-scatters stay inside it;
the groups hold the same shards. ``attach_hybrid`` adds what the replicas need, over the replicate
group (Zhang et al., 2022, PyTorch FSDP's HYBRID_SHARD; Wang et al., 2023, ZeRO++):

- after ``finish_grads`` (each shard summed over its group), one all-reduce of each gradient shard over
  the replicas, so every replica steps on the gradient of the whole global batch;
- which parameters got a gradient is agreed over the replicas too (``usage_comms``), so a parameter
  unused on one replica's share is treated alike everywhere;
- checkpoints: only the first replica writes (the others hold the same shards).

The norm needs nothing: a shard group's share already counts each element once and the replicas agree.
Communication: per step, one all-reduce over ``dp_replicate`` per flat group (the shard's size) and one
small all-reduce of the used flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.zero.base import ZeroBase


def attach_hybrid(engine: ZeroBase, replicate: Comm) -> None:
    """Make ``engine`` (sharded over its shard group) one replica of ``replicate.world_size``."""
    engine.usage_comms.append(replicate)
    local_finish, local_pieces = engine.finish_grads, engine.state_pieces

    def finish_grads() -> None:
        local_finish()
        for group in engine.groups:
            if group.grad_shard is not None:
                replicate.all_reduce(group.grad_shard, label="hybrid replicas")

    def state_pieces(_rank: int, _world_size: int) -> list[Piece]:
        """The first replica's shard group writes; its ranks are numbered within the group."""
        return local_pieces(engine.comm.rank, engine.comm.world_size) if replicate.rank == 0 else []

    overrides: dict[str, Callable[..., Any]] = {"finish_grads": finish_grads, "state_pieces": state_pieces}
    engine.override(overrides)
