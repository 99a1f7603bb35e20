"""Every pipeline schedule, ours against ``torch.distributed.pipelining``, and its bubble three ways.

For each schedule (``pipeline.schedules.SCHEDULES``) at ``pp = nproc``: the built-in GPT is split by
our ``pipeline.split`` into the schedule's stages, and the same stage modules run under our runtime
and under torch's ``PipelineStage`` + the schedule class torch 2.13 names for it (``zb`` has none in
torch and is compared with torch's ``Schedule1F1B``). Same model, seed, micro-batches, optimizer.
Both sides run in the same launch, in turns of ``pipeline_sides.BLOCK`` steps (``pipeline_sides``),
so each of our steps has a torch step near it in time; a round is ``launches`` launches. Each row:

- ``bubble_measured``: from our ranks' recorded action spans (the runtime's ``MONITOR.span`` per
  action): idle over total, ``1 - sum(busy) / (p * window)``, the window from the step's first action
  start to its last action end on any rank (``time.monotonic`` is one clock for every process of a
  machine); the median over the measured steps;
- ``bubble_simulated``: ``pipeline.simulate`` of the schedule our side ran in each launch (a split
  schedule is fitted to each launch's run first, ``pipeline/fitting.py``, so launches may differ; read
  off its last measured step's spans), the median over the launches, fed with a
  profile's costs (``pipeline_profile``: each rank's stages' F, B, I and W alone, all ranks at once, and
  what posting one activation takes its sender), measured in each paired launch between its steps and
  after them, in the same processes, the median over the launches; a message's transfer priced from the
  run's own warm-up steps (``pipeline_handoff``: the mean wait for one; the relay's median, kept as
  ``profiled_ms.transfer_relay``, missed their tail), and the runtime's own time between two of a
  rank's actions (``profiled_ms.gap``) from the same steps. Never from the steps it is compared with;
- ``bubble_theory``: the formula where the literature gives one (GPipe and 1F1B ``(p-1)/(m+p-1)``,
  Huang et al. 2019; interleaved ``(p-1)/(v*m+p-1)``, Narayanan et al. 2021; ZB-H1
  ``(p-1)(F+I-W)/(m(F+I+W)+(p-1)(F+I-W))`` with the profiled mean costs, 0 where W > F+I, Qi et
  al. 2023); else null;
- ``speed_ratio``: tokens/s ours / torch's: per round, over its launches' step pairs (step k of each
  side, a step's time its slowest rank's, within a turn of back-to-back steps: a rank's tail after
  its last action, which a loop of steps overlaps with the next step, weighs on a turn's last step
  only; a turn's first step, which follows another side's, is run and not timed, here or in the
  bubble), the trimmed geometric mean of their ratios (``pipeline_rows.paired_ratio``: the lowest
  and highest tenth of the log-ratios dropped); then the median over rounds, every round's in
  ``speed_ratio_rounds``; ``ours`` and ``torch`` give each side's step time (the trimmed mean of
  its measured steps over every launch, ``step_s_mean`` the plain mean) and the tokens/s that makes.

zb's launches run our 1F1B as a third side in the same turns (``pipeline_sides``), and where the
bench has both schedules the ``1f1b`` row is measured there, against the same torch steps (its
``launches_of`` says so; null on the other rows): the two rows' tokens/s then come from the same
launches (once torch's side has failed, our 1F1B runs in launches of its own after zb's, as ours
does: its row keeps its figures). Measured in
launches of their own, the machine's speed from one launch to the next weighed on their ratio:
torch's same ``Schedule1F1B`` ran 0.93-1.05x as fast in zb's launches as in 1f1b's over eight runs,
and the rows' ratio ranged 0.97-1.17 while the same launches' ranged 1.00-1.04. ``zb_over_1f1b``
compares the two: ``tokens_per_s`` the ratio of the rows' tokens/s; ``same_launch_tokens_per_s``
as a speed ratio is made, from their step pairs (step k of each, in the same round of turns) in
the paired launches; ``paired`` the ratio of their speed ratios, both against torch's
``Schedule1F1B``. With the rows in the same launches the three read one comparison three ways: the
first a ratio of trimmed means, the other two from step pairs.

Launches are interleaved across schedules: launch k of every schedule runs before launch k + 1 of
any, so a drift of the machine's speed over the bench's minutes weighs on every row alike; a round is
``launches`` consecutive launches of a schedule. ``conditions`` says how it was measured: rounds,
launches and steps, the load average before and after, and the spread of the rounds' ratios (the
largest (max - min) / median over the rows). The defaults (3 rounds of 5 launches of 40 steps) are
sized from one run's raw step times (14 launches of every schedule, 27 step pairs each, on the
2-core machine): a step pair's log-ratio swings by 0.15 (sd; lag-one correlation 0.14-0.33), and a
row's launch means by 0.036-0.055 where their pairs alone would give 0.027-0.033, so launches count
as well as steps. Two runs drawn from those launches (with replacement, 300-400 draws) were more
than 5% apart on some ratio in 77% of draws as the bench stood before (9 launches, each a round, of
the first 15 pairs, as 24 steps give; a round's ratio the median of its pairs), 9% with 9 launches
pooled by the trimmed mean, 20% as 3 rounds of 3, 5% as 3 rounds of 5. The medians keep a round
that went wrong from moving a row; the trimmed means use every pair but the stalls. The rows'
arithmetic is in ``bench/pipeline_rows.py``.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.bench.pipeline_handoff import with_warmup_prices
from shardwise.bench.pipeline_profile import PROFILE_REPEATS, costs_of, launch, median_costs, profile_costs
from shardwise.bench.pipeline_rows import (
    PLAIN_PEER,
    TORCH_PEER,
    Launches,
    conditions,
    round_ratios,
    row,
    schedule_of,
    simulated,
    steps_by_rank,
    virtual_for,
    zb_over_1f1b,
)
from shardwise.bench.pipeline_sides import BLOCK, WARMUP_STEPS, measured_steps, ours_worker, paired_worker
from shardwise.config import ConfigError, TrainConfig, load_config
from shardwise.observe.monitor import Span
from shardwise.pipeline.schedules import SCHEDULES, stage_placement
from shardwise.pipeline.simulate import Costs


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


def check_bench(
    names: Sequence[str], nproc: int, microbatches: int, preset: str, global_batch: int, steps: int,
    rounds: int, timeout_s: float, launches: int = 1,
) -> list[TrainConfig]:  # fmt: skip
    """Each schedule's job checked as ``shardwise train`` checks one (``preflight``: values, the
    schedule against the micro-batches, the preset's blocks against the stages) before any rank
    starts, so a bad input is one line here, not a rank's error wrapped in a failed launch."""
    from shardwise.preflight import preflight

    if not measured_steps(steps) or rounds < 1 or launches < 1 or not timeout_s > 0:
        fewest = next(k for k in range(WARMUP_STEPS + 1, WARMUP_STEPS + BLOCK + 2) if measured_steps(k))
        raise ConfigError(
            f"bench pipeline needs --steps >= {fewest} (the first {WARMUP_STEPS} warm up), --rounds >= 1, "
            f"--launches >= 1 and --timeout > 0; got {steps}, {rounds}, {launches}, {timeout_s:g}"
        )
    return [
        preflight(bench_config(name, nproc, microbatches, preset, global_batch, steps), nproc, False)
        for name in names
    ]


