"""The built-in models, their size presets, and ``build_model(ModelConfig)`` for any model kind.

``model.kind`` is ``gpt`` or ``mlp`` (built in, sized by ``model.preset``), ``hf:PATH`` (a Hugging Face
causal LM from a config file, random weights: :mod:`shardwise.models.hf`) or
``package.module:function`` (a user's factory: :mod:`shardwise.models.factory`). What the parallel code
knows of each model family (blocks, tensor-parallel plan, pipeline pieces, shapes, seams) is in
:mod:`shardwise.models.adapters`; what a kind means for the loss is here (``loss_positions``).

No communication: the model is built identically on every rank (same seed, same values) and the
strategies distribute it afterwards. Parameter counts at vocab 256, seq_len 64 (ties counted once):

    gpt   tiny 0.12M   small 1.03M   base 10.8M   medium 25.4M   large 99.5M
    mlp   tiny 0.03M   small 0.27M   base 4.5M    small_bn: small with BatchNorm (has buffers)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from shardwise.config import ConfigError, ModelConfig, check_model_kind, model_source
from shardwise.models.factory import build_factory_model, check_factory
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.hf import build_hf_model, load_hf_config, shipped_configs
from shardwise.models.init_record import load_transformers_init
from shardwise.models.init_replay import build_recorded, materialize_whole
from shardwise.models.mlp import MLP, MLPConfig

__all__ = [
    "GPT",
    "GPT_KIND",
    "MLP",
    "MLP_KIND",
    "PRESETS",
    "GPTConfig",
    "MLPConfig",
    "build_model",
    "check_model_config",
    "count_parameters",
    "loss_positions",
    "predicted_tokens",
    "shipped_configs",
]

GPT_KIND, MLP_KIND = "gpt", "mlp"  # the built-in kinds (model.kind), sized by a preset

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    GPT_KIND: {
        "tiny": {"n_layer": 2, "n_head": 2, "d_model": 64},
        # odd sizes everywhere: sharding must pad and slice across parameter boundaries
        "odd": {"n_layer": 2, "n_head": 3, "d_model": 27, "d_ff": 50},
        "small": {"n_layer": 5, "n_head": 4, "d_model": 128},
        "base": {"n_layer": 6, "n_head": 6, "d_model": 384},
        "medium": {"n_layer": 8, "n_head": 8, "d_model": 512},
        "large": {"n_layer": 14, "n_head": 12, "d_model": 768},
        # verify's model: odd widths (head_dim 7, d_ff 45), 8 blocks so pp 4 x 2 virtual stages fits,
        # heads divisible by 2 and 4 for tensor parallelism
        "odd-deep": {"n_layer": 8, "n_head": 4, "d_model": 28, "d_ff": 44},  # heads of 7; tp 2, 4 divide
    },
    MLP_KIND: {
        "tiny": {"context": 8, "d_embed": 16, "d_hidden": 64, "n_layer": 1},
        "odd": {"context": 8, "d_embed": 7, "d_hidden": 45, "n_layer": 2},
        "small": {"context": 16, "d_embed": 32, "d_hidden": 256, "n_layer": 2},
        "small_bn": {"context": 16, "d_embed": 32, "d_hidden": 256, "n_layer": 2, "batch_norm": True},
        "base": {"context": 32, "d_embed": 64, "d_hidden": 1024, "n_layer": 3},
    },
}


def check_model_config(cfg: ModelConfig) -> dict[str, Any]:
    """Check that ``cfg`` builds, without building it; a one-line ``ConfigError`` otherwise.

    Built-in kinds: returns the preset's sizes. ``hf:``: the config file loads in transformers, is a
    causal LM and fits ``seq_len`` and the byte vocabulary (returns {}). A factory: it imports, and
    returns a module when called on the meta device (returns {}).
    """
    check_model_kind(cfg.kind)
    source = model_source(cfg.kind)
    if source == "hf":
        load_hf_config(cfg)
        return {}
    if source == "factory":
        check_factory(cfg)
        return {}
    return _preset(cfg)


def _preset(cfg: ModelConfig) -> dict[str, Any]:
    """The built-in model's preset sizes, or a ``ConfigError`` naming the known presets."""
    presets = PRESETS.get(cfg.kind)
    if presets is None:
        raise ConfigError(f"model.kind must be one of {', '.join(PRESETS)}; got {cfg.kind!r}")
    if cfg.preset not in presets:
        raise ConfigError(f"unknown {cfg.kind} preset {cfg.preset!r}; known presets: {', '.join(presets)}")
    return presets[cfg.preset]


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, *, meta: bool = False) -> nn.Module:
    """Build the model ``cfg`` describes, then apply ``cfg.freeze``.

    The model is made on the meta device while its initialisation is recorded
    (:mod:`shardwise.models.init_record`: parameters in float32, a Hugging Face model in its config's
    dtype); ``meta``: it is returned so, and ``parallelize`` materialises what each rank holds. Else
    every tensor is given its recorded values, drawn on the chunk grid of
    :mod:`shardwise.models.init_replay` under the caller's torch seed, then cast to ``dtype`` (so a
    float64 model holds exactly the float32 model's values): what every layout's ranks read parts of.
    A factory whose build needs real values (it reads one) is built whole, as a model passed in built
    is, said once on stderr.
    """
    if model_source(cfg.kind) in ("hf", "factory"):
        load_transformers_init()  # a Hugging Face model's init functions, to be recorded
    state = torch.random.get_rng_state()
    try:
        model = build_recorded(lambda: _construct(cfg))
    except ConfigError:
        raise
    except Exception as exc:  # a factory that needs real values while it builds: built whole, as before
        torch.random.set_rng_state(state)
        model = _construct(cfg)
        if os.environ.get("RANK", "0") == "0":
            reason = " ".join(str(exc).split())[:160]
            what = f"{type(exc).__name__}: {reason}"
            print(
                f"shardwise: model.kind {cfg.kind!r} cannot be built on the meta device ({what}); it is "
                "built whole on each rank, from the torch seed",
                file=sys.stderr,
                flush=True,
            )
    model.to(dtype)  # on meta: dtypes only; values are drawn in the dtype the record has, then cast
    apply_freeze(model, cfg.freeze)
    if not meta:
        materialize_whole(model)
    return model


