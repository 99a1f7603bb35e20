"""Hugging Face ``GPT2LMHeadModel``: ``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head``.

Everything shardwise knows of it: the block list (``transformer.h``), the tensor-parallel plan
(``Conv1D`` weights are (in, out), so cuts are transposed), the pipeline pieces (``attention_mask``,
``token_type_ids``, ``position_ids`` read on every stage as the model's forward reads them), its sizes
from a config.json (``model_type`` gpt2, read as JSON: transformers need not be installed), and the
seams through transformers' registries (``hf.py``). No communication here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from shardwise.config import ConfigError
from shardwise.models.adapters.base import Wrap
from shardwise.models.adapters.hf import HFAdapter, config_int, config_name, position_ids
from shardwise.models.adapters.plan import (
    AttentionCore,
    Colwise,
    Dropout,
    ParallelInput,
    QKVColwise,
    Rowwise,
    SequenceParallelNorm,
    SequenceSplit,
    TensorParallelPlan,
    VocabEmbedding,
)
from shardwise.planner.model import ModelShape


def hf_gpt2_plan(n_head: int) -> TensorParallelPlan:
    """``Conv1D`` weights are (in, out), so cuts are transposed; the attention reads ``split_size`` (the
    q/k/v width), divided by tp. Under sequence parallelism the embeddings stay whole (GPT-2 reads their
    length for positions and masks) and ``transformer.drop``'s output is cut."""
    return TensorParallelPlan(
        "hf-gpt2",
        {
            "transformer.wte": VocabEmbedding(sequence_output=False),
            "transformer.drop": SequenceSplit(dim=1),
            "transformer.h.*.ln_1": SequenceParallelNorm(),
            "transformer.h.*.attn": AttentionCore(opens=("c_attn",), closes="c_proj", divide=("split_size",)),
            "transformer.h.*.attn.c_attn": QKVColwise(n_head=n_head, n_kv_head=n_head, transposed=True),
            "transformer.h.*.attn.c_proj": Rowwise(transposed=True),
            "transformer.h.*.attn.attn_dropout": Dropout(split=True),
            "transformer.h.*.attn.resid_dropout": Dropout(),
            "transformer.h.*.ln_2": SequenceParallelNorm(),
            "transformer.h.*.mlp.c_fc": Colwise(transposed=True),
            "transformer.h.*.mlp.c_proj": Rowwise(transposed=True),
            "transformer.h.*.mlp.dropout": Dropout(),
            "transformer.ln_f": (SequenceParallelNorm(), ParallelInput(on="output")),
            "lm_head": Colwise(copy_input=False),
        },
    )


class HFGPT2Adapter(HFAdapter):
    """Hugging Face GPT-2."""

    name: ClassVar[str] = "hf-gpt2"
    module_name = "transformers.models.gpt2.modeling_gpt2"
    class_names = ("GPT2LMHeadModel", "GPT2Model")
    first_modules: ClassVar[tuple[str, ...]] = ("transformer.wte", "transformer.wpe", "transformer.drop")
    last_modules: ClassVar[tuple[str, ...]] = ("transformer.ln_f", "lm_head")
    blocks_path: ClassVar[str] = "transformer.h"
    attention_path: ClassVar[str] = "attn"
    body_path = "transformer"
    batch_keys: ClassVar[tuple[str, ...] | None] = ("attention_mask", "token_type_ids", "position_ids")

    def _tp_plan(self) -> TensorParallelPlan:
        return hf_gpt2_plan(self.model.config.n_head)

    # -- the pipeline ---------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.n_embd)

    def embed(self, ids: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        t, seq = self.model.transformer, ids.shape[-1]
        embeds = t.wte(ids.view(-1, seq))  # (batch, seq, hidden)
        hidden = embeds + t.wpe(position_ids(embeds, extras)).to(embeds.device)
        types = extras.get("token_type_ids")
        if types is not None:  # segment ids share the token embedding, added after the positions
            hidden = hidden + t.wte(types.view(-1, seq))
        return t.drop(hidden)

    def context(self, hidden: torch.Tensor, extras: dict[str, torch.Tensor]) -> dict[str, Any]:
        positions = position_ids(hidden, extras)
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

    # -- seams ----------------------------------------------------------------------------------

    def wrap_attention(self, wrap: Wrap) -> None:
        """Through transformers' ``AttentionInterface``; refused where GPT-2 would bypass it (its
        ``reorder_and_upcast_attn`` path under eager attention)."""
        if getattr(self.model.config, "reorder_and_upcast_attn", False):
            raise ConfigError(
                "GPT-2's reorder_and_upcast_attn computes attention outside transformers' "
                "AttentionInterface, so its attention cannot be replaced; turn it off in the config"
            )
        super().wrap_attention(wrap)

    # -- the planner ----------------------------------------------------------------------------

    @classmethod
    def reads(cls, config: dict[str, Any]) -> bool:
        """Whether a config.json is GPT-2's."""
        return config.get("model_type") == "gpt2" or "n_embd" in config

    @classmethod
    def config_shape(cls, config: dict[str, Any], path: Path) -> ModelShape:
        """GPT-2's sizes from its config.json (as JSON)."""
        positions = config_int(config, path, "n_positions", "max_position_embeddings")
        return ModelShape(
            n_layer=config_int(config, path, "n_layer"),
            d_model=config_int(config, path, "n_embd"),
            n_head=config_int(config, path, "n_head"),
            vocab=config_int(config, path, "vocab_size"),
            d_ff=config.get("n_inner") or 0,
            positions=positions,
            tie_weights=bool(config.get("tie_word_embeddings", True)),
            name=config_name(path),
            context=positions,
        )
