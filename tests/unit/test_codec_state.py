"""Codec states through checkpoint pieces and back (``engine.codec_state``), without processes.

A dict of saved tensors stands for the checkpoint; the states after a restore must equal the saved
ones exactly (residual, reduction count, DGC's velocity, PowerSGD's Q), and a layout or bucket
mismatch must leave fresh states with one ``CheckpointWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import pytest
import torch

from shardwise.checkpoint import CheckpointWarning
from shardwise.compression import CompressedComm, build_codec, segments_of
from shardwise.config import CommConfig
from shardwise.engine.codec_state import codec_layout, codec_pieces, read_codec_states, restore_codec_states
from shardwise.engine.state import Span

SHAPES = [(12, 8), (8,), (6, 10)]


class DictReader:
    """A ``StateReader`` over whole saved tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.tensors.items()}

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]:
        return {n: self.tensors[n].clone() for n in requests}


def _states(spec: str, buckets: int = 2):
    layer = CompressedComm(None, build_codec(CommConfig(compress=spec)))
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    return layer, [layer.new_state(numel, torch.float64, segments_of(SHAPES)) for _ in range(buckets)]


def _saved(spec: str, layout: str, rank: int = 0) -> tuple[list, DictReader]:
    layer, states = _states(spec)
    gen = torch.Generator().manual_seed(0)
    for state in states:
        for _ in range(3):  # a few messages: residuals, counts and codec tensors to keep
            layer.pack(torch.randn(state.numel, generator=gen, dtype=torch.float64), state)
    pieces = codec_pieces(states, layout, rank)
    return states, DictReader({p.name: p.tensor.reshape(p.global_shape) for p in pieces})


@pytest.mark.parametrize("spec", ["topk:0.1", "dgc:0.1", "int8", "none"])
def test_states_come_back_exactly(spec: str) -> None:
    layout = codec_layout("ddp", 2, spec)
    saved, reader = _saved(spec, layout, rank=1)
    _, fresh = _states(spec)
    restore_codec_states(fresh, read_codec_states(fresh, layout, 1, reader))
    for a, b in zip(saved, fresh, strict=True):
        assert a.reductions == b.reductions == 3
        assert (a.residual is None and b.residual is None) or torch.equal(a.residual, b.residual)
        tensors = {k for k, v in a.extra.items() if torch.is_tensor(v)}
        assert tensors == {k for k, v in b.extra.items() if torch.is_tensor(v)}
        assert all(torch.equal(a.extra[k], b.extra[k]) for k in tensors)
    if spec == "dgc:0.1":
        assert "velocity" in saved[0].extra


def test_powersgd_keeps_its_warm_start() -> None:
    layout = codec_layout("ddp", 1, "powersgd:2")
    layer, states = _states("powersgd:2", buckets=1)
    comm = _OneRank()
    layer.comm = comm
    layer.reduce(torch.randn(states[0].numel, dtype=torch.float64), states[0])
    pieces = codec_pieces(states, layout, 0)
    reader = DictReader({p.name: p.tensor.reshape(p.global_shape) for p in pieces})
    assert f"codec/{layout}/rank0/0/extra/q" in reader.shapes
    _, fresh = _states("powersgd:2", buckets=1)
    restore_codec_states(fresh, read_codec_states(fresh, layout, 0, reader))
    assert torch.equal(fresh[0].extra["q"], states[0].extra["q"])


class _OneRank:
    """A ``Comm`` of one rank: every collective is the identity."""

    world_size, rank = 1, 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        return _Done()


class _Done:
    def wait(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("layout", "buckets", "words"),
    [
        (codec_layout("ddp", 4, "topk:0.1"), 2, "none saved for this layout"),  # another world size
        (codec_layout("ddp", 2, "topk:0.1"), 3, "2 buckets saved, 3 here"),  # other buckets
    ],
)
def test_a_mismatch_starts_afresh_with_one_warning(layout: str, buckets: int, words: str) -> None:
    _, reader = _saved("topk:0.1", codec_layout("ddp", 2, "topk:0.1"))
    _, fresh = _states("topk:0.1", buckets)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = read_codec_states(fresh, layout, 0, reader)
    assert saved is None
    assert [w.category for w in caught] == [CheckpointWarning]
    assert words in str(caught[0].message) and "ddp.world2.topk_0.1" in str(caught[0].message)


def test_no_codec_state_in_the_checkpoint_is_silent() -> None:
    _, fresh = _states("topk:0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_codec_states(fresh, "x", 0, DictReader({"model/w": torch.zeros(2)})) is None
