"""The alpha-beta-gamma formulas, profiles on disk, and what ``auto`` picks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shardwise.collectives.cost import FORMULAS, CostProfile, choose, predict

PROFILE = CostProfile(
    alpha_s=2e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=2.5e-10, source="test", beta_one_way_s_per_byte=6e-10
)
B1 = PROFILE.beta_one_way_s_per_byte  # plain sends (tree, naive, the fold of halving-doubling)


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8])
def test_ring_all_reduce_formula(p: int) -> None:
    n, a, b, g = 1_000_000, PROFILE.alpha_s, PROFILE.beta_s_per_byte, PROFILE.gamma_s_per_byte
    expected = 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    assert predict("ring", "all_reduce", n, p, PROFILE) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_halving_doubling_power_of_two(p: int) -> None:
    n, a, b, g = 4096, PROFILE.alpha_s, PROFILE.beta_s_per_byte, PROFILE.gamma_s_per_byte
    expected = 2 * math.log2(p) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    assert predict("halving_doubling", "all_reduce", n, p, PROFILE) == pytest.approx(expected, rel=1e-12)


def test_halving_doubling_folds_extra_ranks() -> None:
    n, a, g = 4096, PROFILE.alpha_s, PROFILE.gamma_s_per_byte
    on_four = predict("halving_doubling", "all_reduce", n, 4, PROFILE)
    assert predict("halving_doubling", "all_reduce", n, 6, PROFILE) == pytest.approx(
        on_four + 2 * a + 2 * n * B1 + n * g
    )


def test_tree_and_naive_formulas() -> None:
    n, p, a, b, g = 10_000, 5, PROFILE.alpha_s, PROFILE.beta_s_per_byte, PROFILE.gamma_s_per_byte
    rounds = 3  # ceil(log2 5)
    assert predict("tree", "reduce", n, p, PROFILE) == pytest.approx(rounds * (a + n * B1 + n * g))
    assert predict("tree", "broadcast", n, p, PROFILE) == pytest.approx(rounds * (a + n * B1))
    assert predict("naive", "all_reduce", n, p, PROFILE) == pytest.approx(
        (p - 1) * (a + n * B1 + n * g) + (p - 1) * (a + n * B1)
    )
    own_block = n / p * g  # the all-gather first copies its own block into the output
    assert predict("ring", "all_gather", n, p, PROFILE) == pytest.approx(
        own_block + (p - 1) * a + (p - 1) / p * n * b
    )


def test_large_broadcast_scatters_then_gathers() -> None:
    n, p, a, b = 64 << 20, 8, PROFILE.alpha_s, PROFILE.beta_s_per_byte
    expected = 3 * a + (p - 1) / p * n * B1 + (p - 1) * a + (p - 1) / p * n * b
    assert predict("tree", "broadcast", n, p, PROFILE) == pytest.approx(expected)
    assert predict("tree", "broadcast", n, p, PROFILE) < 3 * n * B1  # beats binomial's log2(p) n beta


def test_every_formula_is_zero_on_one_rank_and_grows_with_size() -> None:
    for algorithm, op in FORMULAS:
        assert predict(algorithm, op, 1 << 20, 1, PROFILE) == 0.0
        for p in (2, 3, 4, 5, 8):
            small, large = (predict(algorithm, op, n, p, PROFILE) for n in (1 << 10, 1 << 24))
            assert 0 < small < large, (algorithm, op, p)


def test_auto_is_latency_optimal_when_small_and_bandwidth_optimal_when_large() -> None:
    for p in (4, 8):
        assert choose("all_reduce", 64, p, PROFILE) == "halving_doubling"
        # equal bandwidth terms at a power of two: the ring loses on latency alone, so compare
        # against the tree, which moves log2(p) whole copies
        assert choose("all_reduce", 256 << 20, p, PROFILE, ("ring", "tree")) == "ring"
    assert choose("all_reduce", 256 << 20, 6, PROFILE) == "ring"  # halving-doubling pays the fold
    assert choose("broadcast", 64, 8, PROFILE, ("tree", "ring")) == "tree"
    # "native" broadcast is modelled as the binomial tree: scatter + all-gather wins when large
    assert choose("broadcast", 256 << 20, 8, PROFILE, ("native", "ring")) == "ring"
    assert choose("broadcast", 64, 8, PROFILE, ("native", "ring")) == "native"


def test_unknown_pair_is_an_error() -> None:
    with pytest.raises(ValueError, match="no cost formula"):
        predict("ring", "all_to_all", 8, 2, PROFILE)


def test_one_way_beta_defaults_to_beta() -> None:
    plain = CostProfile(alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    assert predict("tree", "broadcast", 1000, 2, plain) == pytest.approx(1000 * 1e-9)


def test_profile_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    PROFILE.save(path)
    assert CostProfile.load(path) == PROFILE
