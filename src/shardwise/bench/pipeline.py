"""Every pipeline schedule, ours against ``torch.distributed.pipelining``, and its bubble three ways.

For each schedule (``pipeline.schedules.SCHEDULES``) at ``pp = nproc``: the built-in GPT is split by
our ``pipeline.split`` into the schedule's stages, and the same stage modules run under our runtime
and under torch's ``PipelineStage`` + the schedule class torch 2.13 names for it (``zb`` has none in
torch and is compared with torch's ``Schedule1F1B``). Same model, seed, micro-batches, optimizer.
Both sides run in the same launch, their steps alternating (``pipeline_sides``), so each of our steps
has a torch step beside it in time; a round is one launch. Each row:

- ``bubble_measured``: from our ranks' recorded action spans (the runtime's ``MONITOR.span`` per
  action): idle over total, ``1 - sum(busy) / (p * window)``, the window from the step's first action
  start to its last action end on any rank (``time.monotonic`` is one clock for every process of a
  machine); the median over the measured steps;
- ``bubble_simulated``: ``pipeline.simulate`` of the schedule our side ran (a split schedule is fitted
  to the run first, ``pipeline/fitting.py``; read off the last measured step's spans), fed with a
  profile's costs (``pipeline_profile``: each rank's stages' F, B, I and W alone, all ranks at once,
  and what posting one activation takes its sender), measured in each paired launch after its steps,
  in the same processes, the median over the launches; a message's transfer priced from the run's
  own warm-up steps (``pipeline_handoff``: the mean wait for one; the relay's median, kept as
  ``profiled_ms.transfer_relay``, missed their tail). Never from the steps it is compared with;
- ``bubble_theory``: the formula where the literature gives one (GPipe and 1F1B ``(p-1)/(m+p-1)``,
  Huang et al. 2019; interleaved ``(p-1)/(v*m+p-1)``, Narayanan et al. 2021; ZB-H1
  ``(p-1)(F+I-W)/(m(F+I+W)+(p-1)(F+I-W))`` with the profiled mean costs, 0 where W > F+I, Qi et
  al. 2023); else null;
- ``speed_ratio``: tokens/s ours / torch's: per round the median over its steps of each pair's ratio
  (the two steps ran back to back, a step's time its slowest rank's), then the median over rounds,
  every round's in ``speed_ratio_rounds``; ``ours`` and ``torch`` give each side's median step time
  over its launches.

``conditions`` says how it was measured: rounds and steps, the load average before and after, and the
spread of the rounds' ratios (the largest (max - min) / median over the rows). The defaults (40 steps,
3 rounds) are meant to make two runs agree within 5% on every ratio (two runs here: within 2.7%).

torch's pipelining has hung on gloo (pytorch#132644), so every launch is a group of fresh processes
with a deadline (``run_on_ranks``); one that hangs or fails makes that row's ``"torch"`` the reason
(``"timeout after N s ..."``) and ours runs alone from then on, never a hung benchmark.
Communication: whatever each side does; ours point-to-point through ``Comm`` over the pp axis.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardwise.bench.pipeline_handoff import with_warmup_transfer
from shardwise.bench.pipeline_profile import PROFILE_REPEATS, costs_of, launch, median_costs, profile_costs
from shardwise.bench.pipeline_sides import ACTION_LANE, WARMUP_STEPS, ours_worker, paired_worker
from shardwise.config import ConfigError, TrainConfig, load_config
from shardwise.observe.monitor import Span
from shardwise.observe.trace import idle_fraction
from shardwise.pipeline.schedules import SCHEDULES, build, stage_placement
from shardwise.pipeline.simulate import Costs, simulate
from shardwise.pipeline.validate import ScheduleError

TORCH_PEER = {"zb": "Schedule1F1B"}  # torch has no ZB-H1: our zb is measured against its 1F1B


def virtual_for(name: str) -> int:
    """Stages per rank each schedule runs with here: 1, or 2 for interleaved and V schedules."""
    return 1 if SCHEDULES[name].virtual == "1" else 2


def bench_config(
    name: str, nproc: int, microbatches: int, preset: str, global_batch: int, steps: int
) -> TrainConfig:
    return load_config(
        None,
        {
            "model.preset": preset,
            "parallel.pp": nproc,
            "parallel.schedule": name,
            "parallel.virtual_stages": virtual_for(name),
            "data.micro_batches": microbatches,
            "data.global_batch": global_batch,
            "strategy": "ddp",
            "steps": steps,
        },
    )


# ------------------------------------------------------------------------------- bubble arithmetic


def bubble_from_spans(spans: Mapping[int, Sequence[Span]]) -> float:
    """Idle over total of one step from each rank's action spans (``observe.trace.idle_fraction``):
    ``1 - sum(busy) / (p * window)``, the window from the first action's start to the last action's
    end on any rank, as the simulator's runs from 0 to its makespan."""
    return idle_fraction({rank: [(s.start, s.duration) for s in mine] for rank, mine in spans.items()})


