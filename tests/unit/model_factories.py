"""Model factories for the ``--model package.module:function`` tests (imported by name, not collected)."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.config import ModelConfig


class TinyLM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, 256): embedding, blocks, head; positions learnt."""

    def __init__(self, seq_len: int = 64, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.size(1)]
        return self.head(torch.tanh(self.blocks(h)))


def tiny_lm() -> nn.Module:
    """Called with no arguments."""
    return TinyLM()


def sized_lm(config: ModelConfig) -> nn.Module:
    """Called with the run's ModelConfig: sized by its seq_len."""
    return TinyLM(seq_len=config.seq_len, dim=12, layers=3)


def not_a_model() -> dict[str, int]:
    return {"layers": 2}


NOT_CALLABLE = 3
