"""What the planner needs to know about a machine: its devices, their memory and links, measured rates.

No communication. ``Machine`` is the target (devices that need not exist here: ``--devices N
--device-memory M --link L``); its link becomes an alpha-beta profile of the collectives' cost model
(:mod:`shardwise.collectives.cost`: an exchange of m bytes costs ``alpha + m / L``). ``Calibration``
holds the constants measured once on a machine (the model's own forward and backward for FLOP/s, plain and
with activation checkpointing; an in-place add for memory bandwidth; one process without a strategy
for the framework overhead) and never fitted on the layout being checked; its defaults are
stated as unmeasured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.collectives.cost import CostProfile
from shardwise.config import ConfigError


@dataclass(frozen=True)
class Calibration:
    """Constants measured on a machine, never fitted on the layout being checked."""

    overhead_bytes: float = 0.0  # per process: allocator, runtime, kernels (one process, no strategy)
    flops_per_s: float = 400e12  # achieved matmul throughput of one device in the compute dtype
    # the same under activation checkpointing, counting its second forward (flops_per_token(recompute)):
    # the replayed forward runs beside its own backward, where its activations are still in cache, so
    # on a CPU it can cost less than a forward's share of the rate; None: flops_per_s
    checkpointed_flops_per_s: float | None = None
    memory_bytes_per_s: float = 2e12  # device memory bandwidth (the optimizer step is bound by it)
    host_bytes_per_s: float = 50e9  # host memory bandwidth (the optimizer step under CPU offload)
    host_link_bytes_per_s: float = 25e9  # device <-> host copies (PCIe) under offload
    source: str = "built-in default (not measured)"

    def __post_init__(self) -> None:
        rates = ("flops_per_s", "memory_bytes_per_s", "host_bytes_per_s", "host_link_bytes_per_s")
        for name in (*rates, "checkpointed_flops_per_s"):
            value = getattr(self, name)
            if value is None and name == "checkpointed_flops_per_s":
                continue
            if value is None or not 0 < value < math.inf:
                raise ConfigError(f"calibration {name} must be a finite number > 0, got {value}")

    def rate(self, checkpointed: bool) -> float:
        """FLOP/s of training compute, with or without activation checkpointing's recomputation."""
        if checkpointed and self.checkpointed_flops_per_s is not None:
            return self.checkpointed_flops_per_s
        return self.flops_per_s


@dataclass(frozen=True)
class Machine:
    """The target: ``devices`` alike, each with ``device_memory`` bytes, joined by ``link`` bytes/s."""

    devices: int
    device_memory: float
    link_bytes_per_s: float
    link_latency_s: float = 10e-6  # per message step; NCCL-class links are a few microseconds
    reduce_bytes_per_s: float = 1e12  # adding incoming data into a buffer (device memory speed)

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError(f"devices must be >= 1, got {self.devices}")
        if not self.link_latency_s >= 0:
            raise ConfigError(f"link latency must be >= 0 seconds, got {self.link_latency_s}")
        if not self.device_memory > 0 or not self.link_bytes_per_s > 0:
            raise ConfigError(
                f"device memory and link must be > 0; got {self.device_memory} bytes, "
                f"{self.link_bytes_per_s} bytes/s"
            )

    def profile(self) -> CostProfile:
        """The link as the cost model's straight lines (full duplex: an exchange costs a one-way step)."""
        return CostProfile(
            alpha_s=self.link_latency_s,
            beta_s_per_byte=1 / self.link_bytes_per_s,
            gamma_s_per_byte=1 / self.reduce_bytes_per_s,
            source=f"target link {self.link_bytes_per_s * 8 / 1e9:g} Gbit/s, "
            f"{self.link_latency_s * 1e6:g} us a step",
        )
