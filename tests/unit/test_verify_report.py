"""``shardwise verify``'s report: every measure printed, the failing ones named; diloco compared only
where one process can equal it (local SGD at H = 1), its rank-local gradient norm shown, not compared."""

from __future__ import annotations

import pytest

from shardwise.cli import main
from shardwise.commands.verify import _render, check_comparable, compare_runs, verify_defaults
from shardwise.config import ConfigError, load_config


def _run(losses: list[float], norms: list[float]) -> dict:
    return {
        "losses": losses,
        "grad_norms": norms,
        "lrs": [0.1, 0.1],
        "grads": {},
        "params": {},
        "buffers": {},
    }


RUN = {"layout": "dp2 x pp1 x tp1", "nproc": 2, "steps": 2, "dtype": "float64"}


def test_the_failing_measure_is_printed_even_when_it_is_the_gradient_norm(capsys) -> None:
    report = compare_runs(_run([1.0, 2.0], [3.0, 4.0]), _run([1.0, 2.0], [3.0, 4.5]), 1e-10)
    assert not report["ok"] and report["failed"] == ["grad norm"]
    _render({**report, "strategy": "ddp", **RUN})
    out = capsys.readouterr().out
    assert out.startswith("FAILED (grad norm over the tolerance): ddp on 2 ranks")
    assert "max grad norm diff 5.000e-01  <- over" in out
    assert "max loss diff      0.000e+00\n" in out  # the others printed too, unmarked


def test_diloco_gradient_norm_is_shown_not_compared(capsys) -> None:
    report = compare_runs(
        _run([1.0, 2.0], [3.0, 4.0]), _run([1.0, 2.0], [3.0, 4.5]), 1e-10, compare_norm=False
    )
    assert report["ok"] and "grad norm" not in report["compared"]
    _render({**report, "strategy": "diloco", **RUN})
    out = capsys.readouterr().out
    assert out.startswith("OK: diloco")
    assert "max grad norm diff 5.000e-01  (not compared: diloco clips each rank's own norm" in out


def test_diloco_is_verified_as_local_sgd_at_h1_and_other_settings_are_refused() -> None:
    config = load_config(None, {**verify_defaults("gpt", "diloco"), "strategy": "diloco"})
    check_comparable(config)  # the defaults: H = 1, outer SGD lr 1 without momentum, inner SGD
    assert (config.diloco.sync_every, config.diloco.outer_lr, config.optim.name) == (1, 1.0, "sgd")
    paper = load_config(
        None, {**verify_defaults("gpt", "diloco"), "strategy": "diloco", "diloco.sync_every": "4"}
    )
    with pytest.raises(ConfigError, match=r"got diloco.sync_every = 4 \(not 1\)\. Drop those settings"):
        check_comparable(paper)
    # every step before start_local_step is plain averaging: equal whatever H says
    averaged = load_config(
        None, {**verify_defaults("gpt", "diloco"), "strategy": "diloco", "diloco.sync_every": "4",
               "diloco.start_local_step": "5"}
    )  # fmt: skip
    check_comparable(averaged)
    adamw = load_config(
        None, {**verify_defaults("gpt", "diloco"), "strategy": "diloco", "optim.name": "adamw"}
    )
    with pytest.raises(ConfigError, match=r"optim.name = 'adamw' \(not sgd\)"):
        check_comparable(adamw)


def test_verify_diloco_with_h4_is_one_line_exit_2(tmp_path, capsys) -> None:
    code = main(["verify", "--strategy", "diloco", "--sync-every", "4", "--preset", "tiny", "--steps", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("shardwise verify: error: verify compares diloco with one process only where")


def test_verify_runs_a_split_schedule_past_its_fit() -> None:
    """The fitted schedule (the one training keeps) runs from step FIT_STEPS on: verify reaches it."""
    from shardwise.pipeline.fitting import FIT_STEPS

    assert verify_defaults("gpt", "ddp", "zb")["steps"] == str(FIT_STEPS + 2)
    assert verify_defaults("gpt", "ddp", "dualpipev")["steps"] == str(FIT_STEPS + 2)
    assert verify_defaults("gpt", "ddp", "1f1b")["steps"] == verify_defaults("gpt")["steps"] == "5"
    assert verify_defaults("gpt", "ddp", "nope")["steps"] == "5"  # refused later, by the config's check
