"""The pipeline split, in one process: balanced contiguous runs or the user's boundaries, every block
once, names preserved; every stage reads the micro-batch's mask, positions and segment ids as the whole
model's forward does (bit for bit); keys no stage reads and a forward of one's own are refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError, TrainConfig, load_config
from shardwise.models.adapters import adapter_for, pipeline_adapter
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallelism import check
from shardwise.pipeline.schedules import stage_placement
from shardwise.pipeline.split import SplitError, balance, plan_stages, split_model


def test_balance_is_contiguous_covers_every_block_once_and_minimises_the_largest_stage() -> None:
    runs = balance([5, 1, 1, 1, 1, 1], 2)
    assert runs == [[0], [1, 2, 3, 4, 5]]
    uneven = balance([1] * 7, 3)  # uneven stages are allowed, never a block dropped
    assert sorted(i for run in uneven for i in run) == list(range(7))
    assert [len(r) for r in uneven] in ([3, 2, 2], [2, 3, 2], [2, 2, 3])
    with pytest.raises(SplitError, match="the model has 5 blocks but the pipeline has 6 stages"):
        plan_stages(_model(), 6)  # in the split's words, before balance is asked


def test_balance_charges_the_first_and_last_stage_their_ends() -> None:
    assert balance([1] * 6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert balance([1] * 6, 2, (0.0, 2.0)) == [[0, 1, 2, 3], [4, 5]]  # the head's work: two blocks'
    assert balance([1] * 7, 3, (2.0, 0.0)) == [[0], [1, 2, 3], [4, 5, 6]]  # the first: one block and 2
    # Llama 3 70B on 8 stages, in blocks: its head's matrix 1.23 of work on the last stage, the
    # embedding's 1.23 held on the first. By work alone the first stage holds 10 blocks and the
    # embedding (11.23, the most); by work then parameters held, no stage holds more than 11
    assert [len(r) for r in balance([1.0] * 80, 8, (0.0, 1.23))] == [10, 10, 10, 10, 10, 10, 11, 9]
    runs = balance([1.0] * 80, 8, (0.0, 1.23), [1.0] * 80, (1.23, 1.23))
    assert max(len(r) for r in runs) == 11 and len(runs[0]) + 1.23 <= 11 and len(runs[-1]) + 1.23 <= 11


def test_the_split_counts_the_head_matrix_not_the_embedding_lookup() -> None:
    wide = GPT(GPTConfig(n_layer=6, n_head=2, d_model=16, d_ff=64, seq_len=8, vocab_size=4096))
    block = sum(p.numel() for p in wide.blocks[0].parameters())  # 3,232; the head's matrix: 65,536
    assert [len(run) for run in plan_stages(wide, 2)] == [5, 1]  # the tied head counted at the head
    narrow = GPT(GPTConfig(n_layer=6, n_head=2, d_model=16, d_ff=64, seq_len=8, vocab_size=4))
    assert block > 16 * 4 and [len(run) for run in plan_stages(narrow, 2)] == [3, 3]


@pytest.mark.parametrize("name", ["gpt small", "tiny-gpt2", "tiny-llama"])
def test_the_planner_counts_the_blocks_each_rank_holds_as_the_split_cuts_them(name: str) -> None:
    from shardwise.models.adapters import hf_shape, preset_shape
    from shardwise.planner.pipeline import rank_shares

    if name.startswith("gpt"):
        shape = preset_shape(name.split()[1], 64)
        model: nn.Module = GPT(GPTConfig(n_layer=shape.n_layer, n_head=shape.n_head, d_model=shape.d_model))
    else:
        shape, model = hf_shape(name), _hf(name)
    for pp, schedule, virtual in [(2, "1f1b", 1), (3, "zb", 1), (2, "interleaved", 2), (2, "zbv", 2)]:
        placement = stage_placement(schedule, pp, virtual)
        runs = plan_stages(model, len(placement))
        held = [sum(len(runs[s]) for s, r in enumerate(placement) if r == rank) for rank in range(pp)]
        assert [share.blocks for share in rank_shares(shape, pp, schedule, virtual)] == held, (pp, schedule)


def test_under_tensor_parallelism_the_stages_are_cut_on_the_whole_model(tmp_path: Any) -> None:
    """``parallelize`` cuts the layers for tp before it splits the stages; the split is planned first,
    on the whole model, so that it is the planner's (a vocabulary-cut embedding read as a matrix
    would move the cut). One rank of pp 2 x tp 2 in torch's fake group, on the meta device."""
    import json

    import torch.distributed as dist

    from shardwise.bench.dry_run import join_fake_group
    from shardwise.checkpoint.source import NoValues
    from shardwise.mesh import build_mesh
    from shardwise.models import build_model
    from shardwise.models.adapters import hf_shape
    from shardwise.parallelism import parallelize
    from shardwise.pipeline.axis import PipelineAxis
    from shardwise.planner.pipeline import rank_shares

    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    sizes = {"vocab_size": 8448, "n_positions": 64, "n_embd": 128, "n_layer": 12, "n_head": 4}
    path.write_text(json.dumps({"model_type": "gpt2", "bos_token_id": 0, "eos_token_id": 0, **sizes}))
    config = load_config(None, {"model.kind": f"hf:{path}", "model.seq_len": "64", "parallel.pp": "2",
                                "parallel.tp": "2", "data.micro_batches": "2"})  # fmt: skip
    with torch.device("meta"):
        whole = plan_stages(build_model(config.model), 2)
        model = build_model(config.model)
    assert [len(r) for r in whole] == [9, 3]  # the head's matrix: about 5.3 blocks
    names = [n for n, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    join_fake_group(0, 4)
    try:
        checked = config.validate(4)
        engine = parallelize(model, build_mesh(checked), checked, weights=NoValues(names))
    finally:
        dist.destroy_process_group()
    (axis,) = [a for a in engine.axes if isinstance(a, PipelineAxis)]
    assert axis.split.assignment == whole
    assert [s.blocks for s in rank_shares(hf_shape(f"hf:{path}"), 2, "1f1b", 1)] == [9, 3]


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


# -- what a stage reads of a micro-batch, and whose forward it runs -------------------------------------
class _ScaledGPT(GPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * 0.5


class _KeptGPT(GPT):
    def describe(self) -> str:
        return "keeps GPT.forward"


def _gpt(cls: type[GPT] = GPT) -> GPT:
    torch.manual_seed(0)
    return cls(GPTConfig(n_layer=4, n_head=2, d_model=8, d_ff=12, seq_len=8))


def _run_stages(make: Callable[[], nn.Module], batch: dict[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Every stage of a zbv split (two ranks, two stages each) in order, each reading ``batch``."""
    placement = stage_placement("zbv", 2, 2)
    splits = [split_model(make(), placement, rank) for rank in range(2)]
    stages = {s: stage for split in splits for s, stage in split.stages.items()}
    given = splits[0].inputs(batch)
    x = given.ids
    for s in range(len(placement)):
        x = stages[s](x, given)
    return x


def test_a_subclass_that_keeps_the_forward_splits_and_one_that_overrides_it_is_refused_by_name() -> None:
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(_run_stages(lambda: _gpt(_KeptGPT), ids), _gpt(_KeptGPT)(ids))
    with pytest.raises(SplitError) as caught:
        split_model(_gpt(_ScaledGPT), stage_placement("1f1b", 2, 1), 0)
    message = str(caught.value)
    why = "a pipeline stage runs the parent's forward piece by piece, so yours would never run"
    assert message.startswith(f"_ScaledGPT.forward overrides GPT.forward, and {why}")
    assert "set parallel.pp = 1" in message and "\n" not in message
    patched = _gpt()
    patched.forward = lambda idx: GPT.forward(patched, idx) * 2  # type: ignore[method-assign]
    with pytest.raises(SplitError, match=r"^GPT\.forward overrides GPT\.forward"):
        split_model(patched, stage_placement("1f1b", 2, 1), 0)


def test_tensor_parallel_plans_a_subclass_that_keeps_the_forward_and_refuses_one_that_does_not() -> None:
    assert adapter_for(_gpt(_KeptGPT)).tp_plan().describe() == adapter_for(_gpt()).tp_plan().describe()
    with pytest.raises(ConfigError) as caught:
        adapter_for(_gpt(_ScaledGPT)).tp_plan()
    assert str(caught.value).startswith(
        "_ScaledGPT.forward overrides GPT.forward, and tensor parallelism hands the forward logits cut by"
    )
    assert "\n" not in str(caught.value)


def test_a_batch_key_no_stage_reads_is_refused_in_one_line_never_dropped() -> None:
    adapter = pipeline_adapter(_gpt())
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(adapter.inputs((ids, ids)).ids, ids) and adapter.inputs(ids).extras == {}
    with pytest.raises(SplitError, match=r"^a dict batch \('input_ids'\) for GPT, whose forward takes"):
        adapter.inputs({"input_ids": ids, "labels": ids})


def _hf(name: str, **overrides: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from shardwise.models.hf import SHIPPED_DIR

    config = transformers.AutoConfig.from_pretrained(str(SHIPPED_DIR / f"{name}.json"), **overrides)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _extras() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4], mask[1, :2] = 0, 0  # left padding
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], list(range(10)), [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]])
    return {
        "left-padded": {"attention_mask": mask},
        "token-types": {"token_type_ids": torch.randint(0, 2, (3, 10), generator=g), "attention_mask": mask},
        "packed": {"position_ids": packed},
    }


@pytest.mark.parametrize(
    ("name", "overrides", "extras"),
    [
        ("tiny-gpt2", {}, "left-padded"),
        ("tiny-gpt2", {}, "token-types"),
        ("tiny-gpt2", {"attn_implementation": "eager"}, "left-padded"),  # a float mask: its dtype matters
        ("tiny-gpt2", {}, "packed"),
        ("tiny-llama", {}, "left-padded"),
        ("tiny-llama", {}, "packed"),
        ("tiny-llama", {"use_cache": True}, "packed"),  # with a cache transformers ignores packing
    ],
)
def test_stages_read_the_mask_positions_and_segments_as_the_models_own_forward(
    name: str, overrides: dict[str, Any], extras: str
) -> None:
    """Bit for bit: the stages derive what the blocks need as the whole model's forward does."""
    ids = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(2))
    given = _extras()[extras]
    want = _hf(name, **overrides)(input_ids=ids, **given).logits
    got = _run_stages(lambda: _hf(name, **overrides), {"input_ids": ids, **given, "labels": ids})
    assert torch.equal(got, want)
    assert not torch.equal(_hf(name, **overrides)(input_ids=ids).logits, want)  # the extras matter


def test_hugging_face_keys_a_family_cannot_honour_are_refused_in_one_line() -> None:
    ids = torch.zeros(2, 4, dtype=torch.long)
    llama = pipeline_adapter(_hf("tiny-llama"))
    with pytest.raises(SplitError) as caught:
        llama.inputs({"input_ids": ids, "token_type_ids": ids})
    assert str(caught.value).startswith(
        "batch key 'token_type_ids': a pipeline stage of LlamaForCausalLM reads input_ids, attention_mask, "
        "position_ids of a dict batch (and labels, for the loss), so it would drop 'token_type_ids'"
    )
    with pytest.raises(SplitError, match=r"^a dict batch without 'input_ids' \('attention_mask'\)"):
        pipeline_adapter(_hf("tiny-gpt2")).inputs({"attention_mask": ids})


def test_a_hugging_face_subclass_is_split_only_with_its_parents_forward() -> None:
    transformers = pytest.importorskip("transformers")
    model = _hf("tiny-gpt2")

    class Scaled(transformers.GPT2LMHeadModel):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    class Body(transformers.GPT2Model):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    with pytest.raises(SplitError, match=r"^Scaled\.forward overrides GPT2LMHeadModel\.forward, and a"):
        pipeline_adapter(Scaled(model.config))
    model.transformer = Body(model.config)
    with pytest.raises(SplitError, match=r"^GPT2LMHeadModel\.transformer is a Body, whose forward overrides"):
        pipeline_adapter(model)
    with pytest.raises(ConfigError, match=r"^GPT2LMHeadModel\.transformer is a Body, whose forward"):
        adapter_for(model).tp_plan()


def test_a_model_of_ones_own_is_split_by_its_own_blocks_not_the_configs_preset() -> None:
    """``Trainer.build(model=...)`` at pp 2 with ZBV (4 stages): the config's preset (tiny, 2 blocks)
    is not the model the ranks split, so only the command line's check, which builds the config's
    model, refuses it; the ranks' split counts the blocks of the model it is given (5 here)."""
    from shardwise.pipeline.axis import check_pipeline

    config = load_config(None, {"parallel.pp": 2, "parallel.schedule": "zbv", "model.preset": "tiny"})
    with pytest.raises(ConfigError, match="the gpt preset 'tiny' has 2 blocks"):
        check(config)
    check_pipeline(config, config_model=False)  # what PipelineAxis runs: no preset in it
    split = split_model(_model(), stage_placement("zbv", 2, 2), 0)
    assert sorted(i for stage in split.stages.values() for i in stage.blocks) == sorted(
        i for s in (0, 3) for i in split.assignment[s]
    )
