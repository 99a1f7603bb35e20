"""Local SGD and DiLoCo: H steps on each rank's own data with no communication, then one outer step.

Follows Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023),
with local SGD (Stich 2019; Lin et al. 2020) as the special case of an outer SGD at lr 1, no momentum.

Every rank holds the whole model and its own inner optimizer (AdamW by default, built by the one
optimizer factory like DDP's). An *inner step* is an ordinary step on the rank's share of the global
batch: its loss is the mean over its own items (not the global count: the rank trains as if alone), and
the inner optimizer steps on that gradient. Nothing is communicated. Every ``sync_every`` (H) inner steps,
and after the last step, the ranks synchronise:

1. the pseudo-gradient of rank i is ``delta_i = theta_sync - theta_i`` (the parameters at the last
   synchronisation minus its parameters now), weighted by ``w_i = n_i / N``, its share of the items all
   ranks saw since the last synchronisation (one all-reduce of one number);
2. ``sum_i w_i delta_i`` is formed by one all-reduce of the flat pseudo-gradient, or, with
   ``comm.compress`` set (and ``diloco.compress``), by the codec layer (``compression.CompressedComm``,
   with its error feedback);
3. an outer SGD with Nesterov momentum (``diloco.outer_lr`` 0.7, ``diloco.outer_momentum`` 0.9, the
   paper's values) steps ``theta_sync`` with that as its gradient, and every rank starts the next round
   from the result. Floating-point buffers come from rank 0 there too.

With H = 1, outer lr 1 and no momentum this is exactly all-reduce data parallelism with an SGD inner
optimizer (SGD is linear in the gradient; each inner gradient is the rank's mean, weighted by its share).
Inner gradient clipping is local (each rank's own norm): no communication between synchronisations.

Communication: none between synchronisations; at one, two all-reduces (the item count, the
pseudo-gradient, or the codec's exchange) and a broadcast of buffers when the model has any.

Checkpoints are taken at synchronisations only (``checkpoint.every`` a multiple of H), where every rank
holds the same parameters, which are also the last-synchronised ones: ``model/<name>`` (those),
``outer/momentum_buffer/<name>`` (the outer optimizer's momentum), and each rank's own inner optimizer
state, rank 0's under the usual ``optim/<key>/<name>`` (what another strategy loads) and rank r's under
``inner/rank<r>/<key>/<name>``. A run resumed on another number of ranks gives the new ranks rank 0's
inner state. With ``comm.compress``, each rank's codec state (its residual, ...) is saved too, under
``codec/`` (``engine.codec_state``): a resumed run on the same ranks goes on exactly; on another number
of ranks it starts with none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm
from shardwise.collectives.coalesced import broadcast_coalesced
from shardwise.compression import CodecState, CompressedComm, segments_of
from shardwise.config import DiLoCoConfig
from shardwise.device import HOST
from shardwise.engine.base import Engine, Role
from shardwise.engine.codec_state import codec_pieces, layout_of, read_codec_states, restore_codec_states
from shardwise.engine.full_state import full_state_tensors, load_named_state, replicated_pieces
from shardwise.engine.state import Span, StateReader
from shardwise.engine.update import NamedTensors, grad_sq_sum

OUTER = "outer/"  # checkpoint names of the outer optimizer's state: outer/<key>/<name>


class DiLoCoEngine(Engine):
    """DiLoCo over ``comm`` (the dp axis); ``share`` is this rank's fraction of each global batch (rows),
    used only to report its share of the global mean loss without communicating."""

    update_communicates = True  # every H steps its after_update averages over the replicas

    name = "diloco"
    comm: Comm

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        config: DiLoCoConfig,
        steps: int,
        share: float,
        role: Role | None = None,
        compressor: CompressedComm | None = None,
    ) -> None:
        super().__init__(model, role)
        self.comm, self.config, self.steps, self.share = comm, config, steps, share
        named = list(model.named_parameters())  # tied weights appear once
        self._names = {id(p): n for n, p in named}
        self.params = [p for _, p in named if p.requires_grad]
        broadcast_coalesced(comm, [p.data for _, p in named] + list(model.buffers()))
        # theta_sync: the parameters at the last synchronisation, which the outer optimizer steps
        self.anchor = [nn.Parameter(p.detach().clone()) for p in self.params]
        momentum = config.outer_momentum
        self.outer = torch.optim.SGD(
            self.anchor, lr=config.outer_lr, momentum=momentum, nesterov=momentum > 0, foreach=False
        )
        self.compressor = compressor if config.compress else None
        self.codec_state: CodecState | None = None
        if self.compressor is not None:
            numel = sum(p.numel() for p in self.params)
            shapes = [tuple(p.shape) for p in self.params]
            self.codec_state = self.compressor.new_state(numel, self.params[0].dtype, segments_of(shapes))
        self.inner_steps = 0  # completed inner steps (= optimizer steps of the run)
        self.window_items = 0.0  # items this rank trained on since the last synchronisation
        self.syncs = 0

    # -- inner steps: no communication -------------------------------------------------------------
    def global_count(self, micro_batches: Sequence[Any]) -> float:
        """No all-reduce: this rank's items scaled by its share (the loop's tokens/s, not the loss)."""
        local = float(sum(self.loss.count(batch) for batch in micro_batches))
        return local / self.share if self.share > 0 else local

    def begin_step(self, micro_batches: Sequence[Any], global_count: float) -> float:
        """Each rank minimises its own mean loss: the divisor is its own item count (counted on the
        host before the batches moved: ``local_count``)."""
        local = self.local_count
        self.window_items += local
        return max(local, 1.0)

    def loss_share(self, share: float) -> float:
        """The rank's own mean loss times its share of the batch (the shares sum to the global mean)."""
        return share * self.share

    def exchange_grads(self) -> None:
        return None  # each rank steps on its own gradient

    def optimizer_units(self) -> list[NamedTensors]:
        return [[(self._names[id(p)], p) for p in self.params]]

    def held_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        return grad_sq_sum(self.params, self.device), None  # local: clipping must not communicate

    def after_update(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.inner_steps += 1
        if self._at_sync():
            self.synchronize()

    # -- the outer step ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Average the pseudo-gradients (weighted by items), step the outer optimizer, restart from it."""
        count = torch.tensor([self.window_items], dtype=torch.float64, device=HOST)  # host: over gloo
        self.comm.all_reduce(count)
        weight = self.window_items / float(count) if float(count) > 0 else 1.0 / self.comm.world_size
        with torch.no_grad():
            # (total trainable numel,) this rank's weighted pseudo-gradient theta_sync - theta_i
            delta = torch.cat([(a - p).reshape(-1) for a, p in zip(self.anchor, self.params, strict=True)])
            delta.mul_(weight)
            if self.compressor is not None and self.codec_state is not None:
                self.compressor.reduce(delta, self.codec_state)
            else:
                self.comm.all_reduce(delta, "sum")
            self._outer_step(delta)
            for anchor, p in zip(self.anchor, self.params, strict=True):
                p.copy_(anchor)
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        if buffers:
            broadcast_coalesced(self.comm, buffers)
        self.window_items = 0.0
        self.syncs += 1

    def _outer_step(self, delta: torch.Tensor) -> None:
        """Step ``theta_sync`` with the averaged pseudo-gradient ``delta``: the outer optimizer, or
        plain averaging (``theta_sync - delta``) while the run is before ``start_local_step``."""
        offset = 0
        for anchor in self.anchor:
            part = delta[offset : offset + anchor.numel()].view_as(anchor)
            offset += anchor.numel()
            if self.inner_steps <= self.config.start_local_step:
                anchor.sub_(part)
            else:
                anchor.grad = part
        if self.inner_steps > self.config.start_local_step:
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)

    def resume_at(self, step: int) -> None:
        self.inner_steps = step

    def metrics(self) -> dict[str, float]:
        return {"outer_syncs": self.syncs}

    # -- inspection --------------------------------------------------------------------------------
    def held_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (after the last step every rank holds the synchronised ones)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def held_gradients(self) -> dict[str, torch.Tensor]:
        """The ranks' own gradients weighted by their shares and summed (an all-reduce: inspection)."""
        out = {}
        for p in self.params:
            grad = (p.grad if p.grad is not None else torch.zeros_like(p)).detach() * self.share
            self.comm.all_reduce(grad)
            out[self._names[id(p)]] = grad
        return out

    # -- checkpoints (at synchronisations) ------------------------------------------------------------
    def _at_sync(self) -> bool:
        step = self.inner_steps
        return (
            step % self.config.sync_every == 0 or step == self.steps or step <= self.config.start_local_step
        )

    def held_pieces(self, rank: int, world_size: int) -> list[Piece]:
        if not self._at_sync():
            raise RuntimeError(
                f"diloco saves checkpoints at synchronisations; step {self.inner_steps} is not one "
                f"(sync_every {self.config.sync_every})"
            )
        everything = full_state_tensors(self.model, self.optimizers[0])
        shared = {n: t for n, t in everything.items() if n.startswith("model/")}
        shared.update(self._outer_tensors())
        pieces = replicated_pieces(shared, rank, world_size)
        own = self.comm.rank
        prefix = "optim/" if own == 0 else f"inner/rank{own}/"
        for name, tensor in everything.items():
            if name.startswith("optim/"):
                pieces.append(Piece.full(prefix + name.removeprefix("optim/"), tensor))
        return pieces + codec_pieces(self._codec_states(), self._codec_layout(), own)

    def _codec_states(self) -> list[CodecState]:
        return [self.codec_state] if self.codec_state is not None else []

    def _codec_layout(self) -> str:
        return layout_of(self.name, self.comm, self.compressor)

    def _outer_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for anchor, p in zip(self.anchor, self.params, strict=True):
            for key, value in self.outer.state.get(anchor, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{OUTER}{key}/{self._names[id(p)]}"] = value.detach()
        return out

    def load_held(self, read: StateReader) -> None:
        """Everything is read first (one call), then the model, the inner and the outer state change."""
        inner_prefix = f"inner/rank{self.comm.rank}/"
        own_inner = self.comm.rank > 0 and any(n.startswith(inner_prefix) for n in read.shapes)
        inner = _Renamed(read, inner_prefix if own_inner else "optim/", "optim/")
        outer = _Renamed(read, OUTER, "optim/")
        local: dict[str, torch.Tensor] = {f"model/{n}": p for n, p in self.model.named_parameters()}
        local.update({f"model/{n}": b for n, b in self.model.named_buffers()})
        wanted = [*local, *inner.stored(), *outer.stored()]
        cache = _Cached(read, read(dict.fromkeys(wanted)))
        codec = read_codec_states(self._codec_states(), self._codec_layout(), self.comm.rank, read)
        params = dict(self.model.named_parameters())
        load_named_state(local, params, self.optimizers[0], _Renamed(cache, inner.source, "optim/"))
        anchors = {self._names[id(p)]: a for p, a in zip(self.params, self.anchor, strict=True)}
        load_named_state({}, anchors, self.outer, _Renamed(cache, OUTER, "optim/"))
        with torch.no_grad():
            for anchor, p in zip(self.anchor, self.params, strict=True):
                anchor.copy_(p)
        self.window_items = 0.0
        restore_codec_states(self._codec_states(), codec)


class _Renamed:
    """A ``StateReader`` that shows names under ``source`` as if they were under ``shown`` (and hides
    the others of ``shown``), so the usual optimizer loader reads ``outer/...`` or ``inner/rank<r>/...``."""

    def __init__(self, read: StateReader, source: str, shown: str) -> None:
        self.read, self.source, self.shown = read, source, shown
        self.shapes: dict[str, tuple[int, ...]] = {
            n: tuple(s) for n, s in read.shapes.items() if not n.startswith(shown)
        }
        for name, shape in read.shapes.items():
            if name.startswith(source):
                self.shapes[shown + name.removeprefix(source)] = tuple(shape)

    def stored(self) -> list[str]:
        return [n for n in self.read.shapes if n.startswith(self.source)]

    def _stored_name(self, name: str) -> str:
        return self.source + name.removeprefix(self.shown) if name.startswith(self.shown) else name

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]:
        got = self.read({self._stored_name(n): span for n, span in requests.items()})
        return {n: got[self._stored_name(n)] for n in requests}


class _Cached:
    """A ``StateReader`` over tensors already read (whole tensors only)."""

    def __init__(self, read: StateReader, tensors: dict[str, torch.Tensor]) -> None:
        self.shapes = dict(read.shapes)
        self._tensors = tensors

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]:
        return {n: self._tensors[n] for n in requests}
