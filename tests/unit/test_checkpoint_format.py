"""Checkpoint format, writer and reader in one process: round trips, damage detection, retention."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardwise.checkpoint as ckpt_pkg
from shardwise.checkpoint import layout, manager
from shardwise.checkpoint.errors import CorruptCheckpointError, ManifestError
from shardwise.checkpoint.format import (
    CHECKSUM,
    FORMAT_VERSION,
    Manifest,
    PieceRecord,
    TensorRecord,
    checksum,
    chunk_span,
    overlap,
    read_manifest,
    write_manifest,
)
from shardwise.checkpoint.inspect import export, format_inspect, inspect
from shardwise.checkpoint.manager import CheckpointWriter, Piece, save, spread_replicated
from shardwise.checkpoint.reader import CheckpointWarning, find_latest_valid, load, load_latest
from shardwise.checkpoint.rng import capture_rng, restore_rng


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(6, 5, generator=g, dtype=torch.float64),
        "model/b": torch.randn(7, generator=g).to(torch.bfloat16),
        "optim/step": torch.tensor(seed, dtype=torch.int64),
        "model/mask": torch.rand(4, generator=g) > 0.5,
    }


def _split_pieces(state: dict[str, torch.Tensor], cuts: int) -> list[Piece]:
    """Each tensor cut into ``cuts`` flat ranges (uneven), as if owned by several ranks."""
    pieces = []
    for name, t in state.items():
        n = t.numel()
        bounds = sorted({0, n, *(n * k // cuts + (k % 2) for k in range(1, cuts))} & set(range(n + 1)))
        flat = t.reshape(-1)
        pieces += [
            Piece(name, tuple(t.shape), a, b, flat[a:b]) for a, b in itertools.pairwise(bounds) if b > a
        ]
    return pieces


def _save(root: Path, step: int, state: dict[str, torch.Tensor], **kw: object) -> str:
    return save(str(root), step, _split_pieces(state, 3), chunk_bytes=16, **kw).path  # type: ignore[arg-type]


def test_manifest_round_trip(tmp_path: Path) -> None:
    _save(tmp_path, 5, _state(5), strategy="zero3", mesh={"dp": 4}, config={"steps": 9}, meta={"pos": 3})
    m = read_manifest(str(tmp_path / "step-00000005"))
    assert (m.step, m.strategy, m.mesh, m.config, m.meta) == (5, "zero3", {"dp": 4}, {"steps": 9}, {"pos": 3})
    assert Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert m.tensors["model/w"].global_shape == (6, 5) and m.tensors["model/b"].dtype == "bfloat16"
    write_manifest(str(tmp_path), m)
    assert read_manifest(str(tmp_path)) == m


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([(0, 4), (5, 10)], r"leaves \[4, 5\) uncovered"),
        ([(0, 6), (5, 10)], "overlaps the previous piece"),
        ([(0, 10), (10, 12)], "out of bounds"),
        ([(0, 8)], r"elements \[8, 10\) are in no piece"),
    ],
)
def test_manifest_validation_names_the_problem(pieces: list[tuple[int, int]], message: str) -> None:
    recs = tuple(PieceRecord("r0.safetensors", f"k{a}", a, b, ("x",)) for a, b in pieces)
    m = Manifest(step=1, tensors={"t": TensorRecord((10,), "float32", recs)}, files={"r0.safetensors": 1})
    with pytest.raises(ManifestError, match=message):
        m.validate()


def test_checksum_is_crc32_as_8_hex_digits() -> None:
    assert CHECKSUM == "crc32"
    assert checksum(b"123456789") == "cbf43926"  # the standard CRC-32 check value
    assert checksum(memoryview(b"")) == "00000000"
    assert checksum(b"\x00\x01") != checksum(b"\x00\x03") and checksum(b"ab") != checksum(b"a")


def test_manifest_records_its_checksum_and_refuses_unknown_ones(tmp_path: Path) -> None:
    m = Manifest(step=1)
    assert m.to_json()["checksum"] == CHECKSUM
    write_manifest(str(tmp_path), m)
    assert read_manifest(str(tmp_path)).checksum == CHECKSUM
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["checksum"] = "sha256"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError) as caught:
        read_manifest(str(tmp_path))
    assert "checksum algorithm 'sha256'" in str(caught.value) and "\n" not in str(caught.value)
    del data["checksum"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="missing checksum"):
        read_manifest(str(tmp_path))


def test_manifest_rejects_unknown_version_and_missing_keys(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format_version": 99, "step": 1, "tensors": {}, "files": {}})
    )
    with pytest.raises(ManifestError, match="format_version 99"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
    with pytest.raises(ManifestError, match="missing step, tensors, files"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(str(tmp_path))


def test_flat_range_arithmetic() -> None:
    assert chunk_span(0, 10, 4) == (0, 3)
    assert chunk_span(4, 8, 4) == (1, 2)
    assert chunk_span(5, 9, 4) == (1, 3)
    assert overlap((0, 5), (5, 9)) is None
    assert overlap((2, 7), (5, 9)) == (5, 7)


def test_any_flat_range_reads_back_across_pieces_and_chunks(tmp_path: Path) -> None:
    state = _state(1)
    _save(tmp_path, 1, state)
    full = load(str(tmp_path), list(state))
    for name, t in state.items():
        assert full[name].dtype == t.dtype and torch.equal(full[name], t), name
    rng = random.Random(0)
    flat = state["model/w"].reshape(-1)
    for _ in range(40):
        a = rng.randrange(0, 30)
        b = rng.randrange(a, 31)
        got = load(str(tmp_path), {"model/w": (a, b)})["model/w"]
        assert torch.equal(got, flat[a:b]), (a, b)


def _data_offset(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_flipped_byte_is_named_and_previous_checkpoint_used(tmp_path: Path) -> None:
    _save(tmp_path, 1, _state(1))
    newest = _save(tmp_path, 2, _state(2))
    target = os.path.join(newest, "rank0.safetensors")
    raw = bytearray(Path(target).read_bytes())
    raw[_data_offset(target) + 3] ^= 0x01
    Path(target).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"step-00000002/rank0.safetensors: crc32 mismatch"):
        load(newest, list(_state(2)))
    with pytest.warns(CheckpointWarning) as caught:
        found = find_latest_valid(str(tmp_path), full=True)
    assert found == str(tmp_path / "step-00000001")
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "step-00000002/rank0.safetensors: crc32 mismatch" in str(caught[0].message)
    messages: list[str] = []
    loaded = load_latest(str(tmp_path), list(_state(1)), on_bad=messages.append)
    assert loaded is not None and loaded.manifest.step == 1
    assert torch.equal(loaded.tensors["model/w"], _state(1)["model/w"])
    assert len(messages) == 1 and "rank0.safetensors" in messages[0]


def test_truncated_file_is_named_and_previous_checkpoint_used(tmp_path: Path) -> None:
    _save(tmp_path, 1, _state(1))
    newest = _save(tmp_path, 2, _state(2))
    target = os.path.join(newest, "rank0.safetensors")
    size = os.path.getsize(target)
    os.truncate(target, size - 5)
    messages: list[str] = []
    assert find_latest_valid(str(tmp_path), on_bad=messages.append) == str(tmp_path / "step-00000001")
    assert messages == [
        f"checkpoint {newest} skipped, using the previous one: step-00000002/rank0.safetensors: "
        f"{size - 5} bytes, the manifest records {size} (truncated)"
    ]


def test_half_written_folder_is_ignored_and_cleaned(tmp_path: Path) -> None:
    _save(tmp_path, 1, _state(1))
    half = tmp_path / layout.tmp_dir_name(2, "abc")
    half.mkdir()
    (half / "rank0.safetensors").write_bytes(b"\0" * 10)
    assert find_latest_valid(str(tmp_path)) == str(tmp_path / "step-00000001")
    assert half.exists()
    find_latest_valid(str(tmp_path), clean_tmp=True)
    assert not half.exists()


def test_keep_k_pruning(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save(tmp_path, step, _state(step), keep=2)
    assert [s for s, _ in layout.list_steps(str(tmp_path))] == [4, 5]
    assert layout.read_latest(str(tmp_path)) == str(tmp_path / "step-00000005")
    assert not layout.list_tmp(str(tmp_path))


def test_latest_pointer_updated_after_the_folder_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, 1, _state(1))
    seen: list[bool] = []

    def crash_before_pointer(root: str, step_dir: str) -> None:
        seen.append(os.path.exists(os.path.join(step_dir, "manifest.json")) and not layout.list_tmp(root))
        raise OSError("simulated crash")

    monkeypatch.setattr(layout, "write_latest", crash_before_pointer)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, 2, _state(2), keep=1)
    assert seen == [True]
    assert layout.read_latest(str(tmp_path)) == str(tmp_path / "step-00000001")  # pointer untouched
    assert len(layout.list_steps(str(tmp_path))) == 2  # and nothing pruned before it
    assert find_latest_valid(str(tmp_path)) == str(tmp_path / "step-00000002")  # the renamed one is complete


def test_async_save_snapshots_then_writes_in_background(tmp_path: Path) -> None:
    writer = CheckpointWriter(str(tmp_path), async_save=True, chunk_bytes=16)
    state = _state(3)
    expected = {n: t.clone() for n, t in state.items()}
    report = writer.save(3, _split_pieces(state, 2))
    state["model/w"].add_(1.0)  # training goes on: the checkpoint must hold the snapshot
    done = writer.wait()
    assert done is report and report.done and report.bytes > 0 and report.write_s > 0
    assert report.throughput_mb_s > 0 and report.path == str(tmp_path / "step-00000003")
    got = load(str(tmp_path), list(expected))
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert writer.wait() is None


def test_spread_replicated_balances_bytes() -> None:
    tensors = {"a": torch.zeros(100), "b": torch.zeros(60), "c": torch.zeros(50), "d": torch.zeros(10)}
    owners = spread_replicated(tensors, 2)
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert set(spread_replicated(tensors, 8).values()) == {0, 1, 2, 3}


def test_rng_states_round_trip(tmp_path: Path) -> None:
    import numpy as np

    state, pieces = capture_rng(0)
    save(str(tmp_path), 1, pieces, rank_meta={"rng": state})
    expected = (random.random(), np.random.rand(), torch.rand(2))
    loaded = load_latest(str(tmp_path), ["rng/torch/rank0"])
    assert loaded is not None
    restore_rng(loaded.manifest.rank_meta[0]["rng"], loaded.tensors, 0)
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_inspect_and_export(tmp_path: Path) -> None:
    state = _state(4)
    _save(tmp_path, 4, state, strategy="zero2")
    info = inspect(str(tmp_path))
    assert info["ok"] and info["checksums_verified"] and info["step"] == 4
    assert len(info["tensors"]["model/w"]["shards"]) == 3
    assert all(s["checksum_ok"] for t in info["tensors"].values() for s in t["shards"])
    assert "OK: all checksums verified" in format_inspect(info)
    out = tmp_path / "model.safetensors"
    shapes = export(str(tmp_path), str(out))
    assert shapes == {"b": [7], "mask": [4], "w": [6, 5]}
    plain = load_file(str(out))
    assert all(torch.equal(plain[n], state[f"model/{n}"]) for n in shapes)
    step_dir = tmp_path / "step-00000004"
    target = step_dir / "rank0.safetensors"
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF
    target.write_bytes(bytes(raw))
    bad = inspect(str(step_dir))
    assert not bad["ok"] and any("rank0.safetensors: crc32 mismatch" in p for p in bad["problems"])
    assert "PROBLEMS" in format_inspect(bad)


def test_no_pickle_in_checkpoint_code() -> None:
    folder = Path(ckpt_pkg.__file__).parent
    pattern = re.compile(r"\bpickle\b|torch\.load|torch\.save|\bnp\.load\b")
    # bench.py is excluded: it drives torch.distributed.checkpoint (which pickles its own metadata) as
    # the comparison point; it never reads a shardwise checkpoint through anything but reader.load.
    sources = [p for p in folder.glob("*.py") if p.name != "bench.py"]
    assert len(sources) >= 7
    offenders = [str(p) for p in sources if pattern.search(p.read_text())]
    assert offenders == []
    assert manager.__doc__  # the module was really read from this folder


@pytest.mark.slow
def test_bench_runs_and_reports_ratios() -> None:
    from shardwise.checkpoint.bench import run_ckpt_bench

    result = run_ckpt_bench(nproc=2, size_mb=2, repeats=1, timeout_s=120)
    assert result["bytes"] == 2_000_000
    for key in ("speed_ratio", "load_speed_ratio", "save_vs_raw", "raw_write_mb_s"):
        assert result[key] > 0, key
    assert set(result["save_mb_s"]) == {"shardwise", "dcp"}


# -- n-d box pieces (format 3) ---------------------------------------------------------------------
class _FakeComm:
    """Enough of a Comm to run every rank's save in this one process: rank 0 last, so it publishes."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        tensor.fill_(1234)  # every rank agrees on the temporary folder's token

    def barrier(self) -> None:
        pass


