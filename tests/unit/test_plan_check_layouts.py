"""``plan --check``: which layouts it runs on N ranks, the overrides that run them, and when the
measured time is declared meaningless (more ranks than cores). Nothing is launched here."""

from __future__ import annotations

from shardwise.bench.plan_check import check_layouts, layout_overrides, time_note
from shardwise.config import load_config
from shardwise.planner.model import preset_shape

LARGE = preset_shape("large", 64)
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


def test_two_ranks_check_each_strategy_with_and_without_checkpointing_then_on_tp2() -> None:
    layouts = check_layouts(LARGE, STRATEGIES, 2)
    names = [layout.name() for layout in layouts]
    assert names[:8] == [f"{s} dp2 mb1{c}" for s in STRATEGIES for c in ("", " ckpt")]
    assert names[8:] == [f"{s} dp1-tp2 mb1" for s in STRATEGIES]  # tp with checkpointing: not built
    assert all(layout.devices == 2 for layout in layouts)
    assert [layout.name() for layout in check_layouts(LARGE, ["ddp"], 2, tp=False)] == [
        "ddp dp2 mb1",
        "ddp dp2 mb1 ckpt",
    ]


def test_odd_ranks_or_odd_heads_take_no_tp() -> None:
    assert {layout.tp for layout in check_layouts(LARGE, STRATEGIES, 3)} == {1}
    odd = preset_shape("odd", 64)
    assert {layout.tp for layout in check_layouts(odd, STRATEGIES, 2)} == {1} or odd.n_head % 2 == 0


def test_overrides_build_the_layouts_mesh() -> None:
    zero2_tp, ddp_ckpt = check_layouts(LARGE, STRATEGIES, 4)[10], check_layouts(LARGE, STRATEGIES, 4)[1]
    config = load_config(None, {"model.kind": "gpt", "model.preset": "large", **layout_overrides(zero2_tp)})
    assert (config.strategy, config.parallel.dp, config.parallel.tp) == ("zero2", 2, 2)
    assert not config.parallel.activation_checkpointing
    config = load_config(None, layout_overrides(ddp_ckpt))
    assert config.parallel.activation_checkpointing and (config.parallel.dp, config.parallel.tp) == (4, 1)


def test_time_is_declared_meaningless_with_more_ranks_than_cores() -> None:
    assert time_note(4, 2) == "time not meaningful: 4 ranks on 2 cores"
    assert time_note(2, 2) == "" and time_note(2, 16) == ""
