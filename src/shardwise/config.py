"""Frozen configuration dataclasses, read from TOML and overridden by dotted keys.

A run is described by one ``TrainConfig`` that nests one config per concern. ``load_config`` reads a
TOML file whose tables mirror the nesting (``[model]``, ``[data]``, ``[ddp]`` ...) and then applies
overrides such as ``{"data.global_batch": "32"}`` coming from CLI flags (the reading, merging and
coercion live in ``shardwise.config_load``). Every check raises ``ConfigError`` with the arithmetic
spelled out, so the CLI can print it as one line.

What each value may be is declared on its field (``checked(default, Range(gt=0))``: bounds, always
finite; ``OneOf``; ``NonEmpty``; the rules live in ``shardwise.config_rules``), and
``TrainConfig.validate`` applies every declaration (``check_values``), then checks what the values mean
together (``shardwise.config_checks``; the model's kind and the built-in GPT's context are checked
here, in the schema of the kinds a user may write). Validation is pure: it touches no filesystem
(``preflight`` tries the folders a run writes); only ``load_config`` reads the TOML file it is given.
Communication: none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardwise.config_checks import STRATEGY_KEYS as STRATEGY_KEYS  # re-exported: the strategies' table
from shardwise.config_checks import VAL_FRACTION as VAL_FRACTION  # re-exported: a test pins it to corpus
from shardwise.config_checks import check_applies, check_batch, check_corpus, check_diloco, check_schedule
from shardwise.config_checks import split_counts as split_counts  # re-exported: the shares' arithmetic
from shardwise.config_load import check_values, merge_table, read_toml, set_key
from shardwise.config_load import to_dict as to_dict  # re-exported: callers import it from here
from shardwise.config_rules import RULE as RULE  # re-exported: callers read a field's rule by it
from shardwise.config_rules import NonEmpty, OneOf, Range, checked
from shardwise.dims import ParallelDims
from shardwise.errors import ConfigError

STRATEGIES = ("ddp", "ps", "zero1", "zero2", "zero3", "diloco")
ALGORITHMS = ("native", "ring", "tree", "halving_doubling", "naive", "auto")

# Bounds set elsewhere: numpy takes 32-bit seeds; gloo cannot connect within less than a second.
MAX_SEED = 2**32 - 1
MIN_TIMEOUT_S = 1
MIN_CORPUS_BYTES = 1024  # = shardwise.data.corpus.MIN_BYTES (a test keeps them equal)
# the built-in GPT's context: its position table has seq_len rows and its attention costs seq_len^2 per
# head and sequence, so a longer window is a typo, not a run (GPT-3's context; GPT-2's is 1024)
MAX_GPT_SEQ_LEN = 2048


@dataclass(frozen=True)
class ModelConfig:
    # gpt | mlp | hf:PATH/config.json | hf:tiny-gpt2 | hf:tiny-llama | package.module:function
    kind: str = "gpt"  # checked by check_model_kind
    preset: str = "small"  # see shardwise.models.PRESETS (checked there)
    seq_len: int = checked(64, Range(ge=1))
    dropout: float = checked(0.0, Range(ge=0, lt=1))
    tie_weights: bool = True
    freeze: tuple[str, ...] = ()  # parameter-name prefixes that stay frozen
    # local weights to start from (a Hugging Face folder of safetensors, a `shardwise ckpt export` file,
    # or a shardwise checkpoint); "": the model's own random initialisation, recorded and replayed
    # (shardwise.models.init_replay). Each rank reads only what it holds. See shardwise.checkpoint.pretrained
    init_from: str = ""


@dataclass(frozen=True)
class ParallelConfig:
    # -1: whatever the world leaves after pp and tp (and the parameter servers)
    dp: int = checked(-1, Range(ge=1, also=(-1,), note="or -1 for what the world leaves"))
    pp: int = checked(1, Range(ge=1))
    tp: int = checked(1, Range(ge=1))
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # the pipeline schedule (pp > 1): gpipe | 1f1b | interleaved | zb | interleaved-zb | zbv | dualpipev
    schedule: str = checked(
        "1f1b", OneOf(("gpipe", "1f1b", "interleaved", "zb", "interleaved-zb", "zbv", "dualpipev"))
    )
    # stages per pp rank (interleaved: >= 2; V: 2); 0: the schedule's own (``stages_per_rank``)
    virtual_stages: int = checked(
        0, Range(ge=1, also=(0,), note="or 0 for the schedule's own (2 for interleaved and V, else 1)")
    )
    # a zero-bubble schedule keeps its split backwards only where the run's own timings say they pay
    # (pipeline/fitting.py); false: every step runs the schedule as built
    fit_schedule: bool = True
    # the block each stage after the first starts at, by its name in the model ("blocks.3", "blocks.6":
    # pp x virtual_stages - 1 of them, in order); empty: balanced by matrix work (the head's counted)
    pp_split: tuple[str, ...] = ()
    # tp > 1: norms and dropout on a tp-th of the sequence each (Korthikanti et al., 2022)
    sequence_parallel: bool = False
    # hybrid sharding (HSDP, ZeRO++'s hpZ): ZeRO shards within groups of dp / dp_replicate ranks and
    # the groups replicate, so gathers stay in a group (a node); 1: shard over the whole dp axis
    dp_replicate: int = checked(1, Range(ge=1))
    # context parallelism: each sequence cut over cp ranks (not built yet: cp > 1 is refused)
    cp: int = checked(1, Range(ge=1))
    # expert parallelism: experts spread over ep ranks carved from dp x cp (not built yet: ep > 1 is refused)
    ep: int = checked(1, Range(ge=1))

    @property
    def stages_per_rank(self) -> int:
        """``virtual_stages``, or where it is 0 the schedule's own: 2 for interleaved, interleaved-zb
        (the smallest interleaving) and the V schedules zbv and dualpipev (two stages per rank), else 1."""
        if self.virtual_stages:
            return self.virtual_stages
        return 2 if self.schedule in ("interleaved", "interleaved-zb", "zbv", "dualpipev") else 1

    def resolve(self, world_size: int, servers: int = 0) -> ParallelConfig:
        """Fill in dp and check that the degrees multiply to the world size (see ``ParallelDims``)."""
        return replace(self, dp=ParallelDims.build(self, world_size, servers).dp)


@dataclass(frozen=True)
class DataConfig:
    # sequences per optimizer step, summed over all data-parallel ranks
    global_batch: int = checked(16, Range(ge=1))
    # gradient accumulation: each rank's share is split this many ways (at most the rows of the rank
    # with the most: data.global_batch x its share)
    micro_batches: int = checked(1, Range(ge=1))
    # per-rank share of the global batch; empty = equal
    weights: tuple[float, ...] = checked((), Range(ge=0))
    corpus_bytes: int = checked(4_000_000, Range(ge=MIN_CORPUS_BYTES))


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = checked("adamw", OneOf(("adamw", "adam", "sgd")))
    lr: float = checked(3e-3, Range(gt=0))
    weight_decay: float = checked(0.0, Range(ge=0))
    beta1: float = checked(0.9, Range(ge=0, lt=1))
    beta2: float = checked(0.95, Range(ge=0, lt=1))
    momentum: float = checked(0.9, Range(ge=0, lt=1))  # sgd only
    # clip gradients to this global norm (every element of every shard counted once); 0 or inf: never
    # clip (the norm is still measured and reported)
    clip_grad_norm: float = checked(0.0, Range(ge=0, also=(math.inf,)))
    # constant | linear | cosine: after the warm-up, decay to min_lr at the last step
    lr_schedule: str = checked("constant", OneOf(("constant", "linear", "cosine")))
    warmup_steps: int = checked(0, Range(ge=0))  # linear warm-up from lr / (warmup_steps + 1) up to lr
    min_lr: float = checked(0.0, Range(ge=0))  # where linear and cosine decay end
    # the schedule's length in steps; 0: the run's. A longer run stays at min_lr past it (to train on
    # with the very schedule of a shorter run, as `bench compress --link` does)
    schedule_steps: int = checked(0, Range(ge=0))


@dataclass(frozen=True)
class DDPConfig:
    bucket_mb: float = checked(25.0, Range(gt=0))
    first_bucket_mb: float = checked(1.0, Range(gt=0))
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True


@dataclass(frozen=True)
class CommConfig:
    algorithm: str = checked("native", OneOf(ALGORITHMS))
    profile: str = ""  # cost-model profile for "auto"; "": the one `shardwise bench comm` saved, if any
    # gradient compression (shardwise.compression): "" = no codec layer; NAME[:PARAM], one of none | fp16 |
    # bf16 | int8[:CHUNK] | sign[:CHUNK] | topk:RATIO | dgc:RATIO | powersgd:RANK
    compress: str = ""
    # reductions of each bucket sent uncompressed first (PowerSGD's start iter)
    compress_start_step: int = checked(0, Range(ge=0))
    # topk/dgc: DGC's exponential sparsity warm-up, in reductions
    compress_warmup_steps: int = checked(0, Range(ge=0))
    compress_momentum: float = checked(0.9, Range(ge=0, lt=1))  # dgc: momentum correction
    # powersgd: compress a matrix only if (n + m) r * this < n m
    compress_min_rate: float = checked(2.0, Range(gt=0))
    compress_epsilon: float = checked(0.0, Range(ge=0))  # powersgd: orthogonalization epsilon
    compress_seed: int = checked(0, Range(ge=0, le=MAX_SEED))  # powersgd: the seed of the initial Q


@dataclass(frozen=True)
class ZeroConfig:
    offload: str = checked("none", OneOf(("none", "cpu", "disk")))
    offload_dir: str = ""  # "": a temporary folder
    # deprecated: the top-level ``precision`` (read when that is left at fp32, with a notice)
    precision: str = checked("fp32", OneOf(("fp32", "bf16", "fp16")))
    bucket_mb: float = checked(25.0, Range(gt=0))
    prefetch: bool = True
    # dotted path of the list whose children are the stage-3 units, each all-gathered as one
    # ("transformer.h"); empty: the model's adapter's block list, else the largest ModuleList/Sequential
    # of one class of blocks (models/adapters/blocks.py)
    unit: str = ""


@dataclass(frozen=True)
class PSConfig:
    servers: int = checked(1, Range(ge=1))
    mode: str = checked("sync", OneOf(("sync", "async")))
    max_staleness: int = checked(4, Range(ge=0))
    # async: a push s versions behind is applied with lr / (1 + s) (Zhang et al., 2016); false: lr as is
    staleness_lr: bool = True


@dataclass(frozen=True)
class DiLoCoConfig:
    """Local SGD / DiLoCo (Douillard et al. 2023): H inner steps per rank, then an outer step."""

    sync_every: int = checked(16, Range(ge=1))  # H: inner steps between synchronisations
    outer_lr: float = checked(0.7, Range(gt=0))
    # Nesterov momentum of the outer SGD (0: plain SGD)
    outer_momentum: float = checked(0.9, Range(ge=0, lt=1))
    # steps up to this one synchronise after every step by plain averaging (no outer optimizer) before
    # the H-step rounds begin: post-local SGD (Lin et al. 2020, torch's start_localSGD_iter); DiLoCo's
    # own runs start from a model trained with data parallelism
    start_local_step: int = checked(0, Range(ge=0))
    compress: bool = True  # reduce the pseudo-gradient through comm.compress when it is set


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # empty: <run_dir>/checkpoints
    every: int = checked(0, Range(ge=0))  # steps between checkpoints; 0 = only at the end when dir is set
    keep: int = checked(3, Range(ge=0))  # the newest ones kept; 0 keeps all
    async_save: bool = False
    resume: bool = True


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = checked("ddp", OneOf(STRATEGIES))
    steps: int = checked(40, Range(ge=1))
    seed: int = checked(0, Range(ge=0, le=MAX_SEED))
    dtype: str = checked("float32", OneOf(("float32", "float64")))
    # where each rank computes: auto = the GPU of its local rank when the machine has GPUs, else the CPU
    # (shardwise.device: the process group follows it, cpu:gloo,cuda:nccl on GPUs)
    device: str = checked("auto", OneOf(("auto", "cpu", "cuda")))
    eval_every: int = checked(10, Range(ge=0))  # 0: no held-out evaluation
    eval_batches: int = checked(4, Range(ge=1))
    log_every: int = checked(1, Range(ge=1))
    run_dir: str = checked("runs/latest", NonEmpty("a folder path"))
    timeout_s: float = checked(300.0, Range(ge=MIN_TIMEOUT_S))
    max_restarts: int = checked(0, Range(ge=0))
    tensorboard: bool = False  # also write the metrics as TensorBoard events in <run_dir>/tensorboard
    trace: bool = False  # record per-rank spans into <run_dir>/trace.json (Chrome trace / Perfetto)
    # a rank blocked in one call this long names the rank that holds it up and stops the job; 0: off;
    # -1: automatic, 5 x the median step time and at least 30 s
    hang_timeout_s: float = checked(-1.0, Range(ge=0, also=(-1.0,), note="or -1 for automatic"))
    # compute in fp32 (the model's own dtype), or bf16/fp16 with fp32 masters (ZeRO: master shards and
    # compute copies; the others: fp32 parameters under autocast); fp16 scales the loss dynamically
    precision: str = checked("fp32", OneOf(("fp32", "bf16", "fp16")))
    sync_batchnorm: bool = False  # BatchNorm layers use the global batch's statistics (over dp)
    # a NaN/inf loss or gradient: stop the run, or skip that step's update on every rank
    on_nonfinite: str = checked("stop", OneOf(("stop", "skip")))
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
        """Check the config against a world of ``world_size`` ranks; return it with dp resolved.

        Pure: every field's type and declared rule, then what fields mean together. No filesystem
        (``preflight`` tries the folders).
        """
        check_values(self)
        check_schedule(self)
        check_model_kind(self.model.kind)
        if world_size < 1:
            raise ConfigError(f"the world needs at least one rank, got {world_size}")
        check_applies(self)
        check_diloco(self)
        dims = self.dims(world_size)
        check_batch(self, dims.dp)
        check_context(self.model)
        check_corpus(self)
        return replace(self, parallel=replace(self.parallel, dp=dims.dp))

    def dims(self, world_size: int) -> ParallelDims:
        """The job's validated degrees in a world of ``world_size`` ranks."""
        return ParallelDims.build(self.parallel, world_size, self.ps.servers if self.strategy == "ps" else 0)

    @property
    def compute_precision(self) -> str:
        """``precision``, or the deprecated ``zero.precision`` when only that one is set."""
        return self.precision if self.precision != "fp32" else self.zero.precision