def theory(name: str, pp: int, virtual: int, microbatches: int, costs: Costs) -> tuple[float | None, str]:
    """The bubble formula of ``name`` (its value, and the formula in words), or None where none is
    known; costs enter only the zero-bubble formula (means over stages)."""
    p, m, v = pp, microbatches, virtual
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    if name == "zb" and m >= p:
        f, i, w = (_mean(c) for c in (costs.forward, costs.input_grad, costs.weight_grad))
        # the formula holds for W <= F + I; past that (the first stage's I is empty, so its W is its
        # whole backward) the cool-down is filled and the formula's bubble is 0
        ramp = max(0.0, (p - 1) * (f + i - w))
        return ramp / (m * (f + i + w) + ramp), "max(0,(p-1)(F+I-W))/(m(F+I+W)+max(0,(p-1)(F+I-W)))"
    return None, "no closed form used here; see bubble_simulated"


def _ran(ours: Launches | str) -> dict[int, list[Any]] | None:
    """The schedule our side ran in its last measured step (a split schedule is fitted to the run:
    ``pipeline/fitting.py``), read off its action spans; None without spans."""
    from shardwise.pipeline.actions import parse_action

    if isinstance(ours, str) or not ours:
        return None
    steps = _steps_by_rank(ours)
    if not steps or not all(steps[-1].values()):
        return None
    return {
        r: [parse_action(s.name) for s in sorted(spans, key=lambda s: s.start)]
        for r, spans in steps[-1].items()
    }


def _as_run(name: str, pp: int, virtual: int, microbatches: int) -> dict[int, list[Any]]:
    """The schedule as the runtime runs it: the first stage's I and W back to back as one B."""
    from shardwise.pipeline.actions import fuse_schedule

    return fuse_schedule(build(name, pp, virtual, microbatches))


def _mean(value: float | tuple[float, ...]) -> float:
    return statistics.fmean(value) if isinstance(value, tuple) else float(value)


# ------------------------------------------------------------------------------------- the rows


