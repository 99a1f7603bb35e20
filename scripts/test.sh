#!/usr/bin/env bash
# The whole test suite: lint, then unit and multi-rank tests (slow ones included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
exec .venv/bin/python -m pytest -q "$@"
