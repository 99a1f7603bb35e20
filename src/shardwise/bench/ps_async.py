"""Asynchronous against synchronous parameter server: held-out loss after the same number of samples.

Two forms: ``compare_async_sync`` trains a tiny model on a Markov chain inside one ``run_on_ranks`` call
(fast, for tests); ``bench_async_vs_sync`` runs the real ``shardwise train --strategy ps`` job for several
seeds in each mode (``shardwise bench ps-async``).

Both runs see the same global batches (each worker its share of each). Synchronous mode makes one
update per global batch; asynchronous mode one per worker share (scaled to a mean gradient, see
ps_async), so it makes ``workers`` times more, noisier and possibly stale updates. The claim checked here
is that the asynchronous run ends within 5% of the synchronous one's held-out loss.
Communication: whatever the parameter server does (run_on_ranks, one server, ``workers`` workers).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import torch

from shardwise.bench.dp_compare import drive_ps, markov_batches, tiny_model
from shardwise.collectives.api import Comm
from shardwise.config import OptimizerConfig, PSConfig, TrainConfig
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import attach_optimizers, optimizer_factory
from shardwise.preflight import preflight
from shardwise.testing.harness import run_on_ranks


def _train_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    model = tiny_model(spec["vocab"], spec["dim"])
    config = PSConfig(servers=1, mode=spec["mode"], max_staleness=spec["max_staleness"])
    optim = OptimizerConfig(name="adamw", lr=spec["lr"])
    engine = ParamServerEngine(model, Comm(), config, spec["steps"])
    attach_optimizers(engine, optimizer_factory(optim))
    batches = markov_batches(spec["vocab"], spec["batch"], spec["seq_len"], spec["steps"], seed=7)
    drive_ps(engine, batches, rank, world_size)
    if rank != 0:
        return {}
    return {
        "heldout_loss": heldout_loss(model, spec),
        "updates": engine.version,
        "max_staleness_seen": engine.max_staleness_seen,
        "rejected": engine.rejected,
    }


def heldout_loss(model: torch.nn.Module, spec: dict[str, Any]) -> float:
    """Mean token loss on 4 batches the training never sees (another seed of the same chain)."""
    held_out = markov_batches(spec["vocab"], spec["batch"], spec["seq_len"], 4, seed=99)
    with torch.no_grad():
        losses = [float(loss_sum(model(x), y)) / y.numel() for x, y in held_out]
    return sum(losses) / len(losses)


def compare_async_sync(
    workers: int = 2,
    steps: int = 60,
    global_batch: int = 16,
    seq_len: int = 16,
    vocab: int = 32,
    dim: int = 32,
    lr: float = 1e-2,
    max_staleness: int = 4,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Train sync and async on the same samples; report both held-out losses and their relative gap."""
    spec = {"steps": steps, "batch": global_batch, "seq_len": seq_len, "vocab": vocab, "dim": dim, "lr": lr,
            "max_staleness": max_staleness}  # fmt: skip
    runs = {}
    for mode in ("sync", "async"):
        runs[mode] = run_on_ranks(_train_rank, workers + 1, {**spec, "mode": mode}, timeout_s=timeout_s)[0]
    sync, asyn = runs["sync"]["heldout_loss"], runs["async"]["heldout_loss"]
    gap = abs(asyn - sync) / sync
    return {
        "samples": steps * global_batch,
        "workers": workers,
        "initial_heldout_loss": heldout_loss(tiny_model(vocab, dim), spec),
        "sync": runs["sync"],
        "async": runs["async"],
        "relative_gap": gap,
        "within_5_percent": gap <= 0.05,
    }


# -- the same comparison on the real job: `shardwise bench ps-async` ------------------------------------

MODES = {  # label -> (ps.mode, ps.staleness_lr)
    "sync": ("sync", True),
    "async": ("async", True),
    "async_constant_lr": ("async", False),
}


def _train_summary(config: TrainConfig, nproc: int) -> dict[str, Any]:
    from shardwise.launcher import launch_local
    from shardwise.train.loop import train_worker

    results = launch_local(train_worker, (config, False), nproc, 0)
    return next(r for r in results.values() if r is not None)


def bench_async_vs_sync(
    nproc: int = 3,
    steps: int = 150,
    seeds: int = 3,
    preset: str = "small",
    run_dir: str = "runs/bench-ps-async",
) -> dict[str, Any]:
    """``shardwise train --strategy ps`` in each of ``MODES`` for ``seeds`` seeds; held-out losses.

    The runs take turns (seed 0: sync, async, async_constant_lr; seed 1: ...), each a fresh launch of
    ``nproc`` ranks (one server). On the same seed every mode sees the same samples. Held-out loss varies
    by several percent from seed to seed at this length even in synchronous mode, so the verdict compares
    the means over seeds, and the per-seed pairs are reported beside them.
    """
    default = TrainConfig()
    base = replace(default, strategy="ps", steps=steps, model=replace(default.model, preset=preset))
    losses: dict[str, list[float]] = {label: [] for label in MODES}
    staleness: dict[str, list[int]] = {label: [] for label in MODES}
    for seed in range(seeds):
        for label, (mode, staleness_lr) in MODES.items():
            ps = replace(base.ps, mode=mode, staleness_lr=staleness_lr)
            # the checks `shardwise train` makes before any rank starts, the run folder tried too
            config = preflight(replace(base, seed=seed, ps=ps, run_dir=f"{run_dir}/{label}-{seed}"), nproc)
            summary = _train_summary(config, nproc)
            losses[label].append(summary["eval_loss"])
            staleness[label].append(summary.get("max_staleness_seen", 0))
    means = {label: statistics.fmean(values) for label, values in losses.items()}
    gaps = {label: (means[label] - means["sync"]) / means["sync"] for label in MODES if label != "sync"}
    return {
        "nproc": nproc,
        "workers": nproc - 1,
        "steps": steps,
        "samples": steps * base.data.global_batch,
        "preset": preset,
        "optimizer": base.optim.name,
        "seeds": seeds,
        "heldout_loss": losses,
        "heldout_loss_mean": means,
        "heldout_loss_sd": {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in losses.items()},
        "max_staleness_seen": staleness,
        "relative_gap_vs_sync": gaps,
        "async_within_5_percent": abs(gaps["async"]) <= 0.05,
    }


def render_ps_async(result: dict[str, Any]) -> None:
    print(
        f"parameter server, {result['workers']} workers, {result['steps']} steps "
        f"({result['samples']} samples), {result['preset']} GPT, {result['optimizer']}; "
        f"held-out loss over {result['seeds']} seeds"
    )
    for label, values in result["heldout_loss"].items():
        gap = result["relative_gap_vs_sync"].get(label)
        tail = f"  ({gap:+.1%} vs sync)" if gap is not None else ""
        mean, sd = result["heldout_loss_mean"][label], result["heldout_loss_sd"][label]
        print(f"  {label:>18}: {mean:.3f} +- {sd:.3f}  [{', '.join(f'{v:.3f}' for v in values)}]{tail}")
    print(f"async within 5% of sync: {result['async_within_5_percent']}")
