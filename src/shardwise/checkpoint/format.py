"""The checkpoint manifest: what a checkpoint folder holds, as plain JSON (never unpickled).

A checkpoint is one folder ``step-<k>`` holding ``manifest.json`` and one safetensors file per writing
rank. Every tensor is described by its global shape and dtype and by the pieces that hold it. A piece
is either a FLAT range ``[start, stop)`` over the row-major flattening of the global tensor (a ZeRO
flat shard, a dim-0 tensor-parallel slice) or, since format 3, an n-d BOX (an offset and a length per
dim, see :mod:`shardwise.checkpoint.boxes`: a slice along any dim). Either way a piece is stored 1-D
(a box in its own row-major order) under one key of one file, with a CRC32 per ``chunk_bytes`` chunk
so that a partial read can be verified without reading the whole piece (the checksum catches
truncation and flipped bytes; it is not a security feature). Format 2 manifests (flat pieces only)
are still read. Parsing is strict: a wrong key, type or number, pieces that overlap or leave a gap,
and any file name that is not a plain name inside the checkpoint folder are one-line
``ManifestError``s (the readers of each field's type in ``strict_json``, the pieces' cover in
``cover``, the file names in ``members``). No communication happens here.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.checkpoint.boxes import Box, Segment, flat_offset, flat_segments
from shardwise.checkpoint.cover import check_box_cover, check_box_piece, check_flat_cover
from shardwise.checkpoint.errors import CheckpointError, ManifestError
from shardwise.checkpoint.members import MANIFEST_NAME, check_member_name
from shardwise.checkpoint.strict_json import as_int, as_list, as_obj, as_str, require, show

FORMAT_VERSION = 3  # 3: box pieces; 2: flat pieces only
READABLE_VERSIONS = (2, 3)
CHECKSUM = "crc32"  # the per-chunk checksum algorithm, recorded in every manifest
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
    """One stored piece of a tensor: a flat range ``[start, stop)`` or (format 3) an n-d ``box``.

    Exactly one of the two is set: a flat piece has ``start``/``stop`` and ``box`` None; a box piece
    has ``box`` and ``start``/``stop`` None (so code that assumes flat ranges fails loudly on a box).
    Either way the piece's elements are stored 1-D under ``key`` in ``file``, with one CHECKSUM per
    ``chunk_bytes`` of them.
    """

    file: str
    key: str
    start: int | None
    stop: int | None
    checksums: tuple[str, ...]
    box: Box | None = None

    def __post_init__(self) -> None:
        flat = self.start is not None and self.stop is not None
        if flat == (self.box is not None) or (self.start is None) != (self.stop is None):
            raise ManifestError(f"piece {self.key!r}: give either start and stop or a box, not both")

    @staticmethod
    def of_box(file: str, key: str, box: Box, checksums: tuple[str, ...]) -> PieceRecord:
        return PieceRecord(file, key, None, None, checksums, box)

    @property
    def span(self) -> tuple[int, int]:
        """``(start, stop)`` of a flat piece."""
        if self.start is None or self.stop is None:
            raise CheckpointError(f"piece {self.key!r} is a box {self.box}, not a flat range")
        return self.start, self.stop

    @property
    def numel(self) -> int:
        """How many elements the piece stores."""
        if self.box is not None:
            return self.box.volume
        start, stop = self.span
        return stop - start

    def segments(self, global_shape: tuple[int, ...]) -> list[Segment]:
        """The piece as boxes of the global tensor, each with its offset inside the piece's storage."""
        if self.box is not None:
            return [(self.box, 0)]
        return flat_segments(global_shape, *self.span)

    def first_element(self, global_shape: tuple[int, ...]) -> int:
        """The flat index of the piece's first element (the order pieces are listed in)."""
        if self.box is not None:
            return flat_offset(Box.full(global_shape), self.box.offsets)
        return self.span[0]

    def describe(self) -> str:
        return f"box {self.box}" if self.box is not None else f"[{self.start}, {self.stop})"

    def to_json(self) -> dict[str, Any]:
        where: dict[str, Any] = (
            {"offsets": list(self.box.offsets), "lengths": list(self.box.lengths)}
            if self.box is not None
            else {"start": self.start, "stop": self.stop}
        )
        return {"file": self.file, "key": self.key, **where, "checksums": list(self.checksums)}

    @staticmethod
    def from_json(data: Any, where: str, *, boxes: bool = True) -> PieceRecord:
        """Parse one piece; ``boxes`` False (format 2) refuses box pieces."""
        require(data, ("file", "key", "checksums"), where)
        file = check_member_name(data["file"], where)
        key = as_str(data["key"], f"{where} key")
        checksums = tuple(
            as_str(d, f"{where} checksum") for d in as_list(data["checksums"], f"{where} checksums")
        )
        if "offsets" in data or "lengths" in data:
            if not boxes:
                raise ManifestError(f"{where}: a box piece (offsets/lengths) needs format_version 3")
            if "start" in data or "stop" in data:
                raise ManifestError(
                    f"{where}: has both a flat range (start/stop) and a box (offsets/lengths)"
                )
            require(data, ("offsets", "lengths"), where)
            offsets = [as_int(o, f"{where} offsets") for o in as_list(data["offsets"], f"{where} offsets")]
            lengths = [as_int(n, f"{where} lengths") for n in as_list(data["lengths"], f"{where} lengths")]
            if len(offsets) != len(lengths):
                raise ManifestError(f"{where}: {len(offsets)} offsets but {len(lengths)} lengths")
            return PieceRecord.of_box(file, key, Box(tuple(offsets), tuple(lengths)), checksums)
        require(data, ("start", "stop"), where)
        start, stop = as_int(data["start"], f"{where} start"), as_int(data["stop"], f"{where} stop")
        return PieceRecord(file, key, start, stop, checksums)


