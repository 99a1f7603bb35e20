"""What the API refuses in one line before it trains on it: malformed batches, a loss that is a mean,
targets the default loss cannot read, a forward that returns nothing (one process, no ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config import ConfigError
from shardwise.data.dataset import DatasetSampler, IterableSampler, check_rows
from shardwise.engine.loss import AutoLoss, LossError, averaged_by, check_summed, run_model


# -- batches ----------------------------------------------------------------------------------------
def test_inputs_and_targets_of_different_lengths_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"batch\[0\] has 4, batch\[1\] has 3"):
        check_rows((torch.zeros(4, 2), torch.zeros(3)))
    with pytest.raises(ConfigError, match=r"\['labels'\] has 2"):
        check_rows({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(2, 5)})
    with pytest.raises(ConfigError, match="0-d tensor"):
        check_rows((torch.zeros(3, 2), torch.tensor(1.0)))
    assert check_rows({"x": torch.zeros(3, 5), "y": [torch.zeros(3)]}) == 3


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_stream_batch_with_mismatched_rows_is_refused_before_slicing(micro_batches: int) -> None:
    sampler = IterableSampler([(torch.zeros(4, 2), torch.zeros(3))])
    with pytest.raises(ConfigError, match="the batch of step 0 has tensors with different numbers of rows"):
        sampler.local_micro_batches(0, micro_batches, keep_empty=True)


def test_a_collate_fn_that_mismatches_rows_is_refused() -> None:
    data = [torch.zeros(2) for _ in range(8)]
    def collate(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(items), torch.zeros(1)

    sampler = DatasetSampler(data, 4, 0, [4], 0, collate_fn=collate)
    with pytest.raises(ConfigError, match="a collated batch has tensors with different numbers of rows"):
        sampler.local_micro_batches(0, 1)


def test_a_dataset_smaller_than_the_global_batch_is_refused() -> None:
    data = [torch.zeros(2) for _ in range(3)]
    with pytest.raises(ConfigError, match=r"3 samples, fewer than data.global_batch \(4\).*at most 3"):
        DatasetSampler(data, 4, 0, [2, 2], 0)
    DatasetSampler(data, 3, 0, [2, 1], 0)  # as large as the batch: fine


# -- the loss contract: a SUM, never a mean -----------------------------------------------------------
def _leaf() -> torch.Tensor:
    return torch.randn(4, 3, requires_grad=True)


@pytest.mark.parametrize(
    "mean",
    [
        lambda x: x.mean(),
        lambda x: x.mean(dim=(0, 1)),
        lambda x: F.mse_loss(x, torch.zeros(4, 3)),
        lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2, 0])),
        lambda x: F.binary_cross_entropy_with_logits(x, torch.zeros(4, 3)),
        lambda x: x.float().mean(),  # a cast after the mean is looked through
    ],
)
def test_a_mean_is_refused(mean) -> None:
    loss = mean(_leaf())
    assert averaged_by(loss) is not None
    with pytest.raises(LossError, match="the loss is a mean"):
        check_summed(loss)


@pytest.mark.parametrize(
    "total",
    [
        lambda x: x.sum(),
        lambda x: F.mse_loss(x, torch.zeros(4, 3), reduction="sum"),
        lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2, 0]), reduction="sum"),
        lambda x: x[:1, :1].mean(),  # a mean of one item is that item: a sum
        lambda x: x.mean() * 12,  # anything else is never guessed
    ],
)
def test_a_sum_passes(total) -> None:
    loss = total(_leaf())
    assert averaged_by(loss) is None
    assert check_summed(loss) is loss


def test_a_loss_that_is_not_one_number_is_refused() -> None:
    with pytest.raises(LossError, match=r"of shape \(4, 3\)"):
        check_summed(_leaf() * 2)


# -- the default loss on (inputs, targets) --------------------------------------------------------------
def test_the_default_loss_takes_one_class_label_per_row() -> None:
    logits, labels = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 2, 1, -100, 2])
    loss = AutoLoss()
    batch = (torch.zeros(5, 7), labels)
    assert loss.count(batch) == 4
    expected = F.cross_entropy(logits, labels, reduction="sum")
    assert torch.equal(loss(logits, batch), expected)
    with pytest.raises(LossError, match=r"need logits of shape \(rows, classes\)"):
        loss(torch.randn(5, 2, 3), batch)


def test_the_default_loss_refuses_targets_it_cannot_read() -> None:
    loss = AutoLoss()
    with pytest.raises(LossError, match=r"the targets are float32 of shape \(4,\)"):
        loss.count((torch.zeros(4, 2), torch.zeros(4)))
    with pytest.raises(LossError, match="needs \\(inputs, targets\\) batches"):
        loss.count(torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(LossError, match=r"need logits of shape \(rows, positions, vocab\)"):
        loss(torch.randn(4, 9), (torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.long)))


def test_the_default_loss_under_tp_picks_each_vocab_parallel_kind_and_refuses_class_labels() -> None:
    """``tensor_parallel_loss`` gives the default loss the vocab-parallel causal-LM and token losses
    (their numbers: tests/distributed/test_api.py, against one process); class labels have no such
    kind, and are refused in one line rather than scored over a tp-th of the classes."""
    from types import SimpleNamespace

    from shardwise.tensor_parallel.axis import tensor_parallel_loss
    from shardwise.tensor_parallel.layers import VocabParallelCausalLMLoss, VocabParallelTokenLoss

    chosen = tensor_parallel_loss(AutoLoss(ignore_index=-7), SimpleNamespace(rank=0, world_size=2))
    assert isinstance(chosen, AutoLoss)
    assert isinstance(chosen.causal, VocabParallelCausalLMLoss) and chosen.causal.ignore_index == -7
    assert isinstance(chosen.tokens, VocabParallelTokenLoss)
    ids = torch.randint(0, 9, (2, 4))
    assert chosen.count({"input_ids": ids}) == 6 and chosen.count((ids, ids)) == 8
    with pytest.raises(LossError, match=r"^the default loss has no cross-entropy over vocab-cut logits"):
        chosen.count((torch.zeros(2, 3), torch.tensor([0, 1])))


def test_a_forward_that_returns_none_is_named() -> None:
    class Forgetful(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            x * 2

    with pytest.raises(LossError, match=r"Forgetful\.forward returned None"):
        run_model(Forgetful(), (torch.zeros(2, 3), torch.zeros(2)))


# -- arguments that would be dropped --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset": [torch.zeros(2)], "batches": [torch.zeros(1, 2)]}, "got both dataset= and batches="),
        ({"batches": [torch.zeros(1, 2)], "collate_fn": list}, "pass one of them too"),
        ({"eval_dataset": [torch.zeros(2)]}, "eval_dataset= needs dataset= or batches="),
    ],
)
def test_arguments_that_would_be_dropped_are_refused(kwargs: dict, message: str) -> None:
    from shardwise.config import load_config
    from shardwise.train.loop import Trainer

    with pytest.raises(ConfigError, match=message):  # before any process group is joined
        Trainer.build(load_config(), model=nn.Linear(2, 1), **kwargs)
