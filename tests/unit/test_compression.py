"""Codecs without processes: round-trip error bounds, the error-feedback invariant, identical sums.

Several "ranks" run as threads of this process over ``_ThreadComm``, which does an all-reduce or an
all-gather by meeting at a barrier (rank order, like gloo for two ranks), so the codec layer runs its real
rounds with no process group.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardwise.collectives.p2p import Done
from shardwise.compression import (
    CompressedComm,
    Segment,
    build_codec,
    check_compress,
    parse_spec,
    segments_of,
)
from shardwise.compression.cast import CastCodec, IdentityCodec
from shardwise.compression.codec import CodecState, chunks_of, concat_bytes, gaps_of, split_bytes
from shardwise.compression.int8 import Int8Codec
from shardwise.compression.powersgd import make_plan
from shardwise.compression.sign import SignCodec, pack_bits, unpack_bits
from shardwise.compression.topk import TopKCodec
from shardwise.config import CommConfig, ConfigError

CODECS = ["none", "fp16", "bf16", "int8", "int8:64", "sign", "sign:64", "topk:0.1", "dgc:0.1", "powersgd:2"]


class _Group:
    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world
        self.bytes_sent = [0] * world


class _ThreadComm:
    """The part of ``Comm`` the codec layer uses, over threads: rank-ordered sums, gathers."""

    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world

    def _meet(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.group.slots[self.rank] = tensor.clone()
        self.group.barrier.wait()
        everyone = list(self.group.slots)
        self.group.barrier.wait()
        return everyone

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, **_: Any) -> Done:
        everyone = self._meet(tensor)
        n = self.world_size
        self.group.bytes_sent[self.rank] += int(2 * (n - 1) / n * tensor.numel() * tensor.element_size())
        out = everyone[0].clone()
        for other in everyone[1:]:
            out = torch.maximum(out, other) if op == "max" else out + other
        tensor.copy_(out)
        return Done()

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, **_: Any) -> Done:
        everyone = self._meet(shard)
        self.group.bytes_sent[self.rank] += (self.world_size - 1) * shard.numel() * shard.element_size()
        output.copy_(torch.cat([t.reshape(-1) for t in everyone]))
        return Done()


def _on_threads(world: int, fn: Callable[[int, _ThreadComm], Any]) -> tuple[list[Any], _Group]:
    group = _Group(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, _ThreadComm(group, rank))
        except BaseException as exc:  # re-raised below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results, group


SHAPES = [(24, 16), (16,), (8, 12), (5,), (24, 16), (3, 4, 2)]  # matrices, biases, a 3-D tensor
NUMEL = sum(math.prod(s) for s in SHAPES)
TOPK_1PCT = sum(math.ceil(0.01 * math.prod(s)) for s in SHAPES)  # top-k picks tensor by tensor


def _grad(rank: int, step: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(NUMEL, generator=g, dtype=dtype)


# -- one message: encode then decode -----------------------------------------------------------------


def _roundtrip(codec: Any, x: torch.Tensor) -> torch.Tensor:
    state = CodecState(x.numel(), x.dtype, (Segment(0, (x.numel(),)),))
    wire, sent = codec.encode(x.clone(), state)
    total = torch.zeros_like(x)
    codec.accumulate(total, wire, state)
    assert torch.equal(total, sent), "what a rank says it sent must be what the others decode"
    return total


def test_identity_is_exact() -> None:
    x = _grad(0, 0)
    assert torch.equal(_roundtrip(IdentityCodec("none"), x), x)


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float16, 11), (torch.bfloat16, 8)])
def test_casts_round_to_their_precision(dtype: torch.dtype, bits: int) -> None:
    x = _grad(0, 0, torch.float32)
    out = _roundtrip(CastCodec("c", dtype), x)
    assert ((out - x).abs() <= x.abs() * 2.0**-bits + 1e-7).all()


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_int8_error_is_half_a_step_of_its_chunk(chunk: int) -> None:
    x = _grad(0, 0, torch.float32) * torch.linspace(0.01, 10, NUMEL)  # chunks of very different scale
    out = _roundtrip(Int8Codec("int8", chunk), x)
    pad = (-NUMEL) % chunk
    step = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, chunk).amax(1) / 127
    bound = step.repeat_interleave(chunk)[:NUMEL] / 2
    assert ((out - x).abs() <= bound * (1 + 1e-5) + 1e-12).all()


@pytest.mark.parametrize("chunk", [1, 5, 64, 10_000])
def test_sign_keeps_each_chunks_l1_norm(chunk: int) -> None:
    x = _grad(0, 0)
    out = _roundtrip(SignCodec("sign", chunk), x)
    assert torch.equal(out.sign(), torch.where(x >= 0, 1.0, -1.0).to(out.dtype))
    for start in range(0, NUMEL, chunk):
        a, b = x[start : start + chunk], out[start : start + chunk]
        assert torch.allclose(b.abs().sum(), a.abs().sum(), rtol=1e-12)
        assert torch.allclose(b.abs(), b.abs()[0].expand_as(b))


def test_packed_bits_round_trip() -> None:
    for n in (1, 7, 8, 9, 1000):
        bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
        packed = pack_bits(bits)
        assert packed.numel() == -(-n // 8) and packed.dtype == torch.uint8
        assert torch.equal(unpack_bits(packed, n), bits)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 1.0])
def test_topk_sends_the_largest_and_bounds_the_error(ratio: float) -> None:
    x = _grad(0, 0)
    out = _roundtrip(TopKCodec("topk", ratio), x)
    k = max(1, math.ceil(ratio * NUMEL))
    kept = out != 0
    assert int(kept.sum()) == k
    assert torch.equal(out[kept], x[kept])
    if k < NUMEL:
        assert x[~kept].abs().max() <= x[kept].abs().min()
    assert (x - out).pow(2).sum() <= (1 - k / NUMEL) * x.pow(2).sum() + 1e-12


def test_byte_packing_survives_misaligned_rows() -> None:
    values, index = torch.randn(3, dtype=torch.float64), torch.tensor([5, 1, 9], dtype=torch.int32)
    data = torch.cat([torch.zeros(3, dtype=torch.uint8), concat_bytes(values, index)])[3:]  # offset 3
    v, i = split_bytes(data, (3, torch.float64), (3, torch.int32))
    assert torch.equal(v, values) and torch.equal(i, index)


def test_dgc_warmup_density_falls_exponentially_to_the_ratio() -> None:
    codec = TopKCodec("dgc:0.001", 0.001, dgc=True, warmup_steps=8)
    state = CodecState(10, torch.float32, ())
    seen = []
    for t in range(10):
        state.reductions = t
        seen.append(codec.density(state))
    assert seen == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]


# -- several ranks ---------------------------------------------------------------------------------------


def _reduce_steps(spec: str, world: int, steps: int, dtype: torch.dtype = torch.float64, **cfg: Any):
    """Each rank reduces its own gradient for ``steps`` steps; returns per rank the totals, what it
    sent, its final residual and the gradients it was given."""

    def rank_fn(rank: int, comm: _ThreadComm) -> dict[str, Any]:
        layer = CompressedComm(
            comm, build_codec(CommConfig(compress=spec, **cfg)), cfg.get("compress_start_step", 0)
        )
        state = layer.new_state(NUMEL, dtype, segments_of(SHAPES))
        totals, sent, grads = [], [], []
        for step in range(steps):
            g = _grad(rank, step, dtype)
            bucket = g.clone()
            work = layer.reduce(bucket, state, async_op=True)
            work.wait()
            assert work.result is not None
            totals.append(bucket)
            sent.append(work.result.sent)
            grads.append(g)
        residual = state.residual if state.residual is not None else torch.zeros(NUMEL, dtype=dtype)
        return {"totals": totals, "sent": sent, "residual": residual, "grads": grads}

    return _on_threads(world, rank_fn)


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_same_sum(spec: str, world: int) -> None:
    results, _ = _reduce_steps(spec, world, steps=3)
    for step in range(3):
        for other in results[1:]:
            assert torch.equal(other["totals"][step], results[0]["totals"][step])


@pytest.mark.parametrize("spec", [s for s in CODECS if not s.startswith("dgc")])
def test_error_feedback_sent_plus_residual_is_the_sum_of_gradients(spec: str) -> None:
    """Per rank, over 5 steps: what it sent plus what it still holds == the gradients it was given."""
    results, _ = _reduce_steps(spec, 2, steps=5)
    for r in results:
        sent = torch.stack(r["sent"]).sum(0) + r["residual"]
        given = torch.stack(r["grads"]).sum(0)
        assert torch.allclose(sent, given, rtol=0, atol=1e-12), float((sent - given).abs().max())


@pytest.mark.parametrize("spec", ["none", "topk:0.05", "fp16"])
def test_error_feedback_is_exact_on_a_dyadic_grid(spec: str) -> None:
    """Gradients on a coarse binary grid: every add and subtract is exact, so equality is bit for bit."""

    def rank_fn(rank: int, comm: _ThreadComm) -> tuple[torch.Tensor, torch.Tensor]:
        layer = CompressedComm(comm, build_codec(CommConfig(compress=spec)))
        state = layer.new_state(64, torch.float64)
        sent, given = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
        for step in range(6):
            g = torch.randint(-512, 512, (64,), generator=torch.Generator().manual_seed(step * 7 + rank))
            g = g.to(torch.float64) / 64
            work = layer.reduce(g.clone(), state)
            assert work.result is not None
            sent += work.result.sent
            given += g
        residual = state.residual if state.residual is not None else torch.zeros(64, dtype=torch.float64)
        return sent + residual, given

    results, _ = _on_threads(2, rank_fn)
    for total, given in results:
        assert torch.equal(total, given)


def test_identity_sum_is_the_plain_sum_bit_for_bit() -> None:
    results, _ = _reduce_steps("none", 4, steps=2, dtype=torch.float32)
    for step in range(2):
        plain = _grad(0, step, torch.float32)
        for rank in range(1, 4):
            plain = plain + _grad(rank, step, torch.float32)
        assert torch.equal(results[0]["totals"][step], plain)


@pytest.mark.parametrize("world", [2, 4])
def test_lossy_sums_are_close_to_the_true_sum(world: int) -> None:
    bounds = {"fp16": 2e-3, "bf16": 2e-2, "int8": 0.05 * world}
    for spec, bound in bounds.items():
        results, _ = _reduce_steps(spec, world, steps=1, dtype=torch.float32)
        true = sum(_grad(r, 0, torch.float32) for r in range(world))
        err = (results[0]["totals"][0] - true).abs().max() / true.abs().max()
        assert err < bound, (spec, float(err))


def test_powersgd_is_exact_on_low_rank_gradients() -> None:
    """Every rank's matrix is a multiple of one rank-1 matrix: rank 1 captures the sum exactly."""
    u, v = torch.randn(24, 1, dtype=torch.float64), torch.randn(1, 16, dtype=torch.float64)

    def rank_fn(rank: int, comm: _ThreadComm) -> torch.Tensor:
        layer = CompressedComm(comm, build_codec(CommConfig(compress="powersgd:1")))
        state = layer.new_state(24 * 16, torch.float64, [Segment(0, (24, 16))])
        bucket = ((rank + 1) * u @ v).reshape(-1)
        layer.reduce(bucket, state)
        return bucket

    results, _ = _on_threads(2, rank_fn)
    assert torch.allclose(results[0], (3 * u @ v).reshape(-1), atol=1e-12)


