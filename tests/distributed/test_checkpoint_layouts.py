"""Saved by ZeRO-3 on 4 ranks, loaded by DDP on 2, ZeRO-2 on 3 and one process: identical state.

The ZeRO-3 run trains through the real train loop (``Trainer`` + ``TrainCheckpoints``) in float64 and
saves; each loader resumes from it and its gathered state (every parameter and every per-parameter
``exp_avg``, ``exp_avg_sq`` and ``step``) must equal the saver's, bit for bit. Engine-level cases cover
what the GPT preset lacks: a frozen parameter, a tied weight and a buffer, SGD momentum, disk offload
and bf16 mixed precision (the checkpoint holds the fp32 masters). The ZeRO-2 run resumed from step 3
equals an uninterrupted one. Every world size runs its cases in one spawn (each spawn costs seconds).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint import CheckpointWriter, load
from shardwise.checkpoint.layout import list_steps
from shardwise.collectives.api import Comm
from shardwise.config import DDPConfig, OptimizerConfig, TrainConfig, ZeroConfig
from shardwise.engine.full_state import FolderReader, full_state_tensors, load_checkpoint
from shardwise.engine.optim import attach_optimizers, build_optimizer, named, optimizer_factory
from shardwise.models import build_model
from shardwise.testing import run_on_ranks
from tests.distributed.test_resume import _config as resume_config

pytestmark = pytest.mark.slow
SAVED_STEPS = 3


def _loop_config(root: Path, strategy: str, **extra: str) -> TrainConfig:
    config = resume_config(root / strategy, "float64", steps=str(SAVED_STEPS), eval_every="0", **extra)
    return replace(config, strategy=strategy, checkpoint=replace(config.checkpoint, dir=str(root / "ckpt")))


def _full_state(engine) -> dict[str, torch.Tensor]:
    if hasattr(engine, "full_state"):
        return engine.full_state()
    return {n: t.clone() for n, t in full_state_tensors(engine.model, engine.optimizers[0]).items()}


def _train_and_save(root: Path, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from shardwise.train.checkpointing import TrainCheckpoints
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(_loop_config(root, "zero3", **{"model.dropout": "0.0"}))
    ckpt = TrainCheckpoints.create(trainer, rank, world_size)
    for step in range(SAVED_STEPS):
        ckpt.after_step(trainer.step(step), [])
    ckpt.close()
    state = _full_state(trainer.engine)
    trainer.engine.close()
    return state


def _resume(root: Path, strategy: str, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from shardwise.train.checkpointing import TrainCheckpoints
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(_loop_config(root, strategy, **{"model.dropout": "0.0"}))
    resumed = TrainCheckpoints.create(trainer, rank, world_size).resume()
    assert resumed is not None and resumed.next_step == SAVED_STEPS
    state = _full_state(trainer.engine)
    trainer.engine.close()
    return state


# -- engine-level cases: frozen, tied, buffer, SGD momentum, disk offload, bf16 ----------------------------
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 5)
        self.wpe = nn.Embedding(4, 5)
        self.wpe.weight.requires_grad_(False)  # frozen
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))
        self.head = nn.Linear(5, 11, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = x + torch.tanh(block(x * self.gain.to(x.dtype)))
        return self.head(x)


CASES = {  # name: (optimizer, saving stage, saving ZeroConfig, loading stage, loading ZeroConfig)
    "adamw-disk": ("adamw", 1, ZeroConfig(bucket_mb=1e-4), 3, ZeroConfig(offload="disk")),
    "sgd": ("sgd", 3, ZeroConfig(offload="disk"), 2, ZeroConfig(bucket_mb=1e-4, offload="disk")),
    "adamw-bf16": ("adamw", 2, ZeroConfig(precision="bf16"), 1, ZeroConfig(precision="bf16", bucket_mb=1e-4)),
}


def _tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny().double()


def _zero(case: str, saving: bool, comm: Comm, seed: int):
    from shardwise.zero import build_zero_engine

    optim, stage, config, load_stage, load_config = CASES[case]
    factory = optimizer_factory(OptimizerConfig(name=optim, weight_decay=0.1))
    model = _tiny(seed)
    if "bf16" in case:
        model = model.float()
    if saving:
        return attach_optimizers(build_zero_engine(model, comm, stage, config), factory)
    return attach_optimizers(build_zero_engine(model, comm, load_stage, load_config), factory)


def _train_tiny(engine, rank: int, world_size: int) -> None:
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, 11, (world_size * 2, 5), generator=g)[rank * 2 : rank * 2 + 2]
        engine.forward_backward([(data[:, :-1], data[:, 1:])], data.numel() * world_size)
        engine.optimizer_step()


def _save_cases(rank: int, world_size: int, root: str) -> dict:
    out = {"loop": _train_and_save(Path(root) / "loop", rank, world_size)}
    comm = Comm()
    for case in CASES:
        engine = _zero(case, True, comm, seed=0)
        _train_tiny(engine, rank, world_size)
        CheckpointWriter(str(Path(root) / case), comm).save(2, engine.state_pieces(rank, world_size))
        out[case] = engine.full_state()
        engine.close()
    return out if rank == 0 else {}


class CountingReader(FolderReader):
    """Records every request, to check each rank asks for its own ranges only."""

    def __init__(self, step_dir: str) -> None:
        super().__init__(step_dir)
        self.requests: dict = {}

    def __call__(self, requests):
        self.requests.update(requests)
        return super().__call__(requests)


def _resume_ps(root: Path, rank: int, world_size: int) -> dict:
    """1 server, 2 workers: every rank's pieces (to check each tensor is written once) and its model."""
    from shardwise.train.checkpointing import TrainCheckpoints
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(_loop_config(root, "ps", **{"model.dropout": "0.0"}))
    resumed = TrainCheckpoints.create(trainer, rank, world_size).resume()
    assert resumed is not None and resumed.next_step == SAVED_STEPS
    pieces = trainer.engine.state_pieces(rank, world_size)
    out = {
        "pieces": {p.name: p.tensor.detach().clone().reshape(p.global_shape) for p in pieces},
        "written": [p.name for p in pieces],
        "model": {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()},
        "server": trainer.engine.is_server,
    }
    trainer.engine.close()
    return out


