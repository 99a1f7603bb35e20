"""A user's own model factory: ``model.kind = package.module:function``.

The function is imported (the current folder first on the path, as ``python -m`` has it, so a module
beside you imports) and called under the run's torch seed: with the run's ``ModelConfig`` when it
has a required argument (for ``seq_len``, say), with none otherwise. It must return a ``torch.nn.Module``
that takes token ids (batch, seq) and returns next-token logits (batch, seq, vocab) as a tensor, a
tuple whose first item they are, or a dict/``ModelOutput`` with ``logits``. No communication: every
rank calls it under the same seed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

from shardwise.config import ConfigError, ModelConfig

Factory = Callable[..., object]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def load_factory(kind: str) -> Factory:
    """The function ``package.module:function`` names, or a one-line ``ConfigError`` saying why not."""
    module_name, _, attr = kind.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while importing
        raise ConfigError(
            f"model.kind {kind!r}: cannot import {module_name} ({_first_line(exc)}); give an importable "
            "package.module:function (the current folder is on the path)"
        ) from None
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            functions = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and n[0] != "_")
            listed = (", ".join(functions[:8]) + (", ..." if len(functions) > 8 else "")) or "none"
            raise ConfigError(f"model.kind {kind!r}: {module_name} has no {attr}; its functions: {listed}")
        target = getattr(target, part)
    if not callable(target):
        what = type(target).__name__
        raise ConfigError(f"model.kind {kind!r}: {module_name}.{attr} is a {what}, not a function")
    return target


def _takes_config(fn: Factory) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): call it bare
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional and p.default is inspect.Parameter.empty for p in params)


def call_factory(fn: Factory, cfg: ModelConfig) -> nn.Module:
    """Call the factory (with ``cfg`` when it has a required argument) and check it made a module."""
    model = fn(cfg) if _takes_config(fn) else fn()
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.kind {cfg.kind!r} returned a {type(model).__name__}, not a torch.nn.Module; "
            "return the model itself"
        )
    return model


def check_factory(cfg: ModelConfig) -> None:
    """Import the factory and call it on the meta device (no memory, no initialisation) to check that
    it returns a module. A factory that cannot run on meta tensors is checked when the ranks build it."""
    fn = load_factory(cfg.kind)
    try:
        with torch.device("meta"):
            call_factory(fn, cfg)
    except ConfigError:
        raise
    except Exception:  # it needs real tensors (loads a file, calls .item()): the ranks will tell
        return


def build_factory_model(cfg: ModelConfig) -> nn.Module:
    """The user's model, built under the caller's torch seed."""
    return call_factory(load_factory(cfg.kind), cfg)
