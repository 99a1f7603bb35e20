"""Start a model from local weights: ``model.init_from`` (``--init-from PATH``).

PATH is a Hugging Face folder (``model.safetensors``, or the ``model-0000x-of-0000y.safetensors``
shards ``model.safetensors.index.json`` lists) or one safetensors file (``shardwise ckpt export``).
``PretrainedWeights.open(path, model)`` reads only the files' headers (each tensor's file, shape and
dtype) and matches them to the model by name: a tied parameter is one tensor with several names, and
the file may hold it under any of them. It refuses, in one line naming the item and the fix, a path
that does not exist or holds no safetensors, parameters the file lacks, tensors the model lacks, and
a shape that differs. Then the model's parameters, built on the meta device, get their values:

* ``read(name, start, stop)``: a flat range of one parameter, reading only the rows or boxes that
  range covers (:func:`~shardwise.checkpoint.boxes.flat_segments` through ``safe_open(...).get_slice``):
  what a ZeRO-3 rank reads for its shard;
* ``load_whole(model)``: every parameter (and any buffer the file holds) whole, for the strategies
  whose ranks hold whole tensors (DDP, ZeRO-1/2, the parameter server) and for one process.

Values are cast from the file's dtype to the parameter's (the run's); ``cast_note`` says so. No
communication: every rank reads what it holds from the same files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shardwise.checkpoint.boxes import flat_segments
from shardwise.checkpoint.format import DTYPES
from shardwise.config import ConfigError
from shardwise.device import HOST

INDEX_NAME = "model.safetensors.index.json"
KEY = "model.init_from"
_TORCH_DTYPES = {code: getattr(torch, name) for name, code in DTYPES.items()}


@dataclass(frozen=True)
class _Entry:
    """One tensor in the files: where it is and what it is."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def weight_files(path: str) -> list[Path]:
    """The safetensors files ``path`` names: itself, the shards its index lists, or every one in it."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(
            f"{KEY} {path!r} does not exist; give a Hugging Face folder of safetensors "
            "(model.safetensors) or a .safetensors file written by `shardwise ckpt export`"
        )
    if root.is_file():
        return [root]
    index = root / INDEX_NAME
    if index.is_file():
        return _indexed_files(path, index)
    found = sorted(root.glob("*.safetensors"))
    if not found:
        others = ", ".join(sorted(p.name for p in root.iterdir())[:5]) or "nothing"
        raise ConfigError(
            f"{KEY} {path!r} holds no .safetensors file (it holds {others}); save the model with "
            "save_pretrained (safetensors is its default) or give a `shardwise ckpt export` file"
        )
    return found


def _indexed_files(path: str, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{KEY} {path!r}: {INDEX_NAME} cannot be read ({type(exc).__name__}: {exc}); save the model again"
        ) from None
    files = [index.parent / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(
            f"{KEY} {path!r}: {INDEX_NAME} lists {', '.join(missing[:3])}, which is missing; "
            "copy every shard the index lists into the folder"
        )
    return files


def read_headers(path: str) -> dict[str, _Entry]:
    """Every tensor in the files ``path`` names, by key (headers only: no tensor data is read)."""
    entries: dict[str, _Entry] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                    if key in entries:
                        raise ConfigError(
                            f"{KEY} {path!r}: {key} is in both {entries[key].file.name} and {file.name}; "
                            f"keep one copy (or add the {INDEX_NAME} save_pretrained writes)"
                        )
                    sl = f.get_slice(key)
                    entries[key] = _Entry(file, tuple(sl.get_shape()), _dtype(path, key, sl.get_dtype()))
        except (SafetensorError, OSError) as exc:
            reason = " ".join(str(exc).split())
            raise ConfigError(
                f"{KEY} {path!r}: {file.name} is not a readable safetensors file ({reason}); "
                "give the safetensors weights (save_pretrained's model*.safetensors)"
            ) from None
    return entries


def _dtype(path: str, key: str, code: str) -> torch.dtype:
    if code not in _TORCH_DTYPES:
        raise ConfigError(f"{KEY} {path!r}: {key} is {code}, which cannot be cast to the run's dtype")
    return _TORCH_DTYPES[code]


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def materialize(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give a tensor on the meta device ``value``'s data, in place: the same Python object (ties,
    hooks and references to it stay valid), now real."""
    new = value
    if isinstance(tensor, nn.Parameter):
        new = nn.Parameter(value, requires_grad=tensor.requires_grad)
    new.__dict__.update(tensor.__dict__)  # attributes libraries set on parameters survive the swap
    torch.utils.swap_tensors(tensor, new)


