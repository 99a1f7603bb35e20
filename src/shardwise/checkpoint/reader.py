"""Read any part of any tensor from a checkpoint, whatever world size, strategy or layout wrote it.

A request names a global tensor and what of it to return: the whole tensor (``None``, returned at the
global shape), a flat range ``(start, stop)`` of its row-major flattening (returned 1-D), or a
:class:`~shardwise.checkpoint.boxes.Box` (an offset and a length per dim, returned at the box's shape).
The reader finds the pieces (flat ranges or boxes) that hold it and reads only the bytes it needs
through ``safe_open(...).get_slice``, rounded out to whole checksum chunks; it checks each file's size
and each key's dtype and length against the manifest before opening it and every chunk's CRC32 before
trusting it. A flat request over flat pieces copies ranges with no index arithmetic at all (the path a
100M-parameter ZeRO or DDP checkpoint takes); where a box is involved, both sides are cut into boxes
(:func:`~shardwise.checkpoint.boxes.flat_segments`) and each intersection is copied between strided
views of the two storages, never through per-element index tensors. No communication, except in
:func:`load_latest`, where one all-reduce of a failure flag makes every rank fall back together.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from shardwise.checkpoint.boxes import Box, Segment, box_runs, flat_offset, flat_segments, intersect, strides
from shardwise.checkpoint.errors import CorruptCheckpointError
from shardwise.checkpoint.format import (
    CHECKSUM,
    DTYPES,
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    PieceRecord,
    checksum,
    chunk_span,
    overlap,
    read_manifest,
    torch_dtype,
)
from shardwise.checkpoint.layout import clean_tmp as _clean_tmp
from shardwise.checkpoint.layout import list_steps
from shardwise.checkpoint.members import member_path
from shardwise.collectives.api import Comm
from shardwise.device import HOST

Request = tuple[int, int] | Box | None  # a flat range [start, stop), a box, or None: the whole tensor
Requests = Mapping[str, Request] | Iterable[str]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped; the message names the file and the reason."""


@dataclass(frozen=True)
class Loaded:
    path: str
    manifest: Manifest
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Want:
    """One normalized request: a flat range (the whole tensor is ``(0, numel)``) or a box."""

    shape: tuple[int, ...]  # of the returned tensor
    span: tuple[int, int] | None  # flat requests
    box: Box | None  # box requests

    def segments(self, global_shape: tuple[int, ...]) -> list[Segment]:
        """The request as boxes of the global tensor, each with its offset in the (flat) result."""
        if self.box is not None:
            return [(self.box, 0)]
        assert self.span is not None
        return flat_segments(global_shape, *self.span)


@dataclass(frozen=True)
class _Copy:
    """Intersection ``part`` of a piece's segment (``src``) and a request's segment (``dst``)."""

    src: Segment
    dst: Segment
    part: Box


def check_files(step_dir: str, manifest: Manifest, names: Iterable[str] | None = None) -> None:
    """Every (or every named) data file exists, inside the folder, with the size the manifest records."""
    for name in manifest.files if names is None else names:
        path = member_path(step_dir, name)
        label = _label(step_dir, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(label, "missing") from None
        except OSError as err:
            raise CorruptCheckpointError(label, f"cannot be read ({err.strerror})") from None
        expected = manifest.files[name]
        if size != expected:
            what = "truncated" if size < expected else "longer than written"
            raise CorruptCheckpointError(label, f"{size} bytes, the manifest records {expected} ({what})")


def load(
    path: str, requests: Requests, *, verify: bool = True, manifest: Manifest | None = None
) -> dict[str, torch.Tensor]:
    """Tensors by name: the global shape for ``None``, 1-D for ``(start, stop)``, the box's shape for a Box.

    ``requests`` maps names to requests (or is an iterable of names: whole tensors). ``path`` is a
    ``step-<k>`` folder or a root (its newest valid checkpoint is read).
    """
    step_dir = resolve(path)
    manifest = manifest or read_manifest(step_dir)
    wanted = _normalize(manifest, requests)
    flat_plan, box_plan = _plan(manifest, wanted)
    check_files(step_dir, manifest, {**flat_plan, **box_plan})
    # Where a box is involved the result is filled in place; flat-only requests keep their parts
    # (one piece covering the request is returned as read, with no extra copy).
    boxed = {name for reads in box_plan.values() for name, _, _ in reads}
    outs = {name: _empty(manifest, name, wanted[name]) for name in boxed}
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in wanted}
    for file in {**flat_plan, **box_plan}:
        label = _label(step_dir, file)
        with _open(step_dir, file) as f:
            for name, piece, lo, hi in flat_plan.get(file, []):
                rec = manifest.tensors[name]
                start = piece.span[0]
                data = _read_range(
                    f, piece, lo - start, hi - start, rec.dtype, manifest.chunk_bytes, verify, label
                )
                if name in outs:
                    first = lo - _span(wanted[name])[0]
                    outs[name][first : first + data.numel()] = data
                else:
                    parts[name].append((lo, data))
            for name, piece, copies in box_plan.get(file, []):
                rec = manifest.tensors[name]
                _read_copies(f, piece, copies, rec.dtype, manifest.chunk_bytes, verify, label, outs[name])
    return {
        name: outs[name].reshape(want.shape) if name in outs else _assemble(manifest, name, want, parts[name])
        for name, want in wanted.items()
    }


