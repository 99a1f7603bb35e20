"""The calibration's arithmetic: the line fit, measured-point interpolation, and the timing statistic."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.collectives.calibrate import fit_alpha_beta
from shardwise.collectives.cost import CostProfile, interpolate, predict
from shardwise.collectives.timing import quantile

POINTS = ((4.0, 100e-6), (1e6, 600e-6), (4e6, 2.6e-3), (16e6, 12e-3))


def test_fit_recovers_an_exact_line() -> None:
    points = [(m, 50e-6 + m * 4e-10) for m in (4, 65536, 1 << 20, 16 << 20)]
    alpha, beta = fit_alpha_beta(points)
    assert alpha == pytest.approx(50e-6, rel=1e-9)
    assert beta == pytest.approx(4e-10, rel=1e-9)


def test_fit_weighs_relative_error() -> None:
    # a 10% error on the largest point moves the latency far less than an absolute fit would
    points = [
        (4, 50e-6),
        (1 << 20, 50e-6 + (1 << 20) * 4e-10),
        (16 << 20, 1.1 * (50e-6 + (16 << 20) * 4e-10)),
    ]
    alpha, _ = fit_alpha_beta(points)
    assert alpha == pytest.approx(50e-6, rel=0.05)


def test_fit_never_goes_negative() -> None:
    alpha, beta = fit_alpha_beta([(1, 10e-6), (1000, 9e-6)])  # falling: no bandwidth term
    assert beta == 0.0 and alpha > 0
    alpha, beta = fit_alpha_beta([(1000, 1e-6), (2000, 10e-6)])  # steep: no latency term
    assert alpha == 0.0 and beta > 0
    with pytest.raises(ValueError, match="two distinct"):
        fit_alpha_beta([(1000, 1e-6)])


def test_interpolation_goes_through_the_points_and_along_the_ends() -> None:
    for m, t in POINTS:
        assert interpolate(POINTS, m) == pytest.approx(t)
    assert interpolate(POINTS, 2.5e6) == pytest.approx((600e-6 + 2.6e-3) / 2)
    slope = (12e-3 - 2.6e-3) / 12e6
    assert interpolate(POINTS, 64e6) == pytest.approx(12e-3 + slope * 48e6)  # past the last point
    assert interpolate(((10.0, 1e-6), (20.0, 5e-6)), 0.0) == 0.0  # extended below zero: clamped


def test_measured_points_replace_the_lines_in_every_formula() -> None:
    profile = CostProfile(exchange_points=POINTS, reduce_points=((1e6, 50e-6), (16e6, 1e-3)), source="t")
    n, p = 8e6, 2
    expected = 2 * interpolate(POINTS, n / 2) + interpolate(profile.reduce_points, n / 2)
    assert predict("ring", "all_reduce", int(n), p, profile) == pytest.approx(expected)
    assert predict("halving_doubling", "all_reduce", int(n), p, profile) == pytest.approx(expected)
    # one-way steps keep the straight line where no one-way points were measured
    assert predict("tree", "broadcast", 1000, 2, profile) == pytest.approx(
        profile.alpha_s + 1000 * profile.beta_s_per_byte
    )


def test_profile_with_points_round_trips(tmp_path: Path) -> None:
    profile = CostProfile(
        exchange_points=POINTS, one_way_points=POINTS[:2], source="t", call_overheads=(("reduce/tree", 1e-4),)
    )
    profile.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == profile


def test_quantile_is_the_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 7.0, 8.0]
    assert quantile(values, 0.25) == 3.0
    assert quantile(values, 0.0) == 1.0
    assert quantile(values, 1.0) == 9.0
    with pytest.raises(ValueError):
        quantile([])


def test_a_call_overhead_is_added_to_its_own_pair_only() -> None:
    plain = CostProfile(exchange_points=POINTS, source="t")
    with_overhead = CostProfile(
        exchange_points=POINTS, source="t", call_overheads=(("all_reduce/ring", 2e-4),)
    )
    n = 4_000_000
    ring_plain = predict("ring", "all_reduce", n, 2, plain)
    assert predict("ring", "all_reduce", n, 2, with_overhead) == pytest.approx(ring_plain + 2e-4)
    assert predict("halving_doubling", "all_reduce", n, 2, with_overhead) == pytest.approx(
        predict("halving_doubling", "all_reduce", n, 2, plain)
    )