@dataclass
class Rounds:
    """One schedule's launches so far: ours and torch's (each a list of per-launch results by rank, or
    the string saying why that side has none) and each paired launch's stage profile."""

    config: TrainConfig
    torch_class: str
    plain: TrainConfig | None = None  # zb's: our 1F1B, run as a third side of its paired launches
    ours: Launches | str = field(default_factory=list)
    theirs: Launches | str = field(default_factory=list)
    profiles: list[Costs] = field(default_factory=list)
    # the third side's, one per launch: the paired launches' first (as many as ``profiles``), then,
    # once torch's side has failed, its own launches alone
    plains: Launches = field(default_factory=list)

    def run_one(self, nproc: int, timeout_s: float) -> None:
        """One more launch (``pipeline_sides.paired_worker``); once torch's side has hung or failed,
        ours alone (``ours_worker``), and the third side alone after it; once ours has failed, none."""
        if isinstance(self.ours, str):
            return
        if isinstance(self.theirs, str):
            results, problem = launch(ours_worker, nproc, (self.config,), timeout_s)
            self._plain_alone(nproc, timeout_s)
        else:
            args = (self.config, self.torch_class, self.plain)
            results, problem = launch(paired_worker, nproc, args, timeout_s)
            if results is None:
                sides = "ours, torch's and our 1f1b" if self.plain is not None else "ours and torch's"
                self.theirs = f"{problem} ({sides} in one launch)"
                results, problem = launch(ours_worker, nproc, (self.config,), timeout_s)
                self._plain_alone(nproc, timeout_s)
            else:
                self.theirs.append([r["torch"] for r in results])
                if self.plain is not None:
                    self.plains.append([r["plain"] for r in results])
                self.profiles.append(costs_of([r["profile"] for r in results]))
                results = [r["ours"] for r in results]
        if results is None:
            self.ours = str(problem)
        else:
            self.ours.append(results)

    def _plain_alone(self, nproc: int, timeout_s: float) -> None:
        """Once torch's side has failed: the third side in a launch of its own, so its row keeps its
        figures as ours does."""
        if self.plain is not None:
            results, _ = launch(ours_worker, nproc, (self.plain,), timeout_s)
            if results is not None:
                self.plains.append(results)

    def paired_plains(self) -> Launches:
        """The third side's launches that ran beside ours and torch's (the first ``len(profiles)``)."""
        return self.plains[: len(self.profiles)]

    def third_side(self) -> Rounds:
        """The third side's launches as its own schedule's (``plain``: our 1F1B in zb's), against the
        same torch steps and with the same launches' profiles (timed on zb's stage modules, whose
        linear layers go through the deferring ``linear``, unarmed for an F or B: the plain op behind
        one more Python call); where none ran it, the reason."""
        assert self.plain is not None
        ours: Launches | str = self.plains
        if not self.plains:
            why = self.theirs if isinstance(self.theirs, str) else "no launch ran it"
            ours = f"measured in the launches of {self.config.parallel.schedule}, which ran it in none: {why}"
        return Rounds(self.plain, self.torch_class, None, ours, self.theirs, self.profiles)


