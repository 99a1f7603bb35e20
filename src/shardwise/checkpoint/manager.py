"""Save a checkpoint from every rank at once: each rank writes what it owns, rank 0 publishes.

Every rank calls :meth:`CheckpointWriter.save` with the pieces it owns (flat ranges of global tensors,
or n-d boxes of them such as a tensor-parallel slice along any dim; replicated tensors go to one owner
each, see :func:`spread_replicated`). Communication: one tiny
broadcast from rank 0 (a token naming the temporary folder, so a stale half-written folder can never be
mistaken for this save), then each rank writes ``rank<r>.safetensors`` and ``rank<r>.json`` with no
communication at all. Synchronous mode: a barrier, rank 0 merges the indexes into ``manifest.json`` and
publishes (rename, then ``latest``), a second barrier, then rank 0 prunes to the last ``keep``. Async mode:
tensors are snapshotted (cloned) on the caller's thread, a background thread writes them, and rank
0's thread waits for every rank's index file to appear in the folder before publishing, so the
background never issues a collective that could interleave with training's.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.checkpoint.boxes import Box
from shardwise.checkpoint.format import (
    DEFAULT_CHUNK_BYTES,
    CheckpointError,
    Manifest,
    PieceRecord,
    TensorRecord,
    dtype_name,
    numel_of,
    write_json_atomic,
    write_manifest,
)
from shardwise.checkpoint.layout import prune, publish, step_dir_name, tmp_dir_name
from shardwise.checkpoint.shardfile import write_shard_file
from shardwise.collectives.api import Comm
from shardwise.device import HOST


@dataclass(frozen=True)
class Piece:
    """What one rank writes of global tensor ``name``: a flat range or an n-d box.

    Flat (``box`` None): elements ``[start, stop)`` of the row-major flattening; ``tensor`` holds
    ``stop - start`` elements in any shape. Box (build it with :meth:`from_box`): ``start``/``stop``
    are None and ``tensor`` holds the box's elements, normally in the box's shape (any shape with its
    volume is read in row-major order). Both are stored 1-D.
    """

    name: str
    global_shape: tuple[int, ...]
    start: int | None
    stop: int | None
    tensor: torch.Tensor
    box: Box | None = None

    @staticmethod
    def full(name: str, tensor: torch.Tensor) -> Piece:
        return Piece(name, tuple(tensor.shape), 0, tensor.numel(), tensor)

    @staticmethod
    def from_box(
        name: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], tensor: torch.Tensor
    ) -> Piece:
        """The block of ``name`` starting at ``offsets`` with ``tensor``'s shape, e.g. ``w[:, 4:8]``."""
        return Piece(name, tuple(global_shape), None, None, tensor, Box(tuple(offsets), tuple(tensor.shape)))

    def check(self) -> None:
        if self.box is not None:
            self._check_box(self.box)
            return
        if self.start is None or self.stop is None:
            raise CheckpointError(
                f"piece of {self.name!r}: give start and stop, or build it with Piece.from_box"
            )
        total = numel_of(self.global_shape)
        empty_ok = self.start == self.stop == total == 0
        if not (0 <= self.start < self.stop <= total or empty_ok):
            raise CheckpointError(
                f"piece of {self.name!r}: range [{self.start}, {self.stop}) is outside its {total} elements"
            )
        if self.tensor.numel() != self.stop - self.start:
            raise CheckpointError(
                f"piece of {self.name!r}: range [{self.start}, {self.stop}) has {self.stop - self.start} "
                f"elements but the tensor has {self.tensor.numel()}"
            )

    def _check_box(self, box: Box) -> None:
        shape = list(self.global_shape)
        if self.start is not None or self.stop is not None:
            raise CheckpointError(
                f"piece of {self.name!r}: box {box} also has a flat range; give one of them"
            )
        if not box.inside(self.global_shape):
            raise CheckpointError(f"piece of {self.name!r}: box {box} is outside its global shape {shape}")
        if box.volume == 0 and numel_of(self.global_shape) > 0:
            raise CheckpointError(f"piece of {self.name!r}: box {box} is empty; leave it out of the save")
        if self.tensor.numel() != box.volume:
            raise CheckpointError(
                f"piece of {self.name!r}: box {box} has {box.volume} elements but the tensor has "
                f"{self.tensor.numel()}"
            )

    @property
    def key(self) -> str:
        """The safetensors key it is stored under (unique per tensor and rank when pieces do not overlap)."""
        if self.box is not None:
            return f"{self.name} box{self.box}"  # "w box[0:5, 4:8]": never a flat key's "w[0:5]"
        return f"{self.name}[{self.start}:{self.stop}]"

    def index_entry(self) -> dict[str, Any]:
        """Where the piece sits in its tensor, as the rank index and the manifest record it."""
        if self.box is not None:
            return {"offsets": list(self.box.offsets), "lengths": list(self.box.lengths)}
        return {"start": self.start, "stop": self.stop}


