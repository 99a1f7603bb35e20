"""What every ZeRO stage shares: start from rank 0's weights, step sharded optimizers, inspect.

Communication: one broadcast per parameter and buffer at start (rank 0's initial weights); one
all-reduce (max) per step of which parameters got a gradient (:mod:`shardwise.zero.unused`: those no
rank used are left alone, as torch leaves ``grad = None``); in fp16, one all-reduce (max) of the
overflow flag per step; the inspection calls (``full_parameters``,
``full_gradients``) all-gather shards. Stage-specific gradient and parameter traffic lives in
:mod:`shardwise.zero.optimizer` (stages 1-2) and :mod:`shardwise.zero.sharded_module` (stage 3).
Stages follow Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC 2020).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.optim import Optimizer

from shardwise.checkpoint.manager import Piece
from shardwise.checkpoint.source import HeldWeights
from shardwise.collectives.api import Comm
from shardwise.compression import CompressedComm
from shardwise.config import ZeroConfig
from shardwise.engine.base import Engine, Role
from shardwise.engine.nonfinite import all_finite, nonfinite_names
from shardwise.engine.precision import LossScaler, resolve_precision
from shardwise.engine.state import StateReader
from shardwise.engine.update import NamedTensors, sq_sum
from shardwise.zero.flat_param import unique_parameters
from shardwise.zero.group import FlatGroup
from shardwise.zero.memory import memory_report
from shardwise.zero.offload import CpuOffload, HostStaging, NoOffload, Offload, build_offload
from shardwise.zero.state import gathered_state, load_zero_state, zero_state_pieces
from shardwise.zero.unused import group_usage, isolated, plan_passes, share, stepped


def broadcast_initial_state(model: nn.Module, comm: Comm) -> None:
    """Every rank starts from rank 0's parameters and buffers (those on meta are read from the weights
    file by every rank instead)."""
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen and not tensor.is_meta:
            seen.add(id(tensor))
            comm.broadcast(tensor.data, src=0)


class ZeroBase(Engine):
    """Sharded master weights and optimizer state over ``comm``; subclasses decide the groups."""

    comm: Comm
    units_are_parameters = False  # one optimizer per flat master shard
    update_communicates = True  # a group's gather starts as it steps (after_group_step)
    stage: int = 0
    reduce_window: int | None = 2  # reduce-scatters in flight at most; None: no limit

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        config: ZeroConfig,
        role: Role | None = None,
        weights: HeldWeights | None = None,
    ) -> None:
        super().__init__(model, role)
        self.comm, self.config = comm, config
        self.weights = weights  # parameters on meta: each group reads its part (build_groups)
        self.usage_comms: list[Comm] = []  # more groups the used flags are agreed over (hybrid replicas)
        broadcast_initial_state(model, comm)
        self.trainable = unique_parameters(model.named_parameters())
        if not self.trainable:
            raise ValueError("the model has no trainable parameters to shard")
        self.precision = resolve_precision(config.precision, self.trainable[0][1].dtype)
        self.scaler = LossScaler(self.precision.scaled)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._in_flight: list[FlatGroup] = []  # groups whose gradient reduce-scatter has started
        self.groups: list[FlatGroup] = self.build_groups()
        if weights is not None:  # what no group shards (frozen parameters, saved buffers): whole
            weights.load_whole(model, skip={id(p) for g in self.groups for p in g.params})
        self.weights = None  # read once: no file is kept open during training
        self.usage = [group_usage(g) for g in self.groups]  # who got a gradient: see zero.unused
        self._cast_frozen()
        if config.offload == "cpu":  # before any optimizer exists, so its state is made in host memory
            CpuOffload(self.groups)
        self.offload: Offload = NoOffload()  # disk offload needs the optimizers: see attach_optimizers
        self.staging = HostStaging(len(self.groups))  # gradient shards to a master on the host
        self._memory: dict[str, float] = {}

    def use_compression(self, compressor: CompressedComm) -> None:
        """Reduce every group's gradients through the codec layer (before the first step)."""
        for group in self.groups:
            group.compress_with(compressor)

    def attach_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        super().attach_optimizers(optimizers)
        self.offload = build_offload(self.config, self.groups, self.optimizers)

    def build_groups(self) -> list[FlatGroup]:
        raise NotImplementedError

    def launch_reduce(self, group: FlatGroup, release: bool) -> None:
        """Start ``group``'s reduce-scatter (it overlaps the rest of backward); once more than
        ``reduce_window`` are in flight, finish the oldest, so flat gradient buffers never pile up."""
        group.reduce_grads(release)
        self._in_flight.append(group)
        if self.reduce_window is not None and len(self._in_flight) > self.reduce_window:
            self._in_flight.pop(0).wait_grads()

    def mark_used(self, index: int, param_index: int) -> None:
        """Parameter ``param_index`` of group ``index`` got a gradient on this rank (from its hook)."""
        self.usage[index].used[param_index] = True

    def share_usage(self) -> None:
        """After the step's gradients: which parameters got one on any rank (one small all-reduce, and
        one more per group in ``usage_comms``: hybrid sharding's replicas)."""
        share(self.usage, self.comm, *self.usage_comms)

    def wait_reduces(self) -> None:
        for group in self._in_flight:
            group.wait_grads()
        self._in_flight.clear()

    def _cast_frozen(self) -> None:
        for p in self.model.parameters():
            if not p.requires_grad and p.dtype != self.precision.compute:
                p.data = p.data.to(self.precision.compute)

    # -- the step ---------------------------------------------------------------------------------

    def _overflowed(self) -> bool:
        """Unscale fp16 gradient shards; True (on every rank) when any is inf or NaN."""
        if not self.scaler.enabled:
            return False
        shards = [g.grad_shard for g in self.groups if g.grad_shard is not None]
        device = shards[0].device if shards else self.device
        flag = torch.zeros(1, device=device)  # on the shards' device: stacked there, read once
        if shards:
            torch._foreach_div_(shards, self.scaler.scale)
            flag.copy_((~all_finite(shards)).to(flag.dtype).reshape(1))
        self.comm.all_reduce(flag, op="max")
        found = bool(flag.item())
        self.scaler.update(found)
        return found

    # -- the update (Engine.optimizer_step) ---------------------------------------------------------
    def optimizer_units(self) -> list[NamedTensors]:
        """One optimizer per flat group, over this rank's master shard of it."""
        return [[(f"flat{i}", group.master)] for i, group in enumerate(self.groups)]

    def held_norm_sq(self) -> tuple[torch.Tensor, Comm | None]:
        """Squares of this rank's gradient shards (padding is zero): each element lives in one shard."""
        shards = [g.grad_shard for g in self.groups if g.grad_shard is not None]
        return sq_sum(shards, self.device), self.comm

    def scale_grads(self, factor: float) -> None:
        for group in self.groups:
            if group.grad_shard is not None:
                group.grad_shard.mul_(factor)

    def held_grads(self, names: set[str]) -> list[torch.Tensor]:
        """This rank's gradient shard's ranges of the parameters ``names`` (views into the shard)."""
        out = []
        for group in self.groups:
            if group.grad_shard is None:
                continue
            for overlap in group.layout.overlaps(self.comm.rank):
                if overlap.name in names:
                    out.append(group.grad_shard[overlap.shard_start : overlap.shard_end])
        return out

    def nonfinite_grad(self) -> str | None:
        """This rank's gradient shards (what it holds after ``finish_grads``); of the parameters with a
        NaN or inf in this rank's range, the first in ``named_parameters`` order."""
        parts = [
            (overlap.name, group.grad_shard[overlap.shard_start : overlap.shard_end])
            for group in self.groups
            if group.grad_shard is not None
            for overlap in group.layout.overlaps(self.comm.rank)
        ]
        bad = set(nonfinite_names(parts))
        return next((name for name, _ in self.trainable if name in bad), None)


    def prepare_update(self) -> bool:
        self._memory = memory_report(self)  # gradients are live now: the moment the formula describes
        return not self._overflowed()

    @contextmanager
    def unit_update(self, index: int) -> Iterator[None]:
        """Group ``index``'s update, leaving parameters that got no gradient alone (``zero.unused``):
        passes before the last step here; the caller's ``optimizer.step()`` is the last."""
        group, optimizer, usage = self.groups[index], self.optimizers[index], self.usage[index]
        with self.offload.resident(index):
            shard, master = group.grad_shard, group.master
            passes = plan_passes(usage, optimizer.state.get(master, {}))
            grad = torch.zeros_like(master) if shard is None else self.staging.take(index, shard, master)
            master.grad = grad if passes else None  # nothing used anywhere: torch skips the group
            try:
                for one in passes[:-1]:
                    with isolated(one, optimizer, master):
                        optimizer.step()
                with isolated(passes[-1], optimizer, master) if passes else nullcontext():
                    yield
            finally:
                master.grad = None
            stepped(usage)
            self.after_group_step(index)

    def run_optimizers(self, lr_scale: float = 1.0) -> None:
        """Every group's gradient shard on its way to a master in host memory at once (offload), then
        the updates in turn, each waiting for its own copy (``zero.offload.HostStaging``)."""
        # a master on disk is an empty host tensor between updates: its dtype and device are all read
        self.staging.start([g.grad_shard for g in self.groups], [g.master for g in self.groups])
        super().run_optimizers(lr_scale)

    def after_update(self) -> None:
        for group in self.groups:
            group.grad_shard = None
        for p in self.model.parameters():
            p.grad = None
        self.after_step()

    def after_group_step(self, index: int) -> None:
        """Stage-specific: group ``index``'s shard is updated (its gather may start while the
        next group steps)."""

    def after_step(self) -> None:
        """Stage-specific: make the updated parameters visible to the next forward."""

    # -- inspection -------------------------------------------------------------------------------
    def held_parameters(self) -> dict[str, torch.Tensor]:
        by_name: dict[str, torch.Tensor] = {}
        for i, group in enumerate(self.groups):
            with self.offload.resident(i):
                by_name.update(group.unflatten(group.full_master()))
        return {
            name: by_name[name] if name in by_name else p.detach().clone()
            for name, p in self.model.named_parameters()
        }

    def held_gradients(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for group in self.groups:
            out.update(group.unflatten(group.full_gradient() / self.scaler.scale))
        return out

    def metrics(self) -> dict[str, float]:
        """Model-state bytes by component beside the ZeRO formula, taken just before the last update;
        in fp16, the loss scale and the steps its overflows skipped."""
        out = dict(self._memory)
        if self.scaler.enabled:
            out.update(loss_scale=self.scaler.scale, scaler_skipped_steps=self.scaler.skipped_steps)
        return out

    # -- checkpoints (see shardwise.zero.state) ----------------------------------------------------
    def held_pieces(self, rank: int, world_size: int) -> list[Piece]:
        return zero_state_pieces(self, rank, world_size)

    def load_held(self, read: StateReader) -> None:
        load_zero_state(self, read)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor at its global shape, by checkpoint name, on every rank (all-gathers)."""
        return gathered_state(self)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.offload.close()