def test_powersgd_plan_follows_torch() -> None:
    state = CodecState(NUMEL, torch.float32, segments_of(SHAPES), gaps_of(NUMEL + 3, segments_of(SHAPES)))
    plan = make_plan(state, rank=2, min_rate=2.0)
    # compressed: (24, 16) twice (grouped by shape), then (8, 12); (3, 4, 2) is (3, 8): (3+8)*2*2 > 24
    assert [(m.rows, m.cols, m.rank) for m in plan.matrices] == [(24, 16, 2), (24, 16, 2), (8, 12, 2)]
    assert plan.p_numel == 2 * (24 + 24 + 8) and plan.q_numel == 2 * (16 + 16 + 12)
    assert plan.plain[-1] == (NUMEL, NUMEL + 3)  # the gap is sent as it is


@pytest.mark.parametrize(
    ("spec", "ratio"),
    [
        ("none", 1.0),
        ("fp16", 0.5),
        ("int8", 0.25 + 1 / 512),
        ("sign", 1 / 32 + len(SHAPES) * 4 / (4 * NUMEL)),  # a scale per tensor (each < 2048)
        ("topk:0.01", TOPK_1PCT * 8 / (4 * NUMEL)),
    ],
)
def test_bytes_on_the_wire(spec: str, ratio: float) -> None:
    """Bytes per rank against an fp32 all-reduce of the same bucket (2 ranks), as the docstrings say."""
    _, group = _reduce_steps(spec, 2, steps=1, dtype=torch.float32)
    plain = 2 * (2 - 1) / 2 * NUMEL * 4
    assert group.bytes_sent[0] / plain == pytest.approx(ratio, rel=0.1, abs=0.004)


