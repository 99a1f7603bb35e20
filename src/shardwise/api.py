"""The entry points of a user's own script: start ranks, join the job, train.

``launch(main, nproc=2)`` runs ``main()`` on N local ranks through shardwise's launcher (torch's
elastic agent), or, under ``torchrun``, once in this process (torchrun started the ranks); each rank
joins the process group first (``init``), so ``main`` only builds and trains. ``init`` also works in a
plain ``python`` process: a world of one. Communication: the process group's rendezvous (a TCP store
on loopback for local ranks, torchrun's for multi-node jobs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from shardwise.launcher import init_distributed, launch_local, running_under_torchrun


def init(timeout_s: float = 300.0) -> int:
    """Join the job's process group (torchrun's or shardwise's launcher's environment; none: a world
    of one) if this process has not yet; returns this rank. Idempotent."""
    init_distributed(timeout_s)
    return dist.get_rank()


class _Joined:
    """``fn`` run on a rank after joining the process group, which it leaves afterwards."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float) -> None:
        self.fn, self.timeout_s = fn, timeout_s
        functools.update_wrapper(self, fn)  # the agent names the entry point by its __qualname__

    def __call__(self, *args: Any) -> Any:
        init(self.timeout_s)
        try:
            return self.fn(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def launch(
    fn: Callable[..., Any], nproc: int = 2, *args: Any, max_restarts: int = 0, timeout_s: float = 300.0
) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks and return what each returned, by rank.

    Under torchrun the ranks already exist: ``fn`` runs once here and the list holds this rank's
    result. A rank that fails stops the job; its traceback comes back in a ``LaunchError``. ``fn``
    must be importable by the spawned ranks (a top-level function of the script, which must guard
    its own start with ``if __name__ == "__main__":``).
    """
    if running_under_torchrun() or dist.is_initialized():
        init(timeout_s)
        return [fn(*args)]
    results = launch_local(_Joined(fn, timeout_s), args, nproc, max_restarts)
    return [results[rank] for rank in sorted(results)]
