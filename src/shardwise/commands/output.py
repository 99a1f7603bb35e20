"""How commands print a result: a JSON line (``--json``) or their own rendering; and save it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], None]) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render(result)


def write_json(path: str, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``path``, replaced whole (a temporary file renamed), never half-written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text(json.dumps(result, indent=2))
    temporary.replace(target)
