"""The cost model of every collective algorithm, and the ``auto`` choice.

Every algorithm is a chain of steps along its critical path, and its predicted time is the sum of their
costs. Three step costs, each a function of the message size m in bytes:

- ``X(m)``, an *exchange*: a rank sends m bytes while it receives m (every ring and halving-doubling
  step);
- ``O(m)``, a *one-way* step: a plain send the next step waits for (tree, naive, the fold of
  halving-doubling);
- ``R(m)``, reducing m incoming bytes into the local copy;
- ``C(m)``, a local copy of m bytes (an all-gather's own block into the output).

In the classic alpha-beta-gamma form (Hockney; Thakur, Rabenseifner & Gropp, 2005) ``X(m) = alpha +
beta m``, ``O(m) = alpha1 + beta1 m`` and ``R(m) = C(m) = gamma m``; ring all-reduce then costs
``2(p-1) X(n/p) + (p-1) R(n/p) = 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``. A calibrated
profile instead carries each step cost as measured points, interpolated piecewise-linearly in m (and
extended along the last segment beyond them), in the spirit of the parameterised LogP model (Kielmann
et al., 2000): per-byte costs on a real machine change with size, as messages outgrow the caches.
On a full-duplex link X = O; on loopback both directions share the same cores and memory, so an
exchange costs more per byte than a one-way send, and its latency is that of two messages crossing.

A measured profile may also carry each algorithm's fixed cost per call beyond its steps (the
bookkeeping of our Python algorithms, about 0.1-0.3 ms here), found at the smallest benchmarked size
and added to every prediction of that algorithm (as NCCL's tuning model adds a base latency per
algorithm).

``n`` is the size of the whole tensor in bytes (for all-gather the gathered output, for reduce-scatter
the full input), ``p`` the world size and ``L = ceil(log2 p)``. ``native`` is modelled as what gloo
runs: a ring for all-reduce, all-gather and reduce-scatter, a binomial tree for broadcast and reduce
(an estimate: gloo's choices are internal). ``shardwise bench comm --calibrate`` measures a profile and
saves it as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

Points = tuple[tuple[float, float], ...]  # (bytes, seconds), by increasing bytes
# where ``shardwise bench comm`` saves the profile it measures, and where ``auto`` looks for one
DEFAULT_PROFILE_PATH = Path.home() / ".cache" / "shardwise" / "comm-profile.json"

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
AUTO_CANDIDATES = ("ring", "tree", "halving_doubling")  # native and naive are never chosen by auto


@dataclass(frozen=True)
class CostProfile:
    alpha_s: float = 50e-6  # latency of an exchange step
    beta_s_per_byte: float = 1 / 1.5e9  # per byte sent while receiving as many (an exchange step)
    gamma_s_per_byte: float = 1 / 4e9  # local reduction of one byte
    source: str = "built-in default (not measured)"
    beta_one_way_s_per_byte: float = 0.0  # per byte of a one-way step; 0: same as beta
    alpha_one_way_s: float = 0.0  # latency of a one-way step; 0: same as alpha
    # measured step costs; where given they replace the straight lines above
    exchange_points: Points = ()
    one_way_points: Points = ()
    reduce_points: Points = ()
    copy_points: Points = ()
    # ("op/algorithm", seconds): the fixed software cost of one call beyond its steps (bookkeeping,
    # Python), measured at the smallest benchmarked size; added to every prediction of that pair
    call_overheads: tuple[tuple[str, float], ...] = ()

    @property
    def one_way_beta(self) -> float:
        return self.beta_one_way_s_per_byte or self.beta_s_per_byte

    @property
    def one_way_alpha(self) -> float:
        return self.alpha_one_way_s or self.alpha_s

    def exchange(self, nbytes: float) -> float:
        """Seconds of one exchange step of ``nbytes`` each way."""
        if self.exchange_points:
            return interpolate(self.exchange_points, nbytes)
        return self.alpha_s + nbytes * self.beta_s_per_byte

    def one_way(self, nbytes: float) -> float:
        """Seconds of one one-way step of ``nbytes``."""
        if self.one_way_points:
            return interpolate(self.one_way_points, nbytes)
        return self.one_way_alpha + nbytes * self.one_way_beta

    def reduce(self, nbytes: float) -> float:
        """Seconds to reduce ``nbytes`` of incoming data into the local copy."""
        if self.reduce_points:
            return interpolate(self.reduce_points, nbytes)
        return nbytes * self.gamma_s_per_byte

    def copy(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` locally."""
        if self.copy_points:
            return interpolate(self.copy_points, nbytes)
        return nbytes * self.gamma_s_per_byte

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object of constants")
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for key in ("exchange_points", "one_way_points", "reduce_points", "copy_points"):
            values[key] = tuple((float(m), float(t)) for m, t in values.get(key, ()))
        values["call_overheads"] = tuple((str(k), float(t)) for k, t in values.get("call_overheads", ()))
        return cls(**values)


def interpolate(points: Points, nbytes: float) -> float:
    """Piecewise-linear through ``points``; beyond them, along the nearest segment; never negative."""
    if len(points) == 1:
        ((m0, t0),) = points
        return t0 * nbytes / m0 if m0 else t0
    index = 1
    while index < len(points) - 1 and points[index][0] < nbytes:
        index += 1
    (m0, t0), (m1, t1) = points[index - 1], points[index]
    return max(0.0, t0 + (t1 - t0) * (nbytes - m0) / (m1 - m0))


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


