"""Write one rank's pieces as a safetensors file, hashing each chunk as it goes out, fsynced once.

The bytes are the standard safetensors layout (8-byte little-endian header length, JSON header padded
to 8 bytes, then the tensors back to back), so ``safetensors.safe_open`` and any other reader can open
the file. We write it ourselves rather than through ``save_file`` to avoid building the whole file in
memory: each tensor's bytes go from its storage to the file through a memoryview, and the CRC32 of
every ``chunk_bytes`` chunk is taken from the same view on a helper thread, overlapping the write.
Purely local; no communication.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shardwise.checkpoint.format import DTYPES, checksum, dtype_name


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size_bytes: int
    digests: dict[str, tuple[str, ...]]  # key -> one checksum per chunk


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy buffer


def chunk_digests(data: memoryview, chunk_bytes: int) -> tuple[str, ...]:
    """The checksum of every ``chunk_bytes`` slice of ``data`` (at least one, even when empty)."""
    if len(data) == 0:
        return (checksum(b""),)
    return tuple(checksum(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes))


def write_shard_file(path: str, items: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int) -> WrittenFile:
    """Write ``(key, tensor)`` pairs (stored 1-D) to ``path``; return its size and per-chunk digests."""
    # Widest dtypes first, so every tensor starts aligned to its element size with no gaps between
    # tensors (safetensors requires contiguous offsets).
    ordered = sorted(items, key=lambda kv: -kv[1].element_size())
    header: dict[str, object] = {"__metadata__": {"format": "pt", "writer": "shardwise"}}
    offset = 0
    for key, tensor in ordered:
        nbytes = tensor.numel() * tensor.element_size()
        code = DTYPES[dtype_name(tensor.dtype)]
        header[key] = {"dtype": code, "shape": [tensor.numel()], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    views = [(key, _as_bytes(tensor)) for key, tensor in ordered]
    # Hashing and writing both release the GIL: hash on a helper thread while this one writes.
    with ThreadPoolExecutor(max_workers=1) as pool, open(path, "wb") as f:
        pending = {key: pool.submit(chunk_digests, data, chunk_bytes) for key, data in views}
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, data in views:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
        digests = {key: job.result() for key, job in pending.items()}
    return WrittenFile(path, 8 + len(head) + offset, digests)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
