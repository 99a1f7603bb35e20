"""``shardwise plan``: which layouts fit a target machine, fastest first, and why the first wins.

The model is a built-in preset (``--preset large``), a Hugging Face config read as JSON (``--model
hf:PATH``), or sizes by hand (``--layers --hidden --heads --vocab``); the machine is ``--devices N
--device-memory 80GB --link 400Gbit`` (devices that need not exist here). Arithmetic only
(:mod:`shardwise.planner`): no processes, no communication, nothing is built.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise.commands.output import emit
from shardwise.config import ConfigError, TrainConfig
from shardwise.models import GPT_KIND
from shardwise.models.adapters import hf_shape, preset_shape
from shardwise.planner.calibration import Calibration, Machine
from shardwise.planner.layout import GB, Layout, Training
from shardwise.planner.model import ModelShape
from shardwise.planner.search import MAX_TP, SEARCHED, enumerate_layouts, plan, search_degrees
from shardwise.planner.units import describe_rate, parse_bytes, parse_rate

HF_SEQ_CAP = 4096  # plan a Hugging Face model at its own context, up to this many tokens
# flags that count something: refused below their least value in one line (0 used to mean "not given")
COUNTS = {"--layers": 1, "--hidden": 1, "--heads": 1, "--vocab": 1, "--ffn": 1, "--kv-heads": 1}
COUNTS |= {"--seq-len": 1, "--top": 0}


def add_plan_parser(sub: Any) -> None:
    base = TrainConfig()
    p = sub.add_parser(
        "plan",
        help="rank the layouts that fit a target machine by predicted step time",
        description="Predict memory per device and step time for every layout; drop what does not fit.",
    )
    model = p.add_argument_group(
        "model (one of: --preset, --model hf:PATH, or --layers/--hidden/--heads/--vocab)"
    )
    model.add_argument("--preset", help="a built-in GPT: tiny | odd | small | base | medium | large")
    model.add_argument("--model", help="hf:PATH/config.json, hf:FOLDER or hf:tiny-llama (read, not built)")
    for flag in ("--layers", "--hidden", "--heads", "--vocab", "--ffn", "--kv-heads"):
        model.add_argument(flag, type=int, help="sizes by hand (--ffn: 4 x hidden; --kv-heads: --heads)")
    p.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (default: a Hugging Face model's context up to {HF_SEQ_CAP}; else, and "
        f"for --check, the training default {base.model.seq_len})",
    )
    p.add_argument("--global-batch", type=int, default=base.data.global_batch, help="sequences per step")
    p.add_argument(
        "--precision", default=base.precision, help=f"fp32 | bf16 | fp16 (default {base.precision})"
    )
    p.add_argument("--optimizer", default=base.optim.name, help="adamw | adam | sgd")
    p.add_argument("--strategies", default=",".join(SEARCHED), help="comma-separated subset to search")
    p.add_argument("--bucket-mb", type=float, default=base.ddp.bucket_mb)
    p.add_argument("--devices", type=int, help="target machine: number of devices")
    p.add_argument(
        "--device-memory", help="target machine: memory per device in bytes (B), e.g. 80GB or 80GiB"
    )
    p.add_argument(
        "--link",
        help="target machine: per-device link; case decides the unit, b or bit: bits, B: bytes "
        "(400Gbit = 400Gb/s = 400Gbps = 50GB/s = 50GBps), as `bench compress --link` reads it (unlike tc, "
        "where gbps means bytes)",
    )
    p.add_argument("--link-latency-us", type=float, default=10.0, help="per message step (default 10)")
    p.add_argument("--flops", type=float, help="achieved FLOP/s per device (default: an unmeasured 400e12)")
    p.add_argument("--overhead", help="framework bytes (B) per process, e.g. 1GB (default 0)")
    p.add_argument("--top", type=int, default=10, help="table rows to print (default 10)")
    p.add_argument(
        "--check",
        action="store_true",
        help="run each strategy here on --nproc local ranks; predicted beside measured memory and time",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run one rank of the layout --strategies/--pp/--tp name on --devices (up to 1024) here, on the "
        "meta device with a fake process group: what it holds after a step beside the planner",
    )
    p.add_argument("--nproc", type=int, default=2, help="--check: local ranks (default 2)")
    p.add_argument("--steps", type=int, default=5, help="--check: timed steps per layout (default 5)")
    p.add_argument("--pp", help="pipeline degrees to search, e.g. 1,2 (default: every one the devices take)")
    p.add_argument("--tp", help=f"tensor degrees to search, e.g. 1,2 (default: every one up to {MAX_TP})")
    p.add_argument(
        "--no-tp", action="store_true", help="--check: leave out the tp=2 layouts (run by default when even)"
    )
    p.add_argument(
        "--no-pp", action="store_true", help="--check: leave out the pp=2 layouts (run by default when even)"
    )
    p.add_argument(
        "--comm-profile",
        default="",
        help="--check: the collectives' cost profile (default: the one `shardwise bench comm` saved here, "
        "else the built-in, unmeasured one)",
    )
    p.add_argument("--out", help="--check: also write the result as JSON to this file")
    p.add_argument("--json", action="store_true", help="print the whole plan as one JSON line")
    p.set_defaults(run=plan_command)


def model_from_args(args: argparse.Namespace) -> ModelShape:
    by_hand = [v is not None for v in (args.layers, args.hidden, args.heads, args.vocab)]
    given = [
        name
        for name, on in (("--preset", args.preset), ("--model", args.model), ("--layers...", any(by_hand)))
        if on
    ]
    if len(given) != 1:
        raise ConfigError(
            "give one model: --preset NAME, --model hf:PATH, or --layers L --hidden H --heads A --vocab V"
            + (f" (got {' and '.join(given)})" if given else "")
        )
    if args.preset:
        return preset_shape(args.preset, args.seq_len or TrainConfig().model.seq_len)
    if args.model:
        if not args.model.startswith("hf:"):
            raise ConfigError(
                f"--model {args.model!r}: the planner reads hf:PATH configs; use --preset for gpt"
            )
        return hf_shape(args.model)
    if not all(by_hand):
        raise ConfigError("sizes by hand need all of --layers, --hidden, --heads and --vocab")
    return ModelShape(
        n_layer=args.layers,
        d_model=args.hidden,
        n_head=args.heads,
        vocab=args.vocab,
        d_ff=args.ffn or 0,
        n_kv_head=args.kv_heads or 0,
        positions=args.seq_len or TrainConfig().model.seq_len,
    )


def seq_len_for(args: argparse.Namespace, model: ModelShape) -> int:
    """``--seq-len``, else a Hugging Face model's own context (capped at ``HF_SEQ_CAP``: a plan for
    an 8B model at the training default's 64 tokens would be a plan for no one), else the default."""
    if args.seq_len:
        return int(args.seq_len)
    if args.model and not args.check and model.context:
        return min(model.context, HF_SEQ_CAP)
    return TrainConfig().model.seq_len


