"""Our PowerSGD codec against PyTorch's ``powerSGD_hook`` on the same bucket, step after step.

The hook is called directly on a stand-in for DDP's ``GradBucket`` (it only asks for the buffer, the
index, the per-tensor views and whether the bucket is the last), in the same 2-rank process group, with
equal settings: rank, start iteration, min compression rate, warm start and error feedback on, seed 0.
torch reduces means, shardwise sums (each rank's gradient is its share of the sum), so torch is given
``x`` and we ``x / world``; the decoded mean and sum must then agree.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.collectives.api import Comm
from shardwise.compression import CompressedComm, segments_of
from shardwise.compression.powersgd import PowerSGDCodec
from shardwise.testing import run_on_ranks

SHAPES = [(32, 24), (24,), (16, 40), (8, 3, 5), (32, 24), (40,)]
STEPS = 6


class _Bucket:
    """What ``powerSGD_hook`` reads of a ``dist.GradBucket``: views of one flat buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for shape in SHAPES:
            views.append(self._buffer[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        return views


def _compare(rank: int, world_size: int, matrix_rank: int) -> tuple[list[float], list[float]]:
    """Per step: our sum against torch's mean, and torch's mean against the exact mean."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    numel = sum(math.prod(s) for s in SHAPES)
    state = torch_psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=matrix_rank, start_powerSGD_iter=2, random_seed=0
    )
    ours = CompressedComm(Comm(), PowerSGDCodec("powersgd", matrix_rank, 2.0, 0.0, seed=0), start_step=2)
    codec_state = ours.new_state(numel, torch.float64, segments_of(SHAPES))
    diffs, lossy = [], []
    for step in range(STEPS):
        x = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 10 + rank))
        x = x * (1 + torch.arange(numel, dtype=torch.float64) / numel)  # not white noise: some structure
        mean = torch_psgd.powerSGD_hook(state, _Bucket(x.clone())).wait()  # type: ignore[arg-type]
        if isinstance(mean, list):
            mean = mean[0]
        bucket = x / world_size
        ours.reduce(bucket, codec_state)
        diffs.append(float((bucket - mean).abs().max() / mean.abs().max()))
        exact = x.clone()
        dist.all_reduce(exact)
        lossy.append(float((exact / world_size - mean).abs().max() / mean.abs().max()))
    return diffs, lossy


@pytest.mark.parametrize("matrix_rank", [1, 2, 4])
def test_powersgd_matches_torchs_hook(matrix_rank: int) -> None:
    """Gram-Schmidt (rank <= 2) and QR (rank 4) both; warm start and error feedback over 6 steps."""
    for diffs, lossy in run_on_ranks(_compare, 2, matrix_rank, timeout_s=120):
        assert max(diffs) < 1e-12, diffs  # in practice 0.0: bit for bit
        assert max(lossy[:2]) < 1e-12 < min(lossy[2:]), lossy  # plain all-reduce first, then compressed
