"""Resume is exact when some parameters went unused: each keeps its own Adam step count through a checkpoint.

torch's AdamW skips a parameter whose ``.grad`` is None: its ``step`` stands still, and one never used
has no state at all. The model (``test_unused_parameters``'s, with a switch per block) has
``blocks.0.extra`` used at steps 1, 3, 4 (its count lags the others'), ``blocks.1.extra`` first used at
step 4, and ``spare`` and ``blocks.0.dead`` never used. Each saver trains 3 float64 steps on 2 ranks and
saves; its checkpoint must hold exactly what one torch process holds after those steps (per-parameter
counts, no state for a parameter never stepped), and every loader (the same ZeRO stage, DDP, plain torch
through ``load_checkpoint``; a DDP checkpoint into each ZeRO stage) trains steps 3 and 4 to the
uninterrupted run's losses and parameters within 1e-12. AdamW (weight decay 0.1), and SGD (momentum
0.9, weight decay 0.1); all cases of one optimizer run in one 2-rank spawn.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint import CheckpointWriter, load
from shardwise.checkpoint.layout import list_steps
from shardwise.collectives.api import Comm
from shardwise.config import DDPConfig, ZeroConfig
from shardwise.data_parallel.ddp import DDPEngine
from shardwise.engine.base import Engine
from shardwise.engine.full_state import FolderReader, full_state_tensors, load_checkpoint
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import attach_optimizers, named, optimizer_factory
from shardwise.testing.harness import run_on_ranks
from shardwise.testing.parity import compare_tensors
from shardwise.zero import build_zero_engine
from tests.distributed.test_unused_parameters import OPTIMS, WORKERS, Branchy, batch, share

STEPS, CUT, TOL = 5, 3, 1e-12
USE = {"blocks.0.extra": [0, 1, 0, 1, 1], "blocks.1.extra": [0, 0, 0, 0, 1]}  # by step


class Switched(Branchy):
    """Each block's ``extra`` on its own schedule (``USE``); ``spare`` and ``blocks.0.dead`` never used."""

    step = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            h = block(h, bool(USE[f"blocks.{i}.extra"][self.step]))
        return self.head(h)


def make_model(seed: int = 0) -> Switched:
    torch.manual_seed(seed)
    return Switched().double()


