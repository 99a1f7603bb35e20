"""``shardwise plan --check``: each layout run here, on N local ranks, beside the planner's prediction.

For each layout, one launch of N ranks (gloo on CPU; loopback): every rank first measures, all ranks
at once so that the contention is the training's own, its FLOP/s on the model's own forward and
backward (one micro-batch, no strategy) and its memory bandwidth (a large in-place add); then builds
the trainer and runs two steps under ``TensorBytes`` (a dispatch mode counting live floating-point
storages: tensor bytes, not RSS) for the peak; then builds it again and times ``steps`` steps without
the counter (the median after the first, the slowest rank's, as ``Trainer.step`` reports it). The
prediction
(:mod:`shardwise.planner`) uses those two rates, the collectives' profile that ``shardwise bench comm``
saved (or ``--comm-profile``; else the built-in default, said so), gloo's forms of ZeRO's collectives,
and no overhead. The layouts (``check_layouts``): each strategy with and without activation
checkpointing, then on tp = 2 when the ranks are even. With more ranks than cores a rank's time is
its share of a core, not the layout's: such a row gives memory alone and says why.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from shardwise.collectives.api import load_profile
from shardwise.collectives.cost import CostProfile
from shardwise.config import TrainConfig
from shardwise.launcher import init_distributed, launch_local
from shardwise.planner.calibration import Calibration
from shardwise.planner.memory import Layout, Training, estimate_memory
from shardwise.planner.model import ModelShape
from shardwise.planner.time import step_time
from shardwise.testing.memory import TensorBytes

MEMORY_STEPS = 2


def _median_seconds(fn: Any, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_rates(config: TrainConfig, model: ModelShape, tokens_per_rank: int) -> tuple[float, float]:
    """(FLOP/s, memory bytes/s) of this process now. FLOP/s: forward and backward of the model itself
    on one micro-batch, in one process, no strategy (so norms, activations functions and the
    framework's own time are in the rate, as the planner's FLOP count is not); memory: an in-place
    add over 16M floats (reads two, writes one)."""
    from shardwise.engine.loss import loss_sum
    from shardwise.models import build_model
    from shardwise.planner.time import flops_per_token

    net = build_model(config.model)
    batch = max(1, tokens_per_rank // config.model.seq_len)
    tokens = torch.randint(0, model.vocab, (batch, config.model.seq_len + 1))
    mixed = config.precision != "fp32"

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = loss_sum(net(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

    flops = flops_per_token(model, config.model.seq_len) * batch * config.model.seq_len
    rate = flops / _median_seconds(step, repeats=3)
    x, y = torch.zeros(1 << 24), torch.ones(1 << 24)
    bandwidth = 3 * x.numel() * 4 / _median_seconds(lambda: x.add_(y))
    return rate, bandwidth


def check_worker(config: TrainConfig, model: ModelShape, steps: int) -> dict[str, float]:
    """On one rank: rates, peak tensor bytes, and step time (see the module docstring)."""
    import torch.distributed as dist

    from shardwise.train.loop import Trainer

    init_distributed(config.timeout_s)
    try:
        # a data-parallel rank's sequences: tp ranks share theirs (the rate is taken at that batch)
        dp = dist.get_world_size() // (config.parallel.tp * config.parallel.pp)
        share = config.data.global_batch // dp // config.data.micro_batches
        flops, bandwidth = measure_rates(config, model, share * config.model.seq_len)
        with TensorBytes() as counted:
            trainer = Trainer.build(config)
            for step in range(MEMORY_STEPS):
                trainer.step(step)
        trainer.engine.close()
        del trainer
        trainer = Trainer.build(config)
        times = [trainer.step(step).step_s for step in range(steps)]
        trainer.engine.close()
        mine = torch.tensor([counted.peak, flops, bandwidth], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return {
            "peak_bytes": max(float(t[0]) for t in everyone),
            "flops_per_s": min(float(t[1]) for t in everyone),  # the slowest rank sets the pace
            "memory_bytes_per_s": min(float(t[2]) for t in everyone),
            "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        }
    finally:
        dist.destroy_process_group()


def time_note(ranks: int, cores: int) -> str:
    """Why a measured step time says nothing about the layout ("" when it does): ranks share cores."""
    return f"time not meaningful: {ranks} ranks on {cores} cores" if ranks > cores else ""


def check_layouts(model: ModelShape, strategies: list[str], nproc: int, tp: bool = True) -> list[Layout]:
    """What ``--check`` runs on ``nproc`` ranks: each strategy with and without activation
    checkpointing on dp = nproc, then (``tp``, when nproc is even and the heads divide) each on tp = 2
    with the strategy over dp = nproc / 2 (without checkpointing: with tp it is not built yet)."""
    meshes = [(nproc, 1)]
    if tp and nproc % 2 == 0 and model.n_head % 2 == 0 and model.kv_heads % 2 == 0:
        meshes.append((nproc // 2, 2))
    return [
        Layout(strategy, dp=dp, tp=degree, activation_checkpointing=ckpt)
        for dp, degree in meshes
        for strategy in strategies
        for ckpt in ((False, True) if degree == 1 else (False,))
    ]


def layout_overrides(layout: Layout) -> dict[str, str]:
    """The config overrides that run ``layout`` (its mesh, strategy and checkpointing)."""
    return {
        "strategy": layout.strategy,
        "parallel.dp": str(layout.dp),
        "parallel.tp": str(layout.tp),
        "parallel.activation_checkpointing": str(layout.activation_checkpointing).lower(),
        "parallel.sequence_parallel": str(layout.sequence_parallel).lower(),
    }


def check_layout(
    model: ModelShape, training: Training, layout: Layout, config: TrainConfig, steps: int
) -> dict[str, Any]:
    """Run ``config`` (the layout's) on ``layout.devices`` local ranks; predicted beside measured.

    With more ranks than cores the ranks take turns on a core, so a step's time says nothing about
    the layout: the row gives the memory ratio alone (``time_ratio`` None) and says why."""
    ranks = layout.devices
    measured = launch_local(check_worker, (config, model, steps), ranks)[0]
    calibration = Calibration(
        flops_per_s=measured["flops_per_s"],
        memory_bytes_per_s=measured["memory_bytes_per_s"],
        source="measured on the ranks",
    )
    profile = load_profile(config.comm.profile) or CostProfile()
    memory = estimate_memory(model, training, layout, calibration)
    time_ = step_time(model, training, layout, profile, calibration, "native", gloo=True)
    note = time_note(ranks, os.cpu_count() or 1)
    return {
        "layout": layout.name(),
        "strategy": layout.strategy,
        "dp": layout.dp,
        "tp": layout.tp,
        "activation_checkpointing": layout.activation_checkpointing,
        "predicted_bytes": memory.total,
        "measured_bytes": measured["peak_bytes"],
        "memory_ratio": memory.total / measured["peak_bytes"],
        "predicted_step_s": time_.total_s,
        "measured_step_s": measured["step_s"],
        "time_ratio": None if note else time_.total_s / measured["step_s"],
        "time_note": note,
        "flops_per_s": measured["flops_per_s"],
        "memory_bytes_per_s": measured["memory_bytes_per_s"],
        "comm_profile": profile.source,
    }
