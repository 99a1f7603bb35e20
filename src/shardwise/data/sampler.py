"""Batches as pure functions of (seed, step), sliced across data-parallel ranks.

No communication: every rank computes the same global batch offsets from (seed, step) with its own
``torch.Generator`` and keeps its contiguous slice. The slices of all ranks, in rank order, concatenate
to exactly the batch one process would draw, which is what makes data-parallel training comparable
with single-process training. Ranks may take unequal shares (``split_counts``), e.g. for slower
machines. Resuming at step k needs only k: no RNG state is saved.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from shardwise.config import ConfigError
from shardwise.config import split_counts as split_counts  # the shares' arithmetic, kept with the config
from shardwise.device import HOST

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets: (batch, seq_len) int64 each


def _generator(seed: int, step: int) -> torch.Generator:
    """A generator seeded by a hash of (seed, step), so nearby pairs give unrelated streams."""
    digest = hashlib.sha256(f"shardwise:{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def batch_offsets(seed: int, step: int, global_batch: int, n_tokens: int, seq_len: int) -> torch.Tensor:
    """Start offsets (global_batch,) int64 of the windows of ``step``; never touches the global RNG.

    A window covers seq_len + 1 tokens (inputs plus the one-token-shifted targets).
    """
    if n_tokens < seq_len + 1:
        raise ConfigError(f"{n_tokens} tokens cannot hold one window of seq_len({seq_len}) + 1 tokens")
    generator = _generator(seed, step)
    return torch.randint(0, n_tokens - seq_len, (global_batch,), generator=generator, device=HOST)


def make_batch(tokens: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> Batch:
    """Cut windows at ``offsets``: inputs tokens[o : o+seq_len], targets tokens[o+1 : o+seq_len+1]."""
    index = offsets.long().unsqueeze(1) + torch.arange(seq_len + 1, device=HOST)  # (batch, seq_len + 1)
    windows = tokens[index].long()
    return windows[:, :-1], windows[:, 1:]


def _split_sizes(total: int, n: int) -> list[int]:
    """``total`` split into ``n`` nearly equal sizes, larger ones first."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


class DataSampler:
    """One rank's view of the training stream: its contiguous slice of each step's global batch."""

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        global_batch: int,
        seed: int,
        counts: list[int],
        rank: int,
    ) -> None:
        if sum(counts) != global_batch or min(counts, default=-1) < 0:
            raise ConfigError(f"counts {counts} must be >= 0 and sum to global_batch({global_batch})")
        if not 0 <= rank < len(counts):
            raise ConfigError(f"rank {rank} is outside the {len(counts)} ranks that counts describes")
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"{len(tokens)} tokens cannot hold one window of seq_len({seq_len}) + 1 tokens")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch
        self.seed = seed
        self.counts = list(counts)
        self.rank = rank
        self.start = sum(counts[:rank])  # first row of this rank in the global batch
        self.step = 0  # the next step to draw: one past the last local batch drawn

    @property
    def local_count(self) -> int:
        return self.counts[self.rank]

    def _offsets(self, step: int) -> torch.Tensor:
        return batch_offsets(self.seed, step, self.global_batch_size, len(self.tokens), self.seq_len)

    def global_batch(self, step: int) -> Batch:
        """The whole batch of ``step``, as one process would train on it."""
        return make_batch(self.tokens, self._offsets(step), self.seq_len)

    def local_batch(self, step: int) -> Batch:
        """This rank's rows of the global batch of ``step``; (0, seq_len) when its count is 0."""
        offsets = self._offsets(step)[self.start : self.start + self.local_count]
        self.step = step + 1
        return make_batch(self.tokens, offsets, self.seq_len)

    def local_micro_batches(self, step: int, n: int, keep_empty: bool = False) -> list[Batch]:
        """The local batch cut into ``n`` nearly equal consecutive pieces.

        Empty pieces (a small or zero share) are dropped, unless ``keep_empty``: then there are always
        ``n`` pieces, so every rank runs the same number of forward and backward passes, which
        strategies that communicate inside them (ZeRO-3) need.
        """
        if n < 1:
            raise ConfigError(f"micro-batches must be >= 1, got {n}")
        inputs, targets = self.local_batch(step)
        sizes = [s for s in _split_sizes(self.local_count, n) if s > 0 or keep_empty]
        return list(zip(inputs.split(sizes), targets.split(sizes), strict=True))

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe position in the stream; the world size and counts may change on resume."""
        return {
            "seed": self.seed,
            "step": self.step,
            "global_batch": self.global_batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("global_batch", self.global_batch_size), ("seq_len", self.seq_len)):
            if state[key] != mine:
                raise ConfigError(
                    f"the saved data stream has {key}={state[key]} but this run has {mine}; "
                    f"the batches after resuming would not continue the saved run"
                )
        self.seed = int(state["seed"])
        self.step = int(state["step"])


def eval_batches(val_tokens: torch.Tensor, seq_len: int, batch: int, n_batches: int) -> list[Batch]:
    """``n_batches`` batches of ``batch`` windows, evenly spaced over the held-out tokens."""
    if batch < 1 or n_batches < 1:
        raise ConfigError(f"eval needs batch >= 1 and n_batches >= 1, got {batch} and {n_batches}")
    last_start = len(val_tokens) - seq_len - 1
    if last_start < 0:
        raise ConfigError(f"{len(val_tokens)} held-out tokens cannot hold a window of {seq_len} + 1")
    total = batch * n_batches
    starts = [i * last_start // max(total - 1, 1) for i in range(total)]
    offsets = torch.tensor(starts, dtype=torch.long, device=HOST)
    return [make_batch(val_tokens, chunk, seq_len) for chunk in offsets.split(batch)]
