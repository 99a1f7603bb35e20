"""Dynamic loss scaling and precision resolution (no processes)."""

from __future__ import annotations

import torch

from shardwise.zero.precision import LossScaler, Precision, resolve_precision


def test_precision_keeps_fp32_masters() -> None:
    assert resolve_precision("fp32", torch.float64) == Precision(torch.float64, torch.float64, False)
    bf16 = resolve_precision("bf16", torch.float32)
    assert (bf16.compute, bf16.master, bf16.scaled) == (torch.bfloat16, torch.float32, False)
    fp16 = resolve_precision("fp16", torch.float32)
    assert (fp16.compute, fp16.master, fp16.scaled) == (torch.float16, torch.float32, True)


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps() -> None:
    scaler = LossScaler(True, init_scale=8.0, growth_interval=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1
    scaler.update(found_inf=False)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    assert scaler.scale == 8.0
    off = LossScaler(False)
    off.update(found_inf=True)
    assert off.scale == 1.0 and off.skipped_steps == 0
