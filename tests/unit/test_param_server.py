"""Parameter-to-server assignment: balanced by bytes, deterministic, complete."""

from __future__ import annotations

import pytest

from shardwise.config import ConfigError
from shardwise.data_parallel.param_server import assign_to_servers
from shardwise.data_parallel.ps_messages import flatten, unflatten_into


def test_largest_first_into_the_lightest_server() -> None:
    sizes = {"a": 40, "b": 10, "c": 30, "d": 20, "e": 20}
    # a(40) -> s0; c(30) -> s1; d(20) -> s1 (30 < 40); e(20) -> s0 (40 < 50); b(10) -> s1 (50 < 60)
    assert assign_to_servers(sizes, 2) == [["a", "e"], ["b", "c", "d"]]


def test_every_parameter_once_and_loads_within_the_largest_item() -> None:
    sizes = {f"p{i}": (i * 37) % 101 + 1 for i in range(40)}
    for servers in (1, 2, 3, 5):
        chosen = assign_to_servers(sizes, servers)
        flat = [n for names in chosen for n in names]
        assert sorted(flat) == sorted(sizes)
        loads = [sum(sizes[n] for n in names) for names in chosen]
        # greedy largest-first: the spread never exceeds the largest single parameter
        assert max(loads) - min(loads) <= max(sizes.values())


def test_deterministic_ties_and_more_servers_than_parameters() -> None:
    sizes = {"x": 8, "y": 8, "z": 8}
    assert assign_to_servers(sizes, 2) == [["x", "z"], ["y"]]
    assert assign_to_servers(sizes, 4) == [["x"], ["y"], ["z"], []]
    assert assign_to_servers(dict(sizes), 2) == assign_to_servers(sizes, 2)


def test_rejects_zero_servers() -> None:
    with pytest.raises(ConfigError, match="at least one server"):
        assign_to_servers({"a": 1}, 0)


def test_flatten_roundtrip_with_header_slots() -> None:
    import torch

    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0])]
    flat = flatten(tensors, 3)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 0, 0, 0]
    out = [torch.zeros(2, 3), torch.zeros(1)]
    unflatten_into(flat, out)
    assert torch.equal(out[0], tensors[0]) and torch.equal(out[1], tensors[1])
