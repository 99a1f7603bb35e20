"""Split a plain model into pipeline stages from outside, parameter names preserved.

The model's blocks are assigned to ``pp * virtual`` stages in order, contiguous runs balanced by matrix
work per token (``stages.balance``: a block's parameters, the head's matrix on the last stage, the
embeddings' lookup nothing), or cut where the user says (``parallel.pp_split``: the block each stage
after the first starts at, ``blocks.3,blocks.6``); each stage holds at least one block and every block
lands on exactly one stage (checked). The embedding goes with the first stage, the final norm, the head
and the loss with the last. A rank keeps the stages its schedule places on it
(``schedules.stage_placement``) and drops every other module: the block list becomes an
``nn.ModuleDict`` keyed by the block's index, so a kept block's parameters keep their names
(``blocks.5.attn.qkv.weight``), and checkpoints and ``full_parameters`` stay in the model's own naming.
(Balancing by measured per-block time is not built yet.) Each ``Stage`` is a callable: the micro-batch's
token ids (first stage) or the hidden state (any other) in, the hidden state (or, on the last, the
logits) out. What every block needs besides the hidden state (the causal mask with the batch's padding,
position ids, Llama's rotary tables) is derived on each stage from the micro-batch (``StageInputs``), as
the whole model's forward derives it, so nothing but the hidden state crosses a stage boundary (each
family's adapter, ``models/adapters/``).

A weight tied across the first and the last stage (the GPT's embedding used as its head) stays a
parameter of the first stage only; the last stage's head reads a plain-tensor copy (``Split.tied``)
that the runtime refreshes from the first stage at the start of each step and whose gradient it adds
into the parameter's before the data-parallel exchange: the parameter gets the sum of both stages'
gradients, is updated once and written to checkpoints once (Narayanan et al. 2021 all-reduce the two
copies' gradients instead; the sum is the same). Where one rank holds both ends (the V schedules)
the weight stays tied as in the plain model.

Supported models: those with an adapter (``models/adapters/``: the built-in GPT, Hugging Face GPT-2 and
Llama), or subclasses that keep their forward (a forward of one's own is refused by name: a stage would
skip it); any other model is refused by name, never run by calling its blocks in sequence.
No communication here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.models.adapters import ModelAdapter, SplitError, StageInputs, pipeline_adapter
from shardwise.models.adapters import get_module as _get
from shardwise.pipeline.stages import FEWER_STAGES, balance

__all__ = [
    "Split", "SplitError", "Stage", "StageInputs", "Tied",
    "balance", "end_size", "plan_stages", "split_model",
]  # fmt: skip


@dataclass
class Tied:
    """The last stage's copy of a weight the first stage owns (``owner_name`` there)."""

    owner_name: str
    copy: torch.Tensor  # a leaf that requires grad like the parameter; refreshed every step
    user: nn.Module | None = None  # the module whose ``weight`` the copy is (the head)

    def match(self, dtype: torch.dtype) -> None:
        """Make the copy ``dtype`` (the owner's, once an engine casts its parameters: ZeRO's compute
        copies), the head reading the new one."""
        if self.copy.dtype != dtype:
            self.copy = torch.empty_like(self.copy, dtype=dtype).requires_grad_(self.copy.requires_grad)
            if self.user is not None:
                object.__setattr__(self.user, "weight", self.copy)


def _drop(root: nn.Module, path: str) -> None:
    parent, _, name = path.rpartition(".")
    owner = _get(root, parent) if parent else root
    owner._modules[name] = None  # named_parameters skips it: the parameters are no longer this rank's