FlatPlan = dict[str, list[tuple[str, PieceRecord, int, int]]]  # file -> (name, piece, lo, hi) global
BoxPlan = dict[str, list[tuple[str, PieceRecord, list[_Copy]]]]  # file -> (name, piece, copies)


def _plan(manifest: Manifest, wanted: Mapping[str, _Want]) -> tuple[FlatPlan, BoxPlan]:
    """What to read from which file: flat ranges of flat pieces, and box copies wherever a box is."""
    flat_plan: FlatPlan = {}
    box_plan: BoxPlan = {}
    for name, want in wanted.items():
        rec = manifest.tensors[name]
        want_segments: list[Segment] | None = None  # cut into boxes only if a box piece needs it
        for piece in rec.pieces:
            if want.span is not None and piece.box is None:
                hit = overlap(want.span, piece.span)
                if hit:
                    flat_plan.setdefault(piece.file, []).append((name, piece, *hit))
                continue
            if want_segments is None:
                want_segments = want.segments(rec.global_shape)
            copies = _copies(piece.segments(rec.global_shape), want_segments)
            if copies:
                box_plan.setdefault(piece.file, []).append((name, piece, copies))
    return flat_plan, box_plan


def _normalize(manifest: Manifest, requests: Requests) -> dict[str, _Want]:
    items = requests.items() if isinstance(requests, Mapping) else ((n, None) for n in requests)
    out = {}
    for name, request in items:
        if name not in manifest.tensors:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint (step {manifest.step})")
        rec = manifest.tensors[name]
        if request is None:
            out[name] = _Want(rec.global_shape, (0, rec.numel), None)
        elif isinstance(request, Box):
            if not request.inside(rec.global_shape):
                raise CheckpointError(
                    f"tensor {name!r}: box {request} is outside its global shape {list(rec.global_shape)}"
                )
            out[name] = _Want(request.lengths, None, request)
        else:
            start, stop = _flat_request(name, request)
            if not 0 <= start <= stop <= rec.numel:
                raise CheckpointError(
                    f"tensor {name!r}: range [{start}, {stop}) is outside its {rec.numel} elements"
                )
            out[name] = _Want((stop - start,), (start, stop), None)
    return out


def _flat_request(name: str, request: object) -> tuple[int, int]:
    if not (
        isinstance(request, tuple | list) and len(request) == 2 and all(isinstance(v, int) for v in request)
    ):
        raise CheckpointError(f"tensor {name!r}: a request is None, (start, stop) or a Box, got {request!r}")
    return int(request[0]), int(request[1])


def _span(want: _Want) -> tuple[int, int]:
    assert want.span is not None
    return want.span


def _copies(pieces: list[Segment], wants: list[Segment]) -> list[_Copy]:
    """Every non-empty intersection of a piece's segments with a request's segments."""
    out = []
    for src in pieces:
        for dst in wants:
            part = intersect(src[0], dst[0])
            if part is not None:
                out.append(_Copy(src, dst, part))
    return out


def _empty(manifest: Manifest, name: str, want: _Want) -> torch.Tensor:
    return torch.empty(_volume(want.shape), dtype=torch_dtype(manifest.tensors[name].dtype), device=HOST)


def _volume(shape: tuple[int, ...]) -> int:
    return Box.full(shape).volume


