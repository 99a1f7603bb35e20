"""A small GPT: byte tokens in, next-byte logits out.

Written plainly, as the reference model every strategy is checked against. There is no communication
here: parallelism (data, ZeRO, pipeline, tensor) is applied from outside. Pre-LayerNorm transformer
blocks as in GPT-2 (Radford et al., 2019), causal attention through
``F.scaled_dot_product_attention``. Two layout choices the parallel code relies on:

- the blocks live in ``self.blocks`` (an ``nn.ModuleList``): ZeRO-3 gathers one block at a time and the
  pipeline splits the model between blocks;
- the model holds no buffers, only parameters; positions are made on the fly;
- the attention between the projections is a seam: ``attn.attention``, called as
  ``scaled_dot_product_attention`` (its default), which context parallelism will replace
  (``models/adapters/gpt.py``: ``wrap_attention``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64  # longest sequence the position table covers
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    d_ff: int | None = None  # None means 4 * d_model
    dropout: float = 0.0
    tie_weights: bool = True  # the output head reuses the token embedding matrix

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.d_model % self.n_head:
            raise ValueError(f"d_model({self.d_model}) is not divisible by n_head({self.n_head})")
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.d_model // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)  # queries, keys, values in one matmul
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)
        # (q, k, v) of (batch, heads, seq, head_dim) -> (batch, heads, seq, head_dim), with
        # scaled_dot_product_attention's keywords: the seam context parallelism replaces
        self.attention: Callable[..., torch.Tensor] = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 x (batch, seq, d_model)
        # (batch, seq, d_model) -> (batch, n_head, seq, head_dim). Heads are counted from the width,
        # so the same code runs when tensor parallelism leaves a rank only some of the heads.
        heads = q.size(-1) // self.head_dim
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = self.attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim)  # heads side by side
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    """Position-wise MLP: d_model -> d_ff -> d_model with a GELU in between."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width = config.d_ff or 4 * config.d_model  # d_ff is set by __post_init__; this tells the type
        self.fc = nn.Linear(config.d_model, width)
        self.proj = nn.Linear(width, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over byte tokens: ``forward(idx) -> logits``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)  # token embedding
        self.wpe = nn.Embedding(config.seq_len, config.d_model)  # learned position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.wte.weight  # one Parameter, two uses
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: normal(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 n_layer).

        Draws from the global torch RNG in module order, so the caller's ``torch.manual_seed`` fixes
        every value.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.Linear):
                if name == "head" and self.config.tie_weights:
                    continue  # the shared matrix was initialised as wte
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (batch, seq) token ids -> logits (batch, seq, vocab)."""
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence of {seq} tokens is longer than the model's seq_len {self.config.seq_len}"
            )
        positions = torch.arange(seq, device=idx.device)  # (seq,)
        x = self.drop(self.wte(idx) + self.wpe(positions))  # (batch, seq, d_model)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (batch, seq, vocab)
