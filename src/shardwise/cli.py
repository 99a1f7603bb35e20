"""``shardwise`` command line: train, verify, bench, ckpt, plot, plan.

Flags map onto dotted config keys (``--bucket-mb`` is ``ddp.bucket_mb``); ``--set key=value`` reaches
any other key. A config that does not add up is reported in one line, without a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from shardwise import procstart, signals
from shardwise.config import ConfigError, TrainConfig, load_config, model_source, set_key

# flag -> (dotted config key, argparse kwargs)
TRAIN_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--strategy": ("strategy", {"help": "ddp | ps | zero1 | zero2 | zero3 | diloco"}),
    "--steps": ("steps", {"help": "optimizer steps"}),
    "--seed": ("seed", {}),
    "--dtype": ("dtype", {"help": "float32 | float64"}),
    "--device": ("device", {"help": "auto | cpu | cuda (auto: a GPU per local rank when there are GPUs)"}),
    "--model": (
        "model.kind",
        {"help": "gpt | mlp | hf:PATH/config.json | hf:tiny-gpt2 | hf:tiny-llama | package.module:function"},
    ),
    "--preset": (
        "model.preset",
        {"help": "model size: tiny | odd | odd-deep | small | base | medium | large"},
    ),
    "--seq-len": ("model.seq_len", {}),
    "--init-from": (
        "model.init_from",
        {
            "help": "start from local weights: a Hugging Face folder of safetensors, an exported file, "
            "or a shardwise checkpoint (a step folder or a checkpoints root)"
        },
    ),
    "--global-batch": ("data.global_batch", {"help": "sequences per step over all ranks"}),
    "--micro-batches": ("data.micro_batches", {"help": "gradient accumulation (no_sync) steps"}),
    "--pp": ("parallel.pp", {"help": "pipeline stages (ranks per pipeline)"}),
    "--tp": ("parallel.tp", {"help": "tensor-parallel degree (ranks per layer)"}),
    "--cp": ("parallel.cp", {"help": "context-parallel degree (ranks per sequence; not built yet)"}),
    "--ep": ("parallel.ep", {"help": "expert-parallel degree (ranks per set of experts; not built yet)"}),
    "--dp-replicate": (
        "parallel.dp_replicate",
        {"help": "hybrid sharding: ZeRO within dp / R ranks, R replicas across (HSDP)"},
    ),
    "--schedule": (
        "parallel.schedule",
        {"help": "pipeline schedule: gpipe | 1f1b | interleaved | zb | interleaved-zb | zbv | dualpipev"},
    ),
    "--virtual-stages": (
        "parallel.virtual_stages",
        {"help": "pipeline stages per pp rank (0: 2 for interleaved and V schedules, else 1)"},
    ),
    "--pp-split": (
        "parallel.pp_split",
        {
            "help": "the blocks stages 1.. start at, e.g. blocks.3,blocks.6 "
            "(default: balanced by matrix work, the head counted)"
        },
    ),
    "--data-weights": ("data.weights", {"help": "per-rank shares, e.g. .25,.25,.10,.40"}),
    "--lr": ("optim.lr", {}),
    "--optimizer": ("optim.name", {"help": "adamw | adam | sgd"}),
    "--clip-grad-norm": ("optim.clip_grad_norm", {"help": "clip to this global norm; 0 or inf: never"}),
    "--lr-schedule": ("optim.lr_schedule", {"help": "constant | linear | cosine"}),
    "--warmup-steps": ("optim.warmup_steps", {"help": "linear learning-rate warm-up"}),
    "--min-lr": ("optim.min_lr", {"help": "the learning rate at the last step (linear, cosine)"}),
    "--bucket-mb": ("ddp.bucket_mb", {}),
    "--algorithm": ("comm.algorithm", {"help": "native | ring | tree | halving_doubling | naive | auto"}),
    "--compress": (
        "comm.compress",
        {"help": "gradient codec NAME[:PARAM]: none|fp16|bf16|int8|sign|topk:R|dgc:R|powersgd:R"},
    ),
    "--sync-every": ("diloco.sync_every", {"help": "diloco: inner steps between synchronisations (H)"}),
    "--servers": ("ps.servers", {"help": "parameter-server ranks"}),
    "--ps-mode": ("ps.mode", {"help": "sync | async"}),
    "--max-staleness": ("ps.max_staleness", {}),
    "--offload": ("zero.offload", {"help": "none | cpu | disk"}),
    "--precision": ("precision", {"help": "fp32 | bf16 | fp16 (compute dtype; fp32 masters)"}),
    "--eval-every": ("eval_every", {}),
    "--run-dir": ("run_dir", {}),
    "--checkpoint-every": ("checkpoint.every", {}),
    "--checkpoint-dir": ("checkpoint.dir", {}),
    "--max-restarts": ("max_restarts", {}),
    "--timeout-s": ("timeout_s", {}),
    "--hang-timeout-s": ("hang_timeout_s", {"help": "name a hung rank after this long; 0: off; -1: auto"}),
    "--on-nonfinite": ("on_nonfinite", {"help": "a NaN/inf loss or gradient: stop | skip (the step)"}),
}


class CLIError(Exception):
    """Reported as one line on stderr with exit code 2."""


def add_train_flags(parser: argparse.ArgumentParser, defaults: dict[str, str] | None = None) -> None:
    parser.add_argument("--config", help="TOML file; flags override it")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks (ignored under torchrun; default: one per GPU on a GPU machine, else 1)",
    )
    base = TrainConfig()
    for flag, (key, kwargs) in TRAIN_FLAGS.items():
        default = (defaults or {}).get(key, _get(base, key))
        extra = f" (default: {default})" if default not in (None, "", ()) else ""
        parser.add_argument(
            flag, dest=key, default=None, **{**kwargs, "help": kwargs.get("help", key) + extra}
        )
    parser.add_argument(
        "--find-unused-parameters", dest="ddp.find_unused_parameters", action="store_const", const="true"
    )
    parser.add_argument(
        "--tensorboard",
        dest="tensorboard",
        action="store_const",
        const="true",
        help="also write the metrics as TensorBoard events in <run-dir>/tensorboard",
    )
    parser.add_argument(
        "--trace",
        dest="trace",
        action="store_const",
        const="true",
        help="write <run-dir>/trace.json: every rank's compute and communication spans",
    )
    parser.add_argument(
        "--sync-batchnorm",
        dest="sync_batchnorm",
        action="store_const",
        const="true",
        help="BatchNorm layers normalise with the global batch's statistics, not each rank's",
    )
    parser.add_argument(
        "--activation-checkpointing",
        dest="parallel.activation_checkpointing",
        action="store_const",
        const="true",
        help="recompute each block's activations in backward instead of keeping them (less memory)",
    )
    parser.add_argument(
        "--sequence-parallel",
        dest="parallel.sequence_parallel",
        action="store_const",
        const="true",
        help="with --tp: norms and dropout each on a tp-th of the sequence",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")


def _get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


SWITCHES = {  # flag -> dotted config key, for the flags that take no value
    "--find-unused-parameters": "ddp.find_unused_parameters",
    "--sync-batchnorm": "sync_batchnorm",
    "--trace": "trace",
    "--tensorboard": "tensorboard",
    "--activation-checkpointing": "parallel.activation_checkpointing",
    "--sequence-parallel": "parallel.sequence_parallel",
}


def config_from_args(args: argparse.Namespace, defaults: dict[str, str] | None = None) -> TrainConfig:
    """Defaults, then the flags, then ``--set``; a key given twice with different values is refused
    (the later one would silently win)."""
    overrides: dict[str, Any] = dict(defaults or {})
    given: dict[str, str] = {}  # key -> how the command line set it, for the message
    flags = {key: flag for flag, (key, _) in TRAIN_FLAGS.items()}
    for key, flag in {**flags, **{k: f for f, k in SWITCHES.items()}}.items():
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
            given[key] = flag if key in SWITCHES.values() else f"{flag} {value}"
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise CLIError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = key.strip(), value.strip()
        if key in given and _differ(key, overrides[key], value):
            raise CLIError(
                f"{given[key]} and --set {key}={value} both set {key}, to different values; give it once"
            )
        overrides[key] = value
        given[key] = f"--set {key}={value}"
    _check_preset_sizes(overrides, given)
    return load_config(args.config, overrides)


def _check_preset_sizes(overrides: dict[str, Any], given: dict[str, str]) -> None:
    """A preset sizes the built-in models only: given beside another model.kind, it would be ignored."""
    kind = str(overrides.get("model.kind", ""))
    if "model.preset" in given and kind and model_source(kind) not in ("", "builtin"):
        raise CLIError(
            f"{given['model.preset']} sizes the built-in models (gpt, mlp); model.kind {kind!r} is sized by "
            "its own config or factory: drop the preset"
        )


def _differ(key: str, first: str, second: str) -> bool:
    """Whether two command-line values of ``key`` mean different things ("3" and "3.0" do not)."""
    base = TrainConfig()
    return _get(set_key(base, key, first), key) != _get(set_key(base, key, second), key)


def _nproc(args: argparse.Namespace, config: TrainConfig) -> int:
    """``--nproc``, or where it is not given one rank per GPU (device auto or cuda, on a GPU machine)."""
    from shardwise.device import default_nproc

    return int(args.nproc) if args.nproc is not None else default_nproc(config.device)


def _cmd_train(args: argparse.Namespace) -> int:
    from shardwise.commands.train import train_command

    config = config_from_args(args)
    return train_command(config, _nproc(args, config), args.json)


def _cmd_verify(args: argparse.Namespace) -> int:
    from shardwise.commands.verify import VERIFY_DEFAULTS, verify_command, verify_defaults

    first = config_from_args(args, VERIFY_DEFAULTS)  # the defaults depend on the model and strategy
    defaults = verify_defaults(first.model.kind, first.strategy, first.parallel.schedule)
    config = config_from_args(args, defaults)
    return verify_command(config, _nproc(args, config), args.json)


def _cmd_bench(args: argparse.Namespace) -> int:
    from shardwise.commands.bench import bench_command

    return bench_command(args)


def build_parser() -> argparse.ArgumentParser:
    from shardwise.commands.parser import CommandParser

    parser = CommandParser(  # and so every sub-command's parser: one line per bad flag, no abbreviations
        prog="shardwise",
        description="Distributed training on torch.distributed, each strategy verified against one process.",
    )
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train", help="train the built-in model on N ranks")
    add_train_flags(train)
    train.set_defaults(run=_cmd_train)
    from shardwise.commands.verify import VERIFY_DEFAULTS

    verify = sub.add_parser("verify", help="train with a strategy and in one process; compare")
    add_train_flags(verify, VERIFY_DEFAULTS)
    verify.set_defaults(run=_cmd_verify)
    from shardwise.commands.bench import add_bench_parser

    add_bench_parser(sub, _cmd_bench)
    from shardwise.commands.ckpt import add_ckpt_parser

    add_ckpt_parser(sub)
    from shardwise.commands.plot import add_plot_parser

    add_plot_parser(sub)
    from shardwise.commands.plan import add_plan_parser

    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # first, before the parser imports torch: a signal at any moment exits 128 + signal, in one line
    previous = signals.install()
    command = ""
    if _starts_ranks(sys.argv[1:] if argv is None else list(argv)):
        procstart.start_early()  # the ranks' imports run beside the parser's (see procstart)
    try:
        parser = build_parser()
        args = parser.parse_args(join_dashed_values(sys.argv[1:] if argv is None else list(argv)))
        if args.command is None:
            parser.print_help()
            return 0
        command = f" {args.command}"
        return int(args.run(args) or 0)
    except (ConfigError, CLIError) as exc:
        print(f"shardwise{command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM as signals.Interrupted
        print(f"shardwise{command}: {signals.describe(exc)}", file=sys.stderr)
        return signals.exit_code(exc)
    finally:
        signals.restore(previous)


_DASHED_VALUE = re.compile(r"-\.?\d")  # "-80GB", "-1e-3", "-.5": no flag of ours starts so


def join_dashed_values(argv: list[str]) -> list[str]:
    """``--flag -80GB`` as ``--flag=-80GB``. argparse takes a value that starts with a dash and is not a
    plain number (``-80GB``, ``-1e-3``) for a flag and says only "expected one argument"; joined, the
    value reaches the command's own check, which says what is wrong with it."""
    out: list[str] = []
    for arg in argv:
        flag = out[-1] if out else ""
        if _DASHED_VALUE.match(arg) and flag.startswith("--") and flag != "--" and "=" not in flag:
            out[-1] = f"{flag}={arg}"
        else:
            out.append(arg)
    return out


def _starts_ranks(argv: list[str]) -> bool:
    """Whether the command will likely start local ranks (a guess: the launcher starts what it needs)."""
    command = argv[0] if argv else ""
    one = any(a in ("--nproc=1", "--help", "-h") for a in argv) or "--nproc 1" in " ".join(argv) + " "
    return not one and (command in ("train", "verify", "bench") or (command == "plan" and "--check" in argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
