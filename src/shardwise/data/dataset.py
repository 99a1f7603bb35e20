"""A user's map-style dataset, sharded over the data-parallel ranks as pure functions of (seed, step).

The stream of sample indices is the concatenation of one permutation of the dataset per epoch, each
seeded by a hash of (seed, epoch); step s takes positions [s * B, (s + 1) * B) of it (B the global batch).
Every rank computes the same global batch and keeps its contiguous slice (``split_counts``: even, or
``--data-weights``), so the slices in rank order are exactly the batch one process would draw, and a
run resumed at step k (mid-epoch included) continues with exactly the batches it would have seen.
Samples are collated with the user's ``collate_fn`` (default: torch's ``default_collate``). A
dataset smaller than the global batch is refused (a step would hold some samples twice), and so is a
batch whose tensors disagree on their number of rows (inputs and targets of different lengths would
broadcast in a loss and train on nonsense). No communication.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import default_collate

from shardwise.config import ConfigError
from shardwise.device import HOST


class MapDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def _permutation(seed: int, epoch: int, size: int) -> torch.Tensor:
    digest = hashlib.sha256(f"shardwise-dataset:{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(size, generator=generator, device=HOST)  # batches are made on the host


def global_indices(seed: int, step: int, global_batch: int, size: int) -> list[int]:
    """Dataset indices of the global batch of ``step`` (epochs reshuffled, never repeated within one)."""
    start, out = step * global_batch, list[int]()
    while len(out) < global_batch:
        epoch, offset = divmod(start + len(out), size)
        take = min(global_batch - len(out), size - offset)
        out.extend(_permutation(seed, epoch, size)[offset : offset + take].tolist())
    return out


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a collated batch: a tensor, a tuple/list or a dict of tensors."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {k: slice_rows(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(slice_rows(v, start, stop) for v in batch)
    raise ConfigError(
        f"collated batches must be tensors, tuples or dicts of tensors; got {type(batch).__name__}"
    )


def check_rows(batch: Any, what: str = "a batch") -> int:
    """The number of rows of a collated batch, after checking that every tensor in it has that many
    (dim 0: one row per sample)."""
    found = list(_leaf_rows(batch, "batch"))
    if not found:
        raise ConfigError(f"{what} holds no tensor; batches are tensors, tuples or dicts of tensors")
    counts = {n for _, n in found}
    if None in counts:
        where = next(path for path, n in found if n is None)
        raise ConfigError(
            f"{what}: {where} is a 0-d tensor; every tensor of a batch needs a first dimension with "
            "one row per sample"
        )
    if len(counts) > 1:
        listed = ", ".join(f"{path} has {n}" for path, n in found)
        raise ConfigError(
            f"{what} has tensors with different numbers of rows (dim 0): {listed}; give every tensor "
            "of a batch one row per sample (inputs and targets of the same length)"
        )
    return int(found[0][1] or 0)


def _leaf_rows(batch: Any, path: str) -> Iterator[tuple[str, int | None]]:
    """(where, rows) of each tensor in a batch; rows None for a 0-d tensor."""
    if isinstance(batch, torch.Tensor):
        yield path, int(batch.size(0)) if batch.dim() else None
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _leaf_rows(value, f"{path}[{key!r}]")
    elif isinstance(batch, tuple | list):
        for i, value in enumerate(batch):
            yield from _leaf_rows(value, f"{path}[{i}]")
    else:
        raise ConfigError(
            f"{path} is a {type(batch).__name__}; batches must be tensors, tuples or dicts of tensors"
        )


class DatasetSampler:
    """This rank's micro-batches of a map-style dataset, step by step (see the module docstring)."""

    def __init__(
        self,
        dataset: MapDataset,
        global_batch: int,
        seed: int,
        counts: Sequence[int],
        rank: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if len(dataset) < 1:
            raise ConfigError("the dataset is empty: it needs at least one sample")
        if len(dataset) < global_batch:  # one step would draw some samples twice (two epochs' worth)
            raise ConfigError(
                f"the dataset has {len(dataset)} samples, fewer than data.global_batch ({global_batch}): "
                f"each step would hold some samples twice; set data.global_batch to at most {len(dataset)}"
            )
        if sum(counts) != global_batch:
            raise ConfigError(f"counts {list(counts)} must sum to global_batch({global_batch})")
        self.dataset, self.global_batch_size, self.seed = dataset, global_batch, seed
        self.counts, self.rank = list(counts), rank
        self.collate = collate_fn or default_collate
        self.start = sum(self.counts[:rank])
        self.step = 0
        self._empty: Any = None

    def local_indices(self, step: int) -> list[int]:
        every = global_indices(self.seed, step, self.global_batch_size, len(self.dataset))
        return every[self.start : self.start + self.counts[self.rank]]

    def local_micro_batches(self, step: int, n: int, keep_empty: bool = False) -> list[Any]:
        """This rank's share of step ``step``'s batch cut into ``n`` near-equal micro-batches.

        Empty pieces are dropped unless ``keep_empty``; then an empty piece is a zero-row batch of the
        dataset's own structure, so every rank runs the same number of passes (ZeRO-3 needs that).
        """
        if n < 1:
            raise ConfigError(f"micro-batches must be >= 1, got {n}")
        indices = self.local_indices(step)
        self.step = step + 1
        sizes = [len(indices) // n + (1 if i < len(indices) % n else 0) for i in range(n)]
        out, at = [], 0
        for size in sizes:
            if size:
                out.append(self.collate([self.dataset[i] for i in indices[at : at + size]]))
                check_rows(out[-1], "a collated batch")  # a collate_fn of the user's may disagree
            elif keep_empty:
                out.append(self._empty_batch())
            at += size
        return out

    def _empty_batch(self) -> Any:
        if self._empty is None:
            self._empty = slice_rows(self.collate([self.dataset[0]]), 0, 0)
        return self._empty

    def global_batch(self, step: int) -> Any:
        """The whole batch of ``step``, as one process would train on it."""
        every = global_indices(self.seed, step, self.global_batch_size, len(self.dataset))
        return self.collate([self.dataset[i] for i in every])

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "step": self.step,
            "global_batch": self.global_batch_size,
            "size": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, mine in (("global_batch", self.global_batch_size), ("size", len(self.dataset))):
            if key in state and state[key] != mine:
                raise ConfigError(
                    f"the saved data stream has {key}={state[key]} but this run has {mine}; "
                    "the batches after resuming would not continue the saved run"
                )
        self.seed = int(state["seed"])
        self.step = int(state["step"])


class IterableSampler:
    """This rank's own batches from a user's iterable (already this rank's share, already collated).

    Each step takes the next batch and cuts it into micro-batches by rows. Exact averaging still holds:
    the loss counts are summed over the ranks each step, whatever each rank's batch holds. Resuming at
    step k starts a fresh iterator and skips its first k batches, which continues the same stream when
    the iterable yields the same batches each time it is iterated (a deterministic loader).
    """

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = batches
        self.step = 0
        self._iterator: Iterator[Any] | None = None
        self._empty: Any = None

    def _next(self, step: int) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.batches)
            for _ in range(step):  # a resumed run: the batches before ``step`` were trained on
                next(self._iterator)
        try:
            batch = next(self._iterator)
        except StopIteration:
            raise ConfigError(f"the batches ran out at step {step}: give more, or lower steps") from None
        check_rows(batch, f"the batch of step {step}")
        self._empty = slice_rows(batch, 0, 0)
        return batch

    def local_micro_batches(self, step: int, n: int, keep_empty: bool = False) -> list[Any]:
        batch = self._next(step)
        self.step = step + 1
        total = rows_of(batch)
        sizes = [total // n + (1 if i < total % n else 0) for i in range(n)]
        out, at = [], 0
        for size in sizes:
            if size or keep_empty:
                out.append(slice_rows(batch, at, at + size))
            at += size
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "iterable": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self._iterator = None


def rows_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.size(0))
    if isinstance(batch, Mapping):
        return rows_of(next(iter(batch.values())))
    return rows_of(batch[0])
