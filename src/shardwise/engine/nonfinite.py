"""Non-finite losses and gradients: what was found, and how the ranks that step agree, in the same
step, to go on, skip the update or stop.

Communication: one all-reduce (min) of two integers over the ranks that step, between the gradient
exchange and the update, and only for engines whose optimizer runs on those ranks; where a gradient was
not finite, one broadcast of its parameter's name from the lowest rank that found one (ranks that hold
different parameters, a pipeline's stages, could not name it otherwise). The flags are read on the host
first, so the all-reduce is host bookkeeping, over gloo: a rank whose share of the squared norm is
finite (taken first, and reused by the update's clipping) holds only finite gradients and looks at none
of them; otherwise each engine takes its tensors' peaks on the device and reads them once. (The per-step
metrics all-gather cannot carry it: it runs after the update so that it times the whole step, and the
verdict is needed before.) Each rank contributes whether its loss share is finite and the index of the
first parameter whose gradient, as it holds it, is not (``Engine.nonfinite_grad``); the minimum over
ranks is the same verdict everywhere. ``Engine.update`` asks for it in every step spine (the Trainer's
and ``Engine.train_step``'s). A parameter server's servers check the summed gradient themselves and send
their verdict with the weights (``Engine.servers_nonfinite``): no message more. Under fp16 dynamic loss
scaling the scaler owns overflows (it skips the step and lowers the scale), until its scale reaches its
floor.

With further axes (pipeline, tensor parallelism, hybrid replicas: the norm's shares are summed over the
same ranks that step) and unscaled gradients, the step's boundary is one all-reduce instead
(``post_boundary_sums``): the norm's share, whether the loss share and the rank's own gradients are
finite, and the loss share, summed. A gradient that is not finite makes the squared norm not finite, so
when both come back finite nothing else is asked: the norm is the one clipping uses and the sum is the
loss the step reports. Otherwise every rank (they all see the same sums) asks the exact question above,
which names what was not finite, or finds nothing where only the norm overflowed (finite gradients above
about 1e19 in fp32), and the update then goes on as it always did. The all-reduce is posted
(``post_boundary_sums``) and, under a pipeline with ``on_nonfinite = "stop"``, nothing clipped and no
ZeRO, a rank whose own gradients and loss share are finite updates while it is in flight
(``Engine.updates_early``): a pipeline's last stage, done first, updates beside the first stage's last
backward instead of after it. Should another rank's turn out not finite, every rank still stops in the
same step with the same line; the ranks that updated early keep the stopped step's update (a stopped run
resumes from its last checkpoint, not from the model in memory). With ``"skip"``, clipping, ZeRO or no
pipeline, no rank updates before the sums are in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardwise.collectives.api import Comm
from shardwise.collectives.p2p import Done
from shardwise.device import HOST

_NONE_FOUND = 2**62  # no (rank << 32 | parameter index) reaches it
_NAME_BYTES = 256  # a parameter's name as one rank tells the others


@dataclass(frozen=True)
class NonFinite:
    """What was found not finite (NaN or inf) in one step, and whether the run stops on it."""

    what: str  # "the loss" | "the gradient of <parameter>"
    stop: bool  # False: the step's update is skipped and training goes on (on_nonfinite = "skip")

    def message(self, step: int) -> str:
        """The one line a stopped run ends with."""
        verb = "are" if " and " in self.what else "is"
        return (
            f"step {step}: {self.what} {verb} not finite (NaN or inf), so training stopped; lower the "
            "learning rate (--lr), or pass --on-nonfinite skip to skip such steps"
        )


class NonFiniteStop(RuntimeError):
    """Raised where a run stops on a non-finite value (``on_nonfinite = "stop"``): on every rank that
    steps in the same step, and on the servers that found it. The run ends on its one line."""

    def __init__(self, step: int, found: NonFinite) -> None:
        super().__init__(found.message(step))
        self.step, self.found = step, found

    @classmethod
    def from_message(cls, message: str) -> NonFiniteStop:
        """The exception back from its one line (what a rank reports to the launcher)."""
        match = re.match(r"step (\d+): (.+?) (?:is|are) not finite", message)
        if match is None:
            raise ValueError(f"not a non-finite stop: {message!r}")
        return cls(int(match[1]), NonFinite(match[2], stop=True))


def describe_nonfinite(loss_ok: bool, grad_name: str | None) -> str:
    """What was not finite, in words: the loss, a parameter's gradient, or both."""
    parts = ([] if loss_ok else ["the loss"]) + ([f"the gradient of {grad_name}"] if grad_name else [])
    return " and ".join(parts) or "the loss"


