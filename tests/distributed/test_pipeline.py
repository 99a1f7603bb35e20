"""Pipeline parallelism end to end: ``shardwise verify --pp ...``'s path against one process, float64.

Every schedule at pp 2 (four micro-batches; zb and zbv also with activation checkpointing), pp 4, one
micro-batch, fewer micro-batches than stages and empty ones, pp x dp with DDP and ZeRO-1/2/3 on the dp
axis, stage boundaries the user names, Hugging Face Llama and GPT-2; evaluation and the reported loss
under a pipeline equal one process's; checkpoints across layouts; refusals in one line. The split
schedules again for six steps, so the schedule fitted to the run (step 5) is held to it too.

The parity cases are the command lines ``shardwise verify`` takes, read by the CLI's own parser into the
configs it would run; those of one world size run in one launched world (``verify_worlds.check_cases``:
each rank trains every case in turn, as ``verify``'s ranks do), each case's one-process reference
computed once in the test process.
One case goes through the real ``shardwise verify`` command.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shardwise.config import load_config
from shardwise.models import build_model
from shardwise.pipeline.actions import fuse_schedule
from shardwise.pipeline.adapt import split_by_parity
from shardwise.pipeline.schedules import build
from shardwise.pipeline.split import plan_stages
from shardwise.testing import run_on_ranks

from .cli_helpers import last_json, refusal, shardwise
from .verify_worlds import check_cases, world_sizes

SHORT = ("--steps", "2")  # parity shows in two steps; the suite stays fast


def pp2(schedule: str, virtual: int = 1) -> list[str]:
    """The Must-show form: pp 2 on 2 ranks, four micro-batches."""
    args = ["--pp", "2", "--schedule", schedule, "--micro-batches", "4", "--nproc", "2"]
    return args + (["--virtual-stages", str(virtual)] if virtual > 1 else [])


CASES = {
    "pp2-gpipe": pp2("gpipe"),
    "pp2-1f1b": pp2("1f1b"),
    "pp2-zb": pp2("zb"),
    "pp2-zb-ac": [*pp2("zb"), "--activation-checkpointing"],
    "pp2-interleaved": pp2("interleaved", 2),
    "pp2-interleaved-zb": pp2("interleaved-zb", 2),
    "pp2-zbv": pp2("zbv", 2),
    "pp2-dualpipev": pp2("dualpipev", 2),
    "pp4-1f1b-m2": ["--pp", "4", "--schedule", "1f1b", "--micro-batches", "2", "--nproc", "4"],
    "pp2-m1": ["--pp", "2", "--micro-batches", "1", "--nproc", "2"],
    "dp2-pp2-ddp": ["--pp", "2", "--nproc", "4", "--strategy", "ddp", "--micro-batches", "4"],
    "dp2-pp2-zero1": ["--pp", "2", "--nproc", "4", "--strategy", "zero1", "--micro-batches", "4"],
    # dp shares of 5 and 1 rows cut into 5 micro-batches: four are empty on the second dp rank (more
    # micro-batches than the rank with the most rows has are refused: issue 27)
    "dp2-pp2-zero2-empty": [
        "--pp", "2", "--schedule", "interleaved-zb", "--virtual-stages", "2", "--micro-batches", "5",
        "--global-batch", "6", "--data-weights", "5,1", "--nproc", "4", "--strategy", "zero2",
    ],
    # ZeRO-3 on dp: units gathered per action (the zero-bubble W pass needs none: it reads the I pass's
    # kept inputs and gradients); gradients accumulated over micro-batches and reduce-scattered once.
    # zb: the tied head's copy on the other
    # rank; zbv: both ends on one rank, with activation checkpointing (gpipe, 1f1b, interleaved,
    # interleaved-zb and dualpipev were checked by hand)
    "dp2-pp2-zero3-zb": ["--pp", "2", "--nproc", "4", "--strategy", "zero3", "--schedule", "zb",
                         "--micro-batches", "4"],
    "dp2-pp2-zero3-zbv-ac": ["--pp", "2", "--nproc", "4", "--strategy", "zero3", "--schedule", "zbv",
                             "--virtual-stages", "2", "--micro-batches", "4", "--activation-checkpointing"],
    # stages cut where the user says: 2 blocks on the first, the other 6 on the second
    "pp2-named-split": [*pp2("1f1b"), "--pp-split", "blocks.2"],
    "pp2-llama": [*pp2("1f1b"), "--model", "hf:tiny-llama"],
    "pp2-gpt2-zb": [*pp2("zb"), "--model", "hf:tiny-gpt2"],
}  # fmt: skip


# past the fit (pipeline/fitting.py: steps 1-4 timed, the fitted schedule from step 5 on): every
# split schedule, with activation checkpointing, and on dp 2 x pp 2 under ZeRO-3, whose replicas must
# fit the same schedule
FITTED = ("--steps", "6")
FITTED_CASES = {
    "pp2-zb-fitted-ac": [*pp2("zb"), "--activation-checkpointing"],
    "pp2-interleaved-zb-fitted": pp2("interleaved-zb", 2),
    "pp2-zbv-fitted-ac": [*pp2("zbv", 2), "--activation-checkpointing"],
    "pp2-dualpipev-fitted": pp2("dualpipev", 2),
    "pp2-zb-as-built": [*pp2("zb"), "--set", "parallel.fit_schedule=false"],
    "dp2-pp2-zero3-zb-fitted": ["--pp", "2", "--nproc", "4", "--strategy", "zero3", "--schedule", "zb",
                                "--micro-batches", "4"],
}  # fmt: skip


TOL = 1e-10
# through the real command (its parser, preflight, launcher, report and exit code): the V schedule with
# activation checkpointing
CLI_CASE = [*pp2("zbv", 2), "--activation-checkpointing"]


WORLDS = world_sizes(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS, ids=[f"{n}-ranks" for n in WORLDS])
def test_verify_pipeline_equals_one_process(world: int) -> None:
    """Losses, gradient norms, learning rates, the first step's gradients, final parameters and
    buffers within 1e-10 of one process, for every case of this world size (each failing one named)."""
    cases = {name: [*args, *SHORT] for name, args in CASES.items()}
    cases |= {name: [*args, *FITTED] for name, args in FITTED_CASES.items()}
    check_cases(cases, world, TOL)


@pytest.mark.slow
def test_verify_command_of_a_pipeline_equals_one_process() -> None:
    result = shardwise("verify", *CLI_CASE, *SHORT, "--json", timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result)
    assert report["ok"] is True, report
    assert report["schedule"] == "zbv" and report["virtual_stages"] == 2 and report["micro_batches"] == 4
    assert report["max_param_diff"] <= TOL
    assert report["max_grad_diff"] <= TOL and report["max_loss_diff"] <= TOL


def _zero3_stage_traffic(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Two zb steps of pp 2 under ZeRO-3 (activation checkpointing on), watched from outside: which
    units are still gathered when each action ends, and how often each group is reduced."""
    from shardwise.config import load_config
    from shardwise.train.loop import Trainer
    from shardwise.zero.group import FlatGroup

    config = load_config(None, {
        "dtype": "float64", "steps": "2", "model.preset": "odd-deep", "data.global_batch": "8",
        "eval_every": "0", "run_dir": root, "strategy": "zero3", "parallel.pp": "2",
        "parallel.schedule": "zb", "data.micro_batches": "4", "parallel.activation_checkpointing": "true",
    })  # fmt: skip
    reduced: list[int] = []
    reduce_grads = FlatGroup.reduce_grads

    def counted(group: FlatGroup, release: bool) -> None:
        reduced.append(id(group))
        reduce_grads(group, release)

    FlatGroup.reduce_grads = counted  # type: ignore[method-assign]
    engine = (trainer := Trainer.build(config)).engine
    stage = engine.pipeline_stage
    units = [g for i, g in enumerate(engine.groups) if i != engine._root]  # type: ignore[attr-defined]
    at_end: dict[str, list[int]] = {"before release": [], "after": []}

    @contextmanager
    def watched(params: Any, input_grad_only: bool = False) -> Iterator[None]:
        with stage(params, input_grad_only):
            yield
            at_end["before release"].append(sum(g.materialized for g in units))
        at_end["after"].append(sum(g.materialized for g in units))

    engine.pipeline_stage = watched  # type: ignore[method-assign]
    runner, order = engine.runner, []  # the tied copy's gradient among the actions (copy's rank)
    run, post_gradient = runner._run, runner.tied.post_gradient
    runner._run = lambda engine, action, *rest: (order.append(str(action)), run(engine, action, *rest))[1]
    runner.tied.post_gradient = lambda: (order.append("gradient"), post_gradient())[1]
    for step in range(2):
        trainer.step(step)
    counts = {"groups": len(engine.groups), "units": len(units), "reduced": len(reduced)}
    return {**counts, **at_end, "order": order}


