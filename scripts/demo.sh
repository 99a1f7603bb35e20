#!/usr/bin/env bash
# The main job: train the built-in GPT on 2 local ranks with all-reduce data parallelism.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/shardwise train --nproc 2 --steps 40 "$@"
