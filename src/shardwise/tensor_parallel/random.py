"""Dropout under tensor parallelism: one random stream shared by the tp ranks, one private to each.

The rule (Megatron-LM's, Shoeybi et al., 2019, section 3):

- **replicated regions** (every tp rank holds the same activation: the residual stream, and the
  embedding's output, without sequence parallelism) draw from torch's default generator. Every rank
  seeds it alike and, because split regions never touch it, consumes it alike, so the masks are
  **equal across tp ranks** and the ranks' copies stay identical;
- **split regions** (each rank holds different elements: its attention heads; with sequence
  parallelism, also its slice of the sequence in the norm/dropout regions) draw from the tracker's
  ``"tensor-parallel"`` state, seeded ``seed + 2718 + tp_rank`` (Megatron's offset), so the masks are
  **independent across tp ranks**, as one process's mask over the whole tensor would be.

:class:`RNGStatesTracker` is ours, written after Megatron's ``CudaRNGStatesTracker``: named generator
states beside the default one; ``fork(name)`` swaps a state in, runs the block, saves the advanced
state and swaps the default back. It works on the generator of the device the model lives on (torch's
CPU generator, or a CUDA device's). Activation checkpointing that recomputes a split region must
save and restore ``get_states()`` beside torch's own RNG state, as Megatron's checkpoint does, or the
recomputed masks differ from the first forward's. No communication here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

TP_STATE = "tensor-parallel"
TP_SEED_OFFSET = 2718  # Megatron's offset between the shared seed and the per-rank one


def default_generator(device: torch.device | str) -> torch.Generator:
    """torch's default generator for ``device`` (the CPU one, or that CUDA device's)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    if device.type != "cpu":
        raise ValueError(f"the tp RNG tracker knows cpu and cuda generators, not {device.type}")
    return torch.default_generator


class RNGStatesTracker:
    """Named generator states, swapped into the device's default generator by ``fork``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.generator = default_generator(device)
        self.states: dict[str, torch.Tensor] = {}
        self._outside: list[tuple[str, torch.Tensor]] = []  # (name, default state) while inside

    def add(self, name: str, seed: int) -> None:
        """A new state ``name`` seeded with ``seed``; the default generator is left as it was."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = self.generator.get_state()
        self.generator.manual_seed(seed)
        self.states[name] = self.generator.get_state()
        self.generator.set_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @property
    def inside(self) -> str | None:
        """The state swapped in now, if any."""
        return self._outside[-1][0] if self._outside else None

    def enter(self, name: str = TP_STATE) -> None:
        """Swap state ``name`` in (the default's is kept to swap back). Entering the state already
        swapped in does nothing, so several hooks may open one region."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; known: {sorted(self.states)}")
        if self.inside == name:
            return
        self._outside.append((name, self.generator.get_state()))
        self.generator.set_state(self.states[name])

    def leave(self, name: str = TP_STATE) -> None:
        """Save the advanced state ``name`` and swap the default back; outside ``name``, nothing."""
        if self.inside != name:
            return
        _, outside = self._outside.pop()
        self.states[name] = self.generator.get_state()
        self.generator.set_state(outside)

    @contextmanager
    def fork(self, name: str = TP_STATE) -> Iterator[None]:
        """Run the block with state ``name`` swapped in."""
        was_inside = self.inside == name
        self.enter(name)
        try:
            yield
        finally:
            if not was_inside:
                self.leave(name)


def tensor_parallel_tracker(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> RNGStatesTracker:
    """A tracker whose ``"tensor-parallel"`` state is seeded ``seed + 2718 + tp_rank``."""
    tracker = RNGStatesTracker(device)
    tracker.add(TP_STATE, seed + TP_SEED_OFFSET + tp_rank)
    return tracker
