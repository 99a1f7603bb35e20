"""The cost model's step costs, measured on this machine: the steps themselves (``step_calls``, which
``shardwise bench comm`` times beside the algorithms) and ``--calibrate``, which times them alone.

Communication pattern: ranks in pairs (rank xor 1), all pairs at the same time, so the figures include
the contention the real collectives see; an unpaired last rank only reduces and copies. Four step
costs are timed (``--calibrate``: at message sizes from 4 bytes to 64 MB):

- an *exchange*: both ranks of a pair send m bytes to each other at once (a ring or halving-doubling
  step);
- a *one-way step*: a send whose receiver is waiting for it before it can go on (a tree or naive step);
- a *reduce*: an in-place float32 add of m bytes;
- a *copy* of m bytes.

The two kinds of message step are timed as two steps back to back, halved (for the one-way step, the
classic ping-pong): a collective is a chain of steps, and on a shared machine a chain's typical time is
more than one step's times its length, because each step can be the one that waits for the scheduler.
Sizes go from small to large and the kinds take turns at each size, as the benchmark runs its
algorithms: the kernel tunes its socket buffers to recent traffic, so a message costs a little less
among others of its size than among much larger ones. The profile keeps the measured points (``cost``
interpolates them) and, for reading, the straight lines ``alpha + beta m`` fitted through them by least
squares on the relative error. Every figure uses the statistic of ``timing``, the same as the benchmark
it is compared with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.collectives import cost
from shardwise.collectives.timing import interleaved_times, quantile
from shardwise.device import HOST
from shardwise.testing import run_on_ranks

SIZES = (4, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
SAMPLES = 40
KINDS = ("exchange", "one_way", "reduce", "copy")


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(alpha, beta)`` of ``t = alpha + beta * m`` through ``(m, t)`` points, both kept >= 0.

    Minimises the sum of ``((alpha + beta * m) / t - 1) ** 2``: a weighted least-squares line, where
    a 100 us message counts as much as a 10 ms one.
    """
    s_aa = sum(1 / t**2 for _, t in points)
    s_ab = sum(m / t**2 for m, t in points)
    s_bb = sum(m**2 / t**2 for m, t in points)
    r_a = sum(1 / t for _, t in points)
    r_b = sum(m / t for m, t in points)
    det = s_aa * s_bb - s_ab**2
    if det <= 0:
        raise ValueError("need at least two distinct message sizes to fit alpha and beta")
    alpha = (r_a * s_bb - r_b * s_ab) / det
    beta = (s_aa * r_b - s_ab * r_a) / det
    if alpha < 0:
        return 0.0, r_b / s_bb
    if beta < 0:
        return r_a / s_aa, 0.0
    return alpha, beta


HALVE = {"exchange": 2, "one_way": 2, "reduce": 1, "copy": 1}  # message steps are timed two in a row


def step_calls(rank: int, partner: int | None, nbytes: int) -> dict[str, Callable[[], None]]:
    """The timed steps at ``nbytes`` (divide their times by ``HALVE``); no messages without a partner."""
    numel = max(1, nbytes // 4)
    data, into = torch.ones(numel, device=HOST), torch.zeros(numel, device=HOST)  # gloo: the host

    def exchange() -> None:
        for _ in range(2):
            for request in [dist.irecv(into, partner), dist.isend(data, partner)]:
                assert request is not None  # the default group: every rank is in it
                request.wait()

    def ping_pong() -> None:
        if rank % 2 == 0:
            dist.send(data, partner)
            dist.recv(into, partner)
        else:
            dist.recv(into, partner)
            dist.send(data, partner)

    def reduce() -> None:
        into.add_(data)

    def copy() -> None:
        into.copy_(data)

    if partner is None:
        return {"exchange": _idle, "one_way": _idle, "reduce": reduce, "copy": copy}
    return {"exchange": exchange, "one_way": ping_pong, "reduce": reduce, "copy": copy}


def _idle() -> None:
    return None


def partner_of(rank: int, world_size: int) -> int | None:
    return rank ^ 1 if rank ^ 1 < world_size else None


def _calibrate_worker(rank: int, world_size: int) -> dict[str, list[tuple[int, float]]]:
    partner = partner_of(rank, world_size)
    points: dict[str, list[tuple[int, float]]] = {kind: [] for kind in KINDS}
    for nbytes in SIZES:  # size by size, small to large, as the benchmark runs
        times = interleaved_times(step_calls(rank, partner, nbytes), SAMPLES)
        for kind in KINDS:
            points[kind].append((nbytes, quantile(times[kind]) / HALVE[kind]))
    return points


def calibrate(nproc: int = 2, timeout_s: float = 300.0) -> tuple[cost.CostProfile, dict[str, list]]:
    """Measure the cost-model step costs on ``nproc`` local ranks; the profile and the measured points."""
    if nproc < 2:
        raise ValueError(f"calibration needs at least 2 ranks, got {nproc}")
    points = run_on_ranks(_calibrate_worker, nproc, timeout_s=timeout_s)[0]  # samples are max-reduced
    return profile_from_points(points, f"calibrated on {nproc} local gloo ranks"), points


def profile_from_points(points: dict[str, list[tuple[int, float]]], what: str) -> cost.CostProfile:
    """A profile from measured step costs (every kind at two sizes or more), with fitted lines."""
    alpha, beta = fit_alpha_beta(points["exchange"])
    alpha_one_way, beta_one_way = fit_alpha_beta(points["one_way"])
    _, gamma = fit_alpha_beta(points["reduce"])
    return cost.CostProfile(
        alpha_s=alpha,
        beta_s_per_byte=beta,
        gamma_s_per_byte=gamma,
        source=f"{what} at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        beta_one_way_s_per_byte=beta_one_way,
        alpha_one_way_s=alpha_one_way,
        exchange_points=_as_points(points["exchange"]),
        one_way_points=_as_points(points["one_way"]),
        reduce_points=_as_points(points["reduce"]),
        copy_points=_as_points(points["copy"]),
    )


def _as_points(points: list[tuple[int, float]]) -> cost.Points:
    return tuple((float(m), float(t)) for m, t in points)
