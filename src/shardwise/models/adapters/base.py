"""The adapter protocol: what shardwise asks of a model family, and the rule for who belongs to one.

An adapter (``adapter_for(model)``) answers for one model: its block list (ZeRO-3's units and
activation checkpointing), its tensor-parallel plan, how a pipeline stage runs it piece by piece and
what every stage reads of a micro-batch, and the seams the next axes hook into: the attention
computation (context parallelism will replace it to see the whole sequence) and the MoE experts
(expert parallelism will dispatch tokens around them). The planner's shape readers sit on the
family classes too (``preset_shape``, ``hf_shape`` in ``__init__``).

A pipeline stage replays its family's forward in pieces: the first stage embeds the token ids, every
stage runs its blocks, the last applies the final norm and the head. What the blocks need besides the
hidden state is derived on every stage from the micro-batch itself, by the same calls with the same
arguments as the whole model's forward (the causal mask with the batch's padding, position ids,
Llama's rotary tables; see each family's ``context``). Every pp rank of a pipeline draws the same
micro-batches (the samplers shard a batch by dp rank), so nothing but the hidden state crosses a stage
boundary. A dict key a family's stages cannot honour is refused in one line naming it, never dropped.

The family rule. The pipeline replays a family's forward piece by piece and tensor parallelism's plans
are written for what a family's forward hands each layer; both must run the model's own code, so a
model belongs to a family (for pp and tp) only when its forward *is* the family's: its class is the
family's class, or a subclass that does not override ``forward``, and the body that forward calls
(Hugging Face's ``transformer`` / ``model``) keeps its own forward too. A subclass whose forward differs
is refused in one line naming the class, never trained as its parent. Blocks, ZeRO-3 and activation
checkpointing run whatever forward the model has, so they ask no such thing. No communication here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.config import ConfigError
from shardwise.engine.loss import model_inputs
from shardwise.models.adapters.blocks import BlockList, param_count, resolve_units
from shardwise.models.adapters.plan import TensorParallelPlan

# what a step replacing a seam is given (the function now in place) and returns (the one to use)
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

TP_WHY = (
    "tensor parallelism hands the forward logits cut by vocabulary (a tp-th of them), which yours was not "
    "written for"
)
PP_WHY = "a pipeline stage runs the parent's forward piece by piece, so yours would never run"
PP_FIX = "set parallel.pp = 1, or make the change in a module that forward calls (a block, the head)"


class SplitError(ConfigError):
    """A model that cannot be split as asked; the message says why and what to do."""


@dataclass(frozen=True)
class StageInputs:
    """What every stage reads of one micro-batch."""

    ids: torch.Tensor  # (batch, seq) token ids: the first stage embeds them; every stage reads the shape
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the batch's other model inputs


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The module at attribute ``path`` (``transformer.h``) of ``root``; ``root`` itself for ''."""
    module = root
    for part in filter(None, path.split(".")):
        module = getattr(module, part)
    return module


def _own_forward(module: nn.Module, parent: type[nn.Module]) -> bool:
    """Whether ``module`` runs ``parent.forward``: not overridden by its class nor set on the instance."""
    return type(module).forward is parent.forward and "forward" not in vars(module)


