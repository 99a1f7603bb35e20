"""The activation counts measured: the bytes a forward pass leaves saved for backward, counted by a
dispatch mode (``shardwise.testing.memory.TensorBytes``: live floating-point storages, not RSS),
against the planner's ``block_activations`` plus the final norm's and head's inputs and the logits."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ModelConfig
from shardwise.models import build_model
from shardwise.models.adapters import hf_shape, preset_shape
from shardwise.planner.activations import block_activations
from shardwise.planner.model import ModelShape
from shardwise.testing.memory import TensorBytes

SEQ, BATCH = 64, 4


def _measured(cfg: ModelConfig, dtype: torch.dtype) -> int:
    torch.manual_seed(0)
    with TensorBytes() as counted:  # the model is built inside, so its weights are known before forward
        model = build_model(cfg, dtype)
        tokens = torch.randint(0, 256, (BATCH, SEQ))
        before = counted.live
        output = model(tokens)
        saved = counted.live - before  # activations autograd keeps, and the logits
    del output
    return saved


def _predicted(shape: ModelShape, element: int) -> float:
    tokens = BATCH * SEQ
    blocks = shape.n_layer * block_activations(shape, tokens, element, element).full
    head = tokens * shape.d_model * element * (2 if shape.layer_norm else 3)
    return blocks + head + tokens * shape.vocab * element


@pytest.mark.parametrize("preset", ["small", "base"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_gpt_saves_what_the_planner_counts(preset: str, dtype: torch.dtype) -> None:
    measured = _measured(ModelConfig(kind="gpt", preset=preset, seq_len=SEQ), dtype)
    predicted = _predicted(preset_shape(preset, SEQ), torch.empty((), dtype=dtype).element_size())
    assert measured / predicted == pytest.approx(1.0, abs=0.01)


def test_a_hugging_face_llama_saves_what_the_planner_counts() -> None:
    pytest.importorskip("transformers")
    measured = _measured(ModelConfig(kind="hf:tiny-llama", seq_len=SEQ), torch.float32)
    assert measured / _predicted(hf_shape("hf:tiny-llama"), 4) == pytest.approx(1.0, abs=0.01)


def _kept(cfg: ModelConfig) -> int:
    """Bytes a zero-bubble I pass keeps for W: the storages behind every record's input and output
    gradient (each once: q, k and v share their input)."""
    from shardwise.engine.linear import WeightGradStore
    from shardwise.pipeline.deferred import defer_weight_grads

    torch.manual_seed(0)
    model = build_model(cfg, torch.float32)
    store = WeightGradStore()
    defer_weight_grads(model, store)
    output = model(torch.randint(0, 256, (BATCH, SEQ)))
    logits = output if isinstance(output, torch.Tensor) else output.logits
    with store.collect() as kept:
        (logits * torch.randn_like(logits)).sum().backward()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for record in kept for t in (record.inputs, record.grad_output)}  # fmt: skip
    return sum(storages.values())


@pytest.mark.parametrize("kind", ["gpt", "hf:tiny-llama"])
def test_what_a_zero_bubble_i_pass_keeps_for_w_is_what_the_planner_counts(kind: str) -> None:
    """Each linear layer's input and output gradient, per block (``kept_per_token``) and for the head
    (``head_kept_per_token``): measured on the model's own storages."""
    from shardwise.planner.pipeline import head_kept_per_token, kept_per_token

    if kind != "gpt":
        pytest.importorskip("transformers")
    cfg = ModelConfig(kind=kind, preset="small", seq_len=SEQ)
    shape = preset_shape("small", SEQ) if kind == "gpt" else hf_shape(kind)
    tokens = BATCH * SEQ
    predicted = tokens * (shape.n_layer * kept_per_token(shape, 4) + head_kept_per_token(shape, 4))
    assert _kept(cfg) / predicted == pytest.approx(1.0, abs=0.01)
