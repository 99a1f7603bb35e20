"""Every explicit algorithm x collective x op x dtype x size gives what the backend (gloo) gives.

All cases of one world size run in ONE ``run_on_ranks`` call; each rank returns the descriptions of its
mismatches, so a failure names the case. Comparison: exact (``torch.equal``) for integer dtypes, for
float64 sums and for max/min of any dtype. Inputs are multiples of 1/8 (small integers for integer
dtypes), so float64 sums are exact in any order and the exact check is meaningful rather than lucky.
float32, bf16 and fp16 sums/avgs use a tolerance (bf16/fp16 reduce in their own dtype, in a different
order than gloo): float32 1e-5, fp16 1e-2, bf16 5e-2, relative to max(1, |value|).
"""

from __future__ import annotations

import pytest
import torch

from shardwise.collectives import P2P, Comm, ring
from shardwise.testing import run_on_ranks

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)
REDUCE_OPS = ("sum", "avg", "max", "min")
# sum runs on every dtype; the other ops, and the collectives that move data without reducing it, on
# these two (bf16/fp16 max/min are order-free, so nothing new is learnt there) to keep the file fast.
FEW_DTYPES = (torch.float64, torch.int32)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}

# "ring_seg" is the ring with about four segments per block (the pipelined path, last segment short);
# broadcast "ring" is the binomial scatter + ring all-gather (the tree's large-message variant).
ALGORITHMS = {
    "all_reduce": ("ring", "ring_seg", "tree", "halving_doubling", "naive", "auto"),
    "broadcast": ("ring", "tree", "naive"),
    "reduce": ("tree", "naive"),
    "all_gather": ("ring", "ring_seg", "naive"),
    "reduce_scatter": ("ring", "ring_seg", "naive"),
}


def _sizes(world_size: int) -> tuple[int, ...]:
    return (1, 7, world_size * 5 + 3, 3001)


def _input(rank: int, case: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case + rank)
    values = torch.randint(-40, 41, (numel,), generator=gen)
    return values.to(dtype) if not dtype.is_floating_point else (values.double() / 8).to(dtype)


def _cases(world_size: int) -> list[tuple[str, str, torch.dtype, str, int]]:
    cases = []
    for collective, algorithms in ALGORITHMS.items():
        ops = REDUCE_OPS if collective in ("all_reduce", "reduce", "reduce_scatter") else ("-",)
        for algorithm in algorithms:
            for op in ops:
                for dtype in DTYPES if op == "sum" else FEW_DTYPES:
                    for numel in _sizes(world_size):
                        if _wanted(algorithm, op, numel):
                            cases.append((collective, algorithm, dtype, op, numel))
    return cases


def _wanted(algorithm: str, op: str, numel: int) -> bool:
    """ "auto" only adds its choice (tested under its own name) with sum; tiny tensors have one segment."""
    if algorithm == "auto":
        return op == "sum"
    return not (algorithm == "ring_seg" and numel < 10)