def named_boundaries(names: Sequence[str], blocks_path: str, blocks: int, stages: int) -> list[list[int]]:
    """Contiguous runs of block indices, one per stage, cut where ``names`` say: ``names[k]`` is the
    block (``<blocks_path>.<index>``, its name in the model) stage ``k + 1`` starts at. A wrong count,
    a name that is not a block, or names out of order are refused in one line naming the fix."""
    known = f"{blocks_path}.0 .. {blocks_path}.{blocks - 1}"
    if len(names) != stages - 1:
        raise SplitError(
            f"parallel.pp_split names {len(names)} boundaries, but {stages} stages (pp x virtual stages) "
            f"need {stages - 1}: the block each stage after the first starts at ({known}); name "
            f"{stages - 1}, or leave it empty to balance by matrix work"
        )
    starts = [0]
    for name in names:
        index = _block_index(name, blocks_path, blocks)
        if index is None:
            raise SplitError(
                f"parallel.pp_split: {name!r} is not a block of the model; name {known} (the block a "
                "stage starts at)"
            )
        if index <= starts[-1]:  # a stage between the two would hold no block
            after = f"{blocks_path}.{starts[-1]}" + ("" if len(starts) > 1 else ", where stage 0 starts")
            raise SplitError(
                f"parallel.pp_split: {name} is not after {after}; list the boundaries in order, each "
                "block after the one before, so that every stage holds at least one"
            )
        starts.append(index)
    ends = [*starts[1:], blocks]
    return [list(range(a, b)) for a, b in zip(starts, ends, strict=True)]


def _block_index(name: str, blocks_path: str, blocks: int) -> int | None:
    prefix, _, index = name.strip().rpartition(".")
    if prefix != blocks_path or not index.isdigit() or int(index) >= blocks:
        return None
    return int(index)


def plan_stages(model: nn.Module, stages: int, boundaries: Sequence[str] = ()) -> list[list[int]]:
    """Every stage's blocks: at ``boundaries`` when given (see ``named_boundaries``), else balanced by
    matrix work, then by parameters held (``stages.balance``; the ends' by ``end_size``). Inspects the
    module tree only (the model may be on the meta device)."""
    adapter = pipeline_adapter(model)
    container = adapter.blocks()
    if not isinstance(container, nn.ModuleList):
        raise SplitError(f"{adapter.blocks_path} is not an nn.ModuleList; the model was split already?")
    if boundaries:
        return named_boundaries(boundaries, adapter.blocks_path, len(container), stages)
    if len(container) < stages:
        raise SplitError(
            f"the model has {len(container)} blocks but the pipeline has {stages} stages (pp x virtual "
            f"stages); every stage needs at least one block: {FEWER_STAGES}"
        )
    sizes = [float(sum(p.numel() for p in b.parameters())) for b in container]
    first, last = adapter.first_modules, adapter.last_modules
    work = (end_size(model, first, lookups=False), end_size(model, last, lookups=False))
    held = (end_size(model, first), end_size(model, last))
    return balance(sizes, stages, work, sizes, held)


def end_size(model: nn.Module, paths: Sequence[str], lookups: bool = True) -> float:
    """The parameters of the modules at ``paths`` (one end of the model); a weight tied across the two
    ends counts at each (the last stage holds a copy where the first is elsewhere). ``lookups=False``:
    the matrix work per token instead, an embedding's parameters left out (it reads one row a token)."""
    total = 0
    for path in paths:
        module = _get(model, path)
        for part in module.modules() if module is not None else ():
            if lookups or not isinstance(part, nn.Embedding):
                total += sum(p.numel() for p in part.parameters(recurse=False))
    return float(total)


@dataclass
class Stage:
    """One pipeline stage this rank holds: ``stage(x)`` runs its blocks (and the ends it owns)."""

    index: int
    blocks: list[int]
    first: bool
    last: bool
    adapter: ModelAdapter

    def __call__(self, x: torch.Tensor, inputs: StageInputs | None = None) -> torch.Tensor:
        """``x``: the token ids (first stage) or the hidden state; ``inputs``: the micro-batch's (its
        extras: the mask, positions and segment ids the blocks read), None for token ids alone."""
        extras = inputs.extras if inputs is not None else {}
        hidden = self.adapter.embed(x, extras) if self.first else x  # (batch, seq, hidden)
        context = self.adapter.context(hidden, extras) if self.blocks else {}
        for index in self.blocks:
            hidden = self.adapter.block(index, hidden, context)
        return self.adapter.head(hidden) if self.last else hidden


