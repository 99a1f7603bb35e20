"""The checkpoint's errors: each a one-line message that names the file and the reason.

No communication happens here.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the reason in one line."""


class ManifestError(CheckpointError):
    """A manifest that does not parse or does not add up."""


class CorruptCheckpointError(CheckpointError):
    """A data file that is missing, truncated or fails its checksum."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason
