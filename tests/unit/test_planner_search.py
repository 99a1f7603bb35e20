"""The planner's search: layouts enumerated, the ones that do not fit dropped with figures, the rest
ranked by predicted step time and the winner explained."""

from __future__ import annotations

import pytest

from shardwise.config import ConfigError
from shardwise.models.adapters import preset_shape
from shardwise.planner.calibration import Calibration, Machine
from shardwise.planner.layout import Training
from shardwise.planner.memory import estimate_memory
from shardwise.planner.model import ModelShape
from shardwise.planner.search import Plan, enumerate_layouts, mesh_shapes, plan, search_degrees

LLAMA3_8B = ModelShape(
    n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336, vocab=128256,
    tie_weights=False, gated_mlp=True, bias=False, layer_norm=False, name="Llama-3-8B",
)  # fmt: skip
H100S = Machine(devices=8, device_memory=80e9, link_bytes_per_s=400e9 / 8)  # 400 Gbit/s
TRAIN = Training(global_batch=64, seq_len=4096, precision="bf16")


def test_mesh_shapes_multiply_to_the_devices() -> None:
    assert list(mesh_shapes(8)) == [(8, 1, 1)]
    shapes = list(mesh_shapes(8, pp_degrees=(1, 2), tp_degrees=(1, 2, 4, 3)))
    assert shapes == [(8, 1, 1), (4, 1, 2), (2, 1, 4), (4, 2, 1), (2, 2, 2), (1, 2, 4)]


def test_enumeration_offloads_only_zero_and_splits_only_what_divides() -> None:
    layouts = enumerate_layouts(LLAMA3_8B, Training(16, 128), devices=8)
    assert {layout.strategy for layout in layouts} == {"ddp", "zero1", "zero2", "zero3"}
    assert all(layout.offload == "none" for layout in layouts if layout.strategy == "ddp")
    assert {layout.micro_batches for layout in layouts} == {1, 2}  # 16 sequences / 8 ranks = 2 each
    assert len(layouts) == (1 + 3 * 2) * 2 * 2  # strategies x offload, x checkpointing, x micro-batches
    # tp must divide the key-value heads (8): tp 16 is left out; pp cannot exceed the 32 blocks
    shaped = enumerate_layouts(
        LLAMA3_8B, Training(64, 128), 64, ["zero3"], (1, 64), (1, 16), (False,), ("none",)
    )
    assert {(layout.dp, layout.pp, layout.tp) for layout in shaped} == {(64, 1, 1)}


def test_llama3_8b_on_eight_80gb_devices_drops_ddp_with_its_figures() -> None:
    result = plan(LLAMA3_8B, TRAIN, H100S)
    assert result.ranked and all(c.memory.total <= 80e9 for c in result.ranked)
    assert all(c.memory.total > 80e9 for c in result.dropped)
    times = [c.time.total_s for c in result.ranked if c.time is not None]
    assert times == sorted(times)
    ddp = [c for c in result.dropped if c.layout.strategy == "ddp"]
    assert len(ddp) == len([c for c in enumerate_layouts(LLAMA3_8B, TRAIN, 8) if c.strategy == "ddp"])
    smallest = min(ddp, key=lambda c: c.memory.total)
    # fp32 parameters, gradients and two moments: 16 bytes x 8.03e9 = 128.5 GB before any activation
    assert smallest.memory.total > 128.4e9
    assert "> 80.0 GB" in smallest.reason and "optimizer_state 64.2 GB" in smallest.reason
    assert result.best is not None and result.why.startswith(f"{result.best.layout.name()} wins: ")
    assert "No ddp layout fits: even " in result.why and "runner-up" in result.why


def test_the_ranking_follows_the_link() -> None:
    """On a slow link ZeRO-3 (1.5x DP's bytes, and every micro-batch) ranks below ZeRO-2; and the
    ranking only reorders what fits: the same layouts fit whatever the link."""
    small = preset_shape("large", 256)
    training = Training(32, 256, "bf16")
    fast = plan(small, training, Machine(8, 80e9, 1e12), Calibration(flops_per_s=1e12))
    slow = plan(small, training, Machine(8, 80e9, 1e8), Calibration(flops_per_s=1e12))
    assert {c.layout for c in fast.ranked} == {c.layout for c in slow.ranked}

    def best(p: Plan, strategy: str) -> float:
        return min(c.time.total_s for c in p.ranked if c.layout.strategy == strategy and c.time)

    assert best(slow, "zero3") > best(slow, "zero2")
    assert slow.best is not None and slow.best.layout.strategy != "zero3"


def test_nothing_fits_says_so_with_the_smallest_layout() -> None:
    tiny_devices = Machine(devices=2, device_memory=1e9, link_bytes_per_s=1e10)
    result = plan(LLAMA3_8B, Training(2, 128, "bf16"), tiny_devices)
    assert not result.ranked and result.best is None
    assert result.why.startswith("nothing fits in 1.00 GB per device: the smallest layout, zero3 dp2")
    with pytest.raises(ConfigError, match=r"divides global_batch\(3\)"):
        plan(LLAMA3_8B, Training(3, 128), tiny_devices)