def test_start_step_sends_the_first_reductions_uncompressed() -> None:
    results, _ = _reduce_steps("topk:0.01", 2, steps=3, compress_start_step=2)
    true = [_grad(0, s) + _grad(1, s) for s in range(3)]
    assert torch.equal(results[0]["totals"][0], true[0]) and torch.equal(results[0]["totals"][1], true[1])
    assert int((results[0]["totals"][2] != 0).sum()) <= 2 * TOPK_1PCT


def test_gaps_stay_zero() -> None:
    def rank_fn(rank: int, comm: _ThreadComm) -> torch.Tensor:
        layer = CompressedComm(comm, build_codec(CommConfig(compress="sign")))
        state = layer.new_state(20, torch.float32, [Segment(0, (16,))])  # 4 elements of padding
        bucket = torch.cat([torch.randn(16), torch.zeros(4)])
        layer.reduce(bucket, state)
        assert state.residual is not None and not state.residual[16:].any()
        return bucket

    results, _ = _on_threads(2, rank_fn)
    assert not results[0][16:].any() and results[0][:16].all()


def test_point_to_point_messages_decode_to_what_was_sent() -> None:
    for spec in ("none", "fp16", "int8", "sign", "topk:0.05", "dgc:0.05"):
        layer = CompressedComm(None, build_codec(CommConfig(compress=spec)))
        state = layer.new_state(NUMEL, torch.float32)
        x = _grad(0, 0, torch.float32)
        data = layer.pack(x, state)
        assert data.dtype == torch.uint8 and data.numel() == layer.packed_bytes(state)
        decoded = layer.unpack(data, layer.new_state(NUMEL, torch.float32))
        residual = state.residual if state.residual is not None else torch.zeros(NUMEL)
        assert torch.allclose(decoded + residual, x, atol=1e-6), spec
    with pytest.raises(ValueError, match="powersgd codec cannot compress point-to-point"):
        psgd = CompressedComm(None, build_codec(CommConfig(compress="powersgd")))
        psgd.packed_bytes(psgd.new_state(10, torch.float32))


