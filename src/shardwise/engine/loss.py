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
    outputs = model(*args, **kwargs)
    if outputs is None:
        raise LossError(
            f"{type(model).__name__}.forward returned None; return its outputs (the logits, or a tuple or "
            "dict holding them)"
        )
    return outputs


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


class ClassLoss:
    """Summed cross-entropy of one class label per row: logits (rows, classes), targets (rows,);
    labels equal to ``ignore_index`` carry no loss and are not counted."""

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        logits, targets = _upcast(logits_of(outputs)), batch[1]
        if logits.dim() != 2 or logits.size(0) != targets.size(0):
            raise LossError(
                f"class labels of shape {tuple(targets.shape)} need logits of shape (rows, classes), but "
                f"the model returned {tuple(logits.shape)}; pass your own loss for other outputs"
            )
        return F.cross_entropy(logits, targets, ignore_index=self.ignore_index, reduction="sum")

    def count(self, batch: Any) -> int:
        return int((batch[1] != self.ignore_index).sum())


def _targets(batch: Any) -> torch.Tensor:
    """The integer targets of an ``(inputs, targets)`` batch, for the default loss."""
    has_targets = isinstance(batch, Sequence) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor)
    if not has_targets:
        raise LossError(
            f"the default loss needs (inputs, targets) batches or dicts with 'labels'; got a "
            f"{type(batch).__name__}: pass loss=sw.summed(fn), fn returning the SUM of the item losses"
        )
    targets = batch[1]
    ids = not (targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool)
    if not ids or targets.dim() > 2:
        raise LossError(
            "the default loss is cross-entropy over integer class ids (rows,) or token ids "
            f"(rows, positions); the targets are {str(targets.dtype).removeprefix('torch.')} "
            f"of shape {tuple(targets.shape)}: "
            "pass loss=sw.summed(fn), fn returning the SUM of the item losses"
        )
    return targets


class AutoLoss:
    """The default loss for a user's model: causal-LM cross-entropy for dict batches (Hugging Face
    style, labels -100 ignored); for ``(inputs, targets)`` batches, class cross-entropy when the
    targets hold one class id per row, token cross-entropy when they hold one id per position.

    ``over(causal, tokens)``: the same choice among other losses of each kind (tensor parallelism's,
    over vocab-cut logits); class labels are then refused, there being no such kind."""

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index
        self.causal: Loss = CausalLMLoss(ignore_index)
        self.tokens: Loss = TokenLoss()
        self.classes: Loss | None = ClassLoss(ignore_index)

    def over(self, causal: Loss, tokens: Loss) -> AutoLoss:
        chosen = AutoLoss(self.ignore_index)
        chosen.causal, chosen.tokens, chosen.classes = causal, tokens, None
        return chosen

    def _pick(self, batch: Any) -> Loss:
        if isinstance(batch, Mapping):
            return self.causal
        if _targets(batch).dim() > 1:
            return self.tokens
        if self.classes is None:
            raise LossError(
                "the default loss has no cross-entropy over vocab-cut logits for class labels (rows,): "
                "set parallel.tp = 1, or give (rows, positions) token targets or dict batches"
            )
        return self.classes

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        loss = self._pick(batch)
        if loss is self.tokens:
            _check_token_logits(logits_of(outputs), batch[1])
        return loss(outputs, batch)

    def count(self, batch: Any) -> int:
        return self._pick(batch).count(batch)


def _check_token_logits(logits: torch.Tensor, targets: torch.Tensor) -> None:
    fits = logits.dim() == 3 and logits.size(0) == targets.size(0) and logits.size(1) <= targets.size(1)
    if not fits:
        raise LossError(
            f"token targets of shape {tuple(targets.shape)} need logits of shape (rows, positions, vocab), "
            f"but the model returned {tuple(logits.shape)}; pass your own loss for other outputs"
        )


# autograd nodes of a loss that averages: ``.mean()``, and the ``reduction="mean"`` of torch's losses
_MEAN_NODES = ("MeanBackward0", "MeanBackward1")
_REDUCTION_MEAN = 1  # torch's at::Reduction::Mean, as saved on a loss's backward node


def averaged_by(loss: torch.Tensor) -> str | None:
    """The operation by which ``loss`` is a mean over more than one item, read off its last autograd
    step (a cast looked through); None when it is not one (a sum, or anything else: never guessed)."""
    node = loss.grad_fn
    while node is not None and node.name() == "ToCopyBackward0":
        node = node.next_functions[0][0]
    if node is None:
        return None
    if node.name() in _MEAN_NODES:
        return ".mean()" if int(getattr(node, "_saved_self_sym_numel", 2)) > 1 else None
    if getattr(node, "_saved_reduction", None) == _REDUCTION_MEAN:
        target = getattr(node, "_saved_target", None)
        if isinstance(target, torch.Tensor) and target.numel() > 1:
            return f'reduction="mean" ({node.name().removesuffix("Backward0")})'
    return None


def check_summed(loss: Any) -> torch.Tensor:
    """``loss`` if it can be the SUM of a micro-batch's item losses: one number, not a mean."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise LossError(
            f"the loss returned {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + "; it must return one number: the SUM of the micro-batch's item losses"
        )
    if how := averaged_by(loss):
        raise LossError(
            f"the loss is a mean ({how}), but shardwise divides a SUM by the global item count: return "
            'the sum of the item losses (reduction="sum", .sum()) and count them with '
            "sw.summed(fn, count=...)"
        )
    return loss


class _Summed:
    def __init__(self, fn: Callable[[Any, Any], torch.Tensor], count: Callable[[Any], int]) -> None:
        self.fn, self._count = fn, count

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        return self.fn(outputs, batch)  # the engine checks it is a sum (check_summed)

    def count(self, batch: Any) -> int:
        return int(self._count(batch))


def summed(fn: Callable[[Any, Any], torch.Tensor], count: Callable[[Any], int] = rows) -> Loss:
    """A ``Loss`` from ``fn(outputs, batch)`` returning a SUM, counting ``count(batch)`` items (rows)."""
    return _Summed(fn, count)


def as_loss(loss: Loss | Callable[[Any, Any], torch.Tensor]) -> Loss:
    """A ``Loss`` as is; a plain function as a summed loss over the batch's rows."""
    return loss if isinstance(loss, Loss) else summed(loss)
