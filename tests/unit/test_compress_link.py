"""``bench compress --link`` without processes: the training-time curve, time to target, the verdict,
and the schedule a longer row trains on (``optim.schedule_steps``)."""

from __future__ import annotations

import pytest

from shardwise.bench.compress_link import EvalPoint, _reach, _verdict, curve, read_metrics, time_to_target
from shardwise.config import ConfigError, OptimizerConfig, load_config
from shardwise.engine.schedule import lr_multiplier


def _rows(step_s: float, losses: dict[int, float], steps: int) -> list[dict[str, object]]:
    return [{"step": s, "step_s": step_s, "eval_loss": losses.get(s)} for s in range(steps)]


def test_curve_sums_step_times_up_to_each_evaluation() -> None:
    points = curve(_rows(0.5, {1: 3.0, 3: 2.0}, 4))
    assert points == [EvalPoint(1, 1.0, 3.0), EvalPoint(3, 2.0, 2.0)]


def test_time_to_target_is_the_first_evaluation_at_or_below_it() -> None:
    losses = {9: 3.0, 19: 2.5, 29: 2.4, 39: 2.6}
    points = [EvalPoint(step, (step + 1) / 10, loss) for step, loss in losses.items()]
    assert time_to_target(points, 2.5) == points[1]  # "at" counts, no interpolation
    assert time_to_target(points, 2.45) == points[2]
    assert time_to_target(points, 2.0) is None


def test_reach_and_verdict() -> None:
    base = {"label": "uncompressed", "evals": [[9, 2.0, 3.0], [19, 4.0, 2.5]]}
    fast = {"label": "int8", "evals": [[9, 1.0, 3.1], [19, 2.0, 2.6], [29, 3.0, 2.5]]}
    slow = {"label": "sign", "evals": [[9, 1.0, 3.1], [39, 4.0, 2.9]]}
    _reach(base, 2.5, None)
    assert (base["reached"], base["steps_to_target"], base["time_to_target_s"], base["time_ratio"]) == (
        True, 20, 4.0, 1.0,
    )  # fmt: skip
    for row in (fast, slow):
        _reach(row, 2.5, base["time_to_target_s"])
    assert (fast["steps_to_target"], fast["time_to_target_s"], fast["time_ratio"]) == (30, 3.0, 0.75)
    assert (slow["reached"], slow["time_to_target_s"], slow["time_ratio"]) == (False, None, None)
    verdict = _verdict(base, [fast, slow], 2.5)
    assert verdict["best"] == {"label": "int8", "time_ratio": 0.75}
    assert verdict["goal_met"] is False  # 0.75 > 0.7


def test_a_half_written_last_line_is_left_out(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "step_s": 0.1}\n{"step": 1, "st')
    assert read_metrics(path) == [{"step": 0, "step_s": 0.1}]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_a_longer_run_follows_the_shorter_schedule_then_stays_at_min_lr() -> None:
    optim = OptimizerConfig(lr_schedule="cosine", warmup_steps=2, min_lr=1e-4, lr=1e-3)
    short = lr_multiplier(optim, 10)
    longer = lr_multiplier(OptimizerConfig(**{**optim.__dict__, "schedule_steps": 10}), 20)
    assert [longer(s) for s in range(10)] == [short(s) for s in range(10)]
    assert [longer(s) for s in range(9, 20)] == pytest.approx([0.1] * 11)


def test_the_warm_up_must_fit_the_schedule() -> None:
    with pytest.raises(ConfigError, match=r"optim.schedule_steps\(4\)"):
        load_config(None, {"steps": "20", "optim.warmup_steps": "5", "optim.schedule_steps": "4"}).validate(1)


def test_without_namespaces_it_exits_2_in_one_line(monkeypatch, capsys) -> None:
    from shardwise import cli
    from shardwise.bench import netns

    monkeypatch.setattr(netns, "netns_unavailable", lambda: "creating network namespaces needs root")
    assert cli.main(["bench", "compress", "--link", "1gbit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "shardwise bench compress: error: --link: creating network namespaces needs root"


def test_a_bad_job_stops_before_any_namespace_is_made(monkeypatch) -> None:
    from shardwise.bench import compress_link

    monkeypatch.setattr(compress_link, "two_hosts", None)  # never reached
    with pytest.raises(ConfigError, match="warmup_steps"):
        compress_link.run_link_bench(steps=20)  # JOB's warm-up is 20 steps


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--seed", "1"], "--seed chooses a --link run's seed"),
        (["--rows", "fp16,bogus"], "no row named bogus"),
    ],
)
def test_a_setting_that_would_be_ignored_is_refused(argv: list[str], says: str, capsys) -> None:
    from shardwise import cli

    assert cli.main(["bench", "compress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


def test_the_link_rate_is_read_as_plan_reads_it_and_handed_to_tc_in_bits() -> None:
    """Case decides (``b`` bits, ``B`` bytes), as for ``plan --link``; tc gets bits, the one unit it
    reads as we do (tc's own ``gbps`` is gigabytes per second, ours a gigabit)."""
    from shardwise.bench.compress_link import tc_rate

    for one_gbit in ("1gbit", "1Gbit", "1Gb/s", "1gbps", "125MB/s", "125MBps"):
        assert tc_rate(one_gbit) == "1000000000bit", one_gbit
    assert tc_rate("200mbit") == "200000000bit"
    for wrong in ("1g", "-1gbit", "fast"):
        with pytest.raises(ConfigError, match="--link"):
            tc_rate(wrong)


def test_torchrun_command_passes_the_rendezvous_settings_as_one_flag() -> None:
    from shardwise.bench.netns import ADDR, Host, torchrun_command

    hosts = {h: Host(f"ns{h}", f"v{h}", addr) for h, addr in ADDR.items()}
    plain = torchrun_command("b", hosts, 29400, "job")
    assert plain[plain.index("--rdzv-conf") + 1] == "is_host=false"
    quick = torchrun_command("a", hosts, 29400, "job", rdzv_conf={"keep_alive_interval": "1"})
    assert quick.count("--rdzv-conf") == 1  # torchrun keeps the last one given
    assert quick[quick.index("--rdzv-conf") + 1] == "is_host=true,keep_alive_interval=1"
