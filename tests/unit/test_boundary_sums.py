"""The step's one all-reduce at its boundary (``engine.nonfinite.post_boundary_sums``), on one process:
the sums, finite when everything is; not finite (ask the exact check) when a loss, a counted gradient
or a rank's own held gradient (a replica's, whose counted share is zero) is not."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.engine.nonfinite import BoundarySums, post_boundary_sums

SHARE = torch.tensor(4.0, dtype=torch.float64)


def sums(share: torch.Tensor, loss: float, held: torch.Tensor | None = None) -> BoundarySums:
    return post_boundary_sums(None, share, loss, "grad norm", held)()


def test_finite_shares_come_back_as_the_norm_and_the_loss() -> None:
    found = sums(SHARE, 2.5, held=SHARE)
    assert found.finite and found.norm_sq == 4.0 and found.loss == 2.5


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_loss_not_finite_asks_the_exact_check(loss: float) -> None:
    assert not sums(SHARE, loss).finite


@pytest.mark.parametrize("norm_sq", [math.nan, math.inf])
def test_a_gradient_not_finite_asks_the_exact_check(norm_sq: float) -> None:
    assert not sums(torch.tensor(norm_sq, dtype=torch.float64), 1.0).finite


@pytest.mark.parametrize("held", [math.nan, math.inf])
def test_a_replicas_own_gradient_not_finite_asks_the_exact_check(held: float) -> None:
    zero = torch.zeros((), dtype=torch.float64)  # a replica counts nothing in the norm
    assert sums(zero, 1.0).finite and not sums(zero, 1.0, torch.tensor(held, dtype=torch.float64)).finite


def test_a_norm_that_overflowed_on_finite_gradients_asks_the_exact_check_too() -> None:
    from shardwise.engine.update import sq_sum

    big = torch.full((4,), 1e30, dtype=torch.float32)  # finite; its fp32 norm is not
    assert torch.isfinite(big).all() and not sums(sq_sum([big]), 1.0).finite
