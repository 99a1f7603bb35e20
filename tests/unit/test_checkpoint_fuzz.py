"""Fuzzed manifests and safetensors headers: every reader either succeeds with the right data or raises
one line of ``CheckpointError``; never another exception, never a hang.

Each case is seeded (``SHARDWISE_FUZZ_SEED`` + case number, printed before it runs, so a failure names
the seed to replay with ``SHARDWISE_FUZZ_SEED=<seed> SHARDWISE_FUZZ_CASES=1``). ``SHARDWISE_FUZZ_CASES``
sets how many cases each test runs (default 250).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.checkpoint import Box, CheckpointError, Piece, save
from shardwise.checkpoint.inspect import format_inspect, inspect
from shardwise.checkpoint.reader import load, verify_checkpoint
from shardwise.cli import main

BASE_SEED = int(os.environ.get("SHARDWISE_FUZZ_SEED", "20240611"))
CASES = int(os.environ.get("SHARDWISE_FUZZ_CASES", "250"))
CASE_LIMIT_S = 20.0  # far above a normal case (milliseconds): a case this slow is a hang in the making

GARBAGE: list[Any] = [
    None, True, False, 0, -1, 1, 3, 7, 2**31, 2**63, 10**30, -(10**30), 1.5, float("nan"), float("inf"),
    "", "5", "xyz", "../x", "/etc/passwd", "F32", "float64", "rank0.safetensors", [], {}, [1, 2],
    [[[[]]]], {"a": [None, {"b": []}]}, {"start": 0, "stop": 1},
]  # fmt: skip
BAD_NAMES = [
    "../x.safetensors",
    "/etc/passwd",
    "",
    ".",
    "..",
    "a/b",
    "rank0.safetensors\0",
    "rank9.safetensors",
]


class _FakeComm:
    """Enough of a Comm to run two ranks' saves in this process (rank 0 last, so it publishes)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        tensor.fill_(77)

    def barrier(self) -> None:
        pass


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "model/w": torch.randn(4, 6, generator=g, dtype=torch.float64),
        "model/v": torch.randn(2, 3, 4, generator=g),
        "model/b": torch.randn(9, generator=g).to(torch.bfloat16),
        "model/mask": torch.rand(5, generator=g) > 0.5,
        "optim/step": torch.tensor(11, dtype=torch.int64),
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A two-rank checkpoint: w cut along dim 1 (boxes), v as box plus flat pieces, the rest flat."""
    state = _state()
    w, v, b = state["model/w"], state["model/v"], state["model/b"]
    per_rank = [
        [
            Piece.from_box("model/w", (4, 6), (0, 0), w[:, :2]),
            Piece("model/v", (2, 3, 4), 0, 5, v.reshape(-1)[:5]),
            Piece("model/b", (9,), 0, 4, b[:4]),
            Piece.full("model/mask", state["model/mask"]),
        ],
        [
            Piece.from_box("model/w", (4, 6), (0, 2), w[:, 2:]),
            Piece("model/v", (2, 3, 4), 5, 12, v.reshape(-1)[5:12]),
            Piece.from_box("model/v", (2, 3, 4), (1, 0, 0), v[1:]),
            Piece("model/b", (9,), 4, 9, b[4:]),
            Piece.full("optim/step", state["optim/step"]),
        ],
    ]
    root = tmp_path_factory.mktemp("fuzz-base")
    path = ""
    for rank in (1, 0):
        path = save(str(root), 1, per_rank[rank], _FakeComm(rank, 2), chunk_bytes=16).path  # type: ignore[arg-type]
    assert torch.equal(load(path, ["model/v"])["model/v"], v)
    return Path(path), state


# -- manifest mutations: each edits the parsed JSON (or its text) and says what it did -------------------
def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        node = node[step]
    return node


def _any_node_edit(data: dict[str, Any], rng: random.Random) -> str:
    path = rng.choice(_paths(data)[1:])
    parent, last = _get(data, path[:-1]), path[-1]
    op = rng.choice(["delete", "garbage", "garbage", "copy", "add"])
    if op == "delete":
        del parent[last]
    elif op == "copy":  # another subtree of the same manifest, in the wrong place
        parent[last] = copy.deepcopy(_get(data, rng.choice(_paths(data))))
    elif op == "add" and isinstance(parent, dict):
        parent[rng.choice(["offsets", "lengths", "start", "x", "box"])] = rng.choice(GARBAGE)
    else:
        parent[last] = copy.deepcopy(rng.choice(GARBAGE))
    return f"{op} at {list(path)}"


def _pieces(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, p) for n, t in data["tensors"].items() for p in t["pieces"]]


def _piece_edit(data: dict[str, Any], rng: random.Random) -> str:
    name, piece = rng.choice(_pieces(data))
    other = rng.choice(_pieces(data))[1]
    numbers = [k for k in ("start", "stop") if k in piece] + [
        (k, i) for k in ("offsets", "lengths") if k in piece for i in range(len(piece[k]))
    ]
    op = rng.choice(["shift", "shift", "file", "key", "checksums", "dup", "drop", "swap-kind"])
    if op == "shift" and numbers:  # overlapping or gapped pieces, out of bounds, negative
        where = rng.choice(numbers)
        delta = rng.choice([-2, -1, 1, 2, -100, 10**6])
        if isinstance(where, tuple):
            piece[where[0]][where[1]] += delta
        else:
            piece[where] += delta
        return f"{name}: {where} {delta:+d}"
    if op == "file":
        piece["file"] = rng.choice([*BAD_NAMES, "rank1.safetensors", "rank0.safetensors"])
    elif op == "key":
        piece["key"] = rng.choice([other["key"], "nope", ""])
    elif op == "checksums":
        piece["checksums"] = rng.choice(
            [other["checksums"], piece["checksums"][:-1], ["0" * 8] * len(piece["checksums"])]
        )
    elif op == "dup":
        data["tensors"][name]["pieces"].append(copy.deepcopy(piece))
    elif op == "drop":
        data["tensors"][name]["pieces"].remove(piece)
    else:  # a flat piece given a box too, or a box piece turned into a flat range
        if "start" in piece:
            piece["offsets"], piece["lengths"] = [0] * 2, [1, piece["stop"] - piece["start"]]
            if rng.random() < 0.5:
                del piece["start"], piece["stop"]
        else:
            piece["start"], piece["stop"] = 0, 1
    return f"{name}: {op}"


def _tensor_edit(data: dict[str, Any], rng: random.Random) -> str:
    name = rng.choice(sorted(data["tensors"]))
    rec = data["tensors"][name]
    op = rng.choice(["dtype", "shape", "shape", "rename"])
    if op == "dtype":
        rec["dtype"] = rng.choice(["float8", "complex64", "F32", "float32", "int64", "bool", "bfloat16", 7])
    elif op == "shape":
        shape = rec["global_shape"]
        rec["global_shape"] = rng.choice(
            [
                shape[::-1],
                [*shape, 1],
                [1, *shape],
                shape[:-1],
                [-d for d in shape],
                [10**12, *shape[1:]],
                [0],
            ]
        )
    else:
        data["tensors"][name + "x"] = data["tensors"].pop(name)
    return f"{name}: {op} -> {rec.get('dtype')} {rec.get('global_shape')}"


def _top_edit(data: dict[str, Any], rng: random.Random) -> str:
    key = rng.choice(["format_version", "chunk_bytes", "files", "files", "step", "rank_meta", "world_size"])
    if key == "format_version":
        data[key] = rng.choice([1, 2, 4, "3", 3.0, None, True])
    elif key == "chunk_bytes":
        data[key] = rng.choice([0, 7, 8, 16, 24, 2**40, -16, "16"])
    elif key == "files":
        name = rng.choice(sorted(data["files"]))
        if rng.random() < 0.5:
            data["files"][name] = rng.choice([0, -1, data["files"][name] + 1, 10**15, "1"])
        else:
            data["files"][rng.choice(BAD_NAMES)] = data["files"].pop(name)
    else:
        data[key] = copy.deepcopy(rng.choice(GARBAGE))
    return f"{key} -> {str(data.get(key))[:40]}"


def _text_edit(text: str, rng: random.Random) -> tuple[bytes, str]:
    raw = text.encode()
    op = rng.choice(["truncate", "flip", "utf8", "nest"])
    if op == "truncate":
        cut = rng.randrange(len(raw))
        return raw[:cut], f"truncated at {cut}"
    if op == "flip":
        at = rng.randrange(len(raw))
        return raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1 :], f"bit flip at {at}"
    if op == "utf8":
        at = rng.randrange(len(raw))
        return raw[:at] + b"\xff\xfe" + raw[at:], f"invalid UTF-8 at {at}"
    depth = rng.choice([1000, 100_000])
    return b"[" * depth + b"]" * depth, f"nested {depth} deep"


def _mutate_manifest(step_dir: Path, rng: random.Random) -> str:
    path = step_dir / "manifest.json"
    data = json.loads(path.read_text())
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        edit: Callable[[dict[str, Any], random.Random], str] = rng.choice(
            [_any_node_edit, _piece_edit, _piece_edit, _tensor_edit, _top_edit]
        )
        try:
            done.append(edit(data, rng))
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as err:
            done.append(
                f"{edit.__name__} skipped ({type(err).__name__})"
            )  # an earlier edit removed its target
    text = json.dumps(data)
    if rng.random() < 0.15:
        raw, what = _text_edit(text, rng)
        path.write_bytes(raw)
        done.append(what)
    else:
        path.write_text(text)
    return "; ".join(done)


# -- safetensors header mutations ---------------------------------------------------------------------
def _mutate_header(step_dir: Path, rng: random.Random) -> str:
    file = step_dir / rng.choice(["rank0.safetensors", "rank1.safetensors"])
    raw = bytearray(file.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    op = rng.choice(["length", "flip", "json", "json", "json", "data", "size"])
    if op == "length":
        new = rng.choice([0, 1, 7, length - 8, length + 8, len(raw), len(raw) - 8, 2**63 - 1, 2**64 - 1])
        raw[:8] = struct.pack("<Q", max(new, 0))
        what = f"length {length} -> {new}"
    elif op == "flip":
        at = 8 + rng.randrange(length)
        raw[at] ^= 1 << rng.randrange(8)
        what = f"header bit flip at {at}"
    elif op == "data":
        at = 8 + length + rng.randrange(len(raw) - 8 - length)
        raw[at] ^= 1 << rng.randrange(8)
        what = f"data bit flip at {at}"
    elif op == "size":
        cut = rng.choice([len(raw) - 1, len(raw) + 8, 8 + length])
        raw = raw[:cut] if cut <= len(raw) else raw + bytes(cut - len(raw))
        what = f"resized to {cut}"
    else:
        header = json.loads(raw[8 : 8 + length])
        key = rng.choice([k for k in header if k != "__metadata__"])
        entry = header[key]
        field = rng.choice(["dtype", "shape", "data_offsets", "delete", "rename", "garbage"])
        if field == "dtype":
            entry["dtype"] = rng.choice(["F32", "F64", "I64", "BF16", "BOOL", "U8", "F8_E4M3", "XX"])
        elif field == "shape":
            entry["shape"] = rng.choice(
                [[entry["shape"][0] - 1], [entry["shape"][0] + 1], [], [1, entry["shape"][0]]]
            )
        elif field == "data_offsets":
            a, b = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[a, b - 1], [a + 1, b + 1], [b, a], [a, 10**12], [-1, b]])
        elif field == "delete":
            del header[key]
        elif field == "rename":
            header[key + "!"] = header.pop(key)
        else:
            header[key] = copy.deepcopy(rng.choice(GARBAGE))
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) <= length:  # same length: only the header changed, the file keeps its size
            text += b" " * (length - len(text))
            raw[8 : 8 + length] = text
        else:
            raw = bytearray(struct.pack("<Q", len(text))) + text + raw[8 + length :]
        what = f"header {key!r} {field}"
    file.write_bytes(bytes(raw))
    return f"{file.name}: {what}"


# -- the checks -------------------------------------------------------------------------------------------
def _expect_ok_or_checkpoint_error(seed: int, what: str, label: str, run: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        result = run()
    except CheckpointError as err:
        message = str(err)
        assert message and "\n" not in message, f"seed {seed} ({what}): {label}: multi-line {message!r}"
        result = err
    except Exception as err:  # the point of this test: nothing but CheckpointError may escape
        pytest.fail(f"seed {seed} ({what}): {label} raised {type(err).__name__}: {err}")
    assert time.monotonic() - start < CASE_LIMIT_S, f"seed {seed} ({what}): {label} took too long"
    return result


def _check(step_dir: Path, state: dict[str, torch.Tensor], seed: int, what: str, capsys: Any) -> None:
    folder = str(step_dir)
    info = _expect_ok_or_checkpoint_error(seed, what, "inspect", lambda: inspect(folder))
    if isinstance(info, dict):
        format_inspect(info)
        json.dumps(info)
        assert len(info["problems"]) <= len(info["files"]) + sum(
            len(t["shards"]) for t in info["tensors"].values()
        )
    got = _expect_ok_or_checkpoint_error(seed, what, "load", lambda: load(folder, list(state)))
    if isinstance(got, dict):
        for name, t in state.items():
            same = got[name].dtype == t.dtype and torch.equal(got[name].reshape(-1), t.reshape(-1))
            assert same, f"seed {seed} ({what}): load returned wrong data for {name}"
        verify_checkpoint(folder, full=True)  # if load read every byte correctly, so must this
    _expect_ok_or_checkpoint_error(seed, what, "verify", lambda: verify_checkpoint(folder, full=True))
    some = {"model/w": Box((1, 1), (2, 4)), "model/v": (3, 20)}
    got = _expect_ok_or_checkpoint_error(seed, what, "partial load", lambda: load(folder, some))
    if isinstance(got, dict):
        assert torch.equal(got["model/w"], state["model/w"][1:3, 1:5]), f"seed {seed} ({what})"
        assert torch.equal(got["model/v"], state["model/v"].reshape(-1)[3:20]), f"seed {seed} ({what})"
    code = main(["ckpt", "inspect", folder])
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (0, 1, 2) and len(err) <= 1, f"seed {seed} ({what}): exit {code}, stderr {err}"


def _run_cases(
    base: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: Any,
    mutate: Callable[[Path, random.Random], str],
    offset: int,
) -> None:
    step_dir, state = base
    for case in range(CASES):
        seed = BASE_SEED + offset + case
        target = tmp_path / f"case-{case}" / step_dir.name
        shutil.copytree(step_dir, target)
        what = mutate(target, random.Random(seed))
        print(f"fuzz seed {seed}: {what}")  # shown by pytest when the case fails
        _check(target, state, seed, what, capsys)
        shutil.rmtree(target.parent)


def test_fuzzed_manifests_fail_in_one_checkpoint_error_line(base, tmp_path, capsys) -> None:
    _run_cases(base, tmp_path, capsys, _mutate_manifest, 0)


def test_fuzzed_safetensors_headers_fail_in_one_checkpoint_error_line(base, tmp_path, capsys) -> None:
    _run_cases(base, tmp_path, capsys, _mutate_header, 1_000_000)


def test_the_unmutated_base_passes_every_check(base, tmp_path, capsys) -> None:
    step_dir, state = base
    _check(step_dir, state, -1, "none", capsys)
    assert inspect(str(step_dir))["ok"]
