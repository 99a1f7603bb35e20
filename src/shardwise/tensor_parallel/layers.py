"""Megatron's tensor-parallel layers, each built from a plain module by cutting its parameters.

Shoeybi et al., 2019 ("Megatron-LM"), section 3; sequence parallelism after Korthikanti et al., 2022.
With ``Y = X A`` and ``A`` cut by columns over the tp ranks, each rank computes its columns of ``Y``
with no communication (:class:`ColumnParallelLinear`); the next layer ``Z = Y B`` with ``B`` cut by rows
takes those columns as they are and sums the ranks' partial ``Z`` with one all-reduce
(:class:`RowParallelLinear`). An MLP or an attention block (split by heads: a fused ``qkv`` is cut so
each rank holds its own heads' q, k and v) thus costs one all-reduce forward (g, after the row layer)
and one backward (f, before the column layer). With sequence parallelism the replicated activations
between blocks are cut along the sequence instead: f becomes an all-gather forward (reduce-scatter
backward) and g a reduce-scatter forward (all-gather backward).

:class:`VocabParallelEmbedding` holds rows ``[r V/tp, (r+1) V/tp)`` of the table; a token outside them
looks up zeros and one all-reduce (reduce-scatter with sequence parallelism) completes the sum.
:func:`vocab_parallel_cross_entropy` takes logits cut along the vocabulary and never gathers them: a
max all-reduce, then the target's logit and the sum of exponentials, all-reduced (3 all-reduces of one
number per token); it returns the SUM of token losses, the project's loss convention
(``engine/loss.py``). Parameter cutting goes through ``shards.ShardedParam``; the layers keep the
records (``shards``) so a parameter always knows its global name, shape and box.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.engine.linear import WeightGradStore, linear
from shardwise.engine.loss import IGNORE_INDEX, CausalLMLoss, logits_of
from shardwise.tensor_parallel import comm_ops
from shardwise.tensor_parallel.shards import ShardedParam, even_share, replicated, split_dim, split_sections


class Sharder:
    """Makes the local Parameter of each cut once, so a tied parameter stays tied.

    The built-in GPT's output head reuses the token embedding's matrix; both are cut by vocabulary rows,
    so the second cut finds the first and returns the same local Parameter. A tied parameter cut two
    different ways is refused.
    """

    def __init__(self) -> None:
        self.made: dict[int, tuple[torch.Tensor, ShardedParam, nn.Parameter]] = {}
        self._records: dict[int, ShardedParam] = {}  # id of a local Parameter made here -> its cut

    def __call__(self, param: torch.Tensor, shard: ShardedParam) -> nn.Parameter:
        hit = self.made.get(id(param))
        if hit is not None:
            _, first, local = hit
            if first.placements != shard.placements:
                raise ValueError(
                    f"{shard.name} is the same parameter as {first.name}, but the plan cuts them differently"
                )
            return local
        local = nn.Parameter(shard.take(param.detach()), requires_grad=param.requires_grad)
        self.made[id(param)] = (param, shard, local)  # the original kept alive: its id stays unique
        self._records[id(local)] = shard
        return local

    def record(self, param: nn.Parameter) -> ShardedParam | None:
        """The record of the cut that made local Parameter ``param``, if this sharder made it."""
        return self._records.get(id(param))


def _check_linear(module: nn.Module, transposed: bool, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of an ``nn.Linear`` (or, ``transposed``, of Hugging Face's ``Conv1D``)."""
    if transposed:
        if type(module).__name__ != "Conv1D":
            raise TypeError(f"{name} is a {type(module).__name__}; a transposed style expects a Conv1D")
    elif not isinstance(module, nn.Linear):
        raise TypeError(f"{name} is a {type(module).__name__}; this style expects an nn.Linear")
    weight, bias = module.weight, module.bias
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} has no weight tensor")
    return weight, bias if isinstance(bias, torch.Tensor) else None




