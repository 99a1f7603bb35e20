"""Built-in data: the stdlib corpus and deterministic, rank-sliced batch sampling (no communication)."""

from __future__ import annotations

from shardwise.data.corpus import Corpus, load_corpus
from shardwise.data.sampler import (
    DataSampler,
    batch_offsets,
    eval_batches,
    make_batch,
    split_counts,
)

__all__ = [
    "Corpus",
    "DataSampler",
    "batch_offsets",
    "eval_batches",
    "load_corpus",
    "make_batch",
    "split_counts",
]