def degrees(text: str | None, flag: str, searched: list[int]) -> list[int]:
    """``--pp``/``--tp`` as a list of degrees, each one the search would try; default all of them."""
    if not text:
        return searched
    try:
        asked = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give degrees separated by commas, e.g. {flag} 1,2") from None
    wrong = [d for d in asked if d not in searched]
    if wrong:
        raise ConfigError(
            f"{flag} {', '.join(map(str, wrong))}: not a degree this model and machine take; "
            f"choose from {', '.join(map(str, searched))}"
        )
    return asked


def machine_from_args(args: argparse.Namespace) -> Machine:
    missing = [
        f
        for f, v in (
            ("--devices", args.devices),
            ("--device-memory", args.device_memory),
            ("--link", args.link),
        )
        if v is None
    ]
    if missing:
        raise ConfigError(
            f"give the target machine: {', '.join(missing)} "
            "(e.g. --devices 8 --device-memory 80GB --link 400Gbit)"
        )
    return Machine(
        args.devices, parse_bytes(args.device_memory), parse_rate(args.link), args.link_latency_us * 1e-6
    )


def _strategies(args: argparse.Namespace) -> list[str]:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in SEARCHED]
    if unknown or not strategies:
        raise ConfigError(
            f"--strategies: {', '.join(unknown) or 'none given'}; choose from {', '.join(SEARCHED)}"
        )
    return strategies


def check_counts(args: argparse.Namespace) -> None:
    """Each counting flag (``COUNTS``) at or above its least value, or one line naming it."""
    for flag, least in COUNTS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be an integer >= {least}, got {value}")


