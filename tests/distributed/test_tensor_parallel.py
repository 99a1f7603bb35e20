"""Tensor parallelism through the whole stack: verify against one process, and checkpoints as boxes.

``shardwise verify``'s path (float64, 2 steps: losses, gradients, the global gradient norm, final
parameters against one process, 1e-10) for tp 2, with sequence parallelism, on a Hugging Face Llama
(grouped-query attention), tp 2 x dp 2, ZeRO-1/2/3 on dp (ZeRO-3 with tp is FSDP + TP), tp x pp, and all
three at once (dp 2 x pp 2 x tp 2 with ZeRO-1 on 8 ranks): the cases of one world size (2, 4, 8 ranks)
in one launched world, each command line read by the CLI's parser (``verify_worlds``). A width tp does
not divide is refused on the ranks, so through the real command, in one line. A dp 2 x pp 2 x tp 2
ZeRO-1 run saves a checkpoint: the files hold the global tensors the saver's ranks assemble
(``full_parameters``), one plain process loads them exactly (``torch.equal``), and the same layout
resumes each rank's own shards and optimizer state bit for bit. tp alone (a dp group of one) keeps no
gradient between steps.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import load
from shardwise.checkpoint.layout import list_steps
from shardwise.config import TrainConfig
from shardwise.engine.full_state import FolderReader, full_state_tensors, load_checkpoint
from shardwise.engine.optim import build_optimizer, named
from shardwise.models import build_model
from shardwise.testing import run_on_ranks
from tests.distributed.test_resume import _config as resume_config

from .cli_helpers import refusal
from .verify_worlds import check_cases, world_sizes

pytestmark = pytest.mark.slow
SAVED_STEPS = 3

VERIFY_CASES = {
    "tp2": ["--tp", "2", "--nproc", "2"],
    "tp2-sp": ["--tp", "2", "--nproc", "2", "--sequence-parallel"],
    "tp2-llama": ["--tp", "2", "--nproc", "2", "--model", "hf:tiny-llama"],
    "dp2-tp2": ["--tp", "2", "--nproc", "4"],
    "tp2-zero1": ["--tp", "2", "--nproc", "2", "--strategy", "zero1"],
    "dp2-tp2-zero3": ["--tp", "2", "--nproc", "4", "--strategy", "zero3"],
    "dp2-tp2-zero2-sp": ["--tp", "2", "--nproc", "4", "--strategy", "zero2", "--sequence-parallel"],
    # zero-bubble: the tp layers keep their weight gradients for W (1F1B: the 8-rank case below)
    "pp2-tp2-zb": ["--tp", "2", "--pp", "2", "--schedule", "zb", "--micro-batches", "4", "--nproc", "4"],
    "dp2-pp2-tp2-zero1": ["--tp", "2", "--pp", "2", "--strategy", "zero1", "--nproc", "8"],
}


VERIFY_WORLDS = world_sizes(VERIFY_CASES)


@pytest.mark.parametrize("world", VERIFY_WORLDS, ids=[f"{n}-ranks" for n in VERIFY_WORLDS])
def test_verify_tensor_parallel(world: int) -> None:
    """Every case of this world size as ``shardwise verify <case> --steps 2`` runs it, in one world:
    each measure (the parameters and the global gradient norm among them) within 1e-10 of one process."""
    check_cases({name: [*args, "--steps", "2"] for name, args in VERIFY_CASES.items()}, world, 1e-10)


def test_a_width_tp_does_not_divide_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by verify's checks before it starts any rank: ``cli.main`` in this process, as
    ``python -m shardwise`` runs it (exit 2, one line on stderr, no rank's pid file)."""
    line = refusal(["verify", "--tp", "2", "--nproc", "2", "--preset", "odd"], tmp_path / "run", capsys)
    assert "not divisible by tp 2" in line, line


def _config(root: Path, layout: str = "3d") -> TrainConfig:
    """``3d``: dp 2 x pp 2 x tp 2 with ZeRO-1 (8 ranks); ``zero3``: ZeRO-3 over dp alone."""
    parallel = {"parallel.tp": "2", "parallel.pp": "2"} if layout == "3d" else {}
    config = resume_config(
        root / "run", "float64", steps=str(SAVED_STEPS), eval_every="0",
        **{"model.dropout": "0.0", "model.preset": "odd-deep", **parallel},
    )
    strategy, micro = ("zero1", 2) if layout == "3d" else ("zero3", 1)  # zero3: 1 row on each of 4 ranks
    data = replace(config.data, global_batch=4, micro_batches=micro)
    config = replace(config, strategy=strategy, data=data)
    return replace(config, checkpoint=replace(config.checkpoint, dir=str(root / "ckpt"), every=SAVED_STEPS))


def _local_state(engine) -> dict[str, torch.Tensor]:
    """This rank's tensors and optimizer state at the shapes it holds (tp shards; ZeRO gathered over dp)."""
    return engine.full_state()


