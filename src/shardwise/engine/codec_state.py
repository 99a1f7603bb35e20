"""Error-feedback state in checkpoints: each rank's codec states (``comm.compress``), saved and restored.

What a rank's buckets keep between reductions (``compression.CodecState``) is its own: the residual is
what *this rank's* messages left out, so it cannot be sharded or merged by layout like a parameter.
Each rank writes, per bucket ``i`` of its engine (DDP buckets, ZeRO flat groups, DiLoCo's
pseudo-gradient, a parameter-server worker's push per server, in the engine's order):

- ``codec/<layout>/rank<r>/<i>/residual``: the residual (numel,), when the bucket has one;
- ``codec/<layout>/rank<r>/<i>/reductions``: the bucket's reduction count, an int64 scalar (warm-ups,
  ``compress_start_step`` and DGC's sparsity schedule count it);
- ``codec/<layout>/rank<r>/<i>/extra/<key>``: the codec's own tensors (DGC's velocity, PowerSGD's
  warm-start Q). Caches derived from the layout (chunk ids, PowerSGD's plan) are rebuilt.

``<layout>`` names what wrote them: ``<engine>.world<N>.<spec>`` (e.g. ``ddp.world2.topk_0.05``). A run
loads them only under its own layout, with the same bucket sizes; anything else (another strategy,
world size, codec, or bucket sizes) starts with fresh states, after one warning line on rank 0 (a
``CheckpointWarning``), since a residual belongs to a rank's own messages and has no meaning
elsewhere. A checkpoint with no codec state at all (an uncompressed run) is silent. Other layouts
ignore ``codec/``. The parameter server's pull residuals are not saved (``ps_state``). No
communication.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch

from shardwise.checkpoint.manager import Piece
from shardwise.checkpoint.reader import CheckpointWarning
from shardwise.collectives.api import Comm
from shardwise.compression import CodecState, CompressedComm
from shardwise.device import HOST
from shardwise.engine.state import StateReader

PREFIX = "codec/"
Saved = list[dict[str, torch.Tensor]]  # per bucket: field -> tensor (residual, reductions, extra/<key>)


def codec_layout(engine: str, world_size: int, spec: str) -> str:
    """The layout tag of a run's codec states (no ``:`` or ``/`` in it: it is part of a name)."""
    return f"{engine}.world{world_size}.{spec.replace(':', '_').replace('/', '_')}"


def layout_of(engine: str, comm: Comm, compressor: CompressedComm | None) -> str:
    """The layout tag of an engine's codec states over ``comm`` (its reducing group)."""
    return codec_layout(engine, comm.world_size, compressor.codec.spec if compressor is not None else "")


def _prefix(layout: str, rank: int) -> str:
    return f"{PREFIX}{layout}/rank{rank}/"


def codec_pieces(states: Sequence[CodecState], layout: str, rank: int) -> list[Piece]:
    """This rank's codec states as checkpoint pieces (see the module docstring)."""
    out = []
    base = _prefix(layout, rank)
    for i, state in enumerate(states):
        reductions = torch.tensor(state.reductions, dtype=torch.int64, device=HOST)
        out.append(Piece.full(f"{base}{i}/reductions", reductions))
        if state.residual is not None:
            out.append(Piece.full(f"{base}{i}/residual", state.residual.detach()))
        for key, value in state.extra.items():
            if torch.is_tensor(value):
                out.append(Piece.full(f"{base}{i}/extra/{key}", value.detach()))
    return out


def read_codec_states(
    states: Sequence[CodecState], layout: str, rank: int, read: StateReader
) -> Saved | None:
    """What the checkpoint holds for ``states`` under this run's layout, or None (nothing to restore;
    a warning on rank 0 when it holds codec state of another layout). Reads; changes nothing."""
    shapes = read.shapes
    if not states or not any(name.startswith(PREFIX) for name in shapes):
        return None
    base = _prefix(layout, rank)
    mine = {name.removeprefix(base): tuple(shape) for name, shape in shapes.items() if name.startswith(base)}
    problem = _mismatch(states, mine)
    if problem is not None:
        if rank == 0:
            others = sorted({n.removeprefix(PREFIX).split("/", 1)[0] for n in shapes if n.startswith(PREFIX)})
            warnings.warn(
                f"the checkpoint's error-feedback state ({', '.join(others)}) does not fit this run "
                f"({layout}: {problem}); every bucket starts with no residual",
                CheckpointWarning,
                stacklevel=2,
            )
        return None
    tensors = read({base + name: None for name in mine})
    saved: Saved = [{} for _ in states]
    for name, tensor in tensors.items():
        index, field = name.removeprefix(base).split("/", 1)
        saved[int(index)][field] = tensor
    return saved


def _mismatch(states: Sequence[CodecState], saved: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why the saved shapes cannot be this rank's states (None: they can)."""
    if not saved:
        return "none saved for this layout and rank"
    indices = {int(name.split("/", 1)[0]) for name in saved}
    if indices != set(range(len(states))):
        return f"{len(indices)} buckets saved, {len(states)} here"
    for i, state in enumerate(states):
        residual = saved.get(f"{i}/residual")
        if residual is not None and residual != (state.numel,):
            return f"bucket {i} has {residual} elements saved, {state.numel} here"
    return None


def restore_codec_states(states: Sequence[CodecState], saved: Saved | None) -> None:
    """Put what ``read_codec_states`` returned into ``states`` (nothing when it returned None)."""
    if saved is None:
        return
    for state, fields in zip(states, saved, strict=True):
        state.reductions = int(fields["reductions"])
        residual = fields.get("residual")
        state.residual = None if residual is None else residual.to(state.dtype).reshape(state.numel).clone()
        state.previous, state.undoable = None, False
        for field, value in fields.items():
            if field.startswith("extra/"):
                state.extra[field.removeprefix("extra/")] = value.clone()
