from __future__ import annotations

import torch
from torch import nn

from shardwise.data_parallel.ddp import plan_buckets


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def _indices(params: list[nn.Parameter], groups: list[list[nn.Parameter]]) -> list[list[int]]:
    where = {id(p): i for i, p in enumerate(params)}
    return [[where[id(p)] for p in group] for group in groups]


def test_buckets_take_parameters_in_reverse_with_a_small_first_bucket() -> None:
    params = _params(10, 10, 10, 10, 10)  # 40 bytes each
    groups = plan_buckets(params, bucket_bytes=120, first_bucket_bytes=40)
    assert _indices(params, groups) == [[4], [3, 2, 1], [0]]


def test_a_parameter_over_the_cap_gets_its_own_bucket_and_dtypes_never_mix() -> None:
    params = _params(1, 100, 1) + _params(1, dtype=torch.float64)
    groups = plan_buckets(params, bucket_bytes=64, first_bucket_bytes=64)
    assert _indices(params, groups) == [[3], [2], [1], [0]]