def spread_replicated(tensors: Mapping[str, torch.Tensor], world_size: int) -> dict[str, int]:
    """Owner rank per name, balancing bytes: largest first, each to the least-loaded rank."""
    load = [0] * world_size
    owners: dict[str, int] = {}
    by_size = sorted(tensors.items(), key=lambda kv: (-kv[1].numel() * kv[1].element_size(), kv[0]))
    for name, tensor in by_size:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += tensor.numel() * tensor.element_size()
    return owners


@dataclass
class SaveReport:
    step: int
    path: str  # the published folder (on every rank once complete)
    bytes: int = 0  # written by this rank
    blocked_s: float = 0.0  # time the caller was held up
    write_s: float = 0.0  # time spent writing this rank's files
    done: bool = False

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes / self.write_s / 1e6 if self.write_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": self.path,
            "bytes": self.bytes,
            "blocked_s": self.blocked_s,
            "write_s": self.write_s,
            "throughput_mb_s": self.throughput_mb_s,
        }


@dataclass
class _Job:
    report: SaveReport
    tmp_dir: str
    items: list[Piece]
    header: dict[str, Any]
    rank_meta: dict[str, Any]
    thread: threading.Thread | None = None
    error: BaseException | None = field(default=None)


class AsyncSaveError(CheckpointError):
    """An asynchronous save that failed in the background, raised by the next ``wait`` (or ``save``):
    ``step`` is the step of the save that failed, not the one being saved when it surfaced."""

    def __init__(self, step: int, error: BaseException) -> None:
        super().__init__(f"asynchronous save of step {step} failed: {error}")
        self.step = step


class CheckpointWriter:
    """Saves checkpoints under ``root``; one instance per rank, kept for the whole run."""

    def __init__(
        self,
        root: str,
        comm: Comm | None = None,
        *,
        keep: int = 3,
        async_save: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = 600.0,
    ) -> None:
        self.root, self.comm, self.keep, self.async_save = root, comm, keep, async_save
        self.chunk_bytes, self.timeout_s = chunk_bytes, timeout_s
        self.rank = comm.rank if comm else 0
        self.world_size = comm.world_size if comm else 1
        self._job: _Job | None = None

    def save(
        self,
        step: int,
        pieces: Iterable[Piece],
        *,
        meta: Mapping[str, Any] | None = None,
        rank_meta: Mapping[str, Any] | None = None,
        strategy: str = "",
        mesh: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> SaveReport:
        """Save this rank's ``pieces``; ``meta``/``config``/``mesh`` are taken from rank 0 only.

        Returns at once in asynchronous mode (``report.done`` is False until :meth:`wait`).
        """
        start = time.perf_counter()
        self.wait()
        tmp_dir = os.path.join(self.root, tmp_dir_name(step, self._agree_token()))
        os.makedirs(tmp_dir, exist_ok=True)
        items = _snapshot(pieces, clone=self.async_save)
        header = {
            "step": step,
            "strategy": strategy,
            "world_size": self.world_size,
            "mesh": dict(mesh or {}),
            "config": dict(config or {}),
            "meta": dict(meta or {}),
        }
        report = SaveReport(step=step, path=tmp_dir)
        job = _Job(report, tmp_dir, items, header, dict(rank_meta or {}))
        if self.async_save:
            job.thread = threading.Thread(target=self._run_background, args=(job,), daemon=True)
            self._job = job
            job.thread.start()
        else:
            self._write_own(job)
            if self.comm:
                self.comm.barrier()
            if self.rank == 0:
                report.path = self._publish(job)
            if self.comm:
                self.comm.barrier()
            if self.rank == 0:
                prune(self.root, self.keep)  # nobody waits on this
            report.path = _final_path(self.root, step)
            report.done = True
        report.blocked_s = time.perf_counter() - start
        return report

    def wait(self) -> SaveReport | None:
        """Block until the pending asynchronous save is written (and, on rank 0, published)."""
        job, self._job = self._job, None
        if job is None:
            return None
        start = time.perf_counter()
        assert job.thread is not None
        job.thread.join()
        job.report.blocked_s += time.perf_counter() - start
        if job.error is not None:
            raise AsyncSaveError(job.report.step, job.error) from job.error
        return job.report

    # -- internals --------------------------------------------------------------------------------
    def _agree_token(self) -> str:
        token = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=HOST)  # host: gloo
        if self.comm and self.world_size > 1:
            self.comm.broadcast(token, src=0)
        return f"{int(token.item()):016x}"

    def _run_background(self, job: _Job) -> None:
        try:
            self._write_own(job)
            if self.rank == 0:
                self._wait_for_indexes(job)
                job.report.path = self._publish(job)
                prune(self.root, self.keep)
            else:
                job.report.path = _final_path(self.root, job.report.step)
            job.report.done = True
        except BaseException as err:  # re-raised on the caller's thread by wait()
            job.error = err

    def _write_own(self, job: _Job) -> None:
        start = time.perf_counter()
        file_name = f"rank{self.rank}.safetensors"
        keyed = [(p.key, p) for p in job.items]
        size, digests = 0, {}
        if keyed:
            written = write_shard_file(
                os.path.join(job.tmp_dir, file_name), [(k, p.tensor) for k, p in keyed], self.chunk_bytes
            )
            size, digests = written.size_bytes, written.digests
        index = {
            "rank": self.rank,
            "file": file_name if keyed else None,
            "size_bytes": size,
            "rank_meta": job.rank_meta,
            "pieces": [
                {
                    "name": p.name,
                    "global_shape": list(p.global_shape),
                    "dtype": dtype_name(p.tensor.dtype),
                    "key": k,
                    **p.index_entry(),
                    "checksums": list(digests[k]),
                }
                for k, p in keyed
            ],
        }
        # Not fsynced: only the manifest (built from it) must survive a crash; the rename still makes the
        # index appear whole, which is what rank 0's asynchronous publisher waits for.
        write_json_atomic(os.path.join(job.tmp_dir, f"rank{self.rank}.json"), index, fsync=False)
        job.report.bytes = size
        job.report.write_s = time.perf_counter() - start

    def _wait_for_indexes(self, job: _Job) -> None:
        deadline = time.monotonic() + self.timeout_s
        paths = [os.path.join(job.tmp_dir, f"rank{r}.json") for r in range(self.world_size)]
        while not all(os.path.exists(p) for p in paths):
            if time.monotonic() > deadline:
                missing = [p for p in paths if not os.path.exists(p)]
                raise CheckpointError(
                    f"step {job.report.step}: no index from {missing} after {self.timeout_s} s"
                )
            time.sleep(0.01)

    def _publish(self, job: _Job) -> str:
        manifest = merge_indexes(job.tmp_dir, self.world_size, job.header, self.chunk_bytes)
        write_manifest(job.tmp_dir, manifest)
        return publish(self.root, job.tmp_dir, manifest.step)


