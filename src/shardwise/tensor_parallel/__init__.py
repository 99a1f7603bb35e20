"""Tensor parallelism (Megatron-LM's layers, applied from outside by a plan); see ``plans.py``.

``comm_ops`` (autograd f/g and the sequence all-gather/reduce-scatter over the tp ``Comm``), ``shards``
(the one shard arithmetic: boxes of global parameters), ``layers`` (column/row-parallel linear, vocab-
parallel embedding and cross-entropy), ``random`` (the RNG tracker for dropout), ``plans``
(``apply_tensor_parallel``: a plan applied; each model family's plan is its adapter's,
``models/adapters/``).
"""

from __future__ import annotations

from shardwise.tensor_parallel.layers import vocab_parallel_cross_entropy
from shardwise.tensor_parallel.plans import TensorParallelLayout, apply_tensor_parallel

__all__ = ["TensorParallelLayout", "apply_tensor_parallel", "vocab_parallel_cross_entropy"]
