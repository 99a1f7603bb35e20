"""Offload of sharded master weights and optimizer state: to CPU memory, or to memory-mapped files.

No communication: offload only moves this rank's own shards. ``cpu`` keeps master shards (and so the
optimizer state the optimizer creates beside them) in pinned host memory while the model computes on a
GPU; on a CPU-only machine it changes nothing. The moves never block the host more than they must
(``HostStaging``): before the update every group's gradient shard is copied, without blocking, into a
pinned host buffer made once per group and reused every step, and each group's update waits only for
its own copy (a CUDA event); the updated master goes back to the GPU from pinned memory without
blocking, on the stream the gather then reads it on. The next update's wait for its own copy, queued
behind that upload on the same stream, also orders the upload before the host writes the master again.
``disk`` keeps each group's master shard and optimizer state
in files under ``offload_dir/rank<r>/`` and maps them (``torch.from_file``, shared) only while that group
is stepped or gathered, so at most one group's state is resident at a time, in the spirit of
ZeRO-Infinity's NVMe swapping (Rajbhandari et al., SC 2021). Parameters in stage 3 are the master
shards, so disk offload covers them too.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from torch.optim import Optimizer

from shardwise.config import ZeroConfig
from shardwise.device import HOST
from shardwise.zero.group import FlatGroup


class NoOffload:
    """State stays where it was made."""

    def resident(self, index: int) -> AbstractContextManager[None]:
        return nullcontext()

    def forget_state(self, index: int, keep: set[str]) -> None:
        """Group ``index``'s optimizer state now holds only ``keep`` (a checkpoint was loaded)."""

    def close(self) -> None:
        pass


class CpuOffload(NoOffload):
    """Master shards in pinned host memory; the optimizer then keeps its state there too."""

    def __init__(self, groups: list[FlatGroup]) -> None:
        for group in groups:
            if group.master.device.type != "cpu":
                group.master.data = group.master.data.to(HOST).pin_memory()


class HostStaging:
    """Gradient shards from the GPU to the host for an update that runs there (see the module doc):
    one pinned buffer per group, made on first use and reused; one CUDA event per copy in flight."""

    def __init__(self, count: int) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._copied: list[torch.cuda.Event | None] = [None] * count

    def start(self, shards: list[torch.Tensor | None], masters: list[torch.Tensor]) -> None:
        """Queue every group's copy at once (those already where their master is stay)."""
        for i, (shard, master) in enumerate(zip(shards, masters, strict=True)):
            if shard is None or shard.device == master.device or not shard.is_cuda:
                continue
            buffer = self._buffers[i]
            if buffer is None or buffer.shape != shard.shape or buffer.dtype != master.dtype:
                buffer = self._buffers[i] = torch.empty(
                    shard.shape, dtype=master.dtype, device=HOST, pin_memory=True
                )
            buffer.copy_(shard, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[i] = event

    def take(self, index: int, shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """Group ``index``'s gradient where its master is: the staged copy once it has landed (this
        group's event only), or the shard itself when both are on one device."""
        event, buffer = self._copied[index], self._buffers[index]
        if event is not None and buffer is not None:
            event.synchronize()
            self._copied[index] = None
            return buffer
        return shard.to(master.device)


class DiskOffload:
    """Master shard and optimizer state of group ``i`` live in files, mapped only while in use."""

    def __init__(self, folder: str, rank: int, groups: list[FlatGroup], optimizers: list[Optimizer]) -> None:
        self._owned = not folder
        root = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="shardwise-offload-"))
        self.dir = root / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.groups, self.optimizers = groups, optimizers
        self._depth = [0] * len(groups)
        self._files: list[dict[str, Path]] = [{} for _ in groups]
        for i, group in enumerate(groups):
            group.resident = functools.partial(self.resident, i)
            self._evict(i)

    def _tensors(self, i: int) -> dict[str, torch.Tensor]:
        """The group's master shard and every optimizer-state tensor of the same shape."""
        master = self.groups[i].master
        out = {"master": master.data}
        for key, value in self.optimizers[i].state.get(master, {}).items():
            if torch.is_tensor(value) and value.shape == master.shape:
                out[f"state.{key}"] = value
        return out

    def _evict(self, i: int) -> None:
        master = self.groups[i].master
        for key, tensor in self._tensors(i).items():
            path = self._files[i].get(key)
            if path is None:  # first time: write the file; later the mapping already wrote through
                path = self.dir / f"group{i}.{key}.bin"
                tensor.detach().cpu().contiguous().numpy().tofile(path)
                self._files[i][key] = path
            self._set(i, key, torch.empty(0, dtype=tensor.dtype, device=HOST))  # in the file now
        if not self._files[i]:
            raise RuntimeError(f"group {i} had nothing to offload")
        assert master.numel() == 0

    def _load(self, i: int) -> None:
        group = self.groups[i]
        numel, dtype = group.layout.shard_size, group.precision.master
        for key, path in self._files[i].items():
            self._set(i, key, torch.from_file(str(path), shared=True, size=numel, dtype=dtype))

    def _set(self, i: int, key: str, tensor: torch.Tensor) -> None:
        master = self.groups[i].master
        if key == "master":
            master.data = tensor
        else:
            self.optimizers[i].state[master][key.removeprefix("state.")] = tensor

    @contextmanager
    def resident(self, index: int) -> Iterator[None]:
        """Map group ``index``'s files for the duration; unmap (writing through) afterwards."""
        if self._depth[index] == 0:
            self._load(index)
        self._depth[index] += 1
        try:
            yield
        finally:
            self._depth[index] -= 1
            if self._depth[index] == 0:
                self._evict(index)

    def forget_state(self, index: int, keep: set[str]) -> None:
        """Drop the files of group ``index``'s optimizer state other than ``keep`` (they were cleared)."""
        for key in [k for k in self._files[index] if k != "master" and k.removeprefix("state.") not in keep]:
            self._files[index].pop(key).unlink(missing_ok=True)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.dir.parent, ignore_errors=True)


Offload = NoOffload | DiskOffload  # CpuOffload is a NoOffload once the masters are in host memory


def build_offload(config: ZeroConfig, groups: list[FlatGroup], optimizers: list[Optimizer]) -> Offload:
    if config.offload == "none":
        return NoOffload()
    if config.offload == "cpu":
        return CpuOffload(groups)
    if config.offload == "disk":
        return DiskOffload(config.offload_dir, groups[0].comm.rank, groups, optimizers)
    raise ValueError(f"zero.offload must be none, cpu or disk; got {config.offload!r}")