def save(
    root: str,
    step: int,
    pieces: Iterable[Piece],
    comm: Comm | None = None,
    *,
    keep: int = 3,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    **kwargs: Any,
) -> SaveReport:
    """One synchronous save (every rank calls it); see :meth:`CheckpointWriter.save` for ``kwargs``."""
    return CheckpointWriter(root, comm, keep=keep, chunk_bytes=chunk_bytes).save(step, pieces, **kwargs)


def merge_indexes(tmp_dir: str, world_size: int, header: Mapping[str, Any], chunk_bytes: int) -> Manifest:
    """Build the manifest from every rank's ``rank<r>.json`` (rank 0 only)."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    pieces: dict[str, list[PieceRecord]] = {}
    files: dict[str, int] = {}
    rank_meta: list[dict[str, Any]] = []
    for rank in range(world_size):
        with open(os.path.join(tmp_dir, f"rank{rank}.json"), encoding="utf-8") as f:
            index = json.load(f)
        rank_meta.append(index["rank_meta"])
        if index["file"] is not None:
            files[index["file"]] = int(index["size_bytes"])
        for p in index["pieces"]:
            kind = (tuple(p["global_shape"]), p["dtype"])
            if shapes.setdefault(p["name"], kind) != kind:
                raise CheckpointError(
                    f"tensor {p['name']!r}: rank {rank} says shape/dtype {kind}, another rank "
                    f"{shapes[p['name']]}"
                )
            pieces.setdefault(p["name"], []).append(_record(index["file"], p))
    tensors = {
        name: TensorRecord(shape, dtype, tuple(sorted(pieces[name], key=lambda r: r.first_element(shape))))
        for name, (shape, dtype) in shapes.items()
    }
    return Manifest(tensors=tensors, files=files, rank_meta=rank_meta, chunk_bytes=chunk_bytes, **header)


def _record(file: str, entry: Mapping[str, Any]) -> PieceRecord:
    """A rank index's piece entry (flat or box) as the manifest's record."""
    checksums = tuple(entry["checksums"])
    if "offsets" in entry:
        return PieceRecord.of_box(file, entry["key"], Box(entry["offsets"], entry["lengths"]), checksums)
    return PieceRecord(file, entry["key"], entry["start"], entry["stop"], checksums)


def _snapshot(pieces: Iterable[Piece], clone: bool) -> list[Piece]:
    out = []
    for piece in pieces:
        piece.check()
        tensor = piece.tensor.detach().reshape(-1)
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        elif clone:
            tensor = tensor.clone()
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
        out.append(Piece(piece.name, tuple(piece.global_shape), piece.start, piece.stop, tensor, piece.box))
    return out


def _final_path(root: str, step: int) -> str:
    return os.path.join(root, step_dir_name(step))


def pieces_from_state(state: Mapping[str, torch.Tensor], prefix: str = "") -> list[Piece]:
    """Whole tensors as pieces (a replicated state, or one process)."""
    return [Piece.full(prefix + name, t) for name, t in state.items()]
