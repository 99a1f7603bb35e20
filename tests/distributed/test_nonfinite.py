"""Non-finite values at run time: every rank sees them in the same step and stops, or skips the update.

A NaN is put into one rank's gradient (DDP: its reduced gradient; ZeRO: its gradient shard) or, on
a parameter server, into one worker's weights before its forward (the server then receives a NaN loss
and gradient). With ``on_nonfinite = "skip"`` no rank's parameters or optimizer state change in that
step and training goes on; with ``"stop"`` the CLI ends in one line naming the step, exit code 1.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardwise.config import load_config
from shardwise.testing import run_on_ranks

from .cli_helpers import shardwise

BAD_STEP = 2


# the boundary's one all-reduce; under pp the poisoned parameter is on rank 1 alone
LAYOUTS = {"tp2": {"parallel.tp": "2"}, "pp2": {"parallel.pp": "2"}}


def _config(strategy: str, policy: str) -> Any:
    strategy, _, layout = strategy.partition("-")
    return load_config(
        None,
        {
            **LAYOUTS.get(layout, {}),
            "strategy": strategy,
            "steps": "4",
            "model.preset": "tiny",
            "data.global_batch": "4",
            "data.corpus_bytes": "100000",
            "eval_every": "0",
            "on_nonfinite": policy,
            "run_dir": "/nonexistent",
        },
    )


def _state(engine: Any, own: bool = False) -> list[torch.Tensor]:
    """The parameters and this rank's optimizer state (a parameter server's worker: its model copy);
    ``own``: the parameters this rank's model holds (``full_parameters`` gathers every stage's)."""
    held = [p.detach().clone() for p in engine.model.parameters()] if own else None
    params = held if held is not None else list(engine.full_parameters().values())
    optim = [
        t.detach().clone()
        for optimizer in engine.optimizers
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    ]
    return params + optim


def _poison_gradient(engine: Any, rank: int) -> str | None:
    """Put a NaN in one element of what rank 1 holds after the gradient exchange; return its name
    (None on a rank that does not hold it: a pipeline's first stage)."""
    if not hasattr(engine, "groups"):  # whole-tensor engine: rank 1's copy of the reduced gradient
        held = [(n, p) for n, p in engine.model.named_parameters() if n.startswith("blocks.1")]
        if not held:
            return None
        name, param = held[0]
        if rank == 1:
            param.grad.view(-1)[0] = float("nan")
        return name
    group = engine.groups[0]
    piece = group.layout.overlaps(1)[0]  # the first parameter overlapping rank 1's shard
    if rank == 1:
        group.grad_shard[piece.shard_start] = float("nan")
    return piece.name


def _skip_case(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    from shardwise.train.loop import Trainer

    trainer = Trainer.build(_config(strategy, "skip"))
    engine, out = trainer.engine, {}
    if engine.role.serves:
        engine.serve()
        return {"server_skipped": engine.nonfinite_updates}
    poisoned: dict[str, str | None] = {}

    def poison(step: int) -> None:
        if step == BAD_STEP and strategy != "ps":
            poisoned["name"] = _poison_gradient(engine, rank)

    for step in range(4):
        if step == BAD_STEP:
            before = _state(engine)
            if strategy == "ps" and rank == world_size - 1:  # this worker's weights only: the next
                dict(engine.model.named_parameters())["ln_f.weight"].data.fill_(float("nan"))  # pull mends
        record = trainer.step(step, after_backward=poison)
        if step == BAD_STEP:
            after = _state(engine)  # a worker's copy: the servers' weights, pulled after the step
            out["unchanged"] = len(before) == len(after) and all(map(torch.equal, before, after))
            out["record"] = (record.nonfinite, record.skipped)
            out["expected"] = poisoned.get("name")
        out["loss"] = record.loss
    engine.finish()
    out["finite"] = all(bool(p.isfinite().all()) for p in engine.full_parameters().values())
    engine.close()
    return out


# ddp-tp2: the step's boundary is one all-reduce (engine.nonfinite.post_boundary_sums); a NaN
# there sends every rank to the exact check, which names it
@pytest.mark.parametrize(
    ("strategy", "world"),
    [("ddp", 2), ("zero2", 2), ("zero3", 2), ("ps", 3), ("ddp-tp2", 2), ("ddp-pp2", 2)],
)
def test_a_nan_on_one_rank_skips_the_update_on_every_rank(strategy: str, world: int) -> None:
    results = run_on_ranks(_skip_case, world, strategy, timeout_s=120)
    trainers = [r for r in results if "record" in r]
    expected = results[1].get("expected")  # the poisoning rank's name: every rank must report it
    assert len(trainers) == (world - 1 if strategy == "ps" else world)
    for got in trainers:
        what, skipped = got["record"]
        assert skipped, got
        assert got["unchanged"], f"{strategy}: a skipped step changed parameters or optimizer state"
        assert got["finite"] and math.isfinite(got["loss"])  # training went on after the bad step
        if strategy == "ps":
            assert what.startswith("the loss and the gradient of "), what
        else:
            assert what == f"the gradient of {expected}", what  # the same name on every rank
    if strategy == "ps":
        assert results[0]["server_skipped"] == 1


def _stop_case(
    rank: int, world_size: int, strategy: str, clip: float, value: float | None, target: int
) -> dict[str, Any]:
    """Step ``BAD_STEP`` with ``value`` (None: nothing) in one element of rank ``target``'s gradient,
    under ``on_nonfinite = "stop"``: each rank's record, whether its own parameters and optimizer
    state changed in that step, and that state after it."""
    from dataclasses import replace

    from shardwise.train.loop import Trainer

    config = _config(strategy, "stop")
    trainer = Trainer.build(replace(config, optim=replace(config.optim, clip_grad_norm=clip)))
    engine, out = trainer.engine, {}

    def poison(step: int) -> None:
        if step != BAD_STEP or rank != target or value is None:
            return
        if hasattr(engine, "groups"):  # ZeRO: this rank's gradient shard
            engine.groups[0].grad_shard[0] = value
        else:
            next(p for p in engine.model.parameters() if p.grad is not None).grad.view(-1)[0] = value

    for step in range(BAD_STEP + 1):
        before = _state(engine, own=True)
        record = trainer.step(step, after_backward=poison)
    out["after"] = _state(engine, own=True)
    out["changed"] = not all(map(torch.equal, before, out["after"]))
    out["record"], out["norm"] = (record.nonfinite, record.skipped), engine.last_grad_norm
    engine.close()
    return out


def _stopped(strategy: str, clip: float, value: float, target: int) -> list[dict[str, Any]]:
    got = run_on_ranks(_stop_case, 2, strategy, clip, value, target, timeout_s=120)
    assert got[0]["record"] == got[1]["record"] and got[0]["record"][1] is False, got  # a stop, alike
    assert got[0]["record"][0].startswith("the gradient of "), got
    assert not got[target]["changed"]  # the rank that found the NaN never applies it
    return got


# under "stop" on a pipeline without clipping (Engine.updates_early) a rank whose own gradients are
# finite updates while the boundary's all-reduce is in flight, exactly as in a step with no NaN; the
# run stops on every rank all the same. With clipping, ZeRO or tensor parallelism alone no rank does.
@pytest.mark.parametrize("target", [0, 1])  # 0: the last stage (rank 1) updates early
def test_a_stopped_step_is_applied_only_by_pipeline_stages_whose_gradients_were_finite(target: int) -> None:
    clean = run_on_ranks(_stop_case, 2, "ddp-pp2", 0.0, None, target, timeout_s=120)
    other = 1 - target
    got = _stopped("ddp-pp2", 0.0, math.nan, target)
    assert got[other]["changed"] and all(map(torch.equal, got[other]["after"], clean[other]["after"]))
    assert not _stopped("ddp-pp2", 1.0, math.nan, target)[other]["changed"]  # clipping waits


@pytest.mark.parametrize("strategy", ["ddp-tp2", "zero1-pp2"])
def test_no_rank_updates_before_the_verdict_without_a_pipeline_or_with_zero(strategy: str) -> None:
    assert not any(rank["changed"] for rank in _stopped(strategy, 0.0, math.nan, 1))


def test_a_norm_that_overflows_on_one_rank_still_updates_every_rank_once() -> None:
    # finite gradients whose squared norm overflows: the exact check finds nothing, so each rank
    # updates (rank 0 early, rank 1 after the check), as in the same step unpoisoned on rank 0
    clean = run_on_ranks(_stop_case, 2, "ddp-pp2", 0.0, None, 1, timeout_s=120)
    got = run_on_ranks(_stop_case, 2, "ddp-pp2", 0.0, 1e30, 1, timeout_s=120)
    for rank in got:
        assert rank["record"] == (None, False) and rank["changed"] and rank["norm"] == math.inf, got
    assert all(map(torch.equal, got[0]["after"], clean[0]["after"]))


def _fp16_case(rank: int, world_size: int) -> dict[str, Any]:
    from dataclasses import replace

    from shardwise.train.loop import Trainer

    config = _config("zero2", "stop")
    trainer = Trainer.build(replace(config, zero=replace(config.zero, precision="fp16")))
    engine = trainer.engine

    def poison(step: int) -> None:
        if step >= 1:
            _poison_gradient(engine, rank)

    first = trainer.step(0)
    scale, skipped = engine.scaler.scale, engine.scaler.skipped_steps
    overflow = trainer.step(1, after_backward=poison)  # the scaler's: skip, halve the scale
    out = {"clean": first.nonfinite, "overflow": overflow.nonfinite}
    out["halved"] = engine.scaler.scale == scale / 2
    out["scaler_skipped"] = engine.scaler.skipped_steps - skipped
    engine.scaler.scale = engine.scaler.min_scale  # at the floor, an overflow is the run's to stop
    floor = trainer.step(2, after_backward=poison)
    out["floor"] = (floor.nonfinite, floor.skipped)
    engine.close()
    return out


def test_fp16_overflow_is_the_loss_scalers_until_its_floor() -> None:
    for got in run_on_ranks(_fp16_case, 2, timeout_s=120):
        assert got["clean"] is None and got["overflow"] is None  # no stop: skipped by the scaler
        assert got["halved"] and got["scaler_skipped"] == 1
        what, skipped = got["floor"]
        assert what is not None and what.startswith("the gradient of ") and not skipped


@pytest.mark.parametrize(("strategy", "nproc"), [("ddp", 1), ("zero2", 2), ("ps", 3)])
def test_a_diverging_run_stops_in_one_line_naming_the_step(tmp_path, strategy: str, nproc: int) -> None:
    run_dir = tmp_path / "run"
    result = shardwise(
        "train", "--strategy", strategy, "--nproc", str(nproc), "--preset", "tiny", "--optimizer", "sgd",
        "--lr", "1e12", "--steps", "5", "--eval-every", "0", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stdout.strip() == ""  # no summary of a run that diverged
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert errors[0].startswith("shardwise train: error: step 1: the loss"), errors[0]
    assert "--on-nonfinite skip" in errors[0]
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2  # step 0, then the step that stopped it


def test_skip_goes_on_and_counts_the_skipped_steps(tmp_path) -> None:
    result = shardwise(
        "train", "--preset", "tiny", "--optimizer", "sgd", "--lr", "1e12", "--steps", "4",
        "--eval-every", "0", "--run-dir", str(tmp_path), "--on-nonfinite", "skip", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    from .cli_helpers import last_json

    summary = last_json(result)
    assert summary["skipped_steps"] == 3 and summary["skipped_at"] == [1, 2, 3]
    assert "skipped the update of 3 of 4 steps" in result.stderr


def _hand_written_loop(rank: int, world_size: int) -> dict[str, Any]:
    """``Engine.train_step`` (a user's own loop over ``parallelize``) with a loss that is NaN on rank 1
    alone in step 1 (its gradient stays finite, so only the agreement can tell rank 0)."""
    import shardwise as sw
    from shardwise.engine.loss import CausalLMLoss
    from shardwise.models import build_model

    out: dict[str, Any] = {}
    for policy in ("skip", "stop"):
        config = _config("ddp", policy)
        calls = {"n": 0}
        inner = CausalLMLoss()

        def loss(outputs: Any, batch: Any, calls: dict = calls, inner: Any = inner) -> torch.Tensor:
            calls["n"] += 1
            summed = inner(outputs, {"input_ids": batch[0], "labels": batch[1]})
            bad = calls["n"] == 2 and rank == 1  # step 1's only micro-batch
            return summed + torch.tensor(float("nan") if bad else 0.0, dtype=summed.dtype)

        torch.manual_seed(0)
        engine = sw.parallelize(build_model(config.model), sw.build_mesh(config), config, loss=loss)
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
        batch = (tokens[:, :-1], tokens[:, 1:])
        losses, unchanged = [], None
        try:
            for step in range(3):
                before = _state(engine)
                losses.append(engine.train_step([batch]))
                if step == 1:
                    unchanged = all(map(torch.equal, before, _state(engine)))
        except sw.NonFiniteStop as stop:
            out[f"{policy}_stop"] = str(stop)
        out[policy] = {"losses": losses, "unchanged": unchanged}
        engine.close()
    return out


def test_the_hand_written_loop_agrees_on_non_finite_values_too() -> None:
    for got in run_on_ranks(_hand_written_loop, 2, timeout_s=180):
        skipped = got["skip"]
        assert skipped["unchanged"] is True  # neither rank applied step 1's update
        assert math.isfinite(skipped["losses"][0]) and math.isnan(skipped["losses"][1])
        assert math.isfinite(skipped["losses"][2]) and "skip_stop" not in got
        assert got["stop"]["losses"] == got["stop"]["losses"][:1]  # step 1 raised on every rank
        assert got["stop_stop"].startswith("step 1: the loss is not finite"), got["stop_stop"]
