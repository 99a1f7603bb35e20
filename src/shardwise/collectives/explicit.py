"""Dispatch from a collective and an algorithm name to the explicit implementation that runs it.

Communication pattern: that of the chosen algorithm (see ring.py, tree.py, halving_doubling.py,
naive.py); this module only shapes tensors for them. Every implementation works on a 1-D contiguous
tensor: a contiguous input is used through a view, anything else through a copy written back at the end.
"avg" is run as "sum" followed by a division (floor division for integer tensors).
"""

from __future__ import annotations

import torch

from shardwise.collectives import halving_doubling, naive, ring, tree
from shardwise.collectives.p2p import P2P

EXPLICIT = ("ring", "tree", "halving_doubling", "naive")

# op -> algorithm -> the variant that runs. An algorithm with no variant of its own for an op runs the
# nearest one: broadcast under "ring" is binomial scatter + ring all-gather; reduce is the binomial tree
# except under "naive"; all-gather and reduce-scatter are the ring except under "naive".
ALGORITHM_FOR: dict[str, dict[str, str]] = {
    "all_reduce": {a: a for a in EXPLICIT},
    "broadcast": {
        "ring": "scatter_allgather",
        "tree": "tree",
        "halving_doubling": "tree",
        "naive": "naive",
    },
    "reduce": {"ring": "tree", "tree": "tree", "halving_doubling": "tree", "naive": "naive"},
    "all_gather": {"ring": "ring", "tree": "ring", "halving_doubling": "ring", "naive": "naive"},
    "reduce_scatter": {"ring": "ring", "tree": "ring", "halving_doubling": "ring", "naive": "naive"},
}


def divide(tensor: torch.Tensor, n: int) -> None:
    """The "avg" step: true division for floating tensors, floor division for integer ones."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.div_(n)
    else:
        tensor.div_(n, rounding_mode="floor")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of ``tensor``, or a 1-D copy when it is not contiguous."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


def _back(flat: torch.Tensor, tensor: torch.Tensor) -> None:
    """Write a result computed in ``_flat(tensor)`` back, when that was a copy."""
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def _reduce_op(op: str) -> str:
    return "sum" if op == "avg" else op


def all_reduce(tensor: torch.Tensor, p2p: P2P, op: str, algorithm: str) -> None:
    flat = _flat(tensor)
    module = {"ring": ring, "tree": tree, "halving_doubling": halving_doubling, "naive": naive}
    module[ALGORITHM_FOR["all_reduce"][algorithm]].all_reduce(flat, p2p, _reduce_op(op))
    if op == "avg":
        divide(flat, p2p.world_size)
    _back(flat, tensor)


def broadcast(tensor: torch.Tensor, p2p: P2P, src: int, algorithm: str) -> None:
    flat, variant = _flat(tensor), ALGORITHM_FOR["broadcast"][algorithm]
    if variant == "scatter_allgather":
        tree.broadcast_scatter_allgather(flat, p2p, src)
    else:
        (tree if variant == "tree" else naive).broadcast(flat, p2p, src)
    _back(flat, tensor)


def reduce(tensor: torch.Tensor, p2p: P2P, dst: int, op: str, algorithm: str) -> None:
    """Only ``dst``'s tensor changes: a tree node with children combines in a scratch copy."""
    tree_variant = ALGORITHM_FOR["reduce"][algorithm] == "tree"
    if p2p.rank == dst or not (tree_variant and tree.combines_into(p2p.rank, p2p.world_size, dst)):
        flat = _flat(tensor)  # dst: the result lands here; a leaf only sends it
    else:
        flat = p2p.workspace(4, tensor.numel(), tensor)
        flat.copy_(tensor.reshape(-1))
    if tree_variant:
        tree.reduce_binomial(flat, p2p, _reduce_op(op), dst)
    else:
        naive.reduce(flat, p2p, _reduce_op(op), dst)
    if p2p.rank == dst:
        if op == "avg":
            divide(flat, p2p.world_size)
        _back(flat, tensor)


def all_gather(output: torch.Tensor, shard: torch.Tensor, p2p: P2P, algorithm: str) -> None:
    flat = _flat(output)
    module = ring if ALGORITHM_FOR["all_gather"][algorithm] == "ring" else naive
    module.all_gather(flat, shard.reshape(-1), p2p)
    _back(flat, output)


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, p2p: P2P, op: str, algorithm: str) -> None:
    flat = _flat(shard)
    module = ring if ALGORITHM_FOR["reduce_scatter"][algorithm] == "ring" else naive
    module.reduce_scatter(flat, full.reshape(-1), p2p, _reduce_op(op))
    if op == "avg":
        divide(flat, p2p.world_size)
    _back(flat, shard)
