"""The step's one all-reduce at its boundary (``engine.nonfinite.boundary_sums``), on one process: the
sums when everything is finite, None (ask the exact check) when a loss or a counted gradient is not."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.engine.nonfinite import boundary_sums

SHARE = torch.tensor(4.0, dtype=torch.float64)


def test_finite_shares_come_back_as_the_norm_and_the_loss() -> None:
    found = boundary_sums(None, SHARE, 2.5, "grad norm")
    assert found is not None and found.norm_sq == 4.0 and found.loss == 2.5


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_loss_not_finite_asks_the_exact_check(loss: float) -> None:
    assert boundary_sums(None, SHARE, loss, "grad norm") is None


@pytest.mark.parametrize("norm_sq", [math.nan, math.inf])
def test_a_gradient_not_finite_asks_the_exact_check(norm_sq: float) -> None:
    assert boundary_sums(None, torch.tensor(norm_sq, dtype=torch.float64), 1.0, "grad norm") is None


def test_a_norm_that_overflowed_on_finite_gradients_asks_the_exact_check_too() -> None:
    from shardwise.engine.base import sq_sum

    big = torch.full((4,), 1e30, dtype=torch.float32)  # finite; its fp32 norm is not
    assert torch.isfinite(big).all() and boundary_sums(None, sq_sum([big]), 1.0, "grad norm") is None
