"""Checkpoint throughput: shardwise against torch.distributed.checkpoint and the disk's raw speed.

Each of ``nproc`` ranks owns ``size_mb / nproc`` MB of a sharded state (a few float32 tensors, each
rank a flat range of every one). One repeat, interleaved so drift hits everyone alike: raw write +
fsync of the same bytes, our save, DCP's save (FileSystemWriter), our load, DCP's load
(FileSystemReader). Every phase runs between two barriers and is timed on rank 0; figures are medians.
Communication: barriers, plus whatever each library does (ours: one small broadcast and two barriers
per save; DCP: its planning gathers). Loads read from the page cache, so they measure the software,
not the disk. DCP stores its metadata with pickle; it is read back only from files this run just wrote.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint.manager import Piece, save
from shardwise.checkpoint.reader import load
from shardwise.collectives.api import Comm
from shardwise.device import HOST
from shardwise.testing import run_on_ranks

PHASES = ("raw_save", "ours_save", "dcp_save", "ours_load", "dcp_load")
N_TENSORS = 4


def _timed(comm: Comm, fn: Callable[[], object]) -> float:
    comm.barrier()
    start = time.perf_counter()
    fn()
    comm.barrier()
    return time.perf_counter() - start


def _raw_write(path: str, tensors: list[torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors:
            f.write(memoryview(t.view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy buffer
        f.flush()
        os.fsync(f.fileno())


def _bench_rank(rank: int, world_size: int, size_mb: float, repeats: int, root: str) -> dict[str, Any]:
    comm = Comm()
    per_tensor = int(size_mb * 1e6 / 4 / world_size / N_TENSORS)  # float32 elements per rank per tensor
    gen = torch.Generator().manual_seed(rank)
    mine = [torch.randn(per_tensor, generator=gen, device=HOST) for _ in range(N_TENSORS)]
    span = (rank * per_tensor, (rank + 1) * per_tensor)
    pieces = [Piece(f"t{i}", (world_size * per_tensor,), *span, t) for i, t in enumerate(mine)]
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    for rep in range(repeats):
        for phase, seconds in _one_repeat(comm, root, rep, mine, pieces, span).items():
            times[phase].append(seconds)
    return {"times_s": times, "bytes": sum(t.numel() * t.element_size() for t in mine)}


def _one_repeat(
    comm: Comm, root: str, rep: int, mine: list[torch.Tensor], pieces: list[Piece], span: tuple[int, int]
) -> dict[str, float]:
    rank = comm.rank
    raw_dir, ours_dir, dcp_dir = (os.path.join(root, f"{kind}-{rep}") for kind in ("raw", "ours", "dcp"))
    os.makedirs(raw_dir, exist_ok=True)
    dcp_state = {f"t{i}.rank{rank}": t for i, t in enumerate(mine)}
    dcp_into = {k: torch.empty_like(v) for k, v in dcp_state.items()}
    loaded: dict[str, torch.Tensor] = {}
    runs = {
        "raw_save": lambda: _raw_write(os.path.join(raw_dir, f"rank{rank}.bin"), mine),
        "ours_save": lambda: save(ours_dir, rep, pieces, comm, keep=0),
        "dcp_save": lambda: dcp.save(dcp_state, storage_writer=dcp.FileSystemWriter(dcp_dir)),
        "ours_load": lambda: loaded.update(load(ours_dir, {f"t{i}": span for i in range(len(mine))})),
        "dcp_load": lambda: dcp.load(dcp_into, storage_reader=dcp.FileSystemReader(dcp_dir)),
    }
    times = {phase: _timed(comm, runs[phase]) for phase in PHASES}
    for i, t in enumerate(mine):
        if not (torch.equal(loaded[f"t{i}"], t) and torch.equal(dcp_into[f"t{i}.rank{rank}"], t)):
            raise AssertionError(
                f"rank {rank}: tensor t{i} loaded back differs from what was saved (repeat {rep})"
            )
    comm.barrier()
    if rank == 0:
        for folder in (raw_dir, ours_dir, dcp_dir):
            shutil.rmtree(folder, ignore_errors=True)
    comm.barrier()
    return times


def run_ckpt_bench(
    nproc: int = 2, size_mb: float = 64.0, repeats: int = 3, dir: str | None = None, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Save/load MB/s for shardwise and DCP and raw write MB/s; ``speed_ratio`` = ours / DCP (save)."""
    with tempfile.TemporaryDirectory(prefix="shardwise-ckpt-bench-", dir=dir) as root:
        per_rank = run_on_ranks(_bench_rank, nproc, size_mb, repeats, root, timeout_s=timeout_s)
    total = sum(r["bytes"] for r in per_rank)
    medians = {p: statistics.median(per_rank[0]["times_s"][p]) for p in PHASES}
    mb_s = {p: total / medians[p] / 1e6 for p in PHASES}
    return {
        "benchmark": "ckpt",
        "nproc": nproc,
        "size_mb": size_mb,
        "repeats": repeats,
        "bytes": total,
        "raw_write_mb_s": mb_s["raw_save"],
        "save_mb_s": {"shardwise": mb_s["ours_save"], "dcp": mb_s["dcp_save"]},
        "load_mb_s": {"shardwise": mb_s["ours_load"], "dcp": mb_s["dcp_load"]},
        "speed_ratio": medians["dcp_save"] / medians["ours_save"],
        "load_speed_ratio": medians["dcp_load"] / medians["ours_load"],
        "save_vs_raw": medians["raw_save"] / medians["ours_save"],
        "samples_s": per_rank[0]["times_s"],
        "notes": "medians over interleaved repeats, timed on rank 0 between barriers; loads hit the page "
        "cache; ours writes crc32 checksums (DCP writes none)",
    }
