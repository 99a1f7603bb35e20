"""Many ``shardwise verify`` command lines in one launched world, each against one process.

A case is the argument list ``shardwise verify`` takes (``--nproc`` included). ``verify_config`` reads
it through the CLI's own parser into the config verify would run (its defaults depend on the model and
strategy), then verify's preflight and comparability checks. ``check_cases`` runs every case of one
world size in one ``run_on_ranks`` world: each rank trains the cases in turn with ``collect_run``, as
verify's ranks train one (each case's communication is its layout's own, on the one process group the
harness starts). Each case's one-process reference is computed once in the test process and compared
with ``compare_runs``; the assertion names every case over the tolerance, and a case that raises on a
rank stops the world with its name in the traceback. A process launch costs seconds per case; a world
pays it once.
"""

from __future__ import annotations

from typing import Any

from shardwise.cli import build_parser, config_from_args, join_dashed_values
from shardwise.commands.verify import (
    LOCAL_NORM,
    TOLERANCE,
    VERIFY_DEFAULTS,
    check_comparable,
    collect_run,
    compare_runs,
    reference_run,
    verify_defaults,
)
from shardwise.config import TrainConfig, describe_layout
from shardwise.preflight import preflight
from shardwise.testing import run_on_ranks


def case_nproc(args: list[str]) -> int:
    """The ``--nproc`` of a case (every case names it: it picks the world the case runs in)."""
    nproc = build_parser().parse_args(join_dashed_values(["verify", *args])).nproc
    assert nproc is not None, f"a verify case names its --nproc: {args}"
    return int(nproc)


def world_sizes(cases: dict[str, list[str]]) -> list[int]:
    """The world sizes the cases need, smallest first (one world, so one test, each)."""
    return sorted({case_nproc(args) for args in cases.values()})


def verify_config(args: list[str]) -> tuple[TrainConfig, int]:
    """The config and rank count ``shardwise verify <args>`` runs: the CLI's parser and defaults, then
    ``run_verify``'s checks (a refusal raises its ``ConfigError`` here, as verify exits 2)."""
    parsed = build_parser().parse_args(join_dashed_values(["verify", *args]))
    first = config_from_args(parsed, VERIFY_DEFAULTS)
    config = config_from_args(parsed, verify_defaults(first.model.kind, first.strategy))
    nproc = case_nproc(args)
    config = preflight(config, nproc, writes_run_files=False)
    check_comparable(config)
    return config, nproc


def verify_world(rank: int, world_size: int, cases: dict[str, TrainConfig]) -> dict[str, Any]:
    """Every case in turn on this rank; a case that raises stops the world (the harness ends the other
    ranks at once) with its name in the traceback."""
    out: dict[str, Any] = {}
    for name, config in cases.items():
        try:
            out[name] = collect_run(config)
        except Exception as exc:
            raise RuntimeError(f"case {name} failed on rank {rank}: {exc}") from exc
    return out


def check_cases(
    cases: dict[str, list[str]], world: int, tol: float = TOLERANCE, timeout_s: float = 280
) -> dict[str, dict[str, Any]]:
    """Run the cases whose ``--nproc`` is ``world`` in one world; each report as verify's (``layout``
    and the measures of ``compare_runs``) by case. Asserts every one within ``tol``, naming those not."""
    configs = {name: verify_config(args)[0] for name, args in cases.items() if case_nproc(args) == world}
    assert configs, f"no case runs on {world} ranks"
    results = run_on_ranks(verify_world, world, configs, timeout_s=timeout_s)
    reports, failed = {}, {}
    for name, config in configs.items():
        candidate = next(r[name] for r in results if r[name] is not None)
        compare_norm = config.strategy not in LOCAL_NORM  # as run_verify compares
        report = compare_runs(reference_run(config), candidate, tol, compare_norm)
        reports[name] = {"layout": describe_layout(config, config.dims(world)), **report}
        worst = {k: report[k] for k in ("max_loss_diff", "max_grad_diff", "max_param_diff")}
        print(f"{name} ({world} ranks) vs one process: {worst}")
        if not report["ok"]:
            failed[name] = {k: report[k] for k in ("failed", *worst, "worst_grad", "worst_param")}
    assert not failed, f"cases over {tol}: {sorted(failed)}: {failed}"
    return reports