def _save_ranks(root: Path, step: int, per_rank: list[list[Piece]], chunk_bytes: int = 16) -> str:
    world = len(per_rank)
    report = None
    for rank in [*range(1, world), 0]:
        comm = _FakeComm(rank, world)
        report = save(str(root), step, per_rank[rank], comm, chunk_bytes=chunk_bytes)  # type: ignore[arg-type]
    assert report is not None
    return report.path


def _box_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w2": torch.randn(6, 10, generator=g, dtype=torch.float64),
        "model/w3": torch.randn(4, 5, 6, generator=g),
        "model/m": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "model/b": torch.randn(7, generator=g),
        "model/mask": torch.rand(9, generator=g) > 0.5,
        "optim/step": torch.tensor(seed + 3, dtype=torch.int64),
    }


def _box_pieces(state: dict[str, torch.Tensor]) -> list[list[Piece]]:
    """Three ranks: w2 cut along dim 1, w3 along dims 1 and 2, m mixes flat and box pieces, the rest flat."""
    w2, w3, m = state["model/w2"], state["model/w3"], state["model/m"]
    b, mask = state["model/b"], state["model/mask"]
    flat_m = m.reshape(-1)
    return [
        [
            Piece.from_box("model/w2", (6, 10), (0, 0), w2[:, 0:3]),
            Piece.from_box("model/w3", (4, 5, 6), (0, 0, 0), w3[:, 0:2, :]),
            Piece("model/m", (5, 4), 0, 6, flat_m[0:6]),  # rows 0-1 and half of row 1: flat
            Piece("model/b", (7,), 0, 3, b[0:3]),
            Piece.full("model/mask", mask),
        ],
        [
            Piece.from_box("model/w2", (6, 10), (0, 3), w2[:, 3:7]),
            Piece.from_box("model/w3", (4, 5, 6), (0, 2, 0), w3[:, 2:5, 0:3]),
            Piece.from_box("model/m", (5, 4), (1, 2), m[1:2, 2:4]),
            Piece("model/b", (7,), 3, 7, b[3:7]),
        ],
        [
            Piece.from_box("model/w2", (6, 10), (0, 7), w2[:, 7:10]),
            Piece.from_box("model/w3", (4, 5, 6), (0, 2, 3), w3[:, 2:5, 3:6]),
            Piece.from_box("model/m", (5, 4), (2, 0), m[2:5, :]),
            Piece.full("optim/step", state["optim/step"]),
        ],
    ]


