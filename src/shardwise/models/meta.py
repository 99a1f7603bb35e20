"""Build a model whose parameters hold no data (the meta device) while its buffers are real.

With ``model.init_from`` the weights come from a file, so drawing random ones first is wasted time and,
for a model larger than one rank's share, memory that ZeRO-3 must never hold. ``parameters_on_meta()``
patches ``nn.Module.register_parameter`` for the duration of a ``with`` (as
``accelerate.init_empty_weights`` does): every parameter a module registers becomes a meta tensor of the
same shape, dtype and ``requires_grad``. Initialisers then run on meta tensors (no memory, no compute),
while buffers (rotary frequencies, causal masks), which weight files do not hold, are computed for real.
A parameter registered again (a tied head) is already on meta and kept, so ties survive. Each parameter
is real only for the instant between its constructor's ``torch.empty`` and its registration. The
strategies then materialise the parameters from the file (``shardwise.checkpoint.pretrained``). No
communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the ``with``, every parameter a module registers is moved to the meta device."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def meta_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters that hold no data yet."""
    return [name for name, p in model.named_parameters() if p.is_meta]
