"""Bad input through a real ``python -m shardwise``: exit 2, one stderr line, no rank started.

The whole table runs in-process in tests/unit/test_cli_bad_input.py; these few check the same end to
end, from the process's exit code to the absent ``<run-dir>/pids`` folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_helpers import shardwise


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "inf"], "optim.lr must be a finite number > 0, got inf"),
        (
            ["--set", "model=gpt"],
            "model is a table, not a value (got 'gpt'); set its keys, e.g. --set model.kind=gpt",
        ),
        (["--checkpoint-dir", "{file}/sub"], "checkpoint.dir = '{file}/sub' cannot be written"),
        (["--max-restarts", "-1"], "max_restarts must be an integer >= 0, got -1"),
        (["--config", "{tmp}"], "--config {tmp} is a folder; give a TOML file"),
        # issue 22: a setting of another strategy (it trained plain ddp and exited 0), and inputs that
        # hung (/dev/zero read forever, deaf to SIGINT) or failed inside every rank (comm.profile)
        (["--strategy", "ddp", "--servers", "2"], "ddp does not read ps.servers = 2 (ps only)"),
        (["--steps", "3", "--set", "steps=2"], "--steps 3 and --set steps=2 both set steps"),
        (["--config", "/dev/zero"], "--config /dev/zero is not a regular file"),
        (["--algorithm", "auto", "--set", "comm.profile={file}"], "comm.profile {file} is not a cost"),
        # issue 27: 10^8 micro-batches were OOM-killed building action lists; a schedule without --pp
        # trained as if it were not there
        (["--pp", "2", "--micro-batches", "100000000"], "data.micro_batches(100000000) is more than"),
        (["--schedule", "interleaved"], "parallel.schedule = 'interleaved' orders a pipeline"),
    ],
)
def test_bad_input_exits_2_in_one_line_and_starts_no_rank(
    tmp_path: Path, args: list[str], message: str
) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    names = {"file": str(file), "tmp": str(tmp_path)}
    run_dir = tmp_path / "run"
    argv = ["train", "--nproc", "2", "--preset", "tiny", "--steps", "2", "--run-dir", str(run_dir), *args]
    result = shardwise(*(a.format(**names) for a in argv), timeout_s=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and message.format(**names) in lines[0], result.stderr[-3000:]
    assert not (run_dir / "pids").exists()