def _random_box(rng: random.Random, shape: tuple[int, ...]) -> ckpt_pkg.Box:
    offsets, lengths = [], []
    for size in shape:
        a = rng.randrange(size)
        offsets.append(a)
        lengths.append(rng.randrange(1, size - a + 1))
    return ckpt_pkg.Box(tuple(offsets), tuple(lengths))


def _slice_of(t: torch.Tensor, box: ckpt_pkg.Box) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]


def test_box_pieces_round_trip_whole_by_flat_ranges_and_by_boxes(tmp_path: Path) -> None:
    state = _box_state()
    step_dir = _save_ranks(tmp_path, 1, _box_pieces(state))
    manifest = read_manifest(step_dir)
    assert manifest.format_version == FORMAT_VERSION == 3 and manifest.world_size == 3
    w2 = manifest.tensors["model/w2"].pieces
    assert [p.box for p in w2] == [ckpt_pkg.Box((0, c), (6, n)) for c, n in ((0, 3), (3, 4), (7, 3))]
    assert [p.file for p in w2] == ["rank0.safetensors", "rank1.safetensors", "rank2.safetensors"]
    assert Manifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    whole = load(step_dir, list(state), manifest=manifest)
    for name, t in state.items():
        assert whole[name].dtype == t.dtype and torch.equal(whole[name], t), name
    rng = random.Random(0)
    for name in ("model/w2", "model/w3", "model/m", "model/b"):
        t, n = state[name], state[name].numel()
        for _ in range(25):  # flat ranges that cut across boxes
            a = rng.randrange(n)
            b = rng.randrange(a, n + 1)
            got = load(step_dir, {name: (a, b)}, manifest=manifest)[name]
            assert torch.equal(got, t.reshape(-1)[a:b]), (name, a, b)
        for _ in range(25):  # boxes that cut across flat pieces and other boxes
            box = _random_box(rng, tuple(t.shape))
            for verify in (True, False):
                got = load(step_dir, {name: box}, manifest=manifest, verify=verify)[name]
                assert got.shape == box.lengths and torch.equal(got, _slice_of(t, box)), (name, box)
    scalar = load(step_dir, {"optim/step": ckpt_pkg.Box((), ())}, manifest=manifest)["optim/step"]
    assert scalar.shape == () and torch.equal(scalar, state["optim/step"])


