"""Find, on a machine without a GPU, every tensor the library makes without regard to its device.

On a GPU a tensor made without ``device=`` lands on the CPU, beside parameters and batches on the GPU:
the step then fails (a kernel given tensors on two devices, a CPU tensor through NCCL) or silently
copies and waits. On a CPU-only machine the same mistake is invisible, since every tensor is on the
CPU anyway. ``DeviceLess`` makes it visible there: inside ``with DeviceLess() as found:``, a tensor
factory (``torch.zeros``, ``torch.tensor``, ... the constructors ``torch.set_default_device`` affects)
called from a file under ``root`` (shardwise's own source) without a ``device`` makes its tensor on the
meta device instead, which has no data: a step that uses it with the CPU model or batch, sends it
through a collective or reads it fails. Each such call is also recorded (``found.calls``: file, line
and function), so a test can name it even where a meta tensor would pass unnoticed. Calls from any
other file (torch's own CPU scalars by design, such as Adam's step count; a user's model) are left
alone. The library's rule it checks: every tensor names its device, its parameters' or batch's, or
``shardwise.device.HOST`` for host bookkeeping.

A ``TorchFunctionMode`` is per thread: work on other threads (an explicit algorithm's communication
thread) is not covered. No communication.
"""

from __future__ import annotations

import linecache
import sys
from pathlib import Path
from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import shardwise

SOURCE_ROOT = Path(shardwise.__file__).resolve().parent


class DeviceLess(TorchFunctionMode):
    """Device-less tensor factories called from files under ``root`` make meta tensors (module doc)."""

    def __init__(self, root: Path = SOURCE_ROOT) -> None:
        super().__init__()
        self.root = str(root)
        self.calls: list[str] = []  # "file:line in function" of each call redirected to meta
        self._factories = _device_constructors()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in self._factories and kwargs.get("device") is None:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(self.root) and _calls_by_name(caller, func):
                self.calls.append(_where(caller))
                kwargs["device"] = "meta"
        return func(*args, **kwargs)

    def __enter__(self) -> DeviceLess:
        super().__enter__()
        return self


def _calls_by_name(frame: Any, func: Any) -> bool:
    """Whether the caller's line names the factory: our own call, not one made for us by compiled code
    (safetensors' slicing makes its CPU tensors from the file's bytes, with our line as the caller)."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return f"{getattr(func, '__name__', '')}(" in line


def _where(frame: Any) -> str:
    path = Path(frame.f_code.co_filename)
    try:
        shown = str(path.relative_to(SOURCE_ROOT.parent))
    except ValueError:
        shown = str(path)
    return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"


def device_less_calls(calls: list[str]) -> str:
    """The recorded calls, one per line, each once (for an assertion's message)."""
    return "\n".join(dict.fromkeys(calls))


__all__ = ["SOURCE_ROOT", "DeviceLess", "device_less_calls"]
