"""``apply_tensor_parallel``: a plan (data) applied to a plain model, in place.

A plan maps module-name patterns (``*`` matches one name part: ``blocks.*.attn.qkv``) to styles; the
plans and the styles' meaning live with the models (``models/adapters/plan.py``, each family's plan in
its adapter: ``adapter_for(model).tp_plan()``). Here is what each style does: ``Colwise`` /
``Rowwise`` / ``QKVColwise`` / ``VocabEmbedding`` swap the module for a Megatron layer cut from its
weights (``layers.py``); ``SequenceParallelNorm``, ``SequenceSplit``, ``Dropout``, ``AttentionCore``
and ``ParallelInput`` add hooks or small wrappers and leave parameters whole. The swapped modules keep
their parameter names, so the model's ``named_parameters`` are the global names and every parameter's
box is in the returned :class:`TensorParallelLayout`.

Communication per transformer block (Megatron-LM, Shoeybi et al., 2019): without sequence parallelism
2 all-reduces forward (after each row layer) and 2 backward (before each column group); with it
(Korthikanti et al., 2022) 2 all-gathers and 2 reduce-scatters each way, and after backward one
all-reduce of the gradients of the parameters replicated inside the sequence-cut region (norms,
row-layer biases): :meth:`TensorParallelLayout.reduce_sequence_parallel_grads`, which the step must
call before the optimizer (Megatron does it in ``finalize_model_grads``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise.collectives.api import Comm
from shardwise.models.adapters.plan import (
    AttentionCore,
    Colwise,
    Dropout,
    ParallelInput,
    QKVColwise,
    Rowwise,
    SequenceParallelNorm,
    SequenceSplit,
    Style,
    TensorParallelPlan,
    VocabEmbedding,
)
from shardwise.tensor_parallel import comm_ops
from shardwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Sharder,
    VocabParallelEmbedding,
    parallel_input,
    qkv_sections,
)
from shardwise.tensor_parallel.random import RNGStatesTracker, tensor_parallel_tracker
from shardwise.tensor_parallel.shards import ShardedParam, even_share, replicated


@dataclass
class _Context:
    """What styles need while a plan is applied."""

    comm: Comm
    sequence_parallel: bool
    sharder: Sharder
    tracker: RNGStatesTracker
    sp_params: list[str] = field(default_factory=list)  # global names; partial gradients under SP
    hooks: list[RemovableHandle] = field(default_factory=list)


Apply = Callable[[Any, nn.Module, str, nn.Module, _Context], None]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _colwise(style: Colwise, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    tp = ctx.comm.world_size
    if style.heads is not None and style.heads % tp:
        raise ValueError(f"{style.heads_name} {style.heads} is not divisible by tp {tp} ({name})")
    layer = ColumnParallelLinear(
        module, ctx.comm, name, transposed=style.transposed, copy_input=style.copy_input,
        sequence_parallel=ctx.sequence_parallel, seq_dim=style.seq_dim, sharder=ctx.sharder,
    )  # fmt: skip
    _replace(model, name, layer)


def _qkv_colwise(style: QKVColwise, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} has no weight tensor")
    width = int(weight.shape[1 if style.transposed else 0])
    sections, names = qkv_sections(width, style.n_head, style.n_kv_head, ctx.comm.world_size)
    layer = ColumnParallelLinear(
        module, ctx.comm, name, sections=sections, section_names=names, transposed=style.transposed,
        copy_input=style.copy_input, sequence_parallel=ctx.sequence_parallel, seq_dim=style.seq_dim,
        sharder=ctx.sharder,
    )  # fmt: skip
    _replace(model, name, layer)


def _rowwise(style: Rowwise, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    layer = RowParallelLinear(
        module, ctx.comm, name, transposed=style.transposed, sequence_parallel=ctx.sequence_parallel,
        seq_dim=style.seq_dim, sharder=ctx.sharder,
    )  # fmt: skip
    _replace(model, name, layer)
    ctx.sp_params += [f"{name}.{p}" for p in layer.sequence_parallel_params()]


def _vocab_embedding(
    style: VocabEmbedding, model: nn.Module, name: str, module: nn.Module, ctx: _Context
) -> None:
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"{name} is a {type(module).__name__}; VocabEmbedding expects nn.Embedding")
    sp = ctx.sequence_parallel and style.sequence_output
    layer = VocabParallelEmbedding(module, ctx.comm, name, sp, style.seq_dim, sharder=ctx.sharder)
    _replace(model, name, layer)


def _sequence_parallel_norm(
    style: SequenceParallelNorm, model: nn.Module, name: str, module: nn.Module, ctx: _Context
) -> None:
    if ctx.sequence_parallel:
        ctx.sp_params += [f"{name}.{p}" for p, _ in module.named_parameters()]


def _sequence_split(
    style: SequenceSplit, model: nn.Module, name: str, module: nn.Module, ctx: _Context
) -> None:
    if style.on not in ("output", "input"):
        raise ValueError(f"SequenceSplit.on is 'output' or 'input', got {style.on!r}")
    if not ctx.sequence_parallel:
        return
    comm, dim = ctx.comm, style.dim
    if style.on == "output":
        ctx.hooks.append(
            module.register_forward_hook(lambda _m, _a, out: comm_ops.split_to_sequence(out, comm, dim))
        )
    else:
        ctx.hooks.append(
            module.register_forward_pre_hook(
                lambda _m, args, kwargs: _map_first(
                    args, kwargs, lambda x: comm_ops.split_to_sequence(x, comm, dim)
                ),
                with_kwargs=True,
            )
        )


class ForkedDropout(nn.Dropout):
    """``nn.Dropout`` drawing its mask from the tracker's tensor-parallel state (independent per rank)."""

    def __init__(self, p: float, inplace: bool, tracker: RNGStatesTracker) -> None:
        super().__init__(p, inplace)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.tracker.fork():
            return super().forward(x)


