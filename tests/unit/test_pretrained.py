"""``model.init_from`` in one process: parameters on meta and buffers real, flat ranges read box by box,
ties, Hugging Face sharded folders, the dtype note, and each bad input in one line."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from shardwise.checkpoint.pretrained import PretrainedWeights, load_pretrained
from shardwise.config import ConfigError, load_config
from shardwise.models import build_model
from shardwise.models.init_replay import build_recorded
from shardwise.preflight import preflight


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.cube = nn.Parameter(torch.zeros(3, 4, 5))
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, two names
        self.register_buffer("scale", torch.full((2,), 7.0), persistent=False)


class Recording(PretrainedWeights):
    """Remembers how many elements each read took from the file."""

    taken = 0

    def _slice(self, name: str) -> tuple[Any, Any]:
        sl, entry = super()._slice(name)
        outer = self

        class Counting:
            def __getitem__(self, index: Any) -> torch.Tensor:
                part = sl[index]
                outer.taken += part.numel()
                return part

        return Counting(), entry


def test_a_flat_range_reads_only_the_boxes_it_covers(tmp_path: Path) -> None:
    cube = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    save_file({"cube": cube, "embed.weight": torch.zeros(5, 4)}, tmp_path / "w.safetensors")
    model = build_recorded(Tied)
    weights = Recording.open(str(tmp_path / "w.safetensors"), model)
    for start, stop in itertools.combinations(range(0, 61, 3), 2):
        weights.taken = 0
        assert torch.equal(weights.read("cube", start, stop), cube.reshape(-1)[start:stop]), (start, stop)
        assert weights.taken == stop - start  # not one element more than the range


def test_a_tied_weight_loads_once_by_the_name_the_file_has_and_stays_tied(tmp_path: Path) -> None:
    embed = torch.randn(5, 4)
    save_file({"head.weight": embed, "cube": torch.ones(3, 4, 5)}, tmp_path / "w.safetensors")
    model = build_recorded(Tied)
    assert all(p.is_meta for p in model.parameters()) and not model.scale.is_meta
    load_pretrained(model, str(tmp_path / "w.safetensors"))
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, embed)
    assert torch.equal(model.scale, torch.full((2,), 7.0))  # computed, not loaded


@pytest.mark.parametrize("kind", ["hf:tiny-llama", "hf:tiny-gpt2"])
def test_a_sharded_hugging_face_folder_loads_into_a_meta_model(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cfg = load_config(None, {"model.kind": kind}).model
    torch.manual_seed(3)
    saved = build_model(cfg)
    saved.save_pretrained(str(tmp_path), max_shard_size="100KB")  # several files and an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = build_model(cfg, torch.float64, meta=True)
    load_pretrained(model, str(tmp_path))
    for name, value in saved.state_dict().items():  # buffers (rotary inv_freq) computed, equal
        assert torch.equal(model.state_dict()[name], value.double()), name


def test_the_dtype_note_says_whether_values_are_rounded(tmp_path: Path) -> None:
    wide = {"cube": torch.ones(3, 4, 5, dtype=torch.float64), "embed.weight": torch.ones(5, 4)}
    save_file(wide, tmp_path / "w.safetensors")
    model = build_recorded(Tied)
    note = PretrainedWeights.open(str(tmp_path / "w.safetensors"), model).cast_note()
    assert note is not None and "float64 -> float32" in note and "precision is lost" in note
    model.double()
    note = PretrainedWeights.open(str(tmp_path / "w.safetensors"), model).cast_note()
    assert note is not None and "float32 -> float64" in note and note.endswith("exactly")


def _one_line(error: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_bad_init_from_paths_are_one_line(tmp_path: Path) -> None:
    config = load_config(None, {"model.kind": "gpt", "model.init_from": str(tmp_path / "nope")})
    with pytest.raises(ConfigError) as missing:
        preflight(config, 1, writes_run_files=False)
    assert "does not exist" in _one_line(missing) and "model.init_from" in str(missing.value)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    config = load_config(None, {"model.kind": "gpt", "model.init_from": str(tmp_path)})
    with pytest.raises(ConfigError) as empty:
        preflight(config, 1, writes_run_files=False)
    assert "holds no .safetensors file (it holds pytorch_model.bin)" in _one_line(empty)


def test_names_and_shapes_that_do_not_fit_are_one_line(tmp_path: Path) -> None:
    cfg = load_config(None, {"model.kind": "gpt", "model.preset": "tiny"})
    torch.manual_seed(0)
    state = build_model(cfg.model).state_dict()
    del state["head.weight"]  # tied: the file holds it once, as wte.weight
    save_file(state, tmp_path / "tiny.safetensors")
    fits = load_config(None, {"model.kind": "gpt", "model.preset": "tiny", "model.init_from": str(tmp_path)})
    preflight(fits, 1, writes_run_files=False)  # the tied head's other name is enough
    other = load_config(None, {"model.kind": "mlp", "model.preset": "tiny", "model.init_from": str(tmp_path)})
    with pytest.raises(ConfigError) as names:
        preflight(other, 1, writes_run_files=False)
    text = _one_line(names)
    assert "has no weights for" in text and "holds" in text and "saved from another model" in text
    wider = load_config(None, {"model.kind": "gpt", "model.preset": "odd", "model.init_from": str(tmp_path)})
    with pytest.raises(ConfigError) as shape:
        preflight(wider, 1, writes_run_files=False)
    assert "has shape [256, 64] in the file but [256, 27] in the model" in _one_line(shape)
