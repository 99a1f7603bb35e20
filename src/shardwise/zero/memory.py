"""Memory accounting for ZeRO: bytes by component from live tensors beside the formula, peak RSS.

No communication. ``model_state_bytes`` walks the engine's live tensors (each storage counted once,
so a master shard that views the parameter buffer is not counted twice); ``zero_formula`` (from
:mod:`shardwise.planner.layout`, re-exported here) gives what Rajbhandari et al. (SC 2020, section 5)
predict per rank for Ψ trainable parameters and N ranks, adapted to how this implementation keeps state:

* fp32 (or float64) training: parameters 4Ψ, gradients 4Ψ, optimizer state KΨ (Adam: K = 8 bytes:
  two moments; the fp32 master *is* the parameter, so it costs nothing extra);
* bf16/fp16 training: parameters 2Ψ (none kept in stage 3: a unit is cast from the master when
  gathered), gradients 2Ψ + 4Ψ/N (stage 1: the full gradients and the fp32 reduced slice) or an fp32
  shard 4Ψ/N (stages 2-3), optimizer state (4 + K)Ψ: the fp32 master plus the moments (the paper's K = 12).

Stage 1 divides the optimizer state by N, stage 2 also the gradients, stage 3 also the parameters.
Frozen parameters are not sharded and are added whole on both sides.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from shardwise.device import memory_mb, peak_rss_mb
from shardwise.planner.layout import zero_formula

__all__ = ["memory_report", "model_state_bytes", "peak_memory_bytes", "peak_rss_bytes", "zero_formula"]

if TYPE_CHECKING:
    from shardwise.zero.base import ZeroBase


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def model_state_bytes(engine: ZeroBase) -> dict[str, int]:
    """Bytes this rank holds now, by component: params, grads, optimizer_state, buffers."""
    seen: set[int] = set()
    frozen: list[torch.Tensor] = [p for p in engine.model.parameters() if not p.requires_grad]
    held = [g.full for g in engine.groups] + [g.master for g in engine.groups] + frozen
    params = _unique_bytes(held, seen)
    grads = [g.flat_grad for g in engine.groups if g.flat_grad is not None]
    grads += [g.grad_shard for g in engine.groups if g.grad_shard is not None]
    grads += [p.grad for p in engine.model.parameters() if p.grad is not None]
    state = [
        value
        for optimizer in engine.optimizers
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if torch.is_tensor(value)
    ]
    out = {
        "params": params,
        "grads": _unique_bytes(grads, seen),
        "optimizer_state": _unique_bytes(state, seen),
        "buffers": _unique_bytes(engine.model.buffers(), seen),
    }
    out["model_state"] = out["params"] + out["grads"] + out["optimizer_state"]
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``device.peak_rss_mb``, in bytes)."""
    return int(peak_rss_mb() * 2**20)


def peak_memory_bytes(device: torch.device) -> int:
    """The allocator's peak on a GPU, peak RSS on the CPU (``device.memory_mb``'s ``peak_mb``)."""
    return int(memory_mb(device)["peak_mb"] * 2**20)


def memory_report(engine: ZeroBase) -> dict[str, float]:
    """This rank's model-state bytes by component beside the formula's, for metrics and ``--json``.

    Before the first optimizer step the optimizer holds no state yet; the comparison is meaningful
    from the end of the first step on.
    """
    live = model_state_bytes(engine)
    psi = sum(p.numel() for _, p in engine.trainable)
    mixed = engine.precision.compute != engine.precision.master
    param_bytes = engine.precision.master.itemsize
    first_state: dict[str, object] = next((s for opt in engine.optimizers for s in opt.state.values()), {})
    states_per_param = sum(1 for t in first_state.values() if torch.is_tensor(t) and t.dim() > 0)
    frozen = sum(p.numel() * p.element_size() for p in engine.model.parameters() if not p.requires_grad)
    precision = "bf16" if mixed else "fp32"  # the formula treats bf16 and fp16 alike (2 bytes)
    formula = zero_formula(
        psi, engine.stage, engine.comm.world_size, precision, param_bytes, states_per_param, frozen
    )
    report = {f"mem_{k}_bytes": float(v) for k, v in live.items()}
    report.update({f"formula_{k}_bytes": float(v) for k, v in formula.items()})
    report["model_state_vs_formula"] = live["model_state"] / formula["model_state"]
    return report