def test_box_request_reads_only_the_chunks_it_needs_and_crc_catches_a_flip(tmp_path: Path) -> None:
    state = _box_state(1)
    step_dir = _save_ranks(tmp_path, 1, _box_pieces(state))
    target = os.path.join(step_dir, "rank1.safetensors")
    key = "model/w2 box[0:6, 3:7]"
    with open(target, "rb") as f:
        head_len = int.from_bytes(f.read(8), "little")
        start = json.loads(f.read(head_len))[key]["data_offsets"][0]
    raw = bytearray(Path(target).read_bytes())
    raw[8 + head_len + start + 5 * 4 * 8 + 1] ^= 0x10  # inside row 5 of the box: its last 16-byte chunks
    Path(target).write_bytes(bytes(raw))
    top = ckpt_pkg.Box((0, 2), (2, 6))  # rows 0-1 only: never touches the damaged chunk
    assert torch.equal(load(step_dir, {"model/w2": top})["model/w2"], state["model/w2"][0:2, 2:8])
    with pytest.raises(
        CorruptCheckpointError, match=r"rank1.safetensors: crc32 mismatch in 'model/w2 box\[0:6, 3:7\]'"
    ):
        load(step_dir, {"model/w2": ckpt_pkg.Box((4, 4), (2, 2))})
    with pytest.raises(CorruptCheckpointError, match="crc32 mismatch"):
        load(step_dir, ["model/w2"])
    bad = inspect(step_dir)
    assert not bad["ok"] and len(bad["problems"]) == 1 and key in bad["problems"][0]
    shards = bad["tensors"]["model/w2"]["shards"]
    assert [s["checksum_ok"] for s in shards] == [True, False, True]
    assert shards[1]["offsets"] == [0, 3] and shards[1]["lengths"] == [6, 4] and "start" not in shards[1]


