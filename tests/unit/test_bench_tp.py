"""The pure parts of ``shardwise bench tp``: Megatron's count per block, the per-block subtraction, the
ratios, the row summary, the settings check and the DTensor side's split q/k/v copy."""

from __future__ import annotations

import pytest
import torch

from shardwise.bench.tp import (
    SplitQKVAttention,
    check_tp_settings,
    collectives_entry,
    megatron_per_block,
    per_block,
    ratios,
    summarize,
)
from shardwise.config import ConfigError
from shardwise.models.gpt import CausalSelfAttention, GPTConfig


def test_megatron_count_without_sequence_parallelism() -> None:
    # 4 all-reduces of b*s*h = 2*16*64 floats; each sends 2(n-1)/n of it on tp 2
    out = megatron_per_block(False, tokens=32, hidden=64, tp=2)
    assert out["ops"] == {"all_reduce": 4}
    assert out["activation_bytes_sent"] == 4 * 32 * 64 * 4
    assert out["sequence_parallel_grad_bytes_sent"] == 0 and out["bytes_sent"] == out["activation_bytes_sent"]


def test_megatron_count_with_sequence_parallelism_moves_the_same_activation_bytes() -> None:
    for tp in (2, 4):
        plain = megatron_per_block(False, tokens=32, hidden=64, tp=tp)
        sp = megatron_per_block(True, tokens=32, hidden=64, tp=tp)
        assert sp["ops"] == {"all_gather": 4, "reduce_scatter": 4}
        assert sp["activation_bytes_sent"] == plain["activation_bytes_sent"]
        # two norms (weight, bias) and two row biases: 6 * hidden floats, all-reduced once per step
        assert sp["sequence_parallel_grad_bytes_sent"] == 2 * (tp - 1) * 6 * 64 * 4 // tp
        assert sp["bytes_sent"] == sp["activation_bytes_sent"] + sp["sequence_parallel_grad_bytes_sent"]


def test_per_block_subtracts_what_lies_outside_the_blocks() -> None:
    # 5 blocks of 4 all-reduces plus 3 outside; 1 block plus the same 3 outside
    full = {"ops": {"all_reduce": 23, "broadcast": 1}, "bytes_sent": 5 * 100 + 40}
    fewer = {"ops": {"all_reduce": 7, "broadcast": 1}, "bytes_sent": 100 + 40}
    assert per_block(full, fewer, 5, 1) == {"ops": {"all_reduce": 4}, "bytes_sent": 100}


def test_per_block_keeps_a_fraction_that_shows_the_count_is_off() -> None:
    out = per_block(
        {"ops": {"all_reduce": 10}, "bytes_sent": 10}, {"ops": {"all_reduce": 1}, "bytes_sent": 0}, 3, 1
    )
    assert out["ops"] == {"all_reduce": 4.5} and out["bytes_sent"] == 5


def test_per_block_needs_more_blocks_in_the_full_model() -> None:
    with pytest.raises(ValueError, match="more blocks"):
        per_block({"ops": {}, "bytes_sent": 0}, {"ops": {}, "bytes_sent": 0}, 1, 1)


def test_matches_megatron_needs_ops_and_bytes() -> None:
    megatron = megatron_per_block(False, tokens=8, hidden=4, tp=2)
    same = {"ops": {"all_reduce": 4}, "bytes_sent": megatron["bytes_sent"]}
    assert collectives_entry(same, megatron)["matches_megatron"] is True
    assert not collectives_entry({**same, "bytes_sent": 1}, megatron)["matches_megatron"]
    assert not collectives_entry({**same, "ops": {"all_reduce": 5}}, megatron)["matches_megatron"]


def test_summary_takes_the_slowest_rank_and_medians_then_ratios() -> None:
    reps = [
        [{"step_s": 1.0, "peak_bytes": 10}, {"step_s": 2.0, "peak_bytes": 12}],
        [{"step_s": 4.0, "peak_bytes": 30}, {"step_s": 1.0, "peak_bytes": 14}],
        [{"step_s": 0.5, "peak_bytes": 20}, {"step_s": 1.0, "peak_bytes": 16}],
    ]
    ours = summarize(reps, tokens=100)  # slowest ranks 2, 4, 1 -> median 2 s
    assert ours == {
        "tokens_per_s": 50.0,
        "step_s": 2.0,
        "peak_at": "",
        "peak_tensor_bytes_per_rank": [20, 14],
    }
    theirs = {"tokens_per_s": 25.0, "step_s": 4.0, "peak_tensor_bytes_per_rank": [40, 10]}
    assert ratios(ours, theirs) == {"speed_ratio": 2.0, "memory_ratio": 0.5}


@pytest.mark.parametrize(
    ("nproc", "preset", "seq_len", "rows", "message"),
    [
        (2, "odd", 64, ("tp",), "n_head 3 is not divisible by tp 2"),
        (2, "nope", 64, ("tp",), "unknown gpt preset"),
        (1, "small", 64, ("tp",), "at least 2 ranks"),
        (2, "small", 63, ("tp+sp",), "--seq-len 63 is not divisible by tp 2"),
        (2, "small", 64, ("tp", "sp"), "unknown --rows sp"),
    ],
)
def test_settings_the_bench_cannot_run_are_one_line(
    nproc: int, preset: str, seq_len: int, rows: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_tp_settings(nproc, preset, seq_len, rows)
    check_tp_settings(2, "small", 63, ("tp",))  # no sequence parallelism: any length


def test_split_qkv_copy_computes_what_the_fused_attention_does() -> None:
    torch.manual_seed(0)
    fused = CausalSelfAttention(GPTConfig(n_head=4, d_model=32)).double()
    split = SplitQKVAttention(fused)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    assert torch.allclose(split(x), fused(x), rtol=0, atol=1e-12)
