"""Tensor-parallel plans as data: module-name patterns mapped to styles, the words adapters write in.

A plan maps module-name patterns (``*`` matches one name part: ``blocks.*.attn.qkv``) to a style (or a
tuple of styles for one module). Each model family's adapter writes its plan here (``gpt.py``,
``hf_gpt2.py``, ``hf_llama.py``); ``tensor_parallel/plans.py`` applies a plan to a model. The styles
are plain frozen dataclasses (no torch, no communication): what to do to a module, not how.
``Colwise`` / ``Rowwise`` / ``QKVColwise`` / ``VocabEmbedding`` swap the module for a Megatron layer cut
from its weights (``swaps``: applied before the styles that hook modules, so hooks land on the final
modules); ``SequenceParallelNorm``, ``SequenceSplit``, ``Dropout``, ``AttentionCore`` and
``ParallelInput`` add hooks or small wrappers and leave parameters whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol


class Style(Protocol):
    """A way to change one module; ``swaps``: it replaces the module."""

    swaps: ClassVar[bool]


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


@dataclass(frozen=True)
class QKVColwise:
    """A fused q/k/v projection, cut section by section so each rank holds its heads' q, k and v."""

    swaps: ClassVar[bool] = True

    n_head: int
    n_kv_head: int
    transposed: bool = False
    copy_input: bool = True
    seq_dim: int = 1


@dataclass(frozen=True)
class Rowwise:
    """Input dim cut (``RowParallelLinear``): sums partial outputs with g (reduce-scatter under SP)."""

    swaps: ClassVar[bool] = True

    transposed: bool = False
    seq_dim: int = 1


@dataclass(frozen=True)
class VocabEmbedding:
    """Embedding rows cut by vocabulary. ``sequence_output``: under sequence parallelism, leave the
    output cut along the sequence (reduce-scatter); off for models that read the embedding's length
    afterwards (Hugging Face's position ids and masks), which cut later with ``SequenceSplit``."""

    swaps: ClassVar[bool] = True

    sequence_output: bool = True
    seq_dim: int = 1


@dataclass(frozen=True)
class SequenceParallelNorm:
    """A norm in the sequence-cut region: parameters stay whole, their gradients are summed over tp
    after backward (each rank saw only its positions). Without sequence parallelism: nothing to do."""

    swaps: ClassVar[bool] = False


@dataclass(frozen=True)
class SequenceSplit:
    """Under sequence parallelism, cut this module's output (``on="output"``) or first input
    (``on="input"``) along ``dim``: replicated activations enter the sequence-cut region (split forward,
    all-gather backward). Without sequence parallelism: nothing to do."""

    swaps: ClassVar[bool] = False

    dim: int = 1
    on: str = "output"


@dataclass(frozen=True)
class Dropout:
    """A dropout module. ``split=True``: it acts on a tp-cut tensor (attention probabilities), so its
    masks are independent per rank, always. ``split=False``: it acts on the residual stream, replicated
    (masks equal across ranks, the default generator) without sequence parallelism and cut along the
    sequence (independent masks) with it."""

    swaps: ClassVar[bool] = True

    split: bool = False


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


@dataclass(frozen=True)
class TensorParallelPlan:
    """Module-name pattern -> style (or a tuple of styles for one module). ``no_sequence_parallel``: why
    this plan cannot run with sequence parallelism (empty when it can)."""

    name: str
    styles: Mapping[str, Style | tuple[Style, ...]]
    no_sequence_parallel: str = ""

    def describe(self) -> str:
        return "\n".join(f"{pattern}: {style}" for pattern, style in self.styles.items())
