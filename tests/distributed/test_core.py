"""The composable core: the mesh and its Comms, message tags, roles, optimizers built outside the
strategies, and the gradient-norm interface every strategy answers (against one process)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardwise.collectives.api import Comm
from shardwise.collectives.cost import CostProfile
from shardwise.config import CommConfig, ConfigError, ParallelConfig, ParallelDims, TrainConfig, load_config
from shardwise.data.corpus import load_corpus
from shardwise.data.sampler import DataSampler
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import build_optimizer
from shardwise.engine.update import trainable
from shardwise.mesh import build_mesh
from shardwise.models import build_model, predicted_tokens
from shardwise.parallelism import NotBuiltError, check
from shardwise.testing import run_on_ranks
from shardwise.train.loop import Trainer, seed_everything, torch_dtype

from .cli_helpers import refusal, shardwise


# -- ParallelDims: the arithmetic in the errors -------------------------------------------------------
def test_parallel_dims_resolve_and_explain() -> None:
    assert ParallelDims.build(ParallelConfig(tp=2), 8) == ParallelDims(dp=4, pp=1, tp=2)
    assert ParallelDims.build(ParallelConfig(), 5, servers=2).mesh_shape == (1, 3, 1, 1, 1)
    with pytest.raises(ConfigError, match=r"dp\(3\) x pp\(1\) x tp\(2\) = 6, but the world has 4 ranks"):
        ParallelDims.build(ParallelConfig(dp=3, tp=2), 4)
    with pytest.raises(
        ConfigError, match=r"= 4 does not divide the world of 3 ranks that train \(5 ranks - 2"
    ):
        ParallelDims.build(ParallelConfig(pp=2, tp=2), 5, servers=2)


def test_unbuilt_parallelism_is_refused_not_ignored() -> None:
    for key in ("parallel.tp", "parallel.pp", "parallel.activation_checkpointing"):  # built: accepted
        check(load_config(None, {key: "true" if key.endswith("checkpointing") else "2"}))
    with pytest.raises(NotBuiltError, match=r"--strategy diloco with tensor parallelism .* is not built yet"):
        check(load_config(None, {"parallel.tp": "2", "strategy": "diloco"}))
    with pytest.raises(NotBuiltError, match=r"compression .* with tensor parallelism is not built yet"):
        check(load_config(None, {"parallel.tp": "2", "comm.compress": "int8"}))
    check(TrainConfig())  # the default asks for nothing unbuilt


@pytest.mark.parametrize("key", ["parallel.tp"])
def test_train_refuses_unbuilt_parallelism_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """Before any rank starts (``cli.main`` in this process): exit 2, one line."""
    args = ["train", "--nproc", "2", "--steps", "5", "--strategy", "diloco", "--set", f"{key}=2"]
    line = refusal(args, tmp_path / "run", capsys)
    assert "is not built yet" in line, line


# -- the mesh -----------------------------------------------------------------------------------------
def _mesh_layout(rank: int, world_size: int, servers: int, profile: str) -> dict:
    mesh = build_mesh(ParallelDims.build(ParallelConfig(), world_size, servers), CommConfig("auto", profile))
    out = {
        "in_mesh": mesh.in_mesh,
        "servers": mesh.servers is not None,
        "trainers": mesh.trainers is not None,
    }
    if mesh.in_mesh:
        dp = mesh.comm("dp")
        out.update(
            same=dp is mesh.comm("dp"),
            dp=(dp.rank, dp.world_size),
            tp=mesh.comm("tp").world_size,
            profile_alpha=dp.profile.alpha_s,
            algorithm=dp.algorithm,
        )
    return out


def test_mesh_builds_each_axis_once_with_the_saved_profile(tmp_path) -> None:
    profile = CostProfile(alpha_s=1.234e-4)
    path = tmp_path / "profile.json"
    profile.save(str(path))
    got = run_on_ranks(_mesh_layout, 4, 0, str(path), timeout_s=120)
    assert [g["dp"] for g in got] == [(r, 4) for r in range(4)]
    assert all(g["same"] and g["tp"] == 1 and g["algorithm"] == "auto" for g in got)
    assert all(g["profile_alpha"] == pytest.approx(1.234e-4) for g in got)  # training's auto reads it


def test_parameter_servers_stand_outside_the_mesh(tmp_path) -> None:
    CostProfile().save(str(tmp_path / "p.json"))
    got = run_on_ranks(_mesh_layout, 4, 1, str(tmp_path / "p.json"), timeout_s=120)
    assert not got[0]["in_mesh"] and got[0]["servers"] and not got[0]["trainers"]
    assert [g["dp"] for g in got[1:]] == [(0, 3), (1, 3), (2, 3)]


def _two_comms_one_group(rank: int, world_size: int) -> list[float]:
    """Two Comms on the same ranks run ring all-reduces at once, beside a caller's own send/recv."""
    first, second = Comm(None, "ring"), Comm(None, "ring")
    a = torch.full((3001,), float(rank + 1))
    b = torch.full((3001,), float(10 * (rank + 1)))
    works = [first.all_reduce(a, async_op=True), second.all_reduce(b, async_op=True)]
    peer = (rank + 1) % world_size
    mine, theirs = torch.tensor([float(rank)]), torch.zeros(1)
    requests = [first.isend(mine, peer), first.irecv(theirs, (rank - 1) % world_size)]
    for work in [*works, *requests]:
        work.wait()
    return [float(a[0]), float(a[-1]), float(b[0]), float(b[-1]), float(theirs)]


