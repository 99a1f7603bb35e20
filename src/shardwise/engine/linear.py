"""Linear layers whose weight gradient can wait: the zero-bubble split of backward, per layer.

A linear layer's backward is two matmuls from one output gradient ``dY``: the input's gradient
``dX = dY W`` (needed at once: it travels on to the previous layer, and to the previous pipeline
stage) and the weight's ``dW = dY^T X`` (needed only by the update). Zero-bubble schedules (Qi et
al. 2023, arXiv:2401.10241) run the first in an I pass and the second later, in a W pass that fills
a bubble. Here each deferring layer computes its op with its weight detached, so its autograd node
computes ``dX`` and the bias's gradient alone, and a pre-hook on that node (``_Capture``) takes ``dY``
as backward reaches it and keeps ``(X, dY)`` in the ``WeightGradStore`` while it collects (the I
pass); outside a collection (a plain backward) the hook accumulates ``dW`` at once. The forward costs
what the plain op does plus one hook; the I pass is a plain backward that skips the ``dW`` matmuls.
``X`` is kept as autograd keeps a saved tensor, through the saved-tensor hooks in force: in an
activation-checkpointed block the forward keeps only checkpointing's handle and ``X`` comes from the
recomputation in I. The W pass (``apply_weight_grads``) is then those matmuls alone: no autograd graph
is walked again, no activation is recomputed, and the graph itself is freed when I ends. What is held
from I to W is each deferred layer's input and output gradient. A weight with gradient hooks (DDP's
buckets, ZeRO-3's flat buffers, a user's) gets its W gradient through its own accumulator
(``torch.autograd.backward`` from the weights), so the hooks see it arrive as from any backward; one
without gets it as that accumulator would give it (stored, or added in place), without a call into
autograd's engine: on the small GPT's 21 layers (one process, the W pass of one micro-batch) 2.9 ms
instead of 3.7, of which the matmuls are 2.3. A layer whose input needs no gradient and whose bias
none (nothing of it would run in I) takes the plain op: its ``dW`` comes in I, as in B.

Torch's pipelining splits backward on the graph instead (``stage_backward_input`` registers hooks on
the nodes where each weight's subgraph joins the input's, ``stage_backward_weight`` runs backward
again from those nodes over the retained graph); under non-reentrant activation checkpointing that
second backward recomputes the block again. Keeping ``(X, dY)`` per layer, as DeepSeek's DualPipe
and Megatron's weight-gradient store do, needs the layers to route through ``linear`` (the pipeline
patches ``nn.Linear`` and Hugging Face's ``Conv1D``; the tensor-parallel layers call it), and gives
everything else (norms, embeddings, biases, a custom layer) its gradient in I, as B would.

Under autocast the op is autocast's (its operands in the lower-precision dtype), ``X`` is kept cast
alike, and the deferred ``dW`` is cast back to the weight's dtype, as autocast's cast would on its
way back.
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
    grad_output: torch.Tensor  # dY: (..., out)
    transposed: bool  # the weight is stored (in, out)

    def compute(self) -> torch.Tensor:
        """``dW`` in the operands' dtype (under autocast, the lower one)."""
        x = self.inputs.reshape(-1, self.inputs.shape[-1])  # (rows, in)
        dy = self.grad_output.reshape(-1, self.grad_output.shape[-1])  # (rows, out)
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


class _Capture:
    """The pre-hook on a deferring layer's autograd node: when backward reaches the node (whose weight
    is not in the graph: it computes ``dX`` and the bias's gradient alone), it takes ``dY`` from it and
    ``X`` from where the forward kept it, and keeps the pair in the store (or, with no I pass
    collecting, accumulates ``dW`` at once)."""

    __slots__ = ("held", "leaf", "store", "transposed")

    def __init__(self, store: WeightGradStore, leaf: torch.Tensor, held: _Held, transposed: bool) -> None:
        self.store, self.leaf, self.held, self.transposed = store, leaf, held, transposed

    def __call__(self, grads: tuple[torch.Tensor, ...]) -> None:
        unpack, kept = self.held
        self.held = (None, None)  # once: a checkpointed block's recomputed tensor is given out once
        x = kept if unpack is None else unpack(kept)
        record = DeferredWeightGrad(self.leaf, x, grads[0], self.transposed)
        if not self.store.keep(record):
            apply_weight_grads([record])


# X as the forward kept it: (None, X), or (the unpack hook, what the pack hook in force returned)
_Held = tuple[Any, Any]


def _hold(x: torch.Tensor) -> _Held:
    """Keep ``x`` as autograd keeps a saved tensor: through the saved-tensor hooks in force, if any
    (activation checkpointing's, so that a checkpointed block's ``X`` is its recomputation's and is
    not held from the forward; an offload's), else the tensor itself."""
    hooks = _TOP_HOOKS(False) if _TOP_HOOKS is not None else None
    return (None, x) if hooks is None else (hooks[1], hooks[0](x))


# the (pack, unpack) pair in force (torch keeps no public reader of it; without one, X is kept as is)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


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
    # a layer whose input and bias need no gradient would have no node to run in I: dW there, as in B
    others = x.requires_grad or (bias is not None and bias.requires_grad)
    if store is None or not (
        store.armed and weight.requires_grad and weight.is_leaf and torch.is_grad_enabled() and others
    ):
        return _plain(x, weight, bias, transposed)
    device = x.device.type
    if torch.is_autocast_enabled(device):  # X kept as autocast casts a linear's input
        x = x.to(torch.get_autocast_dtype(device))
    held = _hold(x)  # before the op, in the forward and in a recomputation alike
    out = _plain(x, weight.detach(), bias, transposed)  # the weight outside the graph: no dW in I
    # (in a checkpointed block's recomputation too, where the node is never run: freed with it)
    node = out.grad_fn
    assert node is not None  # x or the bias requires grad (above)
    node.register_prehook(_Capture(store, weight, held, transposed))
    return out
