"""Start ranks: N local processes through torch's elastic agent, or join a job torchrun started.

``launch_local`` runs ``fn(*args)`` on N local workers with the elastic agent (the engine behind
torchrun): a rendezvous whose one store listens on loopback alone (``rendezvous``), restarts up to
``max_restarts`` times when a worker dies, and the whole job stopped within seconds when one rank
fails, with that rank's traceback.

``init_distributed`` is what every worker calls first. It builds the process group on the agent's
store under a per-attempt prefix, so ranks restarted after a crash never read the keys an earlier
attempt left behind (torch's default reuses them and the restarted job fails). Under
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (what multi-node jobs should use: a replaced host's agent
starts counting attempts from 0 again), rank 0 hosts a fresh store each attempt and no prefix is used;
it listens on ``MASTER_ADDR``'s address (all interfaces only where that name is loopback here but the
job spans hosts, since the other hosts reach it by another address).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise import procstart, signals
from shardwise.device import prepare_rank, process_group_args
from shardwise.observe.watchdog import HANG_REPORT_ENV
from shardwise.rendezvous import bound_store, is_loopback, register_loopback


class LaunchError(RuntimeError):
    """A rank failed; the message holds its rank and traceback.

    ``user_error`` is set when the rank stopped on a mistake in the input (a config or a checkpoint
    that does not fit): one line to show instead of a traceback; ``error_type`` names the exception
    the rank raised then (one of ``USER_ERRORS``).
    """

    def __init__(self, message: str, user_error: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.user_error, self.error_type = user_error, error_type

    def report(self, command: str) -> int:
        """Print the failure for ``shardwise <command>``; the exit code: 2 for bad input, else 1."""
        if self.user_error:
            print(f"shardwise {command}: error: {self.user_error}", file=sys.stderr)
            return 2
        print(f"shardwise {command}: {self}", file=sys.stderr)
        return 1


# exceptions that mean "the input is wrong" (or, NonFiniteStop, that the run diverged), shown as their
# message alone
USER_ERRORS = (
    *("ConfigError", "SplitError", "NotBuiltError"),  # ConfigError and its kinds
    *("StateMismatchError", "CheckpointWriteError", "LossError", "NonFiniteStop"),
    *("CorruptCheckpointError", "ManifestError"),  # a damaged --init-from (resume falls back instead)
)


def running_under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_world_size() -> int:
    """The job's world size as torchrun gives it to each rank (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def threads_per_rank(nproc: int) -> int:
    """Cores divided among local ranks, so N ranks never oversubscribe the machine."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def _launch_config(kind: Any, **options: Any) -> Any:
    """``kind(**options)`` with the options this torch's ``LaunchConfig`` knows: ``shutdown_timeout``
    is newer than torch 2.11 (a GPU image's torch); without it the agent waits its own default (30 s)
    between SIGTERM and SIGKILL when it stops the ranks."""
    known = {f.name for f in dataclasses.fields(kind)}
    return kind(**{name: value for name, value in options.items() if name in known})


def launch_local(
    fn: Callable[..., Any], args: tuple[Any, ...], nproc: int, max_restarts: int = 0
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return each rank's return value by rank.

    SIGINT and SIGTERM raise ``signals.Interrupted`` here as everywhere in the command line: the agent
    then stops the ranks (SIGTERM, SIGKILL after ``shutdown_timeout``) on its way out, and the caller
    exits with the code of the signal that came.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every failure at length; LaunchError carries the one that matters.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    # local ranks talk over loopback only: gloo's pairs, and NCCL's bootstrap (its data goes GPU to GPU)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    config = _launch_config(
        LaunchConfig,
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend=register_loopback(),  # torch's c10d one listens on every interface
        rdzv_configs={"timeout": 60},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=procstart.START_METHOD,
        local_addr="127.0.0.1",
        shutdown_timeout=3,
        # The agent would answer SIGINT and SIGTERM itself by forwarding them to the ranks, and SIGINT
        # to a rank still importing torch prints a traceback. Ours raise Interrupted instead (already
        # so under the command line; installed below for library callers), and the agent's cleanup
        # on the way out stops the ranks with SIGTERM, which ends them quietly at any point.
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    before = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    ours = _install_launch_handlers()
    hang_report = Path(tempfile.mkdtemp(prefix="shardwise-launch-")) / "hang.txt"
    os.environ[HANG_REPORT_ENV] = str(hang_report)  # the watchdog's one line lands here (see below)
    procstart.start_early()
    try:
        return elastic_launch(config, _RankMain(fn, dict(os.environ), procstart.Stdio()))(*args)
    except ChildFailedError as exc:
        if hang_report.exists():  # a rank's watchdog named (above) the rank that held the job up
            raise LaunchError("the job stopped on the hang named above") from None
        raise LaunchError(_describe_failure(exc), *_user_error(exc)) from None
    except SignalException as exc:  # a signal the agent handled: it has already stopped the ranks
        raise signals.Interrupted(int(exc.sigval)) from None
    finally:
        os.environ.pop(HANG_REPORT_ENV, None)
        shutil.rmtree(hang_report.parent, ignore_errors=True)
        # where a signal came, SIG_DFL stays (as ``signals``): a second one during cleanup ends at once
        signals.restore({sig: h for sig, h in ours.items() if signal.getsignal(sig) is _interrupt})
        _drop_agent_handlers(before)


_AGENT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"))


def _install_launch_handlers() -> signals.Handlers:
    """SIGINT and SIGTERM end the spawned ranks first, then raise ``Interrupted`` (``_interrupt``)."""
    previous: signals.Handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals.HANDLED:
            previous[sig] = signal.signal(sig, _interrupt)
    return previous


def _interrupt(signum: int, frame: Any) -> None:
    """A signal to the launcher: stop every rank process at once, then unwind as ``signals`` does.

    The exception may land anywhere in the agent, even inside ``Process.start`` while it writes a new
    rank's start-up data: that rank is in no list the agent cleans up, and left alone it goes on
    starting with half its data, or a semaphore the unwinding has already removed, and prints a
    traceback (or the resource tracker a "leaked semaphore" warning) after our one line. Ended here,
    before anything unwinds, every rank dies quietly (SIGTERM is SIG_DFL in a rank: ``_RankMain``).
    A start under way is let finish first (``_forking_a_rank``), so that its rank is there to end.
    """
    if _hold_signal(signum, frame):
        return
    _held_since.clear()
    signals.restore_defaults()  # a second signal ends the launcher at once
    _end_spawned_ranks()
    raise signals.Interrupted(signum)


# how long a signal may wait for a rank's start to end (a forkserver that never forks: not forever)
HOLD_S = 5.0
_held_since: dict[int, float] = {}


def _hold_signal(signum: int, frame: Any) -> bool:
    """Hold the signal while the main thread is starting a rank through the forkserver: the start-up
    data may already be written while the rank is not yet forked (the forkserver forks it later, after
    the sweep, and it would start on its own). Sent again in 20 ms, it lands once the start is over."""
    if not _forking_a_rank(frame):
        return False
    if time.monotonic() > _held_since.setdefault(signum, time.monotonic()) + HOLD_S:
        return False
    timer = threading.Timer(0.02, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()
    return True


def _forking_a_rank(frame: Any) -> bool:
    """Whether the main thread is inside multiprocessing's forkserver start of a process (``_launch``
    writes the start-up data, then waits for the forked pid)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_launch" and code.co_filename.endswith("popen_forkserver.py"):
            return True
        frame = frame.f_back
    return False


