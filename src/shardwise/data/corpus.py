"""The built-in corpus: the Python standard library's own source, as bytes. Nothing is downloaded.

No communication: every rank reads the same files in the same order and gets the same tensor, so a
run never needs to broadcast data. The files are sorted by their path relative to the stdlib folder,
so two machines with the same Python version build byte-identical corpora (``digest`` tells).
Tokens are bytes (0..255); the last 10% is held out for evaluation.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.config import ConfigError

VAL_FRACTION = 0.1
MIN_BYTES = 1024
# Folders left out: installed packages are not the stdlib, and test suites hold odd encodings and
# huge generated files that would dominate a small corpus.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # (n_train,) uint8; shared by every caller of load_corpus: do not modify
    val: torch.Tensor  # (n_val,) uint8, the held-out last 10%
    digest: str  # sha256 hex of train + val bytes
    n_files: int  # files that contributed bytes


def stdlib_sources() -> list[Path]:
    """The stdlib's ``.py`` files, sorted by relative POSIX path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return [path for _, path in found]


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = 4_000_000) -> Corpus:
    """Concatenate stdlib sources up to ``max_bytes`` and split off the last 10% for validation."""
    if max_bytes < MIN_BYTES:
        raise ConfigError(f"data.corpus_bytes must be >= {MIN_BYTES}, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_sources():
        if total >= max_bytes:
            break
        chunk = path.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
    data = b"".join(chunks)
    if len(data) < MIN_BYTES:
        raise ConfigError(
            f"found only {len(data)} bytes of stdlib source under {sysconfig.get_paths()['stdlib']}"
        )
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(len(data) * VAL_FRACTION)
    return Corpus(
        train=tokens[: len(data) - n_val],
        val=tokens[len(data) - n_val :],
        digest=hashlib.sha256(data).hexdigest(),
        n_files=len(chunks),
    )
