"""Frozen configuration dataclasses, read from TOML and overridden by dotted keys.

A run is described by one ``TrainConfig`` that nests one config per concern. ``load_config`` reads a
TOML file whose tables mirror the nesting (``[model]``, ``[data]``, ``[ddp]`` ...) and then applies
overrides such as ``{"data.global_batch": "32"}`` coming from CLI flags. Every check raises
``ConfigError`` with the arithmetic spelled out, so the CLI can print it as one line.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

STRATEGIES = ("ddp", "ps", "zero1", "zero2", "zero3", "diloco")
ALGORITHMS = ("native", "ring", "tree", "halving_doubling", "naive", "auto")


class ConfigError(ValueError):
    """A configuration that does not add up; the message says why and what to change."""


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "gpt"  # gpt | mlp
    preset: str = "small"  # see shardwise.models.PRESETS
    seq_len: int = 64
    dropout: float = 0.0
    tie_weights: bool = True
    freeze: tuple[str, ...] = ()  # parameter-name prefixes that stay frozen


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = -1  # -1: whatever the world leaves after pp and tp (and the parameter servers)
    pp: int = 1
    tp: int = 1
    activation_checkpointing: bool = False  # recompute each block's activations in backward

    def resolve(self, world_size: int, servers: int = 0) -> ParallelConfig:
        """Fill in dp and check that the degrees multiply to the world size (see ``ParallelDims``)."""
        return replace(self, dp=ParallelDims.build(self, world_size, servers).dp)


@dataclass(frozen=True)
class ParallelDims:
    """The validated degrees of a job: ``servers + dp x pp x tp`` ranks.

    The ranks that train form the mesh (dp x pp x tp, row-major, tp fastest); parameter servers, when
    there are any, are the first ``servers`` global ranks and stand outside it. Pure arithmetic, so the
    planner and the launcher can use it without processes.
    """

    dp: int
    pp: int = 1
    tp: int = 1
    servers: int = 0

    @classmethod
    def build(cls, parallel: ParallelConfig, world_size: int, servers: int = 0) -> ParallelDims:
        """Resolve ``parallel.dp`` (-1) and check the arithmetic against a world of ``world_size``."""
        for name in ("pp", "tp"):
            if getattr(parallel, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(parallel, name)}")
        if parallel.dp < 1 and parallel.dp != -1:
            raise ConfigError(f"parallel.dp must be >= 1, or -1 for what the world leaves; got {parallel.dp}")
        trainers = world_size - servers
        if servers < 0 or trainers < 1:
            raise ConfigError(
                f"the parameter server needs at least one server and one worker: {world_size} ranks - "
                f"{servers} servers = {trainers} workers"
            )
        model_ranks = parallel.pp * parallel.tp
        dp = parallel.dp
        if dp == -1:
            if trainers % model_ranks:
                raise ConfigError(
                    f"pp({parallel.pp}) x tp({parallel.tp}) = {model_ranks} does not divide the world "
                    f"of {_ranks(trainers, servers)}"
                )
            dp = trainers // model_ranks
        total = dp * model_ranks
        if total != trainers:
            raise ConfigError(
                f"dp({dp}) x pp({parallel.pp}) x tp({parallel.tp}) = {total}, but the world has "
                f"{_ranks(trainers, servers)}"
            )
        return cls(dp, parallel.pp, parallel.tp, servers)

    @property
    def world_size(self) -> int:
        return self.servers + self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh's shape over the ranks that train: (dp, pp, tp)."""
        return (self.dp, self.pp, self.tp)


def _ranks(trainers: int, servers: int) -> str:
    if servers:
        return f"{trainers} ranks that train ({trainers + servers} ranks - {servers} servers)"
    return f"{trainers} ranks"


@dataclass(frozen=True)
class DataConfig:
    global_batch: int = 16  # sequences per optimizer step, summed over all data-parallel ranks
    micro_batches: int = 1  # gradient accumulation: each rank's share is split this many ways
    weights: tuple[float, ...] = ()  # per-rank share of the global batch; empty = equal
    corpus_bytes: int = 4_000_000


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"  # adamw | adam | sgd
    lr: float = 3e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    momentum: float = 0.9  # sgd only
    # clip gradients to this global norm (every element of every shard counted once); 0 or inf: never
    # clip (the norm is still measured and reported)
    clip_grad_norm: float = 0.0
    lr_schedule: str = "constant"  # constant | linear | cosine: decay after the warm-up to min_lr
    warmup_steps: int = 0  # linear warm-up from lr / (warmup_steps + 1) up to lr
    min_lr: float = 0.0  # where linear and cosine decay end, at the last step


@dataclass(frozen=True)
class DDPConfig:
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True


