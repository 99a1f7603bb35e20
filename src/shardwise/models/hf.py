"""Hugging Face causal LMs from a config file, with random weights: ``model.kind = hf:PATH``.

``hf:PATH`` names a local ``config.json`` (or a folder holding one); ``hf:tiny-gpt2`` and
``hf:tiny-llama`` name the tiny configs shipped in ``shardwise/models/configs`` (vocab 256 for the
byte corpus, no dropout, a few hundred thousand parameters; the Llama one with grouped-query
attention). The model is ``AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(PATH))``:
nothing is downloaded (local files only) and the weights are drawn under the caller's torch seed.

transformers is an optional extra (``pip install shardwise[hf]``), imported here only when such a model
is asked for. No communication: every rank builds the same model from the same seed.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from shardwise.config import ConfigError, ModelConfig

SHIPPED_DIR = Path(__file__).parent / "configs"
BYTE_VOCAB = 256  # the built-in corpus's tokens are bytes


def shipped_configs() -> list[str]:
    """Names of the configs shipped with shardwise (``hf:<name>``)."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


def config_path(kind: str) -> Path:
    """The config file ``hf:...`` names: a shipped name, a file, or a folder holding config.json."""
    name = kind.removeprefix("hf:")
    if name in shipped_configs():
        return SHIPPED_DIR / f"{name}.json"
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = ", ".join(f"hf:{n}" for n in shipped_configs())
        raise ConfigError(
            f"model.kind {kind!r}: {path} does not exist; give a config.json file, a folder holding one, "
            f"or a shipped config ({shipped})"
        )
    return path


def _transformers(kind: str) -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"model.kind {kind!r} needs Hugging Face transformers, which is not installed: "
            "pip install shardwise[hf]"
        ) from None
    return transformers


def _reason(exc: BaseException) -> str:
    """transformers' reason in one line: its first line, cut short."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def load_hf_config(cfg: ModelConfig) -> Any:
    """The transformers config ``cfg.kind`` names, checked against the run; a one-line ``ConfigError``
    naming the file otherwise (missing, rejected by transformers, not a causal LM, too short, ...)."""
    path = config_path(cfg.kind)
    transformers = _transformers(cfg.kind)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises ValueError, OSError, KeyError, ... for a bad file
        raise ConfigError(f"{path} is rejected by transformers: {_reason(exc)}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"{path}: model_type {config.model_type!r} has no causal-LM class in transformers "
            "(AutoModelForCausalLM); use a decoder config such as gpt2 or llama"
        )
    positions = getattr(config, "max_position_embeddings", None)  # GPT-2 maps it to n_positions
    if isinstance(positions, int) and positions < cfg.seq_len:
        raise ConfigError(
            f"model.seq_len ({cfg.seq_len}) is more than the {positions} positions of {path} "
            "(max_position_embeddings / n_positions); lower --seq-len or raise it in the config"
        )
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < BYTE_VOCAB:
        raise ConfigError(
            f"{path} has vocab_size {vocab}, but the built-in corpus's tokens are bytes 0-255; "
            f"set vocab_size >= {BYTE_VOCAB}"
        )
    return config


def build_hf_model(cfg: ModelConfig) -> nn.Module:
    """The causal LM of ``cfg.kind``'s config, random weights drawn under the caller's torch seed."""
    config = load_hf_config(cfg)
    transformers = _transformers(cfg.kind)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # an inconsistent config (heads that do not divide the width, ...)
        raise ConfigError(
            f"{config_path(cfg.kind)}: transformers cannot build a causal LM from it: {_reason(exc)}"
        ) from None
    return model