def test_inspect_and_export_of_box_pieces(tmp_path: Path) -> None:
    state = _box_state(2)
    step_dir = _save_ranks(tmp_path, 3, _box_pieces(state))
    info = inspect(step_dir)
    assert info["ok"] and info["format_version"] == 3
    text = format_inspect(info)
    assert "box offsets [0, 3] lengths [6, 4] in rank1.safetensors  ok" in text
    assert "OK: all checksums verified" in text
    out = tmp_path / "model.safetensors"
    shapes = export(step_dir, str(out))
    assert shapes == {"b": [7], "m": [5, 4], "mask": [9], "w2": [6, 10], "w3": [4, 5, 6]}
    plain = load_file(str(out))
    assert all(torch.equal(plain[n], state[f"model/{n}"]) for n in shapes)


def _records(shape: tuple[int, ...], *where: object, version: int = FORMAT_VERSION) -> Manifest:
    pieces = []
    for i, w in enumerate(where):
        if isinstance(w, ckpt_pkg.Box):
            pieces.append(PieceRecord.of_box("r0.safetensors", f"k{i}", w, ("x",)))
        else:
            a, b = w  # type: ignore[misc]
            pieces.append(PieceRecord("r0.safetensors", f"k{i}", a, b, ("x",)))
    tensors = {"t": TensorRecord(shape, "float32", tuple(pieces))}
    return Manifest(step=1, tensors=tensors, files={"r0.safetensors": 10**6}, format_version=version)


