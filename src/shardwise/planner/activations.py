"""What a block, the head and the loss save for backward, per micro-batch: the planner's activations.

**Activations** per block and micro-batch of b sequences of s tokens, width h, a heads, tp degree t.
Korthikanti et al. (MLSys 2023, "Reducing Activation Recomputation in Large Transformer Models")
count sbh(34 + 5as/h) bytes per layer at 16 bits (``korthikanti_layer_bytes``; with tensor parallelism
sbh(10 + 24/t + 5as/(ht)), with sequence parallelism too sbh(34 + 5as/h)/t). Our block saves, per token:
the two norm inputs (2h, in the residual stream's dtype: fp32 under autocast), the QKV input (h), the
queries, keys and values (h + 2·kv), the attention output (h: the projection's input is a view of it),
the MLP input (h) and the MLP's inner activations (2f, or 4f gated), in the compute dtype; plus fp32
norm statistics (4 values) and the attention's log-sum-exp (a values): fused attention keeps no s x s
matrix and our blocks have no dropout, so the 5as²b term and the two 1-byte masks are gone. At 16
bits, multi-head, f = 4h this is 32·sbh (Korthikanti's 34 less the masks) plus the small fp32 terms.
Hugging Face's RMSNorm (Llama) keeps its normalised input too: h more per norm. A test measures the
saved bytes of our GPT and of a Llama with a dispatch mode and finds these counts within 1%. Under
tensor parallelism the head-split and MLP tensors divide by t, and with sequence parallelism everything
does. With activation checkpointing a block keeps only its input, and backward rebuilds one block at a
time. Outside the blocks: the final
norm's and the head's inputs, and the logits peak at the loss (the logits, their fp32 log-softmax, and
the gradients of each). With pipeline parallelism (Narayanan et al.,
SC 2021) every rank is estimated with its own share and the largest reported (``planner/pipeline.py``):
its blocks as the split balances them, the embeddings on the first stage, the head, the logits and a
tied embedding's copy on the last, and its own micro-batches in flight from the pipeline's validator
(``pipeline.validate.peak_activations``: a (stage, micro-batch) pair holds the stage's saved tensors
from F to B or I, and from a zero-bubble I to its W each linear layer's input and output gradient;
each pair 1/v of a rank's blocks with v virtual stages); 1F1B gives min(m, pp) on the first stage.

No communication: arithmetic only (``shardwise plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.model import ModelShape


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Korthikanti et al. (2023), table 2: activation bytes of one transformer layer at 16 bits.

    ``recompute``: ``none``; ``selective`` (the attention core recomputed); ``full`` (the layer's input
    alone is kept, 2sbh).
    """
    if recompute == "full":
        return 2 * s * b * h
    if recompute == "selective":  # the attention core (the 5as/h term) is recomputed
        return 34 * s * b * h / tp if sequence_parallel else s * b * h * (10 + 24 / tp)
    attention = 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 + attention) / tp
    return s * b * h * (10 + 24 / tp + attention / tp)


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block saves for backward for one micro-batch, and what it keeps under checkpointing."""

    full: float  # everything autograd saves
    checkpointed: float  # the block's input alone


def block_activations(
    model: ModelShape,
    tokens: int,
    compute_bytes: int,
    residual_bytes: int,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> BlockActivations:
    """Our block's saved tensors for ``tokens`` tokens (see the module docstring for the list)."""
    h, t = model.d_model, tp
    split = t  # tensors split by heads or by the MLP's width
    seq = t if sequence_parallel else 1  # tensors that are whole under tp, sharded along s under sp
    mlp_inner = (4 if model.gated_mlp else 2) * model.ff
    residual = 2 * h * residual_bytes / seq  # the two norms' inputs
    # Hugging Face's RMSNorm also saves the normalised input, cast back, for its weight's product
    rms = 0 if model.layer_norm else 2 * h * compute_bytes / seq
    whole = 2 * h * compute_bytes / seq  # the QKV and MLP inputs
    heads = (h + 2 * model.kv_width + h + mlp_inner) * compute_bytes / split
    fp32 = (2 * 2 * 4) / seq + 4 * model.n_head / split  # norm statistics, attention log-sum-exp
    per_token = residual + rms + whole + heads + fp32
    return BlockActivations(tokens * per_token, tokens * h * residual_bytes / seq)


def logits_peak_bytes(tokens: int, vocab: int, compute_bytes: int, loss_bytes: int, tp: int = 1) -> float:
    """At the loss's backward: the logits, their log-softmax (fp32, or float64 for a float64 model), its
    gradient and the logits' gradient (cast back to the compute dtype under mixed precision)."""
    per_token = (
        vocab / tp * (3 * loss_bytes + compute_bytes + (compute_bytes if compute_bytes < loss_bytes else 0))
    )
    return tokens * per_token