def row(
    name: str, pp: int, microbatches: int, tokens: int, ours: Launches | str, torch_side: Launches | str,
    costs: Costs,
) -> dict[str, Any]:  # fmt: skip
    """One schedule's row from each side's launches (a list of per-launch results by rank) or the
    string saying why that side has none (``"timeout after N s"``)."""
    virtual = virtual_for(name)
    spec = SCHEDULES[name]
    placement = stage_placement(name, pp, virtual)
    try:
        timeline = simulate(_ran(ours) or _as_run(name, pp, virtual, microbatches), placement, costs)
    except ScheduleError:  # the spans do not make a whole schedule (a rank that recorded none)
        timeline = simulate(_as_run(name, pp, virtual, microbatches), placement, costs)
    value, formula = theory(name, pp, virtual, microbatches, costs)
    out: dict[str, Any] = {
        "schedule": name,
        "torch_class": TORCH_PEER.get(name, spec.torch_class),
        "pp": pp,
        "virtual_stages": virtual,
        "microbatches": microbatches,
        "bubble_measured": None,
        "bubble_simulated": timeline.bubble,
        "bubble_theory": value,
        "theory_formula": formula,
        "speed_ratio": None,
        "profiled_ms": _profiled_ms(costs),
    }
    out["ours"], out["torch"] = _side(ours, tokens), _side(torch_side, tokens)
    if not isinstance(ours, str):
        steps = [bubble_from_spans(spans) for spans in _steps_by_rank(ours)]
        out["bubble_measured"] = statistics.median(steps)
    if not isinstance(ours, str) and not isinstance(torch_side, str) and ours and torch_side:
        rounds = [_paired_ratio(o, t) for o, t in zip(ours, torch_side, strict=False)]
        out["speed_ratio"] = statistics.median(rounds)
        out["speed_ratio_rounds"] = rounds
    return out


def _profiled_ms(costs: Costs) -> dict[str, Any]:
    """The simulator's costs in ms: per kind, per stage (the profile's); one activation's post (the
    profile's) and its transfer (priced from the warm-up steps where they waited for one)."""
    out: dict[str, Any] = {"transfer": round(1e3 * costs.transfer, 3), "send": round(1e3 * costs.send, 3)}
    kinds = (costs.forward, costs.backward, costs.input_grad, costs.weight_grad)
    for kind, value in zip("FBIW", kinds, strict=True):
        out[kind] = [round(1e3 * c, 3) for c in value] if isinstance(value, tuple) else round(1e3 * value, 3)
    return out


Launches = list[list[dict[str, Any]]]  # per launch, each rank's result


def _launch_steps(launches: Launches) -> list[float]:
    """Each launch's step time: its slowest rank's median."""
    return [max(statistics.median(r["step_s"]) for r in ranks) for ranks in launches]


