"""Where a rank computes: the ``device`` setting, the process group that follows it, batches moved
there, and what memory and time mean on it.

One process per GPU. ``device = "auto"`` (the default) gives each local rank the GPU of its
``LOCAL_RANK`` when this machine has GPUs, else the CPU; ``"cpu"`` and ``"cuda"`` choose. A CUDA rank
joins the process group ``cpu:gloo,cuda:nccl`` bound to its GPU (``device_id``): a collective on CUDA
tensors (gradients, parameters, activations, the step's norm and non-finite flags) runs over NCCL, and
one on CPU tensors (host bookkeeping: token counts, per-step metrics, checkpoint agreement, the
parameter server's messages) over gloo. Every subgroup (the mesh's axes) inherits both. A CPU rank
joins gloo alone. Which side a collective takes is the device of its tensor, so every tensor the
library makes names its device: its parameters' or batch's, or ``HOST`` where host bookkeeping is
meant (``shardwise.testing.devices`` checks it).

A test bed, for a machine with one GPU (NCCL ranks cannot share a GPU): ``SHARDWISE_CUDA_BACKEND=gloo``
puts every local rank on the GPUs in turn (``LOCAL_RANK`` modulo the count) and joins gloo alone, which
carries CUDA tensors; ``Comm`` passes them through host memory for the operations gloo runs on the host
only. ``shardwise bench gpu`` uses it for the 2- and 4-rank runs that share one GPU.

NCCL's collectives return at once and run on the GPU's stream, so ``wait()`` no longer blocks the host:
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is set (``nccl_environment``) so that a collective that outlives the
process group's timeout aborts the communicator and ends the rank, and the hang watchdog finds the
collective still in flight (``Monitor`` polls ``is_completed``). Time on a GPU is measured with CUDA
events (``Clock``); memory is the allocator's peak there, the resident set size on the CPU
(``memory_mb``). No communication in this module.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any

import psutil
import torch

from shardwise.config import ConfigError

DEVICES = ("auto", "cpu", "cuda")
HOST = torch.device("cpu")  # where host bookkeeping tensors live (collectives on them run over gloo)
CUDA_BACKEND = "cpu:gloo,cuda:nccl"  # the process group of a CUDA rank: each device its backend
CUDA_BACKEND_ENV = "SHARDWISE_CUDA_BACKEND"  # nccl (the default) | gloo: ranks sharing a GPU (module doc)
# NCCL's own watchdog aborts a collective past the process group's timeout and ends the rank (torch's
# default since 2.2 is 3: abort, skip the cleanup that could hang); set here only where unset
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def cuda_count() -> int:
    """GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_type(setting: str) -> str:
    """``cpu`` or ``cuda``: what ``setting`` (auto | cpu | cuda) means on this machine."""
    if setting not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}; got {setting!r}")
    if setting == "auto":
        return "cuda" if cuda_count() else "cpu"
    return setting


def cuda_backend() -> str:
    """What carries CUDA tensors between ranks: ``nccl``, or ``gloo`` (the shared-GPU test bed)."""
    backend = os.environ.get(CUDA_BACKEND_ENV, "nccl") or "nccl"
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"{CUDA_BACKEND_ENV} must be nccl or gloo, got {backend!r}")
    return backend


def local_rank() -> int:
    """This rank's index on its machine (``LOCAL_RANK``, which torchrun and the elastic agent set)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_device(setting: str) -> torch.device:
    """The device of this rank: its local rank's GPU, or the CPU."""
    if device_type(setting) == "cuda":
        shared = cuda_backend() == "gloo" and cuda_count() > 0  # the test bed: ranks share the GPUs
        return torch.device("cuda", local_rank() % cuda_count() if shared else local_rank())
    return HOST


def default_nproc(setting: str) -> int:
    """Local ranks when none are asked for: one per GPU when the run computes on GPUs, else one."""
    return max(1, cuda_count()) if device_type(setting) == "cuda" else 1


def check_device(setting: str, local_ranks: int) -> None:
    """One line when ``setting`` cannot run ``local_ranks`` ranks on this machine: CUDA asked for where
    there is none, or more ranks than GPUs (NCCL needs a GPU of its own per rank)."""
    if setting not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}; got {setting!r}")
    if setting == "cuda" and not cuda_count():
        raise ConfigError(
            "device = cuda, but this machine has no CUDA device (torch.cuda.is_available() is False); "
            "use --device cpu or auto"
        )
    gpus = cuda_count()
    if device_type(setting) == "cuda" and local_ranks > gpus and cuda_backend() == "nccl":
        raise ConfigError(
            f"{local_ranks} local ranks on cuda, but this machine has {gpus} GPU{'s' if gpus != 1 else ''}: "
            "NCCL ranks cannot share a GPU; start at most one rank per GPU (--nproc), or use --device cpu"
        )


def process_group_args(setting: str) -> dict[str, Any]:
    """``init_process_group``'s backend (and ``device_id`` on CUDA) for a rank with ``setting``."""
    device = rank_device(setting)
    if device.type == "cuda" and cuda_backend() == "nccl":
        return {"backend": CUDA_BACKEND, "device_id": device}
    return {"backend": "gloo"}  # a CPU rank; or the shared-GPU test bed, where gloo carries CUDA too


