"""All-reduce data parallelism: every rank holds the whole model and its own optimizer.

Communication: rank 0's initial parameters and buffers are broadcast once. During backward, gradients
land directly in flat buckets (each parameter's ``.grad`` is a view into its bucket, so there is no
copy); a post-accumulate-grad hook counts the parameters still missing from each bucket, and when a
bucket is complete it is all-reduced asynchronously (sum) while backward goes on. Buckets are launched
strictly in index order on every rank, so every rank issues the same collectives in the same order
whatever order its gradients arrive in. ``finish_grads`` launches what is left and waits; then each
rank steps its own optimizer on identical gradients. Buckets hold parameters in reverse registration
order (roughly the order backward produces them); the first bucket is kept small so communication
starts early, the rest are ``bucket_mb`` large (after PyTorch's DDP, Li et al., VLDB 2020).

Cases handled, and how:
- ``no_sync()``: gradients accumulate in the buckets; nothing is sent until the first backward outside.
- Parameters that get no gradient in a step: an error naming them, unless ``find_unused_parameters``;
  then a used-mask is all-reduced (max) and a parameter no rank used keeps ``grad = None``, exactly as
  in one process, so the optimizer skips it.
- A rank with no samples this step (uneven shares): it sends zeros and takes part in every collective.
- Frozen parameters: never bucketed; their values come from rank 0 at the start.
- Buffers (BatchNorm statistics, say): broadcast from rank 0 before each step when
  ``broadcast_buffers`` is set, as PyTorch does; otherwise each rank keeps its own.
- Tied weights: one parameter object, so one gradient slot.
- Gradient compression (``comm.compress``): each complete bucket goes through the codec layer
  (``compression.CompressedComm.reduce``, asynchronous like the plain all-reduce) instead of being
  all-reduced as it is; each bucket keeps its own error-feedback state, and its tensors' shapes for
  PowerSGD. Checkpoints hold each rank's bucket states (``engine.codec_state``), so a resume on the
  same ranks and buckets goes on exactly.
- A dp group of one rank (tensor or pipeline parallelism using every rank, or ``--nproc 1``): there is
  nothing to all-reduce, so no buckets and no hooks: autograd makes each ``.grad`` in backward and
  ``after_update`` drops it (``set_to_none``), as a plain training loop does; gradients then occupy
  memory only from backward to the update, instead of a flat copy of the model held through forward
  (the peak of a tp run, where activations are largest). With a codec the buckets stay (its error
  feedback is per bucket, and it runs even on one rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.manager import Piece
from shardwise.collectives.api import Comm, Work
from shardwise.collectives.coalesced import broadcast_coalesced
from shardwise.compression import CodecState, CompressedComm, Segment
from shardwise.config import DDPConfig
from shardwise.device import HOST
from shardwise.engine.base import Engine, Role
from shardwise.engine.codec_state import codec_pieces, layout_of, read_codec_states, restore_codec_states
from shardwise.engine.full_state import full_state_tensors, load_full_state, replicated_pieces
from shardwise.engine.nonfinite import all_finite
from shardwise.engine.precision import LOSS_SCALE
from shardwise.engine.state import StateReader
from shardwise.engine.update import NamedTensors, sq_sum


@dataclass
class Bucket:
    """A flat gradient buffer shared by consecutive parameters of one dtype."""

    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of numels,)
    offsets: list[int]
    pending: int = 0
    work: Work | None = None
    ready: set[int] = field(default_factory=set)  # ids of params whose gradient arrived this step
    codec: CodecState | None = None  # with comm.compress: this bucket's error feedback and layout


def plan_buckets(
    params: Sequence[nn.Parameter], bucket_bytes: int, first_bucket_bytes: int
) -> list[list[nn.Parameter]]:
    """Group parameters (taken in reverse order) into buckets of one dtype and at most the cap each.

    A parameter larger than the cap gets a bucket of its own.
    """
    groups: list[list[nn.Parameter]] = []
    size, cap = 0, first_bucket_bytes
    for param in reversed(params):
        nbytes = param.numel() * param.element_size()
        if groups and size + nbytes <= cap and groups[-1][0].dtype == param.dtype:
            groups[-1].append(param)
            size += nbytes
        else:
            if groups:
                cap = bucket_bytes
            groups.append([param])
            size = nbytes
    return groups


class DDPEngine(Engine):
    """Our all-reduce data parallelism over ``comm`` (the dp axis)."""

    name = "ddp"
    comm: Comm

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        config: DDPConfig,
        role: Role | None = None,
        compressor: CompressedComm | None = None,
    ) -> None:
        super().__init__(model, role)
        self.comm, self.config, self.compressor = comm, config, compressor
        named = list(model.named_parameters())  # tied weights appear once
        self._names = {id(p): n for n, p in named}
        self.params = [p for _, p in named if p.requires_grad]
        self._buffers = [b for b in model.buffers() if b.is_floating_point()]
        broadcast_coalesced(comm, [p.data for _, p in named] + list(model.buffers()))
        # one rank alone has nothing to reduce: autograd's own .grad tensors, made in backward (module doc)
        self.bucketed = comm.world_size > 1 or compressor is not None
        bucket_caps = int(config.bucket_mb * 2**20), int(config.first_bucket_mb * 2**20)
        groups = plan_buckets(self.params, *bucket_caps) if self.bucketed else []
        self.buckets = [self._make_bucket(g) for g in groups]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # index of the next bucket to launch
        self._sync = True
        hooked = self.params if self.bucketed else []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in hooked]
        self._start_step()

    def _make_bucket(self, params: list[nn.Parameter]) -> Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        codec = None
        if self.compressor is not None:
            segments = [Segment(o, tuple(p.shape)) for p, o in zip(params, offsets, strict=True)]
            codec = self.compressor.new_state(total, buffer.dtype, segments)
        return Bucket(params, buffer, offsets, codec=codec)

    # -- gradient views -------------------------------------------------------------------------
    def _attach_grads(self) -> None:
        """Point every parameter's ``.grad`` at its slot in its bucket (re-done if a user cleared it)."""
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = bucket.buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view

    def _start_step(self) -> None:
        self._attach_grads()
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.ready.clear()
            bucket.work = None
        self._next = 0

    # -- the step -------------------------------------------------------------------------------
    def begin_step(self, micro_batches: Sequence[Any], global_count: float) -> float:
        self._attach_grads()
        if self.config.broadcast_buffers and self._buffers:
            broadcast_coalesced(self.comm, self._buffers)
        return global_count

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in bucket.ready:
            return  # a second backward within one step (reentrant checkpointing): already counted
        bucket.ready.add(id(param))
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.pending and not force:
                return
            if self.compressor is not None and bucket.codec is not None:
                bucket.work = self.compressor.reduce(bucket.buffer, bucket.codec, async_op=True)
            else:
                bucket.work = self.comm.all_reduce(bucket.buffer, "sum", async_op=True)
            self._next += 1

    def _got_grad(self, param: nn.Parameter) -> bool:
        """Whether ``param`` received a gradient this step (unbucketed: autograd made its ``.grad``,
        dropped at the last update)."""
        if not self.bucketed:
            return param.grad is not None
        return id(param) in self._bucket_of[id(param)].ready

    def exchange_grads(self) -> None:
        unused = [p for p in self.params if not self._got_grad(p)]
        had_backward = len(unused) < len(self.params)
        if unused and had_backward and not self.config.find_unused_parameters:
            names = ", ".join(self._names[id(p)] for p in unused[:4])
            more = f" and {len(unused) - 4} more" if len(unused) > 4 else ""
            raise RuntimeError(
                f"parameters {names}{more} received no gradient this step; if the model skips them on "
                "purpose, set ddp.find_unused_parameters = true (--find-unused-parameters)"
            )
        self._launch_ready(force=True)
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
        if self.config.find_unused_parameters:
            self._drop_globally_unused()

    def _drop_globally_unused(self) -> None:
        """A parameter no rank used keeps ``grad = None``, so the optimizer skips it as in one process."""
        flags = [float(self._got_grad(p)) for p in self.params]
        used = torch.tensor(flags, dtype=torch.float32, device=HOST)  # known on the host: over gloo
        self.comm.all_reduce(used, "max")
        for p, flag in zip(self.params, used.tolist(), strict=True):
            if not flag:
                p.grad = None

    # -- the update (Engine.optimizer_step) ---------------------------------------------------------
    def optimizer_units(self) -> list[NamedTensors]:
        return [[(self._names[id(p)], p) for p in self.params]]  # every rank: the whole model

    def _grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient this rank holds: the flat buckets (slots of unused parameters are zeros; a
        frozen parameter is never in one), or unbucketed the ``.grad`` tensors that exist."""
        if self.bucketed:
            return [bucket.buffer for bucket in self.buckets]
        return [p.grad for p in self.params if p.grad is not None]

    def held_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        return sq_sum(self._grad_tensors(), self.device), None  # every rank holds the whole, reduced gradient

    def prepare_update(self) -> bool:
        """fp16: unscale the reduced gradients; an inf or NaN skips the update and lowers the scale.
        The buckets are the same on every rank after the all-reduce, so every rank agrees alone."""
        if not self.scaler.enabled:
            return True
        grads = self._grad_tensors()
        finite = True
        if grads:
            torch._foreach_div_(grads, self.scaler.scale)
            finite = bool(all_finite(grads))  # stacked on the device, read once
        self.scaler.update(found_inf=not finite)
        return finite

    def after_update(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
        if not self.bucketed:  # freed until the next backward makes them (module doc)
            for p in self.params:
                p.grad = None
        self._start_step()

    # -- inspection -------------------------------------------------------------------------------
    def held_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def held_gradients(self) -> dict[str, torch.Tensor]:
        return {
            self._names[id(p)]: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for p in self.params
        }

    # -- checkpoints (every rank holds everything; ranks split the writing by bytes) ------------------
    def held_pieces(self, rank: int, world_size: int) -> list[Piece]:
        pieces = replicated_pieces(full_state_tensors(self.model, self.optimizers[0]), rank, world_size)
        if self.scaler.enabled and rank == 0:  # the same on every rank: one writes it
            pieces.append(Piece.full(LOSS_SCALE, self.scaler.state()))
        return pieces + codec_pieces(self._codec_states(), self._codec_layout(), self.comm.rank)

    def load_held(self, read: StateReader) -> None:
        saved = self.scaler.enabled and LOSS_SCALE in read.shapes  # absent: another precision saved it
        scale = read({LOSS_SCALE: None})[LOSS_SCALE] if saved else None
        states = self._codec_states()
        codec = read_codec_states(states, self._codec_layout(), self.comm.rank, read)
        load_full_state(self.model, self.optimizers[0], read)
        if scale is not None:
            self.scaler.load(scale)
        restore_codec_states(states, codec)

    def _codec_states(self) -> list[CodecState]:
        """Each bucket's error feedback (``comm.compress``; none without it), in bucket order."""
        return [b.codec for b in self.buckets if b.codec is not None]

    def _codec_layout(self) -> str:
        return layout_of(self.name, self.comm, self.compressor)

    def metrics(self) -> dict[str, float]:
        if not self.scaler.enabled:
            return {}
        return {"loss_scale": self.scaler.scale, "scaler_skipped_steps": self.scaler.skipped_steps}

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