def plan_command(args: argparse.Namespace) -> int:
    check_counts(args)
    model = model_from_args(args)
    training = Training(args.global_batch, seq_len_for(args, model), args.precision, args.optimizer)
    strategies = _strategies(args)
    if args.check:
        return check_command(args, model, training, strategies)
    if args.dry_run:
        from shardwise.commands.plan_dry_run import dry_run_command

        return dry_run_command(args, model, training, strategies)
    machine = machine_from_args(args)
    overhead = 0.0 if args.overhead is None else parse_bytes(args.overhead, "--overhead", zero_ok=True)
    calibration = Calibration(
        overhead_bytes=overhead,
        **({"flops_per_s": args.flops, "source": "--flops"} if args.flops is not None else {}),
    )
    pp_searched, tp_searched = search_degrees(model, machine.devices)
    layouts = enumerate_layouts(
        model,
        training,
        machine.devices,
        strategies,
        pp_degrees=degrees(args.pp, "--pp", pp_searched),
        tp_degrees=degrees(args.tp, "--tp", tp_searched),
        bucket_mb=args.bucket_mb,
    )
    result = plan(model, training, machine, calibration, layouts=layouts)
    out = {
        "model": model.describe(),
        "params": model.params,
        "machine": {"devices": machine.devices, "device_memory_bytes": machine.device_memory,
                    "link_bytes_per_s": machine.link_bytes_per_s, "link_latency_s": machine.link_latency_s,
                    "overhead_bytes": calibration.overhead_bytes},
        "calibration": calibration.source,
        "training": {"global_batch": training.global_batch, "seq_len": training.seq_len,
                     "precision": training.precision, "optimizer": training.optimizer},
        "ranked": [{"rank": i + 1, **c.as_dict()} for i, c in enumerate(result.ranked)],
        "dropped": [c.as_dict() for c in result.dropped],
        "why": result.why,
        "run_first": train_command(result.best.layout, training, _model_flags(args)) if result.best else None,
    }  # fmt: skip
    emit(out, args.json, lambda r: _render(r, args.top))
    return 0


def _model_flags(args: argparse.Namespace) -> list[str]:
    """The model flags ``plan`` was given that ``train`` reads the same way (sizes by hand are not)."""
    return [f"--{name} {value}" for name in ("preset", "model") if (value := getattr(args, name, None))]


def train_command(layout: Layout, training: Training, model_flags: Sequence[str] = ()) -> str:
    """The ``shardwise train`` flags that run ``layout`` (the model's as given to plan, if any)."""
    flags = [*model_flags, f"--nproc {layout.devices}", f"--strategy {layout.strategy}"]
    flags += [f"--pp {layout.pp}"] if layout.pp > 1 else []
    flags += [f"--tp {layout.tp}"] if layout.tp > 1 else []
    flags += [f"--schedule {layout.schedule}"] if layout.pp > 1 else []
    flags += [f"--micro-batches {layout.micro_batches}"] if layout.micro_batches > 1 else []
    flags += ["--activation-checkpointing"] if layout.activation_checkpointing else []
    flags += [f"--offload {layout.offload}"] if layout.offload != "none" else []
    flags += [f"--global-batch {training.global_batch}", f"--seq-len {training.seq_len}"]
    flags += [f"--precision {training.precision}"] if training.precision != "fp32" else []
    return "shardwise train " + " ".join(flags)


