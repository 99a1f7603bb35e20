"""The pipeline split, in one process: balanced contiguous runs, every block once, names preserved."""

from __future__ import annotations

import pytest
import torch

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.pipeline.schedules import stage_placement
from shardwise.pipeline.split import SplitError, balance, split_model


def test_balance_is_contiguous_covers_every_block_once_and_minimises_the_largest_stage() -> None:
    runs = balance([5, 1, 1, 1, 1, 1], 2)
    assert runs == [[0], [1, 2, 3, 4, 5]]
    uneven = balance([1] * 7, 3)  # uneven stages are allowed, never a block dropped
    assert sorted(i for run in uneven for i in run) == list(range(7))
    assert [len(r) for r in uneven] in ([3, 2, 2], [2, 3, 2], [2, 2, 3])
    with pytest.raises(SplitError, match="the model has 2 blocks but the pipeline has 3 stages"):
        balance([1, 1], 3)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=5, n_head=2, d_model=8, d_ff=12, seq_len=8))


@pytest.mark.parametrize(("schedule", "pp", "virtual"), [("1f1b", 2, 1), ("1f1b", 3, 1), ("zbv", 2, 2)])
def test_every_parameter_lands_on_exactly_one_rank_under_its_own_name(
    schedule: str, pp: int, virtual: int
) -> None:
    whole = dict(_model().named_parameters())
    placement = stage_placement(schedule, pp, virtual)
    held: list[str] = []
    for rank in range(pp):
        model = _model()
        split_model(model, placement, rank)
        names = [n for n, _ in model.named_parameters()]
        for n, p in model.named_parameters():
            assert torch.equal(p, whole[n])
        held += names
    assert sorted(held) == sorted(whole)  # the tied wte/head weight once, on the first stage


def test_the_last_stage_reads_a_copy_of_the_tied_weight_and_runs_the_plain_model() -> None:
    placement = stage_placement("1f1b", 2, 1)
    first, last = _model(), _model()
    reference = _model()
    a, b = split_model(first, placement, 0), split_model(last, placement, 1)
    assert a.tied_owner is not None and b.tied is not None and b.tied.owner_name == "wte.weight"
    assert "head.weight" not in dict(last.named_parameters())
    ids = torch.randint(0, 256, (2, 8))
    hidden = a.stages[0](ids)
    assert torch.allclose(b.stages[1](hidden), reference(ids))