def _end_spawned_ranks() -> None:
    """SIGTERM every rank this process started (``procstart.is_rank_process``) and wait briefly for
    them; the resource tracker and the forkserver are left to clean up after them."""
    import psutil

    ranks = []
    me = os.getpid()
    for child in psutil.Process().children(recursive=True):
        try:
            if procstart.is_rank_process(child.ppid(), me, " ".join(child.cmdline())):
                child.terminate()
                ranks.append(child)
        except psutil.Error:  # gone already
            continue
    psutil.wait_procs(ranks, timeout=2)


def _drop_agent_handlers(before: dict[Any, Any]) -> None:
    """The agent leaves its handlers installed; after the launch they would raise its exception."""
    if threading.current_thread() is not threading.main_thread():
        return  # the agent installs handlers only from the main thread
    for sig, handler in before.items():
        current = signal.getsignal(sig)
        if getattr(current, "__module__", "").startswith("torch.distributed.elastic"):
            signal.signal(sig, handler)


# What a rank says when it only lost a peer: a consequence of another rank's failure, not a cause.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
)


class _RankMain:
    """Runs a rank's function; a rank that failed only because it lost a peer leaves last.

    The agent reports the first rank it sees exit. Without this pause, a rank blocked in a
    collective when its peer raised can exit first, and its "connection closed" would hide the
    traceback that matters.
    """

    def __init__(self, fn: Callable[..., Any], env: dict[str, str], stdio: procstart.Stdio) -> None:
        # the launcher's environment and output, which a forked rank adopts (``procstart``)
        self.fn, self.env, self.stdio = fn, env, stdio
        # the agent names the entry point by __name__; updated=(): a wrapped _Joined's ``fn`` (the
        # user's function, in its __dict__) must not replace ours, or the rank never joins the group
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any) -> Any:
        # The agent stops ranks with SIGTERM; a Ctrl-C reaching the whole process group (or the
        # parent-death signal torch sets, SIGINT) too. Either ends a rank at once, even blocked inside a
        # collective (where a Python handler would wait for the collective's own timeout), with no
        # traceback. Checkpoints are published atomically, so nothing is left half-written.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        procstart.adopt_environment(self.env, keep=_set_by_agent)
        self.stdio.apply()
        try:
            return self.fn(*args)
        except Exception as exc:
            if any(p in str(exc) for p in _PEER_LOST):
                time.sleep(PEER_LOST_GRACE_S)
            raise


