#!/bin/bash
# The GPU checks in one call, for a machine with a GPU and a torch of its own (a lent one, a cloud box):
# shardwise is installed without its dependencies where it is not importable (the machine's torch
# stays), then the parity parts and the GPU tests run side by side (timing nothing), then the overhead
# against plain PyTorch alone (timings). Not yet run whole on a GPU; its parts took about 4 minutes on an H200.
#
#   bash scripts/gpu_check.sh OUT_DIR      # logs and benchmarks' gpu-*.json land in OUT_DIR (8 files)
#
# Without CUDA: `shardwise bench gpu`'s one line, nothing measured, exit 0. ROUNDS (default 6) sets the
# overhead's interleaved rounds; PYTHON the interpreter (default python3).
set -u
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
T0=$(date +%s)
since() { echo "$(($(date +%s) - T0)) s"; }

{
  nvidia-smi -L 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  "$PY" -c "import shardwise" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
} >"$OUT/env.txt" 2>&1
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec "$PY" -m shardwise bench gpu --out-dir "$OUT"
fi

(timeout 300 "$PY" -m shardwise bench gpu --parts world1 --out-dir "$OUT" >"$OUT/world1.log" 2>&1
  echo "rc $? at $(since)" >>"$OUT/world1.log") &
(timeout 300 "$PY" -m shardwise bench gpu --parts shared --out-dir "$OUT" >"$OUT/shared.log" 2>&1
  echo "rc $? at $(since)" >>"$OUT/shared.log") &
(timeout 300 "$PY" -m pytest -q -p no:cacheprovider -n 4 tests/distributed/test_gpu.py \
  tests/unit/test_devices.py tests/unit/test_nonfinite_checks.py tests/distributed/test_devices.py \
  >"$OUT/pytest.log" 2>&1
  echo "rc $? at $(since)" >>"$OUT/pytest.log") &
wait
echo "parity and tests done at $(since)" >>"$OUT/env.txt"
timeout 240 "$PY" -m shardwise bench gpu --parts overhead --rounds "${ROUNDS:-6}" --steps 40 --out-dir "$OUT" \
  >"$OUT/overhead.log" 2>&1
echo "overhead rc $? at $(since)" >>"$OUT/env.txt"
tail -n 3 "$OUT"/*.log
