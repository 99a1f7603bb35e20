"""The shape of a decoder-only transformer, read from a preset or a config file, never built.

The planner needs only sizes: layers, width, heads (and key-value heads), MLP width, vocabulary,
learned positions, whether the head is tied to the embedding, and whether the MLP is gated (SwiGLU, as
in Llama). ``ModelShape`` holds them and counts parameters exactly as the modules hold them, so a
preset's count equals ``count_parameters`` of the built model (a test checks it). No communication and
no tensors: a 70B model is described in microseconds.

Sources: the model adapters' readers (``shardwise.models.adapters``: ``preset_shape`` for a built-in
preset, ``hf_shape`` for a Hugging Face ``config.json`` of the GPT-2 or Llama family, read as JSON so
transformers need not be installed), or sizes given by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config import ConfigError


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
    def head_work(self) -> int:
        """The last stage's matrix work per token besides its blocks, in parameters (as the pipeline
        split counts it): the final norm and the head's matrix, tied to the embedding or not."""
        return self._norm() + self.vocab * self.d_model

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
