"""Coalesced collectives: many small tensors sent as one flat message per dtype.

Used to broadcast initial weights and buffers from rank 0: one broadcast per dtype instead of one per
tensor, which matters for latency-bound backends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.collectives.api import Comm


def broadcast_coalesced(comm: Comm, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values."""
    if comm.world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src=src)
        offset = 0
        with torch.no_grad():
            for tensor in group:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
