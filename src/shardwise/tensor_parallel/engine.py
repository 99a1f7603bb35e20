"""A data-parallel engine over tensor-parallel shards, made to answer for the whole tensors.

After ``apply_tensor_parallel`` a rank's parameters are local shards (boxes of the global tensors, in
the layout's records) or whole copies every tp rank holds (norms, row-layer biases). The engine over
the dp axis (DDP, ZeRO-1/2/3) knows only the local tensors. ``attach_tensor_parallel`` widens, over
the tp axis, what is global by contract (``engine/base.py``), as ``pipeline.engine.attach_pipeline``
does over pp:

- ``grad_norm_sq``: the engine's share, less the replicated parameters' squares (``held_grads``) on
  every tp rank but the first, summed over dp, then over tp: each element once over dp x tp;
- ``full_parameters`` / ``full_gradients``: each sharded tensor assembled at its global shape on every
  tp rank (its box written into zeros, one all-reduce over tp; boxes are disjoint, so the sum is exact);
- ``state_pieces``: the engine spreads its tensors over its dp group; each sharded tensor (a parameter
  and its optimizer state) is written as the boxes of its placements; replicated tensors, scalars and
  buffers by the first tp rank only;
- ``load_state``: the engine's requests for whole local tensors become box reads of the global ones;
- ``step_loss``: every tp rank computes the same loss, so only the first reports it.
- after ``finish_grads``: under sequence parallelism, one all-reduce over tp of the gradients of the
  parameters replicated inside the sequence-cut region (Korthikanti et al., 2022).

``attach_rng_states`` (after every other attachment, so no wrapper filters its pieces) puts the RNG
tracker's states (the split regions' dropout streams, ``tensor_parallel.random``) into checkpoints as
``rng/<state>/rank<r>``, per global rank beside torch's own generator (``checkpoint.rng``), and loads
them back, as Megatron's checkpoints keep its tracker's states: without them a resumed run would draw
the split regions' masks from the seed again and part from the uninterrupted run.

Communication: per step one all-reduce of one number over tp (the norm), and the sequence-parallel sum;
the full model (verify, the end of a run) costs one all-reduce per sharded tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardwise.checkpoint.boxes import Box, flat_segments, intersect
from shardwise.checkpoint.manager import Piece
from shardwise.checkpoint.rng import torch_rng_name
from shardwise.collectives.api import Comm
from shardwise.engine.base import Engine, Span, StateReader, sq_sum
from shardwise.tensor_parallel.plans import TensorParallelLayout
from shardwise.tensor_parallel.random import RNGStatesTracker
from shardwise.tensor_parallel.shards import Placement, ShardedParam


def attach_tensor_parallel(engine: Engine, layout: TensorParallelLayout) -> None:
    """Make ``engine`` (over one tp rank's shards) answer global questions over the tp axis too."""
    tp = layout.comm
    sharded = {n: s for n, s in layout.params.items() if not s.replicated}
    local_norm, local_finish = engine.grad_norm_sq, engine.finish_grads
    local_params, local_grads = engine.full_parameters, engine.full_gradients
    local_pieces, local_load, local_loss = engine.state_pieces, engine.load_state, engine.step_loss
    replicated = {n for n in layout.params if n not in sharded}
    sequence_parallel = set(layout.sequence_parallel_params)

    def grad_norm_sq() -> tuple[torch.Tensor, Comm | None]:
        share, comm = local_norm()
        if tp.rank != 0:  # a replicated parameter counts once, on the first tp rank
            share = share - sq_sum(engine.held_grads(replicated), share.device)
        if comm is not None:
            comm.all_reduce(share)
        return share, tp

    def finish_grads() -> None:
        local_finish()
        if sequence_parallel:
            sum_over(tp, engine.held_grads(sequence_parallel))

    overrides: dict[str, Callable[..., Any]] = {
        "grad_norm_sq": grad_norm_sq,
        "finish_grads": finish_grads,
        "full_parameters": lambda: assemble_all(tp, sharded, local_params()),
        "full_gradients": lambda: assemble_all(tp, sharded, local_grads()),
        "state_pieces": lambda _rank, _size: tp_pieces(tp.rank, sharded, local_pieces(*_dp_place(engine))),
        "load_state": lambda read: local_load(BoxReader(read, sharded)),
        "step_loss": lambda share: local_loss(share) if tp.rank == 0 else 0.0,
    }
    engine.override(overrides)


def attach_rng_states(engine: Engine, tracker: RNGStatesTracker, rank: int) -> None:
    """Make ``engine``'s checkpoints carry ``tracker``'s states as ``rng/<state>/rank<rank>`` (``rank``:
    this rank in the whole job; every rank writes its own) and its loads restore them when present (a
    checkpoint without them, from a run without tensor parallelism, leaves the tracker as seeded)."""
    local_pieces, local_load = engine.state_pieces, engine.load_state

    def state_pieces(writer_rank: int, writers: int) -> list[Piece]:
        states = tracker.get_states()
        return local_pieces(writer_rank, writers) + [
            Piece.full(torch_rng_name(rank, name), state) for name, state in states.items()
        ]

    def load_state(read: StateReader) -> None:
        names = {torch_rng_name(rank, name): name for name in tracker.states}
        present = [key for key in names if key in read.shapes]
        saved = read(dict.fromkeys(present)) if present else {}  # all read before anything changes
        local_load(read)
        states = tracker.get_states()
        states.update({names[key]: tensor.to(torch.uint8) for key, tensor in saved.items()})
        tracker.set_states(states)

    engine.override({"state_pieces": state_pieces, "load_state": load_state})


def sum_over(comm: Comm, tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` over ``comm`` in one all-reduce, written back in place (under sequence
    parallelism each tp rank's gradient of a norm saw a tp-th of the positions)."""
    if not tensors or comm.world_size == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, label="sequence-parallel grads")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _dp_place(engine: Engine) -> tuple[int, int]:
    """This rank's place in its dp group: the engine spreads what it writes over that group only (each
    tp rank of a dp rank holds other shards)."""
    dp = engine.count_comm
    return (dp.rank, dp.world_size) if dp is not None else (0, 1)


def assemble_all(
    tp: Comm, sharded: Mapping[str, ShardedParam], local: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``local`` with every sharded tensor at its global shape (the same on every tp rank)."""
    out = dict(local)
    for name, record in sharded.items():
        if name not in local:
            continue
        full = local[name].new_zeros(record.global_shape)
        record.put(local[name], full)
        tp.all_reduce(full, label="tp gather")
        out[name] = full
    return out


def _param_of(piece_name: str) -> str | None:
    """The parameter a checkpoint tensor belongs to: ``model/<p>`` or ``optim/<key>/<p>``."""
    kind, _, rest = piece_name.partition("/")
    if kind == "model":
        return rest
    if kind == "optim":
        return rest.partition("/")[2]
    return None


def tp_pieces(tp_rank: int, sharded: Mapping[str, ShardedParam], pieces: list[Piece]) -> list[Piece]:
    """The engine's pieces of local tensors (whole, or a flat range: ZeRO's shard) as boxes of the
    global tensors.

    A sharded parameter's tensors (its value and each optimizer state of its shape) become boxes: the
    flat range cut into row-major boxes (``flat_segments``), each intersected with every placement and
    moved to the global tensor's coordinates. Everything else (replicated parameters, step counts,
    buffers, engine state) is written by the first tp rank only, so every element is written once.
    """
    out = []
    for piece in pieces:
        record = sharded.get(_param_of(piece.name) or "")
        if record is None or piece.global_shape != record.local_shape:
            if tp_rank == 0:
                out.append(piece)
            continue
        if piece.box is not None or piece.start is None or piece.stop is None:
            raise RuntimeError(f"{piece.name}: a tensor-parallel shard is written as a flat range")
        flat = piece.tensor.reshape(-1)
        for local_box, at in flat_segments(record.local_shape, piece.start, piece.stop):
            values = flat[at : at + local_box.volume].reshape(local_box.lengths)
            for placement in record.placements:
                for local_part, global_part in _moved(local_box, placement):
                    part = values[_index(_relative(local_part, local_box))]
                    box = Piece.from_box(piece.name, record.global_shape, global_part.offsets, part.clone())
                    out.append(box)
    return out


def _moved(local_box: Box, placement: Placement) -> list[tuple[Box, Box]]:
    """The part of ``local_box`` a placement holds, and where it sits in the global tensor."""
    common = intersect(local_box, placement.local_box)
    if common is None:
        return []
    shift = [g - lo for g, lo in zip(placement.global_box.offsets, placement.local_box.offsets, strict=True)]
    moved = Box(tuple(o + d for o, d in zip(common.offsets, shift, strict=True)), common.lengths)
    return [(common, moved)]


def _relative(inner: Box, outer: Box) -> Box:
    return Box(tuple(i - o for i, o in zip(inner.offsets, outer.offsets, strict=True)), inner.lengths)


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


class BoxReader:
    """A checkpoint reader that shows the engine its local shapes and reads their boxes."""

    def __init__(self, read: StateReader, sharded: Mapping[str, ShardedParam]) -> None:
        self._read, self._sharded = read, sharded

    def _record(self, name: str, shape: tuple[int, ...]) -> ShardedParam | None:
        record = self._sharded.get(_param_of(name) or "")
        return record if record is not None and shape == record.global_shape else None

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        shapes = dict(self._read.shapes)
        for name, shape in shapes.items():
            if (record := self._record(name, shape)) is not None:
                shapes[name] = record.local_shape
        return shapes

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]:
        global_shapes = self._read.shapes
        plain = {n: s for n, s in requests.items() if self._record(n, global_shapes.get(n, ())) is None}
        out = self._read(plain)
        for name in requests.keys() - plain.keys():
            record = self._record(name, global_shapes[name])
            assert record is not None
            out[name] = self._local(name, record, requests[name])
        return out

    def _local(self, name: str, record: ShardedParam, span: Span) -> torch.Tensor:
        """The local tensor (span None) or a flat range ``(a, b)`` of it, read box by box."""
        if isinstance(span, Box):
            raise RuntimeError(f"{name}: a tensor-parallel shard is read whole or as a flat range")
        start, stop = span if span is not None else (0, math.prod(record.local_shape))
        pieces: list[torch.Tensor] = []
        for local_box, _ in flat_segments(record.local_shape, start, stop):
            block: torch.Tensor | None = None
            for placement in record.placements:
                for local_part, global_part in _moved(local_box, placement):
                    part = self._read({name: global_part})[name].reshape(global_part.lengths)
                    if block is None:
                        block = part.new_empty(local_box.lengths)
                    block[_index(_relative(local_part, local_box))] = part
            assert block is not None
            pieces.append(block.reshape(-1))
        flat = torch.cat(pieces)
        return flat if span is not None else flat.reshape(record.local_shape)
