"""The data-parallel axis: ``config.strategy`` -> the engine that applies it over the mesh (one place).

``DataParallel`` is the axis object ``parallelize`` calls last: the engine built by the registry,
joined to the mesh's groups. Each builder applies one strategy to a plain model in place, over the
mesh's data-parallel groups (DDP reduces dense gradients over ``dense_grads``; ZeRO shards over
``dp_shard``, with hybrid sharding's replicas an axis of its own; the parameter server over the world:
its servers stand outside the mesh), and returns the ``Engine`` with its role set, without
optimizers: ``parallelize`` builds those over what the rank holds. With weights to start
from (``model.init_from``), each builder reads what its ranks hold: whole tensors, or (ZeRO-3) each
rank's shards. With ``comm.compress`` each engine gets the one codec layer
(``compression.CompressedComm``) over the ``Comm`` it reduces gradients on. Communication: what each
engine does at construction (rank 0's initial weights are broadcast, or the servers' sent).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

from torch import nn

from shardwise.checkpoint.source import HeldWeights
from shardwise.collectives.api import Comm
from shardwise.compression import CompressedComm, build_compressed, check_compress
from shardwise.config import ConfigError, TrainConfig
from shardwise.data.sampler import split_counts
from shardwise.data_parallel.ddp import DDPEngine
from shardwise.data_parallel.diloco import DiLoCoEngine
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.data_parallel.sync_batchnorm import convert_sync_batchnorm, has_batchnorm
from shardwise.engine.base import Engine, Role
from shardwise.errors import NotBuiltError
from shardwise.mesh import Mesh
from shardwise.zero import build_zero_engine
from shardwise.zero.hybrid import HybridReplicas

Weights = HeldWeights | None
Builder = Callable[[TrainConfig, nn.Module, Mesh, bool, Weights], Engine]


def _compressor(config: TrainConfig, comm: Comm) -> CompressedComm | None:
    """The codec layer over ``comm`` when ``comm.compress`` is set (one per engine; None otherwise)."""
    check_compress(config.comm, config.strategy)
    return build_compressed(comm, config.comm, config.optim.clip_grad_norm)


def _ddp(
    config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
) -> Engine:
    dp = mesh.comm("dense_grads")
    return DDPEngine(model, dp, config.ddp, Role.trainer(mesh.rank), _compressor(config, dp))


def _zero(stage: int) -> Builder:
    def build(
        config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
    ) -> Engine:
        zero = replace(config.zero, precision=config.compute_precision)
        dp = mesh.comm("dp_shard")  # hybrid sharding: shard within a group, replicate across groups
        role, compressor = Role.trainer(mesh.rank), _compressor(config, dp)
        engine = build_zero_engine(model, dp, stage, zero, role, weights, compressor)
        if mesh.dims.dp_replicate > 1:
            engine.axes.append(HybridReplicas(engine, mesh.comm("dp_replicate")))
        return engine

    return build


def _ps(
    config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
) -> Engine:
    world = mesh.world
    return ParamServerEngine(
        model, world, config.ps, config.steps, share_gradients, mesh.servers, config.on_nonfinite,
        _compressor(config, world),
    )  # fmt: skip


def _diloco(
    config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
) -> Engine:
    dp = mesh.comm("dp")
    batch = config.data.global_batch
    counts = split_counts(batch, config.data.weights or [1.0] * dp.world_size)
    share = counts[dp.rank] / batch if batch else 0.0
    compressor = _compressor(config, dp)
    return DiLoCoEngine(model, dp, config.diloco, config.steps, share, Role.trainer(mesh.rank), compressor)


# strategies whose engines read the initial values themselves: ZeRO-1/2 bucket by bucket into their flat
# buffers, ZeRO-3 each rank's shards; the others get whole tensors before they are built
READS_ITSELF = ("zero1", "zero2", "zero3")

STRATEGIES: dict[str, Builder] = {
    "ddp": _ddp,
    "zero1": _zero(1),
    "zero2": _zero(2),
    "zero3": _zero(3),
    "ps": _ps,
    "diloco": _diloco,
}


def build_data_parallel(
    config: TrainConfig,
    model: nn.Module,
    mesh: Mesh,
    share_gradients: bool = False,
    weights: HeldWeights | None = None,
) -> Engine:
    """Apply ``config.strategy`` to ``model`` over ``mesh``; ``share_gradients``: make global gradients
    visible where a strategy keeps them elsewhere (the parameter server's workers), for ``verify``;
    ``weights``: the initial values (parameters on meta are materialised from them)."""
    builder = STRATEGIES.get(config.strategy)
    if builder is None:
        raise ValueError(f"unknown strategy {config.strategy!r}; known: {', '.join(STRATEGIES)}")
    if weights is not None and config.strategy not in READS_ITSELF:  # every rank holds whole tensors
        weights.load_whole(model)
        weights = None
    return builder(config, model, mesh, share_gradients, weights)


class DataParallel:
    """The data-parallel axis, the last step of ``parallelize``: ``config.strategy``'s engine over what
    this rank holds once the model axes cut it (tp, cp, ep, pp), joined to the mesh: items counted
    over the batch group (dp x cp), the norm's and the loss's shares summed over every rank that steps;
    BatchNorm layers first made synchronous over dp when asked (else a one-line notice)."""

    def __init__(self, mesh: Mesh, config: TrainConfig, share_gradients: bool = False) -> None:
        check_hybrid(config)
        self.mesh, self.config, self.share_gradients = mesh, config, share_gradients

    def apply(self, model: nn.Module, weights: Weights = None) -> Engine:
        mesh, config = self.mesh, self.config
        apply_batchnorm(model, mesh, config)
        engine = build_data_parallel(config, model, mesh, self.share_gradients, weights)
        engine.batch_comm = mesh.comm("batch") if mesh.in_mesh else None
        engine.trainers = mesh.trainers
        engine.clip_grad_norm = config.optim.clip_grad_norm
        engine.on_nonfinite = config.on_nonfinite
        if engine.units_are_parameters:  # ZeRO took the precision at construction (compute copies)
            engine.use_precision(config.compute_precision)
        return engine


def check_hybrid(config: TrainConfig) -> None:
    """Hybrid sharding: ZeRO only, no codec (its error feedback is per shard group), replicas that
    divide the dp degree (checked again with the world's size when the mesh is built)."""
    replicate = config.parallel.dp_replicate
    if replicate == 1:
        return
    if config.strategy not in ("zero1", "zero2", "zero3"):
        raise ConfigError(
            f"parallel.dp_replicate = {replicate} is hybrid sharding: ZeRO shards within groups and the "
            f"groups replicate; --strategy {config.strategy} does not shard: use zero1, zero2 or zero3"
        )
    if config.comm.compress:
        raise NotBuiltError("gradient compression with hybrid sharding (--dp-replicate) is not built yet")
    dp = config.parallel.dp
    if dp != -1 and dp % replicate:
        raise ConfigError(f"parallel.dp_replicate = {replicate} does not divide dp = {dp}")


def apply_batchnorm(model: nn.Module, mesh: Mesh, config: TrainConfig) -> None:
    """BatchNorm under data parallelism: synchronous over ``dp`` when asked, else said once."""
    if not has_batchnorm(model) or not mesh.in_mesh or mesh.dims.dp == 1:
        return
    if config.sync_batchnorm:
        convert_sync_batchnorm(model, mesh.comm("dp"))
    elif mesh.comm("dp").rank == 0 and mesh.dims.trainers == mesh.dims.dp:  # dp alone: said once
        print(
            "shardwise: the model has BatchNorm layers: each rank normalises with its own share's "
            "statistics (--sync-batchnorm uses the global batch's)",
            file=sys.stderr,
            flush=True,
        )
