"""ZeRO stage 3: parameters sharded too, gathered one unit at a time.

Each child of the model's block list is one unit, a :class:`~shardwise.zero.group.FlatGroup`: the
list ``zero.unit`` names by dotted path (``transformer.h``, ``model.layers``), or, with ``zero.unit``
empty, the model's own (its adapter's block list, :mod:`shardwise.models.adapters`; for a model of no
known family the largest ModuleList/Sequential of one class of blocks; a model without one is a single
unit). Parameters outside the units (embeddings, final norm, a head tied to the
embedding) and any parameter shared between units form the root unit, all-gathered at the start of
forward and kept until the step's gradients are reduced. Communication, all through ``Comm``:

* forward: all-gather unit ``i`` just before it runs (prefetching unit ``i + 1``), free it after;
* backward: all-gather unit ``i`` again when the gradient of its output arrives; when its first
  parameter gradient arrives, wait for unit ``i + 1``'s reduce-scatter; when half have arrived,
  prefetch unit ``i - 1``.
  Each gradient is copied into the unit's flat buffer and freed at once; once the unit's last one has
  arrived, reduce-scatter (sum) the buffer into this rank's gradient shard (asynchronously, overlapping
  the next unit's backward) and free the full parameters. So at most one flat gradient buffer and two
  gathered units are alive at a time. The root's gradients stay as ``.grad`` until its last one
  (its final norm's arrives first, its embeddings' last), then go out the same way;
* step: each rank updates its own master shard; nothing is gathered until the next forward.

From weights on disk (``model.init_from``, the model built with its parameters on the meta device),
each unit reads only this rank's shard of its parameters into the master (``FlatGroup._read_shard``);
no rank ever holds its shards plus more than one unit, and no start-up broadcast is needed.

Under a pipeline (``pipeline_stage``, called by the pipeline runtime around each action of a stage),
the same units work per action: the root is gathered when a stage that uses it (the first or the
last) runs, units are gathered by the hooks above and prefetched only within the running stage, and
whatever an action left gathered is released when it ends. A zero-bubble schedule's I pass
(backward with the linear layers keeping their weight gradients for W, ``engine/linear.py``) gathers
each unit through the same output hooks but does not give every parameter its gradient to free it by,
so each unit is released when backward reaches the one before it (the blocks of every model that
splits run in sequence); the W pass computes the kept weight gradients from the inputs and output
gradients I kept, which needs no weight: it gathers nothing, and its gradients arrive through the
weights' accumulators as in any backward. Gradients are not reduced per unit there: each is added into
its unit's flat buffer, kept for the whole step, and ``finish_grads`` reduce-scatters every group once
over the stage's dp group (FSDP's ``no_sync``: a full gradient per unit held across micro-batches, one
exchange per step).
Every replica of a stage runs the same action list, so its gathers and reductions come in the same
order on every rank of the dp group.

Limitations: ``no_sync`` does not skip communication in the plain loop; each micro-batch's gradients are
reduce-scattered and summed into the shard (correct, but no saving). Frozen parameters are not sharded.
Every rank must run the same units (gathers are collectives); a parameter no rank used is left alone
by the optimizer (:mod:`shardwise.zero.unused`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.source import HeldWeights
from shardwise.collectives.api import Comm
from shardwise.config import ZeroConfig
from shardwise.engine.base import Role
from shardwise.models.adapters import adapter_for
from shardwise.zero.base import ZeroBase
from shardwise.zero.group import FlatGroup


class ShardedModule(ZeroBase):
    """ZeRO stage 3 over the data-parallel group ``comm``."""

    stage = 3
    name = "zero3"
    reduce_window = 1  # with _first_grad's wait: one flat gradient buffer at a time

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        config: ZeroConfig,
        role: Role | None = None,
        weights: HeldWeights | None = None,
    ) -> None:
        """``weights``: the parameters (on meta) are read from it, each rank only its shards."""
        self._unit_group: list[int | None] = []  # unit index -> group index (None: nothing to shard)
        self._unit_modules: list[nn.Module] | None = None
        super().__init__(model, comm, config, role, weights)
        self._gathering: set[int] = set()  # groups whose gather has started since they were last freed
        self._missing = [len(g.params) for g in self.groups]
        self._group_unit = {g: u for u, g in enumerate(self._unit_group) if g is not None}
        self._group_of = {id(p): i for i, g in enumerate(self.groups) for p in g.params}
        self._pipelined = False  # set by the first pipeline_stage: gradients wait for finish_grads
        self._active: set[int] | None = None  # under a pipeline action: the groups of its stage
        self._input_only = False  # the action is a zero-bubble I pass
        self._in_backward: int | None = None  # ... and the group its backward last gathered
        self._register_hooks()
        self.after_step()

    # -- units --------------------------------------------------------------------------------------
    def _units(self) -> list[nn.Module]:
        """The modules gathered one at a time (empty: the whole model is one unit, the root)."""
        if self._unit_modules is None:
            found = adapter_for(self.model).block_list(self.config.unit)
            self._unit_modules = found.blocks if found is not None else []
            if found is None and self.comm.rank == 0:
                print(
                    f"shardwise: zero3: {type(self.model).__name__} has no ModuleList/Sequential of blocks, "
                    "so it is gathered whole, as one unit (set zero.unit to a block list to shard it finer)",
                    file=sys.stderr,
                    flush=True,
                )
        return self._unit_modules

    def build_groups(self) -> list[FlatGroup]:
        owners: dict[int, set[int]] = {}
        for i, unit in enumerate(self._units()):
            for p in unit.parameters():
                owners.setdefault(id(p), set()).add(i)
        per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in self._units()]
        root = []
        for name, p in self.trainable:
            units = owners.get(id(p), set())
            if len(units) == 1:
                per_unit[next(iter(units))].append((name, p))
            else:  # outside every unit, or shared between units
                root.append((name, p))
        groups = []
        if root:
            groups.append(self._group(root))
        self._root = 0 if root else None
        for named in per_unit:
            if named:
                self._unit_group.append(len(groups))
                groups.append(self._group(named))
            else:
                self._unit_group.append(None)
        return groups

    def _group(self, named: list[tuple[str, nn.Parameter]]) -> FlatGroup:
        return FlatGroup(named, self.comm, self.precision, alias_master=False, weights=self.weights)

    def _register_hooks(self) -> None:
        self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self._before_forward()))
        for i, unit in enumerate(self._units()):
            if self._unit_group[i] is None:
                continue
            self._hooks.append(unit.register_forward_pre_hook(lambda *_, i=i: self._unit_pre_forward(i)))
            self._hooks.append(unit.register_forward_hook(lambda _m, _a, y, i=i: self._unit_forward(i, y)))
        for index, group in enumerate(self.groups):
            for j, p in enumerate(group.params):
                hook = p.register_post_accumulate_grad_hook(lambda _, g=index, j=j: self._on_grad(g, j))
                self._hooks.append(hook)

    # -- gathering ----------------------------------------------------------------------------------
    def _start(self, index: int | None) -> None:
        if index is not None and index not in self._gathering:
            self.groups[index].gather(async_op=True)
            self._gathering.add(index)

    def _ensure(self, index: int) -> None:
        self._start(index)
        self.groups[index].wait_gather()

    def _free(self, index: int) -> None:
        self.groups[index].free()
        self._gathering.discard(index)

    def _neighbour(self, unit: int, step: int) -> int | None:
        j = unit + step
        while 0 <= j < len(self._unit_group):
            if self._unit_group[j] is not None:
                return self._unit_group[j]
            j += step
        return None

    def _before_forward(self) -> None:
        if self._root is not None:
            self._ensure(self._root)

    def _prefetch(self, index: int | None) -> None:
        """Start gathering ``index`` ahead of its use; under a pipeline action, only a group of the
        running stage (the next block on this rank may be another stage's, run much later)."""
        if self.config.prefetch and (self._active is None or index in self._active):
            self._start(index)

    def _unit_pre_forward(self, unit: int) -> None:
        self._ensure(self._unit_group[unit])  # type: ignore[arg-type]
        self._prefetch(self._neighbour(unit, +1))

    def _unit_forward(self, unit: int, output: Any) -> None:
        if torch.is_grad_enabled():  # a block may return a tuple or a dict (Hugging Face's do)
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda _grad: self._unit_pre_backward(unit))
        self._free(self._unit_group[unit])  # type: ignore[arg-type]

    def _unit_pre_backward(self, unit: int) -> None:
        index = self._unit_group[unit]
        assert index is not None
        if self._input_only:
            # an I pass gives no parameter its gradient, so no gradient hook frees a unit: the unit
            # whose backward ran before this one is done once this one's output gradient is complete
            if self._in_backward is not None and self._in_backward != index:
                self._free(self._in_backward)
            self._in_backward = index
        self._ensure(index)

    # -- gradients ----------------------------------------------------------------------------------
    def _on_grad(self, index: int, param_index: int) -> None:
        self.mark_used(index, param_index)
        if self._pipelined:
            self._accumulate(index, param_index)
            return
        if index != self._root:
            # a unit's gradients arrive together: flatten each at once and free it. The root's arrive
            # at both ends of backward (final norm first, embeddings last): they stay as .grad until
            # the last one, so no flat buffer is held across the whole backward.
            group = self.groups[index]
            if not group.collecting:  # the unit's first gradient
                self.wait_reduces()  # the previous unit's buffer goes before this one's exists
            group.take_grad(param_index)
        self._missing[index] -= 1
        if index != self._root and self._missing[index] == len(self.groups[index].params) // 2:
            self._prefetch_previous(index)
        if self._missing[index] == 0:
            self._missing[index] = len(self.groups[index].params)
            self.launch_reduce(self.groups[index], release=True)
            if index != self._root:
                self._free(index)

    def _accumulate(self, index: int, param_index: int) -> None:
        """Under a pipeline: a unit's gradient is added into its flat buffer (kept until
        ``finish_grads``) and the unit released once all of its gradients of this pass are in. The
        root's stay as ``.grad``, where autograd sums them over micro-batches (and the pipeline adds
        the tied weight's last-stage gradient) until ``finish_grads`` flattens them."""
        if index == self._root:
            return
        group = self.groups[index]
        group.take_grad(param_index)
        self._missing[index] -= 1
        if self._missing[index] == len(group.params) // 2:
            self._prefetch_previous(index)
        if self._missing[index] == 0:
            self._missing[index] = len(group.params)
            self._free(index)

    @contextmanager
    def pipeline_stage(self, params: Sequence[nn.Parameter], input_grad_only: bool = False) -> Iterator[None]:
        """Around one action of a pipeline stage holding ``params`` (see the module docstring): the
        root gathered if the stage uses it (kept, as in the plain model, until the step's gradients
        are reduced), the stage's units gathered by their hooks, and released at the end (in an I
        pass, each unit as soon as backward reaches the unit before it)."""
        self._pipelined = True
        active = {self._group_of[id(p)] for p in params if id(p) in self._group_of}
        self._active, self._input_only, self._in_backward = active, input_grad_only, None
        if self._root is not None and self._root in active:
            self._ensure(self._root)
        try:
            yield
        finally:
            self._active, self._input_only, self._in_backward = None, False, None
            for index in active - {self._root}:
                self._free(index)  # an I pass, or a unit whose gradients did not all come
                self._missing[index] = len(self.groups[index].params)

    def _prefetch_previous(self, index: int) -> None:
        """Half of unit ``index``'s gradients are in (and its activations partly freed): start
        gathering the unit that runs backward next. It still lands well before it is needed (a
        gather takes a few ms, half a block's backward tens), and at most one flat gradient buffer
        and two gathered units are alive at a time (the root aside)."""
        self._prefetch(self._neighbour(self._group_unit[index], -1))

    def exchange_grads(self) -> None:
        if self._pipelined:  # every group once (the same on every replica), zeros where none came
            for index, group in enumerate(self.groups):
                self.launch_reduce(group, release=True)
                self._missing[index] = len(group.params)
        for index, group in enumerate(self.groups):
            if self._missing[index] != len(group.params):  # some gradients never arrived: zeros
                self.launch_reduce(group, release=True)
                self._missing[index] = len(group.params)
        self.wait_reduces()
        self.share_usage()
        self.after_step()

    def after_step(self) -> None:
        """Free every full buffer: the next forward gathers the updated shards."""
        for index in range(len(self.groups)):
            self._free(index)


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a block's output: a tensor, or inside tuples, lists and dicts."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, tuple | list):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):  # ModelOutput is a dict too
        for item in output.values():
            yield from _tensors(item)
