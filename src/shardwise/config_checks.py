"""What a config's fields mean together: the cross-field checks ``TrainConfig.validate`` runs after
each field's own rule (``check_values``).

One function per concern, each taking the whole ``TrainConfig`` (``shardwise.config``): the
learning-rate schedule (``check_schedule``), settings the chosen strategy would ignore
(``check_applies``, from the one table ``STRATEGY_KEYS``), DiLoCo's rounds (``check_diloco``), the
batch and its split over the data-parallel ranks (``check_batch``, with ``split_counts``, the shares'
arithmetic) and the held-out corpus (``check_corpus``). Each raises a one-line ``ConfigError`` with
the arithmetic spelled out and the fix. Pure: no filesystem, no torch. Communication: none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.config import TrainConfig

VAL_FRACTION = 0.1  # = shardwise.data.corpus.VAL_FRACTION: the held-out share of the corpus

# Which strategies read each setting (a table's name: every key in it); ``validate`` refuses a setting
# that differs from its default under any other strategy, which would otherwise train as if it were
# not there. ``zero.precision`` is absent on purpose: the deprecated spelling of ``precision``.
ZERO = ("zero1", "zero2", "zero3")
STRATEGY_KEYS: dict[str, tuple[str, ...]] = {
    "ddp": ("ddp",),
    "ps": ("ps",),
    "diloco": ("diloco",),
    "zero.offload": ZERO,
    "zero.offload_dir": ZERO,
    "zero.bucket_mb": ("zero1", "zero2"),  # stage 3 gathers and reduces per unit, not per bucket
    "zero.prefetch": ("zero3",),
    "zero.unit": ("zero3",),
}


def split_counts(global_batch: int, weights: Sequence[float], world_size: int | None = None) -> list[int]:
    """Per-rank sample counts that sum to ``global_batch``, proportional to ``weights``.

    Largest-remainder rounding (exact, with fractions): every rank gets the floor of its quota, and
    the samples left over go to the largest remainders, ties to the lower rank. Empty ``weights``
    means an equal split over ``world_size`` ranks (the remainder goes to the first ranks).
    """
    if not weights:
        if world_size is None or world_size < 1:
            raise ConfigError(f"an equal split needs world_size >= 1, got {world_size}")
        weights = [1.0] * world_size
    elif world_size is not None and len(weights) != world_size:
        raise ConfigError(f"{len(weights)} weights given for {world_size} ranks")
    if global_batch < 0:
        raise ConfigError(f"global_batch must be >= 0, got {global_batch}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ConfigError(f"weights must be finite and >= 0, got {list(weights)}")
    total = sum(Fraction(w) for w in weights)
    if total == 0:
        raise ConfigError(f"weights sum to {float(total)}; at least one rank needs a positive weight")
    quotas = [global_batch * Fraction(w) / total for w in weights]
    counts = [math.floor(q) for q in quotas]
    left = global_batch - sum(counts)
    # Largest remainder first; sorted() stays stable with reverse=True, so ties keep rank order.
    by_remainder = sorted(range(len(quotas)), key=lambda r: quotas[r] - counts[r], reverse=True)
    for rank in by_remainder[:left]:
        counts[rank] += 1
    return counts


def check_schedule(config: TrainConfig) -> None:
    """What the schedule's fields mean together (each field's own range is declared on it)."""
    optim = config.optim
    length = optim.schedule_steps or config.steps
    if optim.warmup_steps >= length:
        where = f"optim.schedule_steps({length})" if optim.schedule_steps else f"steps({config.steps})"
        raise ConfigError(
            f"optim.warmup_steps must be in [0, {where}), got {optim.warmup_steps}: "
            "a warm-up as long as the run never reaches the learning rate"
        )
    if optim.min_lr > optim.lr:
        raise ConfigError(f"optim.min_lr must be in [0, optim.lr({optim.lr})], got {optim.min_lr}")
    if config.strategy == "ps" and config.ps.mode == "async" and 0 < optim.clip_grad_norm < math.inf:
        raise ConfigError(
            "gradient clipping with the asynchronous parameter server is not built yet; "
            "use ps.mode = sync or optim.clip_grad_norm = 0"
        )


def check_applies(config: TrainConfig) -> None:
    """Refuse settings the chosen strategy would silently ignore (``STRATEGY_KEYS``)."""
    ignored = ignored_settings(config)
    if ignored:
        them, they = ("it", "it belongs") if len(ignored) == 1 else ("them", "they belong")
        raise ConfigError(
            f"{config.strategy} does not read {', '.join(ignored)}: remove {them} or choose the strategy "
            f"{they} to"
        )
    if config.comm.profile and config.comm.algorithm != "auto":  # only auto consults the cost model
        raise ConfigError(
            f"comm.profile = {config.comm.profile!r} applies to comm.algorithm = 'auto', not "
            f"{config.comm.algorithm!r}: remove it or set comm.algorithm = auto"
        )
    if config.zero.offload_dir and config.zero.offload != "disk":
        raise ConfigError(
            f"zero.offload_dir = {config.zero.offload_dir!r} applies to zero.offload = 'disk', not "
            f"{config.zero.offload!r}: remove it or set zero.offload = disk"
        )
    if config.strategy == "ps" and config.compute_precision == "fp16":
        raise ConfigError(
            "fp16 with the parameter server is not built yet (its loss scale would travel with every "
            "push); use precision = bf16"
        )
    if config.precision != "fp32" and config.zero.precision not in ("fp32", config.precision):
        raise ConfigError(
            f"precision = {config.precision!r} and the deprecated zero.precision = {config.zero.precision!r} "
            "disagree; set only precision"
        )


def check_diloco(config: TrainConfig) -> None:
    diloco = config.diloco
    if diloco.sync_every < 1:
        raise ConfigError(f"diloco.sync_every must be >= 1, got {diloco.sync_every}")
    if not diloco.outer_lr > 0 or not 0 <= diloco.outer_momentum < 1:
        raise ConfigError(
            f"diloco.outer_lr must be > 0 and diloco.outer_momentum in [0, 1); got "
            f"{diloco.outer_lr}, {diloco.outer_momentum}"
        )
    every = config.checkpoint.every
    if config.strategy == "diloco" and every > 0 and every % diloco.sync_every:
        raise ConfigError(
            f"diloco saves checkpoints at synchronisations: checkpoint.every({every}) must be a multiple "
            f"of diloco.sync_every({diloco.sync_every})"
        )


def check_batch(config: TrainConfig, dp: int) -> None:
    data = config.data
    if data.weights and len(data.weights) != dp:
        raise ConfigError(
            f"data.weights has {len(data.weights)} entries but there are {dp} data-parallel ranks"
        )
    if data.weights and (min(data.weights) < 0 or sum(data.weights) <= 0):
        raise ConfigError(f"data.weights must be >= 0 with a positive sum, got {list(data.weights)}")
    if data.global_batch < dp and not data.weights:
        raise ConfigError(
            f"data.global_batch({data.global_batch}) is smaller than the {dp} data-parallel ranks: "
            f"every rank needs at least one sequence"
        )
    check_micro_batches(config, dp)


def check_micro_batches(config: TrainConfig, dp: int) -> None:
    """No more micro-batches than the rank with the most rows has rows a step: past that every
    further one is empty on every rank, and each costs a pass and its schedule's actions (10^8 of
    them never finish building). A rank with fewer rows, or none, runs empty ones, as now."""
    data = config.data
    counts = split_counts(data.global_batch, data.weights or [1.0] * dp)
    most = max(counts)
    if data.micro_batches <= most:
        return
    if data.weights:
        rank = counts.index(most)
        share = Fraction(data.weights[rank]) / sum(Fraction(w) for w in data.weights)
        arithmetic = (
            f"data.global_batch({data.global_batch}) x the share of dp rank {rank} "
            f"({float(share):.4g} of data.weights {list(data.weights)}) = {most} rows"
        )
    else:
        arithmetic = f"data.global_batch({data.global_batch}) / dp({dp}) = {most} rows"
        arithmetic += " (rounded up)" if data.global_batch % dp else ""
    raise ConfigError(
        f"data.micro_batches({data.micro_batches}) is more than the rows a rank has a step: "
        f"{arithmetic} on the rank with the most, so at most {most} micro-batches of a row each; "
        f"lower data.micro_batches to at most {most} or raise data.global_batch"
    )


def check_corpus(config: TrainConfig) -> None:
    """A window of seq_len + 1 tokens must fit the held-out share of the corpus, and evaluation must
    find its windows there (the built-in GPT's context is ``shardwise.config.check_context``)."""
    held_out = int(config.data.corpus_bytes * VAL_FRACTION)
    if held_out < config.model.seq_len + 1:
        need = math.ceil((config.model.seq_len + 1) / VAL_FRACTION)
        raise ConfigError(
            f"model.seq_len({config.model.seq_len}) + 1 tokens do not fit in the held-out "
            f"{VAL_FRACTION:.0%} of data.corpus_bytes({config.data.corpus_bytes}); raise "
            f"data.corpus_bytes to at least {need} or lower model.seq_len"
        )
    # evaluation reads eval_batches x global_batch windows spread over the held-out tokens; more
    # than it has distinct windows only repeats them (and a huge count never finishes building)
    windows = held_out - config.model.seq_len
    wanted = config.eval_batches * config.data.global_batch
    if wanted > windows:
        raise ConfigError(
            f"eval_batches({config.eval_batches}) x data.global_batch({config.data.global_batch}) = {wanted} "
            f"held-out windows, but the held-out {VAL_FRACTION:.0%} of data.corpus_bytes"
            f"({config.data.corpus_bytes}) = {held_out} tokens has {held_out} - model.seq_len"
            f"({config.model.seq_len}) = {windows} distinct windows; lower eval_batches to at most "
            f"{windows // config.data.global_batch} or raise data.corpus_bytes"
        )


def ignored_settings(config: TrainConfig) -> list[str]:
    """``key = value (ps only)`` for each setting of ``config`` that its strategy does not read."""
    default = type(config)()  # the defaults: the class called with none given
    found = []
    for where, strategies in STRATEGY_KEYS.items():
        if config.strategy in strategies:
            continue
        value, base = _get_key(config, where), _get_key(default, where)
        pairs = (
            [(f"{where}.{f.name}", getattr(value, f.name), getattr(base, f.name)) for f in fields(value)]
            if dataclasses.is_dataclass(value)
            else [(where, value, base)]
        )
        found += [
            f"{key} = {_show(now)} ({'/'.join(strategies)} only)" for key, now, was in pairs if now != was
        ]
    return found


def _get_key(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)
