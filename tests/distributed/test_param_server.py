"""Parameter server against one process: sync parity in float64, async staleness, a dead worker."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.config import OptimizerConfig, PSConfig
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import attach_optimizers, named, optimizer_factory
from shardwise.testing.harness import run_on_ranks
from shardwise.testing.parity import assert_parity

VOCAB, DIM, SEQ, BATCH, STEPS = 11, 8, 5, 6, 4
OPTIM = OptimizerConfig(name="adamw", lr=0.05, weight_decay=0.01)


class TinyNextToken(nn.Module):
    """Embedding -> tanh(linear) -> vocabulary logits at every position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def _portable(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Tensors through a multiprocessing queue would share memory with a process about to exit."""
    return {n: t.numpy().copy() for n, t in params.items()}


def _tensors(params: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a) for n, a in params.items()}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TinyNextToken().double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    model = _model()
    opt = optimizer_factory(OPTIM)(named(model))
    losses, grads = [], []
    for inputs, targets in _batches():
        loss = loss_sum(model(inputs), targets) / targets.numel()
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _share(worker: int, shares: list[int], batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    start = sum(shares[:worker])
    inputs, targets = batch
    return [(inputs[start : start + shares[worker]], targets[start : start + shares[worker]])]


def _sync_rank(rank: int, world_size: int, servers: int, shares: list[int]) -> dict[str, float]:
    ref_losses, ref_grads, ref_params = _reference()
    engine = ParamServerEngine(_model(), Comm(), PSConfig(servers=servers), STEPS, share_gradients=True)
    attach_optimizers(engine, optimizer_factory(OPTIM))
    grad_diff, losses = 0.0, []
    if engine.is_server:
        engine.serve()
        losses = engine.loss_history if rank == 0 else []
    else:
        for step, batch in enumerate(_batches()):
            engine.forward_backward(_share(rank - servers, shares, batch), BATCH * SEQ)
            grad_diff = max(
                grad_diff, assert_parity(ref_grads[step], engine.full_gradients(), 1e-10).max_diff
            )
            engine.optimizer_step()
            losses.append(engine.last_global_loss)
    loss_diff = assert_parity(ref_losses, losses, 1e-10, "losses").max_diff if losses else 0.0
    param_diff = assert_parity(ref_params, engine.full_parameters(), 1e-10).max_diff
    return {"grad": grad_diff, "loss": loss_diff, "param": param_diff, "bytes": engine.comm.stats.bytes_sent}


def test_sync_one_server_two_workers_matches_one_process() -> None:
    out = run_on_ranks(_sync_rank, 3, 1, [3, 3], timeout_s=60)
    assert all(r["param"] <= 1e-10 and r["grad"] <= 1e-10 and r["loss"] <= 1e-10 for r in out)


def test_sync_two_servers_uneven_workers_matches_one_process() -> None:
    out = run_on_ranks(_sync_rank, 4, 2, [1, 5], timeout_s=60)
    assert all(r["param"] <= 1e-10 for r in out)
    # both servers hold a share of the parameters: each one sends weights
    assert out[0]["bytes"] > 0 and out[1]["bytes"] > 0


def _async_rank(rank: int, world_size: int, servers: int, max_staleness: int, slow: int) -> dict[str, Any]:
    config = PSConfig(servers=servers, mode="async", max_staleness=max_staleness)
    engine = attach_optimizers(ParamServerEngine(_model(), Comm(), config, STEPS), optimizer_factory(OPTIM))
    if engine.is_server:
        engine.serve()
    else:
        worker = rank - servers
        for batch in _batches():
            engine.forward_backward(_share(worker, [3, 3], batch), BATCH * SEQ)
            if worker == slow:
                time.sleep(0.15)  # the other worker's updates pile up meanwhile
            engine.optimizer_step()
    return {
        "server": engine.is_server,
        "staleness": list(engine.staleness),
        "max_seen": engine.max_staleness_seen,
        "version": engine.version,
        "rejected": engine.rejected,
        "dropped": engine.dropped_batches,
        "params": _portable(engine.full_parameters()),
    }


def test_async_one_worker_is_plain_sequential_training() -> None:
    # one worker owning the whole batch: scale 1, staleness 0, so exactly one process
    def_params = _reference()[2]
    out = run_on_ranks(_async_rank_whole, 2, timeout_s=60)
    for r in out:
        assert_parity(def_params, _tensors(r), 1e-10)


def _async_rank_whole(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    engine = ParamServerEngine(_model(), Comm(), PSConfig(mode="async", max_staleness=0), STEPS)
    attach_optimizers(engine, optimizer_factory(OPTIM))
    if engine.is_server:
        engine.serve()
        assert engine.staleness == [0] * STEPS
    else:
        for batch in _batches():
            engine.forward_backward([batch], BATCH * SEQ)
            engine.optimizer_step()
    return _portable(engine.full_parameters())


def test_async_two_servers_staleness_bounded_and_final_weights_shared() -> None:
    out = run_on_ranks(_async_rank, 4, 2, 1, 1, timeout_s=60)
    servers, workers = out[:2], out[2:]
    dropped = sum(w["dropped"] for w in workers)
    for s in servers:
        assert all(0 <= x <= 1 for x in s["staleness"]), s["staleness"]
        # each worker batch is applied once per server, unless refused MAX_ATTEMPTS times and dropped
        assert 2 * STEPS - dropped <= len(s["staleness"]) <= 2 * STEPS
    assert sum(s["rejected"] for s in servers) == sum(w["rejected"] for w in workers)
    # the bound was exercised: a stale gradient was applied or refused
    assert max(s["max_seen"] for s in servers) >= 1 or sum(s["rejected"] for s in servers) > 0
    for r in out[1:]:
        assert_parity(_tensors(out[0]["params"]), _tensors(r["params"]), 0.0)


def _recording_rank(rank: int, world_size: int, staleness_lr: bool) -> dict[str, Any]:
    """Async, SGD without momentum, a slow worker: each applied push must move the weights by exactly
    -lr x scale x gradient, with scale = 1 / (1 + staleness) when ``staleness_lr`` (else 1)."""
    sgd = OptimizerConfig(name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    config = PSConfig(mode="async", max_staleness=3, staleness_lr=staleness_lr)
    engine = attach_optimizers(ParamServerEngine(_model(), Comm(), config, STEPS), optimizer_factory(sgd))
    if not engine.is_server:
        for batch in _batches():
            engine.forward_backward(_share(rank - 1, [3, 3], batch), BATCH * SEQ)
            if rank == 2:
                time.sleep(0.1)  # the other worker's pushes land first: this one's arrive stale
            engine.optimizer_step()
        return {}
    applied: list[tuple[float, float]] = []  # (scale, worst |delta + lr x scale x grad|)
    apply = engine.apply_gradient

    def recording(flat: torch.Tensor, lr_scale: float = 1.0) -> None:
        before = [p.detach().clone() for p in engine.own]
        apply(flat, lr_scale)
        grads, offset = [], 0
        for p in engine.own:
            grads.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        error = max(
            (p.detach() - b + sgd.lr * lr_scale * g).abs().max().item()
            for p, b, g in zip(engine.own, before, grads, strict=True)
        )
        applied.append((lr_scale, error))

    engine.apply_gradient = recording  # type: ignore[method-assign]
    engine.serve()
    return {"applied": applied, "staleness": list(engine.staleness)}


def test_async_applies_stale_pushes_with_a_smaller_learning_rate() -> None:
    for staleness_lr in (True, False):
        server = run_on_ranks(_recording_rank, 3, staleness_lr, timeout_s=60)[0]
        scales = [scale for scale, _ in server["applied"]]
        expected = [1 / (1 + s) if staleness_lr else 1.0 for s in server["staleness"]]
        assert scales == expected
        assert max(error for _, error in server["applied"]) < 1e-6
        if staleness_lr:
            assert max(server["staleness"]) >= 1, "no stale push: the test did not exercise the rule"


# -- a worker that dies ---------------------------------------------------------------------------------
def _dying_rank(rank: int, world_size: int) -> dict[str, Any]:
    config = PSConfig(servers=1, mode="async", max_staleness=8)
    engine = attach_optimizers(ParamServerEngine(_model(), Comm(), config, STEPS), optimizer_factory(OPTIM))
    if engine.is_server:
        engine.serve()
        return {
            "dead": engine.dead_workers,
            "updates": engine.version,
            "params": _portable(engine.full_parameters()),
        }
    for step, batch in enumerate(_batches()):
        if rank == 2 and step == 2:
            os._exit(0)  # the process is gone mid-training, without a word to the server
        engine.forward_backward(_share(rank - 1, [3, 3], batch), BATCH * SEQ)
        engine.optimizer_step()
    return {"params": _portable(engine.full_parameters())}


def _run_allowing_death(fn: Any, world_size: int, timeout_s: float) -> dict[int, Any]:
    """Like run_on_ranks, but a rank that exits without a result is recorded as missing, not failed."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_dying_main, args=(fn, r, world_size, f"{folder}/store", results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while (time.monotonic() < deadline and any(p.is_alive() for p in procs)) or not results.empty():
                try:
                    rank, value = results.get(timeout=0.2)
                    out[rank] = value
                except queue.Empty:
                    continue
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
    return out


def _dying_main(fn: Any, rank: int, world_size: int, store_path: str, results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    try:
        results.put((rank, fn(rank, world_size)))
    except BaseException as exc:
        results.put((rank, f"failed: {exc}"))


def test_async_server_survives_a_dead_worker() -> None:
    out = _run_allowing_death(_dying_rank, 3, timeout_s=60)
    assert 2 not in out, "the dying worker was expected to vanish"
    assert isinstance(out.get(0), dict), out.get(0)
    assert out[0]["dead"] == [2]
    assert out[0]["updates"] >= STEPS + 2  # worker 1's steps and the dead worker's first two
    assert isinstance(out.get(1), dict), out.get(1)
    assert_parity(_tensors(out[0]["params"]), _tensors(out[1]["params"]), 0.0)
