"""A Bengio-style next-byte model: embed a fixed window of bytes, concatenate, run an MLP.

Follows Bengio et al., "A Neural Probabilistic Language Model" (2003). No communication here. It is the
smallest model that still learns something from the corpus, and with ``batch_norm=True`` it carries
buffers (BatchNorm running statistics), which is what data-parallel buffer broadcasting is tested on.

It predicts ONE token per sequence: the one after the last ``context`` tokens of ``idx``. Its logits
have shape (batch, 1, vocab), so the loss pairs them with ``targets[:, -1:]``; in general
``targets[:, -logits.size(1):]`` works for both this model and the GPT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    vocab_size: int = 256
    context: int = 16  # how many of the last tokens the model sees
    d_embed: int = 32
    d_hidden: int = 256
    n_layer: int = 2  # hidden layers
    dropout: float = 0.0
    batch_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_embed", "d_hidden", "n_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLPConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MLPConfig.dropout must be in [0, 1), got {self.dropout}")


class HiddenLayer(nn.Module):
    """Linear, then BatchNorm1d (optional), then GELU and dropout."""

    def __init__(self, d_in: int, d_out: int, config: MLPConfig) -> None:
        super().__init__()
        # With batch norm right after, a bias would be cancelled by the mean subtraction.
        self.fc = nn.Linear(d_in, d_out, bias=not config.batch_norm)
        self.norm = nn.BatchNorm1d(d_out) if config.batch_norm else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(F.gelu(self.norm(self.fc(x))))


class MLP(nn.Module):
    """``forward(idx) -> logits`` of the token that follows the last ``context`` tokens."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_embed)
        d_in = config.context * config.d_embed
        layers = []
        for _ in range(config.n_layer):
            layers.append(HiddenLayer(d_in, config.d_hidden, config))
            d_in = config.d_hidden
        self.blocks = nn.ModuleList(layers)  # named like the GPT's, for ZeRO-3 units
        self.head = nn.Linear(d_in, config.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, 0.02) weights, zero biases, BatchNorm at identity; uses the global torch RNG."""
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    nn.init.zeros_(bias)
            elif isinstance(module, nn.BatchNorm1d):
                module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (batch, seq) with seq >= context -> logits (batch, 1, vocab)."""
        seq = idx.size(1)
        if seq < self.config.context:
            raise ValueError(
                f"the MLP reads the last {self.config.context} tokens, but the sequence has only {seq}"
            )
        window = idx[:, seq - self.config.context :]  # (batch, context)
        x = self.embed(window).flatten(1)  # (batch, context * d_embed)
        for layer in self.blocks:
            x = layer(x)  # (batch, d_hidden)
        return self.head(x).unsqueeze(1)  # (batch, 1, vocab)
