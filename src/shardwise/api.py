"""The entry points of a user's own script: start ranks, join the job, train.

``launch(main, nproc=2)`` runs ``main()`` on N local ranks through shardwise's launcher (torch's
elastic agent), or, under ``torchrun``, once in this process (torchrun started the ranks); each rank
joins the process group first (``init``), so ``main`` only builds and trains. ``init`` also works in a
plain ``python`` process: a world of one. Communication: the process group's rendezvous (a TCP store
on loopback for local ranks, torchrun's for multi-node jobs).
"""

from __future__ import annotations

import ast
import functools
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.config import ConfigError
from shardwise.device import check_device
from shardwise.engine.full_state import StateMismatchError
from shardwise.engine.loss import LossError
from shardwise.engine.nonfinite import NonFiniteStop
from shardwise.launcher import LaunchError, init_distributed, launch_local, running_under_torchrun
from shardwise.train.checkpointing import CheckpointWriteError


def init(timeout_s: float = 300.0, device: str = "auto") -> int:
    """Join the job's process group (torchrun's or shardwise's launcher's environment; none: a world
    of one) if this process has not yet; returns this rank. Idempotent. ``device`` (auto | cpu | cuda,
    as the config's ``device``) picks the backend: ``cpu:gloo,cuda:nccl`` bound to this local rank's
    GPU, or gloo (``shardwise.device``); a config asking for CUDA later needs a group that has it."""
    init_distributed(timeout_s, device)
    return dist.get_rank()


class _Joined:
    """``fn`` run on a rank after joining the process group, which it leaves afterwards."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float, device: str) -> None:
        self.fn, self.timeout_s, self.device = fn, timeout_s, device
        # the agent names the entry point by its __qualname__; updated=(): fn's own attributes (a
        # wrapper's ``fn``) must not replace ours
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any) -> Any:
        init(self.timeout_s, self.device)
        try:
            return self.fn(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    nproc: int = 2,
    *args: Any,
    max_restarts: int = 0,
    timeout_s: float = 300.0,
    device: str = "auto",
) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks and return what each returned, by rank.

    Under torchrun the ranks already exist: ``fn`` runs once here (joining the group first and leaving
    it after, unless the group was already joined) and the list holds this rank's
    result. A rank that fails stops the job. A mistake in the input (``ConfigError``, ``LossError``,
    ``StateMismatchError``, ``CheckpointWriteError``) or a run stopped on a non-finite value
    (``NonFiniteStop``) is raised here as that same exception, its message one line, as under
    torchrun; any other failure is a ``LaunchError`` holding the failed rank's traceback. ``fn`` and
    ``args`` must pickle by reference (``fn`` a top-level function of an importable script, which
    guards its own start with ``if __name__ == "__main__":``, and is not defined inside that block);
    else ``LaunchError`` says so at once. ``device``: as ``init``'s; ``cuda`` on a machine without
    it, or more ranks than GPUs, is a one-line ``ConfigError`` before any rank starts.
    """
    if dist.is_initialized():  # the caller's group: theirs to leave
        init(timeout_s, device)
        return [fn(*args)]
    if running_under_torchrun():  # joined here, so left here: a group left to interpreter exit can abort
        return [_Joined(fn, timeout_s, device)(*args)]
    _check_sendable(fn, args)
    check_device(device, nproc)
    try:
        results = launch_local(_Joined(fn, timeout_s, device), args, nproc, max_restarts)
    except LaunchError as failed:
        if failed.user_error is None or failed.error_type is None:
            raise
        raise _as_raised(failed.error_type, failed.user_error) from None
    return [results[rank] for rank in sorted(results)]


def _check_sendable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """The spawned ranks receive ``fn`` and ``args`` pickled: refuse in one line what cannot be."""
    try:
        pickle.dumps(fn)
    except Exception as err:  # pickle raises PicklingError, AttributeError or TypeError here
        raise LaunchError(
            f"launch cannot send {getattr(fn, '__qualname__', fn)!r} to the ranks ({err}): pass a function "
            "defined at the top level of the script or of a module, not a lambda or a nested function"
        ) from None
    if _defined_only_under_main_guard(fn):
        raise LaunchError(
            f"launch cannot send {fn.__name__!r} to the ranks: it is defined inside the script's "
            '`if __name__ == "__main__":` block, which the ranks do not run when they import the script; '
            "define it at the top level"
        )
    for i, arg in enumerate(args):
        try:
            pickle.dumps(arg)
        except Exception as err:
            raise LaunchError(
                f"launch cannot send argument {i} ({type(arg).__name__}) to the ranks ({err}): pass "
                "arguments that pickle, or build the object inside the function"
            ) from None


def _defined_only_under_main_guard(fn: Callable[..., Any]) -> bool:
    """Whether the script's ``fn`` is bound inside its ``if __name__ == "__main__":`` block and nowhere
    else: it pickles here by name, but a spawned rank imports the script without that block."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(fn, "__module__", None) != "__main__" or not path or not Path(path).is_file():
        return False
    try:
        tree = ast.parse(Path(path).read_text())
    except (SyntaxError, UnicodeDecodeError, OSError):
        return False
    guarded = [node for node in tree.body if _is_main_guard(node)]
    elsewhere = [node for node in tree.body if not _is_main_guard(node)]
    name = getattr(fn, "__name__", "")
    return any(name in _bound(node) for node in guarded) and not any(name in _bound(n) for n in elsewhere)


def _is_main_guard(node: ast.stmt) -> bool:
    test = ast.unparse(node.test) if isinstance(node, ast.If) else ""
    return "__name__" in test and "__main__" in test


def _bound(node: ast.AST) -> set[str]:
    """Names a statement binds anywhere inside it: definitions, assignments, imports."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(sub.name)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, ast.alias):
            names.add(sub.asname or sub.name.split(".")[0])
    return names


# what a rank's user-input error is raised as here, by the name the rank reported (launcher.USER_ERRORS)
_RAISED_AS: dict[str, Callable[[str], Exception]] = {
    "ConfigError": ConfigError,
    "SplitError": ConfigError,  # kinds of ConfigError, raised here as their base
    "NotBuiltError": ConfigError,
    "LossError": LossError,
    "StateMismatchError": StateMismatchError,
    "CheckpointWriteError": CheckpointWriteError,
    "NonFiniteStop": NonFiniteStop.from_message,
}


def _as_raised(error_type: str, message: str) -> Exception:
    build = _RAISED_AS.get(error_type)
    try:
        return build(message) if build is not None else LaunchError(message, message, error_type)
    except ValueError:  # a message the type cannot be rebuilt from: the line still comes through
        return LaunchError(message, message, error_type)
