"""The checkpoint manifest: what a checkpoint folder holds, as plain JSON (never unpickled).

A checkpoint is one folder ``step-<k>`` holding ``manifest.json`` and one safetensors file per writing
rank. Every tensor is described by its global shape and dtype and by the pieces that hold it: a piece
is a FLAT range ``[start, stop)`` over the row-major flattening of the global tensor, stored 1-D under
one key of one file, with a CRC32 per ``chunk_bytes`` chunk so that a partial read can be verified
without reading the whole piece (the checksum catches truncation and flipped bytes; it is not a
security feature). A ZeRO flat shard is one piece per parameter it touches; a dim-0
tensor-parallel slice is one contiguous range too. No communication happens here.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

FORMAT_VERSION = 2
CHECKSUM = "crc32"  # the per-chunk checksum algorithm, recorded in every manifest
MANIFEST_NAME = "manifest.json"
DEFAULT_CHUNK_BYTES = 16 << 20

# torch dtype name <-> safetensors dtype code
DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason in one line."""


class ManifestError(CheckpointError):
    """A manifest that does not parse or does not add up."""


class CorruptCheckpointError(CheckpointError):
    """A data file that is missing, truncated or fails its checksum."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason


def checksum(data: memoryview | bytes) -> str:
    """The CHECKSUM of ``data`` as 8 hex digits (zlib.crc32 releases the GIL on large buffers)."""
    return f"{zlib.crc32(data):08x}"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name} is not supported in checkpoints (supported: {sorted(DTYPES)})")
    return name


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ManifestError(f"unknown dtype {name!r} (supported: {sorted(DTYPES)})")
    return getattr(torch, name)


def numel_of(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def chunk_span(start: int, stop: int, chunk_elems: int) -> tuple[int, int]:
    """Chunk indices ``[first, last)`` that cover element offsets ``[start, stop)`` inside a piece."""
    return start // chunk_elems, -(-stop // chunk_elems)


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The intersection of two half-open ranges, or None when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class PieceRecord:
    file: str
    key: str
    start: int
    stop: int
    checksums: tuple[str, ...]  # one CHECKSUM per chunk_bytes of the piece's bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "key": self.key,
            "start": self.start,
            "stop": self.stop,
            "checksums": list(self.checksums),
        }

    @staticmethod
    def from_json(data: Mapping[str, Any], where: str) -> PieceRecord:
        _require(data, ("file", "key", "start", "stop", "checksums"), where)
        return PieceRecord(
            str(data["file"]),
            str(data["key"]),
            int(data["start"]),
            int(data["stop"]),
            tuple(str(d) for d in data["checksums"]),
        )


@dataclass(frozen=True)
class TensorRecord:
    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[PieceRecord, ...]

    @property
    def numel(self) -> int:
        return numel_of(self.global_shape)

    def to_json(self) -> dict[str, Any]:
        return {
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "pieces": [p.to_json() for p in self.pieces],
        }

    @staticmethod
    def from_json(data: Mapping[str, Any], where: str) -> TensorRecord:
        _require(data, ("global_shape", "dtype", "pieces"), where)
        pieces = tuple(PieceRecord.from_json(p, f"{where} piece {i}") for i, p in enumerate(data["pieces"]))
        return TensorRecord(tuple(int(d) for d in data["global_shape"]), str(data["dtype"]), pieces)


@dataclass(frozen=True)
class Manifest:
    step: int
    strategy: str = ""
    world_size: int = 1
    mesh: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # sampler position, anything JSON
    rank_meta: list[dict[str, Any]] = field(default_factory=list)  # per rank: python/numpy RNG ...
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # file name -> size in bytes
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    format_version: int = FORMAT_VERSION
    checksum: str = CHECKSUM

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "checksum": self.checksum,
            "step": self.step,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "mesh": self.mesh,
            "config": self.config,
            "meta": self.meta,
            "rank_meta": self.rank_meta,
            "chunk_bytes": self.chunk_bytes,
            "files": self.files,
            "tensors": {name: rec.to_json() for name, rec in sorted(self.tensors.items())},
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Manifest:
        _require(data, ("format_version", "step", "tensors", "files"), "manifest")
        if data["format_version"] != FORMAT_VERSION:
            raise ManifestError(
                f"manifest has format_version {data['format_version']}, this shardwise reads {FORMAT_VERSION}"
            )
        _require(data, ("checksum",), "manifest")
        if data["checksum"] != CHECKSUM:
            raise ManifestError(
                f"manifest uses checksum algorithm {data['checksum']!r}, this shardwise reads {CHECKSUM!r}"
            )
        tensors = {n: TensorRecord.from_json(t, f"tensor {n!r}") for n, t in data["tensors"].items()}
        manifest = Manifest(
            step=int(data["step"]),
            strategy=str(data.get("strategy", "")),
            world_size=int(data.get("world_size", 1)),
            mesh=dict(data.get("mesh", {})),
            config=dict(data.get("config", {})),
            meta=dict(data.get("meta", {})),
            rank_meta=list(data.get("rank_meta", [])),
            tensors=tensors,
            files={str(k): int(v) for k, v in data["files"].items()},
            chunk_bytes=int(data.get("chunk_bytes", DEFAULT_CHUNK_BYTES)),
        )
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """Every tensor covered exactly once by its pieces, in known files, with the right digest count."""
        if self.chunk_bytes <= 0 or self.chunk_bytes % 8:
            raise ManifestError(f"chunk_bytes must be a positive multiple of 8, got {self.chunk_bytes}")
        for name, rec in self.tensors.items():
            itemsize = torch.empty((), dtype=torch_dtype(rec.dtype)).element_size()
            chunk_elems = self.chunk_bytes // itemsize
            cursor = 0
            for p in sorted(rec.pieces, key=lambda p: p.start):
                where = f"tensor {name!r} piece [{p.start}, {p.stop}) in {p.file}"
                if p.file not in self.files:
                    raise ManifestError(f"{where}: file is not listed in the manifest's files")
                if p.start != cursor:
                    what = (
                        "overlaps the previous piece"
                        if p.start < cursor
                        else f"leaves [{cursor}, {p.start}) uncovered"
                    )
                    raise ManifestError(f"{where}: {what}")
                if p.stop > rec.numel or (p.stop <= p.start and rec.numel > 0):
                    raise ManifestError(f"{where}: out of bounds for {rec.numel} elements")
                expected = max(1, chunk_span(0, p.stop - p.start, chunk_elems)[1])
                if len(p.checksums) != expected:
                    raise ManifestError(f"{where}: {len(p.checksums)} checksums, expected {expected}")
                cursor = p.stop
            if cursor != rec.numel:
                raise ManifestError(f"tensor {name!r}: elements [{cursor}, {rec.numel}) are in no piece")


def _require(data: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    if not isinstance(data, Mapping):
        raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ManifestError(f"{where}: missing {', '.join(missing)}")


def write_json_atomic(path: str, data: Any, *, fsync: bool = True) -> None:
    """Write JSON to ``path`` through a temporary name (fsynced unless told not to), then rename it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(folder: str, manifest: Manifest) -> None:
    manifest.validate()
    write_json_atomic(os.path.join(folder, MANIFEST_NAME), manifest.to_json())


def read_manifest(folder: str) -> Manifest:
    path = os.path.join(folder, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path}: not valid JSON ({err})") from None
    try:
        return Manifest.from_json(data)
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}") from None
    except (TypeError, ValueError) as err:
        raise ManifestError(f"{path}: malformed ({err})") from None