def _dropout(style: Dropout, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    if not isinstance(module, nn.Dropout):
        raise TypeError(f"{name} is a {type(module).__name__}; the Dropout style expects nn.Dropout")
    if style.split or ctx.sequence_parallel:
        _replace(model, name, ForkedDropout(module.p, module.inplace, ctx.tracker))


def _attention_core(
    style: AttentionCore, model: nn.Module, name: str, module: nn.Module, ctx: _Context
) -> None:
    tracker = ctx.tracker
    for attr in style.divide:
        value = getattr(module, attr)
        setattr(module, attr, even_share(value, ctx.comm.world_size, f"{name}.{attr}"))
    for child in style.opens:
        sub = module.get_submodule(child)
        ctx.hooks.append(sub.register_forward_hook(lambda *_: tracker.enter()))
    closer = module.get_submodule(style.closes)
    ctx.hooks.append(closer.register_forward_pre_hook(lambda *_: tracker.leave()))


def _parallel_input(
    style: ParallelInput, model: nn.Module, name: str, module: nn.Module, ctx: _Context
) -> None:
    if style.on not in ("output", "input"):
        raise ValueError(f"ParallelInput.on is 'output' or 'input', got {style.on!r}")
    comm, sp, dim = ctx.comm, ctx.sequence_parallel, style.seq_dim
    if style.on == "output":
        handle = module.register_forward_hook(lambda _m, _a, out: parallel_input(out, comm, sp, dim))
    else:
        handle = module.register_forward_pre_hook(
            lambda _m, args, kwargs: _map_first(args, kwargs, lambda x: parallel_input(x, comm, sp, dim)),
            with_kwargs=True,
        )
    ctx.hooks.append(handle)


def _map_first(
    args: tuple[Any, ...], kwargs: dict[str, Any], fn: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``fn`` applied to a module call's hidden states: the first positional argument, else
    ``hidden_states=``."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise TypeError(
        "ParallelInput/SequenceSplit found no hidden states (no positional argument, no hidden_states=)"
    )


# each style's mechanism (what it means: models/adapters/plan.py)
APPLY: dict[type, Apply] = {
    Colwise: _colwise,
    QKVColwise: _qkv_colwise,
    Rowwise: _rowwise,
    VocabEmbedding: _vocab_embedding,
    SequenceParallelNorm: _sequence_parallel_norm,
    SequenceSplit: _sequence_split,
    Dropout: _dropout,
    AttentionCore: _attention_core,
    ParallelInput: _parallel_input,
}


def _apply(style: Style, model: nn.Module, name: str, ctx: _Context) -> None:
    apply = APPLY.get(type(style))
    if apply is None:
        known = ", ".join(t.__name__ for t in APPLY)
        raise TypeError(f"{name}: {type(style).__name__} is not a tensor-parallel style ({known})")
    apply(style, model, name, model.get_submodule(name), ctx)


def _pattern(text: str) -> re.Pattern[str]:
    """``*`` matches one dotted name part; everything else literally."""
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in text.split(".")))


