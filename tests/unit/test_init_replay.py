"""Record and replay of a model's initialisation: any part read alone equals that part of the whole.

A model built on the meta device records each tensor's in-place init ops; the replay draws every
tensor on a chunk grid set by its global shape, so a box (a tp shard) or a flat range (a ZeRO-3 shard)
read on its own equals the same elements of the whole tensor that one process materialises, for the
built-in models, Hugging Face GPT-2 and Llama, and the init functions torch skips on meta.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardwise.checkpoint.boxes import Box
from shardwise.checkpoint.source import HeldWeights
from shardwise.config import ConfigError, load_config
from shardwise.models import build_model
from shardwise.models.init_record import record_of
from shardwise.models.init_replay import (
    CHUNK_ELEMENTS,
    RandomInit,
    build_recorded,
    chunk_shape,
    chunks,
    materialize_whole,
    record_initialisation,
)


def _whole_and_source(kind: str, seed: int = 0) -> tuple[nn.Module, RandomInit]:
    cfg = load_config(None, {"model.kind": kind}).model
    torch.manual_seed(seed)
    whole = build_model(cfg)
    torch.manual_seed(seed)
    meta = build_model(cfg, meta=True)
    record = record_of(meta)
    assert record is not None
    return whole, RandomInit(record)


@pytest.mark.parametrize("kind", ["gpt", "mlp", "hf:tiny-gpt2", "hf:tiny-llama"])
def test_any_box_and_flat_range_equals_that_part_of_the_whole(kind: str) -> None:
    if kind.startswith("hf:"):
        pytest.importorskip("transformers")
    whole, source = _whole_and_source(kind)
    for name, p in whole.named_parameters():
        held = HeldWeights(source, {name: tuple(p.shape)}, {name: p.dtype})
        n = p.numel()
        for start, stop in ((0, n), (1, n - 1), (n // 3, n // 2 + 1)):
            assert torch.equal(held.read(name, start, stop), p.detach().reshape(-1)[start:stop]), name
        if p.dim() == 2 and min(p.shape) > 2:
            box = Box((1, 1), (p.shape[0] - 2, p.shape[1] // 2))
            assert torch.equal(source.read_box(name, box), p.detach()[1:-1, 1 : 1 + p.shape[1] // 2]), name


def test_the_recorded_init_is_the_models_own() -> None:
    """GPT-2's scheme, replayed: normal(0, 0.02), zero biases, ones for norms, the residual
    projections at 0.02 / sqrt(2 n_layer) (Hugging Face's _init_weights, recorded while built)."""
    pytest.importorskip("transformers")
    whole, _ = _whole_and_source("hf:tiny-gpt2")
    layers = whole.config.n_layer
    params = {name: p.detach() for name, p in whole.named_parameters()}
    assert abs(float(params["transformer.wte.weight"].std()) - 0.02) < 0.002
    residual = float(params["transformer.h.0.attn.c_proj.weight"].std())
    assert abs(residual - 0.02 / math.sqrt(2 * layers)) < 0.001
    assert torch.equal(params["transformer.h.0.ln_1.weight"], torch.ones(whole.config.n_embd))
    bias = params["transformer.h.0.attn.c_attn.bias"]
    assert torch.equal(bias, torch.zeros_like(bias))


def test_a_seed_changes_the_values_and_the_same_seed_repeats_them() -> None:
    cfg = load_config(None, {"model.preset": "tiny"}).model
    torch.manual_seed(3)
    a = build_model(cfg)
    torch.manual_seed(3)
    b = build_model(cfg)
    torch.manual_seed(4)
    c = build_model(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.get_parameter("wte.weight"), c.get_parameter("wte.weight"))


def test_float64_holds_the_float32_values() -> None:
    cfg = load_config(None, {"model.preset": "tiny"}).model
    torch.manual_seed(0)
    single = build_model(cfg)
    torch.manual_seed(0)
    double = build_model(cfg, torch.float64)
    for a, b in zip(single.parameters(), double.parameters(), strict=True):
        assert b.dtype == torch.float64 and torch.equal(a.double(), b)


def test_the_chunk_grid_depends_on_the_shape_alone() -> None:
    assert chunk_shape((8192, 28672)) == (1024, 1024)
    assert chunk_shape((50257, 27)) == (CHUNK_ELEMENTS // 27, 27)
    assert chunk_shape((10,)) == (10,)
    assert chunk_shape(()) == ()
    shape = (3000, 2500)
    grid = chunk_shape(shape)
    covered = torch.zeros(shape, dtype=torch.int64)
    for _, chunk in chunks(shape, grid, Box.full(shape)):
        covered[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.lengths, strict=True))] += 1
    assert bool((covered == 1).all())
    assert grid == (1024, 1024)  # a 3 x 3 grid: row block 1500 // 1024 = 1, column block 0
    assert {i for i, _ in chunks(shape, grid, Box((1500, 0), (1, 10)))} == {3}


