"""One check of a whole job before any rank starts: values, degrees, model, parallelism, folders.

Commands call ``preflight`` before launching, so a job that cannot run fails in one line at once
instead of inside N ranks, or after training: ``model.init_from``'s weights are matched against the
model (built on the meta device) here too. The values are checked by ``TrainConfig.validate``
(pure, the ranges declared on the config's fields); the folders the run will write are *tried* here:
created if missing and written to, since only a write says whether a write will work (permissions,
read-only mounts, a file where a folder should be, root or not). The ranks run the value checks again
(``Trainer.build``), which is cheap. No communication.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from shardwise.checkpoint.pretrained import open_weights
from shardwise.collectives.api import check_algorithm, load_profile
from shardwise.compression import check_compress
from shardwise.config import ConfigError, TrainConfig
from shardwise.device import check_device, device_type
from shardwise.models import build_model, check_model_config
from shardwise.observe.tensorboard import available as tensorboard_available
from shardwise.parallelism import check as check_parallelism
from shardwise.pipeline.axis import check_combination


def preflight(config: TrainConfig, world_size: int, writes_run_files: bool = True) -> TrainConfig:
    """The config validated for ``world_size`` ranks (dp resolved), or a one-line ``ConfigError``.

    ``writes_run_files``: whether the command writes the run folder and checkpoints (``train`` does,
    ``verify`` does not).
    """
    check_combination(config)  # before the world's arithmetic: a pipeline job that cannot run at all
    config = config.validate(world_size)
    check_device(config.device, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    check_algorithm(config.comm.algorithm, device_type(config.device))
    if config.tensorboard and not tensorboard_available():
        raise ConfigError("--tensorboard needs tensorboardX: pip install shardwise[tensorboard]")
    if config.zero.precision != "fp32":
        print(
            f"shardwise: zero.precision is deprecated: read as precision = {config.compute_precision} "
            "(use --precision)",
            file=sys.stderr,
            flush=True,
        )
    check_model_config(config.model)
    if config.model.init_from:
        check_init_from(config)
    check_parallelism(config)
    for key, folder in output_folders(config, writes_run_files):
        check_writable(key, folder)
    check_compress(config.comm, config.strategy)
    load_profile(config.comm.profile)  # each rank reads it: a bad one fails here, not in N tracebacks
    return config


def check_init_from(config: TrainConfig) -> None:
    """The weights of ``model.init_from`` fit the model: the files' headers against the model built
    with its parameters on the meta device (no values drawn, no tensor data read)."""
    dtype = torch.float64 if config.dtype == "float64" else torch.float32
    open_weights(config.model.init_from, build_model(config.model, dtype, meta=True)).close()


def output_folders(config: TrainConfig, writes_run_files: bool = True) -> list[tuple[str, str]]:
    """(config key, folder) for every folder a run of ``config`` writes into."""
    folders: list[tuple[str, str]] = []
    if writes_run_files:
        folders.append(("run_dir", config.run_dir))
        ckpt = config.checkpoint
        if ckpt.dir:
            folders.append(("checkpoint.dir", ckpt.dir))
        elif ckpt.every > 0:  # the same rule as train.checkpointing.checkpoint_root
            default = str(Path(config.run_dir) / "checkpoints")
            folders.append(("checkpoint.dir (default <run_dir>/checkpoints)", default))
    if config.zero.offload == "disk" and config.zero.offload_dir:
        folders.append(("zero.offload_dir", config.zero.offload_dir))
    return folders


def check_writable(key: str, folder: str) -> None:
    """Make ``folder`` (and its parents) if missing and write a probe file in it, or say why not."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key} = {folder!r} is a file, not a folder; give a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".shardwise-probe-", dir=path)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, (NotADirectoryError, FileExistsError)):
            reason += " (part of the path is a file)"
        raise ConfigError(
            f"{key} = {folder!r} cannot be written: {reason}; give a folder you can write"
        ) from None
