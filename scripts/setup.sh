#!/usr/bin/env bash
# Make .venv with torch 2.13.0 (installed first, so pip never fetches another build) and shardwise.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  .venv/bin/pip install --quiet torch==2.13.0
fi
.venv/bin/pip install --quiet -e ".[test]"
# tests/distributed/test_two_hosts.py also needs root and iproute2's `ip` (apt-get install iproute2);
# without them it skips and says why.
command -v ip >/dev/null || echo "note: iproute2 (ip) is missing: the two-host test will skip" >&2
