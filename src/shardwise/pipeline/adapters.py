"""How each model family runs piece by piece on pipeline stages, and what a stage reads of a micro-batch.

A stage replays its family's forward in pieces: the first stage embeds the token ids, every stage runs
its blocks, the last applies the final norm and the head. What the blocks need besides the hidden
state is derived on every stage from the micro-batch itself, by the same calls with the same arguments
as the whole model's forward: Hugging Face's causal mask from the batch's ``attention_mask`` (left
padding included) and ``position_ids`` (packed rows: a block-diagonal mask, as transformers detects
it), Llama's rotary tables from the position ids; GPT-2's ``token_type_ids`` and ``position_ids``
are embedded on the first stage as its forward embeds them. Every pp rank of a pipeline draws the
same micro-batches (the samplers shard a batch by dp rank), so nothing but the hidden state crosses
a stage boundary. A dict key a family's stages cannot honour is refused in one line naming it, never
dropped; so is a model whose forward is not its family's (``models/family.py``): a stage runs the
family's code, and a subclass's own forward would be skipped.

Families: the built-in GPT (token ids alone, as ``GPT.forward(idx)``), Hugging Face ``GPT2LMHeadModel``
(``attention_mask``, ``token_type_ids``, ``position_ids``) and ``LlamaForCausalLM``
(``attention_mask``, ``position_ids``), against transformers 5. No communication here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.config import ConfigError
from shardwise.engine.loss import model_inputs
from shardwise.models.family import GPT, HF_GPT2, HF_LLAMA, family_of


class SplitError(ConfigError):
    """A model that cannot be split as asked; the message says why and what to do."""


@dataclass(frozen=True)
class StageInputs:
    """What every stage reads of one micro-batch."""

    ids: torch.Tensor  # (batch, seq) token ids: the first stage embeds them; every stage reads the shape
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the batch's other model inputs


class Adapter:
    """How one model family runs piece by piece: embed, one block, head; and which modules are which."""

    first_modules: tuple[str, ...] = ()  # attribute paths kept on the first stage only
    last_modules: tuple[str, ...] = ()  # ... on the last stage only
    shared_modules: tuple[str, ...] = ()  # ... on every stage (parameter-free helpers: rotary tables)
    blocks_path: str = "blocks"
    batch_keys: tuple[str, ...] | None = None  # dict keys read besides input_ids; None: no dict batches

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model  # attribute paths differ per family: typed loosely on purpose

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

    def blocks(self) -> Any:
        return get_module(self.model, self.blocks_path)


class GPTAdapter(Adapter):
    """The built-in GPT: ``wte``/``wpe`` embeddings, ``blocks``, ``ln_f`` and ``head``."""

    first_modules = ("wte", "wpe", "drop")
    last_modules = ("ln_f", "head")

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.d_model)

    def embed(self, ids: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        m = self.model
        positions = torch.arange(ids.shape[1], device=ids.device)  # (seq,)
        return m.drop(m.wte(ids) + m.wpe(positions))  # (batch, seq, d_model)

    def block(self, index: int, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        return self.model.blocks[str(index)](hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.head(self.model.ln_f(hidden))  # (batch, seq, vocab)

    def tied_pair(self) -> tuple[str, str] | None:
        return ("wte.weight", "head.weight") if self.model.config.tie_weights else None


def _positions(hidden: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's ``position_ids``, else 0 .. seq - 1 (Hugging Face's default without a cache)."""
    given = extras.get("position_ids")
    if given is not None:
        return given
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, seq)


