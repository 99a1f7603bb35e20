"""Benchmark: our all-reduce DP against torch's DistributedDataParallel on the same job.

Each measurement is a fresh launch of N ranks running one implementation, so each process's peak RSS
belongs to one implementation alone. Launches alternate (ours, torch, torch, ours, ...) to spread the
machine's drift over both; per launch we take the median step time after warm-up (the slowest rank's),
and across launches the median. Same model, data, optimizer, bucket size and global batch.

Ours runs with the hang watchdog's thread publishing every second, as in training (and every
collective numbered by the monitor, always on); ``watchdog=True`` adds our DDP without the watchdog
thread, interleaved the same way, for the watchdog's cost (``watchdog_speed_ratio``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from shardwise.config import TrainConfig, load_config
from shardwise.device import HOST, to_device
from shardwise.launcher import init_distributed, launch_local
from shardwise.observe.watchdog import Watchdog
from shardwise.preflight import preflight

WARMUP_STEPS = 3


def _bench_config(preset: str, global_batch: int, bucket_mb: float, steps: int) -> TrainConfig:
    return load_config(
        None,
        {
            "model.preset": preset,
            "data.global_batch": global_batch,
            "ddp.bucket_mb": bucket_mb,
            "steps": steps,
        },
    )


def bench_worker(impl: str, config: TrainConfig) -> dict[str, Any]:
    """Run ``config.steps`` steps of one implementation; return median step time and peak RSS."""
    import torch.distributed as dist

    from shardwise.device import joined_device, memory_mb

    init_distributed(config.timeout_s, config.device)
    watchdog = None
    if impl == "shardwise":  # as in training: the hang watchdog watches
        store = dist.distributed_c10d._get_default_store()
        watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s=-1).start()
    try:
        step_fn = _torch_ddp(config) if impl == "torch" else _ours(config)
        times = []
        for step in range(config.steps):
            start = time.perf_counter()
            step_fn(step)
            times.append(time.perf_counter() - start)
        memory = memory_mb(joined_device(config.device))  # a GPU's allocator peak, or peak RSS
        figures = [statistics.median(times[WARMUP_STEPS:]), memory["peak_mb"], memory["peak_rss_mb"]]
        mine = torch.tensor(figures, dtype=torch.float64, device=HOST)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return {
            "step_s": max(float(t[0]) for t in everyone),
            "peak_memory_mb": max(float(t[1]) for t in everyone),
            "peak_rss_mb": max(float(t[2]) for t in everyone),
            "memory": "max_memory_allocated" if "max_memory_allocated_mb" in memory else "rss",
        }
    finally:
        if watchdog is not None:
            watchdog.stop()
        dist.destroy_process_group()


def _setup(config: TrainConfig) -> tuple[torch.nn.Module, Any, int]:
    import torch.distributed as dist

    from shardwise.data.corpus import load_corpus
    from shardwise.data.sampler import DataSampler, split_counts
    from shardwise.device import joined_device
    from shardwise.models import build_model
    from shardwise.train.loop import seed_everything

    config = config.validate(dist.get_world_size())
    seed_everything(config.seed)
    model = build_model(config.model).to(joined_device(config.device))
    counts = split_counts(config.data.global_batch, [1.0] * dist.get_world_size())
    corpus = load_corpus(config.data.corpus_bytes)
    sampler = DataSampler(
        corpus.train, config.model.seq_len, config.data.global_batch, config.seed, counts, dist.get_rank()
    )
    return model, sampler, config.data.global_batch * config.model.seq_len


def _ours(config: TrainConfig) -> Any:
    from shardwise.collectives.api import Comm
    from shardwise.data_parallel.ddp import DDPEngine
    from shardwise.engine.optim import attach_optimizers, optimizer_factory

    model, sampler, tokens = _setup(config)
    engine = attach_optimizers(DDPEngine(model, Comm(), config.ddp), optimizer_factory(config.optim))

    def step(i: int) -> None:
        engine.forward_backward([sampler.local_batch(i)], tokens)
        engine.optimizer_step()

    return step


def _torch_ddp(config: TrainConfig) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    from shardwise.engine.loss import loss_sum
    from shardwise.engine.optim import build_optimizer, named

    model, sampler, _ = _setup(config)
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=config.ddp.bucket_mb)
    optimizer = build_optimizer(named(ddp), config.optim)

    def step(i: int) -> None:
        inputs, targets = to_device(sampler.local_batch(i), device)
        loss = loss_sum(ddp(inputs), targets) / targets.numel()  # local mean; DDP averages over ranks
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def run_ddp_bench(
    nproc: int = 2,
    steps: int = 20,
    rounds: int = 3,
    preset: str = "base",
    global_batch: int = 8,
    bucket_mb: float = 25.0,
    watchdog: bool = False,
) -> dict[str, Any]:
    config = _bench_config(preset, global_batch, bucket_mb, steps)
    preflight(config, nproc, writes_run_files=False)  # before any rank starts, as `shardwise train`
    impls = ["shardwise", "torch"] + (["shardwise-no-watchdog"] if watchdog else [])
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
    for r in range(rounds):
        for impl in impls if r % 2 == 0 else reversed(impls):
            runs[impl].append(launch_local(bench_worker, (impl, config), nproc)[0])
    tokens = global_batch * config.model.seq_len
    result: dict[str, Any] = {
        "nproc": nproc,
        "preset": preset,
        "global_batch": global_batch,
        "bucket_mb": bucket_mb,
        "steps": steps,
        "rounds": rounds,
    }
    for impl, rows in runs.items():
        step_s = statistics.median(row["step_s"] for row in rows)
        result[impl] = {
            "tokens_per_s": tokens / step_s,
            "step_s": step_s,
            "peak_rss_mb": statistics.median(row["peak_rss_mb"] for row in rows),
            "peak_memory_mb": statistics.median(row["peak_memory_mb"] for row in rows),
            "memory": rows[0]["memory"],
            "runs": rows,
        }
    result["speed_ratio"] = result["shardwise"]["tokens_per_s"] / result["torch"]["tokens_per_s"]
    result["memory_ratio"] = result["shardwise"]["peak_memory_mb"] / result["torch"]["peak_memory_mb"]
    if watchdog:
        without = result["shardwise-no-watchdog"]["tokens_per_s"]
        result["watchdog_speed_ratio"] = result["shardwise"]["tokens_per_s"] / without
    return result


def render_ddp(result: dict[str, Any]) -> None:
    print(
        f"all-reduce DP on {result['nproc']} ranks, preset {result['preset']}, batch {result['global_batch']}"
    )
    for impl in [k for k in ("shardwise", "torch", "shardwise-no-watchdog") if k in result]:
        row = result[impl]
        print(
            f"  {impl:9s} {row['tokens_per_s']:>10,.0f} tokens/s  {row['step_s'] * 1e3:8.1f} ms/step  "
            f"peak {'GPU' if row['memory'] != 'rss' else 'RSS'} {row['peak_memory_mb']:.0f} MB"
        )
    print(f"  speed ratio {result['speed_ratio']:.3f}   memory ratio {result['memory_ratio']:.3f}")
    if "watchdog_speed_ratio" in result:
        print(f"  with the hang watchdog / without: {result['watchdog_speed_ratio']:.3f}")
