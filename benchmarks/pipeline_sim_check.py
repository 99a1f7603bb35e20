"""Does the runtime reach the simulator's timeline? Each step simulated with its own action times.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_sim_check.py [schedule ...] [--out FILE]

For each schedule, ``bench pipeline``'s configuration (the small preset, pp 2 on 2 ranks, 4
micro-batches, 8 rows): its stage profile's message costs (``pipeline_profile``: what posting one
activation takes its sender, and its transfer), then our runtime alone for ``STEPS`` steps with every
action's span recorded. Each measured step is simulated (``pipeline.simulate``) with the actions it
ran, each costing what it took in that step, priced three ways: with the profile's send and transfer
(the relay's; the bench now prices the transfer from the warm-up steps, ``bench/pipeline_handoff.py``),
with its transfer alone (no sender's cost), and with neither. What is left
between a step's measured bubble and its simulation is what the simulator is not given here (the
runtime's own work between actions, ``Costs.gap``, which the bench prices from its warm-up steps;
waits longer than a message's price), not the costs. Medians
over the steps (the bench's own worker, ``pipeline_sides.ours_worker``, runs them); writes
``benchmarks/results/pipeline-sim-check.json``. Communication: the runtime's
own (point-to-point over pp, the step's all-reduces), observed only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.bench.pipeline import bench_config
from shardwise.bench.pipeline_profile import PROFILE_REPEATS, profile_costs
from shardwise.bench.pipeline_rows import bubble_from_spans, steps_by_rank, virtual_for
from shardwise.bench.pipeline_sides import WARMUP_STEPS, ours_worker
from shardwise.pipeline.actions import Action, parse_action
from shardwise.pipeline.schedules import SCHEDULES, stage_placement
from shardwise.pipeline.simulate import Costs, simulate
from shardwise.testing import run_on_ranks

STEPS = 23  # the first WARMUP_STEPS warm up (a split schedule is fitted in them)


@dataclass(frozen=True)
class StepTimes(Costs):
    """Each action costs what it took in one measured step."""

    times: Mapping[Action, float] = field(default_factory=dict)

    def of(self, action: Action) -> float:
        return self.times[action]


def check(name: str) -> dict[str, Any]:
    """One schedule's medians (module docstring), in the bench's units (fractions of the step)."""
    config = bench_config(name, 2, 4, "small", 8, STEPS)
    costs = profile_costs(config, 2, PROFILE_REPEATS, timeout_s=300)
    ranks = run_on_ranks(ours_worker, 2, config, timeout_s=300)  # the bench's own side, alone
    placement = stage_placement(name, 2, virtual_for(name))
    prices = {
        "send_and_transfer": (costs.send, costs.transfer),
        "transfer_only": (0.0, costs.transfer),
        "free": (0.0, 0.0),
    }
    rows: dict[str, list[float]] = {"measured": [], **{k: [] for k in prices}}
    for spans in steps_by_rank([ranks]):
        rows["measured"].append(bubble_from_spans(spans))
        schedule = {r: [parse_action(s.name) for s in mine] for r, mine in spans.items()}
        times = {parse_action(s.name): s.duration for mine in spans.values() for s in mine}
        for label, (send, transfer) in prices.items():
            priced = StepTimes(times=times, send=send, transfer=transfer)
            rows[label].append(simulate(schedule, placement, priced).bubble)
    medians = {k: round(statistics.median(v), 4) for k, v in rows.items()}
    return {"schedule": name, "send_ms": round(1e3 * costs.send, 3),
            "transfer_ms": round(1e3 * costs.transfer, 3), "bubble": medians}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedules", nargs="*", help=f"default: every one of {', '.join(SCHEDULES)}")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline-sim-check.json"))
    args = parser.parse_args()
    if unknown := [n for n in args.schedules if n not in SCHEDULES]:
        parser.error(f"unknown schedule {unknown[0]!r}: choose from {', '.join(SCHEDULES)}")
    before = os.getloadavg()[0]
    rows = [check(name) for name in args.schedules or SCHEDULES]
    load = {"load_average_before": before, "load_average_after": os.getloadavg()[0]}
    result = {"steps": STEPS - WARMUP_STEPS, **load, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        b = row["bubble"]
        print(f"{row['schedule']:15s} measured {b['measured']:.3f}  simulated with send+transfer "
              f"{b['send_and_transfer']:.3f}, transfer only {b['transfer_only']:.3f}, free {b['free']:.3f}")


if __name__ == "__main__":
    main()
