#!/usr/bin/env bash
# The whole test suite: lint, layer contracts, type check, then unit and multi-rank tests (slow ones too).
# Two workers (SHARDWISE_TEST_WORKERS=0: one process). Ends with the 15 slowest tests and the time taken;
# exits with pytest's code. With arguments (test files, pytest flags) only those tests run: no lint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
  .venv/bin/ruff check src tests benchmarks examples
  .venv/bin/lint-imports --no-cache    # the layer contracts (pyproject.toml [tool.importlinter])
  .venv/bin/mypy                       # type-check src/ (pyproject.toml [tool.mypy])
fi
begun=$SECONDS
status=0
# two pytest workers (pytest-xdist; tests/conftest.py keeps each file on one worker); -n 0: one process
.venv/bin/python -m pytest -q -n "${SHARDWISE_TEST_WORKERS:-2}" --dist loadgroup --durations=15 "$@" || status=$?
took=$((SECONDS - begun))
echo "scripts/test.sh: pytest took $((took / 60)) min $((took % 60)) s, everything $((SECONDS / 60)) min $((SECONDS % 60)) s (exit $status)"
exit "$status"