B = ckpt_pkg.Box


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ((B((0, 0), (3, 2)), B((0, 2), (3, 2))), None),
        ((B((0, 0), (3, 2)), (2, 4), B((1, 2), (2, 2))), None),  # a flat range between two boxes
        (
            (B((0, 0), (3, 2)), B((0, 1), (3, 3))),
            r"piece box \[0:3, 0:2\] in r0.safetensors overlaps piece "
            r"box \[0:3, 1:4\] in r0.safetensors \(both hold \[0:3, 1:2\]\)",
        ),
        ((B((0, 0), (3, 2)), (3, 6)), r"overlaps piece \[3, 6\)"),
        ((B((0, 0), (3, 2)), B((0, 2), (2, 2))), r"its pieces hold 10 of its 12 elements; 2 are in no piece"),
        ((B((0, 0), (3, 2)), B((0, 2), (3, 3))), r"outside the tensor's global shape \[3, 4\]"),
        ((B((0, 0), (3, 2)), B((0, 2, 0), (3, 2, 1))), "outside the tensor's global shape"),
        ((B((0, 0), (3, 0)), B((0, 0), (3, 4))), "holds no element"),
    ],
)
def test_mixed_piece_validation_names_the_problem(where: tuple[object, ...], message: str | None) -> None:
    m = _records((3, 4), *where)
    if message is None:
        m.validate()
        return
    with pytest.raises(ManifestError, match=message) as caught:
        m.validate()
    assert "tensor 't'" in str(caught.value) and "\n" not in str(caught.value)


def test_format_2_manifests_read_but_cannot_hold_boxes(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="box pieces need format_version 3"):
        _records((3, 4), B((0, 0), (3, 4)), version=2).validate()
    _records((3, 4), (0, 12), version=2).validate()
    data = _records((3, 4), B((0, 0), (3, 4))).to_json()
    data["format_version"] = 2
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        ManifestError, match=r"piece 0: a box piece \(offsets/lengths\) needs format_version 3"
    ):
        read_manifest(str(tmp_path))


FIXTURES = Path(__file__).parent.parent / "fixtures"


def test_format_2_fixture_loads_bit_exact() -> None:
    from shardwise.engine.full_state import FolderReader

    expected = load_file(str(FIXTURES / "ckpt-format2-expected.safetensors"))
    assert set(expected) == {"w", "b"}
    step_dir = str(FIXTURES / "ckpt-format2" / "step-00000004")
    assert read_manifest(step_dir).format_version == 2
    for where in (step_dir, str(FIXTURES / "ckpt-format2")):  # a step folder, or the root
        got = load(where, ["model/w", "model/b"])
        assert all(
            torch.equal(got[f"model/{n}"], t) and got[f"model/{n}"].dtype == t.dtype
            for n, t in expected.items()
        )
    reader = FolderReader(step_dir)
    assert reader.manifest.step == 4 and reader.shapes["model/w"] == tuple(expected["w"].shape)
    got = reader({"model/w": None, "model/b": (2, 6)})
    assert torch.equal(got["model/w"], expected["w"]) and torch.equal(got["model/b"], expected["b"][2:6])
    across = load(step_dir, {"model/w": B((1, 2), (3, 4))})["model/w"]  # a box over format-2 flat pieces
    assert torch.equal(across, expected["w"][1:4, 2:6])
    assert inspect(step_dir)["ok"]


def test_writer_refuses_bad_boxes(tmp_path: Path) -> None:
    w = torch.zeros(4, 6)
    cases = [
        (Piece.from_box("w", (4, 6), (0, 4), w[:, 0:3]), r"box \[0:4, 4:7\] is outside its global shape"),
        (Piece.from_box("w", (4, 6), (0,), w[:, 0]), "outside its global shape"),
        (
            Piece("w", (4, 6), None, None, w[:2].reshape(-1), B((0, 0), (2, 5))),
            "has 10 elements but the tensor has 12",
        ),
        (Piece.from_box("w", (4, 6), (0, 0), w[:, 0:0]), "is empty; leave it out of the save"),
        (Piece("w", (4, 6), 0, 4, w[0, :4], B((0, 0), (1, 4))), "also has a flat range"),
    ]
    for piece, message in cases:
        with pytest.raises(ckpt_pkg.CheckpointError, match=message):
            save(str(tmp_path), 1, [piece])
