"""Legacy single-process DataParallel against plain training, float64, several steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardwise.config import OptimizerConfig
from shardwise.data_parallel.single_process import SingleProcessDPEngine
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import attach_optimizers, named, optimizer_factory
from shardwise.testing.parity import assert_parity

VOCAB, DIM, SEQ, BATCH, STEPS = 13, 6, 4, 7, 4
FACTORY = optimizer_factory(OptimizerConfig(name="adamw", lr=0.05, weight_decay=0.01))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.mark.parametrize("replicas", [1, 3, 4])
def test_matches_plain_training(replicas: int) -> None:
    plain = _model()
    opt = FACTORY(named(plain))
    engine = attach_optimizers(SingleProcessDPEngine(copy.deepcopy(plain), replicas), FACTORY)
    tokens = BATCH * SEQ
    for inputs, targets in _batches():
        loss = loss_sum(plain(inputs), targets) / tokens
        loss.backward()
        # two micro-batches (uneven: 4 + 3 sequences), each scattered over the replicas
        micro = [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]
        got = engine.forward_backward(micro, tokens)
        assert abs(got - float(loss.detach())) <= 1e-12
        assert_parity({n: p.grad for n, p in plain.named_parameters()}, engine.full_gradients(), 1e-12)
        opt.step()
        opt.zero_grad(set_to_none=True)
        engine.optimizer_step()
    assert_parity(dict(plain.named_parameters()), engine.full_parameters(), 1e-12)


def test_counts_replicate_and_reduce_bytes() -> None:
    model = _model()
    engine = attach_optimizers(SingleProcessDPEngine(model, 3), FACTORY)
    inputs, targets = _batches()[0]
    engine.forward_backward([(inputs, targets)], BATCH * SEQ)
    params = sum(p.numel() * 8 for p in model.parameters())
    activations = inputs.numel() * 8 + BATCH * SEQ * VOCAB * 8  # scatter of int64 tokens, gather of logits
    assert engine.bytes_copied == 2 * params + 2 * params + activations  # replicate 2, reduce 2
