"""One GPU, one rank: shardwise's step against plain PyTorch's own loop over the same work.

Both sides build the same model under the same seed on the GPU, draw the same batches from the
built-in corpus (moved there pinned, without blocking), sum the token loss over the global count and
step AdamW (fused on the GPU, as ``engine.optim`` builds it). shardwise runs ``Trainer.step`` (its
bookkeeping included: the count, the norm, the non-finite agreement, the metrics); torch runs
``model(x)``, ``backward``, ``step``, ``zero_grad``. Each side runs in a fresh process, so the
allocator's peak (``max_memory_allocated``) is its own. Step times come from CUDA events, after
``WARMUP_STEPS``. Communication: none (a world of one).
"""

from __future__ import annotations

import statistics

import torch

from shardwise.config import TrainConfig
from shardwise.device import Clock, memory_mb, to_device

WARMUP_STEPS = 5


def overhead_worker(side: str, config: TrainConfig) -> dict[str, float]:
    """One rank: ``config.steps`` steps of ``side`` (shardwise | torch); tokens/s and memory peaks."""
    import torch.distributed as dist

    from shardwise.launcher import init_distributed

    init_distributed(config.timeout_s, config.device)
    try:
        seconds, device = (_ours if side == "shardwise" else _torch_loop)(config)
        timed = seconds[WARMUP_STEPS:] or seconds
        tokens = config.data.global_batch * config.model.seq_len
        memory = memory_mb(device)
        return {
            "tokens_per_s": tokens / statistics.median(timed),
            "max_memory_allocated_mb": memory.get("max_memory_allocated_mb", float("nan")),
            "max_memory_reserved_mb": memory.get("max_memory_reserved_mb", float("nan")),
        }
    finally:
        dist.destroy_process_group()


def _ours(config: TrainConfig) -> tuple[list[float], torch.device]:
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(config)
    seconds = []
    for step in range(config.steps):
        clock = Clock(trainer.engine.device).start()
        trainer.step(step)
        seconds.append(clock.seconds())
    trainer.engine.close()
    return seconds, trainer.engine.device


def _torch_loop(config: TrainConfig) -> tuple[list[float], torch.device]:
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
        inputs, targets = to_device(sampler.global_batch(step), device)
        loss = loss_sum(logits_of(model(inputs)), targets) / targets.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(clock.seconds())
    return seconds, device

