"""Look inside a checkpoint (tensors, shards, sizes, checksums verified) and export a plain model file.

``inspect`` reports every problem it finds instead of stopping at the first, so ``shardwise ckpt
inspect DIR`` can show a whole damaged checkpoint (each file opened once: a file that cannot be opened
is one problem, not one per tensor in it); ``export`` assembles the full model tensors (names under a
prefix such as ``model/``, written as flat ranges or boxes) into one ordinary safetensors file, written
under a temporary name and renamed. Purely local; no communication.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import save_file

from shardwise.checkpoint.format import CheckpointError, Manifest, PieceRecord, read_manifest
from shardwise.checkpoint.members import member_path
from shardwise.checkpoint.reader import (
    _label,
    _open,
    check_files,
    load,
    pieces_by_file,
    resolve,
    verify_piece,
)


def inspect(path: str, *, verify: bool = True) -> dict[str, Any]:
    """A JSON-ready description of the checkpoint at ``path`` (a step folder or a root)."""
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    problems: list[str] = []
    files = {}
    for name, recorded in manifest.files.items():
        try:
            check_files(step_dir, manifest, [name])
            ok = True
        except CheckpointError as err:
            problems.append(str(err))
            ok = False
        files[name] = {"size_bytes": _size(step_dir, name), "recorded_bytes": recorded, "ok": ok}
    checked = _verify_files(step_dir, manifest, files, problems) if verify else {}
    tensors = {}
    for name, rec in sorted(manifest.tensors.items()):
        shards = [_shard(piece, checked.get((piece.file, piece.key))) for piece in rec.pieces]
        tensors[name] = {"global_shape": list(rec.global_shape), "dtype": rec.dtype,
                         "bytes": rec.numel * rec.itemsize, "shards": shards}  # fmt: skip
    return {
        "path": step_dir,
        "step": manifest.step,
        "strategy": manifest.strategy,
        "world_size": manifest.world_size,
        "mesh": manifest.mesh,
        "format_version": manifest.format_version,
        "checksum": manifest.checksum,
        "total_bytes": sum(manifest.files.values()),
        "files": files,
        "tensors": tensors,
        "checksums_verified": verify,
        "ok": not problems,
        "problems": problems,
    }


def _size(step_dir: str, name: str) -> int | None:
    try:
        return os.path.getsize(member_path(step_dir, name))
    except (CheckpointError, OSError):
        return None


def _shard(piece: PieceRecord, ok: bool | None) -> dict[str, Any]:
    """One piece as inspect reports it: a flat range (start/stop) or a box (offsets/lengths)."""
    where: dict[str, Any] = (
        {"offsets": list(piece.box.offsets), "lengths": list(piece.box.lengths)}
        if piece.box is not None
        else {"start": piece.start, "stop": piece.stop}
    )
    return {"file": piece.file, "key": piece.key, **where, "chunks": len(piece.checksums), "checksum_ok": ok}


def _verify_files(
    step_dir: str, manifest: Manifest, files: dict[str, Any], problems: list[str]
) -> dict[tuple[str, str], bool]:
    """Every piece's checksums, by ``(file, key)``; a file that cannot be opened is one problem, not one per
    piece (a damaged header would otherwise be reported for every tensor it holds)."""
    checked: dict[tuple[str, str], bool] = {}
    for file, pieces in pieces_by_file(manifest).items():
        if not files[file]["ok"]:
            continue
        label = _label(step_dir, file)
        try:
            handle = _open(step_dir, file)
        except CheckpointError as err:
            problems.append(str(err))
            files[file]["ok"] = False
            checked.update({(file, piece.key): False for _, piece in pieces})
            continue
        with handle as f:
            for dtype, piece in pieces:
                try:
                    verify_piece(f, piece, dtype, manifest.chunk_bytes, label)
                    checked[(file, piece.key)] = True
                except CheckpointError as err:
                    problems.append(str(err))
                    checked[(file, piece.key)] = False
    return checked


def format_inspect(info: dict[str, Any]) -> str:
    """Plain-text rendering of :func:`inspect`'s result, one line per tensor (and per box piece)."""
    lines = [
        f"{info['path']}: step {info['step']}, strategy {info['strategy'] or '?'}, "
        f"world size {info['world_size']}, {len(info['tensors'])} tensors, "
        f"{len(info['files'])} files, {info['total_bytes'] / 1e6:.2f} MB",
    ]
    for name, t in info["tensors"].items():
        marks = {s["checksum_ok"] for s in t["shards"]}
        state = "ok" if marks == {True} else "BAD" if False in marks else "unverified"
        shape = "x".join(map(str, t["global_shape"])) or "scalar"
        lines.append(f"  {name:<40} {t['dtype']:<9} {shape:<16} {t['bytes']:>12,d} B  "
                     f"{len(t['shards'])} shard(s)  {state}")  # fmt: skip
        # Flat shards are listed by --json only (ZeRO writes one per rank per tensor); a box is worth
        # a line, since it says how the tensor was cut.
        for s in t["shards"]:
            if "offsets" in s:
                mark = {True: "ok", False: "BAD", None: "unverified"}[s["checksum_ok"]]
                lines.append(f"    box offsets {s['offsets']} lengths {s['lengths']} in {s['file']}  {mark}")
    for name, f in info["files"].items():
        lines.append(f"  file {name}: {f['size_bytes']} bytes (recorded {f['recorded_bytes']})")
    verdict = "all checksums verified" if info["checksums_verified"] else "sizes checked, checksums not read"
    lines.append("OK: " + verdict if info["ok"] else "PROBLEMS:\n  " + "\n  ".join(info["problems"]))
    return "\n".join(lines)


def export(
    path: str, out_path: str, *, prefix: str = "model/", strip_prefix: bool = True
) -> dict[str, list[int]]:
    """Write every tensor named ``prefix...`` whole into one plain safetensors file; return name -> shape.

    Tensors saved as flat ranges or boxes are assembled alike. ``out_path`` must be a file name: an
    existing folder is refused before anything is read, and a failed write leaves nothing behind.
    """
    if os.path.isdir(out_path):
        raise CheckpointError(
            f"{out_path} is a folder; give the file to write, "
            f"e.g. {os.path.join(out_path, 'model.safetensors')}"
        )
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    names = [n for n in sorted(manifest.tensors) if n.startswith(prefix)]
    if not names:
        raise CheckpointError(f"{step_dir}: no tensor named {prefix!r}... to export")
    tensors = load(step_dir, names, manifest=manifest)
    out = {(n[len(prefix) :] if strip_prefix else n): t.contiguous() for n, t in tensors.items()}
    tmp = f"{out_path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        save_file(out, tmp, metadata={"format": "pt", "source": step_dir, "step": str(manifest.step)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except (OSError, SafetensorError) as err:
        reason = getattr(err, "strerror", None) or " ".join(str(err).split())
        raise CheckpointError(f"{out_path}: cannot be written ({reason}); choose another path") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # gone already after a successful rename
    return {n: list(t.shape) for n, t in out.items()}
