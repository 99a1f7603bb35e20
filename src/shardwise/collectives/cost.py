"""The alpha-beta-gamma cost model of every collective algorithm, and the ``auto`` choice.

A message of m bytes costs alpha + m * beta (latency plus inverse bandwidth); reducing m bytes locally
costs m * gamma (Hockney; Thakur, Rabenseifner & Gropp, 2005). ``n`` is the size of the whole tensor in
bytes (for all-gather the gathered output, for reduce-scatter the full input), ``p`` the world size and
``L = ceil(log2 p)``. Every formula is the time along the critical path, e.g. ring all-reduce:

    2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma

Two betas: ``beta`` is the cost per byte of an *exchange* step (a rank sends m bytes while it receives m,
as in every ring and halving-doubling step); ``beta_one_way`` that of a plain send (tree, naive, the
fold of halving-doubling). On a real full-duplex link they are equal; on loopback both directions share
the same cores and memory, so an exchange costs up to twice a one-way send per byte.

``native`` is modelled as what gloo runs: a ring for all-reduce, all-gather and reduce-scatter, a binomial
tree for broadcast and reduce (an estimate: gloo's choices are internal). A ``CostProfile`` holds the
three constants, measured by ``shardwise bench comm --calibrate`` and saved as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
AUTO_CANDIDATES = ("ring", "tree", "halving_doubling")  # native and naive are never chosen by auto


@dataclass(frozen=True)
class CostProfile:
    alpha_s: float = 50e-6  # per-message latency
    beta_s_per_byte: float = 1 / 1.5e9  # per byte sent while receiving as many (an exchange step)
    gamma_s_per_byte: float = 1 / 4e9  # local reduction of one byte
    source: str = "built-in default (not measured)"
    beta_one_way_s_per_byte: float = 0.0  # per byte of a send nobody answers; 0: same as beta

    @property
    def one_way_beta(self) -> float:
        return self.beta_one_way_s_per_byte or self.beta_s_per_byte

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        data = json.loads(Path(path).read_text())
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


Formula = Callable[[float, int, "CostProfile"], float]  # (n bytes, p ranks, constants) -> seconds


def _ring_all_reduce(n: float, p: int, c: CostProfile) -> float:
    a, b, g = c.alpha_s, c.beta_s_per_byte, c.gamma_s_per_byte
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g


def _ring_reduce_scatter(n: float, p: int, c: CostProfile) -> float:
    a, b, g = c.alpha_s, c.beta_s_per_byte, c.gamma_s_per_byte
    return (p - 1) * a + (p - 1) / p * n * b + (p - 1) / p * n * g


def _ring_all_gather(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * c.alpha_s + (p - 1) / p * n * c.beta_s_per_byte


def _halving_doubling_all_reduce(n: float, p: int, c: CostProfile) -> float:
    a, b1, g = c.alpha_s, c.one_way_beta, c.gamma_s_per_byte
    pof2 = 1 << (p.bit_length() - 1)
    fold = (2 * a + 2 * n * b1 + n * g) if pof2 != p else 0.0  # extra ranks fold in and out, one way
    return fold + _ring_all_reduce(n, pof2, c) - 2 * (pof2 - 1) * a + 2 * _log2(pof2) * a


def _binomial_broadcast(n: float, p: int, c: CostProfile) -> float:
    return _log2(p) * (c.alpha_s + n * c.one_way_beta)


def _binomial_reduce(n: float, p: int, c: CostProfile) -> float:
    return _log2(p) * (c.alpha_s + n * c.one_way_beta + n * c.gamma_s_per_byte)


def _scatter_allgather_broadcast(n: float, p: int, c: CostProfile) -> float:
    return _log2(p) * c.alpha_s + (p - 1) / p * n * c.one_way_beta + _ring_all_gather(n, p, c)


def _tree_broadcast(n: float, p: int, c: CostProfile) -> float:
    from shardwise.collectives.tree import LARGE_BROADCAST_BYTES

    large = p > 2 and n > LARGE_BROADCAST_BYTES
    return (_scatter_allgather_broadcast if large else _binomial_broadcast)(n, p, c)


def _tree_all_reduce(n: float, p: int, c: CostProfile) -> float:
    return _binomial_reduce(n, p, c) + _binomial_broadcast(n, p, c)


def _naive_reduce(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * (c.alpha_s + n * c.one_way_beta + n * c.gamma_s_per_byte)


def _naive_broadcast(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * (c.alpha_s + n * c.one_way_beta)


def _naive_all_reduce(n: float, p: int, c: CostProfile) -> float:
    return _naive_reduce(n, p, c) + _naive_broadcast(n, p, c)


def _naive_all_gather(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * (c.alpha_s + n / p * c.one_way_beta) + _naive_broadcast(n, p, c)


def _naive_reduce_scatter(n: float, p: int, c: CostProfile) -> float:
    return _naive_reduce(n, p, c) + (p - 1) * (c.alpha_s + n / p * c.one_way_beta)


# (algorithm, op) -> formula. An algorithm with no variant of its own for an op runs the one named in
# ``explicit.ALGORITHM_FOR`` (e.g. all-gather under "tree" is the ring); the table mirrors that.
FORMULAS: dict[tuple[str, str], Formula] = {
    ("ring", "all_reduce"): _ring_all_reduce,
    ("ring", "reduce_scatter"): _ring_reduce_scatter,
    ("ring", "all_gather"): _ring_all_gather,
    ("ring", "broadcast"): _scatter_allgather_broadcast,
    ("ring", "reduce"): _binomial_reduce,
    ("tree", "all_reduce"): _tree_all_reduce,
    ("tree", "broadcast"): _tree_broadcast,
    ("tree", "reduce"): _binomial_reduce,
    ("tree", "all_gather"): _ring_all_gather,
    ("tree", "reduce_scatter"): _ring_reduce_scatter,
    ("halving_doubling", "all_reduce"): _halving_doubling_all_reduce,
    ("halving_doubling", "broadcast"): _tree_broadcast,
    ("halving_doubling", "reduce"): _binomial_reduce,
    ("halving_doubling", "all_gather"): _ring_all_gather,
    ("halving_doubling", "reduce_scatter"): _ring_reduce_scatter,
    ("naive", "all_reduce"): _naive_all_reduce,
    ("naive", "broadcast"): _naive_broadcast,
    ("naive", "reduce"): _naive_reduce,
    ("naive", "all_gather"): _naive_all_gather,
    ("naive", "reduce_scatter"): _naive_reduce_scatter,
    ("native", "all_reduce"): _ring_all_reduce,
    ("native", "broadcast"): _binomial_broadcast,
    ("native", "reduce"): _binomial_reduce,
    ("native", "all_gather"): _ring_all_gather,
    ("native", "reduce_scatter"): _ring_reduce_scatter,
}


def predict(algorithm: str, op: str, nbytes: int, world_size: int, profile: CostProfile) -> float:
    """Predicted seconds for one ``op`` of ``nbytes`` on ``world_size`` ranks with ``algorithm``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        formula = FORMULAS[(algorithm, op)]
    except KeyError:
        raise ValueError(f"no cost formula for algorithm {algorithm!r} and op {op!r}") from None
    if world_size == 1:
        return 0.0
    return formula(float(nbytes), world_size, profile)


def choose(
    op: str,
    nbytes: int,
    world_size: int,
    profile: CostProfile,
    candidates: tuple[str, ...] = AUTO_CANDIDATES,
) -> str:
    """The candidate predicted fastest (ties go to the earlier candidate)."""
    return min(candidates, key=lambda algorithm: predict(algorithm, op, nbytes, world_size, profile))
