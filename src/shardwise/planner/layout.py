"""A run's layout and what each of its ranks keeps of the model: the planner's inputs (``Training``,
``Layout``) and the model states per rank, ours and the ZeRO paper's.

No communication: arithmetic only (``shardwise plan``). For Ψ trainable parameters, N data-parallel
ranks, K optimizer states per parameter (AdamW 2, SGD with momentum 1, plain SGD 0):

**Model states** (``model_states``), as *this* implementation keeps them. fp32 training (``pb`` bytes
per value, 8 for float64): parameters pbΨ, gradients pbΨ, optimizer state K·pbΨ, and the master *is* the
parameter. Mixed precision (bf16/fp16): DDP and the parameter server keep fp32 parameters and compute
under autocast (the same bytes as fp32; the cast weights are counted with the buffers, in
``planner/memory.py``); ZeRO keeps 2Ψ compute copies, an
fp32 master shard 4Ψ/N and fp32 moments 4KΨ/N. Stage 1 keeps the full gradients (2Ψ) and the reduced
fp32 slice (4Ψ/N); stages 2-3 only an fp32 gradient shard 4Ψ/N; stage 3 keeps no compute copy at all
(a unit is cast from the master when gathered). ZeRO's CPU offload moves masters and moments to host
memory. Rajbhandari et al. (SC 2020, "ZeRO", section 5) count the same states with fp16 gradients and
an fp16 parameter shard (``zero_paper_bytes``: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N for K = 12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardwise.config import ConfigError
from shardwise.dims import ParallelDims

STRATEGIES = ("ddp", "ps", "zero1", "zero2", "zero3")
OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")
GB = 1e9  # the ZeRO paper's gigabyte: 7.5e9 parameters x 16 bytes = 120 GB
GiB = 2**30  # DeepSpeed's estimators print GiB as "GB"


def zero_stage(strategy: str) -> int:
    """0 for the replicated strategies (ddp, ps), else the ZeRO stage."""
    return int(strategy[-1]) if strategy.startswith("zero") else 0


def optimizer_states(optimizer: str, momentum: float = 0.9) -> int:
    """Parameter-sized tensors the optimizer keeps: Adam(W) two moments, SGD a momentum buffer or none."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    return 2


@dataclass(frozen=True)
class Training:
    """What a step computes: the batch, the precision and the optimizer."""

    global_batch: int  # sequences per optimizer step, summed over the data-parallel ranks
    seq_len: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.9  # sgd only; 0: no momentum buffer
    param_bytes: int = 4  # the model's dtype in fp32 mode (8 for float64)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        optimizer_states(self.optimizer, self.momentum)
        if self.global_batch < 1 or self.seq_len < 1:
            raise ConfigError(
                f"global_batch and seq_len must be >= 1; got {self.global_batch}, {self.seq_len}"
            )

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def compute_bytes(self) -> int:
        return 2 if self.mixed else self.param_bytes

    @property
    def master_bytes(self) -> int:
        return max(4, self.param_bytes) if self.mixed else self.param_bytes

    @property
    def states(self) -> int:
        return optimizer_states(self.optimizer, self.momentum)