@pytest.mark.slow
def test_zero3_on_a_stage_releases_its_units_after_every_action_and_reduces_once_per_step(
    tmp_path: Path,
) -> None:
    """What parity cannot show: a stage's units are gathered only while an action uses them (an I
    pass, which gives no gradient to free them by, releases each as backward leaves it) and each
    group's gradients, summed over four micro-batches, are reduce-scattered once per step; and the
    tied embedding's copy sends its gradient before the last stage's trailing W passes."""
    for rank, out in enumerate(run_on_ranks(_zero3_stage_traffic, 2, str(tmp_path), timeout_s=300)):
        assert out["units"] >= 2, out
        assert out["reduced"] == 2 * out["groups"], (rank, out)  # two steps, each group once
        assert not any(out["after"]), (rank, out)  # nothing of the stage left gathered
        assert max(out["before release"]) <= 1, (rank, out)  # never the whole stage at once
    # the last stage's rank sends the tied copy's gradient once its last I made it whole, before the
    # W passes left at the step's end (as built: ... 1I3 1W2 1W3), not after them
    order = out["order"]  # rank 1's
    first = order[: order.index("gradient") + 1]
    assert first[-2:] == ["1I3", "gradient"] and order[len(first) : len(first) + 2] == ["1W2", "1W3"], order


