"""Tensor-parallel plans as data, and ``apply_tensor_parallel``, which changes a plain model in place.

A plan maps module-name patterns (``*`` matches one name part: ``blocks.*.attn.qkv``) to a style:
``Colwise`` / ``Rowwise`` / ``QKVColwise`` / ``VocabEmbedding`` swap the module for a Megatron layer
cut from its weights (``layers.py``); ``SequenceParallelNorm``, ``SequenceSplit``, ``Dropout``,
``AttentionCore`` and ``ParallelInput`` add hooks or small wrappers and leave parameters whole. The
swapped modules keep their parameter names, so the model's ``named_parameters`` are the global names
and every parameter's box is in the returned :class:`TensorParallelLayout`. Plans here: the built-in
GPT (:func:`gpt_plan`), Hugging Face GPT-2 (:func:`hf_gpt2_plan`; its ``Conv1D`` weights are stored
(in, out), so its cuts are transposed) and Llama (:func:`hf_llama_plan`; grouped-query attention).

Communication per transformer block (Megatron-LM, Shoeybi et al., 2019): without sequence parallelism
2 all-reduces forward (after each row layer) and 2 backward (before each column group); with it
(Korthikanti et al., 2022) 2 all-gathers and 2 reduce-scatters each way, and after backward one
all-reduce of the gradients of the parameters replicated inside the sequence-cut region (norms,
row-layer biases): :meth:`TensorParallelLayout.reduce_sequence_parallel_grads`, which the step must
call before the optimizer (Megatron does it in ``finalize_model_grads``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise.collectives.api import Comm
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


class Style(Protocol):
    """A way to change one module; ``swaps``: it replaces the module (applied before the styles that
    hook modules, so hooks land on the final modules)."""

    swaps: ClassVar[bool]

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None: ...


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


@dataclass(frozen=True)
class Colwise:
    """Output dim cut (``ColumnParallelLinear``). ``heads``: the output is that many heads, which tp
    must divide (named ``heads_name`` in the refusal); ``copy_input=False`` where ``ParallelInput`` on
    an enclosing module applies f once for several column layers; ``transposed`` for ``Conv1D``."""

    swaps: ClassVar[bool] = True

    transposed: bool = False
    copy_input: bool = True
    heads: int | None = None
    heads_name: str = "n_head"
    seq_dim: int = 1

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        tp = ctx.comm.world_size
        if self.heads is not None and self.heads % tp:
            raise ValueError(f"{self.heads_name} {self.heads} is not divisible by tp {tp} ({name})")
        layer = ColumnParallelLinear(
            module, ctx.comm, name, transposed=self.transposed, copy_input=self.copy_input,
            sequence_parallel=ctx.sequence_parallel, seq_dim=self.seq_dim, sharder=ctx.sharder,
        )  # fmt: skip
        _replace(model, name, layer)


@dataclass(frozen=True)
class QKVColwise:
    """A fused q/k/v projection, cut section by section so each rank holds its heads' q, k and v."""

    swaps: ClassVar[bool] = True

    n_head: int
    n_kv_head: int
    transposed: bool = False
    copy_input: bool = True
    seq_dim: int = 1

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        weight = module.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{name} has no weight tensor")
        width = int(weight.shape[1 if self.transposed else 0])
        sections, names = qkv_sections(width, self.n_head, self.n_kv_head, ctx.comm.world_size)
        layer = ColumnParallelLinear(
            module, ctx.comm, name, sections=sections, section_names=names, transposed=self.transposed,
            copy_input=self.copy_input, sequence_parallel=ctx.sequence_parallel, seq_dim=self.seq_dim,
            sharder=ctx.sharder,
        )  # fmt: skip
        _replace(model, name, layer)


@dataclass(frozen=True)
class Rowwise:
    """Input dim cut (``RowParallelLinear``): sums partial outputs with g (reduce-scatter under SP)."""

    swaps: ClassVar[bool] = True

    transposed: bool = False
    seq_dim: int = 1

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        layer = RowParallelLinear(
            module, ctx.comm, name, transposed=self.transposed, sequence_parallel=ctx.sequence_parallel,
            seq_dim=self.seq_dim, sharder=ctx.sharder,
        )  # fmt: skip
        _replace(model, name, layer)
        ctx.sp_params += [f"{name}.{p}" for p in layer.sequence_parallel_params()]


@dataclass(frozen=True)
class VocabEmbedding:
    """Embedding rows cut by vocabulary. ``sequence_output``: under sequence parallelism, leave the
    output cut along the sequence (reduce-scatter); off for models that read the embedding's length
    afterwards (Hugging Face's position ids and masks), which cut later with ``SequenceSplit``."""

    swaps: ClassVar[bool] = True

    sequence_output: bool = True
    seq_dim: int = 1

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"{name} is a {type(module).__name__}; VocabEmbedding expects nn.Embedding")
        sp = ctx.sequence_parallel and self.sequence_output
        layer = VocabParallelEmbedding(module, ctx.comm, name, sp, self.seq_dim, sharder=ctx.sharder)
        _replace(model, name, layer)