class ColumnParallelLinear(nn.Module):
    """``y[..., cols_r] = x A[:, cols_r] + b[cols_r]``: the output dim cut over tp, output left cut.

    ``copy_input`` applies f (or, with sequence parallelism, the sequence all-gather) to the input;
    turn it off where a module above has applied it once for several column layers sharing one input
    (Llama's q/k/v and gate/up projections), so the backward all-reduce happens once.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        name: str,
        sections: tuple[int, ...] | None = None,
        section_names: tuple[str, ...] = ("output width",),
        transposed: bool = False,
        copy_input: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        sharder: Sharder | None = None,
    ) -> None:
        super().__init__()
        weight, bias = _check_linear(module, transposed, name)
        sharder = sharder or Sharder()
        out_dim = 1 if transposed else 0
        sections = sections or (weight.shape[out_dim],)
        tp, r = comm.world_size, comm.rank
        self.shards: dict[str, ShardedParam] = {
            "weight": split_sections(f"{name}.weight", weight.shape, out_dim, sections, tp, r, section_names)
        }
        self.weight = sharder(weight, self.shards["weight"])
        self.bias: nn.Parameter | None = None
        if bias is not None:
            self.shards["bias"] = split_sections(
                f"{name}.bias", bias.shape, 0, sections, tp, r, section_names
            )
            self.bias = sharder(bias, self.shards["bias"])
        self.comm, self.transposed, self.copy_input = comm, transposed, copy_input
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.weight_grads: WeightGradStore | None = None  # a zero-bubble pipeline's (engine/linear.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = parallel_input(x, self.comm, self.sequence_parallel, self.seq_dim)
        return linear(x, self.weight, self.bias, self.transposed, self.weight_grads)  # (..., out / tp)

    def extra_repr(self) -> str:
        return f"{self.shards['weight'].global_shape} -> local {self.shards['weight'].local_shape}"


class RowParallelLinear(nn.Module):
    """``z = sum_r y[..., rows_r] B[rows_r, :] + b``: the input dim cut over tp, input already cut.

    The ranks' partial products are summed by g (all-reduce), or with sequence parallelism
    reduce-scattered along the sequence; the bias is replicated and added once, after the sum.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        name: str,
        transposed: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        sharder: Sharder | None = None,
    ) -> None:
        super().__init__()
        weight, bias = _check_linear(module, transposed, name)
        sharder = sharder or Sharder()
        in_dim = 0 if transposed else 1
        self.shards = {
            "weight": split_dim(
                f"{name}.weight", weight.shape, in_dim, comm.world_size, comm.rank, "input width"
            )
        }
        self.weight = sharder(weight, self.shards["weight"])
        self.bias: nn.Parameter | None = None
        if bias is not None:
            self.shards["bias"] = replicated(f"{name}.bias", bias.shape)
            self.bias = sharder(bias, self.shards["bias"])
        self.comm, self.transposed = comm, transposed
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.weight_grads: WeightGradStore | None = None  # a zero-bubble pipeline's (engine/linear.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in / tp)
        partial = linear(x, self.weight, None, self.transposed, self.weight_grads)
        if self.sequence_parallel:
            out = comm_ops.reduce_scatter_to_sequence(partial, self.comm, self.seq_dim)
        else:
            out = comm_ops.reduce_from_tp(partial, self.comm)
        return out + self.bias if self.bias is not None else out

    def sequence_parallel_params(self) -> list[str]:
        """Local names of replicated parameters whose gradients are partial (each rank saw its slice of
        the sequence): they need a sum over tp after backward."""
        return ["bias"] if self.sequence_parallel and self.bias is not None else []

    def extra_repr(self) -> str:
        return f"{self.shards['weight'].global_shape} -> local {self.shards['weight'].local_shape}"


def parallel_input(x: torch.Tensor, comm: Comm, sequence_parallel: bool, seq_dim: int = 1) -> torch.Tensor:
    """A replicated (or, with sequence parallelism, sequence-cut) input entering column layers."""
    if sequence_parallel:
        return comm_ops.gather_from_sequence(x, comm, seq_dim)
    return comm_ops.copy_to_tp(x, comm)


def qkv_sections(
    width: int, n_head: int, n_kv_head: int, tp: int
) -> tuple[tuple[int, int, int], tuple[str, str, str]]:
    """The q, k, v widths of a fused projection of output ``width``, with the head counts checked.

    Refused with the arithmetic when tp does not divide the head count or, with grouped-query
    attention, the key/value head count.
    """
    if n_head % tp:
        raise ValueError(f"n_head {n_head} is not divisible by tp {tp}; each rank must hold whole heads")
    if n_kv_head % tp:
        raise ValueError(
            f"n_kv_head {n_kv_head} is not divisible by tp {tp}; with grouped-query attention each rank must "
            "hold whole key/value heads"
        )
    heads = n_head + 2 * n_kv_head
    head_dim = even_share(width, heads, f"qkv width {width} over n_head + 2 n_kv_head =")
    return (n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim), ("q width", "k width", "v width")


