"""The built-in corpus and the sampler: determinism, splits, rank slices that add up to the batch."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.config import ConfigError
from shardwise.data import (
    DataSampler,
    batch_offsets,
    eval_batches,
    load_corpus,
    make_batch,
    split_counts,
)
from shardwise.data.corpus import stdlib_sources

TOKENS = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)


def test_corpus_is_deterministic_and_split_90_10() -> None:
    corpus = load_corpus(100_000)
    assert load_corpus(100_000) is corpus  # cached per process
    load_corpus.cache_clear()
    again = load_corpus(100_000)
    assert again is not corpus and again.digest == corpus.digest
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    assert corpus.train.dtype == torch.uint8
    assert len(corpus.train) + len(corpus.val) == 100_000
    assert len(corpus.val) == 10_000
    assert corpus.n_files >= 1
    first = stdlib_sources()[0].read_bytes()[:100]
    assert bytes(corpus.train[: len(first)].tolist()) == first


def test_default_corpus_size() -> None:
    corpus = load_corpus()
    assert (len(corpus.train), len(corpus.val)) == (3_600_000, 400_000)
    assert corpus.n_files > 10 and len(corpus.digest) == 64


def test_corpus_rejects_tiny_sizes() -> None:
    with pytest.raises(ConfigError, match=">= 1024"):
        load_corpus(10)


def test_split_counts_hand_checked() -> None:
    # quotas 8, 8, 3.2, 12.8 -> floors 8, 8, 3, 12, one left -> largest remainder (0.8) is rank 3
    assert split_counts(32, [0.25, 0.25, 0.10, 0.40]) == [8, 8, 3, 13]
    # quotas 10/3 each, one left, remainders tie -> the lowest rank gets it
    assert split_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert split_counts(10, [], world_size=3) == [4, 3, 3]
    assert split_counts(11, [], world_size=4) == [3, 3, 3, 2]
    assert split_counts(5, [1, 0, 1]) == [3, 0, 2]
    # quotas 0.5, 1.5, 3 -> floors 0, 1, 3, one left, remainders tie at .5 -> rank 0
    assert split_counts(5, [1, 3, 6]) == [1, 1, 3]


@pytest.mark.parametrize("weights", [[0.1, 0.2, 0.7], [3, 1], [0.33, 0.33, 0.34, 5.0], [1e-9, 1.0]])
@pytest.mark.parametrize("global_batch", [0, 1, 7, 64])
def test_split_counts_sum_and_closeness(global_batch: int, weights: list[float]) -> None:
    counts = split_counts(global_batch, weights)
    assert sum(counts) == global_batch and min(counts) >= 0
    total = sum(weights)
    for count, weight in zip(counts, weights, strict=True):
        assert abs(count - global_batch * weight / total) < 1.0


def test_split_counts_errors_show_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"\[1, -1\]"):
        split_counts(4, [1, -1])
    with pytest.raises(ConfigError, match="sum to 0"):
        split_counts(4, [0, 0])
    with pytest.raises(ConfigError, match="2 weights given for 3 ranks"):
        split_counts(4, [1, 1], world_size=3)
    with pytest.raises(ConfigError, match="world_size"):
        split_counts(4, [])


def test_offsets_reproducible_and_vary_with_step_and_seed() -> None:
    torch.manual_seed(0)
    a = batch_offsets(seed=1, step=5, global_batch=16, n_tokens=1000, seq_len=8)
    global_state = torch.get_rng_state()
    b = batch_offsets(seed=1, step=5, global_batch=16, n_tokens=1000, seq_len=8)
    assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG is untouched
    assert torch.equal(a, b) and a.dtype == torch.int64
    assert not torch.equal(a, batch_offsets(1, 6, 16, 1000, 8))
    assert not torch.equal(a, batch_offsets(2, 5, 16, 1000, 8))
    many = batch_offsets(0, 0, 4096, 20, 8)
    assert many.min() == 0 and many.max() == 20 - 8 - 1  # every window fits, both ends reached


def test_make_batch_shifts_targets_by_one() -> None:
    inputs, targets = make_batch(TOKENS, torch.tensor([0, 300]), seq_len=5)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.tolist() == [[0, 1, 2, 3, 4], [44, 45, 46, 47, 48]]
    assert torch.equal(targets, inputs + 1)


def _samplers(counts: list[int], seed: int = 7) -> list[DataSampler]:
    return [DataSampler(TOKENS, 6, sum(counts), seed, counts, rank) for rank in range(len(counts))]


@pytest.mark.parametrize("counts", [[4], [2, 2], [3, 0, 5, 1], [0, 9]])
def test_local_slices_concatenate_to_global_batch(counts: list[int]) -> None:
    samplers = _samplers(counts)
    for step in (0, 3):
        x, y = samplers[0].global_batch(step)
        assert x.shape == (sum(counts), 6)
        parts = [s.local_batch(step) for s in samplers]
        for sampler, (lx, _) in zip(samplers, parts, strict=True):
            assert lx.shape == (sampler.local_count, 6)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_micro_batches_concatenate_to_local_batch(n: int) -> None:
    sampler = _samplers([2, 5])[1]
    pieces = sampler.local_micro_batches(4, n)
    x, y = sampler.local_batch(4)
    assert len(pieces) == min(n, 5) and all(len(p[0]) > 0 for p in pieces)
    assert max(len(p[0]) for p in pieces) - min(len(p[0]) for p in pieces) <= 1
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)
    assert torch.equal(torch.cat([p[1] for p in pieces]), y)
    assert _samplers([0, 3])[0].local_micro_batches(0, 2) == []


def test_state_dict_round_trips_through_json() -> None:
    sampler = _samplers([2, 2])[0]
    sampler.local_batch(0)
    sampler.local_batch(1)
    state = json.loads(json.dumps(sampler.state_dict()))
    # Resume on a different split (one rank now): it continues at step 2 with the same global batch.
    resumed = DataSampler(TOKENS, 6, 4, seed=0, counts=[4], rank=0)
    resumed.load_state_dict(state)
    assert resumed.step == 2 and resumed.seed == 7
    assert torch.equal(resumed.local_batch(resumed.step)[0], sampler.global_batch(2)[0])
    with pytest.raises(ConfigError, match="global_batch=4 but this run has 8"):
        DataSampler(TOKENS, 6, 8, 0, [8], 0).load_state_dict(state)


def test_sampler_rejects_bad_counts() -> None:
    with pytest.raises(ConfigError, match="sum to global_batch"):
        DataSampler(TOKENS, 6, 5, 0, [2, 2], 0)
    with pytest.raises(ConfigError, match="rank 2"):
        DataSampler(TOKENS, 6, 4, 0, [2, 2], 2)


def test_eval_batches_are_deterministic_and_span_the_split() -> None:
    val = TOKENS[:200]
    batches = eval_batches(val, seq_len=10, batch=3, n_batches=4)
    assert len(batches) == 4 and all(x.shape == (3, 10) for x, _ in batches)
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts[0] == 0 and starts[-1] == 200 - 10 - 1
    assert starts == sorted(starts)
    again = eval_batches(val, seq_len=10, batch=3, n_batches=4)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    _, last_y = batches[-1]
    assert last_y[-1, -1] == val[-1]  # the very last held-out token is used
