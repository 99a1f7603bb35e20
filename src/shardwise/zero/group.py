"""One flat group of parameters: a full buffer the parameters view, and this rank's master shard.

A ``FlatGroup`` is a bucket (stages 1-2) or a unit (stage 3). Its parameters are views into one flat,
padded buffer laid out by :mod:`shardwise.zero.flat_param`; each rank owns one equal slice of it as an
fp32 (or model-dtype) master tensor that its optimizer updates. Communication, all through ``Comm``:
``gather`` all-gathers the shards into the full buffer; ``reduce_grads`` reduce-scatters (sum) the
gradients into this rank's gradient shard. ``free`` and ``gather`` release and re-allocate the full
buffer's storage in place, so autograd's saved views stay valid (the trick FSDP uses).

On gloo (native algorithm) both collectives take other forms, because gloo's own are slow: its
reduce-scatter copies its input and all-reduces it (measured 18.6 ms against 12.2 ms for an all-reduce
of the same 14.7 MB buffer, 2 ranks; 39 ms against 32 ms at 4 ranks), and its all-gather took 12.5 ms
where one broadcast per rank of its own slice took 6.0 ms (19.5 against 12.7 ms at 4 ranks). So there
the gradient buffer is all-reduced in place (this rank keeps its slice: twice a reduce-scatter's bytes
on the wire, less time, no output buffer), and the gather is ``world_size`` asynchronous broadcasts
straight into the full buffer's slices (the same bytes as an all-gather, no input copy). NCCL and our
explicit algorithms keep reduce-scatter and all-gather.

With gradient compression (``compress_with``), the gradient buffer goes through the codec layer
(``compression.CompressedComm.reduce``) instead: a codec decodes the whole sum over ranks (an all-reduce
or all-gather of its own messages, never a reduce-scatter) and this rank keeps its slice, exactly as in
the gloo all-reduce form above. Padding is no tensor's: the codec layer keeps it zero.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.checkpoint.source import HeldWeights, materialize
from shardwise.collectives.api import Comm, Work
from shardwise.collectives.p2p import Done
from shardwise.compression import CodecState, CompressedComm, Segment
from shardwise.engine.precision import Precision
from shardwise.zero.flat_param import FlatLayout, layout_of


@dataclass
class _Pending:
    work: Work
    shard: torch.Tensor | None  # where the reduced slice lands (None: all-reduced in ``full``)
    full: torch.Tensor  # kept alive until the collective completes
    owned: bool = True  # ``full`` is the group's alone: released once the reduction is read


class FlatGroup:
    """Parameters ``named`` (unique, trainable) flattened for ``comm.world_size`` ranks."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        comm: Comm,
        precision: Precision,
        alias_master: bool,
        weights: HeldWeights | None = None,
        whole: bool = False,
    ) -> None:
        """``weights``: where parameters on the meta device get their values: read straight into
        the full buffer (``whole``: stages 1-2, which keep it) or into this rank's shard alone
        (stage 3)."""
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.comm, self.precision = comm, precision
        self.layout: FlatLayout = layout_of(named, comm.world_size)
        if weights is not None and not whole and all(weights.knows(n) for n in self.names):
            master = self._read_shard(weights)
        else:
            master = self._flatten_params(alias_master, weights)
        self.master = nn.Parameter(master)
        self.grad_shard: torch.Tensor | None = None  # (shard_size,) master dtype, summed over ranks
        self.flat_grad: torch.Tensor | None = None  # stage 1: (padded_numel,) the parameters' .grad views
        self._incoming: torch.Tensor | None = None  # stages 2-3: (padded_numel,) gradients taken so far
        self._pending: list[_Pending] = []
        self._gather_work: list[Work] | None = None
        # the full buffer's device picks the backend (cpu:gloo,cuda:nccl): host tensors go over gloo,
        # and so do CUDA ones in the shared-GPU test bed (where gloo's all-reduce and broadcast take them)
        on_gloo = self.full.device.type == "cpu" or comm.cuda_over_gloo
        self._gloo = comm.world_size > 1 and on_gloo
        # offload replaces this with a context that maps the master shard in while it is read
        self.resident: Callable[[], AbstractContextManager[None]] = nullcontext
        self.compressor: CompressedComm | None = None  # see compress_with
        self.codec_state: CodecState | None = None

    def compress_with(self, compressor: CompressedComm) -> None:
        """Reduce this group's gradients through ``compressor`` (with error feedback of its own)."""
        segments = [Segment(slot.offset, tuple(slot.shape)) for slot in self.layout.slots]
        self.compressor = compressor
        self.codec_state = compressor.new_state(self.layout.padded_numel, self.precision.master, segments)

    # -- parameters ---------------------------------------------------------------------------------
    def _flatten_params(self, alias_master: bool, weights: HeldWeights | None = None) -> torch.Tensor:
        """The full buffer from the parameters' values (those on meta read from ``weights`` straight
        into it: no parameter is ever held whole beside it); returns this rank's master shard."""
        start, end = self.layout.shard_range(self.comm.rank)
        device = weights.device if weights is not None and self.params[0].is_meta else self.params[0].device
        source = torch.zeros(self.layout.padded_numel, dtype=self.params[0].dtype, device=device)
        for name, slot, p in zip(self.names, self.layout.slots, self.params, strict=True):
            into = source[slot.offset : slot.offset + slot.numel]
            if weights is not None and weights.knows(name):
                weights.read(name, 0, slot.numel, into)
                if p.is_meta:
                    materialize(p, torch.empty(0, dtype=p.dtype, device=device))  # a view of the buffer below
            else:
                into.copy_(p.detach().reshape(-1))
        # (padded_numel,) in the compute dtype; parameters are views of it
        compute = self.precision.compute
        self.full = source.to(compute) if compute != source.dtype else source
        self._bind_views()
        if alias_master and self.precision.master == compute:
            return self.full[start:end]  # stages 1-2 in one dtype: the shard is the buffer itself
        return source[start:end].to(self.precision.master).clone()

    def _read_shard(self, weights: HeldWeights) -> torch.Tensor:
        """Stage 3 from a file (``model.init_from``), parameters on meta: only this rank's shard is read
        (each parameter's overlap with it, ``layout.overlaps``) and kept as the master. The full buffer
        exists for an instant, so that the parameters can view it, and is freed before any read: a
        rank holds its shards plus at most one unit. The first ``gather`` fills it."""
        device = weights.device if self.params[0].is_meta else self.params[0].device
        self.full = torch.empty(self.layout.padded_numel, dtype=self.precision.compute, device=device)
        for p in self.params:  # real now, still without data: _bind_views gives each its view
            if p.is_meta:
                materialize(p, torch.empty(0, dtype=self.precision.compute, device=device))
        self._bind_views()
        self.full.untyped_storage().resize_(0)
        start, end = self.layout.shard_range(self.comm.rank)
        master = torch.zeros(end - start, dtype=self.precision.master, device=device)  # padding: zero
        for piece in self.layout.overlaps(self.comm.rank):
            # straight into the master (cast to its dtype): nothing of the parameter is held beside it
            into = master[piece.shard_start : piece.shard_end]
            weights.read(piece.name, piece.param_start, piece.param_end, into)
        return master

    def _bind_views(self) -> None:
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            p.data = self.full[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def _by_gloo_workaround(self, op: str, nbytes: int) -> bool:
        """Whether ``op`` runs in the faster gloo form (see the module docstring)."""
        return self._gloo and self.comm.resolve(op, nbytes) == "native"

    def _master_is_own(self) -> bool:
        """The master shard is a tensor of its own, always mapped in: it can feed a gather directly."""
        own = self.master.untyped_storage().data_ptr() != self.full.untyped_storage().data_ptr()
        return own and self.resident is nullcontext

    @property
    def collecting(self) -> bool:
        """Whether a flat buffer is already collecting this group's gradients (stages 2-3)."""
        return self._incoming is not None

    @property
    def materialized(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Release the full buffer's memory; the parameter views keep their shapes but no data."""
        self.wait_gather()
        self.full.untyped_storage().resize_(0)

    def gather(self, async_op: bool = False) -> None:
        """All-gather every rank's shard (from ``master``) into the full buffer."""
        if self._gather_work is not None:
            return
        if not self.materialized:
            self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
        if self._by_gloo_workaround("all_gather", self.full.numel() * self.full.element_size()):
            self._broadcast_shards()
        else:
            self._all_gather()
        if not async_op:
            self.wait_gather()

    def _broadcast_shards(self) -> None:
        """Each rank broadcasts its slice of the full buffer, its master shard written there first."""
        size, full = self.layout.shard_size, self.full.data  # .data: no version bump (see _all_gather)
        start, end = self.layout.shard_range(self.comm.rank)
        if self.master.data_ptr() != full[start:end].data_ptr():  # not the slice itself already
            with self.resident():
                full[start:end].copy_(self.master.detach())
        self._gather_work = [
            self.comm.broadcast(full[r * size : (r + 1) * size], src=r, async_op=True, algorithm="native")
            for r in range(self.comm.world_size)
        ]

    def _all_gather(self) -> None:
        with self.resident():
            # a pinned host master (cpu offload) uploads without blocking, on the stream the gather reads
            shard = self.master.detach().to(self.full.device, self.precision.compute, non_blocking=True)
            if shard.data_ptr() == self.master.data_ptr() and not self._master_is_own():
                shard = shard.clone()  # the input may not alias the output buffer (nor a mapped file)
        # .data: the in-place write must not bump the version counter autograd checks on saved views
        self._gather_work = [self.comm.all_gather(self.full.data, shard, async_op=True)]

    def wait_gather(self) -> None:
        if self._gather_work is not None:
            for work in self._gather_work:
                work.wait()
            self._gather_work = None

    # -- gradients ----------------------------------------------------------------------------------
    def attach_grad_buffer(self) -> None:
        """Give every parameter a zeroed ``.grad`` that views one flat buffer (autograd adds in place)."""
        if self.flat_grad is None:
            self.flat_grad = torch.zeros_like(self.full)
        else:
            self.flat_grad.zero_()
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            p.grad = self.flat_grad[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def take_grad(self, index: int) -> None:
        """Add parameter ``index``'s ready gradient into the flat buffer (zeros until the group is
        reduced: under a pipeline, several micro-batches' gradients sum there) and free it."""
        if self._incoming is None:
            dtype, device = self.precision.master, self.full.device
            self._incoming = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        slot, p = self.layout.slots[index], self.params[index]
        if p.grad is not None:
            self._incoming[slot.offset : slot.offset + slot.numel].add_(p.grad.reshape(-1))
            p.grad = None

    def _flatten_grads(self, release: bool) -> torch.Tensor:
        dtype = self.precision.master
        if self.flat_grad is not None:
            return self.flat_grad.to(dtype)
        full = self._incoming
        self._incoming = None
        if full is None:
            full = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.full.device)
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            if p.grad is not None:
                full[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
                if release:
                    p.grad = None
        return full

    def reduce_grads(self, release: bool) -> None:
        """Start reduce-scattering the parameters' ``.grad`` (missing ones count as zero)."""
        full = self._flatten_grads(release)
        if self.compressor is not None and self.codec_state is not None:  # decoded whole; we keep a slice
            reduction = self.compressor.reduce(full, self.codec_state, async_op=True)
            self._pending.append(_Pending(reduction, None, full, owned=False))  # the codec's to keep
            return
        if self.comm.world_size == 1:  # a group of one: the sum is the gradient itself, in place
            self._pending.append(_Pending(Done(), None, full))
            return
        if self._by_gloo_workaround("reduce_scatter", full.numel() * full.element_size()):
            work = self.comm.all_reduce(full, op="sum", async_op=True, algorithm="native")
            self._pending.append(_Pending(work, None, full))
            return
        shard = torch.empty(self.layout.shard_size, dtype=full.dtype, device=full.device)
        work = self.comm.reduce_scatter(shard, full, op="sum", async_op=True)
        self._pending.append(_Pending(work, shard, full))

    def wait_grads(self) -> None:
        """Finish outstanding reductions and add them to the gradient shard."""
        start, end = self.layout.shard_range(self.comm.rank)
        for pending in self._pending:
            pending.work.wait()
            shard = pending.full[start:end] if pending.shard is None else pending.shard
            if self.flat_grad is not None and self.flat_grad.dtype == shard.dtype:
                # stage 1: the summed slice lives in the full gradient buffer, no extra copy kept
                if shard.data_ptr() != self.flat_grad[start:end].data_ptr():
                    self.flat_grad[start:end].copy_(shard)
                self.grad_shard = self.flat_grad[start:end]
            elif self.grad_shard is None:  # a slice of an all-reduced buffer is copied out to free it
                self.grad_shard = shard.clone() if pending.shard is None else shard
            else:
                self.grad_shard.add_(shard)
            if pending.owned:
                self._release(pending.full)
        self._pending.clear()

    def _release(self, full: torch.Tensor) -> None:
        """A reduction's flat input, read: its memory goes now rather than whenever the backend drops
        its last reference (gloo's worker thread may hold one a moment after ``wait`` returns, long
        enough, on a loaded machine, for the next unit's buffer to be made beside it). Not where the
        gradient buffer or the shard lives in it."""
        storage = full.untyped_storage()
        kept = (t for t in (self.flat_grad, self.grad_shard) if t is not None)
        if all(t.untyped_storage().data_ptr() != storage.data_ptr() for t in kept):
            storage.resize_(0)

    def full_gradient(self) -> torch.Tensor:
        """All-gather the gradient shards into a (padded_numel,) tensor (inspection only)."""
        shard = self.grad_shard
        if shard is None:
            shard = torch.zeros(self.layout.shard_size, dtype=self.precision.master, device=self.full.device)
        out = shard.new_empty(self.layout.padded_numel)
        self.comm.all_gather(out, shard.contiguous())
        return out

    def full_master(self) -> torch.Tensor:
        """All-gather the master shards into a (padded_numel,) tensor (inspection only)."""
        with self.resident():
            shard = self.master.detach().to(self.full.device).clone()
        out = shard.new_empty(self.layout.padded_numel)
        self.comm.all_gather(out, shard)
        return out

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
            for name, slot in zip(self.names, self.layout.slots, strict=True)
        }
