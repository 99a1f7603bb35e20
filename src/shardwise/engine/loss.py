"""Losses that average exactly over a global batch, whatever share of it each rank holds.

The contract every strategy relies on: a loss returns the **sum** of its per-item losses over one
micro-batch, and ``count(batch)`` says how many items that sum covers (computable from the batch alone,
before any forward pass). Each step, shardwise sums the counts of every micro-batch of every
data-parallel rank (one all-reduce of one number, before the first backward) and divides every loss
sum by that global count, then sums gradients over ranks. The result is exactly the mean loss of one
process over the whole global batch: uneven shares, padding and masked labels included. This is the
role Hugging Face's ``num_items_in_batch`` plays.

So a user's own loss must reduce with a **sum** (``reduction="sum"``), not a mean: a mean would weight
a rank's items by the size of its share. Wrap a plain function with :func:`summed` to say how to count.

Batches may be a tensor, a tuple/list (``(inputs, targets)``: the model gets ``inputs``) or a dict of
tensors (the model gets every key but ``labels``); outputs a tensor, a tuple (its first item), a dict
or a Hugging Face ``ModelOutput`` (its ``logits``). No communication here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # labels equal to this carry no loss (Hugging Face and torch's convention)


class LossError(ValueError):
    """A model output, batch or loss shardwise cannot use; the message says which and what to do."""


@runtime_checkable
class Loss(Protocol):
    """``loss(outputs, batch)`` -> the summed loss of a micro-batch; ``count(batch)`` -> items summed."""

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor: ...

    def count(self, batch: Any) -> int: ...


def model_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments the model is called with for ``batch``."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), {k: v for k, v in batch.items() if k != "labels"}
    if isinstance(batch, Sequence) and batch and isinstance(batch[0], torch.Tensor):
        return (batch[0],), {}
    raise LossError(
        "a batch must be a tensor, an (inputs, targets) tuple or a dict of tensors; "
        f"got {type(batch).__name__}"
    )


def run_model(model: nn.Module, batch: Any) -> Any:
    args, kwargs = model_inputs(batch)
    return model(*args, **kwargs)


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, a tuple's first item, a dict's/ModelOutput's ``logits``."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping) or hasattr(outputs, "logits"):
        logits = outputs["logits"] if isinstance(outputs, Mapping) and "logits" in outputs else None
        logits = getattr(outputs, "logits", logits)
        if isinstance(logits, torch.Tensor):
            return logits
    elif isinstance(outputs, tuple | list) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise LossError(
        f"cannot find logits in the model's output ({type(outputs).__name__}); return a tensor, a tuple "
        "whose first item is the logits, or a dict/ModelOutput with 'logits', or pass your own loss"
    )


def rows(batch: Any) -> int:
    """The number of sequences (rows) in a batch."""
    if isinstance(batch, torch.Tensor):
        return int(batch.size(0))
    if isinstance(batch, Mapping):
        first = next(iter(batch.values()))
        return int(first.size(0))
    return int(batch[0].size(0))


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits are summed in float32 (a float64 model keeps float64)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (batch, L, vocab) against the last L target positions."""
    logits = _upcast(logits)
    predicted = logits.size(1)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets[:, -predicted:].reshape(-1), reduction="sum"
    )


class TokenLoss:
    """Summed next-token cross-entropy for ``(inputs, targets)`` batches of the built-in models.

    The model predicts the last ``logits.size(1)`` positions of each sequence: all of them for the GPT,
    the last one for the MLP (``positions=1``); ``count`` is that many per row.
    """

    def __init__(self, positions: int | None = None) -> None:
        self.positions = positions

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        return loss_sum(logits_of(outputs), batch[1])

    def count(self, batch: Any) -> int:
        targets = batch[1]
        return int(targets.size(0)) * (self.positions or int(targets.size(1)))


class CausalLMLoss:
    """Summed causal-LM cross-entropy, as Hugging Face computes it: position t predicts label t + 1.

    ``labels`` come from the batch dict (``input_ids`` when there are none); labels equal to
    ``ignore_index`` (padding, prompts) carry no loss and are not counted.
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def _labels(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            labels = batch.get("labels", batch.get("input_ids"))
            if isinstance(labels, torch.Tensor):
                return labels
        raise LossError("a causal-LM batch is a dict with 'labels' (or 'input_ids'); pass your own loss")

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        logits, labels = _upcast(logits_of(outputs)), self._labels(batch)
        shifted = labels[:, 1:].reshape(-1)
        scores = logits[:, :-1].reshape(-1, logits.size(-1))
        return F.cross_entropy(scores, shifted, ignore_index=self.ignore_index, reduction="sum")

    def count(self, batch: Any) -> int:
        return int((self._labels(batch)[:, 1:] != self.ignore_index).sum())


class AutoLoss:
    """The default loss for a user's model: causal-LM cross-entropy for dict batches (Hugging Face
    style, labels -100 ignored), token cross-entropy for ``(inputs, targets)`` batches."""

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.causal, self.tokens = CausalLMLoss(ignore_index), TokenLoss()

    def _pick(self, batch: Any) -> Loss:
        return self.causal if isinstance(batch, Mapping) else self.tokens

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        return self._pick(batch)(outputs, batch)

    def count(self, batch: Any) -> int:
        return self._pick(batch).count(batch)


class _Summed:
    def __init__(self, fn: Callable[[Any, Any], torch.Tensor], count: Callable[[Any], int]) -> None:
        self.fn, self._count = fn, count

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        loss = self.fn(outputs, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise LossError(
                f"the loss function returned {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + "; it must return one number: the SUM of the micro-batch's item losses"
            )
        return loss

    def count(self, batch: Any) -> int:
        return int(self._count(batch))


def summed(fn: Callable[[Any, Any], torch.Tensor], count: Callable[[Any], int] = rows) -> Loss:
    """A ``Loss`` from ``fn(outputs, batch)`` returning a SUM, counting ``count(batch)`` items (rows)."""
    return _Summed(fn, count)


def as_loss(loss: Loss | Callable[[Any, Any], torch.Tensor]) -> Loss:
    """A ``Loss`` as is; a plain function as a summed loss over the batch's rows."""
    return loss if isinstance(loss, Loss) else summed(loss)
