"""ZeRO checkpoints: each rank writes and reads its own flat shard's overlap with every parameter.

Names follow ``Engine.state_pieces``: ``model/<name>`` (the master weights, at the parameter's global
shape), ``optim/<key>/<name>`` for per-element optimizer state, ``optim/step/<name>`` (scalar). The
shard arithmetic is :mod:`shardwise.zero.flat_param`'s (``FlatLayout.overlaps``): for every group, the
parameters overlapping this rank's shard become flat ranges ``[a, b)`` of those parameters; padding is
never written, and a scalar goes to the rank holding the parameter's first element. One optimizer
steps a whole group, but a parameter that got no gradient is skipped as torch skips it
(:mod:`shardwise.zero.unused`), so ``step`` is each parameter's own count, and a parameter never
stepped has no optimizer state in the checkpoint (as in torch): loading sets the counts back and gives
such parameters a fresh (zero) share of the group's state.
Frozen parameters and buffers are whole on every rank: they are spread over ranks by bytes, so each is
written once. In fp16, rank 0 also writes the loss scaler's state (``precision/loss_scale``), so a resumed
run goes on with the same scale; a checkpoint without it (another precision or strategy) keeps a
fresh scaler. Loading asks for exactly the same ranges in the loading engine's own layout (any world
size), so checkpoints of any strategy load here and ours load anywhere. Mixed precision: the checkpoint
holds the master weights; the compute copies are re-derived by the stage's ``after_step`` (an
all-gather in stages 1-2; stage 3 gathers at the next forward). Disk offload: every group is mapped in
(``offload.resident``) while it is read or written, and loaded values are copied into the mapped files.

With ``comm.compress``, each rank also writes its groups' codec state (error-feedback residuals,
under ``codec/``: ``engine.codec_state``), restored on a resume with the same ranks and layout.

Communication: none for saving; for loading, only the stage's own re-gather of the parameters.
``gathered_state`` (inspection and tests) all-gathers every state tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardwise.checkpoint.manager import Piece
from shardwise.compression import CodecState
from shardwise.engine.codec_state import (
    codec_layout,
    codec_pieces,
    read_codec_states,
    restore_codec_states,
)
from shardwise.engine.full_state import StateMismatchError, replicated_pieces
from shardwise.engine.precision import LOSS_SCALE
from shardwise.engine.state import Span, StateReader
from shardwise.zero.flat_param import FlatLayout
from shardwise.zero.group import FlatGroup
from shardwise.zero.unused import restore

if TYPE_CHECKING:
    from shardwise.zero.base import ZeroBase

SCALAR_KEYS = ("step",)  # per-parameter scalars; everything else of the master's shape is per element


def replicated_tensors(engine: ZeroBase) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers, whole on every rank, by checkpoint name (no copies)."""
    out = {f"model/{n}": p.detach() for n, p in engine.model.named_parameters() if not p.requires_grad}
    out.update({f"model/{n}": b.detach() for n, b in engine.model.named_buffers()})
    return out


def _split_state(state: dict, master: torch.Tensor) -> tuple[dict, dict]:
    """(per-element tensors of the master's shape, per-parameter scalars) of one group's optimizer."""
    elements = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape}
    scalars = {k: v for k, v in state.items() if torch.is_tensor(v) and k not in elements and v.dim() == 0}
    return elements, scalars


def _shape(layout: FlatLayout, name: str) -> tuple[int, ...]:
    return layout.slot(name).shape


