"""ZeRO-3 on models whose blocks sit at a dotted path and return tuples, and on a model with no block
list (one unit): float64 parity with one process after 3 AdamW steps, 2 ranks, one spawn."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.config import OptimizerConfig, ZeroConfig
from shardwise.engine.loss import logits_of, loss_sum
from shardwise.engine.optim import attach_optimizers, named, optimizer_factory
from shardwise.testing.harness import run_on_ranks
from shardwise.testing.parity import compare_tensors
from shardwise.zero import build_zero_engine

VOCAB, DIM, SEQ, BATCH, STEPS = 9, 6, 4, 6, 3
OPTIM = OptimizerConfig(name="adamw", lr=0.05, weight_decay=0.1)


class TupleBlock(nn.Module):
    """Returns (hidden, aux) as Hugging Face blocks of transformers 4.x do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = h + torch.tanh(self.fc(h))
        return out, out.detach().sum()


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TupleBlock() for _ in range(3))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.inner = Inner()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(tokens)
        for block in self.inner.layers:
            h, _ = block(h)
        return {"logits": self.head(h)}


class Flat(nn.Module):
    """No ModuleList or Sequential anywhere: one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


MODELS = {"nested": Nested, "flat": Flat}


def _model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7 + step))
    return data[:, :-1], data[:, 1:]


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(kind)
    optimizer = optimizer_factory(OPTIM)(named(model))
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = loss_sum(logits_of(model(x)), y) / y.numel()
        loss.backward()
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    comm, out = Comm(), {}
    for kind, unit in [("nested", "inner.layers"), ("nested", ""), ("flat", "")]:
        model = _model(kind, seed=rank)
        engine = build_zero_engine(model, comm, 3, ZeroConfig(unit=unit))
        attach_optimizers(engine, optimizer_factory(OPTIM))
        losses = []
        for step in range(STEPS):
            x, y = _batch(step)
            mine = torch.tensor_split(torch.arange(BATCH), world_size)[rank]
            value = engine.forward_backward([(x[mine], y[mine])], y.numel())
            share = torch.tensor([value], dtype=torch.float64)
            comm.all_reduce(share)
            losses.append(float(share))
            engine.optimizer_step()
        params = engine.full_parameters()
        groups = len(engine.groups)
        engine.close()
        ref_losses, ref_params = _reference(kind)
        out[f"{kind}-{unit or 'found'}"] = {
            "loss": max(abs(a - b) for a, b in zip(ref_losses, losses, strict=True)),
            "param": compare_tensors(ref_params, params).max_diff,
            "groups": groups,
        }
    return out


def test_zero3_units_by_path_found_and_whole() -> None:
    results = run_on_ranks(_rank, 2, timeout_s=120)[0]
    for case, diffs in results.items():
        assert diffs["loss"] <= 1e-10 and diffs["param"] <= 1e-10, (case, diffs)
    # root + one group per block; the flat model is the root alone
    assert [r["groups"] for r in results.values()] == [4, 4, 1]