def _torch_steps(model: Switched, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """One process on the global batch: what every strategy must equal."""
    losses = []
    for step in steps:
        model.step = step
        x, y = batch(step)
        loss = loss_sum(model(x), y) / y.numel()
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def reference(optim: str) -> dict:
    """The uninterrupted run, and torch's whole state after ``CUT`` steps (what a checkpoint must hold)."""
    model = make_model()
    optimizer = optimizer_factory(OPTIMS[optim])(named(model))
    losses = _torch_steps(model, optimizer, range(CUT))
    at_cut = {n: t.clone() for n, t in full_state_tensors(model, optimizer).items()}
    losses += _torch_steps(model, optimizer, range(CUT, STEPS))
    return {"losses": losses, "at_cut": at_cut, "params": _params(model)}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_steps(engine: Engine, model: Switched, rank: int, comm: Comm, steps: range) -> list[float]:
    losses = []
    for step in steps:
        model.step = step
        x, y = batch(step)
        mine = share(rank)
        loss = torch.tensor([engine.forward_backward([(x[mine], y[mine])], y.numel())], dtype=torch.float64)
        comm.all_reduce(loss)
        losses.append(float(loss))
        engine.optimizer_step()
    return losses


BUILDERS: dict[str, Callable[[nn.Module, Comm], Engine]] = {
    "ddp": lambda m, c: DDPEngine(m, c, DDPConfig(find_unused_parameters=True)),
    "zero1": lambda m, c: build_zero_engine(m, c, 1, ZeroConfig()),
    "zero2": lambda m, c: build_zero_engine(m, c, 2, ZeroConfig(bucket_mb=0.001)),  # several groups
    "zero3": lambda m, c: build_zero_engine(m, c, 3, ZeroConfig()),
}
LOADERS = {  # saver -> engines that resume its checkpoint ("torch": load_checkpoint in one process)
    "zero1": ("zero1", "ddp", "torch"),
    "zero2": ("zero2", "ddp", "torch"),
    "zero3": ("zero3", "ddp", "torch"),
    "ddp": ("zero1", "zero2", "zero3", "torch"),
}


def _diffs(ref: dict, losses: list[float], params: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        "loss": max(abs(a - b) for a, b in zip(ref["losses"][CUT:], losses, strict=True)),
        "param": compare_tensors(ref["params"], params).max_diff,
    }


def _saved(step_dir: str, ref: dict) -> dict[str, float]:
    """The checkpoint against torch's state after ``CUT`` steps: the same names (1 where they differ),
    the same values."""
    names = [n for n in FolderReader(step_dir).shapes if not n.startswith("rng/")]
    saved, want = load(step_dir, dict.fromkeys(names)), ref["at_cut"]
    both = set(saved) & set(want)
    diff = compare_tensors({n: want[n] for n in both}, {n: saved[n] for n in both}).max_diff
    return {"names": float(set(saved) != set(want)), "state": diff}


def _resume(loader: str, optim: str, step_dir: str, ref: dict, rank: int, comm: Comm) -> dict[str, float]:
    model = make_model(seed=7)  # other weights: the checkpoint must replace them all
    factory = optimizer_factory(OPTIMS[optim])
    if loader == "torch":  # one process, no process group
        optimizer = factory(named(model))
        assert load_checkpoint(step_dir, model, optimizer) == CUT
        losses = _torch_steps(model, optimizer, range(CUT, STEPS))
        return _diffs(ref, losses, _params(model))
    engine = attach_optimizers(BUILDERS[loader](model, comm), factory)
    engine.load_state(FolderReader(step_dir))
    losses = _engine_steps(engine, model, rank, comm, range(CUT, STEPS))
    params = engine.full_parameters()
    engine.close()
    return _diffs(ref, losses, params)


def _cases(rank: int, world_size: int, root: str, optim: str) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    comm, out, ref = Comm(), {}, reference(optim)
    for saver, loaders in LOADERS.items():
        model = make_model(seed=rank)
        engine = attach_optimizers(BUILDERS[saver](model, comm), optimizer_factory(OPTIMS[optim]))
        _engine_steps(engine, model, rank, comm, range(CUT))
        CheckpointWriter(str(Path(root) / saver), comm).save(CUT, engine.state_pieces(rank, world_size))
        engine.close()
        dist.barrier()
        step_dir = list_steps(str(Path(root) / saver))[-1][1]
        out[f"{saver}-saved"] = _saved(step_dir, ref)
        for loader in loaders:
            out[f"{saver}->{loader}"] = _resume(loader, optim, step_dir, ref, rank, comm)
    return out


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_zero_resume_with_unused_parameters_equals_uninterrupted(tmp_path: Path, optim: str) -> None:
    """zero1/2/3 with AdamW (and SGD with momentum, which counts no steps but has state only where
    stepped), parameters unused in some steps, saved after step 3 and resumed as itself, as ddp and in
    plain torch (and ddp's checkpoint as each stage): the uninterrupted run to 1e-12."""
    results = run_on_ranks(_cases, WORKERS, str(tmp_path), optim, timeout_s=240)
    cases = {f"{s}->{x}" for s, loaders in LOADERS.items() for x in loaders}
    assert set(results[0]) == cases | {f"{s}-saved" for s in LOADERS}
    bad = [
        f"{case}: {what} {diff:.2e}"
        for rank_results in results
        for case, diffs in rank_results.items()
        for what, diff in diffs.items()
        if diff > TOL
    ]
    assert not bad, f"differs from the uninterrupted run: {sorted(set(bad))}"