def _render(result: dict[str, Any], top: int) -> None:
    machine = result["machine"]
    overhead = machine.get("overhead_bytes") or 0.0
    print(
        f"{result['model']}; {machine['devices']} devices x {_gb(machine['device_memory_bytes'])}, "
        f"link {describe_rate(machine['link_bytes_per_s'])} at {machine['link_latency_s'] * 1e6:g} us"
        + (f", {_gb(overhead)} overhead per process" if overhead else "")
        + " (--devices, --device-memory, --link, --link-latency-us"
        + (", --overhead)" if overhead else ")")
    )
    work = result["training"]
    print(
        f"workload: {work['global_batch']} sequences x {work['seq_len']} tokens per step, "
        f"{work['precision']}, {work['optimizer']} (--global-batch, --seq-len, --precision, --optimizer)"
    )
    print(f"calibration: {result['calibration']}")
    print(f"{'#':>3}  {'layout':<36} {'step ms':>10} {'memory GB':>10}  its largest part (GB) and phase")
    for row in result["ranked"][:top]:
        step_ms, memory_gb = row["step_time_s"] * 1e3, row["memory_bytes"] / GB
        name, largest = row["memory_largest"]
        print(
            f"{row['rank']:>3}  {row['layout']:<36} {step_ms:>10.1f} {memory_gb:>10.2f}  "
            f"{name} {largest / GB:.2f} ({row['memory_peak_phase']})"
        )
    if len(result["ranked"]) > top:
        print(f"     ... {len(result['ranked']) - top} more that fit (--top N, or --json)")
    if result["dropped"]:
        print(f"dropped {len(result['dropped'])} that do not fit; the smallest:")
    for row in sorted(result["dropped"], key=lambda r: r["memory_bytes"])[:3]:
        print(f"     {row['layout']}: {row['reason']}")
    print(result["why"])
    if result["run_first"]:
        print(f"to run the first: {result['run_first']}")


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 10 * GB else f"{nbytes / GB:.2f} GB"


def check_command(
    args: argparse.Namespace, model: ModelShape, training: Training, strategies: list[str]
) -> int:
    """Each strategy run here on ``--nproc`` ranks: predicted and measured peak bytes and step time."""
    import tempfile
    from dataclasses import replace

    from shardwise.bench.plan_check import check_layouts, layout_overrides, run_check
    from shardwise.config import load_config

    if not (args.preset or args.model):
        raise ConfigError("--check runs the model: give --preset NAME or --model hf:PATH, not sizes by hand")
    if args.nproc < 1 or args.steps < 2:
        raise ConfigError(f"--check needs --nproc >= 1 and --steps >= 2; got {args.nproc}, {args.steps}")
    layouts = [
        replace(layout, bucket_mb=args.bucket_mb)
        for layout in check_layouts(model, strategies, args.nproc, tp=not args.no_tp, pp=not args.no_pp)
    ]
    with tempfile.TemporaryDirectory(prefix="shardwise-plan-check-") as run_dir:

        def config_for(layout: Layout, i: int) -> TrainConfig:
            overrides = {
                "model.kind": GPT_KIND if args.preset else args.model, "model.preset": args.preset or "small",
                "model.seq_len": str(training.seq_len), "precision": args.precision,
                "optim.name": args.optimizer, "data.global_batch": str(args.global_batch),
                "ddp.bucket_mb": str(args.bucket_mb), "zero.bucket_mb": str(args.bucket_mb),
                "steps": str(args.steps), "eval_every": "0", "run_dir": f"{run_dir}/{i}",
                "comm.profile": args.comm_profile, **layout_overrides(layout),
            }  # fmt: skip
            return load_config(None, overrides)

        rows, calibration = run_check(model, training, layouts, config_for, args.steps)
    out = {
        "model": model.describe(), "nproc": args.nproc, "cores": os.cpu_count(),
        "calibration": calibration, "check": rows,
    }  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    emit(out, args.json, _render_check)
    return 0


def _render_check(result: dict[str, Any]) -> None:
    print(f"{result['model']}; measured on {result['nproc']} local ranks (tensor bytes, not RSS)")
    heads = ("pred MB", "meas MB", "mem x", "build x", "pred ms", "meas ms", "time x")
    print(f"{'layout':<30} " + " ".join(f"{h:>8}" for h in heads))
    for row in result["check"]:
        cells = (
            row["predicted_bytes"] / 1e6,
            row["measured_bytes"] / 1e6,
            row["memory_ratio"],
            row["build_ratio"],
            row["predicted_step_s"] * 1e3 if row["predicted_step_s"] is not None else None,
            row["measured_step_s"] * 1e3 if row["measured_step_s"] is not None else None,
            row["time_ratio"],
        )
        text = " ".join(f"{c:>8.2f}" if c is not None else f"{'-':>8}" for c in cells)
        print(f"{row['layout']:<30} {text}" + (f"  ({row['time_note']})" if row.get("time_note") else ""))
    if result["check"]:
        print(f"communication profile: {result['check'][0]['comm_profile']}")
