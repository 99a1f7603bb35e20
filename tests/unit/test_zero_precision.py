"""Dynamic loss scaling and precision resolution (no processes)."""

from __future__ import annotations

import torch

from shardwise.engine.precision import LossScaler, Precision, resolve_precision


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


def test_loss_scaler_stops_at_its_floor_and_hands_overflows_on() -> None:
    scaler = LossScaler(True, init_scale=4.0, min_scale=1.0)
    assert scaler.owns_overflow
    for _ in range(3):
        scaler.update(found_inf=True)
    assert scaler.scale == 1.0 and scaler.skipped_steps == 3
    assert not scaler.owns_overflow  # at the floor: non-finite values are the run's policy's
    assert not LossScaler(False).owns_overflow


def test_loss_scaler_state_round_trips() -> None:
    scaler = LossScaler(True, init_scale=8.0, growth_interval=3)
    scaler.update(found_inf=True)
    scaler.update(found_inf=False)
    copy = LossScaler(True, growth_interval=3)
    copy.load(scaler.state())
    assert copy.state().tolist() == [4.0, 1.0, 1.0]
    copy.update(found_inf=False)
    copy.update(found_inf=False)
    assert copy.scale == 8.0  # the clean steps counted before the save count after it
