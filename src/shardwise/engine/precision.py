"""Mixed precision for every strategy: compute in bf16/fp16, keep fp32 masters, scale fp16 losses.

ZeRO keeps fp32 master shards and computes with bf16/fp16 copies of the parameters; the replicated
strategies (DDP, the parameter server) keep fp32 parameters and compute under ``torch.autocast``. fp16
losses are multiplied by a dynamic scale (Micikevicius et al., "Mixed Precision Training", 2018) whose
state travels in checkpoints (``LOSS_SCALE``). No communication of its own: ZeRO all-reduces the
overflow flag through its Comm; DDP's gradients are already the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.device import HOST

_COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_SCALE = "precision/loss_scale"  # fp16: the loss scaler's state (LossScaler.state), written by rank 0


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # parameters and activations during forward/backward
    master: torch.dtype  # master shards, gradient shards and optimizer state
    scaled: bool  # fp16: the loss is multiplied by a dynamic scale before backward


def resolve_precision(name: str, model_dtype: torch.dtype) -> Precision:
    """``fp32`` trains in the model's own dtype (float64 in parity tests); bf16/fp16 keep fp32 masters."""
    if name == "fp32":
        return Precision(model_dtype, model_dtype, False)
    if name not in _COMPUTE:
        raise ValueError(f"precision must be fp32, bf16 or fp16; got {name!r}")
    master = model_dtype if model_dtype == torch.float64 else torch.float32
    return Precision(_COMPUTE[name], master, name == "fp16")


class LossScaler:
    """Multiply the loss by ``scale``; halve it on overflow (skipping the step), double it after
    ``growth_interval`` clean steps.

    The scale never goes below ``min_scale`` (DeepSpeed's floor): an overflow there is no longer a
    scale that is too large but values that are not finite, and the run's ``on_nonfinite`` policy
    decides (see ``owns_overflow``). Its whole state is three numbers (``state`` / ``load``), saved
    in checkpoints so a resumed run goes on with the same scale.
    """

    def __init__(
        self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000, min_scale: float = 1.0
    ) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self._clean_steps = 0
        self.skipped_steps = 0

    @property
    def owns_overflow(self) -> bool:
        """Whether an overflow now is the scaler's to handle (it can still lower the scale)."""
        return self.enabled and self.scale > self.min_scale

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self._clean_steps = 0
            self.skipped_steps += 1
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self._clean_steps = 0

    def state(self) -> torch.Tensor:
        """``[scale, clean steps since the last change, skipped steps]`` as float64 (exact integers)."""
        state = [self.scale, self._clean_steps, self.skipped_steps]
        return torch.tensor(state, dtype=torch.float64, device=HOST)  # host figures, for checkpoints

    def load(self, state: torch.Tensor) -> None:
        scale, clean, skipped = state.double().tolist()
        self.scale, self._clean_steps, self.skipped_steps = scale, int(clean), int(skipped)
