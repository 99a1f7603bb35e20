"""Saved by ZeRO-3 on 4 ranks, loaded by DDP on 2, ZeRO-2 on 3 and one process: identical state.

The save side uses a ZeRO flat layout (every parameter flattened and concatenated, padded to a multiple
of the world size, split evenly), for the parameters and for each optimizer state; the loaders ask for
their own layouts. A corrupted newest checkpoint that only some loading ranks read makes every rank
fall back together to the previous one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.manager import CheckpointWriter, Piece, spread_replicated
from shardwise.checkpoint.reader import load, load_latest
from shardwise.collectives.api import Comm
from shardwise.testing import run_on_ranks

SHAPES = {"embed.weight": (11, 6), "block.0.w": (6, 6), "block.0.b": (6,), "head.w": (5, 6), "head.b": (5,)}
STATES = ("param", "exp_avg", "exp_avg_sq")


def _full_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    out = {f"{kind}/{name}": torch.randn(shape, generator=g, dtype=torch.float64)
           for kind in STATES for name, shape in SHAPES.items()}  # fmt: skip
    out["optim/step"] = torch.tensor(step, dtype=torch.int64)
    return out


def _flat_ranges(world_size: int, rank: int) -> dict[str, tuple[int, int]]:
    """ZeRO flat layout (local test helper): the part of each parameter inside this rank's shard."""
    total = sum(torch.Size(s).numel() for s in SHAPES.values())
    shard = -(-total // world_size)  # padded to a multiple of world_size
    lo, hi = rank * shard, (rank + 1) * shard
    out, offset = {}, 0
    for name, shape in SHAPES.items():
        n = torch.Size(shape).numel()
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out[name] = (a - offset, b - offset)
        offset += n
    return out


def _save_zero3(rank: int, world_size: int, root: str) -> list[dict]:
    comm = Comm()
    reports = []
    for step, async_save in ((1, False), (2, True)):
        state = _full_state(step)
        pieces = [
            Piece(f"{kind}/{name}", SHAPES[name], a, b, state[f"{kind}/{name}"].reshape(-1)[a:b])
            for kind in STATES
            for name, (a, b) in _flat_ranges(world_size, rank).items()
        ]
        owner = spread_replicated({"optim/step": state["optim/step"]}, world_size)
        if owner["optim/step"] == rank:
            pieces.append(Piece.full("optim/step", state["optim/step"]))
        writer = CheckpointWriter(root, comm, keep=3, async_save=async_save, chunk_bytes=64)
        writer.save(step, pieces, strategy="zero3", mesh={"dp": world_size}, meta={"sampler": {"pos": step}})
        report = writer.wait() if async_save else None
        reports.append({"async": async_save, "done": report.done if report else True})
    comm.barrier()
    return reports


def _check_layout(root: str, world_size: int, rank: int, step: int, zero: bool) -> None:
    expected = _full_state(step)
    if zero:
        requests: dict = {
            f"{k}/{n}": span for k in STATES for n, span in _flat_ranges(world_size, rank).items()
        }
    else:
        requests = {f"{k}/{n}": None for k in STATES for n in SHAPES}
    requests["optim/step"] = None
    got = load(os.path.join(root, f"step-{step:08d}"), requests)
    for name, span in requests.items():
        want = expected[name] if span is None else expected[name].reshape(-1)[span[0] : span[1]]
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), (rank, name, span)


def _load_ddp(rank: int, world_size: int, root: str) -> bool:
    for step in (1, 2):
        _check_layout(root, world_size, rank, step, zero=False)
    return True


def _load_zero2_then_fall_back(rank: int, world_size: int, root: str) -> list[str]:
    comm = Comm()
    for step in (1, 2):
        _check_layout(root, world_size, rank, step, zero=True)
    comm.barrier()
    if rank == 0:  # damage param/head.w in the last quarter, which only rank 2 of 3 reads
        target = Path(root, "step-00000002", "rank3.safetensors")
        raw = bytearray(target.read_bytes())
        raw[8 + int.from_bytes(raw[:8], "little") + 5] ^= 0x10
        target.write_bytes(bytes(raw))
    comm.barrier()
    messages: list[str] = []

    def requests(manifest: object) -> dict:
        return {f"param/{n}": span for n, span in _flat_ranges(world_size, rank).items()}

    loaded = load_latest(root, requests, comm, on_bad=messages.append)
    assert loaded is not None and loaded.manifest.step == 1, "every rank falls back to step 1"
    assert loaded.manifest.meta == {"sampler": {"pos": 1}}
    expected = _full_state(1)
    for name, t in loaded.tensors.items():
        a, b = _flat_ranges(world_size, rank)[name.removeprefix("param/")]
        assert torch.equal(t, expected[name].reshape(-1)[a:b]), name
    return messages


@pytest.mark.slow
def test_zero3_on_4_reloads_as_ddp2_zero2_3_and_one_process(tmp_path: Path) -> None:
    root = str(tmp_path)
    reports = run_on_ranks(_save_zero3, 4, root, timeout_s=60)
    assert all(r == [{"async": False, "done": True}, {"async": True, "done": True}] for r in reports)
    assert sorted(os.listdir(root)) == ["latest", "step-00000001", "step-00000002"]
    _load_ddp(0, 1, root)  # one process, whole tensors
    _check_layout(root, 1, 0, 2, zero=True)  # one process, ZeRO layout of world size 1
    assert run_on_ranks(_load_ddp, 2, root, timeout_s=60) == [True, True]
    messages = run_on_ranks(_load_zero2_then_fall_back, 3, root, timeout_s=60)
    assert messages[0] == messages[1] == []  # ranks 0 and 1 of 3 never read the damaged piece
    assert len(messages[2]) == 1 and "step-00000002/rank3.safetensors: crc32 mismatch" in messages[2][0]
