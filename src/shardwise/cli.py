"""``shardwise`` command line: train, verify, bench, ckpt.

Flags map onto dotted config keys (``--bucket-mb`` is ``ddp.bucket_mb``); ``--set key=value`` reaches
any other key. A config that does not add up is reported in one line, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from shardwise.config import ConfigError, TrainConfig, load_config

# flag -> (dotted config key, argparse kwargs)
TRAIN_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--strategy": ("strategy", {"help": "ddp | ps | zero1 | zero2 | zero3 | diloco"}),
    "--steps": ("steps", {"help": "optimizer steps"}),
    "--seed": ("seed", {}),
    "--dtype": ("dtype", {"help": "float32 | float64"}),
    "--model": ("model.kind", {"help": "gpt | mlp"}),
    "--preset": ("model.preset", {"help": "model size: tiny | odd | small | base | medium | large"}),
    "--seq-len": ("model.seq_len", {}),
    "--global-batch": ("data.global_batch", {"help": "sequences per step over all ranks"}),
    "--micro-batches": ("data.micro_batches", {"help": "gradient accumulation (no_sync) steps"}),
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
    "--precision": ("zero.precision", {"help": "fp32 | bf16 | fp16"}),
    "--eval-every": ("eval_every", {}),
    "--run-dir": ("run_dir", {}),
    "--checkpoint-every": ("checkpoint.every", {}),
    "--checkpoint-dir": ("checkpoint.dir", {}),
    "--max-restarts": ("max_restarts", {}),
    "--timeout-s": ("timeout_s", {}),
}


class CLIError(Exception):
    """Reported as one line on stderr with exit code 2."""


def add_train_flags(parser: argparse.ArgumentParser, defaults: dict[str, str] | None = None) -> None:
    parser.add_argument("--config", help="TOML file; flags override it")
    parser.add_argument("--nproc", type=int, default=1, help="local ranks (ignored under torchrun)")
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
        "--sync-batchnorm",
        dest="sync_batchnorm",
        action="store_const",
        const="true",
        help="BatchNorm layers normalise with the global batch's statistics, not each rank's",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")


def _get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def config_from_args(args: argparse.Namespace, defaults: dict[str, str] | None = None) -> TrainConfig:
    overrides: dict[str, Any] = dict(defaults or {})
    for key in [k for k, _ in TRAIN_FLAGS.values()] + ["ddp.find_unused_parameters", "sync_batchnorm"]:
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise CLIError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value.strip()
    return load_config(args.config, overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from shardwise.commands.train import train_command

    return train_command(config_from_args(args), args.nproc, args.json)


def _cmd_verify(args: argparse.Namespace) -> int:
    from shardwise.commands.verify import VERIFY_DEFAULTS, verify_command

    return verify_command(config_from_args(args, VERIFY_DEFAULTS), args.nproc, args.json)


def _cmd_bench(args: argparse.Namespace) -> int:
    from shardwise.commands.bench import bench_command

    return bench_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except (ConfigError, CLIError) as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"shardwise {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
