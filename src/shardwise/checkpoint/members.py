"""File names inside a checkpoint folder: plain names only, and none that resolves outside it.

A manifest names the files it reads; a name with a separator, ``..`` or a link out of the folder is
refused in one line, so a manifest can never make a reader open a file elsewhere. No communication
happens here.
"""

from __future__ import annotations

import os

from shardwise.checkpoint.errors import CorruptCheckpointError, ManifestError
from shardwise.checkpoint.strict_json import show

MANIFEST_NAME = "manifest.json"


def is_plain_name(name: str) -> bool:
    """A bare file name: not empty, not ``.``/``..``, no separator and no NUL (so it stays in its folder)."""
    seps = {"/", "\\", "\0", os.sep, *([os.altsep] if os.altsep else [])}
    return bool(name) and name not in (".", "..") and not any(s in name for s in seps)


def check_member_name(name: object, where: str) -> str:
    """``name`` if it is a plain file name; a manifest naming anything else is refused in one line."""
    if not isinstance(name, str):
        raise ManifestError(f"{where}: a file name must be a string, got {show(name)}")
    if not is_plain_name(name):
        raise ManifestError(
            f"{where}: file {name!r} is outside the checkpoint folder; a manifest may name only plain "
            "file names in its own folder (restore the checkpoint or delete it)"
        )
    return name


def member_path(folder: str, name: str) -> str:
    """The path of file ``name`` in ``folder``, refusing one that resolves outside it (a symlink).

    Checked at open time as well as in the manifest: a link can be planted after the manifest was read.
    """
    check_member_name(name, os.path.join(folder, MANIFEST_NAME))
    path = os.path.join(folder, name)
    real, home = os.path.realpath(path), os.path.realpath(folder)
    if real == home or os.path.commonpath([real, home]) != home:
        raise CorruptCheckpointError(
            os.path.join(os.path.basename(os.path.normpath(folder)), name),
            f"resolves to {real}, outside the checkpoint folder (replace the link with the file itself)",
        )
    return path