def test_held_ranges_count_as_not_sent() -> None:
    """``pack(hold=...)``: the receiver drops those ranges, so their residual keeps all of x."""
    segments = segments_of(SHAPES)
    for spec in ("fp16", "int8", "sign", "topk:0.05"):
        layer = CompressedComm(None, build_codec(CommConfig(compress=spec)))
        state = layer.new_state(NUMEL, torch.float64, segments)
        first, second = _grad(0, 0, torch.float64), _grad(0, 1, torch.float64)
        layer.pack(first, state)
        before = state.residual.clone()
        held = (segments[1].offset, segments[1].offset + segments[1].numel)
        data = layer.pack(second, state, hold=[held])
        a, b = held
        assert torch.equal(state.residual[a:b], before[a:b] + second[a:b]), spec  # nothing of it sent
        decoded = layer.unpack(data, layer.new_state(NUMEL, torch.float64, segments))
        decoded[a:b] = 0  # what the receiver does with a held range
        mask = torch.ones(NUMEL, dtype=torch.bool)
        mask[a:b] = False
        assert torch.allclose((decoded + state.residual)[mask], (before + second)[mask], atol=1e-12), spec


def test_check_compress_for_the_parameter_server() -> None:
    for spec in ("none", "fp16", "bf16", "int8", "sign", "topk:0.01", "dgc:0.05"):
        check_compress(CommConfig(compress=spec), "ps")  # pushable codecs: accepted
    with pytest.raises(ConfigError, match="needs its workers to all-reduce among themselves"):
        check_compress(CommConfig(compress="powersgd"), "ps")
    for key in ("compress_start_step", "compress_warmup_steps"):
        with pytest.raises(ConfigError, match="a push must keep one size"):
            check_compress(CommConfig(compress="topk:0.1", **{key: 2}), "ps")


def test_specs_are_checked_in_one_line() -> None:
    assert parse_spec("topk").param == 0.01 and parse_spec("powersgd:8").param == 8
    for bad, words in [
        ("zip", "unknown codec"),
        ("fp16:2", "takes no parameter"),
        ("topk:2", "must be in (0, 1]"),
        ("powersgd:x", "expects int"),
        ("int8:0", "must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            parse_spec(bad)


def test_chunks_never_cross_a_tensor_and_topk_picks_from_every_tensor() -> None:
    segments = segments_of(SHAPES)
    state = CodecState(NUMEL + 3, torch.float64, segments, gaps_of(NUMEL + 3, segments))
    ids, chunks = chunks_of(state, 100)
    bounds = [s.offset for s in segments] + [NUMEL]
    for a, b in itertools.pairwise(bounds):  # a new chunk starts at every tensor's edge
        assert a == 0 or ids[a] != ids[a - 1]
        assert len(set(ids[a:b].tolist())) == -(-(b - a) // 100)
    assert chunks == int(ids.max()) + 1 and ids[-1] != ids[NUMEL - 1]  # the gap is a chunk of its own
    x = torch.randn(NUMEL + 3, dtype=torch.float64)
    x[:384] *= 1000  # one tensor dominates: a bucket-wide top-k would take only from it
    picked = TopKCodec("topk", 0.01).select(x, state, 0.01)
    for seg in segments:
        inside = ((picked >= seg.offset) & (picked < seg.offset + seg.numel)).sum()
        assert int(inside) == math.ceil(0.01 * seg.numel)
