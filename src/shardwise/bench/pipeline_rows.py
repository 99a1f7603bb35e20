"""The pipeline bench's rows: each schedule's bubble three ways and its speed against torch's class.

What ``bench pipeline`` (``bench/pipeline.py``, which launches the rounds) turns its launches into:
the bubble read off our ranks' action spans, the simulator's from the profiled costs, the
literature's formula; each round's paired speed ratio (its launches' step pairs, a trimmed mean)
and the median over rounds; how far the rounds spread; and ``zb_over_1f1b``, zero-bubble against
plain 1F1B both ways. The module docstring of ``bench/pipeline.py`` says how each figure is measured.
Pure arithmetic on the launches' results: no processes, no communication.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from shardwise.bench.pipeline_sides import ACTION_LANE, BLOCK
from shardwise.observe.monitor import Span
from shardwise.observe.trace import idle_fraction
from shardwise.pipeline.schedules import SCHEDULES, build, stage_placement
from shardwise.pipeline.simulate import Costs, Timeline, simulate
from shardwise.pipeline.validate import ScheduleError

TORCH_PEER = {"zb": "Schedule1F1B"}  # torch has no ZB-H1: our zb is measured against its 1F1B
PLAIN_PEER = {"zb": "1f1b"}  # and against our own 1F1B, in the same launches (``zb_over_1f1b``)


def virtual_for(name: str) -> int:
    """Stages per rank each schedule runs with here: 1, or 2 for interleaved and V schedules."""
    return 1 if SCHEDULES[name].virtual == "1" else 2


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


def _ran(ours: Launches | str) -> list[dict[int, list[Any]] | None]:
    """The schedule our side ran in each launch, read off the action spans of its last measured step
    (a split schedule is fitted to each launch's run: ``pipeline/fitting.py``, so launches may differ);
    None for a launch without them, ``[None]`` without launches."""
    if isinstance(ours, str) or not ours:
        return [None]
    ran: list[dict[int, list[Any]] | None] = []
    for launch in ours:
        steps = steps_by_rank([launch])
        ran.append(schedule_of(steps[-1]) if steps and all(steps[-1].values()) else None)
    return ran


def schedule_of(step: Mapping[int, Sequence[Span]]) -> dict[int, list[Any]]:
    """Each rank's actions of one recorded step, in the order they ran (their spans' names)."""
    from shardwise.pipeline.actions import parse_action

    return {
        r: [parse_action(s.name) for s in sorted(spans, key=lambda s: s.start)] for r, spans in step.items()
    }


def simulated(
    ran: Mapping[int, Sequence[Any]] | None, name: str, pp: int, microbatches: int, costs: Costs
) -> Timeline:
    """The simulator's timeline of the schedule a step ran (``ran``: fitted to the run, for a split
    one), or of the schedule as the runtime builds it where none was recorded whole."""
    virtual = virtual_for(name)
    placement = stage_placement(name, pp, virtual)
    if ran is not None:
        try:
            return simulate(ran, placement, costs)
        except ScheduleError:  # the spans do not make a whole schedule (a rank that recorded none)
            pass
    return simulate(as_run(name, pp, virtual, microbatches), placement, costs)


def as_run(name: str, pp: int, virtual: int, microbatches: int) -> dict[int, list[Any]]:
    """The schedule as the runtime runs it: the first stage's I and W back to back as one B."""
    from shardwise.pipeline.actions import fuse_schedule

    return fuse_schedule(build(name, pp, virtual, microbatches))


def _mean(value: float | tuple[float, ...]) -> float:
    return statistics.fmean(value) if isinstance(value, tuple) else float(value)


# ------------------------------------------------------------------------------------- the rows


