"""Where checkpoints live under a root folder, and how one becomes visible: rename, pointer, prune.

``<root>/.tmp-step-<k>-<token>/`` while being written (ignored by every reader), renamed to
``<root>/step-<k>/`` once its manifest is fsynced; ``<root>/latest`` (a one-line text file naming the
folder) is replaced after the rename, and only then are checkpoints beyond the newest ``keep`` removed.
A dangling or stale pointer is harmless: readers pick the newest complete folder. Only rank 0 calls
:func:`publish` and :func:`prune`; no communication here.
"""

from __future__ import annotations

import os
import re
import shutil

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.members import is_plain_name
from shardwise.checkpoint.shardfile import fsync_dir

LATEST_NAME = "latest"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int, token: str) -> str:
    return f"{TMP_PREFIX}{step_dir_name(step)}-{token}"


def list_steps(root: str) -> list[tuple[int, str]]:
    """Complete checkpoint folders under ``root`` as ``(step, path)``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.listdir(root):
        match = _STEP_RE.match(entry)
        if match and os.path.isdir(os.path.join(root, entry)):
            found.append((int(match.group(1)), os.path.join(root, entry)))
    return sorted(found)


def list_tmp(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, e) for e in os.listdir(root) if e.startswith(TMP_PREFIX))


def read_latest(root: str) -> str | None:
    """The folder the ``latest`` pointer names, or None when there is no pointer.

    The pointer may name only a folder directly under ``root``: anything else (``..``, an absolute
    path, a link that resolves elsewhere) is refused in one line rather than followed.
    """
    path = os.path.join(root, LATEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot be read ({err}); delete it, readers do not need it") from None
    if not name:
        return None
    target = os.path.join(root, name)
    home = os.path.realpath(root)
    if not is_plain_name(name) or os.path.dirname(os.path.realpath(target)) != home:
        raise CheckpointError(
            f"{path}: names {name[:80]!r}, outside the checkpoint root; it may name only a step folder "
            "in the root (delete it, readers find the newest checkpoint without it)"
        )
    return target


def write_latest(root: str, step_dir: str) -> None:
    path = os.path.join(root, LATEST_NAME)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(os.path.basename(step_dir) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(root)


def publish(root: str, tmp_dir: str, step: int) -> str:
    """Rename a finished temporary folder to its step name and point ``latest`` at it.

    The caller prunes afterwards (:func:`prune`), off the path other ranks wait on.
    """
    final = os.path.join(root, step_dir_name(step))
    if os.path.exists(final):  # a re-save of the same step replaces the old one
        shutil.rmtree(final)
    fsync_dir(tmp_dir)
    os.replace(tmp_dir, final)
    write_latest(root, final)  # fsyncs root, making the rename durable too
    return final


def prune(root: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` checkpoints (keep <= 0 keeps all); return what was removed."""
    if keep <= 0:
        return []
    steps = list_steps(root)
    removed = [path for _, path in steps[:-keep]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def clean_tmp(root: str) -> list[str]:
    """Remove half-written folders. Call only when no save can be in flight (at start-up, rank 0)."""
    removed = list_tmp(root)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
