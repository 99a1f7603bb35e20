"""The data-parallel layer: its interface (``base``), the update (``update``), whole-tensor state (``state``),
optimizers (``optim``)."""

from shardwise.engine.base import Batch, Engine, Role
from shardwise.engine.loss import loss_sum
from shardwise.engine.state import StateReader
from shardwise.engine.update import NamedTensors

__all__ = ["Batch", "Engine", "NamedTensors", "Role", "StateReader", "loss_sum"]