def prepare_rank(setting: str) -> torch.device:
    """Before the process group: set this rank's GPU (from ``LOCAL_RANK``) and NCCL's error handling."""
    device = rank_device(setting)
    if device.type == "cuda":
        if device.index is not None and device.index >= cuda_count():  # (nccl: one GPU per rank)
            raise ConfigError(
                f"LOCAL_RANK {device.index} has no GPU of its own: this machine has {cuda_count()}; start "
                "at most one rank per GPU, or use --device cpu"
            )
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(device)
    return device


def group_device_type() -> str:
    """``cuda`` when the joined default process group carries CUDA tensors (``cpu:gloo,cuda:nccl``, or
    gloo in the shared-GPU test bed), else ``cpu``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return "cpu"
    backend = str(dist.get_backend())
    shared = backend == "gloo" and cuda_backend() == "gloo" and cuda_count() > 0
    return "cuda" if "cuda:" in backend or backend == "nccl" or shared else "cpu"


def joined_device(setting: str) -> torch.device:
    """This rank's device in the process group it joined: ``setting`` resolved, and checked against
    the group (``cuda`` asked for in a group without a CUDA side is one line; ``auto`` then means the CPU)."""
    wanted = device_type(setting)
    if wanted == "cuda" and group_device_type() != "cuda":
        if setting == "auto":
            return HOST
        raise ConfigError(
            "device = cuda, but this process joined a process group without CUDA (gloo alone): join with "
            "shardwise.init(device='cuda') or shardwise.launch(..., device='cuda'), or set device = cpu"
        )
    return rank_device(setting)


def place_model(model: torch.nn.Module, device: torch.device) -> None:
    """Move ``model`` to ``device`` in place; parameters on the meta device (weights still to be read,
    ``model.init_from``) stay there and are materialised on ``device`` by whoever reads them."""
    if any(p.is_meta for p in model.parameters()):
        model._apply(lambda t: t if t.is_meta else t.to(device))  # ties kept, as in Module.to
    else:
        model.to(device)


# -- batches ------------------------------------------------------------------------------------------


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) on ``device``. From the host to a GPU
    through pinned memory, without blocking the host (the copy runs on the current stream, before the
    forward that reads it); nothing is copied where it already is."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        if device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


# -- memory -------------------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


_PROCESS: dict[int, psutil.Process] = {}  # by pid: a forked child must not read its parent's


def rss_mb() -> float:
    """Current resident set size (read before the peak, so the peak is never below it). Read every
    step: the ``psutil.Process`` is made once per process, not per read."""
    pid = os.getpid()
    process = _PROCESS.get(pid) or _PROCESS.setdefault(pid, psutil.Process(pid))
    return process.memory_info().rss / 2**20


def memory_mb(device: torch.device) -> dict[str, float]:
    """What this rank's memory is, in MiB: the host's resident set (now and its peak) always, and on a
    GPU the caching allocator's peaks (``max_memory_allocated``: tensors; ``max_memory_reserved``: what
    the allocator holds). ``peak_mb`` is the figure that matters for ``device``: the GPU's allocated
    peak, or the peak RSS on the CPU. The one helper metrics, benchmarks and ``plan --check`` read."""
    now = rss_mb()
    out = {"rss_mb": now, "peak_rss_mb": max(now, peak_rss_mb())}
    if device.type == "cuda":
        allocated, reserved = _cuda_peaks(device)
        out["max_memory_allocated_mb"] = allocated / 2**20
        out["max_memory_reserved_mb"] = reserved / 2**20
        out["peak_mb"] = out["max_memory_allocated_mb"]
    else:
        out["peak_mb"] = out["peak_rss_mb"]
    return out


def _cuda_peaks(device: torch.device) -> tuple[int, int]:
    """``max_memory_allocated`` and ``max_memory_reserved`` in bytes from one read of the allocator's
    statistics, left nested: each of torch's two helpers flattens all of them in Python, which a
    launch-bound step pays for (this is read every step)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before CUDA is initialised

    def peak(key: str) -> int:
        return int(stats.get(key, {}).get("all", {}).get("peak", 0))

    return peak("allocated_bytes"), peak("reserved_bytes")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on a GPU (a benchmark's phase); RSS peaks cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# -- time ---------------------------------------------------------------------------------------------


class Clock:
    """Elapsed time of work on ``device``: wall time on the CPU; on a GPU, CUDA events recorded on the
    current stream, so the time covers the kernels queued between ``start`` and ``stop``, not only
    their launch. ``seconds()`` waits for the stop event: read it once, where the host waits anyway
    (the end of a step)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._begin = 0.0
        self._end: float | None = None
        self._events: tuple[Any, Any] | None = None

    def start(self) -> Clock:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events = (begin, end)
        self._begin, self._end = time.perf_counter(), None
        return self

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._end = time.perf_counter()

    def seconds(self) -> float:
        if self._end is None:
            self.stop()
        if self._events is not None:
            begin, end = self._events
            end.synchronize()
            return float(begin.elapsed_time(end)) / 1000.0
        assert self._end is not None
        return self._end - self._begin
