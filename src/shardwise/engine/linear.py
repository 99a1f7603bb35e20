"""Linear layers whose weight gradient can wait: the zero-bubble split of backward, per layer.

A linear layer's backward is two matmuls from one output gradient ``dY``: the input's gradient
``dX = dY W`` (needed at once: it travels on to the previous layer, and to the previous pipeline
stage) and the weight's ``dW = dY^T X`` (needed only by the update). Zero-bubble schedules (Qi et
al. 2023, arXiv:2401.10241) run the first in an I pass and the second later, in a W pass that fills
a bubble. Here each layer's backward does exactly that: with a ``WeightGradStore`` collecting (the I
pass), it returns ``dX`` and the bias's gradient and keeps ``(X, dY)`` in the store instead of
computing ``dW``; outside a collection (a plain backward, a B pass) it computes ``dW`` at once. The
W pass (``apply_weight_grads``) is then those matmuls alone: no autograd graph is walked again, no
activation is recomputed (an activation-checkpointed block is recomputed once, in I, where ``X``
is taken from the recomputation), and the graph itself is freed when I ends. What is held from I
to W is each deferred layer's input (shared by the layers that read one input: q, k, v) and output
gradient. A weight with gradient hooks (DDP's buckets, ZeRO-3's flat buffers, a user's) gets its W
gradient through its own accumulator (``torch.autograd.backward`` from the weights), so the hooks see
it arrive as from any backward; one without gets it as that accumulator would give it (stored, or
added in place), without a call into autograd's engine: on the small GPT's 21 layers (one process,
the W pass of one micro-batch) 2.9 ms instead of 3.7, of which the matmuls are 2.3.

Torch's pipelining splits backward on the graph instead (``stage_backward_input`` registers hooks on
the nodes where each weight's subgraph joins the input's, ``stage_backward_weight`` runs backward
again from those nodes over the retained graph); under non-reentrant activation checkpointing that
second backward recomputes the block again. Keeping ``(X, dY)`` per layer, as DeepSeek's DualPipe
and Megatron's weight-gradient store do, needs the layers to route through ``linear`` (the pipeline
patches ``nn.Linear`` and Hugging Face's ``Conv1D``; the tensor-parallel layers call it), and gives
everything else (norms, embeddings, biases, a custom layer) its gradient in I, as B would.

Under autocast the operands are cast as autocast casts a linear (to its lower-precision dtype) and
the deferred ``dW`` is cast back to the weight's dtype, as autocast's cast would on its way back.
Communication: none.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardwise.device import HOST


@dataclass
class DeferredWeightGrad:
    """One layer's weight gradient, kept from an I pass: ``weight`` gets ``dY^T X`` (``(in, out)``
    layout, Hugging Face's ``Conv1D``: ``X^T dY``) when its W pass runs."""

    weight: torch.Tensor  # the leaf the gradient is for (a parameter, or a tied weight's copy)
    inputs: torch.Tensor  # X: (..., in)
    grad_output: torch.Tensor  # dY: (rows, out)
    transposed: bool  # the weight is stored (in, out)

    def compute(self) -> torch.Tensor:
        """``dW`` in the operands' dtype (under autocast, the lower one)."""
        x, dy = self.inputs.reshape(-1, self.inputs.shape[-1]), self.grad_output  # (rows, in), (rows, out)
        return x.t().mm(dy) if self.transposed else dy.t().mm(x)  # (in, out) or (out, in)


class WeightGradStore:
    """Where an I pass leaves its layers' weight-gradient work for the W pass (see the module doc).

    The flag is read by the layers' backward, which runs on autograd's threads (CUDA), so it is a
    plain attribute rather than thread-local: the thread that calls backward waits for it to end.
    """

    def __init__(self) -> None:
        self._open: list[DeferredWeightGrad] | None = None
        # the layers take the deferring path only while armed: a pipeline arms it for the forward
        # (and backward) of a micro-batch whose backward is split into I and W, and disarms it for
        # one that runs a plain B, which then pays nothing for the split (``linear``)
        self.armed = True

    @contextmanager
    def collect(self) -> Iterator[list[DeferredWeightGrad]]:
        """Inside: every layer's backward keeps its weight gradient in the list yielded."""
        if self._open is not None:
            raise RuntimeError("a WeightGradStore is already collecting: one I pass at a time")
        kept: list[DeferredWeightGrad] = []
        self._open = kept
        try:
            yield kept
        finally:
            self._open = None

    def keep(self, record: DeferredWeightGrad) -> bool:
        """Keep ``record`` for later if an I pass is collecting; False: compute it now."""
        if self._open is None:
            return False
        self._open.append(record)
        return True


