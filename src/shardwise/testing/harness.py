"""Run a function on N local ranks (gloo, file rendezvous) and collect what each returns.

Each rank is a process (a fork of a server that imported torch once: ``procstart``) that joins one
process group through a ``FileStore`` in a temporary folder, so no ports are involved and parallel
test runs cannot collide. The parent waits with a hard
deadline; the first rank to fail stops the others and its traceback is re-raised, naming the rank
(a rank that failed only because a peer died gives way to that peer's own error: ``_root_cause``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardwise import procstart


class RankFailure(RuntimeError):
    """A rank raised, or the job ran past its deadline."""

    def __init__(self, rank: int | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    ``fn`` must be a top-level (picklable) function; its return value must be picklable too.
    """
    ctx = procstart.context()
    env = {**os.environ, **(env or {})}  # a forked rank adopts it and our output (procstart)
    stdio = procstart.Stdio()
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shardwise-ranks-") as folder:
        store_path = os.path.join(folder, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store_path, backend, timeout_s, env, stdio, args, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, results, world_size, timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)


def _collect(procs: list[Any], results: mp.Queue, world_size: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    while len(out) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(out))
            raise RankFailure(None, f"ranks {missing} did not finish within {timeout_s:.0f} s")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in out and not proc.is_alive() and proc.exitcode not in (0, None):
                    _drain_failure(results)
                    raise RankFailure(rank, f"rank {rank} died with exit code {proc.exitcode}") from None
            continue
        if not ok:
            rank, value = _root_cause(results, rank, value)
            raise RankFailure(rank, f"rank {rank} failed:\n{value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(world_size)]


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo's words for a dead peer
CAUSE_GRACE_S = 2.0  # how long a failure waits for another rank's, which may be its cause


def _root_cause(results: mp.Queue, rank: int, value: str) -> tuple[int, str]:
    """The failure to report: a rank whose peer raised and exited fails too, with only "connection
    closed by peer", and its report can arrive first; so for ``CAUSE_GRACE_S`` the other ranks'
    failures are read, and the first that is not a lost peer wins."""
    if not any(words in value for words in PEER_GONE):
        return rank, value
    deadline = time.monotonic() + CAUSE_GRACE_S
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            other, ok, text = results.get(timeout=remaining)
        except queue.Empty:
            break
        if not ok and not any(words in text for words in PEER_GONE):
            return other, text
    return rank, value


def _drain_failure(results: mp.Queue) -> None:
    """A rank that raised may have died right after reporting: prefer its traceback to its exit code."""
    try:
        rank, ok, value = results.get(timeout=0.5)
    except queue.Empty:
        return
    if not ok:
        raise RankFailure(rank, f"rank {rank} failed:\n{value}")


def _all_returned(store: dist.Store, world_size: int) -> None:
    """Wait, on the store, until every rank's function has returned. A rank that closes its process
    groups while a peer is still connecting one (gloo's full-mesh connect, at the start or in a
    ``new_group``) fails that peer with "Connection closed by peer"; a store outlives a broken group."""
    if store.add("shardwise/returned", 1) == world_size:
        store.set("shardwise/all-returned", "1")
    store.wait(["shardwise/all-returned"])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    timeout_s: float,
    env: dict[str, str],
    stdio: procstart.Stdio,
    args: tuple[Any, ...],
    results: mp.Queue,
) -> None:
    procstart.adopt_environment(env)
    stdio.apply()
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=timeout_s))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        try:
            value = fn(rank, world_size, *args)
            _all_returned(store, world_size)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle bytes: torch's queue reduction would pass tensors as shared-memory handles that
        # die with this process. These bytes only ever travel between our own processes.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
