"""Timing collectives on a shared machine: closures take turns, one call per sample, a low quantile.

Communication pattern: the timed calls themselves, then one all-reduce (max) of every sample, so a
sample is the slowest rank's time for that call.

On a small, shared machine a call's time has a long tail: a rank whose thread is not running when its
message arrives waits for the scheduler, and a call costs several times its usual time. Blocks of
back-to-back calls average the tail in, so their figure swings between runs. Instead each call is one
sample; the closures being compared take turns, in a new shuffled order each turn (the same on every
rank), so a disturbance hits them alike and none always follows the same neighbour; a barrier before
each call keeps a rank that is still finishing the previous one out of the next one's time; and
the figure reported is the lower quartile, the time of a call the tail has not reached. Calibration and
the benchmark use this same statistic, so the cost model is fitted to what it is judged against.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from shardwise.device import HOST

QUANTILE = 0.25
STATISTIC = "lower quartile of per-call times (slowest rank), the compared calls taking turns"


def interleaved_times(calls: Mapping[str, Callable[[], object]], samples: int) -> dict[str, list[float]]:
    """Seconds of ``samples`` calls of each closure (taking turns), each the slowest rank's.

    Every rank of the default group must call this with the same names and ``samples``.
    """
    functions = list(calls.values())
    for fn in functions:  # warm-up: buffers touched, connections made
        fn()
    times = torch.zeros(len(calls), samples, dtype=torch.float64, device=HOST)
    order = random.Random(samples)  # the same shuffles on every rank
    for sample in range(samples):
        for index in order.sample(range(len(functions)), len(functions)):
            dist.barrier()  # no call starts while a rank is still busy with the one before
            start = time.perf_counter()
            functions[index]()
            times[index, sample] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: times[index].tolist() for index, name in enumerate(calls)}


def quantile(values: list[float], q: float = QUANTILE) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, no interpolation)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