def _run(comm: Comm, collective: str, algorithm: str | None, x: torch.Tensor, op: str) -> torch.Tensor:
    """One collective on a copy of ``x``; returns what this rank ends up with."""
    p, root = comm.world_size, comm.world_size - 1  # a non-zero root exercises the renumbering
    p2p = P2P(comm.group)
    segment_bytes = max(x.element_size(), x.numel() * x.element_size() // (4 * p) + 1)
    if collective == "all_reduce":
        out = x.clone()
        if algorithm == "ring_seg":
            ring.all_reduce(out, p2p, "sum" if op == "avg" else op, segment_bytes=segment_bytes)
            if op == "avg":
                out = out.div(p) if out.is_floating_point() else out.div(p, rounding_mode="floor")
        else:
            comm.all_reduce(out, op, algorithm=algorithm)
        return out
    if collective == "broadcast":
        out = x.clone()
        comm.broadcast(out, root, algorithm=algorithm)
        return out
    if collective == "reduce":
        out = x.clone()
        comm.reduce(out, root, op, algorithm=algorithm)
        if comm.rank != root and not torch.equal(out, x):
            raise AssertionError("a non-root rank's input was modified")
        return out if comm.rank == root else x
    if collective == "all_gather":
        out = x.new_zeros(p * x.numel())
        if algorithm == "ring_seg":
            ring.all_gather(out, x, p2p, segment_bytes=segment_bytes)
        else:
            comm.all_gather(out, x, algorithm=algorithm)
        return out
    full = torch.cat([x] * p) * (comm.rank + 1) if x.dtype != torch.bool else x  # (p * numel,)
    given = full.clone()
    shard = x.new_zeros(x.numel())
    if algorithm == "ring_seg":
        ring.reduce_scatter(shard, full, p2p, "sum" if op == "avg" else op, segment_bytes=segment_bytes)
        if op == "avg":
            shard = shard.div(p) if shard.is_floating_point() else shard.div(p, rounding_mode="floor")
    else:
        comm.reduce_scatter(shard, full, op, algorithm=algorithm)
    if not torch.equal(full, given):
        raise AssertionError("reduce-scatter modified its input")
    return shard


def _mismatch(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, op: str) -> str | None:
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    exact = not dtype.is_floating_point or dtype == torch.float64 or op in ("max", "min", "-")
    if exact:
        return None if torch.equal(got, ref) else f"not equal: max diff {_diff(got, ref):.3e}"
    scale = ref.double().abs().clamp(min=1.0)
    worst = ((got.double() - ref.double()).abs() / scale).max().item()
    return None if worst <= TOLERANCE[dtype] else f"relative diff {worst:.3e} > {TOLERANCE[dtype]:.0e}"


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _check_cases(rank: int, world_size: int) -> list[str]:
    comm = Comm()
    failures = []
    for i, (collective, algorithm, dtype, op, numel) in enumerate(_cases(world_size)):
        x = _input(rank, i, numel, dtype)
        ref = _run(comm, collective, "native", x, op)
        try:
            got = _run(comm, collective, algorithm, x, op)
        except AssertionError as error:  # the collective itself completed on every rank
            failures.append(f"rank {rank} {collective}/{algorithm} {dtype} {op} numel={numel}: {error}")
            continue
        problem = _mismatch(got, ref, dtype, op)
        if problem:
            failures.append(f"rank {rank} {collective}/{algorithm} {dtype} {op} numel={numel}: {problem}")
    return failures


def _check_bytes_and_async(rank: int, world_size: int) -> dict[str, object]:
    """Exact byte counts of the ring all-reduce, and async calls that must keep their order."""
    comm = Comm(algorithm="ring")
    numel = 12 * world_size  # divisible: every rank sends exactly 2(p-1)/p of the tensor
    before = comm.stats.snapshot()
    comm.all_reduce(torch.ones(numel, dtype=torch.float64))
    ring_bytes = comm.stats.since(before)
    a, b = torch.full((5,), float(rank)), torch.full((9,), float(rank + 1))
    work_a = comm.all_reduce(a, "sum", async_op=True, algorithm="tree")
    work_b = comm.all_reduce(b, "max", async_op=True, algorithm="halving_doubling")
    work_b.wait()
    work_a.wait()
    return {
        "sent": ring_bytes.bytes_sent,
        "received": ring_bytes.bytes_received,
        "expected": 2 * (world_size - 1) * (numel // world_size) * 8,
        "calls": ring_bytes.calls,
        "a": a.tolist(),
        "b": b.tolist(),
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_matches_native(world_size: int) -> None:
    results = run_on_ranks(_check_cases, world_size, timeout_s=240)
    failures = [line for rank_failures in results for line in rank_failures]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("world_size", [3])
def test_exact_bytes_and_async_order(world_size: int) -> None:
    results = run_on_ranks(_check_bytes_and_async, world_size, timeout_s=60)
    total_a = float(sum(range(world_size)))
    for result in results:
        assert result["sent"] == result["expected"] == result["received"]
        assert result["calls"] == 1
        assert result["a"] == [total_a] * 5
        assert result["b"] == [float(world_size)] * 9