def row(
    name: str, pp: int, microbatches: int, tokens: int, ours: Launches | str, torch_side: Launches | str,
    costs: Costs, per_round: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """One schedule's row from each side's launches (a list of per-launch results by rank) or the
    string saying why that side has none (``"timeout after N s"``); ``per_round`` consecutive launches
    make a round (``rounds_of``)."""
    virtual = virtual_for(name)
    spec = SCHEDULES[name]
    # each launch's own schedule, as the measured bubble is each step's: the median over launches
    bubbles = [simulated(ran, name, pp, microbatches, costs).bubble for ran in _ran(ours)]
    value, formula = theory(name, pp, virtual, microbatches, costs)
    out: dict[str, Any] = {
        "schedule": name,
        "torch_class": TORCH_PEER.get(name, spec.torch_class),
        "pp": pp,
        "virtual_stages": virtual,
        "microbatches": microbatches,
        "bubble_measured": None,
        "bubble_simulated": statistics.median(bubbles),
        "bubble_theory": value,
        "theory_formula": formula,
        "speed_ratio": None,
        "profiled_ms": _profiled_ms(costs),
    }
    out["ours"], out["torch"] = _side(ours, tokens), _side(torch_side, tokens)
    if not isinstance(ours, str):
        steps = [bubble_from_spans(spans) for spans in steps_by_rank(ours)]
        out["bubble_measured"] = statistics.median(steps)
    if not isinstance(ours, str) and not isinstance(torch_side, str) and ours and torch_side:
        rounds = round_ratios(ours, torch_side, per_round)
        out["speed_ratio"] = statistics.median(rounds)
        out["speed_ratio_rounds"] = rounds
    return out


def _profiled_ms(costs: Costs) -> dict[str, Any]:
    """The simulator's costs in ms: per kind, per stage (the profile's); one activation's post (the
    profile's), its transfer (priced from the warm-up steps where they waited for one) and the gap
    between two of a rank's actions (from the same steps)."""
    out: dict[str, Any] = {
        "transfer": round(1e3 * costs.transfer, 3),
        "send": round(1e3 * costs.send, 3),
        "gap": round(1e3 * costs.gap, 3),
    }
    kinds = (costs.forward, costs.backward, costs.input_grad, costs.weight_grad)
    for kind, value in zip("FBIW", kinds, strict=True):
        out[kind] = [round(1e3 * c, 3) for c in value] if isinstance(value, tuple) else round(1e3 * value, 3)
    return out


Launches = list[list[dict[str, Any]]]  # per launch, each rank's result


TRIM = 0.1  # the share of values dropped at each end before a trimmed mean (``trimmed_mean``)


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """The mean of ``values`` without the lowest and the highest ``trim`` of them (``int(trim * n)``
    each end). A step's time here swings by a tenth from one step to the next, by a third or more
    when the machine stalls one; the trimmed mean keeps a median's indifference to those stalls and
    most of a mean's use of every pair (module docstring of ``bench/pipeline.py``)."""
    ordered = sorted(values)
    cut = int(trim * len(ordered))
    return statistics.fmean(ordered[cut : len(ordered) - cut])


def step_times(launch: list[dict[str, Any]]) -> list[float]:
    """A launch's measured steps in order, each its slowest rank's time."""
    return [max(ks) for ks in zip(*(r["step_s"] for r in launch), strict=False)]


def paired_ratio(ours: Launches, theirs: Launches) -> float:
    """Torch's step time over ours from launches that ran both sides (the same index in each list):
    each step pair's ratio (step k of each side, run in neighbouring turns), pooled over the launches,
    their trimmed geometric mean (``trimmed_mean`` of the logs)."""
    logs = [
        math.log(t / o)
        for mine, peer in zip(ours, theirs, strict=False)
        for o, t in zip(step_times(mine), step_times(peer), strict=False)
    ]
    return math.exp(trimmed_mean(logs))


def rounds_of(launches: Launches, per_round: int) -> list[Launches]:
    """Consecutive launches in rounds of ``per_round`` (the last may be short)."""
    return [launches[k : k + per_round] for k in range(0, len(launches), per_round)]


def round_ratios(ours: Launches, theirs: Launches, per_round: int) -> list[float]:
    """Each round's ``paired_ratio``, over the rounds where both sides ran."""
    return [
        paired_ratio(mine, peer)
        for mine, peer in zip(rounds_of(ours, per_round), rounds_of(theirs, per_round), strict=False)
        if mine and peer
    ]


def _side(launches: Launches | str, tokens: int) -> dict[str, Any] | str:
    """A side's step time and tokens/s: the ``trimmed_mean`` of every measured step (each its slowest
    rank's) over all its launches, and (``step_s_mean``) their plain mean, stalls in full. Two sides
    measured in the same launches compare as their step pairs do; the trimmed figure is the one
    tokens/s is made of, as steady as the speed ratios (a stall the machine makes lands on one side's
    step at random)."""
    if isinstance(launches, str):
        return launches
    steps = [t for launch in launches for t in step_times(launch)]
    step_s = trimmed_mean(steps)
    return {
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "step_s_mean": statistics.fmean(steps),
        "launches": len(launches),
    }


def conditions(
    rows: Sequence[dict[str, Any]], load_before: float, load_after: float, per_round: int = 1
) -> dict[str, Any]:
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
        "turn_steps": BLOCK,
        "launches_per_round": per_round,
        "trim": TRIM,
        "note": "speed ratios: the median over interleaved rounds of each round's ratio, the trimmed "
        "geometric mean (trim at each end) of its launches' step pairs (step k of each side, a step's time "
        "its slowest rank's); a side's step time and tokens/s: the trimmed mean of its measured steps over "
        "every launch (step_s_mean: the plain mean); in a launch each side runs turn_steps steps back to "
        "back, then the next side, a turn's first step run and not timed; ratio_spread: the largest "
        "(max - min) / median of a row's round ratios. The defaults (3 rounds of 5 launches of 40 steps) "
        "are sized to put two runs within 5% of each other on every ratio: bench/pipeline.py says how",
    }


def steps_by_rank(launches: Launches, key: str = "spans") -> list[dict[int, list[Span]]]:
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


def zb_over_1f1b(rows: Sequence[dict[str, Any]], same_launch: float | None = None) -> dict[str, float] | None:
    """Our ``zb`` against our ``1f1b``: ``tokens_per_s``, the ratio of the two rows' tokens/s (from
    the same launches where the bench has both: ``bench/pipeline.py``); ``same_launch_tokens_per_s``,
    zb's over 1F1B's measured in the same launches, turn by turn (``same_launch``, where they ran);
    ``paired``, the ratio of their speed ratios (both against torch's ``Schedule1F1B``, so each
    launch's speed cancels). None without both rows."""
    by_name = {r["schedule"]: r for r in rows}
    zb, plain = by_name.get("zb"), by_name.get("1f1b")
    if zb is None or plain is None or isinstance(zb["ours"], str) or isinstance(plain["ours"], str):
        return None
    out = {"tokens_per_s": zb["ours"]["tokens_per_s"] / plain["ours"]["tokens_per_s"]}
    if same_launch is not None:
        out["same_launch_tokens_per_s"] = same_launch
    if zb["speed_ratio"] is not None and plain["speed_ratio"] is not None:
        out["paired"] = zb["speed_ratio"] / plain["speed_ratio"]
    return out
