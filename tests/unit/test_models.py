"""The reference models: shapes, presets, weight tying, freezing, causality, float64, determinism."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import ConfigError, ModelConfig
from shardwise.data import DataSampler, load_corpus
from shardwise.models import GPT, MLP, PRESETS, GPTConfig, MLPConfig, build_model, count_parameters

# Expected parameter ranges at vocab 256, seq_len 64 (the brief's targets).
GPT_RANGES = {
    "tiny": (0.05e6, 0.2e6),
    "small": (0.7e6, 1.5e6),
    "base": (7e6, 14e6),
    "medium": (24e6, 31e6),
    "large": (85e6, 115e6),
}


def _tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=12, **overrides))


def test_gpt_shapes_and_no_buffers() -> None:
    model = _tiny_gpt()
    idx = torch.randint(0, 256, (3, 12))
    assert model(idx).shape == (3, 12, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)
    assert list(model.buffers()) == []
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    with pytest.raises(ValueError, match="longer than"):
        model(torch.zeros(1, 13, dtype=torch.long))


def test_gpt_d_ff_default_and_validation() -> None:
    assert GPTConfig(d_model=24, n_head=2).d_ff == 96
    assert GPTConfig(d_model=24, n_head=2, d_ff=10).d_ff == 10
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(d_model=10, n_head=3)


@pytest.mark.parametrize("preset", sorted(GPT_RANGES))
def test_gpt_preset_sizes(preset: str) -> None:
    # The meta device builds the shapes without allocating or initialising 100M values.
    with torch.device("meta"):
        model = GPT(GPTConfig(**PRESETS["gpt"][preset], seq_len=64))
    low, high = GPT_RANGES[preset]
    assert low <= count_parameters(model) <= high


def test_mlp_preset_sizes_grow() -> None:
    sizes = [count_parameters(MLP(MLPConfig(**PRESETS["mlp"][p]))) for p in ("tiny", "small", "base")]
    assert sizes == sorted(sizes) and sizes[0] < 0.1e6 and sizes[2] > 1e6


def test_tied_weights_are_one_parameter() -> None:
    tied = _tiny_gpt()
    assert tied.head.weight is tied.wte.weight
    untied = _tiny_gpt(tie_weights=False)
    assert untied.head.weight is not untied.wte.weight
    assert count_parameters(untied) - count_parameters(tied) == 256 * 16
    # A gradient through the head lands in the embedding's .grad too.
    tied(torch.randint(0, 256, (2, 4))).sum().backward()
    assert tied.wte.weight.grad is not None and tied.wte.weight.grad.abs().sum() > 0


def test_gpt_is_causal() -> None:
    model = _tiny_gpt().double()
    idx = torch.randint(0, 256, (2, 10))
    changed = idx.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 256
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :6], after[:, :6], rtol=0, atol=0)
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_float64_forward_backward() -> None:
    model = build_model(ModelConfig(kind="gpt", preset="tiny", seq_len=8), dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.dtype == torch.float64
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in model.parameters())


def test_init_is_deterministic_and_float64_holds_float32_values() -> None:
    cfg = ModelConfig(kind="gpt", preset="tiny", seq_len=16)
    torch.manual_seed(3)
    a = build_model(cfg)
    torch.manual_seed(3)
    b = build_model(cfg, dtype=torch.float64)
    torch.manual_seed(4)
    c = build_model(cfg)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa.double(), pb), name
        if name.endswith("weight") and pa.std() > 0.01:  # random, not LayerNorm ones
            assert not torch.equal(pa, pc), name
    for name, param in a.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(param) == 0, name


def test_dropout_only_in_training() -> None:
    model = _tiny_gpt(dropout=0.5)
    idx = torch.randint(0, 256, (2, 8))
    model.eval()
    torch.testing.assert_close(model(idx), model(idx), rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(idx), model(idx))


def test_freeze_prefixes() -> None:
    cfg = ModelConfig(kind="gpt", preset="tiny", seq_len=8, freeze=("wte", "blocks.0"))
    model = build_model(cfg)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "wte.weight" in frozen and "wpe.weight" not in frozen
    assert all(n.startswith(("wte.", "blocks.0.")) for n in frozen)
    assert any(n.startswith("blocks.0.") for n in frozen)
    assert not any(n.startswith("blocks.1.") for n in frozen)


def test_freeze_matches_whole_components_and_errors() -> None:
    with pytest.raises(ConfigError, match=r"'blocks\.9'"):
        build_model(ModelConfig(kind="gpt", preset="tiny", freeze=("blocks.9",)))
    with pytest.raises(ConfigError, match="'wt'"):  # a partial component is not a match
        build_model(ModelConfig(kind="gpt", preset="tiny", freeze=("wt",)))


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match="known presets: tiny, odd, small, base"):
        build_model(ModelConfig(kind="gpt", preset="huge"))
    with pytest.raises(ConfigError, match="mlp preset 'base' reads 32 tokens"):
        build_model(ModelConfig(kind="mlp", preset="base", seq_len=16))


def test_mlp_reads_only_the_last_context_tokens() -> None:
    torch.manual_seed(0)
    model = MLP(MLPConfig(context=4, d_embed=8, d_hidden=16, n_layer=2))
    idx = torch.randint(0, 256, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 1, 256)
    changed = idx.clone()
    changed[:, :6] = 0  # outside the window: no effect
    torch.testing.assert_close(model(changed), logits, rtol=0, atol=0)
    changed[:, 7] = (changed[:, 7] + 1) % 256  # inside the window: an effect
    assert not torch.allclose(model(changed), logits)
    with pytest.raises(ValueError, match="last 4 tokens"):
        model(idx[:, :3])


def test_mlp_batch_norm_has_buffers_others_do_not() -> None:
    plain = build_model(ModelConfig(kind="mlp", preset="small", seq_len=16))
    assert list(plain.buffers()) == []
    bn = build_model(ModelConfig(kind="mlp", preset="small_bn", seq_len=16), dtype=torch.float64)
    names = {n for n, _ in bn.named_buffers()}
    assert "blocks.0.norm.running_mean" in names
    before = bn.blocks[0].norm.running_mean.clone()
    bn(torch.randint(0, 256, (4, 16)))
    assert not torch.equal(before, bn.blocks[0].norm.running_mean)


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_models_learn_the_corpus(kind: str) -> None:
    """Models, corpus and sampler fit together: 40 AdamW steps bring the loss well below ln(256)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind=kind, preset="tiny", seq_len=32))
    sampler = DataSampler(load_corpus(200_000).train, 32, 16, seed=0, counts=[16], rank=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        inputs, targets = sampler.local_batch(step)
        logits = model(inputs)  # the MLP predicts only the last target
        loss = F.cross_entropy(logits.flatten(0, 1), targets[:, -logits.size(1) :].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and losses[-1] < 4.0, losses
