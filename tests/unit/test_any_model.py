"""Any model from the config: Hugging Face causal LMs from a config file, a user's factory, and the
one-line errors for each way they can be wrong (no ranks: these run in this process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from shardwise.commands.verify import VERIFY_DEFAULTS, verify_defaults
from shardwise.config import ConfigError, ModelConfig, load_config, model_source
from shardwise.engine.loss import TokenLoss
from shardwise.models import (
    build_model,
    check_model_config,
    count_parameters,
    predicted_tokens,
    shipped_configs,
)
from shardwise.models.adapters import resolve_units
from shardwise.models.hf import SHIPPED_DIR

transformers = pytest.importorskip("transformers")

FACTORIES = "tests.unit.model_factories"


def _build(kind: str, seed: int = 0, **extra: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(kind=kind, **extra), torch.float64)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "source"),
    [
        ("gpt", "builtin"),
        ("mlp", "builtin"),
        ("hf:tiny-gpt2", "hf"),
        ("hf:some/dir/config.json", "hf"),
        ("pkg.mod:make", "factory"),
        ("pkg.mod:Class.create", "factory"),
        ("hf:", ""),
        ("resnet", ""),
        ("pkg mod:make", ""),
    ],
)
def test_model_kinds(kind: str, source: str) -> None:
    assert model_source(kind) == source


def test_an_unknown_kind_is_refused_by_validate() -> None:
    config = load_config(None, {"model.kind": "resnet"})
    with pytest.raises(ConfigError, match=r"^model.kind must be gpt, mlp, hf:PATH/config.json .*'resnet'$"):
        config.validate(1)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_shipped_configs_are_tiny_byte_models(name: str) -> None:
    assert name in shipped_configs()
    raw = json.loads((SHIPPED_DIR / f"{name}.json").read_text())
    assert raw["vocab_size"] == 256
    assert all(v == 0 for k, v in raw.items() if "drop" in k)
    model = _build(f"hf:{name}")
    assert 1e5 <= count_parameters(model) <= 1e6
    assert next(model.parameters()).dtype == torch.float64
    if name == "tiny-llama":  # grouped-query attention
        assert raw["num_key_value_heads"] < raw["num_attention_heads"]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_hf_models_train_on_the_built_in_batches(name: str) -> None:
    model = _build(f"hf:{name}", seq_len=16)
    inputs = torch.randint(0, 256, (3, 16))
    batch = (inputs, torch.roll(inputs, -1, dims=1))
    loss = TokenLoss()
    value = loss(model(inputs), batch)  # a ModelOutput: its logits
    assert value.dim() == 0 and value.dtype == torch.float64
    assert loss.count(batch) == predicted_tokens(f"hf:{name}", 3, 16) == 48
    value.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_hf_weights_come_from_the_callers_seed() -> None:
    a, b, c = _build("hf:tiny-llama", 3), _build("hf:tiny-llama", 3), _build("hf:tiny-llama", 4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(a.parameters(), c.parameters(), strict=True))


def test_a_config_file_or_its_folder(tmp_path: Path) -> None:
    raw = json.loads((SHIPPED_DIR / "tiny-gpt2.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "n_layer": 2}))
    for kind in (f"hf:{tmp_path}", f"hf:{tmp_path / 'config.json'}"):
        model = _build(kind)
        assert len(model.transformer.h) == 2  # type: ignore[union-attr, arg-type]


def test_freeze_applies_to_hf_names() -> None:
    model = _build("hf:tiny-gpt2", freeze=("transformer.wpe",))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["transformer.wpe.weight"]


def test_hugging_face_block_lists_are_found() -> None:
    with torch.device("meta"):
        gpt2 = build_model(ModelConfig(kind="hf:tiny-gpt2"))
        llama = build_model(ModelConfig(kind="hf:tiny-llama"))
    assert resolve_units(gpt2, "").path == "transformer.h"  # type: ignore[union-attr]
    assert resolve_units(llama, "").path == "model.layers"  # type: ignore[union-attr]


def _write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return f"hf:{tmp_path / name}"


@pytest.mark.parametrize(
    ("content", "seq_len", "message"),
    [
        (None, 64, r"does not exist; give a config.json file, a folder holding one, or a shipped config"),
        ('{"model_type": ', 64, r"x.json is rejected by transformers: .*not a valid JSON file"),
        ('{"model_type": "nosuch"}', 64, r"x.json is rejected by transformers: .*nosuch"),
        ('{"model_type": "t5"}', 64, r"model_type 't5' has no causal-LM class in transformers"),
        ('{"model_type": "gpt2", "vocab_size": 100}', 64, r"vocab_size 100, but the built-in corpus"),
        ('{"model_type": "gpt2", "n_positions": 32}', 64, r"seq_len \(64\) is more than the 32 positions"),
    ],
)
def test_bad_hf_configs_are_one_line(tmp_path: Path, content: str | None, seq_len: int, message: str) -> None:
    kind = f"hf:{tmp_path / 'x.json'}" if content is None else _write(tmp_path, "x.json", content)
    with pytest.raises(ConfigError, match=message) as info:
        check_model_config(ModelConfig(kind=kind, seq_len=seq_len))
    assert "\n" not in str(info.value)


def test_a_config_transformers_cannot_build_is_one_line(tmp_path: Path) -> None:
    kind = _write(tmp_path, "x.json", '{"model_type": "gpt2", "n_embd": 64, "n_head": 5}')
    with pytest.raises(ConfigError, match=r"x.json: transformers cannot build a causal LM from it: .*divis"):
        build_model(ModelConfig(kind=kind))


def test_without_transformers_the_fix_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ConfigError, match=r"needs Hugging Face transformers.*pip install shardwise\[hf\]$"):
        check_model_config(ModelConfig(kind="hf:tiny-gpt2"))


def test_a_factory_with_or_without_the_model_config() -> None:
    bare = _build(f"{FACTORIES}:tiny_lm", seq_len=8)
    assert bare.pos.shape == (64, 16)  # type: ignore[union-attr]  # its own default
    sized = _build(f"{FACTORIES}:sized_lm", seq_len=8)
    assert sized.pos.shape == (8, 12)  # type: ignore[union-attr]  # from the ModelConfig
    assert sized.pos.dtype == torch.float64  # type: ignore[union-attr]
    assert check_model_config(ModelConfig(kind=f"{FACTORIES}:sized_lm")) == {}


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("nosuch", r"model_factories has no nosuch; its functions: not_a_model, sized_lm, tiny_lm$"),
        ("NOT_CALLABLE", r"tests.unit.model_factories.NOT_CALLABLE is a int, not a function"),
        ("not_a_model", r"returned a dict, not a torch.nn.Module; return the model itself"),
    ],
)
def test_bad_factories_are_one_line(function: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_model_config(ModelConfig(kind=f"{FACTORIES}:{function}"))


def test_a_module_that_does_not_import_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"cannot import no_such_pkg.models \(ModuleNotFoundError: No mod"):
        check_model_config(ModelConfig(kind="no_such_pkg.models:make"))


def test_verify_freezes_wpe_only_in_the_built_in_gpt() -> None:
    assert verify_defaults("gpt")["model.freeze"] == "wpe" == VERIFY_DEFAULTS["model.freeze"]
    for kind in ("mlp", "hf:tiny-gpt2", f"{FACTORIES}:tiny_lm"):
        assert "model.freeze" not in verify_defaults(kind)
