"""The training loop every strategy shares: build, step, evaluate, report.

One step: draw this rank's share of the global batch, then the one step spine
``engine.step.take_step`` (the same ``Engine.train_step`` runs for a hand-written loop: forward,
backward, gradient communication, one tiny all-reduce agreeing whether the loss and gradients are
finite, the update or ``skip_update``), then one tiny all-gather of per-rank figures (see
``metrics``). Rank 0 shows a progress bar, writes ``metrics.jsonl`` and returns the summary. A run
stopped on a non-finite value raises ``NonFiniteStop`` (one line naming the step) on every rank;
``run_training``, the command line's entry, returns it as ``{"error": <one line>}``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from shardwise.collectives.api import Comm
from shardwise.config import ConfigError, TrainConfig, describe_layout, to_dict
from shardwise.data.corpus import load_corpus
from shardwise.data.dataset import DatasetSampler, IterableSampler, MapDataset, check_rows
from shardwise.data.sampler import DataSampler, eval_batches, split_counts
from shardwise.device import Clock, joined_device, memory_mb, to_device
from shardwise.engine.base import Engine
from shardwise.engine.loss import AutoLoss, Loss, TokenLoss, as_loss, rows, run_model
from shardwise.engine.nonfinite import NonFinite, NonFiniteStop
from shardwise.engine.optim import OptimizerFactory, SchedulerFactory, fast_forward
from shardwise.engine.schedule import lr_multiplier
from shardwise.engine.step import take_step
from shardwise.launcher import init_distributed, restart_count
from shardwise.mesh import Mesh, build_mesh
from shardwise.models import apply_freeze, build_model, loss_positions
from shardwise.observe.monitor import MONITOR
from shardwise.parallelism import parallelize
from shardwise.train.checkpointing import (
    TrainCheckpoints,
    agreed_restart_count,
    truncate_metrics,
    write_pid_file,
)
from shardwise.train.metrics import MetricsWriter, StepRecord, gather_step
from shardwise.train.observing import observing
from shardwise.train.progress import Progress


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def torch_dtype(name: str) -> torch.dtype:
    return torch.float64 if name == "float64" else torch.float32


def param_digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over every parameter's name and bytes, in name order: equal digests, equal models."""
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(params[name].detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


class Sampler(Protocol):
    """Where a rank's micro-batches come from: the built-in corpus, or a user's dataset."""

    step: int

    def local_micro_batches(self, step: int, n: int, keep_empty: bool = False) -> list[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def default_loss(config: TrainConfig, user_model: bool) -> Loss:
    """The built-in models' token loss; for a user's model, causal-LM cross-entropy on dict batches
    (labels -100 ignored) and token cross-entropy on (inputs, targets) batches."""
    if user_model:
        return AutoLoss()
    return TokenLoss(positions=loss_positions(config.model.kind))


@dataclass
class Trainer:
    """Everything one rank needs to train: the engine, its data share and the mesh's communicators.

    ``Trainer.build(config)`` trains the built-in model on the built-in corpus; pass ``model``,
    ``dataset`` (map-style, sharded here), ``loss`` (see ``shardwise.engine.loss``), ``collate_fn``,
    ``optimizer`` (a factory of named parameters), ``scheduler`` (a factory of an optimizer's
    ``torch.optim.lr_scheduler``) and ``eval_dataset`` to train your own; instead of ``dataset``,
    ``batches`` is this rank's own iterable of collated batches (one per step; exact averaging
    still holds). ``fit()`` runs the whole loop and returns the summary on the reporting rank.
    """

    config: TrainConfig
    engine: Engine
    sampler: Sampler
    mesh: Mesh
    eval_data: list[Any] | None = None  # fixed held-out batches (None: no evaluation)
    custom_schedule: bool = False  # the user gave a scheduler factory
    history: list[StepRecord] = field(default_factory=list)

    @property
    def world_comm(self) -> Comm:
        """Every rank: checkpoints and agreement on restarts."""
        return self.mesh.world

    @classmethod
    def build(
        cls,
        config: TrainConfig,
        share_gradients: bool = False,
        *,
        model: nn.Module | None = None,
        loss: Loss | Callable[[Any, Any], torch.Tensor] | None = None,
        dataset: MapDataset | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        eval_dataset: MapDataset | None = None,
        batches: Iterable[Any] | None = None,
    ) -> Trainer:
        """Validate against the live world, build the model under the seed, parallelize it.

        ``share_gradients``: make global gradients visible where a strategy keeps them elsewhere
        (the parameter server's workers), for ``verify``.
        """
        _refuse_unused(dataset, batches, collate_fn, eval_dataset)
        # a plain process that did not join a job: a world of one
        init_distributed(config.timeout_s, config.device)
        world = dist.get_world_size()
        config = config.validate(world)
        device = joined_device(config.device)
        mesh = build_mesh(config.dims(world), config.comm, device.type)
        seed_everything(config.seed)
        if model is not None:
            net = apply_freeze(model, config.model.freeze)  # as build_model does for its own models
        else:  # on meta: each rank materialises only what it holds (parallelize)
            net = build_model(config.model, torch_dtype(config.dtype), meta=True)
        chosen = as_loss(loss) if loss is not None else default_loss(config, model is not None)
        engine = parallelize(net, mesh, config, optimizer, share_gradients, loss=chosen, scheduler=scheduler)
        counts = split_counts(config.data.global_batch, config.data.weights or [1.0] * config.parallel.dp)
        rank = max(mesh.dp_rank, 0)
        if batches is not None:  # the user's own per-rank stream: this rank's share, already collated
            sampler: Sampler = IterableSampler(batches)
            held_out = _eval_from(eval_dataset, config, collate_fn)
        elif dataset is not None:
            sampler = DatasetSampler(
                dataset, config.data.global_batch, config.seed, counts, rank, collate_fn
            )
            held_out = _eval_from(eval_dataset, config, collate_fn)
        else:
            corpus = load_corpus(config.data.corpus_bytes)
            sampler = DataSampler(
                corpus.train, config.model.seq_len, config.data.global_batch, config.seed, counts, rank
            )
            held_out = eval_batches(
                corpus.val, config.model.seq_len, max(1, config.data.global_batch), config.eval_batches
            )
        return cls(config, engine, sampler, mesh, held_out, scheduler is not None)

    def _step_comms(self, trainers: Comm) -> list[Comm]:
        """What a step communicates over: the engine's group, every rank that steps (the norm, the
        non-finite agreement) and each further axis of the engine (activations, gradients, replicas)."""
        comms = [self.engine.comm, trainers, *(axis.comm for axis in self.engine.axes)]
        return list({id(c): c for c in comms if c is not None}.values())

    def step(self, step: int, after_backward: Callable[[int], None] | None = None) -> StepRecord:
        """One optimizer step; ``after_backward(step)`` sees the global gradients before the update."""
        # every rank runs the same number of passes, empty ones included (see local_micro_batches)
        MONITOR.set_phase("data", step)
        begun = time.monotonic()
        micro = self.sampler.local_micro_batches(step, self.config.data.micro_batches, keep_empty=True)
        trainers = self.mesh.trainers
        if trainers is None or not self.engine.role.steps:
            raise RuntimeError(f"rank {self.mesh.rank} serves; it does not step")
        step_comms = self._step_comms(trainers)
        before = [c.stats.snapshot() for c in step_comms]
        clock = Clock(self.engine.device).start()  # CUDA events on a GPU: the kernels' time, not launches
        lr = float("nan")

        def before_update() -> None:  # the global gradients, and the rate this step's update uses
            nonlocal lr
            if after_backward is not None:
                after_backward(step)
            lr = self._lr(step)

        result = take_step(self.engine, micro, before_update)
        elapsed = clock.seconds()  # the one wait for the device in a step's bookkeeping
        MONITOR.set_phase("metrics")
        comms = [c.stats.since(b) for c, b in zip(step_comms, before, strict=True)]
        values = {
            "loss_share": result.loss_share,
            "step_s": elapsed,
            "comm_s": sum(c.blocked_s for c in comms),
            "bytes_sent": sum(c.bytes_sent for c in comms),
            **memory_mb(self.engine.device),
            "samples": sum(rows(batch) for batch in micro),
        }
        record = gather_step(trainers, step, values, result.items, result.found)
        record.grad_norm, record.lr = self.engine.last_grad_norm, lr
        record.extra = self.engine.metrics() or None
        self.history.append(record)
        MONITOR.step_times.append(elapsed)
        MONITOR.span(f"step {step}", "step", "step", begun, loss=record.loss)
        return record

    def _lr(self, step: int) -> float:
        """The learning rate of this step's update: the optimizer's, or (a parameter server's worker,
        which holds none) the built-in schedule's."""
        if self.engine.optimizers:
            return float(self.engine.optimizers[0].param_groups[0]["lr"])
        if self.custom_schedule:  # the user's scheduler lives on the servers only
            return float("nan")
        return self.config.optim.lr * lr_multiplier(self.config.optim, self.config.steps)(step)

    def evaluate(self) -> float:
        """Mean held-out loss per counted item over the fixed evaluation batches (every rank the same)."""
        model, loss = self.engine.model, self.engine.loss
        was_training = model.training
        model.eval()
        total, items = 0.0, 0
        staged = getattr(self.engine.runner, "evaluate", None)  # a pipeline: stage after stage
        device = self.engine.device
        if staged is not None:
            total, items = staged(self.engine, [to_device(b, device) for b in self.eval_data or []])
        else:
            summed = torch.zeros((), dtype=torch.float64, device=device)  # read once, at the end
            with torch.no_grad():
                for batch in self.eval_data or []:
                    items += loss.count(batch)  # on the host, before the batch moves
                    moved = to_device(batch, device)
                    summed += loss(run_model(model, moved), moved).to(torch.float64)
            total = float(summed)
        model.train(was_training)
        return total / max(1, items)

    def fit(self, show_progress: bool = True) -> dict[str, Any] | None:
        """Train ``config.steps`` steps (resuming from a checkpoint when there is one); the reporting
        rank returns the summary, every other rank None. ``show_progress``: the reporting rank's
        progress bar on stderr. A loss or gradient that is not finite (with ``on_nonfinite = "stop"``,
        the default) raises ``NonFiniteStop`` on every rank, after the step's metrics are written."""
        return _fit(self, show_progress)


def _refuse_unused(dataset: Any, batches: Any, collate_fn: Any, eval_dataset: Any) -> None:
    """Arguments that would be silently dropped: refused in one line each (before any rank joins)."""
    if dataset is not None and batches is not None:
        raise ConfigError(
            "Trainer.build got both dataset= and batches=: pass dataset= (shardwise shards it over the "
            "ranks) or batches= (each rank's own stream), not both"
        )
    if collate_fn is not None and dataset is None and eval_dataset is None:
        raise ConfigError("collate_fn= collates dataset= or eval_dataset= samples; pass one of them too")
    if eval_dataset is not None and dataset is None and batches is None:
        raise ConfigError(
            "eval_dataset= needs dataset= or batches=: the built-in corpus has its own held-out part"
        )


def _eval_from(
    dataset: MapDataset | None, config: TrainConfig, collate_fn: Callable[[list[Any]], Any] | None
) -> list[Any] | None:
    """Up to ``eval_batches`` consecutive batches of ``global_batch`` samples from the start."""
    if dataset is None:
        return None
    collate = collate_fn or default_collate
    size, batch = len(dataset), max(1, config.data.global_batch)
    starts = range(0, min(size, batch * config.eval_batches), batch)
    held_out = [collate([dataset[i] for i in range(s, min(s + batch, size))]) for s in starts]
    for collated in held_out:
        check_rows(collated, "an eval_dataset batch")
    return held_out


def train_worker(config: TrainConfig, show_progress: bool) -> dict[str, Any] | None:
    """What every rank runs (top-level so the agent can start it in a fresh process)."""
    init_distributed(config.timeout_s, config.device)
    try:
        return run_training(config, show_progress=show_progress)
    finally:
        dist.destroy_process_group()


def run_training(config: TrainConfig, show_progress: bool = True) -> dict[str, Any] | None:
    """Train the built-in model on the already-initialised process group; the reporting rank returns
    the summary, others None. A run stopped on a non-finite value returns ``{"error": <one line>,
    "step": <step>}`` from the reporting rank instead: every rank returns normally, so the agent does
    not restart a run that would diverge again (the command line prints the line, exit code 1)."""
    trainer = Trainer.build(config)
    try:
        return trainer.fit(show_progress)
    except NonFiniteStop as stop:
        return {"error": str(stop), "step": stop.step} if trainer.engine.role.reports else None


def _fit(trainer: Trainer, show_progress: bool) -> dict[str, Any] | None:
    """The loop. With checkpointing on (``checkpoint.dir`` or ``checkpoint.every``), the run first
    resumes from the newest usable checkpoint, if any (see ``train.checkpointing``). A run stopped on
    a non-finite value (``on_nonfinite = "stop"``) raises ``NonFiniteStop`` on every rank."""
    config = trainer.config
    rank = dist.get_rank()
    write_pid_file(config.run_dir, rank)
    restarts = agreed_restart_count(trainer.world_comm)  # every rank, servers too: a world collective
    ckpt = TrainCheckpoints.create(trainer, rank, dist.get_world_size())
    resumed = ckpt.resume() if ckpt else None
    start = resumed.next_step if resumed else 0
    if resumed:
        trainer.engine.resume_at(start)
        fast_forward(trainer.engine.schedulers, start)
    blocks = getattr(trainer.engine.model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):  # a pipeline stage keeps its blocks keyed by index
        blocks = nn.ModuleList(blocks.values())
    with observing(trainer, blocks):
        return _loop(trainer, show_progress, ckpt, resumed, restarts)


def _loop(
    trainer: Trainer, show_progress: bool, ckpt: TrainCheckpoints | None, resumed: Any, restarts: int
) -> dict[str, Any] | None:
    config, role, run_dir = trainer.config, trainer.engine.role, Path(trainer.config.run_dir)
    start = resumed.next_step if resumed else 0
    if role.serves:
        _serve(trainer, ckpt)
        return None
    if role.reports:
        run_dir.mkdir(parents=True, exist_ok=True)
        # a fresh run starts its own metrics file; a resumed one keeps the rows before its step
        truncate_metrics(run_dir / "metrics.jsonl", start)
        (run_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
        _announce(config, ckpt, start, restarts)
    writer = MetricsWriter(run_dir, enabled=role.reports, tensorboard=config.tensorboard)
    progress = Progress(config.steps, enabled=role.reports and show_progress, completed=start)
    eval_losses: list[tuple[int, float]] = list(resumed.eval_losses) if resumed else []
    skipped: list[int] = list(resumed.skipped_steps) if resumed else []
    try:
        for step in range(start, config.steps):
            record = trainer.step(step)
            notes = trainer.engine.runner.take_notes()  # a pipeline's fit, in words, once
            last = step == config.steps - 1
            if record.nonfinite and not record.skipped:  # every rank, this same step
                writer.write(record)
                raise NonFiniteStop(step, NonFinite(record.nonfinite, stop=True))
            if record.skipped:
                skipped.append(step)
            if trainer.eval_data and config.eval_every and ((step + 1) % config.eval_every == 0 or last):
                MONITOR.set_phase("eval", step)
                record.eval_loss = trainer.evaluate()
                eval_losses.append((step, record.eval_loss))
            writer.write(record)
            progress.update(record)
            for note in notes if role.reports else []:  # after this step's line: it is about the next
                log(note)
            if ckpt:
                MONITOR.set_phase("checkpoint", step)
                ckpt.after_step(record, eval_losses, skipped)
        trainer.engine.finish()  # owed to other ranks even when resumed after the last step
        if ckpt:
            ckpt.close()
        params = trainer.engine.full_parameters()
    except NonFiniteStop:
        trainer.engine.finish()  # what is still owed to serving ranks (a parameter server's last pull)
        if ckpt:
            ckpt.close()  # an asynchronous save still being written is finished, not left half done
        raise
    finally:
        progress.close()
        writer.close()
        trainer.engine.close()
    if not role.reports:
        return None
    if not trainer.history and resumed and resumed.last_record:  # resumed after the last step
        trainer.history.append(resumed.last_record)
    summary = summarize(trainer, eval_losses, param_digest(params))
    summary["restarts"] = restarts
    summary["skipped_steps"], summary["skipped_at"] = len(skipped), skipped
    if skipped:
        log(f"skipped the update of {len(skipped)} of {config.steps} steps (a loss or gradient not finite)")
    if ckpt:
        summary["initial_loss"] = ckpt.initial_loss
        summary["checkpoint"] = ckpt.summary()
    writer.enabled = False
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _announce(config: TrainConfig, ckpt: TrainCheckpoints | None, start: int, restarts: int) -> None:
    """One line on stderr for what a user would otherwise miss: a restart, a resume, nothing to do, a
    pipeline with fewer micro-batches than stages."""
    where = f" from {ckpt.root}/step-{start:08d}" if ckpt and start else ""
    if restarts:
        origin = where or " from step 0"
        log(f"restart {restarts} of {config.max_restarts} after a rank failed; resuming{origin}")
    elif start:
        log(f"resuming at step {start}{where}")
    p, m = config.parallel.pp, config.data.micro_batches
    if p > 1 and m < p:
        log(
            f"pp {p} with {m} micro-batch{'es' if m > 1 else ''} a step: fewer micro-batches than stages "
            f"leave most stages idle most of the step (1F1B's bubble (p-1)/(m+p-1) = "
            f"{100 * (p - 1) / (m + p - 1):.0f}%); --micro-batches {4 * p}, say, fills the pipeline"
        )
    if start == config.steps:
        log(f"the checkpoint already holds the last step ({start}): the run is complete")
    elif start > config.steps:
        log(
            f"the checkpoint is already at step {start}, past --steps {config.steps}: nothing to train "
            "(raise --steps, or use another --checkpoint-dir or --set checkpoint.resume=false)"
        )


def log(message: str) -> None:
    print(f"shardwise: {message}", file=sys.stderr, flush=True)


def _serve(trainer: Trainer, ckpt: TrainCheckpoints | None) -> None:
    """A parameter-server rank: serve the workers until they are done, saving with them."""
    try:
        trainer.engine.serve(ckpt.serve_step if ckpt else None)
        if ckpt:
            ckpt.close()
        trainer.engine.full_parameters()
    except NonFiniteStop:  # the workers stop with it too
        if ckpt:
            ckpt.close()
        raise
    finally:
        trainer.engine.close()


def _device_memory(record: StepRecord) -> dict[str, Any]:
    """On a GPU: the allocator's peaks (the largest rank's, and each rank's); nothing on the CPU."""
    if record.max_memory_allocated_mb_by_rank is None or record.max_memory_reserved_mb_by_rank is None:
        return {"device": "cpu"}
    return {
        "device": "cuda",
        "max_memory_allocated_mb": max(record.max_memory_allocated_mb_by_rank),
        "max_memory_reserved_mb": max(record.max_memory_reserved_mb_by_rank),
        "max_memory_allocated_mb_by_rank": record.max_memory_allocated_mb_by_rank,
    }


def summarize(trainer: Trainer, eval_losses: list[tuple[int, float]], digest: str) -> dict[str, Any]:
    """The run's figures; tokens/s leaves out the first step (warm-up)."""
    history, config = trainer.history, trainer.config
    timed = history[1:] or history
    total_s = sum(r.step_s for r in timed)
    ranks = len(history[-1].peak_rss_mb_by_rank)
    return {
        "strategy": config.strategy,
        "layout": describe_layout(config, trainer.mesh.dims),
        "compute_dtype": str(trainer.engine.compute_dtype).removeprefix("torch."),
        "world_size": dist.get_world_size(),
        "training_ranks": ranks,
        "steps": history[-1].step + 1,
        "initial_loss": history[0].loss,
        "final_loss": history[-1].loss,
        "final_grad_norm": history[-1].grad_norm,
        "final_lr": history[-1].lr,
        "eval_loss": eval_losses[-1][1] if eval_losses else None,
        "eval_losses": eval_losses,
        "tokens_per_s": sum(r.tokens_per_s * r.step_s for r in timed) / total_s if total_s else 0.0,
        "step_s_median": float(np.median([r.step_s for r in timed])),
        "comm_s_median": float(np.median([r.comm_s for r in timed])),
        "peak_rss_mb": max(history[-1].peak_rss_mb_by_rank),
        "peak_rss_mb_by_rank": history[-1].peak_rss_mb_by_rank,
        **_device_memory(history[-1]),
        **trainer.engine.runner.report(),  # a pipeline's stages (blocks, ranks) and what its fit kept split
        "samples_per_step_by_rank": history[-1].samples_by_rank,
        "step_s_median_by_rank": [
            float(np.median([r.step_s_by_rank[i] for r in timed])) for i in range(ranks)
        ],
        "bytes_sent_per_step_by_rank": history[-1].bytes_sent,
        **trainer.engine.metrics(),
        "restarts": restart_count(),
        "final_param_digest": digest,
        "run_dir": str(Path(config.run_dir).resolve()),
    }
