"""A parameter that gets no gradient is left alone by the optimizer in every strategy, as in torch.

torch skips a parameter whose ``.grad`` is None: no weight decay, no momentum, and its own Adam step
count stands still. The model has a branch never used (``spare``, ``blocks.0.dead``) and one used in
some steps only (``extra``, first used at step 1, so its Adam step count lags the others'), in some
cases by one rank only. Each strategy runs 5 float64 steps with AdamW (weight decay 0.1) and with SGD
(momentum 0.9, weight decay 0.1) and must match one process: losses, every step's gradients and the
final parameters within 1e-10. All cases of one world size run in one spawn.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.config import DDPConfig, OptimizerConfig, PSConfig, ZeroConfig
from shardwise.data_parallel.ddp import DDPEngine
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.engine.base import Engine
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import attach_optimizers, named, optimizer_factory
from shardwise.testing.harness import run_on_ranks
from shardwise.testing.parity import compare_tensors
from shardwise.zero import build_zero_engine

VOCAB, DIM, SEQ, BATCH, STEPS, WORKERS, TOL = 11, 6, 5, 7, 5, 2, 1e-10
OPTIMS = {
    "adamw": OptimizerConfig(name="adamw", lr=0.05, weight_decay=0.1),
    "sgd": OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.1),
}
# which steps use `extra` on each worker: the same on all, or each worker on its own steps (globally
# used at steps 1, 3, 4 either way)
PATTERNS = {
    "same": {0: [0, 1, 0, 1, 1], 1: [0, 1, 0, 1, 1]},
    "per-rank": {0: [0, 1, 0, 0, 1], 1: [0, 0, 0, 1, 1]},
}
UNTOUCHED = ("spare.weight", "spare.bias", "blocks.0.dead.weight", "blocks.0.dead.bias")


class Block(nn.Module):
    def __init__(self, dead: bool) -> None:
        super().__init__()
        self.main = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)  # used when asked
        self.dead = nn.Linear(DIM, DIM) if dead else None  # never used

    def forward(self, h: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = h + torch.tanh(self.main(h))
        return h + self.extra(h) if use_extra else h


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(dead=True), Block(dead=False)])  # ZeRO-3 finds these
        self.head = nn.Linear(DIM, VOCAB)
        self.spare = nn.Linear(DIM, VOCAB)  # never used
        self.use_extra = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, self.use_extra)
        return self.head(h)


def make_model(seed: int = 0) -> Branchy:
    torch.manual_seed(seed)
    return Branchy().double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return data[:, :-1], data[:, 1:]


def share(worker: int) -> torch.Tensor:
    return torch.tensor_split(torch.arange(BATCH), WORKERS)[worker]  # uneven: 4 and 3


def reference(optim: str, pattern: str) -> dict:
    """One process on the global batch, each worker's share run with that worker's branch choice."""
    model = make_model()
    optimizer = optimizer_factory(OPTIMS[optim])(named(model))
    losses, grads = [], []
    for step in range(STEPS):
        x, y = batch(step)
        total = torch.zeros((), dtype=torch.float64)
        for worker in range(WORKERS):
            model.use_extra = bool(PATTERNS[pattern][worker][step])
            idx = share(worker)
            total = total + loss_sum(model(x[idx]), y[idx])
        loss = total / y.numel()
        loss.backward()
        losses.append(float(loss))
        grads.append({n: _grad(p) for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad.clone()


def _diffs(ref: dict, losses: list[float], grads: list[dict], params: dict) -> dict[str, float]:
    initial = dict(make_model().named_parameters())
    return {
        "loss": max(abs(a - b) for a, b in zip(ref["losses"], losses, strict=True)),
        "grad": max(compare_tensors(r, g).max_diff for r, g in zip(ref["grads"], grads, strict=True)),
        "param": compare_tensors(ref["params"], params).max_diff,
        # bitwise: the never-used parameters keep their initial values
        "untouched": float(not all(torch.equal(params[n], initial[n].detach()) for n in UNTOUCHED)),
    }


def _run_trainer(engine: Engine, model: Branchy, rank: int, comm: Comm, pattern: str, micro: int) -> dict:
    losses, grads = [], []
    for step in range(STEPS):
        x, y = batch(step)
        model.use_extra = bool(PATTERNS[pattern][rank][step])
        mine = share(rank)
        parts = [(x[m], y[m]) for m in torch.tensor_split(mine, micro)]
        loss = torch.tensor([engine.forward_backward(parts, y.numel())], dtype=torch.float64)
        comm.all_reduce(loss)
        losses.append(float(loss))
        grads.append(engine.full_gradients())
        engine.optimizer_step()
    params = engine.full_parameters()
    engine.close()
    return {"losses": losses, "grads": grads, "params": params}


Build = Callable[[nn.Module, Comm], Engine]
BUILDERS: dict[str, Build] = {
    "ddp": lambda m, c: DDPEngine(m, c, DDPConfig(find_unused_parameters=True)),
    "zero1": lambda m, c: build_zero_engine(m, c, 1, ZeroConfig()),
    "zero1-buckets": lambda m, c: build_zero_engine(m, c, 1, ZeroConfig(bucket_mb=0.001)),
    "zero2": lambda m, c: build_zero_engine(m, c, 2, ZeroConfig()),
    "zero2-buckets": lambda m, c: build_zero_engine(m, c, 2, ZeroConfig(bucket_mb=0.001)),
    "zero3": lambda m, c: build_zero_engine(m, c, 3, ZeroConfig()),
}
# ZeRO-3 gathers and reduces units inside forward and backward: every rank must run the same modules
CASES = [
    (name, optim, pattern, micro)
    for name in BUILDERS
    for optim in OPTIMS
    for pattern in PATTERNS
    for micro in ((1, 2) if name == "zero2" else (1,))
    if not (name == "zero3" and pattern == "per-rank")
]


def _trainers(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    comm, out = Comm(), {}
    for name, optim, pattern, micro in CASES:
        model = make_model(seed=rank)  # different on purpose: the engine starts from rank 0's
        engine = attach_optimizers(BUILDERS[name](model, comm), optimizer_factory(OPTIMS[optim]))
        run = _run_trainer(engine, model, rank, comm, pattern, micro)
        key = f"{name}-{optim}-{pattern}-micro{micro}"
        out[key] = _diffs(reference(optim, pattern), run["losses"], run["grads"], run["params"])
    return out


def test_ddp_and_zero_leave_unused_parameters_alone() -> None:
    results = run_on_ranks(_trainers, WORKERS, timeout_s=240)
    for case, diffs in results[0].items():
        assert diffs["untouched"] == 0.0, f"{case}: a never-used parameter changed"
        for what in ("loss", "grad", "param"):
            assert diffs[what] <= TOL, f"{case}: {what} differs from one process by {diffs[what]:.2e}"


def _param_server(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    out = {}
    for optim in OPTIMS:
        for pattern in PATTERNS:
            model = make_model()
            engine = ParamServerEngine(model, Comm(), PSConfig(servers=1), STEPS, share_gradients=True)
            attach_optimizers(engine, optimizer_factory(OPTIMS[optim]))
            if engine.is_server:
                engine.serve()
                engine.close()
                continue
            worker, losses, grads = rank - 1, [], []
            for step in range(STEPS):
                x, y = batch(step)
                model.use_extra = bool(PATTERNS[pattern][worker][step])
                idx = share(worker)
                engine.forward_backward([(x[idx], y[idx])], y.numel())
                grads.append(engine.full_gradients())
                engine.optimizer_step()
                losses.append(engine.last_global_loss)
            params = engine.full_parameters()
            engine.close()
            out[f"ps-{optim}-{pattern}"] = _diffs(reference(optim, pattern), losses, grads, params)
    return out


def test_parameter_server_leaves_unused_parameters_alone() -> None:
    results = run_on_ranks(_param_server, 1 + WORKERS, timeout_s=240)
    for rank_results in results[1:]:
        assert len(rank_results) == 4
        for case, diffs in rank_results.items():
            assert diffs["untouched"] == 0.0, f"{case}: a never-used parameter changed"
            for what in ("loss", "grad", "param"):
                assert diffs[what] <= TOL, f"{case}: {what} differs from one process by {diffs[what]:.2e}"
