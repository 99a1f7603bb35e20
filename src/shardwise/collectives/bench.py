"""``shardwise bench comm``: every collective algorithm against the backend's own, beside the cost model.

Communication pattern: whatever is measured. Ranks are started with ``run_on_ranks`` (gloo, loopback).
For each op, size and algorithm the ranks run a warm-up call, then ``ROUNDS`` rounds of back-to-back
calls; a round's time is the slowest rank's mean, and the best round is reported (the machine is
shared, so the minimum is the least disturbed figure). Bandwidths follow nccl-tests: algbw = bytes /
time, busbw = algbw x (2(p-1)/p for all-reduce, (p-1)/p for all-gather and reduce-scatter, 1 for
broadcast and reduce), where bytes is the whole tensor (all-gather: the gathered output).

Calibration (``calibrate=True``) measures the three constants of the cost model on the same machine:
alpha from back-to-back one-element exchanges (a ping-pong's half round trip is several times larger on
a loaded machine, where each blocking receive waits for the scheduler; collectives keep messages in
flight and see the smaller figure), beta from two ranks exchanging 16 MB at once (the shape of
ring and halving-doubling steps), the one-way beta from 16 MB sent one way (tree and naive steps),
gamma from a local in-place float32 add; all ranks run in pairs at the same time, so the figures include
the contention of the real collectives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.collectives import cost
from shardwise.collectives.api import Comm
from shardwise.testing import run_on_ranks

DEFAULT_SIZES = [4096 * 4**i for i in range(9)]  # 4 KB ... 256 MB
ALGORITHMS = {
    "all_reduce": ("native", "ring", "halving_doubling", "tree", "naive"),
    "broadcast": ("native", "tree", "ring", "naive"),
    "reduce": ("native", "tree", "naive"),
    "all_gather": ("native", "ring", "naive"),
    "reduce_scatter": ("native", "ring", "naive"),
}
ROUNDS = 5
CALIBRATION_BYTES = 16 << 20


def bus_factor(op: str, p: int) -> float:
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter"):
        return (p - 1) / p
    return 1.0


def _iterations(nbytes: int) -> int:
    return max(3, min(20, (32 << 20) // max(nbytes, 1)))


def _call(comm: Comm, op: str, algorithm: str, nbytes: int) -> Callable[[], object]:
    """A closure running one ``op`` of ``nbytes`` (float32) with ``algorithm``."""
    p = comm.world_size
    numel = max(p, nbytes // 4 // p * p)
    if op == "all_reduce":
        x = torch.ones(numel)
        return lambda: comm.all_reduce(x, "sum", algorithm=algorithm)
    if op == "broadcast":
        x = torch.ones(numel)
        return lambda: comm.broadcast(x, 0, algorithm=algorithm)
    if op == "reduce":
        x = torch.ones(numel)
        return lambda: comm.reduce(x, 0, "sum", algorithm=algorithm)
    if op == "all_gather":
        out, shard = torch.empty(numel), torch.ones(numel // p)
        return lambda: comm.all_gather(out, shard, algorithm=algorithm)
    full, shard = torch.ones(numel), torch.empty(numel // p)
    return lambda: comm.reduce_scatter(shard, full, "sum", algorithm=algorithm)


def _time(comm: Comm, fn: Callable[[], object], iterations: int) -> float:
    """Best round's mean seconds per call, each round's figure taken from the slowest rank."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(ROUNDS):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, elapsed.item())
    return best