@pytest.mark.slow
def test_train_pipeline_reports_the_loss_and_evaluates_as_one_process(tmp_path: Path) -> None:
    common = ["--preset", "tiny", "--steps", "3", "--eval-every", "2", "--json"]
    piped = shardwise("train", "--pp", "2", "--nproc", "2", "--run-dir", str(tmp_path / "pp"), *common)
    plain = shardwise("train", "--nproc", "1", "--run-dir", str(tmp_path / "one"), *common)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, b = last_json(piped), last_json(plain)
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-5)
    assert a["initial_loss"] == pytest.approx(b["initial_loss"], rel=1e-5)
    # the evaluation after an update: the last stage's copy of the tied head is refreshed first
    assert [loss for _, loss in a["eval_losses"]] == pytest.approx(
        [loss for _, loss in b["eval_losses"]], rel=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_bf16_pipeline_trains_as_one_process(tmp_path: Path, strategy: str) -> None:
    """Mixed precision across stages: under autocast (DDP) the residual stream crossing a boundary
    stays fp32, ZeRO-3's compute copies are bf16, and the last stage's copy of the tied embedding
    takes the owner's dtype (both crashed before: a buffer of the wrong size, a matmul of two
    dtypes). zb, 3 steps: the final loss as one process's, to bf16's rounding."""
    common = ["--precision", "bf16", "--preset", "tiny", "--steps", "3", "--eval-every", "0"]
    common += ["--micro-batches", "4", "--strategy", strategy, "--json"]
    piped = shardwise("train", "--pp", "2", "--schedule", "zb", "--nproc", "2", "--run-dir",
                      str(tmp_path / "pp"), *common)  # fmt: skip
    plain = shardwise("train", "--nproc", "1", "--run-dir", str(tmp_path / "one"), *common)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert last_json(piped)["final_loss"] == pytest.approx(last_json(plain)["final_loss"], rel=1e-3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "ps", "--servers", "1", "--nproc", "3"], "--strategy ps does not run with pipeline"),
        (
            ["--schedule", "interleaved", "--virtual-stages", "1"],  # left unset, it takes 2
            "interleaved interleaves chunks: --virtual-stages must be >= 2",
        ),
        (["--schedule", "zbv", "--virtual-stages", "3"], "zbv holds two stages per rank in a V"),
        (
            ["--pp", "4", "--nproc", "4", "--preset", "tiny"],
            "has 2 blocks, fewer than pp(4) x virtual_stages(1)",
        ),
        (["--precision", "fp16"], "precision = fp16 (each stage would decide an overflow alone)"),
        (["--pp-split", "blocks.1,blocks.2"], "parallel.pp_split names 2 boundaries, but 2 stages"),
    ],
)
def test_pipeline_refusals_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """Refused by the checks ``train`` runs before it starts any rank: ``cli.main`` in this process, as
    ``python -m shardwise`` runs it (exit 2, one line on stderr, no rank's pid file)."""
    argv = ["train", "--pp", "2", "--nproc", "2", "--steps", "1", *args]
    line = refusal(argv, tmp_path / "run", capsys)
    assert message in line, line


