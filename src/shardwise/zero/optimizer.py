"""ZeRO stages 1 and 2: sharded optimizer state (and, in stage 2, sharded gradients).

Parameters stay whole on every rank, as views into flat buckets (:mod:`shardwise.zero.group`).
Communication per step, all through ``Comm``: each bucket's gradients are reduce-scattered (sum), so
each rank receives only the slice of the summed gradient that its optimizer shard needs; each
bucket's shards are all-gathered back into the full parameters as soon as that bucket is updated
(overlapping the next bucket's update), all waited for at the end of the step. On gloo these take
faster forms of the same exchange (an in-place all-reduce, per-rank broadcasts: see the group module).

Both reduce-scatter each bucket as soon as its last gradient has accumulated during backward
(buckets launched strictly in order, so every rank issues the same collectives), overlapping
communication with the rest of backward (stage 1 never waits during backward; stage 2 keeps at most
two reductions in flight). Stage 1 keeps the full gradients in one flat buffer per bucket (the
parameters' ``.grad`` are views of it, so autograd accumulates there without a copy; the summed
slice lands in it) until the step; stage 2 frees the full gradients as soon as they are flattened,
keeping only its shard. Under ``no_sync`` both accumulate full gradients
locally and communicate on the last micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from shardwise.checkpoint.source import HeldWeights
from shardwise.collectives.api import Comm
from shardwise.config import ZeroConfig
from shardwise.engine.base import Role
from shardwise.zero.base import ZeroBase
from shardwise.zero.group import FlatGroup


def split_buckets(
    named: list[tuple[str, nn.Parameter]], bucket_bytes: float, element_size: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of ``named`` of about ``bucket_bytes`` each (a parameter never splits)."""
    buckets: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, param in named:
        if buckets[-1] and size + param.numel() * element_size > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, param))
        size += param.numel() * element_size
    return buckets


class ZeroEngine(ZeroBase):
    """ZeRO stage 1 or 2 over the data-parallel group ``comm``."""

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        stage: int,
        config: ZeroConfig,
        role: Role | None = None,
        weights: HeldWeights | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroEngine runs stages 1 and 2; got {stage} (stage 3: ShardedModule)")
        self.stage = stage
        self.name = f"zero{stage}"
        # stage 1 reduces in place in gradient buffers that live all step: never block backward
        self.reduce_window = None if stage == 1 else 2
        super().__init__(model, comm, config, role, weights)
        self._sync = True
        self._launched = 0  # buckets whose reduce-scatter has started this step, in order
        self._missing: list[int] = []  # per bucket: gradients not yet accumulated
        self._reset_counts()
        for index, group in enumerate(self.groups):
            if stage == 1:
                group.attach_grad_buffer()
            for j, p in enumerate(group.params):
                hook = p.register_post_accumulate_grad_hook(lambda _, i=index, j=j: self._on_grad(i, j))
                self._hooks.append(hook)

    def build_groups(self) -> list[FlatGroup]:
        # backward produces gradients roughly in reverse registration order: bucket in that order
        named = list(reversed(self.trainable))
        element = self.precision.master.itemsize
        buckets = split_buckets(named, self.config.bucket_mb * 2**20, element)
        alias = self.config.offload == "none"
        return [
            FlatGroup(bucket, self.comm, self.precision, alias_master=alias, weights=self.weights, whole=True)
            for bucket in buckets
        ]

    def _reset_counts(self) -> None:
        self._launched = 0
        self._missing = [len(g.params) for g in self.groups]

    def _on_grad(self, index: int, param_index: int) -> None:
        self.mark_used(index, param_index)  # under no_sync too: any micro-batch counts
        if not self._sync:
            return
        if self.stage == 2:  # flatten now: the full gradient lives only until its bucket is sent
            self.groups[index].take_grad(param_index)
        self._missing[index] -= 1
        while self._launched < len(self.groups) and self._missing[self._launched] == 0:
            self.launch_reduce(self.groups[self._launched], release=self.stage == 2)
            self._launched += 1

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def exchange_grads(self) -> None:
        for group in self.groups[self._launched :]:
            self.launch_reduce(group, release=self.stage == 2)
        self.wait_reduces()
        self.share_usage()
        self._reset_counts()

    def after_group_step(self, index: int) -> None:
        self.groups[index].gather(async_op=True)  # overlaps the next group's update

    def after_step(self) -> None:
        for group in self.groups:  # (already started unless the step was skipped) all in flight at once
            group.gather(async_op=True)
        for group in self.groups:
            if self.stage == 1:
                group.attach_grad_buffer()
            group.wait_gather()