def describe_layout(config: TrainConfig, dims: ParallelDims) -> str:
    """The layout in words, as ``train``'s summary and ``verify``'s header print it: the mesh
    (``dp4 x pp2 x tp1``), then what else shapes a step where it is on: hybrid sharding (shard groups
    and their replicas), sequence parallelism, the pipeline's schedule (stages per rank, named split),
    the micro-batches, activation checkpointing."""
    parallel = config.parallel
    parts = [dims.label]
    if dims.dp_replicate > 1:
        shard, replicas = dims.dp_shard, dims.dp_replicate
        parts.append(f"hybrid sharding: {config.strategy} over {shard} ranks x {replicas} replicas")
    if parallel.sequence_parallel:
        parts.append("sequence parallel")
    if dims.pp > 1:
        parts.append(f"{parallel.schedule} schedule")
        if parallel.stages_per_rank > 1:
            parts.append(f"{parallel.stages_per_rank} stages per rank")
        if parallel.pp_split:
            parts.append(f"split at {','.join(parallel.pp_split)}")
    if dims.pp > 1 or config.data.micro_batches > 1:
        micro = config.data.micro_batches
        parts.append(f"{micro} micro-batch{'es' if micro > 1 else ''}")
    if parallel.activation_checkpointing:
        parts.append("activation checkpointing")
    return ", ".join(parts)