@dataclass(frozen=True)
class TensorRecord:
    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[PieceRecord, ...]

    @property
    def numel(self) -> int:
        return numel_of(self.global_shape)

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "pieces": [p.to_json() for p in self.pieces],
        }

    @staticmethod
    def from_json(data: Any, where: str, *, boxes: bool = True) -> TensorRecord:
        require(data, ("global_shape", "dtype", "pieces"), where)
        shape = tuple(
            as_int(d, f"{where} global_shape") for d in as_list(data["global_shape"], f"{where} global_shape")
        )
        pieces = tuple(
            PieceRecord.from_json(p, f"{where} piece {i}", boxes=boxes)
            for i, p in enumerate(as_list(data["pieces"], f"{where} pieces"))
        )
        return TensorRecord(shape, as_str(data["dtype"], f"{where} dtype"), pieces)


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
    def from_json(data: Any) -> Manifest:
        """Parse and validate; every wrong key, type or number is a one-line ``ManifestError``."""
        require(data, ("format_version", "step", "tensors", "files"), "manifest")
        version = data["format_version"]
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ManifestError(
                f"manifest has format_version {show(version)}, this shardwise reads "
                f"{' and '.join(map(str, READABLE_VERSIONS))}"
            )
        require(data, ("checksum",), "manifest")
        if data["checksum"] != CHECKSUM:
            raise ManifestError(
                f"manifest uses checksum algorithm {show(data['checksum'])}, "
                f"this shardwise reads {CHECKSUM!r}"
            )
        boxes = version >= 3
        tensors = {
            n: TensorRecord.from_json(t, f"tensor {n!r}", boxes=boxes)
            for n, t in as_obj(data["tensors"], "manifest tensors").items()
        }
        files = {
            check_member_name(k, "manifest files"): as_int(v, f"manifest files {k!r} size")
            for k, v in as_obj(data["files"], "manifest files").items()
        }
        rank_meta = [
            as_obj(r, "manifest rank_meta") for r in as_list(data.get("rank_meta", []), "manifest rank_meta")
        ]
        manifest = Manifest(
            step=as_int(data["step"], "manifest step"),
            strategy=as_str(data.get("strategy", ""), "manifest strategy"),
            world_size=as_int(data.get("world_size", 1), "manifest world_size"),
            mesh=dict(as_obj(data.get("mesh", {}), "manifest mesh")),
            config=dict(as_obj(data.get("config", {}), "manifest config")),
            meta=dict(as_obj(data.get("meta", {}), "manifest meta")),
            rank_meta=[dict(r) for r in rank_meta],
            tensors=tensors,
            files=files,
            chunk_bytes=as_int(data.get("chunk_bytes", DEFAULT_CHUNK_BYTES), "manifest chunk_bytes"),
            format_version=version,
        )
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """Plain file names with sizes; every tensor covered exactly once by pieces that fit their files.

        Also bounds every piece by its file's recorded size, so a reader that has checked the files'
        sizes never allocates more than the files hold, whatever numbers a damaged manifest carries.
        """
        if self.chunk_bytes <= 0 or self.chunk_bytes % 8:
            raise ManifestError(f"chunk_bytes must be a positive multiple of 8, got {self.chunk_bytes}")
        if self.world_size < 1:
            raise ManifestError(f"world_size must be at least 1, got {self.world_size}")
        sampler = self.meta.get("sampler")
        if isinstance(sampler, dict) and "step" in sampler and sampler["step"] != self.step:
            # the position a resume continues from: trusted, it would pair step k's weights with
            # another step's data, learning rate and metrics
            raise ManifestError(
                f"meta.sampler.step {show(sampler['step'])} disagrees with the manifest's step {self.step}"
            )
        for name, size in self.files.items():
            check_member_name(name, "manifest files")
            if size < 0:
                raise ManifestError(f"manifest files: {name} has a negative size {size}")
        used = dict.fromkeys(self.files, 0)
        keys: set[tuple[str, str]] = set()
        for name, rec in self.tensors.items():
            self._validate_tensor(name, rec, used, keys)
        for file, nbytes in used.items():
            if nbytes > self.files[file]:
                raise ManifestError(
                    f"file {file}: its pieces hold {nbytes} bytes but the file is {self.files[file]} bytes"
                )

    def _validate_tensor(
        self, name: str, rec: TensorRecord, used: dict[str, int], keys: set[tuple[str, str]]
    ) -> None:
        if any(d < 0 for d in rec.global_shape):
            raise ManifestError(f"tensor {name!r}: negative size in global_shape {list(rec.global_shape)}")
        itemsize = rec.itemsize  # refuses an unknown dtype
        chunk_elems = self.chunk_bytes // itemsize
        for p in rec.pieces:
            where = f"tensor {name!r} piece {p.describe()} in {p.file}"
            check_member_name(p.file, where)
            if p.file not in self.files:
                raise ManifestError(f"{where}: file is not listed in the manifest's files")
            if (p.file, p.key) in keys:
                raise ManifestError(f"{where}: key {p.key!r} is used by another piece of that file")
            keys.add((p.file, p.key))
            if p.box is not None:
                check_box_piece(p.box, rec, self.format_version, where)
            else:
                start, stop = p.span
                if start < 0 or stop > rec.numel or (stop <= start and rec.numel > 0):
                    raise ManifestError(f"{where}: out of bounds for {rec.numel} elements")
            expected = max(1, chunk_span(0, p.numel, chunk_elems)[1])
            if len(p.checksums) != expected:
                raise ManifestError(f"{where}: {len(p.checksums)} checksums, expected {expected}")
            used[p.file] += p.numel * itemsize
        if all(p.box is None for p in rec.pieces):
            check_flat_cover(name, rec)
        else:
            check_box_cover(name, rec)


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
    """The folder's manifest, parsed and validated; any damage is one ``ManifestError`` line naming it."""
    path = os.path.join(folder, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, or an integer too long to parse
        raise ManifestError(f"{path}: not valid JSON ({_one_line(err)})") from None
    except RecursionError:
        raise ManifestError(f"{path}: not valid JSON (nested too deeply)") from None
    except OSError as err:
        raise ManifestError(f"{path}: cannot be read ({_one_line(err)})") from None
    try:
        return Manifest.from_json(data)
    except ManifestError as err:
        raise ManifestError(f"{path}: {err}") from None
    except (TypeError, ValueError) as err:  # a safety net: parsing checks every type it relies on
        raise ManifestError(f"{path}: malformed ({_one_line(err)})") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())
