"""ZeRO stages 1-3 against one process in float64: losses, step-1 gradients and parameters after 5 steps.

The model is GPT-shaped (wte, wpe, blocks, ln_f, head tied to wte) with a frozen parameter (wpe) and
parameter sizes that divide neither 2 nor 4. The global batch of 10 sequences splits unevenly at 4 ranks
(3, 3, 2, 2), each rank's share in 2 micro-batches, so no_sync and the loss convention are exercised.
All cases of one world size run in one spawn (each spawn costs seconds).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.config import OptimizerConfig, ZeroConfig
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import attach_optimizers, named, optimizer_factory
from shardwise.testing.harness import run_on_ranks
from shardwise.testing.parity import compare_tensors
from shardwise.zero import build_zero_engine, unique_parameters
from shardwise.zero.memory import model_state_bytes, zero_formula

VOCAB, DIM, SEQ, GLOBAL_BATCH, STEPS, ATOL = 13, 5, 6, 10, 5, 1e-10


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)  # causal mean over previous positions, then mixed
        self.fc = nn.Linear(dim, 7)
        self.proj = nn.Linear(7, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, dim)
        h = self.ln(x)
        steps = torch.arange(1, x.size(1) + 1, dtype=x.dtype).view(1, -1, 1)
        x = x + self.mix(h.cumsum(1) / steps)
        return x + self.proj(torch.tanh(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.wpe.weight.requires_grad_(False)  # the frozen parameter
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(seed: int, dtype: torch.dtype = torch.float64) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT().to(dtype)


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def reference(
    optim: str, dtype: torch.dtype = torch.float64
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole global batch: losses, step-1 gradients, final parameters."""
    model = make_model(0, dtype)
    opt = optimizer_factory(OptimizerConfig(name=optim, weight_decay=0.1))(named(model))
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batches(step)
        loss = loss_sum(model(x), y) / y.numel()
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _formula(engine: object, stage: int, world_size: int, optim: str) -> float:
    psi = sum(p.numel() for _, p in unique_parameters(engine.model.named_parameters()))
    frozen = engine.model.wpe.weight.numel() * 8
    states = 1 if optim == "sgd" else 2
    return zero_formula(psi, stage, world_size, "fp32", 8, states, frozen)["model_state"]


def _run_case(rank: int, world_size: int, comm: Comm, stage: int, optim: str, config: ZeroConfig) -> dict:
    model = make_model(seed=rank)  # different on purpose: the engine must broadcast rank 0's weights
    factory = optimizer_factory(OptimizerConfig(name=optim, weight_decay=0.1))
    engine = attach_optimizers(build_zero_engine(model, comm, stage, config), factory)
    resident: list[int] = []  # stage 3: full buffers held while each block runs forward

    def count(*_: object) -> None:
        resident.append(sum(g.materialized for g in engine.groups))

    for block in model.blocks:
        block.register_forward_pre_hook(count)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batches(step)
        mine = torch.tensor_split(torch.arange(GLOBAL_BATCH), world_size)[rank]
        micro = [(x[m], y[m]) for m in torch.tensor_split(mine, 2)]
        share = torch.tensor([engine.forward_backward(micro, y.numel())], dtype=torch.float64)
        comm.all_reduce(share)
        if stage == 3:  # everything is released once the step's gradients are reduced
            assert not any(g.materialized for g in engine.groups)
        losses.append(share.item())
        if step == 0:
            grads = engine.full_gradients()
        if step == 1:  # optimizer state exists now: compare the live bytes with the formula
            memory = model_state_bytes(engine)["model_state"] / _formula(engine, stage, world_size, optim)
        engine.optimizer_step()
    params = engine.full_parameters()
    engine.close()
    ref_losses, ref_grads, ref_params = reference(optim)
    if stage == 3:  # root + this block (+ the prefetched next one), never the whole model
        assert len(engine.groups) == 4 and max(resident) == (3 if config.prefetch else 2), resident
    return {
        "memory_vs_formula": memory,
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "grad": compare_tensors(ref_grads, grads).max_diff,
        "param": compare_tensors(ref_params, params).max_diff,
    }