@dataclass(frozen=True)
class SequenceParallelNorm:
    """A norm in the sequence-cut region: parameters stay whole, their gradients are summed over tp
    after backward (each rank saw only its positions). Without sequence parallelism: nothing to do."""

    swaps: ClassVar[bool] = False

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        if ctx.sequence_parallel:
            ctx.sp_params += [f"{name}.{p}" for p, _ in module.named_parameters()]


@dataclass(frozen=True)
class SequenceSplit:
    """Under sequence parallelism, cut this module's output (``on="output"``) or first input
    (``on="input"``) along ``dim``: replicated activations enter the sequence-cut region (split forward,
    all-gather backward). Without sequence parallelism: nothing to do."""

    swaps: ClassVar[bool] = False

    dim: int = 1
    on: str = "output"

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        if self.on not in ("output", "input"):
            raise ValueError(f"SequenceSplit.on is 'output' or 'input', got {self.on!r}")
        if not ctx.sequence_parallel:
            return
        comm, dim = ctx.comm, self.dim
        if self.on == "output":
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


@dataclass(frozen=True)
class Dropout:
    """A dropout module. ``split=True``: it acts on a tp-cut tensor (attention probabilities), so its
    masks are independent per rank, always. ``split=False``: it acts on the residual stream, replicated
    (masks equal across ranks, the default generator) without sequence parallelism and cut along the
    sequence (independent masks) with it."""

    swaps: ClassVar[bool] = True

    split: bool = False

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        if not isinstance(module, nn.Dropout):
            raise TypeError(f"{name} is a {type(module).__name__}; the Dropout style expects nn.Dropout")
        if self.split or ctx.sequence_parallel:
            _replace(model, name, ForkedDropout(module.p, module.inplace, ctx.tracker))


@dataclass(frozen=True)
class AttentionCore:
    """The attention between the q/k/v projections and the output projection runs on this rank's heads
    only: random draws there (dropout inside ``scaled_dot_product_attention``) come from the
    tensor-parallel state, entered after the first of ``opens`` runs and left before ``closes`` runs.
    ``divide``: attributes holding a global width the module's code reads (GPT-2's ``split_size``),
    divided by tp."""

    swaps: ClassVar[bool] = False

    opens: tuple[str, ...]
    closes: str
    divide: tuple[str, ...] = ()

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        tracker = ctx.tracker
        for attr in self.divide:
            value = getattr(module, attr)
            setattr(module, attr, even_share(value, ctx.comm.world_size, f"{name}.{attr}"))
        for child in self.opens:
            sub = module.get_submodule(child)
            ctx.hooks.append(sub.register_forward_hook(lambda *_: tracker.enter()))
        closer = module.get_submodule(self.closes)
        ctx.hooks.append(closer.register_forward_pre_hook(lambda *_: tracker.leave()))