def _peaks(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest magnitude, stacked on their device (one device: a rank's gradients):
    finite exactly when every element is (a NaN or an inf is its own tensor's peak; no sum, so nothing
    overflows). One multi-tensor kernel per dtype, not several small ones per tensor: on a GPU a
    step's launches are its time."""
    return torch.stack(torch._foreach_norm(list(tensors), math.inf))


def _checked(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` can hold a NaN or inf at all: a floating (or complex) one with elements."""
    return tensor is not None and bool(tensor.numel()) and (tensor.is_floating_point() or tensor.is_complex())


def nonfinite_names(named: Sequence[tuple[str, torch.Tensor | None]]) -> list[str]:
    """Every name whose tensor has a NaN or inf, in the order given (a missing, empty or integer
    tensor counts finite). The peaks are taken together on the tensors' device and read once (no
    synchronisation per tensor)."""
    present = [(name, t) for name, t in named if _checked(t)]
    if not present:
        return []
    finite = torch.isfinite(_peaks([t for _, t in present if t is not None])).tolist()
    return [name for (name, _), ok in zip(present, finite, strict=True) if not ok]


def first_nonfinite(named: Sequence[tuple[str, torch.Tensor | None]]) -> str | None:
    """The first name whose tensor has a NaN or inf (``nonfinite_names``), or None."""
    return next(iter(nonfinite_names(named)), None)


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor on the tensors' device: every element of every one of ``tensors`` is finite
    (True for none, or only empty or integer ones). Not read here: the caller reads it, or sends it,
    once."""
    present = [t for t in tensors if _checked(t)]
    if not present:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if len(tensors) else HOST)
    return torch.isfinite(_peaks(present)).all()


@dataclass(frozen=True)
class BoundarySums:
    """What the step's boundary all-reduce summed over the ranks that step (``post_boundary_sums``)."""

    norm_sq: float  # the squared global gradient norm (inf or NaN where a share was not finite)
    loss: float  # the loss shares summed (those that were finite)
    finite: bool  # every loss share and counted gradient finite


def post_boundary_sums(
    comm: Comm | None,
    norm_share: torch.Tensor,
    loss_share: float,
    label: str,
    held: torch.Tensor | None = None,
) -> Callable[[], BoundarySums]:
    """Post one all-reduce (sum) over the ranks that step of this rank's squared-norm share, a 1 if its
    loss share (or ``held``: its own share before the axes discount it, a replica's too) is not
    finite, and the loss share; return what waits for it and reads the sums (once, on the host).
    While it is in flight a rank may update (``Engine.updates_early``). Where the sums are not
    finite, every rank sees that alike and asks ``agree_nonfinite``."""
    finite = math.isfinite(loss_share)
    values = [0.0, 0.0 if finite else 1.0, loss_share if finite else 0.0]
    sums = torch.tensor(values, dtype=torch.float64, device=norm_share.device)
    sums[0] = norm_share.to(torch.float64)
    if held is not None:  # on the device: no read here
        sums[1] += (~torch.isfinite(held)).to(torch.float64)
    work = comm.all_reduce(sums, label=label, async_op=True) if comm is not None else Done()

    def read() -> BoundarySums:
        work.wait()
        norm_sq, bad_losses, loss = sums.tolist()
        return BoundarySums(norm_sq, loss, math.isfinite(norm_sq) and bad_losses == 0)

    return read


def _name_from(comm: Comm | None, owner: int, name: str) -> str:
    """``name`` as group rank ``owner`` has it, on every rank (a broadcast of its UTF-8 bytes, cut
    at ``_NAME_BYTES``); only on the rare step where something was not finite."""
    if comm is None:
        return name
    buffer = torch.zeros(_NAME_BYTES, dtype=torch.uint8, device=HOST)
    if comm.rank == owner:
        encoded = name.encode()[:_NAME_BYTES]
        buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8, device=HOST)
    comm.broadcast(buffer, src=owner)
    return bytes(buffer.tolist()).rstrip(b"\0").decode(errors="replace")


def agree_nonfinite(
    comm: Comm | None, names: Sequence[str], bad: str | None, loss_ok: bool, policy: str
) -> NonFinite | None:
    """After ``finish_grads``: what any rank found not finite this step (the same on every rank), or
    None. ``names``: this rank's trainable parameters in order; ``bad``: the first of them whose
    gradient, as it holds it, is not finite; ``loss_ok``: its loss share is; ``comm``: the ranks that
    step (None: this rank alone)."""
    # ranks may hold different parameters (pipeline stages): the lowest rank's first one wins, and
    # that rank tells the others its name; "none found" is one sentinel for all
    me = comm.rank if comm is not None else 0
    found = (me << 32) | names.index(bad) if bad else _NONE_FOUND
    flags = torch.tensor([int(loss_ok), found], dtype=torch.int64, device=HOST)
    if comm is not None:
        comm.all_reduce(flags, "min")
    loss_ok, found = bool(flags[0]), int(flags[1])
    if loss_ok and found == _NONE_FOUND:
        return None
    grad_name = None
    if found != _NONE_FOUND:
        owner = found >> 32
        grad_name = _name_from(comm, owner, names[found & 0xFFFFFFFF] if owner == me else "")
    return NonFinite(describe_nonfinite(loss_ok, grad_name), stop=policy == "stop")