class HFAdapter(Adapter):
    """What Hugging Face families share: the causal mask as their body's forward makes it."""

    body_path = ""  # the module whose forward the family's forward calls (``transformer``, ``model``)

    def _like(self, hidden: torch.Tensor) -> torch.Tensor:
        """A stand-in for the body's ``inputs_embeds`` where only its batch, length, dtype and device are
        read (the mask, the rotary tables): the embedding's dtype, whatever dtype arrived."""
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), hidden.dtype)
        return hidden.new_empty((hidden.shape[0], hidden.shape[1], 0), dtype=dtype)

    def _cache(self) -> Any:
        """An empty cache where the body's forward makes one (``config.use_cache``, off under Hugging
        Face's own gradient checkpointing in training): with a cache, transformers does not look for
        packed rows in the position ids. The blocks are not given it (it would only keep keys)."""
        body, config = get_module(self.model, self.body_path), self.model.config
        use = bool(getattr(config, "use_cache", False))
        if getattr(body, "gradient_checkpointing", False) and body.training and torch.is_grad_enabled():
            use = False
        if not use:
            return None
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=config)

    def causal_mask(self, like: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> Any:
        from transformers.masking_utils import create_causal_mask

        return create_causal_mask(
            config=self.model.config, inputs_embeds=like, attention_mask=mask, cache=self._cache(),
            position_ids=positions,
        )  # fmt: skip

    def block_kwargs(self) -> dict[str, Any]:
        """What the body passes every block beyond the mask and positions: ``is_causal`` where the config
        has one (transformers' ``merge_with_config_defaults``)."""
        config = self.model.config
        return {"is_causal": config.is_causal} if hasattr(config, "is_causal") else {}


class HFGPT2Adapter(HFAdapter):
    """Hugging Face ``GPT2LMHeadModel``: ``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head``."""

    first_modules = ("transformer.wte", "transformer.wpe", "transformer.drop")
    last_modules = ("transformer.ln_f", "lm_head")
    blocks_path = "transformer.h"
    body_path = "transformer"
    batch_keys = ("attention_mask", "token_type_ids", "position_ids")

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.n_embd)

    def embed(self, ids: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        t, seq = self.model.transformer, ids.shape[-1]
        embeds = t.wte(ids.view(-1, seq))  # (batch, seq, hidden)
        hidden = embeds + t.wpe(_positions(embeds, extras)).to(embeds.device)
        types = extras.get("token_type_ids")
        if types is not None:  # segment ids share the token embedding, added after the positions
            hidden = hidden + t.wte(types.view(-1, seq))
        return t.drop(hidden)

    def context(self, hidden: torch.Tensor, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        positions = _positions(hidden, extras)
        mask = extras.get("attention_mask")
        if mask is not None and mask.ndim < 4:
            mask = mask.view(hidden.shape[0], -1)
        return {"mask": self.causal_mask(self._like(hidden), mask, positions), "positions": positions}

    def block(self, index: int, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        out = self.model.transformer.h[str(index)](
            hidden, attention_mask=context["mask"], position_ids=context["positions"], **self.block_kwargs()
        )
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.transformer.ln_f(hidden))

    def tied_pair(self) -> tuple[str, str] | None:
        tied = self.model.lm_head.weight is self.model.transformer.wte.weight
        return ("transformer.wte.weight", "lm_head.weight") if tied else None


class LlamaAdapter(HFAdapter):
    """Hugging Face ``LlamaForCausalLM``: ``model.{embed_tokens, layers, norm, rotary_emb}``, ``lm_head``."""

    first_modules = ("model.embed_tokens",)
    last_modules = ("model.norm", "lm_head")
    shared_modules = ("model.rotary_emb",)
    blocks_path = "model.layers"
    body_path = "model"
    batch_keys = ("attention_mask", "position_ids")

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def embed(self, ids: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def context(self, hidden: torch.Tensor, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        positions, like = _positions(hidden, extras), self._like(hidden)
        mask = self.causal_mask(like, extras.get("attention_mask"), positions)
        rotary = self.model.model.rotary_emb(like, position_ids=positions)  # (cos, sin)
        return {"mask": mask, "positions": positions, "rotary": rotary}

    def block(self, index: int, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        out = self.model.model.layers[str(index)](
            hidden,
            attention_mask=context["mask"],
            position_ids=context["positions"],
            position_embeddings=context["rotary"],
            **self.block_kwargs(),
        )
        return out[0] if isinstance(out, tuple) else out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))

    def tied_pair(self) -> tuple[str, str] | None:
        tied = self.model.lm_head.weight is self.model.model.embed_tokens.weight
        return ("model.embed_tokens.weight", "lm_head.weight") if tied else None


ADAPTERS: dict[str, type[Adapter]] = {GPT: GPTAdapter, HF_GPT2: HFGPT2Adapter, HF_LLAMA: LlamaAdapter}


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of ``model``'s family; a ``SplitError`` naming the families that split, or naming
    the class whose forward is its own."""
    family = family_of(
        model,
        why="a pipeline stage runs the parent's forward piece by piece, so yours would never run",
        fix="set parallel.pp = 1, or make the change in a module that forward calls (a block, the head)",
        error=SplitError,
    )
    if family is None:
        raise SplitError(
            f"a {type(model).__name__} cannot be split into pipeline stages: pp > 1 runs the built-in GPT "
            "and Hugging Face GPT2LMHeadModel and LlamaForCausalLM (or subclasses that keep their "
            "forward); set parallel.pp = 1"
        )
    return ADAPTERS[family](model)


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The module at attribute ``path`` (``transformer.h``) of ``root``; ``root`` itself for ''."""
    module = root
    for part in filter(None, path.split(".")):
        module = getattr(module, part)
    return module