@dataclass(frozen=True)
class CommConfig:
    algorithm: str = "native"  # one of ALGORITHMS
    profile: str = ""  # cost-model profile for "auto"; "": the one `shardwise bench comm` saved, if any
    # gradient compression (shardwise.compression): "" = no codec layer; NAME[:PARAM], one of none | fp16 |
    # bf16 | int8[:CHUNK] | sign[:CHUNK] | topk:RATIO | dgc:RATIO | powersgd:RANK
    compress: str = ""
    compress_start_step: int = 0  # reductions of each bucket sent uncompressed first (PowerSGD's start iter)
    compress_warmup_steps: int = 0  # topk/dgc: DGC's exponential sparsity warm-up, in reductions
    compress_momentum: float = 0.9  # dgc: momentum correction
    compress_min_rate: float = 2.0  # powersgd: compress a matrix only if (n + m) r * this < n m
    compress_epsilon: float = 0.0  # powersgd: orthogonalization epsilon
    compress_seed: int = 0  # powersgd: the seed of the initial Q


@dataclass(frozen=True)
class ZeroConfig:
    offload: str = "none"  # none | cpu | disk
    offload_dir: str = ""
    precision: str = "fp32"  # fp32 | bf16 | fp16
    bucket_mb: float = 25.0
    prefetch: bool = True
    unit: str = "blocks"  # module holding the stage-3 units: each child is all-gathered as one


@dataclass(frozen=True)
class PSConfig:
    servers: int = 1
    mode: str = "sync"  # sync | async
    max_staleness: int = 4
    # async: a push s versions behind is applied with lr / (1 + s) (Zhang et al., 2016); false: lr as is
    staleness_lr: bool = True


