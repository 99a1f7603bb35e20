"""The data-parallel registry: ``config.strategy`` -> the engine that applies it over the mesh (one place).

Each builder applies one strategy to a plain model in place, over the mesh's ``dp`` axis (the parameter
server over the world: its servers stand outside the mesh), and returns the ``Engine`` with its role
set, without optimizers: ``parallelize`` builds those over what the rank holds. With weights to start
from (``model.init_from``), each builder reads what its ranks hold: whole tensors, or (ZeRO-3) each
rank's shards. Communication: what each engine does at construction (rank 0's initial weights are
broadcast, or the servers' sent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import nn

from shardwise.checkpoint.pretrained import PretrainedWeights
from shardwise.config import TrainConfig
from shardwise.data_parallel.ddp import DDPEngine
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.engine.base import Engine, Role
from shardwise.mesh import Mesh
from shardwise.zero import build_zero_engine

Weights = PretrainedWeights | None
Builder = Callable[[TrainConfig, nn.Module, Mesh, bool, Weights], Engine]


def _ddp(
    config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
) -> Engine:
    if weights is not None:
        weights.load_whole(model)
    return DDPEngine(model, mesh.comm("dp"), config.ddp, Role.trainer(mesh.rank))


def _zero(stage: int) -> Builder:
    def build(
        config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
    ) -> Engine:
        zero = replace(config.zero, precision=config.compute_precision)
        return build_zero_engine(model, mesh.comm("dp"), stage, zero, Role.trainer(mesh.rank), weights)

    return build


def _ps(
    config: TrainConfig, model: nn.Module, mesh: Mesh, share_gradients: bool, weights: Weights
) -> Engine:
    if weights is not None:  # servers and workers alike hold whole tensors
        weights.load_whole(model)
    return ParamServerEngine(
        model, mesh.world, config.ps, config.steps, share_gradients, mesh.servers, config.on_nonfinite
    )


STRATEGIES: dict[str, Builder] = {
    "ddp": _ddp,
    "zero1": _zero(1),
    "zero2": _zero(2),
    "zero3": _zero(3),
    "ps": _ps,
}


def build_data_parallel(
    config: TrainConfig,
    model: nn.Module,
    mesh: Mesh,
    share_gradients: bool = False,
    weights: PretrainedWeights | None = None,
) -> Engine:
    """Apply ``config.strategy`` to ``model`` over ``mesh``; ``share_gradients``: make global gradients
    visible where a strategy keeps them elsewhere (the parameter server's workers), for ``verify``;
    ``weights``: the initial values (parameters on meta are materialised from them)."""
    builder = STRATEGIES.get(config.strategy)
    if builder is None:
        raise ValueError(f"unknown strategy {config.strategy!r}; known: {', '.join(STRATEGIES)}")
    return builder(config, model, mesh, share_gradients, weights)
