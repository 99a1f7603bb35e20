"""Which parameters of a model hold no data yet (the meta device).

Models are built on the meta device with their initialisation recorded
(:mod:`shardwise.models.init_record`); each rank then materialises what it holds
(:mod:`shardwise.materialize`). ``meta_parameters`` names what is still without values, so that no
engine ever trains on none. No communication.
"""

from __future__ import annotations

from torch import nn


def meta_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters that hold no data yet."""
    return [name for name, p in model.named_parameters() if p.is_meta]
