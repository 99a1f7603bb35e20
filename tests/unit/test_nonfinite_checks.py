"""The non-finite checks every step runs (``first_nonfinite``, ``nonfinite_names``, ``all_finite``):
exact for every floating dtype, wherever the NaN or inf sits in a large tensor, with finite values as
large as the dtype holds counted finite (nothing may overflow into a false alarm). On the CPU here and,
where there is one, on a GPU (the multi-tensor kernel there is another implementation)."""

from __future__ import annotations

import pytest
import torch

from shardwise.engine.nonfinite import all_finite, first_nonfinite, nonfinite_names

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA on this machine"),
    ),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BAD = [float("nan"), float("inf"), float("-inf")]


def _large(dtype: torch.dtype, device: str, at: int | None = None, value: float = 0.0) -> torch.Tensor:
    """200,003 elements (over several multi-tensor chunks), the largest finite value of ``dtype`` in
    one place, and ``value`` at ``at``."""
    t = torch.randn(200_003, device=device).to(dtype)
    t[7] = torch.finfo(dtype).max
    t[8] = -torch.finfo(dtype).max
    if at is not None:
        t[at] = value
    return t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_largest_finite_values_count_finite(device: str, dtype: torch.dtype) -> None:
    tensors = [_large(dtype, device), torch.full((3,), torch.finfo(dtype).max, dtype=dtype, device=device)]
    assert bool(all_finite(tensors))
    assert first_nonfinite([("a", tensors[0]), ("b", tensors[1])]) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("at", [0, 65_537, 200_002])
def test_a_nan_or_inf_anywhere_is_found(device: str, dtype: torch.dtype, bad: float, at: int) -> None:
    clean, dirty = _large(dtype, device), _large(dtype, device, at, bad)
    assert not bool(all_finite([clean, dirty]))
    assert bool(all_finite([clean]))
    assert first_nonfinite([("clean", clean), ("dirty", dirty)]) == "dirty"


@pytest.mark.parametrize("device", DEVICES)
def test_names_come_in_the_order_given_across_dtypes_missing_and_empty_tensors(device: str) -> None:
    def t(dtype: torch.dtype, bad: float | None = None) -> torch.Tensor:
        out = torch.ones(5, dtype=dtype, device=device)
        if bad is not None:
            out[2] = bad
        return out

    empty = torch.empty(0, device=device)
    named = [
        ("w0", t(torch.float32)),
        ("w1", t(torch.bfloat16, float("nan"))),
        ("none", None),
        ("empty", empty),
        ("w2", t(torch.float64)),
        ("w3", t(torch.float16, float("-inf"))),
    ]
    assert nonfinite_names(named) == ["w1", "w3"]
    assert first_nonfinite(named) == "w1"
    assert nonfinite_names([("none", None), ("empty", empty)]) == []
    assert bool(all_finite([empty]))
    flag = all_finite([t(torch.float32), t(torch.float16, float("inf"))])
    assert flag.device.type == torch.device(device).type and flag.dim() == 0  # left on the device
    assert not bool(flag)


def test_integer_and_bool_tensors_count_finite_and_no_tensors_at_all_is_finite() -> None:
    ints, flags = torch.tensor([1, 2, 3]), torch.tensor([True, False])
    assert bool(all_finite([ints, flags])) and bool(all_finite([]))
    named = [("ints", ints), ("nan", torch.tensor([float("nan")])), ("flags", flags)]
    assert nonfinite_names(named) == ["nan"]
