"""The model adapters, in one process: which adapter a model gets, its block list, the fallback's
refusals, the planner's readers without transformers, and the seams the next axes hook into (the
built-in GPT's ``attn.attention``; transformers' attention and experts registries), each shown to be
called and to leave the values unchanged (bit for bit, float64 where the model allows it)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.config import ConfigError, ModelConfig
from shardwise.models import build_model
from shardwise.models.adapters import FallbackAdapter, SplitError, adapter_for, block_lists, pipeline_adapter
from shardwise.models.adapters import hf as hf_seams
from shardwise.models.gpt import GPT, GPTConfig


def _gpt(**sizes: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"n_layer": 3, "n_head": 2, "d_model": 8, "seq_len": 8, **sizes})).double()


def _hf(name: str, **overrides: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from shardwise.models.hf import SHIPPED_DIR

    config = transformers.AutoConfig.from_pretrained(str(SHIPPED_DIR / f"{name}.json"), **overrides)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _counting(calls: list[str], tag: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrap that records each call and otherwise runs what it wraps."""

    def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(tag)
            return inner(*args, **kwargs)

        return wrapped

    return wrap


def test_each_family_gets_its_adapter_and_its_block_list_is_the_one_discovery_finds() -> None:
    models = {"gpt": _gpt(), "hf-gpt2": _hf("tiny-gpt2"), "hf-llama": _hf("tiny-llama")}
    for name, model in models.items():
        adapter = adapter_for(model)
        assert adapter.name == name
        found = adapter.block_list()
        assert found is not None and found.path == block_lists(model)[0].path == adapter.blocks_path
        assert adapter.moe_layers() == []  # dense families
    assert [n for n, _ in adapter_for(models["gpt"]).attention_modules()] == [
        f"blocks.{i}.attn" for i in range(3)
    ]
    assert adapter_for(models["hf-gpt2"]).attention_modules()[0][0] == "transformer.h.0.attn"
    assert adapter_for(models["hf-llama"]).attention_modules()[-1][0] == "model.layers.3.self_attn"
    explicit = adapter_for(models["gpt"]).block_list("blocks")  # zero.unit, by path
    assert explicit is not None and explicit.path == "blocks"


def test_a_model_without_an_adapter_gets_blocks_only_and_pp_tp_and_the_seams_refused_by_name() -> None:
    torch.manual_seed(0)
    mlp = build_model(ModelConfig(kind="mlp", preset="tiny"))
    adapter = adapter_for(mlp)
    assert isinstance(adapter, FallbackAdapter)
    found = adapter.block_list()
    assert found is not None and found.path == "blocks"
    with pytest.raises(
        ConfigError, match=r"^tensor parallelism needs a plan for the model, and there is none for MLP"
    ):
        adapter.tp_plan()
    with pytest.raises(SplitError, match=r"^a MLP cannot be split into pipeline stages"):
        pipeline_adapter(mlp)
    for call in (adapter.attention_modules, adapter.moe_layers, lambda: adapter.wrap_attention(lambda f: f)):
        with pytest.raises(ConfigError, match=r"^MLP has no adapter \(the built-in GPT, Hugging Face GPT-2"):
            call()
    with pytest.raises(ConfigError, match=r"^GPT has no MoE layers"):
        adapter_for(_gpt()).wrap_experts(lambda f: f)


def test_the_gpt_attention_seam_is_called_in_every_block_and_gives_the_same_values() -> None:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    model = _gpt()
    want = model(ids)
    calls: list[str] = []
    adapter_for(model).wrap_attention(_counting(calls, "sdpa"))
    assert torch.equal(model(ids), want)
    assert calls == ["sdpa"] * 3
    # the seam is the computation, not a bystander: another attention changes the logits
    adapter_for(model).wrap_attention(
        lambda inner: lambda q, k, v, **kw: inner(q, k, v, **{**kw, "is_causal": False})
    )
    assert not torch.equal(model(ids), want)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("tiny-gpt2", {}), ("tiny-gpt2", {"attn_implementation": "eager"}), ("tiny-llama", {})],
)
def test_the_hugging_face_attention_seam_is_transformers_registry_called_per_layer_same_values(
    name: str, overrides: dict[str, Any]
) -> None:
    ids = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0  # left padding: the mask function registered beside the attention is used
    model = _hf(name, **overrides)
    want = model(input_ids=ids, attention_mask=mask).logits
    calls: list[str] = []
    adapter_for(model).wrap_attention(_counting(calls, "attention"))
    assert model.config._attn_implementation.startswith("shardwise-attention-")
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)
    assert calls == ["attention"] * model.config.num_hidden_layers


def test_the_experts_seam_is_transformers_registry_and_finds_the_moe_layers() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)  # float32: grouped_mm takes no float64
    assert [n for n, _ in hf_seams.experts_modules(model)] == [
        f"model.layers.{i}.mlp.experts" for i in (0, 1)
    ]
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    want = model(input_ids=ids).logits
    calls: list[str] = []
    hf_seams.wrap_experts(model, _counting(calls, "experts"))
    assert torch.equal(model(input_ids=ids).logits, want)
    assert calls == ["experts"] * 2
    with pytest.raises(ConfigError, match=r"^MixtralForCausalLM has no adapter"):
        adapter_for(model).moe_layers()  # no family: expert parallelism refuses it by name
    with pytest.raises(ConfigError, match=r"has no experts module that transformers dispatches"):
        hf_seams.wrap_experts(_hf("tiny-llama"), _counting(calls, "experts"))


def test_the_planners_readers_need_no_transformers() -> None:
    script = """
import sys
class NoTransformers:
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "transformers":
            raise ImportError("transformers is not installed here")
sys.meta_path.insert(0, NoTransformers())
from shardwise.models.adapters import hf_shape, preset_shape
print(hf_shape("hf:tiny-gpt2").params, hf_shape("hf:tiny-llama").params, preset_shape("tiny", 64).params)
print("transformers" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    counts, imported = out.split("\n")[:2]
    assert imported == "False" and len(counts.split()) == 3
    assert int(counts.split()[2]) == sum(
        p.numel() for p in build_model(ModelConfig(preset="tiny")).parameters()
    )
