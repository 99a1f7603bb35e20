"""``shardwise plan --check``: each layout run here, on N local ranks, beside the planner's prediction.

For each layout, one launch of N ranks (gloo on CPU; loopback): every rank first runs the calibration's
probes, all ranks at once so that the contention is the training's own, each with a training rank's
thread count: the model's own forward and backward on a data-parallel rank's micro-batch (no strategy),
the same with each block checkpointed, and a large in-place add (memory bandwidth), three interleaved
repeats; then it builds the trainer and runs two steps under ``TensorBytes`` (a dispatch mode counting
live floating-point storages: tensor bytes, not RSS) for the peak, the build's own peak counted apart
(``Trainer.build``: the model made on meta, ``parallelize`` reading each rank's part) beside the
planner's ``model_build``; then builds it again and times
``steps`` steps without the counter (each the slowest rank's, as ``Trainer.step`` reports it), with the
bytes each rank sent. The probes' samples of every launch are pooled into one calibration for the whole
check (``calibration_from``: each rate's best repeat), so no row is predicted from its own launch alone
and none from a step timing (the issue's rule: calibrations measured separately, never fitted on the
layout being checked). The prediction (:mod:`shardwise.planner`) uses that calibration, the
collectives' profile that ``shardwise bench comm`` saved (or ``--comm-profile``; else the built-in
default, said so), gloo's forms of ZeRO's collectives, and no overhead; it is compared with the fastest
timed step (others on a shared machine only add time, as they do to the probes), the median beside it.
The layouts (``check_layouts``): each strategy with and without activation checkpointing, then the same
on tp = 2 and on a 2-stage 1F1B pipeline when the ranks are even. With more ranks than cores a rank's
time is its share of a core, not the layout's: such a row gives memory alone and says why.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.collectives.api import load_profile
from shardwise.collectives.cost import CostProfile
from shardwise.config import TrainConfig
from shardwise.device import HOST, joined_device, memory_mb, reset_peak_memory
from shardwise.launcher import init_distributed, launch_local
from shardwise.planner.calibration import Calibration
from shardwise.planner.layout import Layout, Training
from shardwise.planner.memory import estimate_memory
from shardwise.planner.model import ModelShape
from shardwise.planner.time import step_time
from shardwise.testing.memory import TensorBytes

MEMORY_STEPS = 2
CALIBRATION_REPEATS = 3  # per launch; pooled over the check's launches


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Probe:
    """One timed piece of work of the calibration and its size (FLOPs, or bytes moved)."""

    run: Callable[[], Any]
    work: float


def _model_probe(config: TrainConfig, model: ModelShape, batch: int, checkpointed: bool) -> Probe:
    """The model's own forward and backward on ``batch`` sequences, in one process, no strategy (so
    norms, activation functions and the framework's time are in the rate, as the planner's FLOP count
    is not); ``checkpointed``: each block wrapped as ``apply_activation_checkpointing`` wraps it, so
    the recomputation's real cost (a forward kept off the graph, then replayed beside its backward) is
    measured on the model's own blocks rather than assumed."""
    from shardwise.activation_checkpointing import checkpoint_forward
    from shardwise.engine.loss import loss_sum
    from shardwise.models import build_model
    from shardwise.models.adapters import adapter_for
    from shardwise.planner.time import flops_per_token

    net = build_model(config.model)
    if checkpointed:
        found = adapter_for(net).block_list(config.zero.unit)
        for block in found.blocks if found else []:
            checkpoint_forward(block)
    tokens = torch.randint(0, model.vocab, (batch, config.model.seq_len + 1), device=HOST)  # CPU probes
    mixed = config.precision != "fp32"

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = loss_sum(net(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

    per_token = flops_per_token(model, config.model.seq_len, recompute=checkpointed)
    return Probe(run, per_token * batch * config.model.seq_len)


def _probes(config: TrainConfig, model: ModelShape, batch: int) -> list[Probe]:
    """The calibration's probes, in the order of ``Calibration``'s rates: the model's training compute,
    the same with activation checkpointing, and an in-place add over 16M floats (reads two, writes one)
    for memory bandwidth."""
    x, y = torch.zeros(1 << 24, device=HOST), torch.ones(1 << 24, device=HOST)
    return [
        _model_probe(config, model, batch, checkpointed=False),
        _model_probe(config, model, batch, checkpointed=True),
        Probe(lambda: x.add_(y), 3 * x.numel() * 4.0),
    ]


def measure_rates(config: TrainConfig, model: ModelShape, repeats: int) -> list[list[float]]:
    """On one rank of a launch: ``repeats`` interleaved samples of each probe's rate (``_probes``),
    every rank measuring at once (a barrier before each probe) so that the ranks contend for the cores
    and memory as training's ranks do, each with the thread count a training rank gets (the
    launcher's), on a data-parallel rank's micro-batch at dp = all ranks (the same probe in every
    launch, whatever its layout). Returns, per repeat, the slowest rank's rates (the slowest rank sets
    a step's pace)."""
    import torch.distributed as dist

    batch = max(1, config.data.global_batch // dist.get_world_size())  # whatever the layout's micro-batches
    probes = _probes(config, model, batch)
    for probe in probes:  # warm-up: first-touch allocation, lazy initialisation
        probe.run()
    mine = torch.zeros(repeats, len(probes), dtype=torch.float64, device=HOST)
    for i in range(repeats):
        for j, probe in enumerate(probes):
            dist.barrier()
            mine[i, j] = probe.work / _seconds(probe.run)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    slowest = torch.stack(everyone).amin(dim=0)
    return [[float(v) for v in row] for row in slowest]


RATES = ("flops_per_s", "checkpointed_flops_per_s", "memory_bytes_per_s")  # the probes' order


def calibration_from(samples: list[list[float]]) -> tuple[Calibration, dict[str, Any]]:
    """The rates the prediction uses and a summary of their spread. Each rate is its best repeat's:
    the other users of a shared machine only ever slow a probe down, so the fastest of several is the
    least disturbed estimate of the machine's own rate (the measured step time is taken the same way,
    see ``compare``); the median and the slowest are reported beside it."""
    spread: dict[str, Any] = {"repeats": len(samples), "samples": samples}
    for j, name in enumerate(RATES):
        rates = sorted(sample[j] for sample in samples)
        spread[name] = {"best": rates[-1], "median": statistics.median(rates), "slowest": rates[0]}
    calibration = Calibration(
        **{name: spread[name]["best"] for name in RATES},
        source=f"measured once on the ranks, best of {len(samples)} interleaved repeats",
    )
    return calibration, spread


def check_worker(config: TrainConfig, model: ModelShape, steps: int, timed: bool = True) -> dict[str, Any]:
    """On one rank: first the calibration's probes (``measure_rates``: samples of the machine's rates
    now, pooled over the whole check, never used for this layout alone); then peak tensor bytes over
    ``MEMORY_STEPS`` steps under ``TensorBytes`` (a dispatch mode counting live floating-point
    storages: tensor bytes, not RSS); then, built again without the counter, ``steps`` timed steps
    (each the slowest rank's, as ``Trainer.step`` reports it) with the bytes each rank sent and the
    time it was blocked on communication. Not ``timed`` (more ranks than cores: a time would say
    nothing): no probes and no timed steps, the memory alone, and the bytes the counted steps sent."""
    import torch.distributed as dist

    from shardwise.train.loop import Trainer

    init_distributed(config.timeout_s, config.device)
    try:
        rates = measure_rates(config, model, CALIBRATION_REPEATS) if timed else []
        reset_peak_memory(joined_device(config.device))  # a GPU's peaks: the counted steps' own
        with TensorBytes() as counted:
            with TensorBytes() as built:  # parallelize: the model made on meta, each rank's part read
                trainer = Trainer.build(config)
            records = [trainer.step(step) for step in range(MEMORY_STEPS)]
        device_memory = memory_mb(trainer.engine.device)  # the allocator's peaks on a GPU, RSS here
        trainer.engine.close()
        del trainer
        if timed:
            trainer = Trainer.build(config)
            records = [trainer.step(step) for step in range(steps)]
            trainer.engine.close()
        keys = sorted(k for k in device_memory if k != "rss_mb")
        figures = [counted.peak, built.peak, *(device_memory[k] for k in keys)]
        mine = torch.tensor(figures, dtype=torch.float64, device=HOST)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        kept = records[1:] if len(records) > 1 else records  # the first step warms up
        return {
            "rates": rates,
            "peak_bytes": max(float(t[0]) for t in everyone),
            "build_bytes": max(float(t[1]) for t in everyone),
            # the largest rank's: max_memory_allocated/reserved on a GPU, peak RSS on the CPU
            "memory_mb": {k: max(float(t[2 + i]) for t in everyone) for i, k in enumerate(keys)},
            "step_s": [r.step_s for r in kept] if timed else [],
            "comm_s": [r.comm_s for r in kept] if timed else [],
            "bytes_sent": max(float(b) for b in kept[-1].bytes_sent),
        }
    finally:
        dist.destroy_process_group()


def time_note(ranks: int, cores: int) -> str:
    """Why a measured step time says nothing about the layout ("" when it does): ranks share cores."""
    return f"time not meaningful: {ranks} ranks on {cores} cores" if ranks > cores else ""


PP_MICRO_BATCHES = 4  # --check's pipeline layouts: 1F1B over this many micro-batches


def check_layouts(
    model: ModelShape, strategies: list[str], nproc: int, tp: bool = True, pp: bool = True
) -> list[Layout]:
    """What ``--check`` runs on ``nproc`` ranks: each strategy with and without activation
    checkpointing on dp = nproc; then, when nproc is even, the same on tp = 2 (``tp``, where the heads
    divide) and on a 1F1B pipeline of 2 stages over ``PP_MICRO_BATCHES`` micro-batches (``pp``, where
    the model has 2 blocks or more), each with the strategy over dp = nproc / 2."""
    meshes = [(nproc, 1, 1)]
    if tp and nproc % 2 == 0 and model.n_head % 2 == 0 and model.kv_heads % 2 == 0:
        meshes.append((nproc // 2, 1, 2))
    if pp and nproc % 2 == 0 and model.n_layer >= 2:
        meshes.append((nproc // 2, 2, 1))
    return [
        Layout(
            strategy,
            dp=dp,
            pp=stages,
            tp=degree,
            micro_batches=PP_MICRO_BATCHES if stages > 1 else 1,
            activation_checkpointing=ckpt,
        )
        for dp, stages, degree in meshes
        for strategy in strategies
        for ckpt in (False, True)
    ]


def layout_overrides(layout: Layout) -> dict[str, str]:
    """The config overrides that run ``layout`` (its mesh, strategy, micro-batches, schedule and
    checkpointing)."""
    return {
        "strategy": layout.strategy,
        "parallel.dp": str(layout.dp),
        "parallel.pp": str(layout.pp),
        "parallel.tp": str(layout.tp),
        "parallel.schedule": layout.schedule,
        "parallel.virtual_stages": str(layout.virtual_stages),
        "data.micro_batches": str(layout.micro_batches),
        "parallel.activation_checkpointing": str(layout.activation_checkpointing).lower(),
        "parallel.sequence_parallel": str(layout.sequence_parallel).lower(),
    }


def run_check(
    model: ModelShape,
    training: Training,
    layouts: list[Layout],
    config_for: Callable[[Layout, int], TrainConfig],
    steps: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run every layout; then each layout's prediction beside its run, all from one calibration.

    ``config_for(layout, i)``: the config that runs ``layout``, ``i`` a distinct index for its run
    folder. Each launch measures the calibration's probes before it builds anything; the samples of
    all launches are pooled into the one calibration of the whole check (``calibration_from``), so
    the rates span the same spells of load as the steps do, and no row's prediction is made from its
    own launch's rates alone, nor ever from a step timing."""
    runs = []
    for i, layout in enumerate(layouts):
        load = os.getloadavg()[0]
        config = config_for(layout, i)
        timed = not time_note(layout.devices, os.cpu_count() or 1)
        measured = launch_local(check_worker, (config, model, steps, timed), layout.devices)[0]
        runs.append((layout, config, load, measured))
    samples = [s for *_, measured in runs for s in measured["rates"]]
    calibration, spread = calibration_from(samples) if samples else (Calibration(), {"repeats": 0})
    rows = [
        {**compare(model, training, layout, config, measured, calibration), "load_average": load}
        for layout, config, load, measured in runs
    ]
    return rows, spread


def compare(
    model: ModelShape,
    training: Training,
    layout: Layout,
    config: TrainConfig,
    measured: dict[str, Any],
    calibration: Calibration,
) -> dict[str, Any]:
    """One layout's prediction beside its run (``check_worker``'s ``measured``).

    ``calibration``: the check's one calibration, never this layout's timings. The measured step time
    is the fastest timed step (each the slowest rank's), as the calibration takes its best repeat: on
    a shared machine others only add time; the median is reported beside it. With more ranks than
    cores the ranks take turns on a core, so a step's time says nothing about the layout: the row
    gives the memory ratio alone (``time_ratio`` None) and says why."""
    profile = load_profile(config.comm.profile) or CostProfile()
    memory = estimate_memory(model, training, layout, calibration)
    time_ = step_time(model, training, layout, profile, calibration, "native", gloo=True)
    note = time_note(layout.devices, os.cpu_count() or 1)
    steps = measured["step_s"] or [math.nan]  # none timed: more ranks than cores
    best, median = min(steps), statistics.median(steps)
    return {
        "layout": layout.name(),
        "strategy": layout.strategy,
        "dp": layout.dp,
        "pp": layout.pp,
        "tp": layout.tp,
        "micro_batches": layout.micro_batches,
        "schedule": layout.schedule if layout.pp > 1 else None,
        "activation_checkpointing": layout.activation_checkpointing,
        "predicted_bytes": memory.total,
        "measured_bytes": measured["peak_bytes"],
        "memory_ratio": memory.total / measured["peak_bytes"],
        "predicted_build_bytes": memory.device["model_build"],
        "measured_build_bytes": measured["build_bytes"],
        "build_ratio": memory.device["model_build"] / measured["build_bytes"],
        "measured_memory_mb": measured.get("memory_mb"),  # the device's own figures (device.memory_mb)
        "predicted_step_s": None if note else time_.total_s,  # no calibration was measured
        "measured_step_s": None if note else best,
        "measured_step_s_median": None if note else median,
        "measured_steps_s": measured["step_s"],  # every timed step, for whoever doubts the statistic
        "time_ratio": None if note else time_.total_s / best,
        "time_ratio_median": None if note else time_.total_s / median,
        "time_note": note,
        "predicted_parts_s": {
            "forward": time_.forward_s,
            "backward": time_.backward_s,
            "optimizer": time_.optimizer_s,
            "comm": time_.comm_s,
            "exposed_comm": time_.exposed_comm_s,
        },
        "predicted_sent_bytes": time_.sent_bytes,
        "measured_sent_bytes": measured["bytes_sent"],
        "measured_comm_s": min(measured["comm_s"]) if measured["comm_s"] else None,
        "flops_per_s": calibration.flops_per_s,
        "checkpointed_flops_per_s": calibration.checkpointed_flops_per_s,
        "memory_bytes_per_s": calibration.memory_bytes_per_s,
        "comm_profile": profile.source,
    }