@dataclass(frozen=True)
class DiLoCoConfig:
    """Local SGD / DiLoCo (Douillard et al. 2023): H inner steps per rank, then an outer step."""

    sync_every: int = 16  # H: inner steps between synchronisations
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov momentum of the outer SGD (0: plain SGD)
    compress: bool = True  # reduce the pseudo-gradient through comm.compress when it is set


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # empty: <run_dir>/checkpoints
    every: int = 0  # steps between checkpoints; 0 = only at the end when dir is set
    keep: int = 3
    async_save: bool = False
    resume: bool = True


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "ddp"
    steps: int = 40
    seed: int = 0
    dtype: str = "float32"  # float32 | float64
    eval_every: int = 10
    eval_batches: int = 4
    log_every: int = 1
    run_dir: str = "runs/latest"
    timeout_s: float = 300.0
    max_restarts: int = 0
    sync_batchnorm: bool = False  # BatchNorm layers use the global batch's statistics (over dp)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self, world_size: int) -> TrainConfig:
        """Check the config against a world of ``world_size`` ranks; return it with dp resolved."""
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("comm.algorithm", self.comm.algorithm, ALGORITHMS)
        _check_choice("dtype", self.dtype, ("float32", "float64"))
        _check_choice("model.kind", self.model.kind, ("gpt", "mlp"))
        _check_choice("optim.name", self.optim.name, ("adamw", "adam", "sgd"))
        self._check_schedule()
        _check_choice("zero.offload", self.zero.offload, ("none", "cpu", "disk"))
        _check_choice("zero.precision", self.zero.precision, ("fp32", "bf16", "fp16"))
        _check_choice("ps.mode", self.ps.mode, ("sync", "async"))
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if world_size < 1:
            raise ConfigError(f"the world needs at least one rank, got {world_size}")
        if (
            self.strategy == "ps"
            and self.ps.mode == "async"
            and (self.checkpoint.dir or self.checkpoint.every)
        ):
            raise ConfigError(
                "checkpoints of the parameter server need ps.mode = sync (asynchronous servers have no "
                "common step to save at); drop checkpoint.dir/checkpoint.every or set ps.mode = sync"
            )
        self._check_applies()
        self._check_diloco()
        dims = self.dims(world_size)
        self._check_batch(dims.dp)
        return replace(self, parallel=replace(self.parallel, dp=dims.dp))

    def dims(self, world_size: int) -> ParallelDims:
        """The job's validated degrees in a world of ``world_size`` ranks."""
        return ParallelDims.build(self.parallel, world_size, self.ps.servers if self.strategy == "ps" else 0)

    def _check_schedule(self) -> None:
        optim = self.optim
        _check_choice("optim.lr_schedule", optim.lr_schedule, ("constant", "linear", "cosine"))
        if not optim.clip_grad_norm >= 0:  # also refuses NaN
            raise ConfigError(
                f"optim.clip_grad_norm must be >= 0 (0 or inf: do not clip), got {optim.clip_grad_norm}"
            )
        if not 0 <= optim.warmup_steps < self.steps:
            raise ConfigError(
                f"optim.warmup_steps must be in [0, steps({self.steps})), got {optim.warmup_steps}: "
                "a warm-up as long as the run never reaches the learning rate"
            )
        if not 0 <= optim.min_lr <= optim.lr:
            raise ConfigError(f"optim.min_lr must be in [0, optim.lr({optim.lr})], got {optim.min_lr}")
        if self.strategy == "ps" and self.ps.mode == "async" and 0 < optim.clip_grad_norm < float("inf"):
            raise ConfigError(
                "gradient clipping with the asynchronous parameter server is not built yet; "
                "use ps.mode = sync or optim.clip_grad_norm = 0"
            )

    def _check_applies(self) -> None:
        """Refuse settings the chosen strategy would silently ignore."""
        zero_only = {
            "zero.precision": (self.zero.precision, "fp32"),
            "zero.offload": (self.zero.offload, "none"),
        }
        for key, (value, default) in zero_only.items():
            if value != default and not self.strategy.startswith("zero"):
                raise ConfigError(f"{key} = {value!r} applies to zero1/zero2/zero3, not to {self.strategy}")

    def _check_diloco(self) -> None:
        diloco = self.diloco
        if diloco.sync_every < 1:
            raise ConfigError(f"diloco.sync_every must be >= 1, got {diloco.sync_every}")
        if not diloco.outer_lr > 0 or not 0 <= diloco.outer_momentum < 1:
            raise ConfigError(
                f"diloco.outer_lr must be > 0 and diloco.outer_momentum in [0, 1); got "
                f"{diloco.outer_lr}, {diloco.outer_momentum}"
            )
        every = self.checkpoint.every
        if self.strategy == "diloco" and every > 0 and every % diloco.sync_every:
            raise ConfigError(
                f"diloco saves checkpoints at synchronisations: checkpoint.every({every}) must be a multiple "
                f"of diloco.sync_every({diloco.sync_every})"
            )

    def _check_batch(self, dp: int) -> None:
        data = self.data
        if data.weights and len(data.weights) != dp:
            raise ConfigError(
                f"data.weights has {len(data.weights)} entries but there are {dp} data-parallel ranks"
            )
        if data.weights and (min(data.weights) < 0 or sum(data.weights) <= 0):
            raise ConfigError(f"data.weights must be >= 0 with a positive sum, got {list(data.weights)}")
        if data.micro_batches < 1:
            raise ConfigError(f"data.micro_batches must be >= 1, got {data.micro_batches}")
        if data.global_batch < dp and not data.weights:
            raise ConfigError(
                f"data.global_batch({data.global_batch}) is smaller than the {dp} data-parallel ranks: "
                f"every rank needs at least one sequence"
            )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Read a TOML file (optional) and apply dotted-key overrides on top of the defaults."""
    config = TrainConfig()
    if path is not None:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        config = _merge(config, table, prefix="")
    for key, value in (overrides or {}).items():
        config = set_key(config, key, value)
    return config


def set_key(config: Any, dotted: str, value: Any, _prefix: str = "") -> Any:
    """Return a copy of ``config`` with the field at ``dotted`` (e.g. ``"ddp.bucket_mb"``) replaced."""
    head, _, rest = dotted.partition(".")
    names = {f.name: f for f in fields(config)}
    if head not in names:
        known = ", ".join(sorted(names))
        raise ConfigError(f"unknown config key {_prefix + dotted!r}; known here: {known}")
    current = getattr(config, head)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"{_prefix + head!r} has no sub-keys (got {_prefix + dotted!r})")
        return replace(config, **{head: set_key(current, rest, value, f"{_prefix}{head}.")})
    hint = typing.get_type_hints(type(config))[head]
    return replace(config, **{head: _coerce(_prefix + dotted, value, hint)})


def _merge(config: Any, table: Mapping[str, Any], prefix: str) -> Any:
    for key, value in table.items():
        if isinstance(value, Mapping):
            sub = getattr(config, key, None)
            if not dataclasses.is_dataclass(sub):
                tables = ", ".join(_tables(config))
                raise ConfigError(f"unknown config table [{prefix}{key}]; known tables: {tables}")
            config = replace(config, **{key: _merge(sub, value, prefix=f"{prefix}{key}.")})
        else:
            config = set_key(config, key, value, prefix)
    return config


def _tables(config: Any) -> list[str]:
    return [f.name for f in fields(config) if dataclasses.is_dataclass(getattr(config, f.name))]


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Turn a TOML value or a CLI string into the field's type, or say why not."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    try:
        if origin is tuple:
            (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            return tuple(_coerce(name, v, item) for v in value)
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            return bool(value)
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return hint(value)
    except ConfigError:
        raise  # an item of a tuple, already named
    except (TypeError, ValueError):
        raise ConfigError(f"{name} expects {getattr(hint, '__name__', hint)}, got {value!r}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """A plain, JSON-ready dict of a config (tuples become lists)."""
    return dataclasses.asdict(config)