@dataclass(frozen=True)
class ParallelInput:
    """Apply f (or, under sequence parallelism, the sequence all-gather) once to this module's hidden
    states (its first argument, or ``hidden_states=``), for column layers inside that share them and
    were told ``copy_input=False``: one backward all-reduce instead of one per layer. ``on="output"``:
    to the module's output instead, for a model that reshapes between a norm and the column layer after
    it (GPT-2 views the final norm's output with the sequence length it was given)."""

    swaps: ClassVar[bool] = False

    seq_dim: int = 1
    on: str = "input"

    def apply(self, model: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        if self.on not in ("output", "input"):
            raise ValueError(f"ParallelInput.on is 'output' or 'input', got {self.on!r}")
        comm, sp, dim = ctx.comm, ctx.sequence_parallel, self.seq_dim
        if self.on == "output":
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


@dataclass(frozen=True)
class Plan:
    """Module-name pattern -> style (or a tuple of styles for one module). ``no_sequence_parallel``: why
    this plan cannot run with sequence parallelism (empty when it can)."""

    name: str
    styles: Mapping[str, Style | tuple[Style, ...]]
    no_sequence_parallel: str = ""

    def describe(self) -> str:
        return "\n".join(f"{pattern}: {style}" for pattern, style in self.styles.items())


def gpt_plan(n_head: int) -> Plan:
    """The built-in GPT (``models/gpt.py``): vocab-cut embedding and head (tied: one box), attention
    by heads through the fused ``qkv``, the MLP column then row."""
    return Plan(
        "gpt",
        {
            "wte": VocabEmbedding(),
            "wpe": SequenceSplit(dim=0),  # positions (seq,) -> (seq, d_model): the sequence is dim 0
            "drop": Dropout(),
            "blocks.*.ln_1": SequenceParallelNorm(),
            # the attention reads the sequence length from its input: gather it there (under sequence
            # parallelism), not inside qkv
            "blocks.*.attn": (ParallelInput(), AttentionCore(opens=("qkv",), closes="proj")),
            "blocks.*.attn.qkv": QKVColwise(n_head=n_head, n_kv_head=n_head, copy_input=False),
            "blocks.*.attn.proj": Rowwise(),
            "blocks.*.attn.resid_dropout": Dropout(),
            "blocks.*.ln_2": SequenceParallelNorm(),
            "blocks.*.mlp.fc": Colwise(),
            "blocks.*.mlp.proj": Rowwise(),
            "blocks.*.mlp.dropout": Dropout(),
            "ln_f": SequenceParallelNorm(),
            "head": Colwise(),  # logits stay cut by vocabulary: use vocab_parallel_cross_entropy
        },
    )


def hf_gpt2_plan(n_head: int) -> Plan:
    """Hugging Face ``GPT2LMHeadModel``: ``Conv1D`` weights are (in, out), so cuts are transposed; the
    attention reads ``split_size`` (the q/k/v width), divided by tp. Under sequence parallelism the
    embeddings stay whole (GPT-2 reads their length for positions and masks) and ``transformer.drop``'s
    output is cut."""
    return Plan(
        "hf-gpt2",
        {
            "transformer.wte": VocabEmbedding(sequence_output=False),
            "transformer.drop": SequenceSplit(dim=1),
            "transformer.h.*.ln_1": SequenceParallelNorm(),
            "transformer.h.*.attn": AttentionCore(opens=("c_attn",), closes="c_proj", divide=("split_size",)),
            "transformer.h.*.attn.c_attn": QKVColwise(n_head=n_head, n_kv_head=n_head, transposed=True),
            "transformer.h.*.attn.c_proj": Rowwise(transposed=True),
            "transformer.h.*.attn.attn_dropout": Dropout(split=True),
            "transformer.h.*.attn.resid_dropout": Dropout(),
            "transformer.h.*.ln_2": SequenceParallelNorm(),
            "transformer.h.*.mlp.c_fc": Colwise(transposed=True),
            "transformer.h.*.mlp.c_proj": Rowwise(transposed=True),
            "transformer.h.*.mlp.dropout": Dropout(),
            "transformer.ln_f": (SequenceParallelNorm(), ParallelInput(on="output")),
            "lm_head": Colwise(copy_input=False),
        },
    )


def hf_llama_plan(n_head: int, n_kv_head: int) -> Plan:
    """Hugging Face ``LlamaForCausalLM``: separate q/k/v projections share one f (``ParallelInput`` on
    the attention), as gate/up do on the MLP; grouped-query attention needs tp to divide the key/value
    head count. Under sequence parallelism the first decoder layer's input is cut (Llama computes
    positions and masks from the embedding's length)."""
    return Plan(
        "hf-llama",
        {
            "model.embed_tokens": VocabEmbedding(sequence_output=False),
            "model.layers.0": SequenceSplit(dim=1, on="input"),
            "model.layers.*.input_layernorm": SequenceParallelNorm(),
            "model.layers.*.self_attn": (ParallelInput(), AttentionCore(opens=("q_proj",), closes="o_proj")),
            "model.layers.*.self_attn.q_proj": Colwise(copy_input=False, heads=n_head),
            "model.layers.*.self_attn.k_proj": Colwise(
                copy_input=False, heads=n_kv_head, heads_name="n_kv_head"
            ),
            "model.layers.*.self_attn.v_proj": Colwise(
                copy_input=False, heads=n_kv_head, heads_name="n_kv_head"
            ),
            "model.layers.*.self_attn.o_proj": Rowwise(),
            "model.layers.*.post_attention_layernorm": SequenceParallelNorm(),
            "model.layers.*.mlp": ParallelInput(),
            "model.layers.*.mlp.gate_proj": Colwise(copy_input=False),
            "model.layers.*.mlp.up_proj": Colwise(copy_input=False),
            "model.layers.*.mlp.down_proj": Rowwise(),
            "model.norm": SequenceParallelNorm(),
            "lm_head": Colwise(),
        },
    )


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
    plan: Plan,
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
                    style.apply(model, name, model.get_submodule(name), ctx)
    params = {}
    for name, param in model.named_parameters():
        params[name] = ctx.sharder.record(param) or replicated(name, tuple(param.shape))
    ctx.sharder.made.clear()  # the full, uncut weights: hooks hold ctx, so they would live on with it
    return TensorParallelLayout(comm, sequence_parallel, params, tuple(ctx.sp_params), ctx.tracker, ctx.hooks)