class ModelAdapter:
    """What shardwise knows of one model family; an instance holds one model.

    Subclasses set the class attributes and implement the pieces; the fallback
    (``fallback.py``) implements only the block list and refuses the rest by name.
    """

    name: ClassVar[str] = ""  # the family's name ("" for the fallback)
    blocks_path: ClassVar[str] = ""  # the block list's attribute path; "": found (``blocks.py``)
    attention_path: ClassVar[str] = ""  # a block's attention module, relative to the block
    first_modules: ClassVar[tuple[str, ...]] = ()  # attribute paths kept on the first stage only
    last_modules: ClassVar[tuple[str, ...]] = ()  # ... on the last stage only
    shared_modules: ClassVar[tuple[str, ...]] = ()  # ... on every stage (parameter-free: rotary tables)
    batch_keys: ClassVar[tuple[str, ...] | None] = None  # dict keys read besides input_ids; None: no dicts

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model  # attribute paths differ per family: typed loosely on purpose

    @classmethod
    def root(cls) -> type[nn.Module] | None:
        """The family's class, or None where it cannot be here (Hugging Face's, before transformers
        is imported: then no model of it was built)."""
        return None

    @classmethod
    def body(cls) -> tuple[str, type[nn.Module]] | None:
        """(path, class) of the module whose forward the family's forward calls, if any."""
        return None

    # -- the family rule -------------------------------------------------------------------------

    def check_forward(self, why: str, fix: str, error: type[ConfigError] = ConfigError) -> None:
        """Refuse (``error``: ``<class>.forward overrides <family class>.forward, and <why>; <fix>``) a
        model whose forward, or whose body's forward, is not the family's."""
        root = self.root()
        if root is None:
            return
        name = type(self.model).__name__
        if not _own_forward(self.model, root):
            raise error(f"{name}.forward overrides {root.__name__}.forward, and {why}; {fix}")
        if (body := self.body()) is not None:
            path, body_class = body
            module = getattr(self.model, path, None)
            if isinstance(module, nn.Module) and not _own_forward(module, body_class):
                raise error(
                    f"{name}.{path} is a {type(module).__name__}, whose forward overrides "
                    f"{body_class.__name__}.forward, and {why}; {fix}"
                )

    # -- blocks: ZeRO-3's units, activation checkpointing ---------------------------------------

    def block_list(self, unit: str = "") -> BlockList | None:
        """The block list: the one ``unit`` names (``zero.unit``, any model), else the family's
        (found, for the fallback); None: the model has none."""
        if unit or not self.blocks_path:
            return resolve_units(self.model, unit)
        container = get_module(self.model, self.blocks_path)
        if not isinstance(container, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            return resolve_units(self.model, "")
        return BlockList(self.blocks_path, container, param_count(container))

    def blocks(self) -> Any:
        """The block container at ``blocks_path`` (a ModuleList; a ModuleDict after the split)."""
        return get_module(self.model, self.blocks_path)

    # -- tensor parallelism ---------------------------------------------------------------------

    def tp_plan(self) -> TensorParallelPlan:
        """The family's tensor-parallel plan (``models/adapters/plan.py``), after the family rule."""
        self.check_forward(why=TP_WHY, fix="set parallel.tp = 1")
        return self._tp_plan()

    def _tp_plan(self) -> TensorParallelPlan:
        raise NotImplementedError

    # -- the pipeline ---------------------------------------------------------------------------

    def check_pipeline(self) -> None:
        """Refuse (``SplitError``) a model a pipeline stage cannot replay."""
        self.check_forward(why=PP_WHY, fix=PP_FIX, error=SplitError)

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    def inputs(self, batch: Any) -> StageInputs:
        """The token ids and the extras of ``batch``, as the model would be called with them; a key
        the family's stages do not honour is refused (``SplitError``, one line naming it)."""
        args, kwargs = model_inputs(batch)
        if args:
            return StageInputs(args[0])
        name = type(self.model).__name__
        if self.batch_keys is None:
            raise SplitError(
                f"a dict batch ({', '.join(map(repr, kwargs))}) for {name}, whose forward takes the token "
                "ids alone: give tensors or (inputs, targets) batches"
            )
        known = ("input_ids", *self.batch_keys)
        for key in kwargs:
            if key not in known:
                raise SplitError(
                    f"batch key {key!r}: a pipeline stage of {name} reads {', '.join(known)} of a dict batch "
                    f"(and labels, for the loss), so it would drop {key!r}; remove it from the batch, or "
                    "set parallel.pp = 1"
                )
        if "input_ids" not in kwargs:
            raise SplitError(
                f"a dict batch without 'input_ids' ({', '.join(map(repr, kwargs))}): the first pipeline "
                f"stage of {name} embeds them; add them, or set parallel.pp = 1"
            )
        extras = {k: v for k, v in kwargs.items() if k != "input_ids"}
        return StageInputs(kwargs["input_ids"], extras)

    def embed(self, ids: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def context(self, hidden: torch.Tensor, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What every block needs besides the hidden state, from its shape and the batch's extras."""
        return {}

    def block(self, index: int, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tied_pair(self) -> tuple[str, str] | None:
        """(owner on the first stage, user on the last stage) of a weight tied across them, or None."""
        return None

    # -- seams for the next axes ----------------------------------------------------------------

    def attention_modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every block's attention, in block order: the modules context parallelism
        will give the whole sequence's keys and values."""
        found = self.block_list()
        if found is None:
            return []
        path = self.attention_path
        return [
            (f"{found.path}.{k}.{path}", get_module(b, path)) for k, b in found.container.named_children()
        ]

    def wrap_attention(self, wrap: Wrap) -> None:
        """Route every attention computation through ``wrap(current)``, called in the family's own
        convention (each family says which); context parallelism will use it."""
        raise NotImplementedError

    def moe_layers(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every module that holds a layer's experts: what expert parallelism will
        split over ep. Empty for a dense model."""
        return []

    def wrap_experts(self, wrap: Wrap) -> None:
        """Route every experts computation through ``wrap(current)``; expert parallelism will use it."""
        raise ConfigError(
            f"{type(self.model).__name__} has no MoE layers, so there are no experts to route; "
            "expert parallelism needs a mixture-of-experts model"
        )
