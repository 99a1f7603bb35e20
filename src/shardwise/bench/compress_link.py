"""``shardwise bench compress --link RATE``: the wall time each codec needs to reach the uncompressed
run's held-out loss when two hosts are joined by a slow link.

Two "hosts" (``bench.netns``: network namespaces joined by a veth pair, BOTH directions shaped to
RATE by tc's token-bucket filter), one rank on each, started by one torchrun agent per host as
docs/multi-node.md does (gloo on the veth). Every row is ``shardwise train`` on bench compress's job
(``compress.job_overrides``: the small GPT, cosine schedule with warm-up, seed 0 or ``--seed``) at a
smaller global batch (``LINK_BATCH``), so that the link, not the compute, bounds a step; only
``comm.compress`` (or the strategy, for DiLoCo) changes between rows.

Per row: the held-out loss every ``eval_every`` steps, and at each evaluation the cumulative
*training* time: the sum of the steps' ``step_s`` (the slowest rank's time from its forward to the
end of its update, communication included; evaluations, the data draw and the per-step metrics
all-gather are left out). The uncompressed run trains ``steps`` steps; its final held-out loss is the
target. Every other row may train up to ``step_factor`` x ``steps`` steps on the very same learning-rate
schedule (``optim.schedule_steps``: cosine over ``steps``, then ``min_lr``) and is stopped at its first
evaluation at or below the target. ``time_to_target_s`` is the training time at the first evaluation
at or below the target, without interpolation (the same rule for the uncompressed run), and
``time_ratio`` is that over the uncompressed run's. Before the rows, the uncompressed job runs
``PROBE_STEPS`` steps unshaped and then shaped: its median step and communication times show whether
the link bounds the step.

Communication: whatever each row does (all-reduce, the codec's exchange, DiLoCo's outer all-reduce
every H steps), between two ranks over the shaped veth pair.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.bench.compress import job_overrides, select_rows
from shardwise.bench.netns import (
    Host,
    kill_namespace,
    measure_gbit_s,
    qdiscs,
    rank_env,
    shape,
    torchrun_command,
    two_hosts,
)
from shardwise.config import load_config
from shardwise.planner.units import describe_rate, parse_rate

LINK_BATCH = 4  # global batch: at 16 the small GPT's compute, not the 1 Gbit/s link, bounds a step
HELD_OUT_SEQUENCES = 256  # the held-out set of bench compress (16 batches of 16), at any batch
PROBE_STEPS = 30
LINK_STEPS = 300  # the uncompressed run's steps (the others may take step_factor times as many)
DEFAULT_ROWS = [
    "fp16", "int8", "sign", "topk:0.01", "powersgd:4", "powersgd:8", "update:sign", "update:topk:0.01",
    "diloco:H16", "diloco:H4-avg",
]  # fmt: skip
BASE_PORT = 29500
ROW_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation: after ``step`` (0-based), ``train_s`` of training so far."""

    step: int
    train_s: float
    loss: float


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` written so far (a half-written last line is left out)."""
    rows = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def curve(rows: list[dict[str, Any]]) -> list[EvalPoint]:
    """Each evaluation with the cumulative training time (sum of ``step_s``) up to its step."""
    points, train_s = [], 0.0
    for row in rows:
        train_s += float(row["step_s"])
        if row.get("eval_loss") is not None:
            points.append(EvalPoint(int(row["step"]), train_s, float(row["eval_loss"])))
    return points


def time_to_target(points: list[EvalPoint], target: float) -> EvalPoint | None:
    """The first evaluation at or below ``target`` (no interpolation), or None if none reached it."""
    return next((p for p in points if p.loss <= target), None)


def _load() -> dict[str, Any]:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": uptime, "loadavg": list(os.getloadavg()), "cpus": os.cpu_count()}


@dataclass
class LinkJob:
    """What every row shares."""

    steps: int
    preset: str
    global_batch: int
    eval_every: int
    step_factor: float
    run_dir: Path
    seed: int = 0

    def overrides(self, steps: int, run_dir: Path, row: dict[str, str], eval_every: int) -> dict[str, str]:
        link = {
            "data.global_batch": str(self.global_batch),
            "eval_batches": str(max(1, HELD_OUT_SEQUENCES // self.global_batch)),
            "eval_every": str(eval_every),
            "optim.schedule_steps": str(self.steps),  # past it, a longer row stays at min_lr
        }
        return job_overrides(steps, self.preset, self.seed, str(run_dir), {**link, **row})

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "global_batch": self.global_batch,
            "steps": self.steps,
            "max_steps": int(self.steps * self.step_factor),
            "eval_every": self.eval_every,
            "eval_sequences": HELD_OUT_SEQUENCES,
            "seeds": 1,
            "seed": self.seed,
            "overrides": self.overrides(self.steps, self.run_dir, {}, self.eval_every),
        }


class RowRun:
    """One ``shardwise train`` over the two hosts: an agent per host, stopped early when told."""

    def __init__(self, hosts: dict[str, Host], overrides: dict[str, str], port: int, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.run_dir, self.hosts, self.stopped = run_dir, hosts, False
        sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        for name, host in hosts.items():
            command = [*torchrun_command(name, hosts, port, f"link-{port}"), "-m", "shardwise", "train"]
            with (run_dir / f"agent-{name}.log").open("w") as log:  # the agent keeps its own copy
                self.agents[name] = subprocess.Popen(
                    [*command, *sets], env=rank_env(host), stdout=log, stderr=subprocess.STDOUT
                )

    def wait(self, stop_below: float | None) -> list[dict[str, Any]]:
        """Every metrics row once both agents end, or once an evaluation reaches ``stop_below``."""
        deadline = time.monotonic() + ROW_TIMEOUT_S
        metrics = self.run_dir / "metrics.jsonl"
        while any(agent.poll() is None for agent in self.agents.values()):
            if stop_below is not None and time_to_target(curve(read_metrics(metrics)), stop_below):
                self.stop()
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"a row ran past {ROW_TIMEOUT_S:.0f} s: {self.run_dir}")
            time.sleep(0.2)
        failed = {n: a.returncode for n, a in self.agents.items() if a.returncode}
        if failed and not self.stopped:  # stopped here: SIGKILL, or one saw the other go first
            tail = (self.run_dir / "agent-a.log").read_text()[-3000:]
            raise RuntimeError(f"training over the link failed (exit codes {failed}):\n{tail}")
        return read_metrics(metrics)

    def stop(self) -> None:
        self.stopped = True
        for host in self.hosts.values():
            kill_namespace(host.ns)
        for agent in self.agents.values():
            agent.wait(timeout=30)


def _times(rows: list[dict[str, Any]]) -> dict[str, float]:
    timed = rows[1:] or rows  # the first step is warm-up
    return {
        "step_s_median": statistics.median(float(r["step_s"]) for r in timed),
        "comm_s_median": statistics.median(float(r["comm_s"]) for r in timed),
        "bytes_per_step": statistics.fmean(statistics.fmean(r["bytes_sent"]) for r in rows),
    }


def _probe(hosts: dict[str, Host], job: LinkJob, port: int, name: str) -> dict[str, float]:
    run_dir = job.run_dir / f"probe-{name}"
    overrides = job.overrides(PROBE_STEPS, run_dir, {}, 0)
    overrides["optim.schedule_steps"] = "0"
    return _times(RowRun(hosts, overrides, port, run_dir).wait(None))


def _row(
    hosts: dict[str, Host], job: LinkJob, label: str, row: dict[str, str], port: int, target: float | None
) -> dict[str, Any]:
    steps = job.steps if target is None else int(job.steps * job.step_factor)
    run_dir = job.run_dir / label.replace(":", "-")
    started = time.monotonic()
    rows = RowRun(hosts, job.overrides(steps, run_dir, row, job.eval_every), port, run_dir).wait(target)
    points = curve(rows)
    return {
        "label": label,
        "overrides": row,
        "max_steps": steps,
        "steps_run": len(rows),
        "evals": [[p.step, p.train_s, p.loss] for p in points],
        "final_heldout_loss": points[-1].loss,
        "wall_s": time.monotonic() - started,
        **_times(rows),
    }


def _reach(entry: dict[str, Any], target: float, base_s: float | None) -> None:
    """Fill in ``reached``, ``steps_to_target``, ``time_to_target_s`` and ``time_ratio``."""
    hit = time_to_target([EvalPoint(int(s), t, v) for s, t, v in entry["evals"]], target)
    entry["reached"] = hit is not None
    entry["steps_to_target"] = hit.step + 1 if hit else None
    entry["time_to_target_s"] = hit.train_s if hit else None
    base = base_s if base_s is not None else entry["time_to_target_s"]
    entry["time_ratio"] = hit.train_s / base if hit and base else None


def tc_rate(rate: str) -> str:
    """``rate`` as ``planner.units`` reads it (case decides: ``1Gbit``, ``1Gb/s`` and ``125MB/s`` are one
    rate), handed to tc in bits per second, the one unit tc and we read alike (tc's ``gbps`` is bytes)."""
    return f"{round(parse_rate(rate, '--link') * 8)}bit"


def run_link_bench(
    rate: str = "1Gbit",
    steps: int = LINK_STEPS,
    preset: str = "small",
    labels: list[str] | None = None,
    global_batch: int = LINK_BATCH,
    eval_every: int = 10,
    step_factor: float = 2.0,
    run_dir: str = "runs/bench-compress-link",
    seed: int = 0,
) -> dict[str, Any]:
    """The uncompressed run, then each row of ``ROWS`` named in ``labels``, over a link of ``rate``
    (``tc_rate``), all from seed ``seed``."""
    shaped = tc_rate(rate)
    chosen = [r for r in select_rows(labels or DEFAULT_ROWS) if r.label != "none"]
    job = LinkJob(steps, preset, global_batch, eval_every, step_factor, Path(run_dir).resolve(), seed)
    for extra in [{}, *(r.overrides for r in chosen)]:  # a bad job stops here, in one line, not in a rank
        load_config(None, job.overrides(steps, job.run_dir, extra, eval_every)).validate(2)
    result: dict[str, Any] = {"load_start": _load(), "job": job.describe()}
    started = time.monotonic()
    with two_hosts() as hosts:
        unshaped_gbit = measure_gbit_s(hosts, 256)
        probe = {"unshaped": _probe(hosts, job, BASE_PORT, "unshaped")}
        shape(hosts, shaped)
        result["link"] = {
            "rate": rate,
            "bytes_per_s": parse_rate(rate, "--link"),
            "tc_rate": shaped,
            "shaper": "tc tbf on both veth ends (each direction)",
            "qdisc": qdiscs(hosts),
            "measured_gbit_s": {"unshaped": unshaped_gbit, "shaped": measure_gbit_s(hosts, 64)},
        }
        probe["shaped"] = _probe(hosts, job, BASE_PORT + 1, "shaped")
        result["probe"] = {"steps": PROBE_STEPS, **probe}
        base = _row(hosts, job, "uncompressed", {}, BASE_PORT + 2, None)
        target = base["final_heldout_loss"]
        _reach(base, target, None)
        table = []
        for i, row in enumerate(chosen):
            entry = _row(hosts, job, row.label, row.overrides, BASE_PORT + 3 + i, target)
            _reach(entry, target, base["time_to_target_s"])
            table.append(entry)
    result.update(_verdict(base, table, target))
    result["wall_s"] = time.monotonic() - started
    result["load_end"] = _load()
    return result


LINK_GOAL = 0.7  # the best codec reaches the uncompressed loss in at most this share of its time


def _verdict(base: dict[str, Any], table: list[dict[str, Any]], target: float) -> dict[str, Any]:
    reached = [r for r in table if r["reached"]]
    best = min(reached, key=lambda r: r["time_ratio"]) if reached else None
    return {
        "target_heldout_loss": target,
        "target_rule": "first evaluation at or below the target (no interpolation)",
        "uncompressed": base,
        "rows": table,
        "best": {"label": best["label"], "time_ratio": best["time_ratio"]} if best else None,
        "goal_time_ratio": LINK_GOAL,
        "goal_met": bool(best and best["time_ratio"] <= LINK_GOAL),
    }


def render_link(result: dict[str, Any]) -> None:
    job, link, probe = result["job"], result["link"], result["probe"]
    print(
        f"compression over a {link['rate']} link"
        + (f", read as {describe_rate(link['bytes_per_s'])}" if "bytes_per_s" in link else "")
        + f" ({link['measured_gbit_s']['shaped']:.2f} Gbit/s measured), "
        f"2 hosts x 1 rank, {job['preset']} GPT, global batch {job['global_batch']}, {job['steps']} steps "
        f"(others up to {job['max_steps']}), seed {job.get('seed', 0)}; "
        f"load {result['load_start']['loadavg'][0]:.2f} -> "
        f"{result['load_end']['loadavg'][0]:.2f}"
    )
    for name, p in probe.items():
        if isinstance(p, dict):
            step_ms, comm_ms = p["step_s_median"] * 1e3, p["comm_s_median"] * 1e3
            print(f"  probe {name}: step {step_ms:.0f} ms, blocked in communication {comm_ms:.0f} ms")
    print(f"  target held-out loss {result['target_heldout_loss']:.4f}")
    print(f"  {'row':>16}  {'MB/step':>8}  {'step ms':>8}  {'steps':>6}  {'time s':>7}  {'ratio':>6}")
    for r in [result["uncompressed"], *result["rows"]]:
        steps = r["steps_to_target"] if r["reached"] else f">{r['steps_run']}"
        time_s = f"{r['time_to_target_s']:7.1f}" if r["reached"] else f"{'-':>7}"
        ratio = f"{r['time_ratio']:6.3f}" if r["reached"] else "not reached"
        print(
            f"  {r['label']:>16}  {r['bytes_per_step'] / 2**20:8.3f}  {r['step_s_median'] * 1e3:8.1f}  "
            f"{steps!s:>6}  {time_s}  {ratio:>6}"
        )
    best = result["best"]
    if best:
        verdict = "met" if result["goal_met"] else "MISSED"
        ratio = best["time_ratio"]
        print(f"  best: {best['label']} at {ratio:.3f} of the time (goal <= {LINK_GOAL}: {verdict})")