CKPT_COMMON = ["--preset", "tiny", "--dtype", "float64", "--eval-every", "0", "--json"]
PP2_DP2 = ["--pp", "2", "--nproc", "4"]


@pytest.fixture(scope="module")
def one_process_four_steps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What one process that never stopped ends with (every layout's resume is held to it)."""
    run_dir = tmp_path_factory.mktemp("one-process")
    plain = shardwise("train", "--nproc", "1", "--steps", "4", "--run-dir", str(run_dir), *CKPT_COMMON)
    assert plain.returncode == 0, plain.stderr[-3000:]
    return last_json(plain)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("save", "loads"),
    [
        ([*PP2_DP2, "--strategy", "zero1"], [["--nproc", "1"], ["--nproc", "4", "--strategy", "zero3"]]),
        (["--nproc", "1"], [[*PP2_DP2, "--strategy", "ddp"]]),
        ([*PP2_DP2, "--strategy", "zero3"], [["--nproc", "2", "--strategy", "ddp"]]),
    ],
    ids=["pp2-dp2-zero1-to-one-and-zero3-on-4", "one-to-pp2-dp2-ddp", "pp2-dp2-zero3-to-ddp-on-2"],
)
def test_a_pipeline_checkpoint_loads_in_any_layout(
    tmp_path: Path, save: list[str], loads: list[list[str]], one_process_four_steps: dict[str, Any]
) -> None:
    """Each stage writes its own parameters under the model's names (the tied weight once; ZeRO-3
    its shards of them): every other layout resumes from them and ends where one process that never
    stopped ends."""
    ckpt = tmp_path / "ckpt"
    every = ["--checkpoint-every", "2"]
    first = shardwise(
        "train", *save, "--steps", "2", *every, "--checkpoint-dir", str(ckpt), "--run-dir",
        str(tmp_path / "a"), *CKPT_COMMON,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    for i, load in enumerate(loads):
        mine = tmp_path / f"ckpt{i}"  # each resume writes its own step-4 checkpoint: start from a copy
        shutil.copytree(ckpt, mine)
        resumed = shardwise(
            "train", *load, "--steps", "4", *every, "--checkpoint-dir", str(mine), "--run-dir",
            str(tmp_path / f"b{i}"), *CKPT_COMMON,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resuming at step 2" in resumed.stderr, load
        a, b = last_json(resumed), one_process_four_steps
        assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-12, abs=0), load
        assert a["final_grad_norm"] == pytest.approx(b["final_grad_norm"], rel=1e-10, abs=0), load


@pytest.fixture(scope="module")
def zb_traced_six_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], list[dict]]:
    """``train --pp 2 --schedule zb --trace`` for six steps (the fit's steps and one past them): its
    stderr, its summary and its trace's events; every test of the trace reads this one run."""
    run_dir = tmp_path_factory.mktemp("zb-traced")
    args = ["--pp", "2", "--nproc", "2", "--steps", "6", "--preset", "tiny", "--micro-batches", "4"]
    result = shardwise("train", *args, "--schedule", "zb", "--trace", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return result.stderr, last_json(result), events


def _actions_by_step(events: list[dict]) -> dict[int, list[tuple[int, str]]]:
    """Each action span (rank, name) under the step it ran in: the last of its rank's step spans that
    began at or before it."""
    starts = [(e["pid"], e["ts"], int(e["name"].split()[1])) for e in events if e.get("cat") == "step"]
    by_step: dict[int, list[tuple[int, str]]] = {}
    for e in events:
        if "kind" in e.get("args", {}):
            began = [(t, s) for pid, t, s in starts if pid == e["pid"] and t <= e["ts"]]
            assert began, f"an action before its rank's first step: {e}"
            by_step.setdefault(max(began)[1], []).append((e["pid"], e["name"]))
    return by_step


@pytest.mark.slow
def test_trace_records_every_action_of_every_rank(zb_traced_six_steps: tuple[str, dict, list[dict]]) -> None:
    """One span per action (the run of six steps: each action falls within one of its rank's steps)."""
    by_step = _actions_by_step(zb_traced_six_steps[2])
    assert sorted(by_step) == list(range(6)), sorted(by_step)
    # the fit's first steps (pipeline/fitting.py): as built (the first stage's I and W one B), then
    # only the even micro-batches' backwards split, then only the odd ones'
    built = fuse_schedule(build("zb", 2, 1, 4))
    for step, schedule in enumerate([built, split_by_parity(built, 0), split_by_parity(built, 1)]):
        expected = [(rank, str(a)) for rank in (0, 1) for a in schedule[rank]]
        assert sorted(by_step[step]) == sorted(expected), step


def test_bench_pipeline_measures_both_sides_of_a_schedule() -> None:
    args = ["--schedules", "1f1b", "--steps", "6", "--rounds", "1", "--launches", "1", "--preset", "tiny"]
    args.append("--json")
    result = shardwise("bench", "pipeline", "--nproc", "2", *args, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = last_json(result)["rows"]
    assert row["schedule"] == "1f1b" and row["torch_class"] == "Schedule1F1B"
    for key in ("bubble_measured", "bubble_simulated", "bubble_theory", "speed_ratio"):
        assert isinstance(row[key], float) and row[key] >= 0, (key, row)
    # the profile's message costs, posted as the runtime posts them: posting is measured (0 unmeasured)
    assert row["profiled_ms"]["send"] > 0, row["profiled_ms"]
    # a message's transfer priced from the warm-up steps' waits, the profile relay's beside it
    assert isinstance(row["profiled_ms"]["transfer_relay"], float), row["profiled_ms"]


@pytest.mark.slow
def test_fit_schedule_false_runs_the_schedule_as_built(tmp_path: Path) -> None:
    """Without the fit every step runs zb as built (with it, step 1 would run fully fused)."""
    args = ["--pp", "2", "--nproc", "2", "--steps", "2", "--preset", "tiny", "--micro-batches", "4"]
    result = shardwise(
        "train", *args, "--schedule", "zb", "--set", "parallel.fit_schedule=false", "--trace",
        "--run-dir", str(tmp_path), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    actions = [(e["pid"], e["name"]) for e in events if "kind" in e.get("args", {})]
    built = fuse_schedule(build("zb", 2, 1, 4))
    assert sorted(actions) == sorted((rank, str(a)) for _ in range(2) for rank in (0, 1) for a in built[rank])
    assert "pipeline_fit" not in last_json(result)


@pytest.mark.slow
def test_a_fit_says_what_it_kept(zb_traced_six_steps: tuple[str, dict, list[dict]]) -> None:
    """One stderr line and ``pipeline_fit`` in the summary, which agree with the I actions that ran."""
    stderr, summary, events = zb_traced_six_steps
    # the cut that ran, in the summary: the planner's balanced one for the tiny preset at 2 stages
    tiny = build_model(load_config(None, {"model.preset": "tiny"}).model)
    assert summary["pipeline_stages"] == plan_stages(tiny, 2), summary["pipeline_stages"]
    assert summary["pipeline_placement"] == [0, 1]
    notes = [line for line in stderr.splitlines() if "fitted to this run's timings" in line]
    assert len(notes) == 1, stderr[-3000:]
    fit = summary["pipeline_fit"]["4"]
    assert fit["splits_built"] == 4
    kept = fit["splits_kept"]
    said = "all 4 backwards" if kept == 4 else f"{kept} of 4 backwards" if kept else "none of its 4"
    assert said in notes[0], notes[0]
    kinds = [e["args"]["kind"] for e in events if "kind" in e.get("args", {})]
    # steps 0-4: as built, fused, built, built, fused (4 I's each time as built); step 5: what was kept
    assert kinds.count("I") == 3 * 4 + fit["splits_kept"]