PEER_LOST_GRACE_S = 2.0

# what the elastic agent sets for each worker alone (LocalElasticAgent's worker env)
_AGENT_KEYS = frozenset(
    {
        *("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE"),
        *("GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)


def _set_by_agent(name: str) -> bool:
    return name in _AGENT_KEYS or name.startswith("TORCHELASTIC_")


def _failure_text(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "") + "\n" + message.get("extraInfo", {}).get("py_callstack", "")
    if failure.exitcode < 0 and not str(message).strip():
        message = f"killed by signal {-failure.exitcode}"
    return str(message).strip()


def _user_error(exc: Any) -> tuple[str | None, str | None]:
    """The message and type of a user-input error any rank raised, if that is what stopped the job."""
    for _, failure in sorted(exc.failures.items()):
        first = _failure_text(failure).splitlines()[0] if _failure_text(failure) else ""
        name, sep, message = first.partition(": ")
        if sep and name.rsplit(".", 1)[-1] in USER_ERRORS:
            return message, name.rsplit(".", 1)[-1]
    return None, None


def _describe_failure(exc: Any) -> str:
    """Name the rank that caused the failure; ranks that merely lost it as a peer are listed after."""
    failures = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
    causes = [(r, f) for r, f in failures if not any(p in _failure_text(f) for p in _PEER_LOST)]
    rank, failure = (causes or failures)[0]
    others = sorted(r for r, _ in failures if r != rank)
    also = f"\n(ranks {others} stopped too, having lost their peer)" if others else ""
    return f"rank {rank} failed (exit code {failure.exitcode}):\n{_failure_text(failure)}{also}"


def init_distributed(timeout_s: float = 300.0, device: str = "auto") -> None:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_*).

    The backend follows ``device`` (``shardwise.device``): a CUDA rank first sets its GPU from
    ``LOCAL_RANK`` and joins ``cpu:gloo,cuda:nccl`` bound to it (``device_id``), a CPU rank joins gloo.
    """
    if dist.is_initialized():
        return
    prepare_rank(device)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads_per_rank(1))))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" not in os.environ:  # a plain single process
        store: dist.Store = dist.HashStore()
    else:
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = _job_store(rank == 0 and not agent_hosts, world_size, timeout)
        if agent_hosts:
            # The agent's store outlives attempts: prefix each one. Restart counts agree across nodes
            # only while no agent is replaced, hence the advice for multi-node jobs.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"shardwise/attempt-{attempt}", store)
            _warn_shared_store_multinode(rank)
    args = process_group_args(device)  # backend (and device_id on CUDA)
    dist.init_process_group(store=store, rank=rank, world_size=world_size, timeout=timeout, **args)


def _job_store(hosts: bool, world_size: int, timeout: timedelta) -> dist.Store:
    """The store at ``MASTER_ADDR:MASTER_PORT``: served here (``hosts``) on that address alone, or
    on every interface where the name is loopback here but the job spans hosts; else a client of it."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    spans_hosts = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) < world_size
    if hosts and not (spans_hosts and is_loopback(addr)):
        return bound_store(addr, port, timeout.total_seconds())
    return dist.TCPStore(addr, port, world_size, is_master=hosts, timeout=timeout)


def _warn_shared_store_multinode(rank: int) -> None:
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if rank == 0 and nodes > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        print(
            "shardwise: a multi-node job with restarts: start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a replaced host's ranks cannot rejoin "
            "(see docs/multi-node.md)",
            file=sys.stderr,
            flush=True,
        )


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