def test_tags_never_pair_two_comms_on_one_group() -> None:
    got = run_on_ranks(_two_comms_one_group, 3, timeout_s=120)
    for rank, values in enumerate(got):
        assert values == [6.0, 6.0, 60.0, 60.0, float((rank - 1) % 3)]


# -- roles, optimizers outside, and the gradient norm of every strategy ----------------------------------
def _config(strategy: str, **changes: object) -> TrainConfig:
    overrides = {"strategy": strategy, "dtype": "float64", "model.preset": "odd", "data.global_batch": "6"}
    overrides.update({k: str(v) for k, v in changes.items()})
    return load_config(None, overrides)


def _reference_norm(config: TrainConfig) -> float:
    """One process on the global batch of step 0: the global gradient's norm, by torch."""
    seed_everything(config.seed)
    model = build_model(config.model, torch_dtype(config.dtype))
    corpus = load_corpus(config.data.corpus_bytes)
    batch = config.data.global_batch
    sampler = DataSampler(corpus.train, config.model.seq_len, batch, config.seed, [batch], 0)
    inputs, targets = sampler.global_batch(0)
    tokens = predicted_tokens(config.model.kind, batch, config.model.seq_len)
    (loss_sum(model(inputs), targets) / tokens).backward()
    params = [p for _, p in trainable(model)]
    return float(torch.nn.utils.clip_grad_norm_(params, float("inf")))


def _norm_rank(rank: int, world_size: int, config: TrainConfig) -> dict:
    trainer = Trainer.build(config)
    engine = trainer.engine
    seen: list[float] = []
    if engine.role.serves:  # the norm is taken on the servers, between the summed gradient and the step
        step_optimizers = engine.run_optimizers

        def measured(lr_scale: float = 1.0) -> None:
            share, comm = engine.grad_norm_sq()
            if comm is not None:
                comm.all_reduce(share)
            seen.append(float(share.sqrt()))
            step_optimizers(lr_scale)

        engine.run_optimizers = measured  # type: ignore[method-assign]
        engine.serve()
    else:
        micro = trainer.sampler.local_micro_batches(0, 1, keep_empty=True)
        engine.forward_backward(micro, engine.global_count(micro))
        if engine.optimizer_runs == "every_rank":
            share, comm = engine.grad_norm_sq()
            if comm is not None:
                comm.all_reduce(share)
            seen.append(float(share.sqrt()))
        engine.optimizer_step()
    units = [[name for name, _ in unit] for unit in engine.optimizer_units()]
    engine.close()
    role = engine.role
    return {"norm": seen[:1], "units": units, "role": (role.steps, role.serves, role.reports, role.reporter)}


@pytest.mark.parametrize(
    ("strategy", "world", "extra"),
    [("ddp", 2, {}), ("zero1", 2, {}), ("zero2", 3, {}), ("zero3", 2, {}), ("ps", 4, {"ps.servers": 2})],
)
def test_gradient_norm_shares_add_up_to_one_process(strategy: str, world: int, extra: dict) -> None:
    config = _config(strategy, steps=1, **extra)
    got = run_on_ranks(_norm_rank, world, config.validate(world), timeout_s=180)
    expected = _reference_norm(config)
    norms = [g["norm"][0] for g in got if g["norm"]]
    assert norms and all(n == pytest.approx(expected, rel=1e-12) for n in norms)
    reporter = config.ps.servers if strategy == "ps" else 0
    assert [g["role"][2] for g in got] == [r == reporter for r in range(world)]
    assert all(g["role"][3] == reporter for g in got)
    if strategy == "ps":
        assert [g["role"][:2] for g in got] == [(False, True)] * 2 + [(True, False)] * 2
        assert got[2]["units"] == [] and all(g["units"] for g in got[:2])  # optimizers live on servers
    elif strategy.startswith("zero"):
        assert all(len(g["units"]) >= 1 and g["units"][0] == ["flat0"] for g in got)


def _factory_rank(rank: int, world_size: int, config: TrainConfig) -> list[list[str]]:
    from shardwise.parallelism import parallelize

    mesh = build_mesh(config.dims(world_size), config.comm)
    model = build_model(config.model, torch.float64)
    built: list[list[str]] = []

    def factory(named):  # the user's own: records what it was given, builds SGD
        built.append([name for name, _ in named])
        return build_optimizer(named, replace(config.optim, name="sgd"))

    engine = parallelize(model, mesh, config, factory)
    kinds = {type(opt).__name__ for opt in engine.optimizers}
    engine.close()
    assert kinds <= {"SGD"}, kinds
    return built


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_parallelize_builds_the_optimizers_with_the_given_factory(strategy: str) -> None:
    config = _config(strategy).validate(2)
    got = run_on_ranks(_factory_rank, 2, config, timeout_s=120)
    if strategy == "ddp":
        names = got[0][0]
        assert "wte.weight" in names and "wpe.weight" in names and len(got[0]) == 1
    else:  # first a probe over the model's own names (are there param groups to keep apart?), then shards
        probe, *units = got[0]
        assert "wte.weight" in probe
        assert units and all(unit == [f"flat{i}"] for i, unit in enumerate(units))


def test_checkpoint_records_the_mesh(tmp_path) -> None:
    result = shardwise(
        "train", "--nproc", "3", "--strategy", "ps", "--preset", "tiny", "--steps", "2",
        "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--run-dir", str(tmp_path),
        timeout_s=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((tmp_path / "ck" / "step-00000002" / "manifest.json").read_text())
    degrees = {"dp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "ep": 1, "pp": 1, "tp": 1, "servers": 1}
    assert manifest["mesh"] == degrees
