#!/usr/bin/env bash
# The whole test suite: lint, layer contracts, type check, then unit and multi-rank tests (slow ones too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/lint-imports --no-cache    # the layer contracts (pyproject.toml [tool.importlinter])
.venv/bin/mypy                       # type-check src/ (pyproject.toml [tool.mypy])
exec .venv/bin/python -m pytest -q "$@"
