"""Count tensor bytes, not RSS: the peak of live floating-point storages made while a block runs.

``TensorBytes`` is a ``TorchDispatchMode``: every operator that runs inside ``with TensorBytes() as
counted:`` is seen, and each real (not meta) floating-point storage among its outputs is remembered
through a weak reference. After each operator the live bytes are summed from the storages' current
sizes, so frees (the storage's last tensor gone) and in-place resizes (ZeRO-3 frees a gathered unit
with ``untyped_storage().resize_(0)``) both count, and ``counted.peak`` is the most alive at once;
``counted.peak_parts`` says what it was made of (bytes by the operator that made each storage), so a
peak that differs from the expected one names what was alive.
Floating point only: parameters, buffers, gradients and activations are; token ids and the corpus
are not. RSS would mix in the allocator, the libraries and the page cache; this counts what the
code under test holds. No communication.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorBytes(TorchDispatchMode):
    """Live and peak bytes of the floating-point storages operators create inside the ``with``."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref[torch.UntypedStorage]] = {}  # StorageImpl address -> storage
        self._made_by: dict[int, str] = {}  # StorageImpl address -> the operator that made it
        self.peak = 0
        self.peak_at = ""  # the operator after which the peak was seen
        self.peak_parts: dict[str, int] = {}  # at the peak: live bytes by the operator that made them

    @property
    def live(self) -> int:
        """Bytes of the tracked storages alive now, at their current sizes."""
        total = 0
        for key, ref in list(self._live.items()):
            storage = ref()
            if storage is None:
                del self._live[key]
            else:
                total += storage.nbytes()
        return total

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.is_meta:
                storage = tensor.untyped_storage()
                key = storage._cdata
                known = self._live.get(key)
                if known is None or known() is None:  # new, or a freed one's address reused
                    self._live[key] = weakref.ref(storage)
                    self._made_by[key] = str(func)
        now = self.live
        if now > self.peak:
            self.peak, self.peak_at, self.peak_parts = now, str(func), self._parts()
        return out

    def _parts(self) -> dict[str, int]:
        parts: dict[str, int] = {}
        for key, ref in self._live.items():
            storage = ref()
            if storage is not None and storage.nbytes():
                op = self._made_by.get(key, "?")
                parts[op] = parts.get(op, 0) + storage.nbytes()
        return dict(sorted(parts.items(), key=lambda item: -item[1]))
