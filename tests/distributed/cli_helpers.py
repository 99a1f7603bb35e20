"""Run ``python -m shardwise`` as a user would and read its last stdout line as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"


def shardwise(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "shardwise", *args], capture_output=True, text=True, timeout=timeout_s, env=env
    )


def last_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, f"no stdout; stderr:\n{result.stderr[-3000:]}"
    return json.loads(lines[-1])
