"""The pipeline split, in one process: balanced contiguous runs or the user's boundaries, every block
once, names preserved."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError, TrainConfig, load_config
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallelism import check
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


def test_named_boundaries_cut_where_the_user_says_and_every_rank_keeps_its_blocks() -> None:
    placement = stage_placement("interleaved", 2, 2)  # stages 0, 2 on rank 0; 1, 3 on rank 1
    model = _model()
    split = split_model(model, placement, 1, ("blocks.1", "blocks.2", "blocks.4"))
    assert split.assignment == [[0], [1], [2, 3], [4]]  # uneven, and not what balance() gives
    assert split.assignment != balance([1] * 5, 4)
    assert [split.stages[s].blocks for s in sorted(split.stages)] == [[1], [4]]
    kept = {n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("blocks.")}
    assert sorted(kept) == ["1", "4"]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("blocks.2",), "names 1 boundaries, but 4 stages (pp x virtual stages) need 3"),
        (("blocks.1", "blocks.9", "blocks.4"), "'blocks.9' is not a block of the model; name blocks.0 .."),
        (("blocks.1", "h.2", "blocks.4"), "'h.2' is not a block of the model"),
        (("blocks.3", "blocks.2", "blocks.4"), "blocks.2 is not after blocks.3; list the boundaries in"),
        (("blocks.0", "blocks.2", "blocks.4"), "blocks.0 is not after blocks.0, where stage 0 starts"),
    ],
)  # fmt: skip
def test_wrong_boundaries_are_refused_in_one_line(names: tuple[str, ...], message: str) -> None:
    with pytest.raises(SplitError, match=r"^parallel\.pp_split") as caught:
        split_model(_model(), stage_placement("interleaved", 2, 2), 0, names)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_config_check_refuses_bad_boundaries_before_any_rank_starts() -> None:
    def config(**keys: object) -> TrainConfig:
        parallel = {f"parallel.{k}": v for k, v in keys.items()}
        return load_config(overrides={"model.preset": "tiny", **parallel})

    known = r"'blocks\.9' is not a block of the model; name blocks\.0 \.\. blocks\.1 "
    with pytest.raises(SplitError, match=known):
        check(config(pp=2, pp_split="blocks.9"))
    check(config(pp=2, pp_split="blocks.1"))
    with pytest.raises(ConfigError, match=r"parallel\.pp_split names where pipeline stages start, but there"):
        check(config(pp_split="blocks.1"))
