"""``--compress NAME[:PARAM]`` (``comm.compress``): parse the spec and build the codec layer from config.

| spec | codec | exchange |
| --- | --- | --- |
| ``none`` | identity, through the codec path (parity checks, a baseline) | all-reduce |
| ``fp16``, ``bf16`` | 16-bit cast | all-reduce in 16 bits |
| ``int8[:CHUNK]`` | int8, one scale per CHUNK elements (512) | all-reduce (max) of scales, then of int8 |
| ``sign[:CHUNK]`` | 1 bit per element, one scale per CHUNK (2048) | all-gather of packed signs |
| ``topk:RATIO`` | the largest RATIO of each bucket (0.01) | all-gather of (index, value) |
| ``dgc:RATIO`` | top-k with DGC's momentum correction, clipping, warm-up | all-gather of (index, value) |
| ``powersgd:RANK`` | rank-RANK PowerSGD as torch's hook (4) | all-reduce of P, of Q, of the rest |

An empty ``comm.compress`` (the default) means no codec layer at all: gradients are reduced as before.
Each codec's module names the paper it follows. No communication here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.collectives.api import Comm
from shardwise.compression.cast import CastCodec, IdentityCodec
from shardwise.compression.codec import Codec
from shardwise.compression.comm import CompressedComm
from shardwise.compression.int8 import Int8Codec
from shardwise.compression.powersgd import PowerSGDCodec
from shardwise.compression.sign import SignCodec
from shardwise.compression.topk import TopKCodec
from shardwise.config import CommConfig, ConfigError

# name -> (what PARAM is, its default, its type); None: takes no parameter
PARAMS: dict[str, tuple[str, float, type] | None] = {
    "none": None,
    "fp16": None,
    "bf16": None,
    "int8": ("elements per scale", 512, int),
    "sign": ("elements per scale", 2048, int),
    "topk": ("fraction of each bucket sent", 0.01, float),
    "dgc": ("fraction of each bucket sent", 0.01, float),
    "powersgd": ("matrix rank", 4, int),
}


@dataclass(frozen=True)
class Spec:
    name: str
    param: float | None  # None for codecs without a parameter


def parse_spec(spec: str) -> Spec:
    """``NAME[:PARAM]`` checked, the parameter defaulted; ``ConfigError`` in one line otherwise."""
    name, sep, raw = spec.strip().partition(":")
    name = name.lower()
    if name not in PARAMS:
        raise ConfigError(f"comm.compress: unknown codec {name!r}; known: {', '.join(PARAMS)}")
    about = PARAMS[name]
    if about is None:
        if sep:
            raise ConfigError(f"comm.compress: {name} takes no parameter, got {spec!r}")
        return Spec(name, None)
    what, default, kind = about
    if not sep:
        return Spec(name, default)
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(
            f"comm.compress: {name}:PARAM expects {kind.__name__} ({what}), got {raw!r}"
        ) from None
    low_ok = value > 0 if kind is float else value >= 1
    if not low_ok or (name in ("topk", "dgc") and value > 1):
        bound = "in (0, 1]" if kind is float else ">= 1"
        raise ConfigError(f"comm.compress: {name}'s {what} must be {bound}, got {raw}")
    return Spec(name, value)


def check_compress(config: CommConfig, strategy: str = "ddp") -> None:
    """Every ``comm.compress*`` key makes sense for ``strategy`` (before any rank starts)."""
    if config.compress_start_step < 0 or config.compress_warmup_steps < 0:
        raise ConfigError("comm.compress_start_step and comm.compress_warmup_steps must be >= 0")
    if not 0 <= config.compress_momentum < 1:
        raise ConfigError(f"comm.compress_momentum must be in [0, 1), got {config.compress_momentum}")
    if not config.compress:
        return
    codec = build_codec(config)
    if strategy == "ps" and not codec.pushable:
        raise ConfigError(
            f"comm.compress = {config.compress!r} needs its workers to all-reduce among themselves; the "
            "parameter server's workers only push to servers: use fp16, bf16, int8, sign, topk or dgc"
        )
    if strategy == "ps" and (config.compress_start_step or config.compress_warmup_steps):
        raise ConfigError(
            "with the parameter server a push must keep one size (the server preallocates it): set "
            "comm.compress_start_step = 0 and comm.compress_warmup_steps = 0"
        )


def build_codec(config: CommConfig, clip_norm: float = 0.0) -> Codec:
    """The codec ``config.compress`` names, with the other ``comm.compress_*`` settings."""
    spec = parse_spec(config.compress)
    param = spec.param
    if spec.name == "none":
        return IdentityCodec(config.compress)
    if spec.name in ("fp16", "bf16"):
        return CastCodec(config.compress, torch.float16 if spec.name == "fp16" else torch.bfloat16)
    assert param is not None
    if spec.name == "int8":
        return Int8Codec(config.compress, int(param))
    if spec.name == "sign":
        return SignCodec(config.compress, int(param))
    if spec.name in ("topk", "dgc"):
        return TopKCodec(
            config.compress,
            float(param),
            dgc=spec.name == "dgc",
            momentum=config.compress_momentum,
            clip_norm=clip_norm,
            warmup_steps=config.compress_warmup_steps,
            start_step=config.compress_start_step,
        )
    return PowerSGDCodec(
        config.compress, int(param), config.compress_min_rate, config.compress_epsilon, config.compress_seed
    )


def build_compressed(comm: Comm, config: CommConfig, clip_norm: float = 0.0) -> CompressedComm | None:
    """The codec layer over ``comm`` for ``config.compress``, or None when it is empty (no codec layer)."""
    if not config.compress:
        return None
    return CompressedComm(comm, build_codec(config, clip_norm), config.compress_start_step)