def test_the_plan_is_pure_and_its_figures_are_the_estimators() -> None:
    small = preset_shape("large", 64)
    training = Training(16, 64)
    machine = Machine(2, 4e9, 1e9)
    first, again = plan(small, training, machine), plan(small, training, machine)
    assert [c.as_dict() for c in first.ranked] == [c.as_dict() for c in again.ranked]
    top = first.ranked[0]
    assert top.memory == estimate_memory(small, training, top.layout)
    row = top.as_dict()
    assert row["fits"] and row["memory_bytes"] == top.memory.total and row["step_time_s"] > 0
    assert row["layout"] == top.layout.name() and row["strategy"] == top.layout.strategy


def test_tp_and_pp_layouts_are_searched_with_checkpointing_and_both_schedules() -> None:
    pp, tp = search_degrees(LLAMA3_8B, 8)
    assert (pp, tp) == ([1, 2, 4, 8], [1, 2, 4, 8])  # 8 key-value heads: tp 8 at most
    layouts = enumerate_layouts(LLAMA3_8B, Training(16, 128), 8, ["zero1"], pp, tp, offload=("none",))
    shapes = {(layout.dp, layout.pp, layout.tp) for layout in layouts}
    assert shapes == set(mesh_shapes(8, pp, tp)) and len(shapes) == 10
    assert any(layout.activation_checkpointing for layout in layouts if layout.tp == 2)
    staged = {(layout.schedule, layout.virtual_stages) for layout in layouts if layout.pp > 1}
    assert staged == {("1f1b", 1), ("interleaved", 2)}
    assert all(layout.schedule == "1f1b" for layout in layouts if layout.pp == 1)
    # pp x stages per rank may not exceed the blocks: a 6-block model takes no interleaved pp4
    small = ModelShape(n_layer=6, d_model=64, n_head=4, vocab=100, name="six")
    assert search_degrees(small, 12) == ([1, 2, 3, 4, 6], [1, 2, 4])
    pp4 = [layout for layout in enumerate_layouts(small, Training(8, 16), 4, ["ddp"], (4,)) if layout.pp == 4]
    assert pp4 and {layout.schedule for layout in pp4} == {"1f1b"}


def test_a_pipeline_layout_is_costed_with_its_bubble_and_in_flight_micro_batches() -> None:
    """1F1B on pp 4 at m micro-batches: the simulator's bubble is (pp - 1) / m of the compute, and the
    first stage holds min(m, pp) micro-batches of its blocks' activations, the last one."""
    from shardwise.planner.layout import Layout
    from shardwise.planner.pipeline import pair_peak, rank_shares
    from shardwise.planner.time import step_time

    machine = Machine(devices=4, device_memory=1e12, link_bytes_per_s=1e12)
    profile = machine.profile()
    for m in (2, 4, 8):
        layout = Layout("ddp", dp=1, pp=4, micro_batches=m)
        time = step_time(LLAMA3_8B, Training(8, 512), layout, profile)
        assert time.bubble_s == pytest.approx(3 / m * time.compute_s, rel=1e-9)
        first, *_, last = rank_shares(LLAMA3_8B, 4, "1f1b", 1)
        assert pair_peak(first, 4, "1f1b", m, 1.0, 1.0) == min(m, 4)
        assert pair_peak(last, 4, "1f1b", m, 1.0, 1.0) == 1


def test_on_a_dp_group_of_one_zero1_and_zero2_tie_with_ddp_and_ddp_ranks_first() -> None:
    """ZeRO-1/2 over dp = 1 shard nothing: the same time as DDP (the tied embedding's sum between the
    pipeline's ends used to hide behind their update, and ranked them first) and no less memory
    (their optimizer's temporaries are a bucket's, DDP's a tensor's), and the tie goes to the simpler
    strategy, whatever order --strategies named them in."""
    large = preset_shape("large", 64)  # tied embedding and head
    train = Training(16, 64)
    layouts = [
        layout
        for layout in enumerate_layouts(large, train, 8, ["zero2", "zero1", "ddp"], (8,), (1,), (False,))
        if layout.offload == "none"
    ]
    result = plan(large, train, H100S, layouts=layouts)
    by_mesh: dict[tuple[int, str, int], dict[str, float]] = {}
    for c in result.ranked:
        assert c.time is not None and c.layout.dp == 1
        key = (c.layout.micro_batches, c.layout.schedule, c.layout.virtual_stages)
        by_mesh.setdefault(key, {})[c.layout.strategy] = (c.time.total_s, c.memory.total)  # type: ignore[assignment]
    assert by_mesh and all(len({t for t, _ in v.values()}) == 1 for v in by_mesh.values())
    for v in by_mesh.values():  # DDP holds no more than they do: at most two 25 MB buckets' temporaries
        assert v["ddp"][1] <= min(v["zero1"][1], v["zero2"][1]) <= 1.10 * v["ddp"][1], v
    assert result.ranked[0].layout.strategy == "ddp"
    assert [c.layout.strategy for c in result.ranked[:3]] == ["ddp", "zero1", "zero2"]
    assert "zero1 shards nothing over a dp group of one: it does ddp's work" in result.why
    row = result.ranked[0].as_dict()  # built on meta: the build (its stage) is not the peak
    assert row["memory_peak_phase"] != "build"