Formula = Callable[[float, int, "CostProfile"], float]  # (n bytes, p ranks, constants) -> seconds


def _ring_all_reduce(n: float, p: int, c: CostProfile) -> float:
    return 2 * (p - 1) * c.exchange(n / p) + (p - 1) * c.reduce(n / p)


def _ring_reduce_scatter(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * (c.exchange(n / p) + c.reduce(n / p))


def _ring_all_gather(n: float, p: int, c: CostProfile) -> float:
    """The ring steps alone: every rank's block is already in place."""
    return (p - 1) * c.exchange(n / p)


def _ring_all_gather_op(n: float, p: int, c: CostProfile) -> float:
    """The all-gather collective: the own block copied into the output first."""
    return c.copy(n / p) + _ring_all_gather(n, p, c)


def _halving_doubling_all_reduce(n: float, p: int, c: CostProfile) -> float:
    pof2 = 1 << (p.bit_length() - 1)
    fold = 2 * c.one_way(n) + c.reduce(n) if pof2 != p else 0.0  # extra ranks fold in and out
    halves = [n / 2**k for k in range(1, _log2(pof2) + 1)]
    return fold + sum(2 * c.exchange(m) + c.reduce(m) for m in halves)


def _binomial_broadcast(n: float, p: int, c: CostProfile) -> float:
    return _log2(p) * c.one_way(n)


def _binomial_reduce(n: float, p: int, c: CostProfile) -> float:
    return _log2(p) * (c.one_way(n) + c.reduce(n))


def _scatter_allgather_broadcast(n: float, p: int, c: CostProfile) -> float:
    scatter = sum(c.one_way(n / 2**k) for k in range(1, _log2(p) + 1))
    return scatter + _ring_all_gather(n, p, c)


def _tree_broadcast(n: float, p: int, c: CostProfile) -> float:
    from shardwise.collectives.tree import LARGE_BROADCAST_BYTES

    large = p > 2 and n > LARGE_BROADCAST_BYTES
    return (_scatter_allgather_broadcast if large else _binomial_broadcast)(n, p, c)


def _tree_all_reduce(n: float, p: int, c: CostProfile) -> float:
    return _binomial_reduce(n, p, c) + _binomial_broadcast(n, p, c)


def _naive_reduce(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * (c.one_way(n) + c.reduce(n))


def _naive_broadcast(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * c.one_way(n)


def _naive_all_reduce(n: float, p: int, c: CostProfile) -> float:
    return _naive_reduce(n, p, c) + _naive_broadcast(n, p, c)


def _naive_all_gather(n: float, p: int, c: CostProfile) -> float:
    return (p - 1) * c.one_way(n / p) + _naive_broadcast(n, p, c)


def _naive_reduce_scatter(n: float, p: int, c: CostProfile) -> float:
    return _naive_reduce(n, p, c) + (p - 1) * c.one_way(n / p)


# (algorithm, op) -> formula. An algorithm with no variant of its own for an op runs the one named in
# ``explicit.ALGORITHM_FOR`` (e.g. all-gather under "tree" is the ring); the table mirrors that.
FORMULAS: dict[tuple[str, str], Formula] = {
    ("ring", "all_reduce"): _ring_all_reduce,
    ("ring", "reduce_scatter"): _ring_reduce_scatter,
    ("ring", "all_gather"): _ring_all_gather_op,
    ("ring", "broadcast"): _scatter_allgather_broadcast,
    ("ring", "reduce"): _binomial_reduce,
    ("tree", "all_reduce"): _tree_all_reduce,
    ("tree", "broadcast"): _tree_broadcast,
    ("tree", "reduce"): _binomial_reduce,
    ("tree", "all_gather"): _ring_all_gather_op,
    ("tree", "reduce_scatter"): _ring_reduce_scatter,
    ("halving_doubling", "all_reduce"): _halving_doubling_all_reduce,
    ("halving_doubling", "broadcast"): _tree_broadcast,
    ("halving_doubling", "reduce"): _binomial_reduce,
    ("halving_doubling", "all_gather"): _ring_all_gather_op,
    ("halving_doubling", "reduce_scatter"): _ring_reduce_scatter,
    ("naive", "all_reduce"): _naive_all_reduce,
    ("naive", "broadcast"): _naive_broadcast,
    ("naive", "reduce"): _naive_reduce,
    ("naive", "all_gather"): _naive_all_gather,
    ("naive", "reduce_scatter"): _naive_reduce_scatter,
    ("native", "all_reduce"): _ring_all_reduce,
    ("native", "broadcast"): _binomial_broadcast,
    ("native", "reduce"): _binomial_reduce,
    ("native", "all_gather"): _ring_all_gather_op,
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
    return formula(float(nbytes), world_size, profile) + dict(profile.call_overheads).get(
        f"{op}/{algorithm}", 0.0
    )


def choose(
    op: str,
    nbytes: int,
    world_size: int,
    profile: CostProfile,
    candidates: tuple[str, ...] = AUTO_CANDIDATES,
) -> str:
    """The candidate predicted fastest (ties go to the earlier candidate)."""
    return min(candidates, key=lambda algorithm: predict(algorithm, op, nbytes, world_size, profile))
