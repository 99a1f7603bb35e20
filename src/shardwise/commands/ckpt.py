"""``shardwise ckpt inspect DIR`` and ``shardwise ckpt export DIR OUT.safetensors``.

DIR is a checkpoint folder (``step-<k>``), a checkpoint root (its newest valid checkpoint is used) or
a run folder (``<run>/checkpoints`` is looked in). Purely local: no processes, no communication.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from shardwise.checkpoint import CheckpointError, export, format_inspect, inspect
from shardwise.checkpoint.reader import CheckpointWarning


def add_ckpt_parser(sub: Any) -> None:
    ckpt = sub.add_parser("ckpt", help="look inside a checkpoint, or export its model")
    actions = ckpt.add_subparsers(dest="action", required=True)
    look = actions.add_parser("inspect", help="tensors, shards, sizes; every checksum verified")
    look.add_argument("dir", help="a step-<k> folder, a checkpoint root or a run folder")
    look.add_argument("--no-verify", action="store_true", help="check sizes only, read no data")
    look.add_argument("--json", action="store_true", help="print the description as JSON")
    look.set_defaults(run=inspect_command)
    out = actions.add_parser("export", help="the model's tensors, whole, in one plain safetensors file")
    out.add_argument("dir", help="a step-<k> folder, a checkpoint root or a run folder")
    out.add_argument("out", help="the .safetensors file to write")
    out.add_argument("--json", action="store_true", help="print name -> shape as JSON")
    out.set_defaults(run=export_command)


def _checkpoint_path(given: str) -> str:
    """A run folder stands for its ``checkpoints`` folder."""
    path = Path(given)
    if not path.exists():
        raise CheckpointError(f"{given}: no such folder")
    nested = path / "checkpoints"
    if nested.is_dir() and not (path / "manifest.json").exists():
        return str(nested)
    return str(path)


def _report_skipped(command: str, caught: list[warnings.WarningMessage]) -> bool:
    """Newer checkpoints passed over as damaged, one line each on stderr; True when there were any."""
    for warning in caught:
        print(f"shardwise ckpt {command}: {warning.message}", file=sys.stderr)
    return bool(caught)


def inspect_command(args: argparse.Namespace) -> int:
    """Exit 0 when the checkpoint is whole, 1 when a file (or a newer checkpoint) is damaged, 2 if none."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            info = inspect(_checkpoint_path(args.dir), verify=not args.no_verify)
    except CheckpointError as err:
        print(f"shardwise ckpt inspect: {err}", file=sys.stderr)
        return 2
    skipped = _report_skipped("inspect", caught)
    print(json.dumps(info) if args.json else format_inspect(info))
    return 0 if info["ok"] and not skipped else 1


def export_command(args: argparse.Namespace) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CheckpointWarning)
            shapes = export(_checkpoint_path(args.dir), args.out)
    except CheckpointError as err:
        print(f"shardwise ckpt export: {err}", file=sys.stderr)
        return 2
    _report_skipped("export", caught)
    if args.json:
        print(json.dumps({"out": args.out, "tensors": shapes}))
    else:
        print(f"wrote {len(shapes)} tensors to {args.out}")
    return 0
