"""Checkpoints: a manifest plus safetensors shards that any world size or strategy can load.

See ``format`` (the manifest), ``boxes`` (n-d box arithmetic), ``manager`` (saving from every rank),
``reader`` (resharding loads and fallback to the newest valid checkpoint), ``inspect`` (inspect and
export) and ``bench``.
"""

from shardwise.checkpoint.boxes import Box
from shardwise.checkpoint.errors import CheckpointError, CorruptCheckpointError, ManifestError
from shardwise.checkpoint.format import Manifest
from shardwise.checkpoint.inspect import export, format_inspect, inspect
from shardwise.checkpoint.manager import CheckpointWriter, Piece, SaveReport, save, spread_replicated
from shardwise.checkpoint.reader import (
    CheckpointWarning,
    Loaded,
    find_latest_valid,
    load,
    load_latest,
    verify_checkpoint,
)
from shardwise.checkpoint.rng import capture_rng, restore_rng

__all__ = [
    "Box",
    "CheckpointError",
    "CheckpointWarning",
    "CheckpointWriter",
    "CorruptCheckpointError",
    "Loaded",
    "Manifest",
    "ManifestError",
    "Piece",
    "SaveReport",
    "capture_rng",
    "export",
    "find_latest_valid",
    "format_inspect",
    "inspect",
    "load",
    "load_latest",
    "restore_rng",
    "save",
    "spread_replicated",
    "verify_checkpoint",
]
