"""A model factory that cannot be built on the meta device (imported by name, not collected)."""

from __future__ import annotations

from torch import nn

from tests.unit.model_factories import TinyLM


def reads_its_values() -> nn.Module:
    """A build that reads a value it drew (as some do to pick a scale): it cannot run on meta."""
    model = TinyLM()
    if float(model.head.weight.detach().abs().max()) > 10:  # never true; the read is the point
        raise AssertionError("unreachable")
    return model
