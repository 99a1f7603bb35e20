"""Asynchronous against synchronous parameter server: held-out loss after the same number of samples.

Both runs see the same global batches (each worker its share of each). Synchronous mode makes one
update per global batch; asynchronous mode one per worker share (scaled to a mean gradient, see
ps_async), so it makes ``workers`` times more, noisier and possibly stale updates. The claim checked here
is that the asynchronous run ends within 5% of the synchronous one's held-out loss.
Communication: whatever the parameter server does (run_on_ranks, one server, ``workers`` workers).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.collectives.api import Comm
from shardwise.config import OptimizerConfig, PSConfig
from shardwise.data_parallel.compare import drive_ps, markov_batches, tiny_model
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.testing.harness import run_on_ranks
from shardwise.train.engine import loss_sum
from shardwise.train.optim import optimizer_factory


def _train_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    model = tiny_model(spec["vocab"], spec["dim"])
    config = PSConfig(servers=1, mode=spec["mode"], max_staleness=spec["max_staleness"])
    optim = OptimizerConfig(name="adamw", lr=spec["lr"])
    engine = ParamServerEngine(model, Comm(), optimizer_factory(optim), config, spec["steps"])
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
