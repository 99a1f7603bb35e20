#!/usr/bin/env bash
# Run every benchmark and keep its JSON under benchmarks/results/ (one file per benchmark).
# Each figure there is a ratio against the PyTorch built-in measured in the same run, interleaved.
# Run it on a quiet machine: `uptime` first; the load average should be well under the core count.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"
sw=.venv/bin/shardwise
[ -x "$sw" ] || sw=shardwise
export OMP_NUM_THREADS=1
uptime | tee "$out/load.txt"
for kind in "$@"; do
  case "$kind" in
    ddp) $sw bench ddp --nproc 2 --json --out "$out/ddp.json" >/dev/null ;;
    dp-compare) $sw bench dp-compare --nproc 3 --json --out "$out/dp-compare.json" >/dev/null ;;
    comm) $sw bench comm --nproc 2 --json --out "$out/comm.json" >/dev/null ;;
    zero) $sw bench zero --nproc 2 --json --out "$out/zero.json" >/dev/null ;;
    ckpt) $sw bench ckpt --nproc 2 --json --out "$out/ckpt.json" >/dev/null ;;
    ps-async) $sw bench ps-async --nproc 3 --json --out "$out/ps-async.json" >/dev/null ;;
    compress) $sw bench compress --nproc 2 --json --out "$out/compress.json" >/dev/null ;;
    # two network namespaces over a veth pair shaped to 1 Gbit/s both ways: needs root and iproute2
    compress_link) $sw bench compress --link 1gbit --steps 300 --json --out "$out/compress_link.json" >/dev/null ;;
    *) echo "unknown benchmark $kind" >&2; exit 2 ;;
  esac
  echo "$kind -> $out/$kind.json"
done
