"""Start a model from local weights: ``model.init_from`` (``--init-from PATH``).

PATH is a Hugging Face folder (``model.safetensors``, or the ``model-0000x-of-0000y.safetensors``
shards ``model.safetensors.index.json`` lists), one safetensors file (``shardwise ckpt export``), or a
shardwise checkpoint (a ``step-<k>`` folder or a checkpoint root: its ``model/<name>`` tensors, in
flat ranges or boxes, whatever layout wrote them). ``open_weights(path, model)`` reads only the files'
headers (or the manifest) and matches them to the model as built, before any split
(``match_tensors``): a tied parameter is one tensor with several names, and the file may hold it under
any of them. It refuses, in one line naming the item and the fix, a path that does not exist or holds
no safetensors, parameters the file lacks, tensors the model lacks, and a shape that differs.

Both are ``WeightSource`` s (:mod:`shardwise.checkpoint.source`): ``read_box(name, box)`` reads one box
of one tensor and nothing more (``safe_open(...).get_slice``; the checkpoint reader, CRC-checked), so
a rank reads only its tp shards, its stage's tensors or its ZeRO-3 shard. ``load_pretrained`` loads a
whole model in one process. Values are cast from the file's dtype to the parameter's (the run's);
``cast_note`` says so. No communication: every rank reads what it holds from the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from shardwise.checkpoint.boxes import Box, index_of
from shardwise.checkpoint.format import DTYPES, MANIFEST_NAME, CheckpointError, read_manifest
from shardwise.checkpoint.source import HeldWeights
from shardwise.checkpoint.source import materialize as materialize
from shardwise.config import ConfigError

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


class PretrainedWeights:
    """The files of ``model.init_from``, matched to one model's tensors: a ``WeightSource``
    (:mod:`shardwise.checkpoint.source`) read slice by slice (see the module docstring).

    ``keys`` maps every name of each parameter (a tied one has several) and each buffer the file holds
    to its key in the files; ``dtypes`` is what each is cast to (the run's). Open files are kept until
    ``close``.
    """

    def __init__(
        self, path: str, entries: dict[str, _Entry], keys: dict[str, str], dtypes: dict[str, torch.dtype]
    ) -> None:
        self.path, self.entries, self.keys, self.dtypes = path, entries, keys, dtypes
        self._handles: dict[Path, Any] = {}

    @classmethod
    def open(cls, path: str, model: nn.Module) -> PretrainedWeights:
        """Match the files' headers to ``model`` (whole, as built: before any split); a one-line
        ``ConfigError`` when they do not fit."""
        entries = read_headers(path)
        keys, dtypes = match_tensors(path, model, {k: e.shape for k, e in entries.items()})
        return cls(path, entries, keys, dtypes)

    # -- reading ------------------------------------------------------------------------------------
    def _slice(self, name: str) -> tuple[Any, _Entry]:
        entry = self.entries[self.keys[name]]
        if entry.file not in self._handles:
            self._handles[entry.file] = safe_open(str(entry.file), framework="pt")
        return self._handles[entry.file].get_slice(self.keys[name]), entry

    def has(self, name: str) -> bool:
        return name in self.keys

    def read_box(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``box`` of ``name`` (in the file's dtype, or into ``out``): only that slice is read."""
        sl, _ = self._slice(name)
        part = sl[index_of(box)].reshape(box.lengths)  # () for a 0-d tensor: the whole of it
        return part if out is None else out.copy_(part)

    def _view(self, name: str) -> HeldWeights:
        shape = self.entries[self.keys[name]].shape
        return HeldWeights(self, {name: shape}, {name: self.dtypes[name]})

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``name``'s row-major flattening (1-D, in ``dtypes[name]``),
        reading only the boxes that cover them."""
        return self._view(name).read(name, start, stop)

    def read_whole(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` at its shape, in ``dtypes[name]``."""
        return self._view(name).read_whole(name)

    def notes(self) -> list[str]:
        note = self.cast_note()
        return [note] if note else []

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


def match_tensors(
    path: str, model: nn.Module, stored: dict[str, tuple[int, ...]]
) -> tuple[dict[str, str], dict[str, torch.dtype]]:
    """Match stored tensors (key -> shape) to ``model``'s by name: every name of each parameter (the
    file may hold a tied one under any of them) and each buffer stored -> its key, and each -> the
    dtype it is cast to. A one-line ``ConfigError`` for parameters missing, tensors the model lacks,
    or a shape that differs."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    keys, dtypes, missing, known = {}, {}, [], set()
    for _, p in model.named_parameters():
        names = aliases[id(p)]
        known.update(names)
        present = [n for n in names if n in stored]
        if not present:
            missing.append(" / ".join(names))
            continue
        for name in names:
            keys[name], dtypes[name] = present[0], p.dtype
    for name, b in model.named_buffers():
        known.add(name)
        if name in stored:  # a persistent buffer saved with the weights: loaded too
            keys[name], dtypes[name] = name, b.dtype
    extra = sorted(set(stored) - known)
    if missing or extra:
        raise ConfigError(_names_message(path, missing, extra))
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for name, key in keys.items():
        if name in shapes and stored[key] != shapes[name]:
            raise ConfigError(
                f"{KEY} {path!r}: {key} has shape {list(stored[key])} in the file but "
                f"{list(shapes[name])} in the model; give weights saved from a model of this size"
            )
    return keys, dtypes


class CheckpointWeights:
    """A shardwise checkpoint (a ``step-<k>`` folder, or a run's checkpoint root: its newest valid one)
    as a source: the model's tensors are stored as ``model/<name>`` in flat ranges or boxes, whatever
    layout wrote them; each box is read alone, CRC-checked, only the chunks it covers."""

    PREFIX = "model/"

    def __init__(self, path: str, model: nn.Module) -> None:
        from shardwise.checkpoint.reader import resolve

        try:
            self.path = resolve(path)
            self.manifest = read_manifest(self.path)
        except CheckpointError as exc:
            raise ConfigError(f"{KEY} {path!r}: {exc}") from None
        stored = {
            name.removeprefix(self.PREFIX): tuple(record.global_shape)
            for name, record in self.manifest.tensors.items()
            if name.startswith(self.PREFIX)
        }
        self.keys, self.dtypes = match_tensors(path, model, stored)

    def has(self, name: str) -> bool:
        return name in self.keys

    def read_box(self, name: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        from shardwise.checkpoint.reader import load

        key = self.PREFIX + self.keys[name]
        part = load(self.path, {key: box}, manifest=self.manifest)[key]
        return part if out is None else out.copy_(part)

    def notes(self) -> list[str]:
        return []

    def close(self) -> None:
        return None


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a shardwise checkpoint (a step folder with a manifest, or a root of them)."""
    root = Path(path).expanduser()
    return (root / MANIFEST_NAME).is_file() or any(root.glob(f"step-*/{MANIFEST_NAME}"))


def open_weights(path: str, model: nn.Module) -> PretrainedWeights | CheckpointWeights:
    """The source ``model.init_from`` names, matched to ``model`` (whole, as built): a shardwise
    checkpoint, or safetensors files."""
    if is_checkpoint(path):
        return CheckpointWeights(path, model)
    return PretrainedWeights.open(path, model)


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
    weights = open_weights(path, model)
    try:
        HeldWeights.of(weights, model, overwrite=True).load_whole(model)
    finally:
        weights.close()