def _param_scalars(scalars: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """One parameter's scalars: ``step`` is its own count (``zero.unused`` keeps one per parameter; the
    group's follows the last pass), any other scalar is the group's."""
    return {k: torch.full_like(v, count) if k == "step" else v for k, v in scalars.items()}


def _stepped(engine: ZeroBase, index: int) -> dict[str, int]:
    """Group ``index``'s parameters that have optimizer state, with their step counts: those never
    stepped have none in torch, so none is written for them (their share of the flat state is zero)."""
    group, usage = engine.groups[index], engine.usage[index]
    return {name: count for name, count in zip(group.names, usage.counts, strict=True) if count > 0}


def zero_state_pieces(engine: ZeroBase, rank: int, world_size: int) -> list[Piece]:
    """What this rank writes: its shards' overlap with every parameter, and its share of the rest."""
    comm = engine.comm
    if world_size != comm.world_size or rank != comm.rank:
        raise ValueError(
            f"ZeRO shards over its data-parallel group (rank {comm.rank} of {comm.world_size}); the "
            f"checkpoint was asked for rank {rank} of {world_size}: save over the data-parallel group"
        )
    out = replicated_pieces(replicated_tensors(engine), rank, world_size)
    for i, (group, optimizer) in enumerate(zip(engine.groups, engine.optimizers, strict=True)):
        with engine.offload.resident(i):  # views of mapped files stay valid after the group is unmapped
            master = group.master.detach()
            elements, scalars = _split_state(optimizer.state.get(group.master, {}), master)
            stepped = _stepped(engine, i)
            for overlap in group.layout.overlaps(rank):
                shape = _shape(group.layout, overlap.name)
                span = slice(overlap.shard_start, overlap.shard_end)
                a, b = overlap.param_start, overlap.param_end
                out.append(Piece(f"model/{overlap.name}", shape, a, b, master[span]))
                if overlap.name not in stepped:
                    continue
                for key, value in elements.items():
                    out.append(Piece(f"optim/{key}/{overlap.name}", shape, a, b, value[span]))
                if a == 0:
                    mine = _param_scalars(scalars, stepped[overlap.name])
                    out.extend(Piece.full(f"optim/{k}/{overlap.name}", v) for k, v in mine.items())
    if engine.scaler.enabled and rank == 0:  # the same on every rank: one writes it
        out.append(Piece.full(LOSS_SCALE, engine.scaler.state()))
    return out + codec_pieces(_codec_states(engine), _codec_layout(engine), rank)


def _codec_states(engine: ZeroBase) -> list[CodecState]:
    """Each group's error feedback (``comm.compress``; none without it), in group order."""
    return [g.codec_state for g in engine.groups if g.codec_state is not None]


def _codec_layout(engine: ZeroBase) -> str:
    compressor = next((g.compressor for g in engine.groups if g.compressor is not None), None)
    spec = compressor.codec.spec if compressor is not None else ""
    return codec_layout(engine.name, engine.comm.world_size, spec)


# -- loading ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _GroupKeys:
    """What the checkpoint holds for one group's optimizer: its keys (per element, scalar) and the
    parameters that have them (the others were never stepped: a fresh state, zero, and count 0)."""

    elements: list[str]
    scalars: list[str]
    stateful: set[str]


def _group_keys(group: FlatGroup, shapes: dict) -> _GroupKeys:
    """A parameter has every key of its group or none, since one optimizer steps the whole group."""
    have: dict[str, set[str]] = {name: set() for name in group.names}
    for name in shapes:
        if name.startswith("optim/"):
            _, key, pname = name.split("/", 2)
            if pname in have:
                have[pname].add(key)
    keys = set().union(*have.values())
    stateful = {name for name, mine in have.items() if mine}
    for name in sorted(stateful):
        if have[name] != keys:
            missing = sorted(keys - have[name])
            raise StateMismatchError(
                f"the checkpoint has optimizer state {', '.join(missing)} for some parameters of a ZeRO "
                f"group but not for {name}: ZeRO steps them together and cannot load a partial state"
            )
    elements: list[str] = []
    scalars: list[str] = []
    if stateful:
        first = min(stateful)
        shape = tuple(group.params[group.names.index(first)].shape)
        for key in sorted(keys):
            saved = shapes[f"optim/{key}/{first}"]
            scalar = key in SCALAR_KEYS or (saved == () != shape)
            (scalars if scalar else elements).append(key)
    return _GroupKeys(elements, scalars, stateful)


def _check_model_shapes(engine: ZeroBase, shapes: dict) -> None:
    local = {n: tuple(t.shape) for n, t in replicated_tensors(engine).items()}
    for group in engine.groups:
        local.update({f"model/{s.name}": s.shape for s in group.layout.slots})
    for name, shape in local.items():
        if name not in shapes:
            raise StateMismatchError(f"the checkpoint has no {name}: it was written for another model")
        if tuple(shapes[name]) != tuple(shape):
            raise StateMismatchError(
                f"{name} has shape {tuple(shapes[name])} in the checkpoint but {shape} in this model: "
                "it was written for another model"
            )


def _requests(engine: ZeroBase, shapes: dict) -> tuple[dict[str, Span], list[_GroupKeys]]:
    rank = engine.comm.rank
    requests: dict[str, Span] = dict.fromkeys(replicated_tensors(engine))
    keys = []
    for group in engine.groups:
        found = _group_keys(group, shapes)
        keys.append(found)
        for overlap in group.layout.overlaps(rank):
            span = (overlap.param_start, overlap.param_end)
            requests[f"model/{overlap.name}"] = span
            if overlap.name in found.stateful:
                requests.update({f"optim/{key}/{overlap.name}": span for key in found.elements})
        requests.update({f"optim/{key}/{name}": None for key in found.scalars for name in found.stateful})
    return requests, keys


def _shard(group: FlatGroup, prefix: str, tensors: dict[str, torch.Tensor], names: set[str]) -> torch.Tensor:
    """This rank's (shard_size,) slice in the master dtype from the loaded ranges of ``names``; the rest
    (padding, parameters with no such state) zero."""
    out = torch.zeros(group.layout.shard_size, dtype=group.precision.master, device=group.master.device)
    for overlap in group.layout.overlaps(group.comm.rank):
        if overlap.name in names:
            saved = tensors[f"{prefix}/{overlap.name}"]
            out[overlap.shard_start : overlap.shard_end].copy_(saved.reshape(-1))
    return out


def _scalar(group: FlatGroup, key: str, found: _GroupKeys, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The group's ``key``: ``step`` is the largest count (each parameter's own is in ``zero.unused``);
    any other scalar must be the same for every parameter that has it, as one optimizer keeps one."""
    values = [tensors[f"optim/{key}/{name}"] for name in sorted(found.stateful)]
    if key == "step":
        return max(values, key=float).clone()
    if any(not torch.equal(v, values[0]) for v in values[1:]):
        raise StateMismatchError(
            f"optim/{key} differs between parameters of one ZeRO group ({', '.join(group.names[:3])}...): "
            "ZeRO keeps one per group and cannot load them"
        )
    return values[0].clone()


def _counts(group: FlatGroup, found: _GroupKeys, tensors: dict[str, torch.Tensor]) -> list[int]:
    """Each parameter's step count: its saved ``step``; where the optimizer counts none (SGD) only
    whether it has state matters (1, else 0); never stepped: 0."""
    counts = []
    for name in group.names:
        step = tensors.get(f"optim/step/{name}")
        counts.append(int(step) if step is not None else int(name in found.stateful))
    return counts


def load_zero_state(engine: ZeroBase, read: StateReader) -> None:
    """Read this rank's ranges of every tensor, then replace masters, optimizer state and the rest."""
    shapes = {name: tuple(shape) for name, shape in read.shapes.items()}
    _check_model_shapes(engine, shapes)
    requests, keys = _requests(engine, shapes)
    scaled = engine.scaler.enabled and LOSS_SCALE in shapes  # absent: another precision saved it
    if scaled:
        requests[LOSS_SCALE] = None
    tensors = read(requests)  # every read before any change: a damaged file leaves the engine as it was
    codec = read_codec_states(_codec_states(engine), _codec_layout(engine), engine.comm.rank, read)
    if scaled:
        engine.scaler.load(tensors[LOSS_SCALE])
    with torch.no_grad():
        for name, target in replicated_tensors(engine).items():
            target.copy_(tensors[name])
        for i, (group, found) in enumerate(zip(engine.groups, keys, strict=True)):
            with engine.offload.resident(i):
                _load_group(engine, i, group, found, tensors)
    restore_codec_states(_codec_states(engine), codec)
    engine.after_step()  # compute copies from the new masters


def _load_group(engine: ZeroBase, index: int, group: FlatGroup, found: _GroupKeys, tensors: dict) -> None:
    everything = set(group.names)
    group.master.copy_(_shard(group, "model", tensors, everything))  # in place: stages 1-2 may view it
    state = engine.optimizers[index].state[group.master]
    for key in list(state):
        if key not in found.elements and key not in found.scalars:
            del state[key]
    if not found.stateful:
        engine.optimizers[index].state.pop(group.master, None)
    engine.offload.forget_state(index, set(found.elements))
    for key in found.elements:
        value = _shard(group, f"optim/{key}", tensors, found.stateful)
        if torch.is_tensor(state.get(key)) and state[key].shape == value.shape:
            state[key].copy_(value)  # a mapped file (disk offload) is written through
        else:
            state[key] = value
    for key in found.scalars:
        state[key] = _scalar(group, key, found, tensors)  # kept as saved, as torch's load_state_dict does
    restore(engine.usage[index], _counts(group, found, tensors))


def gathered_state(engine: ZeroBase) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint contract at its global shape, on every rank (all-gathers)."""
    out = {name: t.clone() for name, t in replicated_tensors(engine).items()}
    for i, (group, optimizer) in enumerate(zip(engine.groups, engine.optimizers, strict=True)):
        with engine.offload.resident(i):
            master = group.master.detach()
            elements, scalars = _split_state(optimizer.state.get(group.master, {}), master)
            stepped = _stepped(engine, i)
            flat = {"model": master, **{f"optim/{k}": v for k, v in elements.items()}}
            for prefix, shard in flat.items():
                full = shard.new_empty(group.layout.padded_numel)
                engine.comm.all_gather(full, shard.contiguous().clone())
                for name, tensor in group.unflatten(full).items():
                    if prefix == "model" or name in stepped:  # never stepped: no state, as in torch
                        out[f"{prefix}/{name}"] = tensor
            for name, count in stepped.items():
                mine = _param_scalars(scalars, count)
                out.update({f"optim/{k}/{name}": v.clone() for k, v in mine.items()})
    return out