def _load_cases_zero(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    out = {"loop": _resume(Path(root) / "loop", "zero2", rank, world_size)}
    out["ps"] = _resume_ps(Path(root) / "loop", rank, world_size)
    comm = Comm()
    for case in CASES:
        engine = _zero(case, False, comm, seed=1)  # other initial weights: all must be replaced
        reader = CountingReader(list_steps(str(Path(root) / case))[-1][1])
        engine.load_state(reader)
        spans: list = [None] * world_size
        dist.all_gather_object(spans, {n: s for n, s in reader.requests.items() if s is not None})
        out[case] = engine.full_state()
        if engine.stage < 3:  # compute copies re-derived from the masters
            out[case + "/compute"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        out[case + "/spans"] = spans
        engine.close()
    return out if rank == 0 else {"ps": out["ps"]}


def _load_cases_ddp(rank: int, world_size: int, root: str) -> dict:
    from shardwise.data_parallel.ddp import DDPEngine

    out = {"loop": _resume(Path(root) / "loop", "ddp", rank, world_size)}
    comm = Comm()
    for case in ("adamw-disk", "sgd"):
        factory = optimizer_factory(OptimizerConfig(name=CASES[case][0], weight_decay=0.1))
        engine = attach_optimizers(DDPEngine(_tiny(seed=1), comm, DDPConfig()), factory)
        engine.load_state(FolderReader(list_steps(str(Path(root) / case))[-1][1]))
        out[case] = _full_state(engine)
        engine.close()
    return out if rank == 0 else {}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert sorted(got) == sorted(want), f"{label}: names differ: {sorted(set(got) ^ set(want))}"
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, f"{label}: {name} dtype {got[name].dtype} != {tensor.dtype}"
        assert torch.equal(got[name], tensor), f"{label}: {name} differs"


def _one_process(root: Path) -> dict[str, torch.Tensor]:
    config = _loop_config(root, "single_process", **{"model.dropout": "0.0"})
    torch.manual_seed(1)
    model = build_model(config.model, torch.float64)
    optimizer = build_optimizer(named(model), config.optim)
    assert load_checkpoint(str(root / "ckpt"), model, optimizer) == SAVED_STEPS
    return {n: t.clone() for n, t in full_state_tensors(model, optimizer).items()}


def test_zero3_checkpoint_loads_into_ddp_zero2_and_one_process(tmp_path: Path) -> None:
    saved = run_on_ranks(_save_cases, 4, str(tmp_path), timeout_s=240)[0]
    loop = saved["loop"]
    assert any(n.startswith("optim/exp_avg_sq/") for n in loop)
    assert any(n.startswith("optim/step/") for n in loop)
    step_dir = list_steps(str(tmp_path / "loop" / "ckpt"))[-1][1]
    names = [n for n in FolderReader(step_dir).shapes if not n.startswith("rng/")]
    on_disk = load(step_dir, dict.fromkeys(names))
    _assert_same(on_disk, loop, "files written by zero3 on 4 ranks")

    zero_ranks = run_on_ranks(_load_cases_zero, 3, str(tmp_path), timeout_s=240)
    zero = zero_ranks[0]
    _assert_same(zero["loop"], loop, "zero2 on 3 ranks")
    _assert_ps_loaded([r["ps"] for r in zero_ranks], loop)
    ddp = run_on_ranks(_load_cases_ddp, 2, str(tmp_path), timeout_s=240)[0]
    _assert_same(ddp["loop"], loop, "ddp on 2 ranks")
    _assert_same(_one_process(tmp_path / "loop"), loop, "one process")

    for case, (_, _, _, load_stage, _) in CASES.items():
        want = saved[case]
        assert "model/wpe.weight" in want and "model/gain" in want and "model/head.weight" not in want
        _assert_same(zero[case], want, f"{case}: zero{load_stage} on 3 ranks")
        if case + "/compute" in zero:
            compute = zero[case + "/compute"]
            for name, tensor in compute.items():
                assert torch.equal(tensor, want[f"model/{name}"].to(tensor.dtype)), f"{case}: compute {name}"
        _assert_spans_partition(zero[case + "/spans"], want)
    for case in ("adamw-disk", "sgd"):
        _assert_same(ddp[case], saved[case], f"{case}: ddp on 2 ranks")
    assert "optim/momentum_buffer/wte.weight" in saved["sgd"]


def _assert_ps_loaded(ranks: list[dict], loop: dict[str, torch.Tensor]) -> None:
    """Servers hold what they serve, workers the whole model; together they write each tensor once."""
    own = ("rng/", "ps/")  # per-rank RNG and the servers' versions: no other layout has them
    written = [n for r in ranks for n in r["written"] if not n.startswith(own)]
    assert len(written) == len(set(written)), "a tensor is written by two ranks"
    union = {n: t for r in ranks for n, t in r["pieces"].items() if not n.startswith(own)}
    _assert_same(union, loop, "ps (1 server, 2 workers)")
    for r in ranks:
        if not r["server"]:
            for name, tensor in r["model"].items():
                assert torch.equal(tensor, loop[f"model/{name}"]), f"ps worker: {name}"


def _assert_spans_partition(spans: list[dict], want: dict[str, torch.Tensor]) -> None:
    """Every rank asked for ranges (never a whole trainable tensor) and together they cover it once."""
    covered: dict[str, int] = {}
    for mine in spans:
        for name, (a, b) in mine.items():
            covered[name] = covered.get(name, 0) + (b - a)
    for name, numel in covered.items():
        assert numel == want[name].numel(), f"{name}: ranks asked for {numel} of {want[name].numel()}"
    assert any(n.startswith("model/blocks") for n in covered)


# -- resume equivalence for ZeRO -------------------------------------------------------------------------
def _resume_run(rank: int, world_size: int, root: str, strategy: str) -> dict:
    """An uninterrupted run, then the same run resumed from step 3 of its checkpoints."""
    import torch.distributed as dist

    from shardwise.train.loop import run_training

    base = Path(root)
    full = run_training(
        replace(resume_config(base / "full", "float64"), strategy=strategy), show_progress=False
    )
    if rank == 0:
        shutil.copytree(base / "full" / "checkpoints", base / "cut" / "checkpoints")
        steps = list_steps(str(base / "cut" / "checkpoints"))
        shutil.rmtree(steps[-1][1])
        shutil.rmtree(steps[-2][1])  # resume from step 3
    dist.barrier()
    cut = run_training(
        replace(resume_config(base / "cut", "float64"), strategy=strategy), show_progress=False
    )
    return {"full": full, "cut": cut}


def test_zero2_resume_equals_uninterrupted(tmp_path: Path) -> None:
    got = run_on_ranks(_resume_run, 2, str(tmp_path), "zero2", timeout_s=240)[0]
    full, cut = got["full"], got["cut"]
    assert cut["checkpoint"]["resumed_at_step"] == 3 and full["checkpoint"]["resumed_from"] is None
    assert cut["final_param_digest"] == full["final_param_digest"]
    for key in ("initial_loss", "final_loss", "eval_losses", "steps"):
        assert cut[key] == full[key], key


def test_parameter_server_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """1 server and 2 workers (sync): servers save with the workers and resume where they stopped."""
    got = run_on_ranks(_resume_run, 3, str(tmp_path), "ps", timeout_s=240)[1]  # rank 1 reports
    full, cut = got["full"], got["cut"]
    assert full["checkpoint"]["saves"] == 3 and cut["checkpoint"]["resumed_at_step"] == 3
    assert cut["final_param_digest"] == full["final_param_digest"]
    for key in ("initial_loss", "final_loss", "eval_losses", "steps"):
        assert cut[key] == full[key], key
