"""Tensor-parallel shard arithmetic, the RNG tracker and plan refusals, in one process (no communication:
cutting a model reads only the tp axis's size and this rank's place in it)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shardwise.checkpoint.boxes import Box
from shardwise.models.adapters.gpt import gpt_plan
from shardwise.models.adapters.plan import Colwise, TensorParallelPlan
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.tensor_parallel import apply_tensor_parallel
from shardwise.tensor_parallel.layers import qkv_sections
from shardwise.tensor_parallel.random import RNGStatesTracker, tensor_parallel_tracker
from shardwise.tensor_parallel.shards import assemble, even_share, replicated, split_dim, split_sections


def _axis(rank: int, tp: int) -> Any:
    return SimpleNamespace(rank=rank, world_size=tp)


def test_an_uneven_split_is_refused_with_the_arithmetic() -> None:
    with pytest.raises(ValueError, match=r"^hidden 10 is not divisible by tp 4$"):
        even_share(10, 4, "hidden")
    with pytest.raises(ValueError, match="input width 10 is not divisible by tp 4"):
        split_dim("w", (3, 10), 1, 4, 0, "input width")


def test_a_fused_qkv_is_cut_so_each_rank_holds_its_heads_q_k_and_v() -> None:
    full = torch.arange(12 * 2).reshape(12, 2)  # q rows 0-3, k rows 4-7, v rows 8-11
    cut = split_sections("qkv.weight", full.shape, 0, (4, 4, 4), 2, 1, ("q", "k", "v"))
    assert cut.local_shape == (6, 2)
    assert [p.global_box for p in cut.placements] == [
        Box((2, 0), (2, 2)),
        Box((6, 0), (2, 2)),
        Box((10, 0), (2, 2)),
    ]
    assert torch.equal(cut.take(full), full[[2, 3, 6, 7, 10, 11]])
    ranks = [split_sections("qkv.weight", full.shape, 0, (4, 4, 4), 2, r, ("q", "k", "v")) for r in range(2)]
    assert torch.equal(assemble(ranks, [r.take(full) for r in ranks]), full)


def test_assemble_refuses_boxes_that_do_not_cover_the_tensor_once() -> None:
    full = torch.zeros(4, 2)
    twice = [split_dim("w", full.shape, 0, 2, 0, "rows")] * 2  # both ranks claim rows 0-1
    with pytest.raises(ValueError, match="exactly once"):
        assemble(twice, [torch.zeros(2, 2)] * 2)
    assert replicated("b", (3,)).replicated


def test_grouped_query_attention_needs_tp_to_divide_the_key_value_heads() -> None:
    assert qkv_sections(8 * 4, n_head=4, n_kv_head=2, tp=2)[0] == (16, 8, 8)
    with pytest.raises(ValueError, match=r"^n_kv_head 2 is not divisible by tp 4"):
        qkv_sections(8 * 4, n_head=4, n_kv_head=2, tp=4)
    with pytest.raises(ValueError, match=r"^n_head 3 is not divisible by tp 2"):
        qkv_sections(3 * 3 * 4, n_head=3, n_kv_head=3, tp=2)


def test_the_tracker_forks_without_touching_the_default_stream() -> None:
    torch.manual_seed(0)
    expected_default = torch.rand(3)
    torch.manual_seed(0)
    tracker = tensor_parallel_tracker(seed=7, tp_rank=1)
    with tracker.fork():
        first = torch.rand(3)
        with tracker.fork():  # re-entering the state swapped in does nothing
            second = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_default)  # the default stream went on as if untouched
    private = torch.Generator().manual_seed(7 + 2718 + 1)
    assert torch.equal(first, torch.rand(3, generator=private))
    assert torch.equal(second, torch.rand(3, generator=private))
    saved = tracker.get_states()
    with tracker.fork():
        again = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(3), again)  # states restored: the same draws (recomputation)
    with pytest.raises(KeyError, match="never added"):
        RNGStatesTracker().enter("nope")


def test_plans_refuse_heads_tp_does_not_divide_and_patterns_that_miss() -> None:
    odd = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=3, d_model=12))
    with pytest.raises(ValueError, match=r"^n_head 3 is not divisible by tp 2"):
        apply_tensor_parallel(odd, _axis(0, 2), gpt_plan(3))
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8))
    with pytest.raises(ValueError, match=re.escape("pattern 'blocks.*.mlp.nope' matches no module")):
        apply_tensor_parallel(model, _axis(0, 2), TensorParallelPlan("p", {"blocks.*.mlp.nope": Colwise()}))
    both = TensorParallelPlan("p", {"blocks.*.mlp.fc": Colwise(), "blocks.0.mlp.fc": Colwise()})
    with pytest.raises(ValueError, match=r"blocks.0.mlp.fc matches both"):
        apply_tensor_parallel(model, _axis(0, 2), both)
    with pytest.raises(ValueError, match="vocab_size 15 is not divisible by tp 2"):
        apply_tensor_parallel(
            GPT(GPTConfig(vocab_size=15, seq_len=8, n_head=2, d_model=8)), _axis(0, 2), gpt_plan(2)
        )


def test_a_cut_gpt_names_every_parameter_with_its_global_box() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = apply_tensor_parallel(model, _axis(1, 2), gpt_plan(2))
    assert set(layout.params) == set(full)  # the global names survive; the tied head is wte's
    assert model.head.weight is model.wte.weight
    for name, param in model.named_parameters():
        record = layout.params[name]
        assert record.global_shape == tuple(full[name].shape)
        assert torch.equal(param.detach(), record.take(full[name])), name
    assert layout.params["blocks.0.ln_1.weight"].replicated
    assert layout.params["blocks.0.mlp.fc.weight"].placements[0].global_box == Box((16, 0), (16, 8))
