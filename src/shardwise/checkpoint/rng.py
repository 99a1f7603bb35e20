"""Per-rank random number generator states, saved as JSON and tensors and restored exactly.

Python's and NumPy's Mersenne Twister states go into the manifest as JSON (``rank_meta["rng"]``); the
torch CPU generator state (a uint8 tensor) is a checkpoint tensor named ``rng/torch/rank<r>`` (and
``rng/cuda/rank<r>`` when CUDA is in use). Purely local; the checkpoint writer carries them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shardwise.checkpoint.manager import Piece


def torch_rng_name(rank: int, device: str = "torch") -> str:
    return f"rng/{device}/rank{rank}"


def capture_rng(rank: int) -> tuple[dict[str, Any], list[Piece]]:
    """``(json_state, pieces)`` for this rank: put the first in ``rank_meta["rng"]``, save the second."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    pieces = [Piece.full(torch_rng_name(rank), torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pieces.append(Piece.full(torch_rng_name(rank, "cuda"), torch.cuda.get_rng_state()))
    return state, pieces


def restore_rng(state: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], rank: int) -> None:
    """Put back what :func:`capture_rng` took (``tensors`` holds the loaded ``rng/...`` tensors)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["kind"],
            np.asarray(npy["keys"], dtype=np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(tensors[torch_rng_name(rank)].to(torch.uint8))
    cuda_name = torch_rng_name(rank, "cuda")
    if cuda_name in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[cuda_name].to(torch.uint8))