@dataclass
class TensorParallelLayout:
    """What ``apply_tensor_parallel`` did: every parameter's shard record (by its first name, tied ones
    once; replicated ones cover the whole tensor), the parameters whose gradients need a sum over tp
    after backward (sequence parallelism), the RNG tracker, and the hooks it added."""

    comm: Comm
    sequence_parallel: bool
    params: dict[str, ShardedParam]
    sequence_parallel_params: tuple[str, ...]
    tracker: RNGStatesTracker
    hooks: list[RemovableHandle]

    def reduce_sequence_parallel_grads(self, model: nn.Module) -> None:
        """Sum over tp the gradients of parameters replicated in the sequence-cut region, in one
        all-reduce (call once per step, after the last backward, before clipping and the optimizer)."""
        named = dict(model.named_parameters())
        grads = [named[n].grad for n in self.sequence_parallel_params if named[n].grad is not None]
        if not grads or self.comm.world_size == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
        self.comm.all_reduce(flat, label="sequence-parallel grads")
        offset = 0
        for g in grads:
            assert g is not None
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def apply_tensor_parallel(
    model: nn.Module,
    comm: Comm,
    plan: TensorParallelPlan,
    sequence_parallel: bool = False,
    seed: int = 0,
    device: torch.device | None = None,
) -> TensorParallelLayout:
    """Cut ``model`` in place over ``comm`` (the tp axis) as ``plan`` says; returns the layout.

    Every rank must hold the same full model (built under the same seed), or the model on the meta
    device (its values read afterwards, each rank its boxes). ``seed`` seeds the tracker's per-rank
    state (``seed + 2718 + tp_rank``) on ``device`` (default: the parameters'). Each pattern must match
    a module and no module may match two patterns; a split tp does not divide is refused with the
    arithmetic.
    """
    if sequence_parallel and plan.no_sequence_parallel:
        raise ValueError(
            f"plan {plan.name} cannot run with sequence parallelism: {plan.no_sequence_parallel}"
        )
    # the tracker's states live where the parameters will be (``device``: given for a model on meta)
    if device is None:
        device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    ctx = _Context(comm, sequence_parallel, Sharder(), tensor_parallel_tracker(seed, comm.rank, device))
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, tuple[Style, ...]]] = {}
    for text, styles in plan.styles.items():
        pattern = _pattern(text)
        matched = [name for name in modules if pattern.fullmatch(name)]
        if not matched:
            raise ValueError(
                f"plan {plan.name}: pattern {text!r} matches no module of {type(model).__name__}"
            )
        for name in matched:
            if name in chosen:
                raise ValueError(f"plan {plan.name}: {name} matches both {chosen[name][0]!r} and {text!r}")
            chosen[name] = (text, styles if isinstance(styles, tuple) else (styles,))
    for swaps in (True, False):  # swaps first, so hooks land on the final modules
        for name in modules:  # module order: the first use of a tied parameter names it
            for style in chosen.get(name, ("", ()))[1]:
                if style.swaps == swaps:
                    _apply(style, model, name, ctx)
    params = {}
    for name, param in model.named_parameters():
        params[name] = ctx.sharder.record(param) or replicated(name, tuple(param.shape))
    ctx.sharder.made.clear()  # the full, uncut weights: hooks hold ctx, so they would live on with it
    return TensorParallelLayout(comm, sequence_parallel, params, tuple(ctx.sp_params), ctx.tracker, ctx.hooks)