CASES = [
    (1, "adamw", ZeroConfig(bucket_mb=0.0005)),  # several buckets
    (1, "sgd", ZeroConfig()),
    (2, "adamw", ZeroConfig(bucket_mb=0.0005)),
    (2, "sgd", ZeroConfig(bucket_mb=0.0005)),
    (3, "adamw", ZeroConfig()),
    (3, "sgd", ZeroConfig(prefetch=False)),
]


def _worker(rank: int, world_size: int, cases: list, offload_root: str) -> dict:
    comm = Comm()
    out = {}
    for stage, optim, config in cases:
        if config.offload == "disk":
            config = ZeroConfig(**{**config.__dict__, "offload_dir": f"{offload_root}/s{stage}"})
        out[f"zero{stage}-{optim}-{config.offload}"] = _run_case(rank, world_size, comm, stage, optim, config)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_matches_one_process(world_size: int) -> None:
    cases = [*CASES, *[(stage, "adam", ZeroConfig(offload="disk")) for stage in (1, 2, 3)]]
    with tempfile.TemporaryDirectory() as root:
        results = run_on_ranks(_worker, world_size, cases, root, timeout_s=240)
    for name, diffs in results[0].items():
        ratio = diffs.pop("memory_vs_formula")
        if name.endswith("none"):  # disk offload keeps the optimizer state out of memory
            assert 0.9 <= ratio <= 1.1, f"{name} at {world_size} ranks: model state {ratio:.3f} x formula"
        else:
            assert ratio < 0.9, f"{name} at {world_size} ranks: offloaded state still {ratio:.3f} x formula"
        for what, diff in diffs.items():
            assert diff <= ATOL, f"{name} at {world_size} ranks: {what} differs by {diff:.2e}"


def _precision_worker(rank: int, world_size: int, cases: list) -> dict:
    comm = Comm()
    out = {}
    ref_losses, _, ref_params = reference("adamw", torch.float32)
    for stage, precision in cases:
        model = make_model(0, torch.float32)
        factory = optimizer_factory(OptimizerConfig(name="adamw", weight_decay=0.1))
        engine = build_zero_engine(model, comm, stage, ZeroConfig(precision=precision))
        attach_optimizers(engine, factory)
        losses = []
        for step in range(STEPS):
            x, y = batches(step)
            mine = torch.tensor_split(torch.arange(GLOBAL_BATCH), world_size)[rank]
            share = torch.tensor([engine.forward_backward([(x[mine], y[mine])], y.numel())])
            comm.all_reduce(share)
            losses.append(share.item())
            engine.optimizer_step()
        params = engine.full_parameters()
        out[f"zero{stage}-{precision}"] = {
            "loss": max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)),
            "param": compare_tensors(ref_params, params).max_diff,
            "master": {str(g.master.dtype) for g in engine.groups},
            "compute": str(model.ln_f.weight.dtype),
            "scale": engine.scaler.scale,
        }
        engine.close()
    return out


@pytest.mark.slow
def test_mixed_precision_tracks_fp32_with_fp32_masters() -> None:
    """bf16/fp16 compute stays within 0.5% of fp32's loss and 0.01 of its parameters after 5 Adam steps
    (lr 3e-3: two runs drift apart by 0.03 at most; bf16 measured 0.0056, fp16 0.0005); master shards
    stay fp32 while the weights the model computes with are bf16/fp16."""
    cases = [(1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp16"), (3, "fp16")]
    (results, *_) = run_on_ranks(_precision_worker, 2, cases, timeout_s=240)
    for name, got in results.items():
        low = "bfloat16" if name.endswith("bf16") else "float16"
        assert got["master"] == {"torch.float32"} and got["compute"] == f"torch.{low}", (name, got)
        assert got["loss"] <= 0.005 and got["param"] <= 0.01, (name, got)
        assert got["scale"] == (2.0**16 if low == "float16" else 1.0), (name, got)