@dataclass
class Split:
    """This rank's share of the model after ``split_model``."""

    stages: dict[int, Stage]  # stage index -> stage, those this rank holds
    assignment: list[list[int]]  # every stage's blocks (all ranks)
    hidden_size: int
    tied: Tied | None = None  # on the last stage's rank when the tied weight's owner is elsewhere
    tied_owner: nn.Parameter | None = None  # on the first stage's rank in that case
    params: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # stage -> its trainable ones
    shared_buffers: set[str] = field(default_factory=set)  # buffers every stage holds (written once)

    def inputs(self, batch: Any) -> StageInputs:
        """What every stage of this rank reads of ``batch`` (a key no stage honours: ``SplitError``)."""
        return next(iter(self.stages.values())).adapter.inputs(batch)


def tied_user(model: nn.Module, pair: tuple[str, str]) -> nn.Module:
    """The module that reads the weight of ``pair`` (``ModelAdapter.tied_pair``): the head."""
    return _get(model, pair[1].rpartition(".")[0])


def split_model(
    model: nn.Module, placement: Sequence[int], rank: int, boundaries: Sequence[str] = (),
    assignment: list[list[int]] | None = None,
) -> Split:  # fmt: skip
    """Keep on ``model`` only what pipeline rank ``rank`` holds under ``placement`` (stage -> rank);
    ``boundaries``: the blocks stages 1.. start at (``parallel.pp_split``), empty to balance;
    ``assignment``: every stage's blocks as ``plan_stages`` gave them on the whole model (tensor
    parallelism, applied first, changes the sizes it reads), None to plan them here."""
    adapter = pipeline_adapter(model)
    stages = len(placement)
    if assignment is None:
        assignment = plan_stages(model, stages, boundaries)
    blocks = list(adapter.blocks())
    held = [s for s in range(stages) if placement[s] == rank]
    holds_first, holds_last = 0 in held, stages - 1 in held
    pair = adapter.tied_pair()
    tied: Tied | None = None
    owner: nn.Parameter | None = None
    if pair is not None and holds_first != holds_last:
        owner_param = dict(model.named_parameters())[pair[0]]
        if holds_first:
            owner = owner_param
        else:
            head = tied_user(model, pair)
            copy = owner_param.detach().clone().requires_grad_(owner_param.requires_grad)
            del head._parameters["weight"]
            object.__setattr__(head, "weight", copy)  # a plain tensor: not this rank's parameter
            tied = Tied(pair[0], copy, head)
    kept = {str(i): blocks[i] for s in held for i in assignment[s]}
    parent, _, name = adapter.blocks_path.rpartition(".")
    (_get(model, parent) if parent else model)._modules[name] = nn.ModuleDict(kept)
    if not holds_first:
        for path in adapter.first_modules:
            _drop(model, path)
    if not holds_last:
        for path in adapter.last_modules:
            _drop(model, path)
    split = Split(
        {s: Stage(s, assignment[s], s == 0, s == stages - 1, adapter) for s in held},
        assignment,
        adapter.hidden_size,
        tied,
        owner,
    )
    split.params = {s: _stage_params(model, adapter, split.stages[s]) for s in held}
    split.shared_buffers = {
        f"{path}.{name}" for path in adapter.shared_modules for name, _ in _get(model, path).named_buffers()
    }
    return split


def _stage_params(model: nn.Module, adapter: ModelAdapter, stage: Stage) -> list[nn.Parameter]:
    """The trainable parameters stage ``stage`` uses (its blocks, and the ends it owns)."""
    modules: list[nn.Module] = [adapter.blocks()[str(i)] for i in stage.blocks]
    paths = (adapter.first_modules if stage.first else ()) + (adapter.last_modules if stage.last else ())
    modules += [m for p in paths if (m := _get(model, p)) is not None]
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


StageFn = Callable[[torch.Tensor], torch.Tensor]
