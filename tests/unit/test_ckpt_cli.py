"""``shardwise ckpt inspect`` and ``shardwise ckpt export`` on a checkpoint written in one process."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from shardwise.checkpoint import Piece, save
from shardwise.cli import main


def _write(root: Path) -> dict[str, torch.Tensor]:
    tensors = {"model/w": torch.randn(5, 7, dtype=torch.float64), "model/b": torch.arange(5.0)}
    pieces = [
        Piece("model/w", (5, 7), 0, 20, tensors["model/w"].reshape(-1)[:20]),  # two shards of one tensor
        Piece("model/w", (5, 7), 20, 35, tensors["model/w"].reshape(-1)[20:]),
        Piece.full("model/b", tensors["model/b"]),
        Piece.full("optim/exp_avg/b", torch.zeros(5)),
    ]
    save(str(root / "checkpoints"), 4, pieces, strategy="ddp")
    return tensors


def test_inspect_reports_tensors_shards_and_verified_checksums(tmp_path, capsys) -> None:
    _write(tmp_path)
    assert main(["ckpt", "inspect", str(tmp_path), "--json"]) == 0  # a run folder stands for its checkpoints
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] and info["step"] == 4 and info["checksums_verified"]
    assert info["tensors"]["model/w"]["global_shape"] == [5, 7]
    assert [(s["start"], s["stop"]) for s in info["tensors"]["model/w"]["shards"]] == [(0, 20), (20, 35)]
    assert all(s["checksum_ok"] for t in info["tensors"].values() for s in t["shards"])
    assert main(["ckpt", "inspect", str(tmp_path / "checkpoints" / "step-00000004")]) == 0
    assert "OK: all checksums verified" in capsys.readouterr().out


def test_inspect_names_a_damaged_file_and_fails(tmp_path, capsys) -> None:
    _write(tmp_path)
    shard = tmp_path / "checkpoints" / "step-00000004" / "rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    step_dir = str(shard.parent)
    assert main(["ckpt", "inspect", step_dir]) == 1
    out = capsys.readouterr().out
    assert "PROBLEMS" in out and "step-00000004/rank0.safetensors: crc32 mismatch" in out


def test_export_writes_the_model_whole(tmp_path, capsys) -> None:
    tensors = _write(tmp_path)
    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(tmp_path / "checkpoints"), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == {"b": [5], "w": [5, 7]}
    loaded = load_file(str(out))
    assert set(loaded) == {"w", "b"}
    assert torch.equal(loaded["w"], tensors["model/w"]) and torch.equal(loaded["b"], tensors["model/b"])


def test_missing_folder_is_one_line(tmp_path, capsys) -> None:
    assert main(["ckpt", "inspect", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such folder" in err[0]