def apply_weight_grads(records: Sequence[DeferredWeightGrad]) -> None:
    """The W pass: every kept weight gradient computed and accumulated into its weight; nothing else
    is walked.

    Newest first (the I pass kept them last to first layer, so the freshest inputs are still in
    cache). A weight without gradient hooks gets its gradient as autograd's accumulator gives it,
    without the engine: stored when it has none (in the weight's layout), added in place otherwise.
    A weight with hooks (DDP's buckets, ZeRO-3's flat buffers, a user's) gets it through its own
    accumulator (``torch.autograd.backward`` from the weights), so its hooks run as in any backward,
    handed over in groups of about the largest one's bytes: one call per weight costs more than the
    small matmuls here, one call for all would hold a stage's whole gradient at once."""
    hooked = [record for record in reversed(records) if not _accumulate(record)]
    largest = max((r.weight.numel() for r in hooked), default=0)
    weights: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    held = 0
    for record in hooked:
        grads.append(record.compute().to(record.weight.dtype))  # as autocast's cast would on its way back
        weights.append(record.weight)
        held += record.weight.numel()
        if held >= largest:
            torch.autograd.backward(weights, grads)
            weights, grads, held = [], [], 0
    if weights:
        torch.autograd.backward(weights, grads)


def _accumulate(record: DeferredWeightGrad) -> bool:
    """``record``'s gradient accumulated into its weight as autograd's accumulator would (the same
    values, bit for bit: stored in the weight's layout when it has none, added in place otherwise)
    where no hook on the weight watches its gradient; False (nothing done) where one does. Hooks on
    the accumulator node itself (torch's own DDP registers its there) are not seen: the pipeline's
    engines use the weight's post-accumulate hooks."""
    weight = record.weight
    if not _HOOKS_READABLE or weight._backward_hooks or weight._post_accumulate_grad_hooks:
        return False
    grad = record.compute().to(weight.dtype)
    if weight.grad is not None:
        weight.grad.add_(grad)
    elif grad.stride() == weight.stride():
        weight.grad = grad
    else:  # the weight's own strides (empty_like keeps a dense tensor's)
        weight.grad = torch.empty_like(weight).copy_(grad)
    return True


def _hooks_readable() -> bool:
    """Whether a tensor shows its gradient hooks where ``_accumulate`` looks (checked once: a torch
    that keeps them elsewhere sends every W gradient through autograd)."""
    probe = torch.zeros(1, requires_grad=True, device=HOST)
    probe.register_hook(lambda grad: grad)
    probe.register_post_accumulate_grad_hook(lambda tensor: None)
    return bool(getattr(probe, "_backward_hooks", None)) and bool(
        getattr(probe, "_post_accumulate_grad_hooks", None)
    )


_HOOKS_READABLE = _hooks_readable()


class _Linear(torch.autograd.Function):
    """``Y = X W^T + b`` (``transposed``: ``X W + b``) whose ``dW`` can wait (module docstring). Kept
    lean: each Python op here runs once per layer and micro-batch, beside matmuls that may be small."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
        store: WeightGradStore, leaf: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.store, ctx.leaf = transposed, store, leaf
        return _plain(x, weight, bias, transposed)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        rows = grad.reshape(-1, grad.shape[-1])  # (rows, out): one 2-D view for the three products
        grad_input = None
        if needs[0]:
            grad_input = rows.mm(weight.t() if ctx.transposed else weight).view(x.shape)
        grad_bias = rows.sum(0) if needs[2] else None
        grad_weight = None
        if needs[1]:
            record = DeferredWeightGrad(ctx.leaf, x, rows, ctx.transposed)
            if not ctx.store.keep(record):
                grad_weight = record.compute()
        return grad_input, grad_weight, grad_bias, None, None, None


def _plain(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    """The op itself: ``F.linear``, or (``transposed``) ``addmm`` on the rows as ``Conv1D`` does."""
    if not transposed:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # as Conv1D computes it
    product = torch.addmm(bias, rows, weight) if bias is not None else rows.mm(weight)
    return product.view(*x.shape[:-1], weight.shape[-1])


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool = False,
    store: WeightGradStore | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x W^T + b`` (``transposed``: ``x W + b``, Hugging Face's ``Conv1D`` layout, ``W`` (in, out)).

    With ``store`` armed, and ``weight`` a leaf that requires grad (a parameter, a tied weight's copy),
    its gradient waits in the store while an I pass collects; otherwise this is the plain op."""
    if store is None or not (
        store.armed and weight.requires_grad and weight.is_leaf and torch.is_grad_enabled()
    ):
        return _plain(x, weight, bias, transposed)
    leaf = weight
    device = x.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast casts a linear's operands
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device, enabled=False):
            out: torch.Tensor = _Linear.apply(x, weight, bias, transposed, store, leaf)
        return out
    out = _Linear.apply(x, weight, bias, transposed, store, leaf)
    return out
