"""Checkpoint state of an engine that holds whole tensors: a model plus a ``torch.optim`` optimizer.

Used by replicated strategies (DDP) and any engine whose parameters and optimizer state are whole
tensors on the rank. Names follow ``Engine.state_pieces``: ``model/<name>`` for parameters and
buffers, ``optim/<key>/<name>`` for per-parameter optimizer tensors (``optim/step/<name>`` included).
No communication: saving spreads whole tensors over ranks by bytes (each written by one rank), and
loading reads whole tensors through the caller's reader. ``load_checkpoint`` loads any strategy's
checkpoint into a plain model and ``torch.optim`` optimizer in one process (no process group).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from shardwise.checkpoint.format import Manifest
from shardwise.checkpoint.manager import Piece, spread_replicated
from shardwise.checkpoint.reader import load, resolve, verify_checkpoint
from shardwise.engine.state import Span, StateReader


class StateMismatchError(ValueError):
    """The checkpoint does not describe this model (a tensor is missing or has another shape)."""


def full_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and per-parameter optimizer tensor by checkpoint name (no copies)."""
    out = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
    out.update({f"model/{n}": b.detach() for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{key}/{names[id(param)]}"] = value.detach()
    return out


def replicated_pieces(tensors: dict[str, torch.Tensor], rank: int, world_size: int) -> list[Piece]:
    """The whole tensors this rank writes when every rank holds all of them (balanced by bytes)."""
    owners = spread_replicated(tensors, world_size)
    return [Piece.full(name, t) for name, t in tensors.items() if owners[name] == rank]


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, read: StateReader) -> None:
    """Read whole tensors, then copy them into ``model`` and replace ``optimizer``'s state."""
    local: dict[str, torch.Tensor] = {f"model/{n}": p for n, p in model.named_parameters()}
    local.update({f"model/{n}": b for n, b in model.named_buffers()})
    load_named_state(local, dict(model.named_parameters()), optimizer, read)


def load_named_state(
    local: dict[str, torch.Tensor],
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    read: StateReader,
) -> None:
    """Whole tensors by checkpoint name into ``local``, and the optimizer state of ``params``.

    Only these names are read (a parameter server reads the parameters it serves).
    """
    _check_shapes(local, read)
    optim_names = {}
    for name in read.shapes if optimizer is not None else ():
        if name.startswith("optim/"):
            _, key, pname = name.split("/", 2)
            if pname in params:
                optim_names[name] = (key, pname)
    tensors = read(dict.fromkeys([*local, *optim_names]))  # every read before any change
    with torch.no_grad():
        for name, target in local.items():
            target.copy_(tensors[name])
    if optimizer is not None:
        loaded = {n: (k, p, tensors[n]) for n, (k, p) in optim_names.items()}
        _replace_optimizer_state(optimizer, params, loaded)


class FolderReader:
    """``StateReader`` over one checkpoint folder (``step-<k>``)."""

    def __init__(self, step_dir: str, manifest: Manifest | None = None) -> None:
        self.step_dir = step_dir
        self.manifest = manifest or verify_checkpoint(step_dir)
        self.shapes = {name: tuple(rec.global_shape) for name, rec in self.manifest.tensors.items()}

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]:
        return load(self.step_dir, requests, manifest=self.manifest)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint saved by any strategy and world size into one process; returns its step.

    ``path`` is a ``step-<k>`` folder or a checkpoint root (its newest complete checkpoint).
    ``optimizer`` must be built over ``model``'s trainable parameters.
    """
    reader = FolderReader(resolve(path))
    load_full_state(model, optimizer, reader)
    return reader.manifest.step


def _check_shapes(local: dict[str, torch.Tensor], read: StateReader) -> None:
    missing = sorted(n for n in local if n not in read.shapes)
    if missing:
        raise StateMismatchError(
            f"the checkpoint has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
            "it was written for another model"
        )
    for name, tensor in local.items():
        if tuple(read.shapes[name]) != tuple(tensor.shape):
            raise StateMismatchError(
                f"{name} has shape {tuple(read.shapes[name])} in the checkpoint but {tuple(tensor.shape)} "
                "in this model: it was written for another model"
            )


def _replace_optimizer_state(
    optimizer: torch.optim.Optimizer,
    params: dict[str, nn.Parameter],
    loaded: dict[str, tuple[str, str, torch.Tensor]],
) -> None:
    """Through ``load_state_dict``, so torch casts each value as it does for its own checkpoints."""
    index: dict[int, dict[str, torch.Tensor]] = {}
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    by_id = {id(p): i for i, p in enumerate(flat)}
    for key, pname, tensor in loaded.values():
        param = params[pname]
        if id(param) not in by_id:
            continue  # frozen: this optimizer does not update it
        value = tensor if key == "step" else tensor.reshape(param.shape)
        index.setdefault(by_id[id(param)], {})[key] = value
    state_dict = optimizer.state_dict()
    state_dict["state"] = index
    optimizer.load_state_dict(state_dict)
