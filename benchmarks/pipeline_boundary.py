"""Where a pipeline step's time goes outside its actions: the step boundary, phase by phase, per rank.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_boundary.py [schedule] [--out FILE]

Runs ``bench pipeline``'s own configuration (the small preset, pp 2 on 2 ranks, 4 micro-batches, 8 rows)
under our runtime with the action spans recorded, and times the step spine's phases by wrapping the
engine's and the runner's methods with a clock (no code of ours changed). Per rank, medians over the
measured steps: the step; the actions' busy time; the time before the first action and after the last;
and each phase (the global count, the tied weight's values and gradient, the finite check, the
agreement, the norm's share, the post of the boundary's one all-reduce (its wait is inside
``update``; a pipeline's rank updates early, before that wait, and measures no norm in
``clip_gradients``: ``Engine.updates_early``), the optimizer). Writes
``benchmarks/results/pipeline-boundary.json``.

What it showed (see that file): on a quiet machine the last stage's actions run back to back (gaps under
1 ms), and about 20 ms of a 67 ms 1F1B step is outside the actions, at the step boundary: the update's
finite check, the agreement on it, the global norm and the loss report each synchronise or scan every
gradient, where torch's schedule is followed by ``optimizer.step()`` alone. Communication: whatever the
runtime does (point-to-point over pp, the step's all-reduces), observed only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.bench.pipeline import bench_config
from shardwise.pipeline.schedules import SCHEDULES
from shardwise.testing import run_on_ranks

ENGINE_PHASES = (
    "global_count", "nonfinite_grad", "grad_norm_sq", "clip_gradients", "run_optimizers", "update",
    "forward_backward",
)  # fmt: skip
BOUNDARY_PHASES = ("post_boundary_sums",)  # engine/nonfinite.py, as engine/base.py calls it (the post)
TIED_PHASES = ("post_values", "wait_values", "add_gradient")  # pipeline/tied.py
STEPS, WARMUP = 22, 2


def _timed(owner: Any, name: str, into: dict[str, list[float]]) -> None:
    """Replace ``owner.name`` by the same call, timed into ``into[name]``."""
    inner: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into[name].append(time.perf_counter() - started)

    setattr(owner, name, timed)


def _worker(rank: int, world: int, config: Any) -> dict[str, Any]:
    from shardwise.bench.pipeline_profile import bench_data
    from shardwise.mesh import build_mesh
    from shardwise.models import build_model
    from shardwise.observe.monitor import MONITOR
    from shardwise.parallelism import parallelize
    from shardwise.train.loop import seed_everything

    config = config.validate(world)
    seed_everything(config.seed)
    engine = parallelize(build_model(config.model), build_mesh(config), config)
    sampler, _ = bench_data(config)
    phases: dict[str, list[float]] = defaultdict(list)
    for name in ENGINE_PHASES:
        _timed(engine, name, phases)
    for name in TIED_PHASES:
        _timed(engine.runner.tied, name, phases)
    import shardwise.engine.base as spine

    for name in BOUNDARY_PHASES:
        _timed(spine, name, phases)
    MONITOR.tracing = True
    for step in range(config.steps):
        MONITOR.spans.clear()
        begun = time.monotonic()
        engine.train_step(sampler.local_micro_batches(step, config.data.micro_batches))
        ended = time.monotonic()
        spans = sorted((s.start, s.duration) for s in MONITOR.spans if s.lane == "actions")
        phases["step"].append(ended - begun)
        phases["actions_busy"].append(sum(d for _, d in spans))
        phases["before_first_action"].append(spans[0][0] - begun)
        phases["after_last_action"].append(ended - (spans[-1][0] + spans[-1][1]))
    MONITOR.tracing = False
    return {name: round(1e3 * statistics.median(times[WARMUP:]), 3) for name, times in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedule", nargs="?", default="1f1b", choices=sorted(SCHEDULES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline-boundary.json"))
    args = parser.parse_args()
    config = bench_config(args.schedule, 2, 4, "small", 8, STEPS)
    load = os.getloadavg()[0]
    ranks = run_on_ranks(_worker, 2, config, timeout_s=300)
    result = {
        "schedule": args.schedule, "preset": "small", "pp": 2, "microbatches": 4, "global_batch": 8,
        "steps": STEPS, "warmup_steps": WARMUP, "unit": "ms, median over steps",
        "load_average_before": load, "load_average_after": os.getloadavg()[0],
        "ranks": {str(rank): phases for rank, phases in enumerate(ranks)},
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
