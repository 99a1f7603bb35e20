"""The data-parallel registry: ``config.strategy`` -> the engine that applies it over the mesh (one place).

Each builder applies one strategy to a plain model in place, over the mesh's ``dp`` axis (the parameter
server over the world: its servers stand outside the mesh), and returns the ``Engine`` with its role
set, without optimizers: ``parallelize`` builds those over what the rank holds. With weights to start
from (``model.init_from``), each builder reads what its ranks hold: whole tensors, or (ZeRO-3) each
rank's shards. With ``comm.compress`` each engine gets the one codec layer
(``compression.CompressedComm``) over the ``Comm`` it reduces gradients on. Communication: what each
engine does at construction (rank 0's initial weights are
broadcast, or the servers' sent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from shardwise.checkpoint.source import HeldWeights
from shardwise.collectives.api import Comm
from shardwise.compression import CompressedComm, build_compressed, check_compress
from shardwise.config import TrainConfig
from shardwise.data.sampler import split_counts
from shardwise.data_parallel.ddp import DDPEngine
from shardwise.data_parallel.diloco import DiLoCoEngine
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.engine.base import Engine, Role
from shardwise.mesh import Mesh
from shardwise.zero import build_zero_engine
from shardwise.zero.hybrid import attach_hybrid

Weights = HeldWeights | None
Builder = Callable[[TrainConfig, nn.Module, Mesh, bool, Weights], Engine]


def _compressor(config: TrainConfig, comm: Comm) -> CompressedComm | None:
    """The codec layer over ``comm`` when ``comm.compress`` is set (one per engine; None otherwise)."""
    check_compress(config.comm, config.strategy)
    return build_compressed(comm, config.comm, config.optim.clip_grad_norm)


def _ddp(
    config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
) -> Engine:
    dp = mesh.comm("dp")
    return DDPEngine(model, dp, config.ddp, Role.trainer(mesh.rank), _compressor(config, dp))


def _zero(stage: int) -> Builder:
    def build(
        config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
    ) -> Engine:
        zero = replace(config.zero, precision=config.compute_precision)
        hybrid = config.parallel.dp_replicate > 1
        dp = mesh.comm("dp_shard" if hybrid else "dp")  # hybrid: shard within a group, replicate across
        role, compressor = Role.trainer(mesh.rank), _compressor(config, dp)
        engine = build_zero_engine(model, dp, stage, zero, role, weights, compressor)
        if hybrid:
            attach_hybrid(engine, mesh.comm("dp_replicate"))
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
