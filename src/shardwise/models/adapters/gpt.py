"""The built-in GPT (``models/gpt.py``): ``wte``/``wpe`` embeddings, ``blocks``, ``ln_f`` and ``head``.

Everything shardwise knows of it: the block list (``blocks``), the tensor-parallel plan (vocab-cut
embedding and head, tied: one box; attention by heads through the fused ``qkv``; the MLP column then
row), the pipeline pieces (token ids alone, as ``GPT.forward(idx)``; the embedding tied to the head
across the first and last stages), its sizes for the planner (a preset, read without building it), and
the attention seam: each block's ``attn.attention`` (``scaled_dot_product_attention`` by default),
which context parallelism will replace. No communication here.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.config import ConfigError, ModelConfig
from shardwise.models import GPT_KIND, PRESETS
from shardwise.models.adapters.base import ModelAdapter, Wrap
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
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.hf import BYTE_VOCAB
from shardwise.planner.model import ModelShape


def gpt_plan(n_head: int) -> TensorParallelPlan:
    """The built-in GPT's tensor-parallel plan: vocab-cut embedding and head (tied: one box), attention
    by heads through the fused ``qkv``, the MLP column then row."""
    return TensorParallelPlan(
        "gpt",
        {
            "wte": VocabEmbedding(),
            "wpe": SequenceSplit(dim=0),  # positions (seq,) -> (seq, d_model): the sequence is dim 0
            "drop": Dropout(),
            "blocks.*.ln_1": SequenceParallelNorm(),
            # the attention reads the sequence length from its input: gather it there (under sequence
            # parallelism), not inside qkv
            "blocks.*.attn": (ParallelInput(), AttentionCore(opens=("qkv",), closes="proj")),
            "blocks.*.attn.qkv": QKVColwise(n_head=n_head, n_kv_head=n_head, copy_input=False),
            "blocks.*.attn.proj": Rowwise(),
            "blocks.*.attn.resid_dropout": Dropout(),
            "blocks.*.ln_2": SequenceParallelNorm(),
            "blocks.*.mlp.fc": Colwise(),
            "blocks.*.mlp.proj": Rowwise(),
            "blocks.*.mlp.dropout": Dropout(),
            "ln_f": SequenceParallelNorm(),
            "head": Colwise(),  # logits stay cut by vocabulary: use vocab_parallel_cross_entropy
        },
    )


class GPTAdapter(ModelAdapter):
    """The built-in GPT."""

    name: ClassVar[str] = "gpt"
    blocks_path: ClassVar[str] = "blocks"
    attention_path: ClassVar[str] = "attn"
    first_modules: ClassVar[tuple[str, ...]] = ("wte", "wpe", "drop")
    last_modules: ClassVar[tuple[str, ...]] = ("ln_f", "head")

    @classmethod
    def root(cls) -> type[nn.Module]:
        return GPT

    def _tp_plan(self) -> TensorParallelPlan:
        return gpt_plan(self.model.config.n_head)

    # -- the pipeline ---------------------------------------------------------------------------

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

    # -- seams ----------------------------------------------------------------------------------

    def wrap_attention(self, wrap: Wrap) -> None:
        """Each block's ``attn.attention`` becomes ``wrap(attn.attention)``: called as
        ``scaled_dot_product_attention(q, k, v, dropout_p=, is_causal=True)`` with q, k, v of
        (batch, heads on this rank, seq, head_dim), returning the same shape as q."""
        for _, attn in self.attention_modules():
            seam: Any = attn
            seam.attention = wrap(seam.attention)

    # -- the planner ----------------------------------------------------------------------------

    @classmethod
    def preset_shape(cls, preset: str, seq_len: int, tie_weights: bool = True) -> ModelShape:
        """The sizes of ``preset`` (see ``shardwise.models.PRESETS``) at ``seq_len`` learned positions."""
        sizes = PRESETS[GPT_KIND].get(preset)
        if sizes is None:
            known = ", ".join(PRESETS[GPT_KIND])
            raise ConfigError(f"unknown {GPT_KIND} preset {preset!r}; known presets: {known}")
        return ModelShape(
            n_layer=sizes["n_layer"],
            d_model=sizes["d_model"],
            n_head=sizes["n_head"],
            vocab=BYTE_VOCAB,
            d_ff=sizes.get("d_ff", 0),
            positions=seq_len,
            tie_weights=tie_weights,
            name=f"{GPT_KIND} {preset}",
        )

    @classmethod
    def from_shape(cls, shape: ModelShape) -> nn.Module:
        """The built-in GPT of ``shape``'s sizes (built under the caller's device context, e.g. meta)."""
        sizes = GPTConfig(
            vocab_size=shape.vocab, seq_len=shape.positions, n_layer=shape.n_layer, n_head=shape.n_head,
            d_model=shape.d_model, d_ff=shape.ff, tie_weights=shape.tie_weights,
        )  # fmt: skip
        return GPT(sizes)

    @classmethod
    def config_blocks(cls, cfg: ModelConfig) -> int | None:
        """The blocks of the model ``cfg`` describes, read from its preset (0 for an unknown one), or
        None when ``cfg`` is not the built-in GPT."""
        if cfg.kind != GPT_KIND:
            return None
        return int(PRESETS[GPT_KIND].get(cfg.preset, {}).get("n_layer", 0))