def _bench_worker(
    rank: int, world_size: int, sizes: list[int], ops: list[str]
) -> list[tuple[str, str, int, float]]:
    comm = Comm()
    rows = []
    for op in ops:
        for nbytes in sizes:
            for algorithm in ALGORITHMS[op]:
                fn = _call(comm, op, algorithm, nbytes)
                numel = max(world_size, nbytes // 4 // world_size * world_size)
                rows.append((op, algorithm, numel * 4, _time(comm, fn, _iterations(nbytes))))
    return rows


def _latency(rank: int, partner: int, steps: int = 50) -> float:
    """Seconds per step of back-to-back one-element exchanges: the latency a collective's steps see."""
    out, into = torch.zeros(1), torch.zeros(1)
    start = time.perf_counter()
    for _ in range(steps):
        requests = [dist.irecv(into, partner), dist.isend(out, partner)]
        for request in requests:
            request.wait()
    return (time.perf_counter() - start) / steps


def _transfer(rank: int, partner: int, both_ways: bool, data: torch.Tensor, into: torch.Tensor) -> float:
    """Seconds to move ``data`` to the partner (and back into ``into`` at the same time if both_ways)."""
    start = time.perf_counter()
    requests = []
    if both_ways or rank % 2 == 1:
        requests.append(dist.irecv(into, partner))
    if both_ways or rank % 2 == 0:
        requests.append(dist.isend(data, partner))
    for request in requests:
        request.wait()
    return time.perf_counter() - start


def _calibrate_worker(rank: int, world_size: int) -> dict[str, float]:
    """Measure alpha, betas and gamma; every rank with a partner (rank xor 1) runs at the same time."""
    partner = rank ^ 1
    figures = {"alpha_s": float("inf"), "beta_s_per_byte": float("inf")}
    figures["beta_one_way_s_per_byte"] = float("inf")
    if partner < world_size:
        figures["alpha_s"] = min(_latency(rank, partner) for _ in range(ROUNDS))
        # buffers touched before timing: first-touch page faults are not the link's cost
        data, into = torch.ones(CALIBRATION_BYTES // 4), torch.zeros(CALIBRATION_BYTES // 4)
        _transfer(rank, partner, True, data, into)
        for key, both_ways in (("beta_s_per_byte", True), ("beta_one_way_s_per_byte", False)):
            seconds = min(_transfer(rank, partner, both_ways, data, into) for _ in range(ROUNDS))
            figures[key] = max(seconds - figures["alpha_s"], 0.0) / CALIBRATION_BYTES
    a, b = torch.ones(CALIBRATION_BYTES // 4), torch.ones(CALIBRATION_BYTES // 4)
    dist.barrier()
    gamma = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        a.add_(b)
        gamma = min(gamma, (time.perf_counter() - start) / CALIBRATION_BYTES)
    figures["gamma_s_per_byte"] = gamma
    return figures


def calibrate_profile(nproc: int = 2, timeout_s: float = 300.0) -> cost.CostProfile:
    """Measure the cost-model constants on ``nproc`` local ranks (the worst paired rank's figures)."""
    if nproc < 2:
        raise ValueError(f"calibration needs at least 2 ranks, got {nproc}")
    figures = run_on_ranks(_calibrate_worker, nproc, timeout_s=timeout_s)
    paired = [f for f in figures if f["alpha_s"] != float("inf")]
    return cost.CostProfile(
        alpha_s=max(f["alpha_s"] for f in paired),
        beta_s_per_byte=max(f["beta_s_per_byte"] for f in paired),
        gamma_s_per_byte=max(f["gamma_s_per_byte"] for f in figures),
        source=f"calibrated on {nproc} local gloo ranks at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        beta_one_way_s_per_byte=max(f["beta_one_way_s_per_byte"] for f in paired),
    )


def _row(op: str, algorithm: str, nbytes: int, seconds: float, p: int, profile: cost.CostProfile) -> dict:
    algbw = nbytes / seconds / 1e9
    predicted = cost.predict(algorithm, op, nbytes, p, profile)
    return {
        "op": op,
        "algorithm": algorithm,
        "bytes": nbytes,
        "time_us": seconds * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor(op, p),
        "predicted_us": predicted * 1e6,
        "model_error": abs(predicted - seconds) / seconds,
    }


def _summaries(rows: list[dict]) -> dict[str, object]:
    """The ring-vs-native ratio at 16 MB+ and the model's worst error at 1 MB+ (explicit algorithms)."""
    native = {(r["op"], r["bytes"]): r["busbw_gbps"] for r in rows if r["algorithm"] == "native"}
    ratios = [
        r["busbw_gbps"] / native[(r["op"], r["bytes"])]
        for r in rows
        if r["op"] == "all_reduce" and r["algorithm"] == "ring" and r["bytes"] >= 16 << 20
    ]
    large = [r for r in rows if r["bytes"] >= 1 << 20 and r["algorithm"] != "native"]
    by_algorithm: dict[str, float] = {}
    for r in large:
        key = f"{r['op']}/{r['algorithm']}"
        by_algorithm[key] = max(by_algorithm.get(key, 0.0), r["model_error"])
    return {
        "ring_vs_native_busbw_16mb_plus": min(ratios) if ratios else None,
        "model_error_1mb_plus": max((r["model_error"] for r in large), default=None),
        "model_error_1mb_plus_by_algorithm": by_algorithm,
    }


def run_comm_bench(
    nproc: int = 2,
    sizes: list[int] | None = None,
    calibrate: bool = False,
    profile_path: str | None = None,
    ops: list[str] | None = None,
    timeout_s: float = 1200.0,
) -> dict[str, object]:
    """Benchmark every algorithm of ``ops`` over ``sizes`` on ``nproc`` ranks; JSON-ready result.

    ``calibrate`` measures a profile first (and saves it to ``profile_path`` when given);
    otherwise the profile is read from ``profile_path`` if it exists, else the built-in default.
    """
    sizes = sizes or DEFAULT_SIZES
    ops = ops or list(ALGORITHMS)
    if calibrate:
        profile = calibrate_profile(nproc)
        if profile_path:
            profile.save(profile_path)
    elif profile_path and Path(profile_path).exists():
        profile = cost.CostProfile.load(profile_path)
    else:
        profile = cost.CostProfile()
    measured = run_on_ranks(_bench_worker, nproc, sizes, ops, timeout_s=timeout_s)[0]
    rows = [_row(op, algorithm, n, t, nproc, profile) for op, algorithm, n, t in measured]
    return {
        "nproc": nproc,
        "backend": "gloo",
        "profile": {
            "alpha_s": profile.alpha_s,
            "beta_s_per_byte": profile.beta_s_per_byte,
            "gamma_s_per_byte": profile.gamma_s_per_byte,
            "beta_one_way_s_per_byte": profile.one_way_beta,
            "source": profile.source,
        },
        "timing": f"best of {ROUNDS} rounds of back-to-back calls, slowest rank; float32 tensors",
        "rows": rows,
        **_summaries(rows),
    }


def format_table(result: dict) -> str:
    """An nccl-tests style table: one line per op, size and algorithm."""
    header = (
        f"{'op':>15} {'algorithm':>17} {'size(B)':>12} {'time(us)':>11} {'algbw(GB/s)':>12} "
        f"{'busbw(GB/s)':>12} {'pred(us)':>11} {'err':>6}"
    )
    lines = [
        f"# nproc {result['nproc']}, {result['backend']}; {result['timing']}",
        f"# profile: {result['profile']['source']}",
        "#" + header[1:],
    ]
    previous = None
    for r in result["rows"]:
        if previous is not None and r["op"] != previous:
            lines.append("")
        previous = r["op"]
        lines.append(
            f"{r['op']:>15} {r['algorithm']:>17} {r['bytes']:>12} {r['time_us']:>11.1f} "
            f"{r['algbw_gbps']:>12.3f} {r['busbw_gbps']:>12.3f} {r['predicted_us']:>11.1f} "
            f"{r['model_error']:>6.0%}"
        )
    ratio, error = result["ring_vs_native_busbw_16mb_plus"], result["model_error_1mb_plus"]
    if ratio is not None:
        lines.append(f"# ring all-reduce busbw / native, 16 MB and above (min): {ratio:.2f}")
    if error is not None:
        lines.append(f"# cost model, worst relative error at 1 MB and above: {error:.0%}")
    return "\n".join(lines)
