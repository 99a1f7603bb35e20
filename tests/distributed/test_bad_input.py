"""Bad input through a real ``python -m shardwise``: exit 2, one stderr line, no rank started.

The whole table (these cases among them) runs in-process through ``cli.main`` in
tests/unit/test_cli_bad_input.py, for train and verify. Three representatives run here end to end, from
the process's exit code to the absent ``<run-dir>/pids`` folder: a config error, a file error and a
pipeline error (each process costs seconds of start and imports, so no more).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_helpers import shardwise


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # a config error: a setting of another strategy (issue 22: it trained plain ddp and exited 0)
        (["--strategy", "ddp", "--servers", "2"], "ddp does not read ps.servers = 2 (ps only)"),
        # a file error: /dev/zero was read forever, deaf to SIGINT (issue 22)
        (["--config", "/dev/zero"], "--config /dev/zero is not a regular file"),
        # a pipeline error: 10^8 micro-batches were OOM-killed building action lists (issue 27)
        (["--pp", "2", "--micro-batches", "100000000"], "data.micro_batches(100000000) is more than"),
    ],
)
def test_bad_input_exits_2_in_one_line_and_starts_no_rank(
    tmp_path: Path, args: list[str], message: str
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--nproc", "2", "--preset", "tiny", "--steps", "2", "--run-dir", str(run_dir), *args]
    result = shardwise(*argv, timeout_s=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]
    assert not (run_dir / "pids").exists()
