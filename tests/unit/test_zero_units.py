"""ZeRO-3 units: ``zero.unit`` by dotted path, the repeated blocks found when it is empty, one-line errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError, ModelConfig
from shardwise.models import build_model
from shardwise.models.adapters import block_lists, resolve_units


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))  # 216 params
        self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))  # 24 params
        self.mixed = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))  # not one class
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(2))  # no parameters


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(8, 2)


def test_the_largest_list_of_one_class_is_found() -> None:
    model = Outer()
    assert [b.path for b in block_lists(model)] == ["body.layers", "body.small"]
    found = resolve_units(model, "")
    assert found is not None and found.path == "body.layers" and len(found.container) == 3
    assert found.describe() == "body.layers (3 x Linear, 216 params)"


def test_a_dotted_path_names_the_list() -> None:
    found = resolve_units(Outer(), "body.small")
    assert found is not None and len(found.container) == 4
    mixed = resolve_units(Outer(), "body.mixed")  # named explicitly: any ModuleList/Sequential will do
    assert mixed is not None and len(mixed.container) == 3


def test_the_built_in_models_are_found_without_a_setting() -> None:
    with torch.device("meta"):
        gpt = build_model(ModelConfig(kind="gpt", preset="tiny"))
        mlp = build_model(ModelConfig(kind="mlp", preset="tiny"))
    assert resolve_units(gpt, "").path == "blocks"  # type: ignore[union-attr]
    assert resolve_units(mlp, "").path == "blocks"  # type: ignore[union-attr]


def test_a_model_without_a_list_is_one_unit() -> None:
    assert resolve_units(nn.Linear(3, 3), "") is None


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "body.blocks",
            r"^zero.unit 'body.blocks' names nothing in the model \(Outer\); block lists found: "
            r"body.layers \(3 x Linear, 216 params\); body.small .*set zero.unit to one of them",
        ),
        ("head", r"^zero.unit 'head' is a Linear, not a ModuleList or Sequential of blocks; block lists"),
    ],
)
def test_a_bad_unit_is_one_line_with_the_candidates(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        resolve_units(Outer(), path)
    assert "\n" not in str(info.value)


def test_no_candidates_says_so() -> None:
    with pytest.raises(ConfigError, match=r"has no ModuleList/Sequential of blocks: leave zero.unit empty"):
        resolve_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "missing")

