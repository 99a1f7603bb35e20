"""The shard arithmetic: offsets, padding, and the pieces each rank holds, checked by reassembly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.zero.flat_param import build_layout, layout_of, unique_parameters

SHAPES = [("a", (3, 5)), ("b", (7,)), ("c", (2, 2, 3))]  # 15 + 7 + 12 = 34 elements


def test_offsets_and_padding() -> None:
    layout = build_layout(SHAPES, world_size=4)
    assert [(s.name, s.offset, s.numel) for s in layout.slots] == [("a", 0, 15), ("b", 15, 7), ("c", 22, 12)]
    assert layout.total_numel == 34
    assert layout.shard_size == 9  # ceil(34 / 4)
    assert layout.padded_numel == 36 and layout.padding() == 2
    assert layout.shard_range(3) == (27, 36)


def test_pieces_of_one_rank() -> None:
    layout = build_layout(SHAPES, world_size=4)
    pieces = layout.overlaps(1)  # elements 9..18: a[9:15] then b[0:3]
    assert [(p.name, p.param_start, p.param_end, p.shard_start, p.shard_end) for p in pieces] == [
        ("a", 9, 15, 0, 6),
        ("b", 0, 3, 6, 9),
    ]
    last = layout.overlaps(3)  # elements 27..36: c[5:12] then two padding elements
    assert [(p.name, p.param_start, p.param_end, p.shard_start, p.shard_end) for p in last] == [
        ("c", 5, 12, 0, 7)
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 40])
def test_pieces_reassemble_every_parameter(world_size: int) -> None:
    layout = build_layout(SHAPES, world_size)
    tensors = {name: torch.randn(shape) for name, shape in SHAPES}
    rebuilt = {name: torch.full((t.numel(),), float("nan")) for name, t in tensors.items()}
    covered = 0
    for rank in range(world_size):
        flat = torch.cat([t.reshape(-1) for t in tensors.values()])
        flat = torch.cat([flat, flat.new_zeros(layout.padding())])
        start, end = layout.shard_range(rank)
        shard = flat[start:end]
        for p in layout.overlaps(rank):
            rebuilt[p.name][p.param_start : p.param_end] = shard[p.shard_start : p.shard_end]
            covered += p.numel
    assert covered == layout.total_numel
    for name, t in tensors.items():
        assert torch.equal(rebuilt[name].view(t.shape), t)


def test_unique_parameters_skips_tied_and_frozen() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    frozen = nn.Linear(3, 3)
    frozen.weight.requires_grad_(False)
    model = nn.ModuleDict({"emb": emb, "mid": frozen, "head": head})
    named = unique_parameters(model.named_parameters(remove_duplicate=False))
    assert [n for n, _ in named] == ["emb.weight", "mid.bias"]
    assert layout_of(named, 2).total_numel == 15 + 3


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="repeat"):
        build_layout([("a", (2,)), ("a", (3,))], 2)
    with pytest.raises(ValueError, match="world_size"):
        build_layout(SHAPES, 0)
    with pytest.raises(ValueError, match="outside"):
        build_layout(SHAPES, 2).shard_range(2)