class _Special(nn.Module):
    """Init ops torch skips on meta, views of parameters, a tie, values computed at build time."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(600, 3000))
        nn.init.trunc_normal_(self.a, std=1.0, a=-0.5, b=0.5)  # chunked: elementwise; torch skips it on meta
        self.b = nn.Parameter(torch.empty(40, 30))
        nn.init.orthogonal_(self.b)  # not elementwise: drawn whole
        self.emb = nn.Embedding(20, 8, padding_idx=3)  # its row 3 zeroed through a view
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight  # tied: drawn once under emb.weight
        self.scale = nn.Parameter(torch.ones(5) * 2)  # a constant: a fill
        self.table = nn.Parameter(torch.arange(12.0).reshape(3, 4))  # computed data: kept
        with torch.no_grad():
            self.a[:, :7].mul_(0.5)  # a region op on a view


def test_special_inits_replay_in_parts() -> None:
    torch.manual_seed(0)
    meta = build_recorded(_Special)
    record = record_of(meta)
    assert record is not None and set(record.tensors) == {"a", "b", "emb.weight", "scale", "table"}
    assert record.aliases["head.weight"] == "emb.weight"
    assert record.tensors["b"].whole and not record.tensors["a"].whole
    assert any("orthogonal_" in note for note in record.notes())
    torch.manual_seed(0)
    whole = build_recorded(_Special)
    materialize_whole(whole)
    assert whole.head.weight is whole.emb.weight and not whole.emb.weight.is_meta
    b = whole.b.detach()
    assert torch.allclose(b.T @ b, torch.eye(30), atol=1e-5)  # orthogonal, drawn whole
    assert torch.equal(whole.emb.weight[3], torch.zeros(8))
    assert torch.equal(whole.scale, torch.full((5,), 2.0))
    assert torch.equal(whole.table, torch.arange(12.0).reshape(3, 4))
    a = whole.a.detach()
    assert float(a.abs().max()) <= 0.5 and float(a[:, 7:].abs().max()) > 0.49  # truncated at 0.5
    source = RandomInit(record)
    for box in (Box((0, 1000), (600, 1100)), Box((599, 0), (1, 3000)), Box((100, 5), (7, 4))):
        index = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
        assert torch.equal(source.read_box("a", box), a[index])
    assert torch.equal(source.read_box("b", Box((5, 5), (3, 3))), b[5:8, 5:8])


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.custom = nn.Parameter(torch.empty(3))  # nothing initialises it


def test_a_model_a_user_built_on_meta_is_recorded_through_reset_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))
    record = record_initialisation(model)
    assert record is not None and {op.name for op in record.tensors["0.weight"].ops} == {"uniform_"}
    materialize_whole(model)
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model[1].weight, torch.ones(4))
    with torch.device("meta"):
        plain = _Plain()
    with pytest.raises(ConfigError, match="custom"):
        materialize_whole(plain)


def test_a_factory_that_reads_its_values_is_built_whole_and_said(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, {"model.kind": "tests.unit.meta_factories:reads_its_values"}).model
    torch.manual_seed(5)
    model = build_model(cfg, meta=True)  # asked for on meta, built whole instead
    assert not any(p.is_meta for p in model.parameters()) and record_of(model) is None
    assert "cannot be built on the meta device" in capsys.readouterr().err
    torch.manual_seed(5)
    again = build_model(cfg)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
