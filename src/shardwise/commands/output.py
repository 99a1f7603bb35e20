"""How commands print a result: a JSON line (``--json``) or their own rendering."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def emit(result: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], None]) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        render(result)