def _assemble(
    manifest: Manifest, name: str, want: _Want, parts: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    start, stop = _span(want)
    if len(parts) == 1 and parts[0][1].numel() == stop - start:
        out = parts[0][1]  # one piece covers the request: no extra copy
    else:
        out = torch.empty(stop - start, dtype=torch_dtype(manifest.tensors[name].dtype), device=HOST)
        for lo, data in parts:
            out[lo - start : lo - start + data.numel()] = data
    return out.reshape(want.shape)


def _read_copies(
    f: object,
    piece: PieceRecord,
    copies: list[_Copy],
    dtype: str,
    chunk_bytes: int,
    verify: bool,
    label: str,
    out: torch.Tensor,
) -> None:
    """Copy every intersection from one piece into ``out``, reading only the chunks they touch."""
    chunk_elems = chunk_bytes // torch_dtype(dtype).itemsize
    runs = _touched_chunks(piece, copies, chunk_elems)
    base, end = runs[0][0] * chunk_elems, min(runs[-1][1] * chunk_elems, piece.numel)
    if len(runs) == 1:
        buffer = _read_range(f, piece, base, end, dtype, chunk_bytes, verify, label)
    else:
        buffer = torch.empty(end - base, dtype=torch_dtype(dtype), device=HOST)
        for first, last in runs:
            a, b = first * chunk_elems, min(last * chunk_elems, piece.numel)
            buffer[a - base : b - base] = _read_range(f, piece, a, b, dtype, chunk_bytes, verify, label)
    for copy in copies:
        (src_box, src_at), (dst_box, dst_at), part = copy.src, copy.dst, copy.part
        src_offset = buffer.storage_offset() + src_at + flat_offset(src_box, part.offsets) - base
        dst_offset = out.storage_offset() + dst_at + flat_offset(dst_box, part.offsets)
        source = buffer.as_strided(part.lengths, strides(src_box.lengths), src_offset)
        out.as_strided(part.lengths, strides(dst_box.lengths), dst_offset).copy_(source)


def _touched_chunks(piece: PieceRecord, copies: list[_Copy], chunk_elems: int) -> list[tuple[int, int]]:
    """Maximal runs ``[first, last)`` of the piece's checksum chunks that hold an element of ``copies``."""
    count = len(piece.checksums)
    marks = torch.zeros(count + 1, dtype=torch.int64, device=HOST)
    for copy in copies:
        starts, run = box_runs(copy.src[0], copy.part)
        starts += copy.src[1]
        ones = torch.ones_like(starts)
        marks.index_add_(0, starts // chunk_elems, ones)
        marks.index_add_(0, (starts + run - 1) // chunk_elems + 1, -ones)
    touched = (marks.cumsum(0)[:-1] > 0).tolist()
    runs: list[tuple[int, int]] = []
    for chunk, hit in enumerate(touched):
        if not hit:
            continue
        if runs and runs[-1][1] == chunk:
            runs[-1] = (runs[-1][0], chunk + 1)
        else:
            runs.append((chunk, chunk + 1))
    return runs


def _slice(f: object, piece: PieceRecord, dtype: str, label: str) -> object:
    """The piece's key in an open file, after checking its dtype and length against the manifest."""
    try:
        sl = f.get_slice(piece.key)  # type: ignore[attr-defined]
    except SafetensorError:
        raise CorruptCheckpointError(
            label, f"has no tensor {piece.key!r}, which the manifest names"
        ) from None
    found, shape = sl.get_dtype(), sl.get_shape()
    if found != DTYPES[dtype] or list(shape) != [piece.numel]:
        raise CorruptCheckpointError(
            label,
            f"{piece.key!r} is {found} {list(shape)} in the file but {DTYPES[dtype]} [{piece.numel}] in the "
            "manifest (the file or the manifest was replaced)",
        )
    return sl


def _read_range(
    f: object, piece: PieceRecord, a: int, b: int, dtype: str, chunk_bytes: int, verify: bool, label: str
) -> torch.Tensor:
    """Elements ``[a, b)`` of one piece (offsets inside the piece), checked chunk by chunk."""
    sl = _slice(f, piece, dtype, label)
    if not verify:
        return sl[a:b]  # type: ignore[index]
    itemsize = torch_dtype(dtype).itemsize
    chunk_elems = chunk_bytes // itemsize
    first, last = chunk_span(a, b, chunk_elems)
    s0, s1 = first * chunk_elems, min(last * chunk_elems, piece.numel)
    data = sl[s0:s1]  # type: ignore[index]
    raw = memoryview(data.view(torch.uint8).numpy()).cast("B")
    for i, chunk in enumerate(range(first, max(last, first + 1))):
        if checksum(raw[i * chunk_bytes : (i + 1) * chunk_bytes]) != piece.checksums[chunk]:
            raise CorruptCheckpointError(
                label, f"{CHECKSUM} mismatch in {piece.key!r} (chunk {chunk} of {len(piece.checksums)})"
            )
    return data[a - s0 : b - s0]


def _open(step_dir: str, file: str) -> Any:  # a safetensors handle (untyped upstream)
    try:
        return safe_open(member_path(step_dir, file), framework="pt")
    except (SafetensorError, OSError) as err:
        reason = " ".join(str(err).split())
        raise CorruptCheckpointError(_label(step_dir, file), f"cannot be opened ({reason})") from None


def _label(step_dir: str, file: str) -> str:
    return os.path.join(os.path.basename(os.path.normpath(step_dir)), file)


def verify_checkpoint(step_dir: str, *, full: bool = False) -> Manifest:
    """The manifest if the checkpoint is usable: it parses, files have their sizes, and (``full``) digests."""
    manifest = read_manifest(step_dir)
    check_files(step_dir, manifest)
    if full:
        for file, pieces in pieces_by_file(manifest).items():
            with _open(step_dir, file) as f:
                for dtype, piece in pieces:
                    verify_piece(f, piece, dtype, manifest.chunk_bytes, _label(step_dir, file))
    return manifest


def pieces_by_file(manifest: Manifest) -> dict[str, list[tuple[str, PieceRecord]]]:
    """Every piece as ``(dtype, piece)``, grouped by the file that holds it (each file opened once)."""
    out: dict[str, list[tuple[str, PieceRecord]]] = {}
    for rec in manifest.tensors.values():
        for piece in rec.pieces:
            out.setdefault(piece.file, []).append((rec.dtype, piece))
    return out


def verify_piece(f: object, piece: PieceRecord, dtype: str, chunk_bytes: int, label: str) -> None:
    """Read a whole piece from an open file, checking every chunk (raises ``CorruptCheckpointError``)."""
    _read_range(f, piece, 0, piece.numel, dtype, chunk_bytes, True, label)


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def find_latest_valid(
    root: str, *, full: bool = False, clean_tmp: bool = False, on_bad: Callable[[str], None] | None = None
) -> str | None:
    """Newest usable ``step-<k>`` folder under ``root``; each bad one is reported in one line and skipped.

    Half-written ``.tmp-*`` folders are never considered (``clean_tmp`` removes them: rank 0, at start-up).
    """
    if clean_tmp:
        _clean_tmp(root)
    for _, step_dir in reversed(list_steps(root)):
        try:
            verify_checkpoint(step_dir, full=full)
        except CheckpointError as err:
            (on_bad or _warn)(f"checkpoint {step_dir} skipped, using the previous one: {err}")
            continue
        return step_dir
    return None


def resolve(path: str) -> str:
    """A step folder as given, or the newest valid one under a root: each newer one skipped is reported
    (a ``CheckpointWarning``); when none is usable the error says why each was skipped."""
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return path
    skipped: list[str] = []
    found = find_latest_valid(path, on_bad=skipped.append)
    if found is None:
        reasons = [reason.replace(" skipped, using the previous one:", " skipped:") for reason in skipped]
        raise CheckpointError(f"{path}: no complete checkpoint here" + "".join(f"; {r}" for r in reasons))
    for reason in skipped:
        _warn(reason)
    return found


def load_latest(
    root: str,
    requests: Callable[[Manifest], Requests] | Requests,
    comm: Comm | None = None,
    *,
    on_bad: Callable[[str], None] | None = None,
) -> Loaded | None:
    """Load from the newest checkpoint that every rank can read; fall back together on any failure.

    ``requests`` may be a function of the manifest (a rank's needs often depend on the saved shapes).
    Returns None when no checkpoint is usable.
    """
    report = on_bad or _warn
    for _, step_dir in reversed(list_steps(root)):
        error, result = None, None
        try:
            manifest = verify_checkpoint(step_dir)
            wanted = requests(manifest) if callable(requests) else requests
            result = Loaded(step_dir, manifest, load(step_dir, wanted, manifest=manifest))
        except CheckpointError as err:
            error = err
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=HOST)  # host: gloo
        if comm is not None:
            comm.all_reduce(failed, op="max")
        if int(failed.item()) == 0:
            return result
        if error is not None:
            report(f"checkpoint {step_dir} skipped, using the previous one: {error}")
    return None
