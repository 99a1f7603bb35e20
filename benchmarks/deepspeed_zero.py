"""Benchmark shardwise's ZeRO stages 1-3 against DeepSpeed's same stages, on the CPU (gloo).

DeepSpeed is NOT a dependency of shardwise, and nothing in the package or the tests imports this
script. Run it from the repository root in a throwaway virtual environment:

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/dsvenv/bin/pip install einops hjson msgpack ninja numpy packaging psutil py-cpuinfo \
        pydantic tqdm wheel
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install --no-build-isolation --no-deps deepspeed==0.19.8
    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONPATH=src /tmp/dsvenv/bin/python benchmarks/deepspeed_zero.py

Both sides train the same ``BenchGPT`` (shardwise.bench.zero) on the same data, fp32, with
``torch.optim.AdamW(lr=1e-4, foreach=False)`` (a client optimizer for DeepSpeed, not its fused CPU
Adam), the same micro-batch and number of steps, on 2 gloo ranks (``run_on_ranks``). Ours and
DeepSpeed's runs alternate, each a fresh spawn, so peak RSS (``ru_maxrss``) belongs to that run; each
figure is the median over repeats; a step takes as long as its slowest rank. DeepSpeed averages
gradients over ranks, so its loss is the sum of token losses over the LOCAL tokens: the same update as
ours (global-token normalisation, summed gradients). Gradient bucket sizes match ours (``bucket_mb``);
stage 3 keeps DeepSpeed's defaults otherwise (prefetch bucket, parameter persistence threshold).
Prints JSON and writes benchmarks/results/zero-deepspeed.json. Timings on a shared machine are noisy:
the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from shardwise.bench.zero import BenchGPT, _bench_rank, _return_freed_memory, _summarize
from shardwise.engine.loss import loss_sum
from shardwise.testing.harness import run_on_ranks

SHAPE = {"vocab": 8192, "dim": 384, "layers": 6, "seq_len": 64, "batch": 4}  # as `shardwise bench zero`
LR = 1e-4


def ds_config(stage: int, batch: int, bucket_mb: float) -> dict[str, Any]:
    """DeepSpeed's configuration for ``stage``: fp32, no clipping, buckets of ``bucket_mb`` (in elements)."""
    bucket = int(bucket_mb * 2**20 / 4)
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
        "steps_per_print": 10**9,
    }


def _ds_rank(rank: int, world_size: int, stage: int, shape: dict, steps: int, bucket_mb: float) -> dict:
    import deepspeed

    from shardwise.zero.memory import peak_rss_bytes

    for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size}.items():
        os.environ[key] = str(value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the process group already exists (FileStore)
    os.environ.setdefault("MASTER_PORT", "29511")
    _return_freed_memory()
    baseline = peak_rss_bytes()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = BenchGPT(shape["vocab"], shape["dim"], shape["layers"], shape["seq_len"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    config = ds_config(stage, shape["batch"], bucket_mb)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    gen = torch.Generator().manual_seed(rank)
    data = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq_len"] + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:]
    times, losses = [], []
    for _ in range(steps + 1):  # the first step (allocation, state creation) is not timed
        start = time.perf_counter()
        loss = loss_sum(engine(x), y) / y.numel()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    out = {"step_s": statistics.median(times[1:]), "peak_rss": peak_rss_bytes(), "baseline_rss": baseline}
    return out | {"losses": losses, "threads": torch.get_num_threads()}


def run(steps: int, repeats: int, stages: tuple[int, ...], nproc: int, bucket_mb: float) -> dict:
    import deepspeed

    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    runs: dict[tuple[int, str], list[list[dict]]] = {}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for stage in stages:
            ours = run_on_ranks(_bench_rank, nproc, "ours", stage, SHAPE, steps, bucket_mb, timeout_s=600)
            runs.setdefault((stage, "ours"), []).append(ours)
            theirs = run_on_ranks(_ds_rank, nproc, stage, SHAPE, steps, bucket_mb, timeout_s=600, env=env)
            runs.setdefault((stage, "deepspeed"), []).append(theirs)
    tokens = SHAPE["batch"] * SHAPE["seq_len"] * nproc
    report: dict[str, Any] = {"nproc": nproc, "steps": steps, "repeats": repeats, "shape": SHAPE}
    report.update(bucket_mb=bucket_mb, deepspeed=deepspeed.__version__, torch=torch.__version__)
    report["load_avg_1m"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    report["stages"] = {}
    for stage in stages:
        entry: dict[str, Any] = {"deepspeed_config": ds_config(stage, SHAPE["batch"], bucket_mb)}
        for impl in ("ours", "deepspeed"):
            entry[impl] = _summarize(runs[(stage, impl)], tokens)
        ours, theirs = entry["ours"], entry["deepspeed"]
        entry["speed_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        entry["memory_ratio"] = max(ours["peak_rss_per_rank"]) / max(theirs["peak_rss_per_rank"])
        entry["deepspeed_losses_rank0"] = runs[(stage, "deepspeed")][0][0]["losses"]  # training happened
        entry["deepspeed_threads"] = runs[(stage, "deepspeed")][0][0]["threads"]
        report["stages"][f"zero{stage}"] = entry
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--out", default="benchmarks/results/zero-deepspeed.json")
    args = parser.parse_args()
    report = run(args.steps, args.repeats, tuple(args.stages), args.nproc, args.bucket_mb)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