@dataclass(frozen=True)
class Layout:
    """How the job is laid out over the devices: the data-parallel strategy and the mesh degrees (read
    as the job's own axis table, ``dims``: the same ``ParallelDims`` the config and the mesh use)."""

    strategy: str = "ddp"
    dp: int = 1
    pp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    micro_batches: int = 1  # gradient accumulation: each rank's share is split this many ways
    activation_checkpointing: bool = False
    offload: str = "none"  # none | cpu: ZeRO's masters and optimizer state in host memory
    bucket_mb: float = 25.0
    prefetch: bool = True  # ZeRO-3 gathers the next block while this one runs
    ps_servers: int = 1
    schedule: str = "1f1b"  # the pipeline schedule (pipeline.schedules), when pp > 1
    virtual_stages: int = 1  # stages per pipeline rank (interleaved and V schedules)
    dims: ParallelDims = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}")
        for name in ("dp", "pp", "tp", "micro_batches", "ps_servers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"layout {name} must be >= 1, got {getattr(self, name)}")
        servers = self.ps_servers if self.strategy == "ps" else 0
        object.__setattr__(self, "dims", ParallelDims(self.dp, self.pp, self.tp, servers))
        if not 0 < self.bucket_mb < math.inf:
            raise ConfigError(f"bucket_mb must be a finite number > 0, got {self.bucket_mb}")
        if self.offload not in ("none", "cpu"):
            raise ConfigError(f"the planner models offload none or cpu; got {self.offload!r}")
        if self.offload != "none" and not self.strategy.startswith("zero"):
            raise ConfigError(f"offload applies to zero1/zero2/zero3, not to {self.strategy}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence parallelism needs tp > 1")
        if self.pp > 1:
            from shardwise.pipeline.schedules import ScheduleConfigError, check

            try:
                check(self.schedule, self.pp, self.virtual_stages, self.micro_batches)
            except ScheduleConfigError as e:
                raise ConfigError(f"layout: {e}") from None

    @property
    def devices(self) -> int:
        """The devices that train (a parameter server's stand beside them)."""
        return self.dims.trainers

    def name(self) -> str:
        mesh = (
            f"dp{self.dp}"
            + (f"-pp{self.pp}" if self.pp > 1 else "")
            + (f"-tp{self.tp}" if self.tp > 1 else "")
        )
        parts = [self.strategy, mesh, f"mb{self.micro_batches}"]
        if self.pp > 1 and (self.schedule, self.virtual_stages) != ("1f1b", 1):
            parts.append(self.schedule + (f"-v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.offload != "none":
            parts.append(f"offload-{self.offload}")
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's parameters, fp32 masters, gradients and optimizer moments."""

    params: float
    master: float
    grads: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.params + self.master + self.grads + self.optimizer_state


def model_states(
    psi: float, strategy: str, dp: int, precision: str = "fp32", states: int = 2, param_bytes: int = 4
) -> ModelStates:
    """Model-state bytes per rank as this implementation keeps them (see the module docstring)."""
    stage, n = zero_stage(strategy), dp
    mixed = precision != "fp32"
    full = param_bytes * psi  # one full fp32 (or float64) copy
    if stage == 0:  # replicated; under mixed precision the parameters stay fp32 (autocast)
        return ModelStates(full, 0.0, full, states * full)
    master_bytes = max(4, param_bytes) if mixed else param_bytes
    state = states * master_bytes * psi / n
    if not mixed:  # the master is the parameter (or, in stage 3, the parameter shard)
        params = full / n if stage == 3 else full
        return ModelStates(params, 0.0, full if stage == 1 else full / n, state)
    params = 0.0 if stage == 3 else 2 * psi
    shard = master_bytes * psi / n
    grads = 2 * psi + shard if stage == 1 else shard
    return ModelStates(params, shard, grads, state)


def zero_paper_bytes(psi: float, stage: int, dp: int, k: int = 12) -> dict[str, float]:
    """Rajbhandari et al. (2020), section 5: fp16 parameters and gradients, K bytes of optimizer state
    per parameter (mixed-precision Adam: fp32 master, momentum, variance: K = 12); stage 0 is DP."""
    n = dp
    params = 2 * psi / (n if stage >= 3 else 1)
    grads = 2 * psi / (n if stage >= 2 else 1)
    state = k * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer_state": state, "model_state": params + grads + state}


def zero_formula(
    psi: int,
    stage: int,
    world_size: int,
    precision: str = "fp32",
    param_bytes: int = 4,
    states_per_param: int = 2,
    frozen_bytes: int = 0,
) -> dict[str, float]:
    """Model-state bytes per rank for ZeRO ``stage``, masters counted with the optimizer state (as
    ``shardwise.zero.memory.model_state_bytes`` reports live tensors beside it). Frozen parameters
    are not sharded and are added whole."""
    ms = model_states(psi, f"zero{stage}", world_size, precision, states_per_param, param_bytes)
    params = ms.params + frozen_bytes
    state = ms.master + ms.optimizer_state
    return {
        "params": params,
        "grads": ms.grads,
        "optimizer_state": state,
        "model_state": params + ms.grads + state,
    }
