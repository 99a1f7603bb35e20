"""A model's block list: ZeRO-3's units (each child one unit) and what activation checkpointing recomputes.

A family's adapter names its list (``blocks`` in the built-in GPT, ``transformer.h`` in GPT-2,
``model.layers`` in Llama); for any other model (the fallback adapter) it is found: the
``nn.ModuleList`` / ``nn.Sequential`` with the most parameters whose children are all of one class.
``zero.unit`` names the list by its dotted path instead (``model.get_submodule``), for any model. A
model without one is trained by ZeRO-3 as a single unit. No communication: this only inspects the
module tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.config import ConfigError

# a pipeline stage keeps its blocks in a ModuleDict keyed by index (names survive the split)
BlockContainer = nn.ModuleList | nn.Sequential | nn.ModuleDict


@dataclass(frozen=True)
class BlockList:
    """A list of blocks: where it is, the modules, and what they hold."""

    path: str  # dotted, as model.get_submodule takes it ("" is the model itself)
    container: BlockContainer
    params: int  # parameter values under it, a shared tensor once

    @property
    def blocks(self) -> list[nn.Module]:
        """The blocks, in order (a ModuleDict's values, not its keys)."""
        return list(self.container.values() if isinstance(self.container, nn.ModuleDict) else self.container)

    def describe(self) -> str:
        kinds = sorted({type(child).__name__ for child in self.blocks})
        where = self.path or "(the model)"
        return f"{where} ({len(self.container)} x {'/'.join(kinds)}, {self.params:,} params)"


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a shared tensor once


def block_lists(model: nn.Module) -> list[BlockList]:
    """Every ModuleList/Sequential whose children are all of one class and hold parameters, the
    largest (by parameter count) first; equal sizes keep the model's order."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, BlockContainer) or len(module) == 0:
            continue
        children = module.values() if isinstance(module, nn.ModuleDict) else module
        if len({type(child) for child in children}) == 1 and (params := param_count(module)):
            found.append(BlockList(path, module, params))
    return sorted(found, key=lambda b: -b.params)  # sorted() is stable


def _candidates(model: nn.Module) -> str:
    found = block_lists(model)
    if not found:
        return "the model has no ModuleList/Sequential of blocks: leave zero.unit empty (one unit)"
    listed = "; ".join(b.describe() for b in found[:4])
    return f"block lists found: {listed}; set zero.unit to one of them, or leave it empty to pick the first"


def resolve_units(model: nn.Module, path: str) -> BlockList | None:
    """The block list ``path`` names, or (``path`` empty) the largest one found; None: there is none.

    A ``path`` that names nothing, or something that is not a ModuleList/Sequential, is a one-line
    ``ConfigError`` naming the path, what is there and the candidates.
    """
    if not path:
        found = block_lists(model)
        return found[0] if found else None
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ConfigError(
            f"zero.unit {path!r} names nothing in the model ({type(model).__name__}); {_candidates(model)}"
        ) from None
    if not isinstance(module, BlockContainer):
        raise ConfigError(
            f"zero.unit {path!r} is a {type(module).__name__}, not a ModuleList or Sequential of blocks; "
            f"{_candidates(model)}"
        )
    return BlockList(path, module, param_count(module))
