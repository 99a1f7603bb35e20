"""Tensor parallelism (Megatron-LM's layers, applied from outside by a plan); see ``plans.py``.

``comm_ops`` (autograd f/g and the sequence all-gather/reduce-scatter over the tp ``Comm``), ``shards``
(the one shard arithmetic: boxes of global parameters), ``layers`` (column/row-parallel linear, vocab-
parallel embedding and cross-entropy), ``random`` (the RNG tracker for dropout), ``plans`` (plans as
data and ``apply_tensor_parallel``).
"""

from __future__ import annotations

from shardwise.tensor_parallel.layers import vocab_parallel_cross_entropy
from shardwise.tensor_parallel.plans import (
    Plan,
    TensorParallelLayout,
    apply_tensor_parallel,
    gpt_plan,
    hf_gpt2_plan,
    hf_llama_plan,
)

__all__ = [
    "Plan",
    "TensorParallelLayout",
    "apply_tensor_parallel",
    "gpt_plan",
    "hf_gpt2_plan",
    "hf_llama_plan",
    "vocab_parallel_cross_entropy",
]