def _save(rank: int, world_size: int, root: str, layout: str = "3d") -> dict:
    from shardwise.train.checkpointing import TrainCheckpoints
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(_config(Path(root), layout))
    ckpt = TrainCheckpoints.create(trainer, rank, world_size)
    for step in range(SAVED_STEPS):
        ckpt.after_step(trainer.step(step), [])
    ckpt.close()
    out = {"full": trainer.engine.full_parameters(), "local": _local_state(trainer.engine)}
    trainer.engine.close()
    return out


def _resume(rank: int, world_size: int, root: str) -> dict:
    from shardwise.train.checkpointing import TrainCheckpoints
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(_config(Path(root)))  # fresh weights and no optimizer state: all must load
    resumed = TrainCheckpoints.create(trainer, rank, world_size).resume()
    assert resumed is not None and resumed.next_step == SAVED_STEPS
    out = {"full": trainer.engine.full_parameters(), "local": _local_state(trainer.engine)}
    trainer.engine.close()
    return out


def test_dp2_pp2_tp2_checkpoint_loads_in_one_process_and_resumes(tmp_path: Path) -> None:
    saved = run_on_ranks(_save, 8, str(tmp_path), timeout_s=480)
    step_dir = list_steps(str(tmp_path / "ckpt"))[-1][1]
    names = [n for n in FolderReader(step_dir).shapes if not n.startswith("rng/")]
    on_disk = load(step_dir, dict.fromkeys(names))
    full = saved[0]["full"]
    for name, tensor in full.items():
        assert torch.equal(on_disk[f"model/{name}"], tensor), f"{name}: the files differ from the run's"
    assert any(n.startswith("optim/exp_avg_sq/") for n in on_disk)

    config = _config(tmp_path)
    model = build_model(config.model, torch.float64)
    optimizer = build_optimizer(named(model), config.optim)
    assert load_checkpoint(str(tmp_path / "ckpt"), model, optimizer) == SAVED_STEPS
    plain = full_state_tensors(model, optimizer)
    for name, tensor in on_disk.items():
        if name.startswith(("model/", "optim/")):
            assert torch.equal(plain[name], tensor), f"one process: {name} differs"

    resumed = run_on_ranks(_resume, 8, str(tmp_path), timeout_s=480)
    for rank, (before, after) in enumerate(zip(saved, resumed, strict=True)):
        for name, tensor in before["local"].items():
            assert torch.equal(after["local"][name], tensor), f"rank {rank}: {name} not restored"
        for name, tensor in before["full"].items():
            assert torch.equal(after["full"][name], tensor), f"rank {rank}: full {name} differs"


def test_zero3_on_4_loads_into_dp2_pp2_tp2_on_8(tmp_path: Path) -> None:
    """Any layout loads any other: ZeRO-3's flat ranges of the global tensors are read back as the
    boxes a dp 2 x pp 2 x tp 2 rank holds."""
    saved = run_on_ranks(_save, 4, str(tmp_path), "zero3", timeout_s=480)[0]["full"]
    resumed = run_on_ranks(_resume, 8, str(tmp_path), timeout_s=480)
    for rank, got in enumerate(resumed):
        for name, tensor in saved.items():
            assert torch.equal(got["full"][name], tensor), f"rank {rank}: {name} differs from ZeRO-3's"


def _held_between_steps(rank: int, world_size: int, overrides: dict[str, str]) -> dict:
    """Tensor bytes alive after two steps, beside those of the parameters and the optimizer state."""
    from shardwise.config import load_config
    from shardwise.mesh import build_mesh
    from shardwise.parallelism import parallelize
    from shardwise.testing.memory import TensorBytes

    config = load_config(None, overrides)
    tokens = torch.randint(0, 256, (4, config.model.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with TensorBytes() as counted:
        torch.manual_seed(0)
        engine = parallelize(build_model(config.model), build_mesh(config), config)
        for _ in range(2):
            engine.train_step([(tokens[:, :-1], tokens[:, 1:])])
    held = list(engine.model.parameters())
    states = [v for o in engine.optimizers for s in o.state.values() for v in s.values()]
    held += [v for v in states if v.is_floating_point()]
    out = {
        "live": counted.live,
        "states": sum(t.numel() * t.element_size() for t in held),
        "buckets": len(getattr(engine, "buckets", [])),
        "grads": [n for n, p in engine.model.named_parameters() if p.grad is not None],
    }
    engine.close()
    return out


def test_tp_alone_keeps_no_gradient_buckets_between_steps() -> None:
    """tp 2 on 2 ranks leaves a dp group of one: nothing to all-reduce, so DDP keeps no flat buckets (a
    whole gradient copy held through forward, where a tp run peaks: it made our peak 1.10 x DTensor's in
    ``bench tp``); gradients exist from backward to the update, as in a plain loop."""
    overrides = {"model.preset": "tiny", "model.seq_len": "16", "parallel.tp": "2", "strategy": "ddp"}
    for rank, got in enumerate(run_on_ranks(_held_between_steps, 2, overrides, timeout_s=240)):
        assert got["buckets"] == 0 and got["grads"] == [], f"rank {rank}: {got}"
        assert got["live"] == got["states"], f"rank {rank}: more than parameters and optimizer state: {got}"
