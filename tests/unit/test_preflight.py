"""preflight tries the folders a run will write: made if missing, written to, one line if not."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shardwise.config import ConfigError, load_config
from shardwise.preflight import check_writable, output_folders, preflight


def test_missing_folders_are_made_and_the_probe_is_gone(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "b" / "run"
    config = load_config(None, {"run_dir": str(run_dir), "checkpoint.every": "2"})
    preflight(config, 1)
    assert (run_dir / "checkpoints").is_dir()
    assert list(run_dir.rglob("*")) == [run_dir / "checkpoints"]  # no probe left, no pids folder


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    config = load_config(None, {"run_dir": str(path)})
    with pytest.raises(
        ConfigError, match=f"^run_dir = '{re.escape(str(path))}' is a file, not a folder; give a folder path$"
    ):
        preflight(config, 1)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"checkpoint.dir": "{file}/sub"}, "checkpoint.dir"),
        ({"run_dir": "{file}/sub"}, "run_dir"),
        ({"strategy": "zero2", "zero.offload": "disk", "zero.offload_dir": "{file}/sub"}, "zero.offload_dir"),
    ],
)
def test_a_folder_under_a_file_cannot_be_written_even_by_root(
    tmp_path: Path, overrides: dict[str, str], key: str
) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    values = {"run_dir": str(tmp_path / "run"), **{k: v.format(file=file) for k, v in overrides.items()}}
    where = re.escape(f"{key} = '{file}/sub'")
    message = f"^{where} cannot be written: Not a directory .*; give a folder you can write$"
    with pytest.raises(ConfigError, match=message):
        preflight(load_config(None, values), 1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the test above covers it")
def test_a_read_only_folder_cannot_be_written(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(
            ConfigError,
            match=f"^checkpoint.dir = '{re.escape(str(folder))}' cannot be written: Permission denied",
        ):
            check_writable("checkpoint.dir", str(folder))
    finally:
        folder.chmod(0o700)


def test_only_the_folders_the_run_writes_are_tried(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    plain = load_config(None, {"run_dir": run})
    assert output_folders(plain) == [("run_dir", run)]
    ckpt = load_config(None, {"run_dir": run, "checkpoint.every": "5"})
    assert output_folders(ckpt)[1] == ("checkpoint.dir (default <run_dir>/checkpoints)", f"{run}/checkpoints")
    # the folder is used only for disk offload; verify writes neither run folder nor checkpoints
    cpu = load_config(None, {"strategy": "zero1", "zero.offload": "cpu", "zero.offload_dir": "/x"})
    assert ("zero.offload_dir", "/x") not in output_folders(cpu)
    disk = load_config(None, {"strategy": "zero1", "zero.offload": "disk", "zero.offload_dir": "/x"})
    assert output_folders(disk, writes_run_files=False) == [("zero.offload_dir", "/x")]


def test_values_are_checked_before_any_folder_is_made(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^optim\.lr must be"):
        preflight(load_config(None, {"run_dir": str(run_dir), "optim.lr": "inf"}), 1)
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strategy": "ps"}, "--strategy ps does not run with pipeline parallelism"),
        ({"precision": "fp16"}, "precision = fp16 (each stage would decide an overflow alone)"),
    ],
)
def test_a_pipeline_that_cannot_run_is_said_before_the_rank_count(
    tmp_path: Path, overrides: dict[str, str], message: str
) -> None:
    """pp 2 on 2 ranks with ps (one rank serves) would first fail the world's arithmetic; the user
    should hear what can never run, not fix the rank count first."""
    config = load_config(None, {"parallel.pp": "2", "run_dir": str(tmp_path), **overrides})
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(config, 2)