class PretrainedWeights:
    """The files of ``model.init_from``, matched to one model's parameters (see the module docstring).

    ``keys`` maps each parameter's first name (``named_parameters``) and each buffer the file holds to
    its key in the files; ``dtypes`` is what each is cast to. Open files are kept until ``close``.
    """

    def __init__(
        self,
        path: str,
        entries: dict[str, _Entry],
        keys: dict[str, str],
        dtypes: dict[str, torch.dtype],
        device: torch.device = HOST,
    ) -> None:
        self.path, self.entries, self.keys, self.dtypes = path, entries, keys, dtypes
        self.device = device  # where parameters on meta are materialised (the rank's device)
        self._handles: dict[Path, Any] = {}

    @classmethod
    def open(cls, path: str, model: nn.Module, device: torch.device = HOST) -> PretrainedWeights:
        """Match the files' headers to ``model``; a one-line ``ConfigError`` when they do not fit.
        ``device``: where parameters on meta are materialised (reads land on the host first)."""
        entries = read_headers(path)
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        keys, dtypes, missing, known = {}, {}, [], set()
        for name, p in model.named_parameters():
            names = aliases[id(p)]
            known.update(names)
            present = [n for n in names if n in entries]
            if not present:
                missing.append(" / ".join(names))
                continue
            keys[name], dtypes[name] = present[0], p.dtype
        for name, b in model.named_buffers():
            known.add(name)
            if name in entries:  # a persistent buffer saved with the weights: loaded too
                keys[name], dtypes[name] = name, b.dtype
        extra = sorted(set(entries) - known)
        if missing or extra:
            raise ConfigError(_names_message(path, missing, extra))
        shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        for name, key in keys.items():
            if entries[key].shape != shapes[name]:
                raise ConfigError(
                    f"{KEY} {path!r}: {key} has shape {list(entries[key].shape)} in the file but "
                    f"{list(shapes[name])} in the model; give weights saved from a model of this size"
                )
        return cls(path, entries, keys, dtypes, device)

    # -- reading ------------------------------------------------------------------------------------
    def _slice(self, name: str) -> tuple[Any, _Entry]:
        entry = self.entries[self.keys[name]]
        if entry.file not in self._handles:
            self._handles[entry.file] = safe_open(str(entry.file), framework="pt")
        return self._handles[entry.file].get_slice(self.keys[name]), entry

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``name``'s row-major flattening (1-D, in ``dtypes[name]``),
        reading only the boxes that cover them."""
        sl, entry = self._slice(name)
        out = torch.empty(stop - start, dtype=self.dtypes[name], device=HOST)  # read from the file
        for box, at in flat_segments(entry.shape, start, stop):
            index = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
            part = sl[index]  # () for a 0-d tensor: the whole of it
            out[at : at + box.volume] = part.reshape(-1)  # casts to the run's dtype
        return out

    def read_whole(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` at its shape, in ``dtypes[name]``."""
        shape = self.entries[self.keys[name]].shape
        return self.read(name, 0, math.prod(shape)).reshape(shape)

    def load_whole(self, model: nn.Module, skip: Collection[int] = ()) -> None:
        """Read every parameter whole (those on meta materialised, the others overwritten), except the
        tensors whose ``id`` is in ``skip``, and every buffer the file holds."""
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if id(tensor) in skip or name not in self.keys:
                    continue
                value = self.read_whole(name)
                if tensor.is_meta:
                    materialize(tensor, value.to(self.device))
                else:
                    tensor.copy_(value)

    def cast_note(self) -> str | None:
        """One line when the file's dtypes differ from the run's (saying whether values are rounded)."""
        casts = sorted(
            {(self.entries[key].dtype, self.dtypes[name]) for name, key in self.keys.items()}
            - {(d, d) for d in _TORCH_DTYPES.values()},
            key=str,
        )
        if not casts:
            return None
        listed = ", ".join(f"{_short(a)} -> {_short(b)}" for a, b in casts)
        lossy = any(_bits(b) <= _bits(a) for a, b in casts)
        how = "values are rounded: precision is lost" if lossy else "exactly"
        return f"{KEY} {self.path!r}: weights cast to the run's dtype ({listed}), {how}"

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> PretrainedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _names_message(path: str, missing: list[str], extra: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"has no weights for {len(missing)} of the model's parameters ({_listed(missing)})")
    if extra:
        parts.append(f"holds {len(extra)} tensors the model does not have ({_listed(extra)})")
    return (
        f"{KEY} {path!r} {' and '.join(parts)}: it was saved from another model; give weights saved "
        "from this model (the same model.kind and sizes)"
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits


def load_pretrained(model: nn.Module, path: str) -> None:
    """Load ``path``'s weights whole into ``model`` (parameters on meta are materialised)."""
    with PretrainedWeights.open(path, model) as weights:
        weights.load_whole(model)