def _paired_ratio(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float:
    """One launch's ratio, torch's step time over ours: the median over its steps of each pair's
    (step k of each side ran back to back; a step's time is its slowest rank's)."""
    ours_k, theirs_k = (
        [max(ks) for ks in zip(*(r["step_s"] for r in side), strict=False)] for side in (ours, theirs)
    )
    return statistics.median(t / o for o, t in zip(ours_k, theirs_k, strict=False))


def _side(launches: Launches | str, tokens: int) -> dict[str, Any] | str:
    if isinstance(launches, str):
        return launches
    per_launch = _launch_steps(launches)
    step_s = statistics.median(per_launch)
    return {"tokens_per_s": tokens / step_s, "step_s": step_s, "launches": len(per_launch)}


def conditions(rows: Sequence[dict[str, Any]], load_before: float, load_after: float) -> dict[str, Any]:
    """How the rows were measured, and how far the rounds' ratios spread (see the module docstring)."""
    spreads = [
        (max(r["speed_ratio_rounds"]) - min(r["speed_ratio_rounds"])) / r["speed_ratio"]
        for r in rows
        if r.get("speed_ratio_rounds")
    ]
    return {
        "load_average_before": load_before,
        "load_average_after": load_after,
        "cpus": os.cpu_count(),
        "ratio_spread": max(spreads, default=None),
        "note": "medians of interleaved rounds; ratio_spread: the largest (max - min) / median of a row's "
        "per-round speed ratios",
    }


def _steps_by_rank(launches: Launches, key: str = "spans") -> list[dict[int, list[Span]]]:
    """Every measured step (``key="warmup_spans"``: warm-up step) of every launch as ``{rank: [Span]}``."""
    out = []
    for ranks in launches:
        for step in range(min(len(res.get(key, [])) for res in ranks)):
            out.append(
                {
                    r: [Span(n, "compute", ACTION_LANE, s, d, a) for n, s, d, a in res[key][step]]
                    for r, res in enumerate(ranks)
                }
            )
    return out


def check_bench(
    names: Sequence[str], nproc: int, microbatches: int, preset: str, global_batch: int, steps: int,
    rounds: int, timeout_s: float,
) -> list[TrainConfig]:  # fmt: skip
    """Each schedule's job checked as ``shardwise train`` checks one (``preflight``: values, the
    schedule against the micro-batches, the preset's blocks against the stages) before any rank
    starts, so a bad input is one line here, not a rank's error wrapped in a failed launch."""
    from shardwise.preflight import preflight

    if steps <= WARMUP_STEPS or rounds < 1 or not timeout_s > 0:
        raise ConfigError(
            f"bench pipeline needs --steps > {WARMUP_STEPS} (the first {WARMUP_STEPS} warm up), "
            f"--rounds >= 1 and --timeout > 0; got {steps}, {rounds}, {timeout_s:g}"
        )
    return [
        preflight(bench_config(name, nproc, microbatches, preset, global_batch, steps), nproc, False)
        for name in names
    ]


def run_rounds(
    config: TrainConfig, nproc: int, torch_class: str, rounds: int, timeout_s: float
) -> tuple[Launches | str, Launches | str, list[Costs]]:
    """Each side's launches (``pipeline_sides.paired_worker``, one per round), or why it has none,
    and each paired launch's stage profile; once torch's side hangs or fails, ours runs alone
    (``ours_worker``) for the rounds left."""
    ours: Launches = []
    theirs: Launches | str = []
    profiles: list[Costs] = []
    for _ in range(rounds):
        if isinstance(theirs, str):
            results, problem = launch(ours_worker, nproc, (config,), timeout_s)
        else:
            results, problem = launch(paired_worker, nproc, (config, torch_class), timeout_s)
            if results is None:
                theirs = f"{problem} (ours and torch's in one launch)"
                results, problem = launch(ours_worker, nproc, (config,), timeout_s)
            else:
                theirs.append([r["torch"] for r in results])
                profiles.append(costs_of([r["profile"] for r in results]))
                results = [r["ours"] for r in results]
        if results is None:
            return str(problem), theirs, profiles
        ours.append(results)
    return ours, theirs, profiles


def run_pipeline_bench(
    nproc: int = 2,
    microbatches: int = 4,
    steps: int = 40,
    rounds: int = 3,
    preset: str = "small",
    global_batch: int = 8,
    schedules: Sequence[str] | None = None,
    timeout_s: float = 120.0,
    trace_dir: str | None = None,
) -> dict[str, Any]:
    """Every schedule's row (see the module docstring)."""
    if nproc < 2:
        raise ConfigError(
            f"bench pipeline runs one pipeline rank per process: --nproc must be >= 2, got {nproc}"
        )
    names = list(schedules or SCHEDULES)
    if unknown := [n for n in names if n not in SCHEDULES]:
        raise ConfigError(
            f"unknown schedule {unknown[0]!r} in --schedules: choose from {', '.join(SCHEDULES)}"
        )
    configs = check_bench(names, nproc, microbatches, preset, global_batch, steps, rounds, timeout_s)
    load_before = os.getloadavg()[0]
    rows = []
    for name, config in zip(names, configs, strict=True):
        torch_class = TORCH_PEER.get(name) or SCHEDULES[name].torch_class or "Schedule1F1B"
        ours, theirs, profiles = run_rounds(config, nproc, torch_class, rounds, timeout_s)
        if profiles:  # each paired launch's own, after its steps: the median over them
            costs = median_costs(profiles)
        else:  # torch's side failed from the first round: a launch of the profile alone
            costs = profile_costs(config, nproc, repeats=PROFILE_REPEATS, timeout_s=timeout_s)
        relay, placement = costs.transfer, stage_placement(name, nproc, virtual_for(name))
        if not isinstance(ours, str):  # a message's price from the run's own warm-up steps
            costs = with_warmup_transfer(costs, _steps_by_rank(ours, "warmup_spans"), placement)
        tokens = global_batch * config.model.seq_len
        rows.append(row(name, nproc, microbatches, tokens, ours, theirs, costs))
        rows[-1]["profiled_ms"]["transfer_relay"] = round(1e3 * relay, 3)
        if trace_dir and not isinstance(ours, str):
            write_traces(Path(trace_dir) / name, _steps_by_rank(ours)[-1], rows[-1], costs)
    return {
        "nproc": nproc,
        "preset": preset,
        "global_batch": global_batch,
        "microbatches": microbatches,
        "steps": steps,
        "warmup_steps": WARMUP_STEPS,
        "rounds": rounds,
        "timeout_s": timeout_s,
        "conditions": conditions(rows, load_before, os.getloadavg()[0]),
        "rows": rows,
    }


def write_traces(
    run_dir: Path, step: Mapping[int, Sequence[Span]], result_row: dict[str, Any], costs: Costs
) -> None:
    """``trace.json`` (one measured step, every rank) and ``simulated.json`` (the simulator's timeline
    from the profiled costs) in ``run_dir``: what ``shardwise plot timeline`` draws side by side."""
    from shardwise.observe.trace import rank_events

    name, pp, virtual = result_row["schedule"], result_row["pp"], result_row["virtual_stages"]
    origin = min(s.start for spans in step.values() for s in spans)
    end = max(s.start + s.duration for spans in step.values() for s in spans)
    events = []
    for rank, spans in sorted(step.items()):
        frame = [Span("step", "step", "step", origin, end - origin), *spans]
        events += rank_events(frame, rank, origin)
    timeline = simulate(
        _as_run(name, pp, virtual, result_row["microbatches"]), stage_placement(name, pp, virtual), costs
    )
    simulated = [
        e for rank in sorted(timeline.slots) for e in rank_events(timeline.spans(rank, 1.0), rank, 0.0)
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    for file, body in (("trace.json", events), ("simulated.json", simulated)):
        (run_dir / file).write_text(json.dumps({"traceEvents": body, "displayTimeUnit": "ms"}))


def render_pipeline(result: dict[str, Any]) -> None:
    print(
        f"pipeline schedules, pp {result['nproc']}, preset {result['preset']}, "
        f"batch {result['global_batch']}, {result['microbatches']} micro-batches, "
        f"{result['steps']} steps x {result['rounds']} rounds"
    )
    print(f"  {'schedule':15s} {'measured':>9s} {'simulated':>9s} {'theory':>7s} {'ours tok/s':>11s}  torch")
    for r in result["rows"]:
        ours = f"{r['ours']['tokens_per_s']:,.0f}" if isinstance(r["ours"], dict) else str(r["ours"])
        torch_side = r["torch"]
        theirs = f"{torch_side['tokens_per_s']:,.0f} tok/s" if isinstance(torch_side, dict) else torch_side
        ratio = ""
        if r["speed_ratio"] is not None:
            rounds = r["speed_ratio_rounds"]
            ratio = f"  ratio {r['speed_ratio']:.2f} (rounds {min(rounds):.2f}-{max(rounds):.2f})"
        bubbles = [_pct(r[k]) for k in ("bubble_measured", "bubble_simulated", "bubble_theory")]
        cells = f"{bubbles[0]:>9s} {bubbles[1]:>9s} {bubbles[2]:>7s} {ours:>11s}"
        print(f"  {r['schedule']:15s} {cells}  {theirs}{ratio}")
    c = result["conditions"]
    spread = "-" if c["ratio_spread"] is None else f"{100 * c['ratio_spread']:.1f}%"
    print(
        f"  load average {c['load_average_before']:.2f} before, {c['load_average_after']:.2f} after; "
        f"largest spread of a row's round ratios {spread}"
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
