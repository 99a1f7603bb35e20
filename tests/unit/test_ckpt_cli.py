"""``shardwise ckpt inspect`` and ``shardwise ckpt export`` on a checkpoint written in one process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint import CheckpointError, ManifestError, Piece, layout, load, load_latest, save
from shardwise.checkpoint.reader import verify_checkpoint
from shardwise.cli import main
from shardwise.engine.full_state import load_checkpoint


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


def _step_dir(root: Path) -> Path:
    return root / "checkpoints" / "step-00000004"


def _rename_file(step_dir: Path, new_name: str) -> None:
    """Point the manifest's rank0 entry (files and pieces) at ``new_name``."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"] = {new_name if k == "rank0.safetensors" else k: v for k, v in manifest["files"].items()}
    for rec in manifest["tensors"].values():
        for piece in rec["pieces"]:
            if piece["file"] == "rank0.safetensors":
                piece["file"] = new_name
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../x.safetensors", "/etc/passwd", "sub/rank0.safetensors", ".."])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path, capsys, name: str) -> None:
    _write(tmp_path)
    step_dir = _step_dir(tmp_path)
    shutil.copy(step_dir / "rank0.safetensors", step_dir.parent / "x.safetensors")  # there to be followed
    _rename_file(step_dir, name)
    for argv in (
        ["ckpt", "inspect", str(step_dir)],
        ["ckpt", "export", str(step_dir), str(tmp_path / "o.st")],
    ):
        assert main(argv) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and "outside the checkpoint folder" in err[0] and repr(name) in err[0], err
        assert "OK" not in captured.out
    with pytest.raises(ManifestError, match="outside the checkpoint folder"):
        verify_checkpoint(str(step_dir))
    model = torch.nn.Linear(7, 5)
    with pytest.raises(ManifestError, match="outside the checkpoint folder"):
        load_checkpoint(str(step_dir), model, torch.optim.SGD(model.parameters(), lr=0.1))
    messages: list[str] = []
    assert load_latest(str(tmp_path / "checkpoints"), ["model/b"], on_bad=messages.append) is None
    assert len(messages) == 1 and "outside the checkpoint folder" in messages[0]


def test_a_data_file_linked_outside_the_folder_is_refused(tmp_path, capsys) -> None:
    _write(tmp_path)
    step_dir = _step_dir(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(step_dir / "rank0.safetensors", outside)
    os.symlink(outside, step_dir / "rank0.safetensors")
    assert main(["ckpt", "inspect", str(step_dir)]) == 1
    out = capsys.readouterr().out
    assert "rank0.safetensors: resolves to" in out and "outside the checkpoint folder" in out
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load(str(step_dir), ["model/b"])
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        verify_checkpoint(str(step_dir))
    os.remove(step_dir / "rank0.safetensors")  # a link inside the folder is fine
    shutil.move(outside, step_dir / "data.bin")
    os.symlink("data.bin", step_dir / "rank0.safetensors")
    assert torch.equal(load(str(step_dir), ["model/b"])["model/b"], torch.arange(5.0))


def test_the_latest_pointer_must_name_a_folder_in_the_root(tmp_path) -> None:
    _write(tmp_path)
    root = tmp_path / "checkpoints"
    assert layout.read_latest(str(root)) == str(root / "step-00000004")
    for bad in ("../checkpoints/step-00000004", "/etc", "..", "step-00000004/../.."):
        (root / "latest").write_text(bad + "\n")
        with pytest.raises(CheckpointError, match="outside the checkpoint root") as caught:
            layout.read_latest(str(root))
        assert "\n" not in str(caught.value)
    os.symlink(tmp_path, root / "step-link")
    (root / "latest").write_text("step-link\n")
    with pytest.raises(CheckpointError, match="outside the checkpoint root"):
        layout.read_latest(str(root))


def test_export_into_an_existing_folder_is_one_line_and_leaves_nothing(tmp_path, capsys) -> None:
    _write(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["ckpt", "export", str(tmp_path), str(out_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a folder" in err[0] and "model.safetensors" in err[0]
    assert list(out_dir.iterdir()) == [] and not list(tmp_path.glob("*.tmp-*"))


def test_a_damaged_header_is_one_problem_per_file(tmp_path, capsys) -> None:
    _write(tmp_path)
    shard = _step_dir(tmp_path) / "rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:10] = b"[["  # the JSON header no longer parses
    shard.write_bytes(bytes(data))
    assert main(["ckpt", "inspect", str(shard.parent), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert len(info["problems"]) == 1 and "rank0.safetensors: cannot be opened" in info["problems"][0]
    assert {s["checksum_ok"] for t in info["tensors"].values() for s in t["shards"]} == {False}


def test_a_root_with_no_usable_checkpoint_says_why_each_was_skipped(tmp_path, capsys) -> None:
    """It used to say only "no complete checkpoint here", dropping the reason."""
    _write(tmp_path)
    _rename_file(_step_dir(tmp_path), "../x.safetensors")
    root = str(tmp_path / "checkpoints")
    assert main(["ckpt", "inspect", root]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"shardwise ckpt inspect: {root}: no complete checkpoint here; checkpoint ")
    assert "step-00000004 skipped: " in err[0] and "outside the checkpoint folder" in err[0], err


def test_a_manifest_whose_sampler_step_disagrees_with_its_step_is_corrupt(tmp_path) -> None:
    """It was trusted: a resume would pair step 4's weights with step 9's data and schedule. Refused
    as corrupt, the newest-valid search falls back to the previous checkpoint like any damaged one."""
    root = tmp_path / "checkpoints"
    for step in (3, 4):
        save(str(root), step, [Piece.full("model/b", torch.arange(5.0))], meta={"sampler": {"step": step}})
    step_dir = root / "step-00000004"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["meta"]["sampler"]["step"] = 9
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"meta.sampler.step 9 disagrees with the manifest's step 4"):
        verify_checkpoint(str(step_dir))
    messages: list[str] = []
    loaded = load_latest(str(root), ["model/b"], on_bad=messages.append)
    assert loaded is not None and loaded.manifest.step == 3
    assert len(messages) == 1 and "meta.sampler.step 9" in messages[0]
