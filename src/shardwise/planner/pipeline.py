"""The planner's pipeline terms: what each pipeline rank holds, so the worst one is charged, not a sum.

A pipeline's ranks differ (Narayanan et al., SC 2021): the split (``pipeline.stages.balance``, the
same arithmetic the runtime cuts the model with: equal blocks, the head's matrix on the last stage,
then the parameters held) gives each stage a contiguous run
of blocks; the first stage's rank holds the embeddings, the last stage's the final norm, the head and
the loss (the logits peak), and, when the head is tied to the embedding on another rank, a copy of
that matrix and its gradient (``pipeline.split.Tied``); each rank's activations are the pipeline
validator's peak for its own action list (``pipeline.validate.peak_activations``): a (stage,
micro-batch) pair holds a stage's saved tensors from its F to its B or I, and from a zero-bubble I to
its W only what the W pass reads, each linear layer's input and output gradient (``engine/linear.py``:
``kept_per_token``). ``memory.estimate_memory`` estimates every rank and reports the largest; the
first stage holds more micro-batches in flight, the last the head and the logits, so neither alone is
always the worst. Without a pipeline there is one share, the whole model. Arithmetic only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from shardwise.planner.model import ModelShape


@dataclass(frozen=True)
class RankShare:
    """One pipeline rank's part of the model (the whole model without a pipeline)."""

    rank: int
    blocks: int  # blocks over all of the rank's stages
    first: bool  # holds the embeddings (the first stage)
    last: bool  # holds the final norm, the head and the loss (the last stage)
    tied_copy: bool  # reads a copy of the embedding tied to its head (the first stage is elsewhere)
    stages: int = 1  # stages on the rank (virtual stages)


def rank_shares(model: ModelShape, pp: int, schedule: str, virtual: int) -> list[RankShare]:
    """Every pipeline rank's share (one share, the whole model, when ``pp`` is 1)."""
    if pp == 1:
        return [RankShare(0, model.n_layer, True, True, False)]
    from shardwise.pipeline.schedules import stage_placement
    from shardwise.pipeline.stages import balance

    placement = stage_placement(schedule, pp, virtual)
    block, head = float(model.block_params), float(model.head_work)
    embeddings = float((model.vocab + model.positions) * model.d_model)
    sizes = [block] * model.n_layer
    runs = balance(sizes, len(placement), (0.0, head), sizes, (embeddings, head))
    last = len(placement) - 1
    shares = []
    for rank in range(pp):
        mine = [s for s, r in enumerate(placement) if r == rank]
        first_here, last_here = 0 in mine, last in mine
        copy = model.tie_weights and last_here and not first_here
        blocks = sum(len(runs[s]) for s in mine)
        shares.append(RankShare(rank, blocks, first_here, last_here, copy, len(mine)))
    return shares


def pair_peak(
    share: RankShare, pp: int, schedule: str, micro_batches: int, in_flight: float, kept: float
) -> float:
    """The most ``share``'s rank holds at once of its (stage, micro-batch) pairs: ``in_flight`` per
    pair from F to B or I, ``kept`` from I to W (the validator's ``peak_activations`` over its action
    list). Without a pipeline, one micro-batch in flight."""
    if pp == 1:
        return in_flight
    from shardwise.pipeline.validate import peak_activations

    return peak_activations(_actions(schedule, pp, share.stages, micro_batches, share.rank), in_flight, kept)


@functools.lru_cache(maxsize=1024)
def _actions(schedule: str, pp: int, virtual: int, micro_batches: int, rank: int) -> tuple[Any, ...]:
    """The rank's action list (cached: a search asks the same schedule once per strategy, offload and
    checkpointing)."""
    from shardwise.pipeline.schedules import build

    return tuple(build(schedule, pp, virtual, micro_batches)[rank])


def kept_per_token(
    model: ModelShape, compute_bytes: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Bytes one block keeps per token from a zero-bubble I to its W: every linear layer's input (one
    tensor for the layers that read the same one: q, k and v; gate and up) and output gradient, in the
    compute dtype. Column layers' inputs are whole (cut along the sequence with sequence parallelism)
    and their outputs cut by tp; row layers' inputs cut by tp and their output gradients whole."""
    h, seq = model.d_model, tp if sequence_parallel else 1
    ff_out = (2 if model.gated_mlp else 1) * model.ff  # fc, or gate and up
    inputs = 2 * h / seq + (h + model.ff) / tp  # attention and MLP inputs; attention output, MLP inner
    grads = (h + 2 * model.kv_width + ff_out) / tp + 2 * h  # column outputs; projection and down
    return compute_bytes * (inputs + grads)


def head_kept_per_token(model: ModelShape, compute_bytes: int, tp: int = 1) -> float:
    """Bytes the head keeps per token from I to W: its input and the logits' gradient (cut by tp)."""
    return compute_bytes * (model.d_model + model.vocab / tp)
