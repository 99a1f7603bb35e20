"""``shardwise plan --dry-run``: the layout the flags name, one rank of it run here on no memory.

The flags name one layout: one strategy (``--strategies``), one ``--pp`` and one ``--tp`` (1 when
left out) on ``--devices`` ranks (up to 1,024); dp is what is left. The model is the planner's
(``--preset``, ``--model hf:PATH``, or sizes by hand as a built-in GPT). What the rank holds after a
step is printed by component beside the planner's model state (:mod:`shardwise.bench.dry_run`).
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from shardwise.commands.output import emit
from shardwise.config import ConfigError, ModelConfig, TrainConfig, load_config
from shardwise.planner.layout import GB, Layout, Training
from shardwise.planner.model import ModelShape


def _one(text: str | None, flag: str) -> int:
    if not text:
        return 1
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--dry-run runs one layout: give one {flag} degree, got {flag} {text!r}") from None


def dry_run_layout(args: argparse.Namespace, strategies: list[str], micro_batches: int) -> Layout:
    """The one layout the flags name, or a one-line ``ConfigError`` saying which flag to narrow."""
    if len(strategies) != 1:
        given = ",".join(strategies)
        raise ConfigError(f"--dry-run runs one layout: give one strategy, got --strategies {given}")
    from shardwise.bench.dry_run import MAX_DEVICES

    if args.devices is None or not 1 <= args.devices <= MAX_DEVICES:
        given = "none given" if args.devices is None else f"got --devices {args.devices}"
        raise ConfigError(f"--dry-run runs one rank of 1 to {MAX_DEVICES} devices ({given})")
    pp, tp = _one(args.pp, "--pp"), _one(args.tp, "--tp")
    if pp < 1 or tp < 1 or args.devices % (pp * tp):
        raise ConfigError(f"--devices {args.devices} is not divisible by pp({pp}) x tp({tp}) = {pp * tp}")
    return Layout(strategies[0], dp=args.devices // (pp * tp), pp=pp, tp=tp, micro_batches=micro_batches)


def _maker(args: argparse.Namespace, shape: ModelShape, config: TrainConfig) -> Any:
    """How the model is built (on meta, its initialisation recorded), as training builds it."""
    from shardwise.models import build_model
    from shardwise.models.adapters import model_of_shape
    from shardwise.models.init_replay import build_recorded

    if args.preset or args.model:
        return lambda: build_model(config.model, meta=True)
    if args.kv_heads and args.kv_heads != args.heads:
        raise ConfigError("--dry-run builds sizes by hand as the built-in GPT, which has no --kv-heads")
    def make() -> nn.Module:
        return build_recorded(lambda: model_of_shape(shape))

    return make


def dry_run_command(
    args: argparse.Namespace, shape: ModelShape, training: Training, strategies: list[str]
) -> int:
    from shardwise.bench.dry_run import dry_run

    pp = _one(args.pp, "--pp")
    layout = dry_run_layout(args, strategies, micro_batches=pp if pp > 1 else 1)
    overrides = {
        "model.kind": args.model or ModelConfig().kind, "model.preset": args.preset or ModelConfig().preset,
        "model.seq_len": str(training.seq_len), "precision": training.precision,
        "optim.name": training.optimizer, "data.global_batch": str(training.global_batch),
        "strategy": layout.strategy, "parallel.pp": str(layout.pp), "parallel.tp": str(layout.tp),
        "data.micro_batches": str(layout.micro_batches), "steps": "2", "eval_every": "0",
    }  # fmt: skip
    config = load_config(None, overrides)
    result = dry_run(config, args.devices, _maker(args, shape, config), shape, layout)
    emit(result, args.json, _render)
    return 0


def _render(result: dict[str, Any]) -> None:
    print(
        f"{result['model']}; {result['layout']} on {result['devices']} devices: rank {result['rank']} run "
        f"here on the meta device ({result['seconds']:.1f} s), what it holds after a step beside the planner"
    )
    held, planned = result["held_bytes"], result["planner_model_state"]
    print(f"  {'component':<16}{'held GB':>10}{'planner GB':>12}")
    for part in ("params", "master_params", "grads", "optimizer_state"):
        print(f"  {part:<16}{held[part] / GB:>10.3f}{planned[part] / GB:>12.3f}")
    print(f"  {'model state':<16}{result['held_model_state_bytes'] / GB:>10.3f}"
          f"{result['planner_model_state_bytes'] / GB:>12.3f}   held / planner {result['ratio']:.3f}")
    print(f"  {'buffers':<16}{held['buffers'] / GB:>10.3f}")
