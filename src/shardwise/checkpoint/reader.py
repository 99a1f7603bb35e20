"""Read any flat range of any tensor from a checkpoint, whatever world size or strategy wrote it.

A request names a global tensor and a flat range ``[start, stop)`` of it (or the whole tensor). The
reader finds the pieces that overlap it and reads only those bytes through ``safe_open(...).get_slice``
(rounded out to whole checksum chunks), checks each file's size before opening it (truncation) and each
chunk's CRC32 before trusting it, and copies the overlap into place. No communication, except in
:func:`load_latest`, where one all-reduce of a failure flag makes every rank fall back together.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from shardwise.checkpoint.format import (
    CHECKSUM,
    MANIFEST_NAME,
    CheckpointError,
    CorruptCheckpointError,
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
from shardwise.collectives.api import Comm

Requests = Mapping[str, "tuple[int, int] | None"] | Iterable[str]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped; the message names the file and the reason."""


@dataclass(frozen=True)
class Loaded:
    path: str
    manifest: Manifest
    tensors: dict[str, torch.Tensor]


def check_files(step_dir: str, manifest: Manifest, names: Iterable[str] | None = None) -> None:
    """Every (or every named) data file exists with the size the manifest records."""
    for name in manifest.files if names is None else names:
        path = os.path.join(step_dir, name)
        label = _label(step_dir, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(label, "missing") from None
        expected = manifest.files[name]
        if size != expected:
            what = "truncated" if size < expected else "longer than written"
            raise CorruptCheckpointError(label, f"{size} bytes, the manifest records {expected} ({what})")


def load(
    path: str, requests: Requests, *, verify: bool = True, manifest: Manifest | None = None
) -> dict[str, torch.Tensor]:
    """Tensors by name: a 1-D tensor for a ``(start, stop)`` request, the global shape for a full one.

    ``path`` is a ``step-<k>`` folder or a root (its newest valid checkpoint is read).
    """
    step_dir = resolve(path)
    manifest = manifest or read_manifest(step_dir)
    wanted = _normalize(manifest, requests)
    plan: dict[str, list[tuple[str, PieceRecord, int, int]]] = {}
    for name, (start, stop) in wanted.items():
        for piece in manifest.tensors[name].pieces:
            hit = overlap((start, stop), (piece.start, piece.stop))
            if hit:
                plan.setdefault(piece.file, []).append((name, piece, *hit))
    check_files(step_dir, manifest, plan)
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in wanted}
    for file, reads in plan.items():
        with _open(step_dir, file) as f:
            for name, piece, lo, hi in reads:
                rec = manifest.tensors[name]
                data = _read_range(
                    f,
                    piece,
                    lo - piece.start,
                    hi - piece.start,
                    rec.dtype,
                    manifest.chunk_bytes,
                    verify,
                    _label(step_dir, file),
                )
                parts[name].append((lo, data))
    return {name: _assemble(manifest, name, wanted[name], parts[name], requests) for name in wanted}


def _normalize(manifest: Manifest, requests: Requests) -> dict[str, tuple[int, int]]:
    items = requests.items() if isinstance(requests, Mapping) else ((n, None) for n in requests)
    out = {}
    for name, span in items:
        if name not in manifest.tensors:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint (step {manifest.step})")
        numel = manifest.tensors[name].numel
        start, stop = span if span is not None else (0, numel)
        if not 0 <= start <= stop <= numel:
            raise CheckpointError(f"tensor {name!r}: range [{start}, {stop}) is outside its {numel} elements")
        out[name] = (start, stop)
    return out


def _assemble(
    manifest: Manifest,
    name: str,
    span: tuple[int, int],
    parts: list[tuple[int, torch.Tensor]],
    requests: Requests,
) -> torch.Tensor:
    rec = manifest.tensors[name]
    start, stop = span
    if len(parts) == 1 and parts[0][1].numel() == stop - start:
        out = parts[0][1]  # one piece covers the request: no extra copy
    else:
        out = torch.empty(stop - start, dtype=torch_dtype(rec.dtype))
        for lo, data in parts:
            out[lo - start : lo - start + data.numel()] = data
    full = not isinstance(requests, Mapping) or requests[name] is None
    return out.reshape(rec.global_shape) if full else out


def _read_range(
    f: object, piece: PieceRecord, a: int, b: int, dtype: str, chunk_bytes: int, verify: bool, label: str
) -> torch.Tensor:
    """Elements ``[a, b)`` of one piece (offsets inside the piece), checked chunk by chunk."""
    sl = f.get_slice(piece.key)  # type: ignore[attr-defined]
    if not verify:
        return sl[a:b]
    itemsize = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    chunk_elems = chunk_bytes // itemsize
    first, last = chunk_span(a, b, chunk_elems)
    s0, s1 = first * chunk_elems, min(last * chunk_elems, piece.stop - piece.start)
    data = sl[s0:s1]
    raw = memoryview(data.view(torch.uint8).numpy()).cast("B")
    for i, chunk in enumerate(range(first, max(last, first + 1))):
        if checksum(raw[i * chunk_bytes : (i + 1) * chunk_bytes]) != piece.checksums[chunk]:
            raise CorruptCheckpointError(
                label, f"{CHECKSUM} mismatch in {piece.key!r} (chunk {chunk} of {len(piece.checksums)})"
            )
    return data[a - s0 : b - s0]


def _open(step_dir: str, file: str) -> object:
    try:
        return safe_open(os.path.join(step_dir, file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CorruptCheckpointError(_label(step_dir, file), f"cannot be opened ({err})") from None


def _label(step_dir: str, file: str) -> str:
    return os.path.join(os.path.basename(os.path.normpath(step_dir)), file)


def verify_checkpoint(step_dir: str, *, full: bool = False) -> Manifest:
    """The manifest if the checkpoint is usable: it parses, files have their sizes, and (``full``) digests."""
    manifest = read_manifest(step_dir)
    check_files(step_dir, manifest)
    if full:
        for rec in manifest.tensors.values():
            for piece in rec.pieces:
                with _open(step_dir, piece.file) as f:
                    _read_range(
                        f,
                        piece,
                        0,
                        piece.stop - piece.start,
                        rec.dtype,
                        manifest.chunk_bytes,
                        True,
                        _label(step_dir, piece.file),
                    )
    return manifest


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
    """A step folder as given, or the newest valid one under a root."""
    if os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return path
    found = find_latest_valid(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint here")
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
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
        if comm is not None:
            comm.all_reduce(failed, op="max")
        if int(failed.item()) == 0:
            return result
        if error is not None:
            report(f"checkpoint {step_dir} skipped, using the previous one: {error}")
    return None
