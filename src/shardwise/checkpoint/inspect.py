"""Look inside a checkpoint (tensors, shards, sizes, checksums verified) and export a plain model file.

``inspect`` reports every problem it finds instead of stopping at the first, so ``shardwise ckpt
inspect DIR`` can show a whole damaged checkpoint; ``export`` assembles the full model tensors (names
under a prefix such as ``model/``) into one ordinary safetensors file, written under a temporary name
and renamed. Purely local; no communication.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file

from shardwise.checkpoint.format import CheckpointError, read_manifest, torch_dtype
from shardwise.checkpoint.reader import _label, _open, _read_range, check_files, load, resolve


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
        full = os.path.join(step_dir, name)
        size = os.path.getsize(full) if os.path.exists(full) else None
        files[name] = {"size_bytes": size, "recorded_bytes": recorded, "ok": ok}
    tensors = {}
    for name, rec in sorted(manifest.tensors.items()):
        shards = []
        for piece in rec.pieces:
            ok = None
            if verify and files[piece.file]["ok"]:
                ok = _verify_piece(step_dir, piece, rec.dtype, manifest.chunk_bytes, problems)
            shards.append({"file": piece.file, "key": piece.key, "start": piece.start, "stop": piece.stop,
                           "chunks": len(piece.checksums), "checksum_ok": ok})  # fmt: skip
        itemsize = torch.empty((), dtype=torch_dtype(rec.dtype)).element_size()
        tensors[name] = {"global_shape": list(rec.global_shape), "dtype": rec.dtype,
                         "bytes": rec.numel * itemsize, "shards": shards}  # fmt: skip
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


def _verify_piece(step_dir: str, piece: Any, dtype: str, chunk_bytes: int, problems: list[str]) -> bool:
    try:
        with _open(step_dir, piece.file) as f:
            _read_range(
                f, piece, 0, piece.stop - piece.start, dtype, chunk_bytes, True, _label(step_dir, piece.file)
            )
        return True
    except CheckpointError as err:
        problems.append(str(err))
        return False


def format_inspect(info: dict[str, Any]) -> str:
    """Plain-text rendering of :func:`inspect`'s result, one line per tensor."""
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
    for name, f in info["files"].items():
        lines.append(f"  file {name}: {f['size_bytes']} bytes (recorded {f['recorded_bytes']})")
    verdict = "all checksums verified" if info["checksums_verified"] else "sizes checked, checksums not read"
    lines.append("OK: " + verdict if info["ok"] else "PROBLEMS:\n  " + "\n  ".join(info["problems"]))
    return "\n".join(lines)


def export(
    path: str, out_path: str, *, prefix: str = "model/", strip_prefix: bool = True
) -> dict[str, list[int]]:
    """Write every tensor named ``prefix...`` whole into one plain safetensors file; return name -> shape."""
    step_dir = resolve(path)
    manifest = read_manifest(step_dir)
    names = [n for n in sorted(manifest.tensors) if n.startswith(prefix)]
    if not names:
        raise CheckpointError(f"{step_dir}: no tensor named {prefix!r}... to export")
    tensors = load(step_dir, names, manifest=manifest)
    out = {(n[len(prefix) :] if strip_prefix else n): t.contiguous() for n, t in tensors.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    save_file(out, tmp, metadata={"format": "pt", "source": step_dir, "step": str(manifest.step)})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out_path)
    return {n: list(t.shape) for n, t in out.items()}