def model_source(kind: str) -> str:
    """Where ``model.kind`` comes from: "builtin" (gpt, mlp), "hf" (``hf:PATH`` or a shipped config's
    name) or "factory" (``package.module:function``); "" when it is none of them."""
    if kind in ("gpt", "mlp"):
        return "builtin"
    if kind.startswith("hf:") and len(kind) > 3:
        return "hf"
    module, sep, function = kind.partition(":")
    dotted = all(part.isidentifier() for part in module.split(".") + function.split("."))
    return "factory" if sep and dotted else ""


def check_model_kind(kind: str) -> None:
    if not model_source(kind):
        raise ConfigError(
            "model.kind must be gpt, mlp, hf:PATH/config.json (or a shipped one: hf:tiny-gpt2, "
            f"hf:tiny-llama) or package.module:function; got {kind!r}"
        )


def check_context(model: ModelConfig) -> None:
    """A window of seq_len + 1 tokens must fit the built-in GPT's context (``MAX_GPT_SEQ_LEN``)."""
    seq_len = model.seq_len
    if model.kind == "gpt" and seq_len > MAX_GPT_SEQ_LEN:
        raise ConfigError(
            f"model.seq_len({seq_len}) is longer than the built-in gpt's context of {MAX_GPT_SEQ_LEN} "
            f"positions: its attention would cost {seq_len}^2 = {seq_len**2:.1e} per head and sequence, "
            f"{(seq_len / MAX_GPT_SEQ_LEN) ** 2:,.0f}x that of {MAX_GPT_SEQ_LEN}; lower model.seq_len, "
            "or use an hf: model whose max_position_embeddings covers it"
        )


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Read a TOML file (optional) and apply dotted-key overrides on top of the defaults."""
    config = TrainConfig()
    if path is not None:
        config = merge_table(config, read_toml(path), prefix="")
    for key, value in (overrides or {}).items():
        config = set_key(config, key, value)
    return config
