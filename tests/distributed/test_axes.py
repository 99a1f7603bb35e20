"""The axes as objects: one all-reduce for a step's gradient norm, and no method replaced at run time.

One launched world of 8 ranks builds dp 2 x pp 2 x tp 2 under DDP, ZeRO-3 and hybrid ZeRO-3 (dp 2 as
2 replicas of 1), each clipping its gradients, and runs one step of each (``Trainer.step``). Every
``Comm`` of the mesh counts its calls by label: the gradient norm is exactly one all-reduce per step
on every rank, over every rank that steps (the trainers), where it used to be one per axis. The norm it
gives equals the norm of the full gradients (assembled over every axis: another path) before clipping.
No engine instance attribute shadows a method of its class (axes are objects the engine asks, not
wrappers set on it).
"""

from __future__ import annotations

import math
from functools import partial

import pytest

from shardwise.config import load_config
from shardwise.engine.update import NORM_LABEL
from shardwise.testing import run_on_ranks
from shardwise.train.loop import Trainer

pytestmark = pytest.mark.slow

BASE = {
    "model.preset": "tiny", "dtype": "float64", "parallel.pp": "2", "parallel.tp": "2", "steps": "2",
    "data.global_batch": "4", "data.micro_batches": "2", "optim.clip_grad_norm": "0.05",
    "eval_every": "0", "data.corpus_bytes": "200000",
}  # fmt: skip
LAYOUTS = {
    "ddp": {"strategy": "ddp"},
    "zero3": {"strategy": "zero3"},
    "zero3-hybrid": {"strategy": "zero3", "parallel.dp_replicate": "2"},
}


def _capture(engine, into: dict, _step: int) -> None:
    into.update(engine.full_gradients())  # global, before clipping


def _one_step(rank: int, world_size: int) -> dict[str, dict]:
    out = {}
    for name, overrides in LAYOUTS.items():
        config = load_config(None, {**BASE, **overrides, "run_dir": f"/tmp/shardwise-axes-{name}"})
        trainer = Trainer.build(config)
        engine = trainer.engine
        shadowed = sorted(n for n in vars(engine) if callable(getattr(type(engine), n, None)))
        comms = trainer.mesh.all_comms()
        before = [c.stats.snapshot() for c in comms]
        grads: dict = {}
        trainer.step(0, after_backward=partial(_capture, engine, grads))
        counts = [c.stats.since(b).labels.get(NORM_LABEL, 0) for c, b in zip(comms, before, strict=True)]
        full_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        out[name] = {
            "shadowed": shadowed,
            "axes": [axis.name for axis in engine.axes],
            "norm_all_reduces": sum(counts),
            "over": [c.world_size for c, n in zip(comms, counts, strict=True) if n],
            "norm": engine.last_grad_norm,
            "full_norm": full_norm,
        }
        engine.close()
    return out


def test_one_norm_all_reduce_per_step_over_every_rank_that_steps() -> None:
    results = run_on_ranks(_one_step, 8, timeout_s=600)
    for rank, by_layout in enumerate(results):
        for name, got in by_layout.items():
            where = f"rank {rank}, {name}"
            assert got["shadowed"] == [], where
            assert got["norm_all_reduces"] == 1 and got["over"] == [8], (where, got)
            assert got["norm"] == pytest.approx(got["full_norm"], rel=1e-12), (where, got)
            assert got["norm"] == results[0][name]["norm"], where  # every rank: the same number
        assert by_layout["ddp"]["axes"] == ["tp", "pp"]
        assert by_layout["zero3-hybrid"]["axes"] == ["dp_replicate", "tp", "pp"]
    norms = {name: got["norm"] for name, got in results[0].items()}
    assert norms["zero3"] == pytest.approx(norms["ddp"], rel=1e-12)  # one batch, one model, one norm
    assert norms["zero3-hybrid"] == pytest.approx(norms["ddp"], rel=1e-12)
