"""One GPU, one rank: shardwise's step against plain PyTorch's own loop over the same work.

Both sides build the same model under the same seed on the GPU, draw the same batches from the
built-in corpus (moved there pinned, without blocking), sum the token loss over the global count and
step AdamW (fused on the GPU, as ``engine.optim`` builds it). shardwise runs ``Trainer.step`` (its
bookkeeping included: the count, the norm, the non-finite agreement, the metrics); torch runs
``model(x)``, ``backward``, ``step``, ``zero_grad``. Each side runs in a fresh process, so the
allocator's peak (``max_memory_allocated``) is its own. Step times come from CUDA events, after
``WARMUP_STEPS``. Beside them, each side's host time per phase (``host_ms``: forward and backward,
the update, the rest of the step): where a small model's step is launch-bound, the host's time is the
step's, so the phases say where our extra time goes (measured on a GPU, the figures that ask for a fix
next). Communication: none (a world of one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardwise.config import TrainConfig
from shardwise.device import Clock, memory_mb, to_device

WARMUP_STEPS = 5


def overhead_worker(side: str, config: TrainConfig) -> dict[str, Any]:
    """One rank: ``config.steps`` steps of ``side`` (shardwise | torch); tokens/s and memory peaks."""
    import torch.distributed as dist

    from shardwise.launcher import init_distributed

    init_distributed(config.timeout_s, config.device)
    try:
        phases = HostPhases()
        seconds, device = (_ours if side == "shardwise" else _torch_loop)(config, phases)
        timed = seconds[WARMUP_STEPS:] or seconds
        tokens = config.data.global_batch * config.model.seq_len
        memory = memory_mb(device)
        return {
            "tokens_per_s": tokens / statistics.median(timed),
            "max_memory_allocated_mb": memory.get("max_memory_allocated_mb", float("nan")),
            "max_memory_reserved_mb": memory.get("max_memory_reserved_mb", float("nan")),
            "host_ms": phases.medians_ms(WARMUP_STEPS),
        }
    finally:
        dist.destroy_process_group()


class HostPhases:
    """Host seconds of each step's phases (``time.perf_counter``): ``step`` the whole, the named ones
    inside it, and ``rest`` (the step less them) in ``medians_ms``."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds.setdefault(name, []).append(time.perf_counter() - started)

    def wrap(self, owner: Any, method: str) -> None:
        """Time every call of ``owner.method`` as the phase of its name (the instance's own attribute)."""
        original: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(method):
                return original(*args, **kwargs)

        setattr(owner, method, timed)

    def medians_ms(self, skip: int) -> dict[str, float]:
        """Each phase's median over the steps after the first ``skip``, in ms, and ``rest``: each
        step's time outside the named phases (each of which ran once a step), its median."""
        kept = {name: v[skip:] or v for name, v in self.seconds.items() if v}
        out = {name: 1e3 * statistics.median(v) for name, v in kept.items()}
        steps = kept.get("step", [])
        inside = [v for name, v in kept.items() if name != "step" and len(v) == len(steps)]
        if steps:
            out["rest"] = 1e3 * statistics.median(t - sum(p[i] for p in inside) for i, t in enumerate(steps))
        return out


def _ours(config: TrainConfig, phases: HostPhases) -> tuple[list[float], torch.device]:
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(config)
    phases.wrap(trainer.engine, "forward_backward")  # what take_step calls, by these names
    phases.wrap(trainer.engine, "update")
    seconds = []
    for step in range(config.steps):
        clock = Clock(trainer.engine.device).start()
        with phases.phase("step"):
            trainer.step(step)
        seconds.append(clock.seconds())
    trainer.engine.close()
    return seconds, trainer.engine.device


def _torch_loop(config: TrainConfig, phases: HostPhases) -> tuple[list[float], torch.device]:
    from shardwise.data.corpus import load_corpus
    from shardwise.data.sampler import DataSampler
    from shardwise.device import joined_device
    from shardwise.engine.loss import logits_of, loss_sum
    from shardwise.engine.optim import build_optimizer, named
    from shardwise.models import build_model
    from shardwise.train.loop import seed_everything

    device = joined_device(config.device)
    seed_everything(config.seed)
    model = build_model(config.model).to(device)
    optimizer = build_optimizer(named(model), config.optim)
    corpus = load_corpus(config.data.corpus_bytes)
    batch = config.data.global_batch
    sampler = DataSampler(corpus.train, config.model.seq_len, batch, config.seed, [batch], 0)
    seconds = []
    for step in range(config.steps):
        clock = Clock(device).start()
        with phases.phase("step"):
            inputs, targets = to_device(sampler.global_batch(step), device)
            with phases.phase("forward_backward"):
                loss = loss_sum(logits_of(model(inputs)), targets) / targets.numel()
                loss.backward()
            with phases.phase("update"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        seconds.append(clock.seconds())
    return seconds, device

