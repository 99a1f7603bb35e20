#!/usr/bin/env bash
# The whole test suite: lint, layer contracts, type check, then unit and multi-rank tests (slow ones too).
# Ends with the 15 slowest tests and the time taken; exits with pytest's code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/lint-imports --no-cache    # the layer contracts (pyproject.toml [tool.importlinter])
.venv/bin/mypy                       # type-check src/ (pyproject.toml [tool.mypy])
begun=$SECONDS
status=0
.venv/bin/python -m pytest -q --durations=15 "$@" || status=$?
took=$((SECONDS - begun))
echo "scripts/test.sh: pytest took $((took / 60)) min $((took % 60)) s, everything $((SECONDS / 60)) min $((SECONDS % 60)) s (exit $status)"
exit "$status"