def run_pipeline_bench(
    nproc: int = 2,
    microbatches: int = 4,
    steps: int = 40,
    rounds: int = 3,
    preset: str = "small",
    launches: int = 5,
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
    shape = (nproc, microbatches, preset, global_batch, steps, rounds, timeout_s)
    configs = check_bench(names, *shape, launches)
    # zb's launches run our 1F1B as a third side where the bench has both, and the 1f1b row is
    # measured there (module docstring)
    both = [name for name in names if PLAIN_PEER.get(name) in names]
    plain = {name: configs[names.index(PLAIN_PEER[name])] for name in both}
    hosts = {PLAIN_PEER[name]: name for name in both}
    load_before = os.getloadavg()[0]
    runs = {
        name: Rounds(
            config, TORCH_PEER.get(name) or SCHEDULES[name].torch_class or "Schedule1F1B", plain.get(name)
        )
        for name, config in zip(names, configs, strict=True)
        if name not in hosts
    }
    for _ in range(rounds * launches):  # launch k of every schedule before launch k + 1 of any
        for run in runs.values():
            run.run_one(nproc, timeout_s)
    rows = []
    for name in names:
        run = runs[hosts[name]].third_side() if name in hosts else runs[name]
        tokens = global_batch * run.config.model.seq_len
        rows.append(_row_of(name, run, (nproc, microbatches, launches), tokens, timeout_s, trace_dir))
        rows[-1]["launches_of"] = hosts.get(name)
    return {
        "nproc": nproc,
        "preset": preset,
        "global_batch": global_batch,
        "microbatches": microbatches,
        "steps": steps,
        "warmup_steps": WARMUP_STEPS,
        "timed_steps": len(measured_steps(steps)),  # a launch's, each side's (pipeline_sides.measured_steps)
        "rounds": rounds,
        "launches_per_round": launches,
        "timeout_s": timeout_s,
        "conditions": conditions(rows, load_before, os.getloadavg()[0], launches),
        "zb_over_1f1b": zb_over_1f1b(rows, same_launch(runs.get("zb"), launches)),
        "rows": rows,
    }


def same_launch(run: Rounds | None, per_round: int = 1) -> float | None:
    """zb's tokens/s over our 1F1B's in the same launches (``plain``), as a row's speed ratio is
    made: each round's ``paired_ratio`` of the two (step k of each), the median over rounds; None
    where none ran both."""
    if run is None or isinstance(run.ours, str) or not run.paired_plains():
        return None  # ours alone once torch's side failed: the paired launches come first
    return statistics.median(round_ratios(run.ours, run.paired_plains(), per_round))


def _row_of(
    name: str, run: Rounds, shape: tuple[int, int, int], tokens: int, timeout_s: float,
    trace_dir: str | None,
) -> dict[str, Any]:  # fmt: skip
    """``name``'s row from its launches, the simulator fed with their profiles' median costs (and,
    with ``trace_dir``, its last measured step's trace beside the simulator's timeline); ``shape``:
    the pp ranks, the micro-batches and the launches per round."""
    nproc, microbatches, per_round = shape
    if run.profiles:  # each paired launch's own, after its steps: the median over them
        costs = median_costs(run.profiles)
    else:  # torch's side failed from the first round: a launch of the profile alone
        costs = profile_costs(run.config, nproc, repeats=PROFILE_REPEATS, timeout_s=timeout_s)
    relay, placement = costs.transfer, stage_placement(name, nproc, virtual_for(name))
    if not isinstance(run.ours, str):  # a message's and a gap's price from the run's own warm-up steps
        costs = with_warmup_prices(costs, steps_by_rank(run.ours, "warmup_spans"), placement)
    out = row(name, nproc, microbatches, tokens, run.ours, run.theirs, costs, per_round)
    out["profiled_ms"]["transfer_relay"] = round(1e3 * relay, 3)
    if trace_dir and not isinstance(run.ours, str):
        write_traces(Path(trace_dir) / name, steps_by_rank(run.ours)[-1], out, costs)
    return out


def write_traces(
    run_dir: Path, step: Mapping[int, Sequence[Span]], result_row: dict[str, Any], costs: Costs
) -> None:
    """``trace.json`` (one measured step, every rank) and ``simulated.json`` (the simulator's timeline
    of the schedule that step ran, from the profiled costs) in ``run_dir``: what ``shardwise plot
    timeline`` draws side by side."""
    from shardwise.observe.trace import rank_events

    name, pp = result_row["schedule"], result_row["pp"]
    origin = min(s.start for spans in step.values() for s in spans)
    end = max(s.start + s.duration for spans in step.values() for s in spans)
    events = []
    for rank, spans in sorted(step.items()):
        frame = [Span("step", "step", "step", origin, end - origin), *spans]
        events += rank_events(frame, rank, origin)
    timeline = simulated(schedule_of(step), name, pp, result_row["microbatches"], costs)  # as the row's
    predicted = [
        e for rank in sorted(timeline.slots) for e in rank_events(timeline.spans(rank, 1.0), rank, 0.0)
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    for file, body in (("trace.json", events), ("simulated.json", predicted)):
        (run_dir / file).write_text(json.dumps({"traceEvents": body, "displayTimeUnit": "ms"}))


def render_pipeline(result: dict[str, Any]) -> None:
    print(
        f"pipeline schedules, pp {result['nproc']}, preset {result['preset']}, "
        f"batch {result['global_batch']}, {result['microbatches']} micro-batches, "
        f"{result['rounds']} rounds of {result['launches_per_round']} launches of {result['steps']} steps"
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
    for r in result["rows"]:
        if r.get("launches_of"):
            print(
                f"  {r['schedule']} measured in {r['launches_of']}'s launches, against the same torch steps"
            )
    if gain := result.get("zb_over_1f1b"):
        said = [f"{gain['tokens_per_s']:.3f} in the rows' tokens/s"]
        if "same_launch_tokens_per_s" in gain:
            said.insert(0, f"{gain['same_launch_tokens_per_s']:.3f} in tokens/s in the same launches")
        if "paired" in gain:
            said.append(f"{gain['paired']:.3f} paired against torch's 1F1B")
        print(f"  zb over 1f1b: {', '.join(said)}")
    c = result["conditions"]
    spread = "-" if c["ratio_spread"] is None else f"{100 * c['ratio_spread']:.1f}%"
    print(
        f"  load average {c['load_average_before']:.2f} before, {c['load_average_after']:.2f} after; "
        f"largest spread of a row's round ratios {spread}"
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