def _construct(cfg: ModelConfig) -> nn.Module:
    check_model_kind(cfg.kind)
    source = model_source(cfg.kind)
    if source == "hf":
        return build_hf_model(cfg)
    if source == "factory":
        return build_factory_model(cfg)
    sizes = _preset(cfg)
    if cfg.kind == GPT_KIND:
        return GPT(GPTConfig(**sizes, seq_len=cfg.seq_len, dropout=cfg.dropout, tie_weights=cfg.tie_weights))
    mlp_config = MLPConfig(**sizes, dropout=cfg.dropout)
    if mlp_config.context > cfg.seq_len:
        raise ConfigError(
            f"mlp preset {cfg.preset!r} reads {mlp_config.context} tokens, more than "
            f"model.seq_len({cfg.seq_len}); raise seq_len or pick a smaller preset"
        )
    return MLP(mlp_config)


def apply_freeze(model: nn.Module, prefixes: tuple[str, ...]) -> nn.Module:
    """Set ``requires_grad=False`` on parameters whose dotted name starts with one of ``prefixes``.

    A prefix matches whole name components: ``"blocks.1"`` freezes ``blocks.1.*`` but not
    ``blocks.10.*``. A tied matrix answers to both of its names (``wte`` and ``head`` in the GPT).
    """
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    for prefix in prefixes:
        matched = [name for name in names if _matches(name, prefix)]
        if not matched:
            tops = sorted({name.split(".")[0] for name in names})
            raise ConfigError(
                f"model.freeze prefix {prefix!r} matches no parameter; names start with {', '.join(tops)}"
            )
    for name, param in model.named_parameters(remove_duplicate=False):
        if any(_matches(name, prefix) for prefix in prefixes):
            param.requires_grad_(False)
    return model


def _matches(name: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


def loss_positions(kind: str) -> int | None:
    """How many trailing positions of each sample carry a loss: 1 for the MLP (it predicts the token
    after its window), None (every position) for the other kinds."""
    return 1 if kind == MLP_KIND else None


def predicted_tokens(kind: str, batch: int, seq_len: int) -> int:
    """Tokens that carry a loss in a batch of ``batch`` samples of ``seq_len`` tokens of model ``kind``."""
    return batch * (loss_positions(kind) or seq_len)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter values; a tied matrix counts once."""
    return sum(p.numel() for p in model.parameters())