class VocabParallelEmbedding(nn.Module):
    """An embedding table cut by vocabulary rows; out-of-range tokens look up zeros, one sum completes it."""

    def __init__(
        self,
        module: nn.Embedding,
        comm: Comm,
        name: str,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        sharder: Sharder | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Embedding):
            raise TypeError(
                f"{name} is a {type(module).__name__}; vocab-parallel embedding expects nn.Embedding"
            )
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(
                f"{name}: max_norm, sparse and scale_grad_by_freq embeddings cannot be cut by vocab"
            )
        sharder = sharder or Sharder()
        tp, r = comm.world_size, comm.rank
        vocab = module.num_embeddings
        self.shards = {"weight": split_dim(f"{name}.weight", module.weight.shape, 0, tp, r, "vocab_size")}
        self.weight = sharder(module.weight, self.shards["weight"])
        self.per_rank = vocab // tp
        self.vocab_start = r * self.per_rank
        pad = module.padding_idx
        # the padding row keeps a zero gradient only where this rank holds it
        in_range = pad is not None and self.vocab_start <= pad < self.vocab_start + self.per_rank
        self.padding_idx = pad - self.vocab_start if in_range and pad is not None else None
        self.comm, self.sequence_parallel, self.seq_dim = comm, sequence_parallel, seq_dim

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.per_rank)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight, self.padding_idx)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)  # (..., hidden): this rank's rows only
        if self.sequence_parallel:
            return comm_ops.reduce_scatter_to_sequence(partial, self.comm, self.seq_dim)
        return comm_ops.reduce_from_tp(partial, self.comm)

    def extra_repr(self) -> str:
        stop, shape = self.vocab_start + self.per_rank, self.shards["weight"].global_shape
        return f"vocab [{self.vocab_start}, {stop}) of {shape}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Comm, ignore_index: int
    ) -> torch.Tensor:
        # logits: (tokens, vocab / tp); target: (tokens,) global ids
        per_rank = logits.size(-1)
        start = comm.rank * per_rank
        top = logits.max(dim=-1).values  # (tokens,)
        comm.all_reduce(top, op="max", label="vocab-parallel CE max")
        shifted = logits - top.unsqueeze(-1)  # the max subtracted: exp never overflows
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + per_rank) & ~ignored
        local_target = (target - start).masked_fill(~mine, 0)
        rows = torch.arange(logits.size(0), device=logits.device)
        picked = shifted[rows, local_target].masked_fill(~mine, 0.0)  # the target's logit, on its rank only
        comm.all_reduce(picked, label="vocab-parallel CE target logit")
        exp = shifted.exp_()  # in place: no second logits-sized buffer (shifted is not needed again)
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, label="vocab-parallel CE sum exp")
        losses = (sum_exp.log() - picked).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # now the softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(exp, local_target, mine, ignored)
        return losses.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, mine, ignored = ctx.saved_tensors
        # d(sum of losses)/d logits = softmax - one_hot(target), on this rank's columns; no communication
        g = softmax.clone()
        rows = torch.arange(g.size(0), device=g.device)
        g[rows, local_target] -= mine.to(g.dtype)
        g.masked_fill_(ignored.unsqueeze(-1), 0.0)
        return g.mul_(grad), None, None, None  # the clone above keeps the saved softmax for a re-walk


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: Comm, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The SUM of cross-entropies of ``logits`` (..., vocab / tp), cut by vocabulary over ``comm``, against
    global ``target`` ids (...); targets equal to ``ignore_index`` carry no loss. Equal on every tp rank.

    Rank ``r`` holds vocabulary columns ``[r V/tp, (r+1) V/tp)`` (as :class:`ColumnParallelLinear`
    leaves them). Half-precision logits are reduced in float32, as ``engine.loss`` does.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    flat = logits.reshape(-1, logits.size(-1))
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), comm, ignore_index)
    return out


class VocabParallelTokenLoss:
    """``engine.loss.TokenLoss`` for vocab-cut logits: summed next-token CE of ``(inputs, targets)``."""

    def __init__(self, comm: Comm, positions: int | None = None) -> None:
        self.comm, self.positions = comm, positions

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        logits, targets = logits_of(outputs), batch[1]
        predicted = logits.size(1)
        return vocab_parallel_cross_entropy(logits, targets[:, -predicted:], self.comm)

    def count(self, batch: Any) -> int:
        targets = batch[1]
        return int(targets.size(0)) * (self.positions or int(targets.size(1)))


class VocabParallelCausalLMLoss(CausalLMLoss):
    """``engine.loss.CausalLMLoss`` for vocab-cut logits: position t predicts label t + 1, labels equal to
    ``ignore_index`` carry no loss and are not counted (Hugging Face models)."""

    def __init__(self, comm: Comm, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__(ignore_index)
        self.comm = comm

    def __call__(self, outputs: Any, batch: Any) -> torch.Tensor:
        logits, labels = logits_of(outputs), self._labels(batch)
        return vocab_parallel_cross_entropy(logits[:, :-1], labels[:, 1:], self.comm, self.ignore_index)
