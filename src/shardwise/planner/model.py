"""The shape of a decoder-only transformer, read from a preset or a config file, never built.

The planner needs only sizes: layers, width, heads (and key-value heads), MLP width, vocabulary,
learned positions, whether the head is tied to the embedding, and whether the MLP is gated (SwiGLU, as
in Llama). ``ModelShape`` holds them and counts parameters exactly as the modules hold them, so a
preset's count equals ``count_parameters`` of the built model (a test checks it). No communication and
no tensors: a 70B model is described in microseconds.

Sources: a built-in GPT preset (``shardwise.models.PRESETS``), a Hugging Face ``config.json`` of the
GPT-2 or Llama family (read as JSON, so transformers need not be installed), or sizes given by hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.config import ConfigError

BYTE_VOCAB = 256  # the built-in corpus's tokens are bytes (= shardwise.models.hf.BYTE_VOCAB)


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a pre-norm decoder: ``n_layer`` blocks of attention + MLP between an embedding and a head."""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    d_ff: int = 0  # 0: 4 * d_model
    n_kv_head: int = 0  # 0: n_head (multi-head attention); fewer: grouped-query attention
    positions: int = 0  # rows of a learned position table (GPT); 0: rotary positions (Llama)
    tie_weights: bool = True  # the head reuses the embedding matrix
    gated_mlp: bool = False  # SwiGLU: gate, up and down matrices (Llama); else fc, proj (GPT)
    bias: bool = True  # linear layers carry biases (GPT); Llama has none
    layer_norm: bool = True  # LayerNorm (weight and bias); False: RMSNorm (weight only)
    name: str = "custom"
    context: int = 0  # the longest sequence the config names (max_position_embeddings); 0: not said

    def __post_init__(self) -> None:
        for field_name in ("n_layer", "d_model", "n_head", "vocab"):
            if getattr(self, field_name) < 1:
                raise ConfigError(f"model {field_name} must be >= 1, got {getattr(self, field_name)}")
        for field_name in ("d_ff", "n_kv_head", "positions", "context"):
            if getattr(self, field_name) < 0:
                raise ConfigError(f"model {field_name} must be >= 0, got {getattr(self, field_name)}")
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model({self.d_model}) is not divisible by n_head({self.n_head})")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"n_head({self.n_head}) is not divisible by n_kv_head({self.kv_heads})")

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): d_model under multi-head attention."""
        return self.kv_heads * self.head_dim

    def _norm(self) -> int:
        return 2 * self.d_model if self.layer_norm else self.d_model

    @property
    def block_params(self) -> int:
        """Parameters of one block (one ZeRO-3 unit)."""
        h, f, kv = self.d_model, self.ff, self.kv_width
        attention = 2 * h * h + 2 * h * kv + ((h + 2 * kv) + h if self.bias else 0)
        if self.gated_mlp:
            mlp = 3 * h * f + ((2 * f + h) if self.bias else 0)
        else:
            mlp = 2 * h * f + ((f + h) if self.bias else 0)
        return attention + mlp + 2 * self._norm()

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks: embeddings, final norm, an untied head (ZeRO-3's root unit)."""
        head = 0 if self.tie_weights else self.vocab * self.d_model
        return (self.vocab + self.positions) * self.d_model + self._norm() + head

    def end_params(self, pp: int) -> int:
        """Parameters outside the blocks that one pipeline rank holds, on the heavier end: all of
        them without a pipeline; else the first stage's embeddings or the last stage's final norm and
        untied head (a tied head is the first stage's parameter; the last holds a copy of it)."""
        if pp == 1:
            return self.root_params
        first = (self.vocab + self.positions) * self.d_model
        last = self._norm() + (0 if self.tie_weights else self.vocab * self.d_model)
        return max(first, last)

    @property
    def params(self) -> int:
        """Every parameter value, a tied matrix once."""
        return self.n_layer * self.block_params + self.root_params

    def describe(self) -> str:
        return (
            f"{self.name}: {self.params / 1e6:,.1f}M params, {self.n_layer} layers x d_model {self.d_model}, "
            f"{self.n_head} heads, vocab {self.vocab}"
        )


def preset_shape(preset: str, seq_len: int, tie_weights: bool = True) -> ModelShape:
    """The built-in GPT ``preset`` (see ``shardwise.models.PRESETS``) at ``seq_len`` learned positions."""
    from shardwise.models import PRESETS

    sizes = PRESETS["gpt"].get(preset)
    if sizes is None:
        raise ConfigError(f"unknown gpt preset {preset!r}; known presets: {', '.join(PRESETS['gpt'])}")
    return ModelShape(
        n_layer=sizes["n_layer"],
        d_model=sizes["d_model"],
        n_head=sizes["n_head"],
        vocab=BYTE_VOCAB,
        d_ff=sizes.get("d_ff", 0),
        positions=seq_len,
        tie_weights=tie_weights,
        name=f"gpt {preset}",
    )


def _get(config: dict[str, Any], path: Path, *keys: str) -> int:
    for key in keys:
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ConfigError(
        f"{path}: no integer {' or '.join(keys)}; the planner reads GPT-2 and Llama-style configs"
    )


def hf_shape(kind: str) -> ModelShape:
    """The shape of ``hf:PATH`` (a config.json, a folder holding one, or a shipped name), read as JSON."""
    from shardwise.models.hf import config_path

    path = config_path(kind if kind.startswith("hf:") else f"hf:{kind}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a config must be a JSON object")
    if config.get("model_type") == "gpt2" or "n_embd" in config:
        return ModelShape(
            n_layer=_get(config, path, "n_layer"),
            d_model=_get(config, path, "n_embd"),
            n_head=_get(config, path, "n_head"),
            vocab=_get(config, path, "vocab_size"),
            d_ff=config.get("n_inner") or 0,
            positions=_get(config, path, "n_positions", "max_position_embeddings"),
            tie_weights=bool(config.get("tie_word_embeddings", True)),
            name=path.parent.name if path.name == "config.json" else path.stem,
            context=_get(config, path, "n_positions", "max_position_embeddings"),
        )
    if "head_dim" in config and config["head_dim"] * _get(config, path, "num_attention_heads") != config.get(
        "hidden_size"
    ):
        raise ConfigError(
            f"{path}: head_dim x num_attention_heads != hidden_size; the planner cannot size it"
        )
    if bool(config.get("mlp_bias", False)) != bool(config.get("attention_bias", False)):
        raise ConfigError(f"{path}: attention_bias and mlp_bias differ; the planner sizes them alike")
    return ModelShape(
        n_layer=_get(config, path, "num_hidden_layers"),
        d_model=_get(config, path, "hidden_size"),
        n_head=_get(config, path, "num_attention_heads"),
        vocab=_get(config, path, "vocab_size"),
        d_ff=_get(config, path, "intermediate_size"),
        n_kv_head=config.get("num_key_value_heads") or 0,
        tie_weights=bool(config.get("tie_word_embeddings", False)),
        gated_mlp=True,
        bias=bool(config.get("attention_bias", False)),
        layer_norm=False,
        name=path.parent.name if path.name == "config.json" else path.stem,
        context=int(config.get("max_position_embeddings") or 0),
    )
