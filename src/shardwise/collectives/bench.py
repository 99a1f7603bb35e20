"""``shardwise bench comm``: every collective algorithm against the backend's own, beside the cost model.

Communication pattern: whatever is measured. Ranks are started with ``run_on_ranks`` (gloo, loopback).
For each op and size, the algorithms take turns call by call, and each reports the lower quartile of
its per-call times (slowest rank): see ``timing`` for why. Bandwidths follow nccl-tests: algbw = bytes /
time, busbw = algbw x (2(p-1)/p for all-reduce, (p-1)/p for all-gather and reduce-scatter, 1 for
broadcast and reduce), where bytes is the whole tensor (all-gather: the gathered output).

The cost model's step costs are measured in the same turns as the algorithms they predict (see
``run_comm_bench``); ``shardwise bench comm --calibrate`` measures them alone, over fixed sizes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import torch

from shardwise.collectives import cost
from shardwise.collectives.api import Comm
from shardwise.collectives.calibrate import (
    HALVE,
    KINDS,
    calibrate,
    partner_of,
    profile_from_points,
    step_calls,
)
from shardwise.collectives.timing import STATISTIC, interleaved_times, quantile
from shardwise.device import HOST
from shardwise.testing import run_on_ranks

DEFAULT_SIZES = [4096 * 4**i for i in range(9)]  # 4 KB ... 256 MB
ALGORITHMS = {
    "all_reduce": ("native", "ring", "halving_doubling", "tree", "naive"),
    "broadcast": ("native", "tree", "ring", "naive"),
    "reduce": ("native", "tree", "naive"),
    "all_gather": ("native", "ring", "naive"),
    "reduce_scatter": ("native", "ring", "naive"),
}


def bus_factor(op: str, p: int) -> float:
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter"):
        return (p - 1) / p
    return 1.0


def _samples(nbytes: int) -> int:
    """Calls per algorithm: 64 up to 16 MB, 16 for the largest (a quartile of 8 calls swings too much)."""
    return max(16, min(64, (1 << 30) // max(nbytes, 1)))


def _call(comm: Comm, op: str, algorithm: str, nbytes: int) -> Callable[[], object]:
    """A closure running one ``op`` of ``nbytes`` (float32) with ``algorithm``."""
    p = comm.world_size
    numel = max(p, nbytes // 4 // p * p)
    if op == "all_reduce":
        x = torch.ones(numel, device=HOST)  # gloo's collectives, on the host
        return lambda: comm.all_reduce(x, "sum", algorithm=algorithm)
    if op == "broadcast":
        x = torch.ones(numel, device=HOST)
        return lambda: comm.broadcast(x, 0, algorithm=algorithm)
    if op == "reduce":
        x = torch.ones(numel, device=HOST)
        return lambda: comm.reduce(x, 0, "sum", algorithm=algorithm)
    if op == "all_gather":
        out, shard = torch.empty(numel, device=HOST), torch.ones(numel // p, device=HOST)
        return lambda: comm.all_gather(out, shard, algorithm=algorithm)
    full, shard = torch.ones(numel, device=HOST), torch.empty(numel // p, device=HOST)
    return lambda: comm.reduce_scatter(shard, full, "sum", algorithm=algorithm)


Rows = list[tuple[str, str, int, float]]  # (op, algorithm, bytes, seconds)
StepTimes = dict[str, dict[int, list[float]]]  # step kind -> message bytes -> one figure per turn


def _bench_worker(rank: int, world_size: int, sizes: list[int], ops: list[str]) -> tuple[Rows, StepTimes]:
    """Time every algorithm of every op at every size, and the model's steps in the same turns."""
    comm = Comm()
    partner = partner_of(rank, world_size)
    rows: Rows = []
    steps: StepTimes = {kind: {} for kind in KINDS}
    for op in ops:
        for nbytes in sizes:
            numel = max(world_size, nbytes // 4 // world_size * world_size)
            calls = {algorithm: _call(comm, op, algorithm, nbytes) for algorithm in ALGORITHMS[op]}
            messages = sorted({numel * 4 // world_size, numel * 4})  # what the formulas ask for
            for m in messages:
                calls.update({f"{kind}@{m}": fn for kind, fn in step_calls(rank, partner, m).items()})
            times = interleaved_times(calls, _samples(nbytes))
            rows.extend((op, a, numel * 4, quantile(times[a])) for a in ALGORITHMS[op])
            for m in messages:
                for kind in KINDS:
                    steps[kind].setdefault(m, []).append(quantile(times[f"{kind}@{m}"]) / HALVE[kind])
            del calls  # free this size's tensors before the next
    return rows, steps


def _call_overheads(measured: Rows, p: int, profile: cost.CostProfile) -> tuple[tuple[str, float], ...]:
    """Per op and algorithm: measured minus predicted steps at the smallest size, if below 1 MB."""
    smallest = min(n for _, _, n, _ in measured)
    if smallest >= 1 << 20:
        return ()
    return tuple(
        (f"{op}/{algorithm}", max(0.0, seconds - cost.predict(algorithm, op, n, p, profile)))
        for op, algorithm, n, seconds in measured
        if n == smallest
    )


def _profile_summary(profile: cost.CostProfile) -> dict[str, object]:
    return {
        "alpha_s": profile.alpha_s,
        "beta_s_per_byte": profile.beta_s_per_byte,
        "alpha_one_way_s": profile.one_way_alpha,
        "beta_one_way_s_per_byte": profile.one_way_beta,
        "gamma_s_per_byte": profile.gamma_s_per_byte,
        "call_overheads_us": {key: seconds * 1e6 for key, seconds in profile.call_overheads},
        "source": profile.source,
    }


def _step_points(steps: StepTimes) -> dict[str, list[tuple[int, float]]]:
    """One figure per step kind and size: the median over the turns that measured it."""
    return {
        kind: [(m, statistics.median(v)) for m, v in sorted(by_size.items())]
        for kind, by_size in steps.items()
    }


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
    """The ring-vs-native ratio at 16 MB+; the model's worst error at 1 MB+, for our algorithms and for
    native (whose algorithm gloo chooses internally, so its formula is an estimate)."""
    native_busbw = {(r["op"], r["bytes"]): r["busbw_gbps"] for r in rows if r["algorithm"] == "native"}
    ratios = [
        r["busbw_gbps"] / native_busbw[(r["op"], r["bytes"])]
        for r in rows
        if r["op"] == "all_reduce" and r["algorithm"] == "ring" and r["bytes"] >= 16 << 20
    ]
    by_algorithm: dict[str, float] = {}
    by_op: dict[str, float] = {}  # our algorithms only
    for r in rows:
        if r["bytes"] < 1 << 20:
            continue
        key, error = f"{r['op']}/{r['algorithm']}", r["model_error"]
        by_algorithm[key] = max(by_algorithm.get(key, 0.0), error)
        if r["algorithm"] != "native":
            by_op[r["op"]] = max(by_op.get(r["op"], 0.0), error)
    native = [e for key, e in by_algorithm.items() if key.endswith("/native")]
    return {
        "ring_vs_native_busbw_16mb_plus": min(ratios) if ratios else None,
        "model_error_1mb_plus": max(by_op.values(), default=None),
        "model_error_1mb_plus_native": max(native, default=None),
        "model_error_1mb_plus_by_op": by_op,
        "model_error_1mb_plus_by_algorithm": by_algorithm,
    }


def run_comm_bench(
    nproc: int = 2,
    sizes: list[int] | None = None,
    profile_path: str | None = None,
    ops: list[str] | None = None,
    timeout_s: float = 1200.0,
) -> dict[str, object]:
    """Benchmark every algorithm of ``ops`` over ``sizes`` on ``nproc`` ranks; JSON-ready result.

    The cost model's steps (exchange, one-way, reduce, copy at the message sizes the formulas use) are
    timed in the same turns as the algorithms, so both see the same machine; the profile they make
    predicts every row and is saved to ``profile_path`` when given (where ``auto`` finds it).
    """
    sizes = sizes or DEFAULT_SIZES
    ops = ops or list(ALGORITHMS)
    measured, steps = run_on_ranks(_bench_worker, nproc, sizes, ops, timeout_s=timeout_s)[0]
    points = _step_points(steps)
    profile = profile_from_points(points, f"measured beside the algorithms on {nproc} local gloo ranks")
    profile = replace(profile, call_overheads=_call_overheads(measured, nproc, profile))
    if profile_path:
        profile.save(profile_path)
    rows = [_row(op, algorithm, n, t, nproc, profile) for op, algorithm, n, t in measured]
    return {
        "nproc": nproc,
        "backend": "gloo",
        "profile": _profile_summary(profile),
        "calibration_points_s": points,
        "timing": f"{STATISTIC}; float32 tensors",
        "rows": rows,
        **_summaries(rows),
    }


def run_calibration(nproc: int = 2, profile_path: str | None = None) -> dict[str, object]:
    """``--calibrate``: the step costs alone, over ``calibrate.SIZES``; saved to ``profile_path``."""
    profile, points = calibrate(nproc)
    if profile_path:
        profile.save(profile_path)
    return {
        "nproc": nproc,
        "backend": "gloo",
        "profile": _profile_summary(profile),
        "calibration_points_s": points,
    }


def format_calibration(result: dict) -> str:
    """The measured step costs, one line per message size."""
    points = result["calibration_points_s"]
    lines = [f"# step costs on {result['nproc']} ranks, us; {result['profile']['source']}"]
    lines.append(f"{'bytes':>12}" + "".join(f"{kind:>12}" for kind in points))
    for i, (nbytes, _) in enumerate(next(iter(points.values()))):
        lines.append(f"{nbytes:>12}" + "".join(f"{points[kind][i][1] * 1e6:>12.1f}" for kind in points))
    return "\n".join(lines)


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
    native_error = result.get("model_error_1mb_plus_native")
    if native_error is not None:
        lines.append(f"# (for native, whose algorithm gloo picks internally: {native_error:.0%})")
    return "\n".join(lines)
