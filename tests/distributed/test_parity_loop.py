"""All-reduce DP against one process, in float64, through the same path ``shardwise verify`` uses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.commands.verify import VERIFY_DEFAULTS, collect_run, compare_runs, reference_run
from shardwise.config import DDPConfig, OptimizerConfig, TrainConfig, load_config
from shardwise.data_parallel.ddp import DDPEngine
from shardwise.engine.optim import attach_optimizers, build_optimizer, named, optimizer_factory
from shardwise.models import build_model
from shardwise.testing import RankFailure, assert_parity, run_on_ranks
from shardwise.train.loop import seed_everything

TOL = 1e-10


def _config(**overrides: str) -> TrainConfig:
    return load_config(None, {**VERIFY_DEFAULTS, **overrides})


def _worker(rank: int, world_size: int, config: TrainConfig):
    return collect_run(config.validate(world_size))


CASES = {
    "dp2": (2, {}),
    "dp2-uneven-.3-.7": (2, {"data.weights": "0.3,0.7"}),
    "dp4-uneven-.25-.25-.10-.40": (4, {"data.weights": ".25,.25,.10,.40", "data.global_batch": "16"}),
    "dp3-one-rank-empty": (3, {"data.weights": "1,0,1"}),
    "dp2-no_sync-3-micro": (
        2,
        {"data.micro_batches": "3", "ddp.bucket_mb": "0.05", "ddp.first_bucket_mb": "0.01"},
    ),
    "dp2-sgd-mlp": (
        2,
        {"optim.name": "sgd", "model.kind": "mlp", "model.preset": "odd", "model.freeze": "embed"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_matches_one_process(case: str) -> None:
    world, overrides = CASES[case]
    config = _config(**overrides)
    results = run_on_ranks(_worker, world, config, timeout_s=120)
    report = compare_runs(reference_run(config.validate(world)), results[0], TOL)
    assert report["ok"], report
    seed_everything(config.seed)  # a frozen parameter keeps its initial value
    initial = build_model(config.model, torch.float64)
    frozen = [n for n, p in initial.named_parameters() if not p.requires_grad]
    assert frozen
    for name in frozen:
        assert torch.equal(results[0]["params"][name], dict(initial.named_parameters())[name])


class _TwoHeads(nn.Module):
    """``b`` is used only when asked: an unused parameter in the other steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if use_b else y


def _unused_worker(rank: int, world_size: int, find_unused: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)  # different starting weights: the engine must broadcast rank 0's
    model = _TwoHeads()
    engine = DDPEngine(model, Comm(), DDPConfig(find_unused_parameters=find_unused))
    attach_optimizers(engine, optimizer_factory(OptimizerConfig(name="adamw")))
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    # step 0 uses b on rank 0 only; step 1 uses b nowhere
    for step, use_b in enumerate([rank == 0, False]):
        (model(x, use_b).sum() / 10).backward()
        engine.finish_grads()
        if step == 1:
            assert model.b.weight.grad is None  # nobody used it: like one process, no gradient
        engine.optimizer_step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_unused_parameters_error_names_them() -> None:
    with pytest.raises(RankFailure, match=r"b\.weight, b\.bias received no gradient.*find_unused_parameters"):
        run_on_ranks(_unused_worker, 2, False, timeout_s=60)


def test_find_unused_parameters_matches_one_process() -> None:
    got = run_on_ranks(_unused_worker, 2, True, timeout_s=60)
    torch.manual_seed(0)
    model = _TwoHeads()
    optimizer = build_optimizer(named(model), OptimizerConfig(name="adamw"))
    xs = [
        torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(2)
    ]
    for use_b in ([True, False], [False, False]):
        for x, b in zip(xs, use_b, strict=True):
            (model(x, b).sum() / 10).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    for rank_params in got:
        assert_parity(expected, rank_params, atol=TOL)


def _views_worker(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))  # rank 0's buffers must win
    engine = attach_optimizers(DDPEngine(model, Comm(), DDPConfig()), optimizer_factory(OptimizerConfig()))
    everyone = [torch.zeros(3) for _ in range(world_size)]
    dist.all_gather(everyone, model[1].running_mean)
    buffers_from_rank_0 = bool(torch.all(torch.stack(everyone) == 0.0))
    ptrs = [p.grad.data_ptr() for p in engine.params]
    model(torch.randn(4, 3)).sum().backward()
    engine.finish_grads()
    same_storage = [p.grad.data_ptr() for p in engine.params] == ptrs
    engine.optimizer_step()
    return same_storage and buffers_from_rank_0


def test_gradients_live_in_the_buckets_and_buffers_start_from_rank_0() -> None:
    assert all(run_on_ranks(_views_worker, 2, timeout_s=60))


def test_parameter_server_through_the_train_loop_matches_one_process() -> None:
    """Two servers, two workers with uneven shares: the same path as ``shardwise verify --strategy ps``."""
    config = _config(strategy="ps", **{"ps.servers": "2", "data.weights": "0.25,0.75"})
    results = run_on_ranks(_worker, 4, config, timeout_s=120)
    candidate = next(r for r in results if r is not None)
    report = compare_runs(reference_run(config.validate(4)), candidate, TOL)
    assert report["ok"], report


def _many_worker(rank: int, world_size: int, configs: list[TrainConfig]):
    return [collect_run(config.validate(world_size)) for config in configs]


@pytest.mark.parametrize("world", [2, 4], ids=["dp2", "dp4"])
def test_zero_stages_through_the_train_loop_match_one_process(world: int) -> None:
    """ZeRO 1/2/3 on the odd-sized GPT (tied head, frozen wpe), uneven shares, accumulation."""
    weights = "0.3,0.7" if world == 2 else ".25,.25,.10,.40"
    configs = [
        _config(strategy=f"zero{stage}", **{"data.weights": weights, "data.global_batch": "16", **extra})
        for stage in (1, 2, 3)
        for extra in ({}, {"data.micro_batches": "2", "optim.name": "sgd"})
    ]
    # a rank with no data, and ranks whose micro-batches are partly empty: every rank still runs the
    # same number of passes, which ZeRO-3 (gathering inside forward and backward) depends on
    empty = "1,0" if world == 2 else "1,0,1,3"
    configs.append(_config(strategy="zero3", **{"data.weights": empty, "data.micro_batches": "3"}))
    results = run_on_ranks(_many_worker, world, configs, timeout_s=240)[0]
    for config, candidate in zip(configs, results, strict=True):
        report = compare_runs(reference_run(config.validate(world)), candidate, TOL)
        assert report["ok"], (config.strategy, config.optim.name, report)
