"""``shardwise bench gpu``: the checks that need a GPU, for a machine with one (or more).

Three parts (``--parts``, all by default), each written to ``<out-dir>/gpu-<part>.json``:

- ``world1``: every strategy that runs on one rank (ddp, zero1, zero2, zero3, zero3 with its master
  shards offloaded to the host, diloco), at world size 1 on CUDA, against the one-process run on the
  CPU (``shardwise verify``'s reference, float64): the largest difference of losses, gradients and
  final parameters. The parameter server needs two ranks (a server and a worker): it is in ``shared``.
- ``shared``: 2 and 4 ranks sharing the GPU with CUDA tensors over gloo (``SHARDWISE_CUDA_BACKEND=gloo``:
  NCCL ranks cannot share a GPU), each against one process: DDP, ZeRO-1/2/3, tp 2, pp 2, the parameter
  server. NCCL between ranks needs a GPU per rank: on such a machine, ``shardwise verify --device cuda``.
- ``overhead``: shardwise at world size 1 on the GPU against plain PyTorch's own loop over the same
  model, batches and optimizer (fused AdamW): tokens/s and peak allocated memory, each side in fresh
  processes, interleaved; the goal is >= 0.97 of torch's tokens/s at <= 1.05 of its memory.

Without CUDA: one line, nothing measured or written, exit 0. Communication: what each run does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from shardwise.commands.parser import SHOW_DEFAULT
from shardwise.config import TrainConfig, load_config
from shardwise.device import CUDA_BACKEND_ENV, cuda_count

PARTS = ("world1", "shared", "overhead")
PARITY_TOLERANCE = 1e-10  # float64, as `shardwise verify`
WORLD1 = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "zero3-offload-cpu": {"strategy": "zero3", "zero.offload": "cpu"},
    "diloco": {"strategy": "diloco"},
}
SHARED = {
    "ddp": (2, {"strategy": "ddp"}),
    "zero1": (2, {"strategy": "zero1"}),
    "zero2": (2, {"strategy": "zero2"}),
    "zero3": (2, {"strategy": "zero3"}),
    "tp2": (2, {"strategy": "ddp", "parallel.tp": "2"}),
    "pp2": (2, {"strategy": "ddp", "parallel.pp": "2", "data.micro_batches": "4"}),
    "ps": (2, {"strategy": "ps"}),
    "ddp-4": (4, {"strategy": "ddp", "data.weights": ".25,.25,.10,.40"}),
    "zero1-4": (4, {"strategy": "zero1"}),
    "zero2-4": (4, {"strategy": "zero2"}),
    "zero3-4": (4, {"strategy": "zero3"}),
    "dp2-tp2-4": (4, {"strategy": "zero2", "parallel.tp": "2"}),
    "dp2-pp2-4": (4, {"strategy": "ddp", "parallel.pp": "2", "data.micro_batches": "4"}),
}


def add_gpu_parser(kinds: Any, run: Any) -> None:
    about = "the GPU checks: world 1 on CUDA vs the CPU, ranks sharing a GPU, overhead against torch"
    gpu = kinds.add_parser("gpu", help=about)
    gpu.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)} (default: all)"
    )
    gpu.add_argument(
        "--out-dir", default="benchmarks/results", help="where gpu-<part>.json go" + SHOW_DEFAULT
    )
    gpu.add_argument("--preset", default="small", help="overhead: the gpt preset" + SHOW_DEFAULT)
    gpu.add_argument(
        "--steps", type=int, default=30, help="overhead: steps per run, the first 5 warm-up" + SHOW_DEFAULT
    )
    gpu.add_argument(
        "--rounds", type=int, default=3, help="overhead: interleaved runs of each side" + SHOW_DEFAULT
    )
    gpu.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    gpu.set_defaults(run=run)


def bench_gpu_command(args: argparse.Namespace) -> int:
    from shardwise.commands.output import emit, write_json
    from shardwise.config import ConfigError

    parts = [p for p in args.parts.split(",") if p]  # checked first: a typo is found before a GPU is
    if unknown := sorted(set(parts) - set(PARTS)):
        raise ConfigError(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if not parts:
        raise ConfigError(f"--parts: none given; choose from {', '.join(PARTS)}")
    if args.steps < 1 or args.rounds < 1:
        raise ConfigError(f"--steps and --rounds must be at least 1 (got {args.steps}, {args.rounds})")
    if not cuda_count():
        print(
            "shardwise bench gpu: skipped: this machine has no CUDA device (torch.cuda.is_available() "
            "is False); nothing measured, nothing written",
            file=sys.stderr,
        )
        return 0
    results: dict[str, Any] = {}
    for part in parts:
        if part == "world1":
            results[part] = world1_parity()
        elif part == "shared":
            results[part] = shared_gpu_parity()
        else:
            results[part] = overhead(args.preset, args.steps, args.rounds)
        results[part]["device"] = torch.cuda.get_device_name(0)
        write_json(str(Path(args.out_dir) / f"gpu-{part}.json"), results[part])
    emit(results, args.json, _render)
    ok = all(r.get("ok", True) for r in results.values())
    return 0 if ok else 1


def _verify_config(overrides: dict[str, str]) -> TrainConfig:
    from shardwise.commands.verify import VERIFY_DEFAULTS, verify_defaults

    first = load_config(None, {**VERIFY_DEFAULTS, **overrides})
    defaults = verify_defaults(first.model.kind, first.strategy, first.parallel.schedule)
    return load_config(None, {**defaults, **overrides, "device": "cuda"})


def _parity_row(config: TrainConfig, nproc: int) -> dict[str, Any]:
    from shardwise.commands.verify import run_verify

    report = run_verify(config, nproc)
    keys = ("layout", "nproc", "ok", "failed", "max_loss_diff", "max_grad_diff", "max_param_diff")
    return {k: report[k] for k in keys}


def world1_parity() -> dict[str, Any]:
    """Each strategy at world size 1 on CUDA against the one-process CPU run (float64)."""
    rows = {name: _parity_row(_verify_config(o), 1) for name, o in WORLD1.items()}
    return {"rows": rows, "tolerance": PARITY_TOLERANCE, "ok": all(r["ok"] for r in rows.values())}


def shared_gpu_parity() -> dict[str, Any]:
    """2 and 4 ranks sharing the GPU, CUDA tensors over gloo, each against one process (float64)."""
    before = os.environ.get(CUDA_BACKEND_ENV)
    os.environ[CUDA_BACKEND_ENV] = "gloo"  # the ranks the launcher starts read it
    try:
        rows = {name: _parity_row(_verify_config(o), n) for name, (n, o) in SHARED.items()}
    finally:
        if before is None:
            os.environ.pop(CUDA_BACKEND_ENV, None)
        else:
            os.environ[CUDA_BACKEND_ENV] = before
    return {
        "rows": rows,
        "backend": "gloo (CUDA tensors)",
        "tolerance": PARITY_TOLERANCE,
        "ok": all(r["ok"] for r in rows.values()),
    }


def overhead(preset: str, steps: int, rounds: int) -> dict[str, Any]:
    """shardwise at world size 1 on the GPU against plain PyTorch: tokens/s and peak memory."""
    from shardwise.bench.gpu_overhead import WARMUP_STEPS, overhead_worker
    from shardwise.launcher import launch_local

    config = load_config(
        None,
        {
            "device": "cuda",
            "model.preset": preset,
            "steps": str(steps),
            "data.global_batch": "16",
            "model.seq_len": "256",
            "eval_every": "0",
            "hang_timeout_s": "0",
        },
    )
    runs: dict[str, list[dict[str, Any]]] = {"shardwise": [], "torch": []}
    for r in range(rounds):
        for side in ("shardwise", "torch") if r % 2 == 0 else ("torch", "shardwise"):
            runs[side].append(launch_local(overhead_worker, (side, config), 1)[0])
    out: dict[str, Any] = {"preset": preset, "steps": steps, "warmup_steps": WARMUP_STEPS, "rounds": rounds}
    for side, rows in runs.items():
        out[side] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "max_memory_allocated_mb": statistics.median(r["max_memory_allocated_mb"] for r in rows),
            "max_memory_reserved_mb": statistics.median(r["max_memory_reserved_mb"] for r in rows),
            "host_ms": {p: statistics.median(r["host_ms"][p] for r in rows) for p in rows[0]["host_ms"]},
            "runs": rows,
        }
    out["speed_ratio"] = out["shardwise"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
    memory = "max_memory_allocated_mb"
    out["memory_ratio"] = out["shardwise"][memory] / out["torch"][memory]
    out["goal"] = {"speed_ratio": ">= 0.97", "memory_ratio": "<= 1.05"}
    return out


def _render(results: dict[str, Any]) -> None:
    for part, result in results.items():
        if part == "overhead":
            print(
                f"overhead on {result['device']}: shardwise / torch tokens/s {result['speed_ratio']:.3f} "
                f"(goal >= 0.97), peak allocated {result['memory_ratio']:.3f} (goal <= 1.05)"
            )
            ours, theirs = result["shardwise"]["host_ms"], result["torch"]["host_ms"]
            phases = ", ".join(f"{p} {ours[p]:.2f} / {theirs[p]:.2f}" for p in ours if p in theirs)
            print(f"  host ms per step, shardwise / torch: {phases}")
            continue
        print(f"{part} on {result['device']}: {'OK' if result['ok'] else 'FAILED'}")
        for name, row in result["rows"].items():
            mark = "" if row["ok"] else f"  <- over ({', '.join(row['failed'])})"
            print(f"  {name:<20} {row['layout']:<22} max param diff {row['max_param_diff']:.2e}{mark}")
