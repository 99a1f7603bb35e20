"""The tp axis: the model's layers cut over it (step 1 of ``parallelize``), then joined to the
data-parallel engine over the shards, so that the engine answers for whole tensors.

``TensorParallelAxis.apply`` cuts the model by its adapter's plan (``tensor_parallel.plans``); the
config's refusals are ``check_tensor_parallel``; ``loss`` makes the engine's loss vocab-parallel.
After that a rank's parameters are local shards (boxes of the global tensors, in
the layout's records) or whole copies every tp rank holds (norms, row-layer biases). The engine over
the dp axis (DDP, ZeRO-1/2/3) knows only the local tensors. ``TensorParallelAxis`` (``engine/axis.py``)
widens, over the tp axis, what is global by contract (``engine/base.py``):

- after the gradient exchange: under sequence parallelism, one all-reduce over tp of the gradients of
  the parameters replicated inside the sequence-cut region (Korthikanti et al., 2022);
- the norm: a replicated parameter's squares (``held_grads``) taken out of every tp rank's share but
  the first's, so each element counts once over tp;
- full tensors: each sharded tensor assembled at its global shape on every tp rank (its box written
  into zeros, one all-reduce over tp; boxes are disjoint, so the sum is exact);
- checkpoints: the engine spreads its tensors over its dp group; each sharded tensor (a parameter and
  its optimizer state) is written as the boxes of its placements; replicated tensors, scalars and
  buffers by the first tp rank only; loading, the engine's requests for whole local tensors become box
  reads of the global ones (``BoxReader``);
- its own state: the RNG tracker's states (the split regions' dropout streams, ``tensor_parallel.random``)
  go into checkpoints as ``rng/<state>/rank<r>``, per global rank beside torch's own generator
  (``checkpoint.rng``), and are loaded back, as Megatron's checkpoints keep its tracker's states:
  without them a resumed run would draw the split regions' masks from the seed again and part from the
  uninterrupted run;
- the loss: every tp rank computes the same loss, so only the first reports it.

Communication: per step, the sequence-parallel sum; the norm's share joins the engine's one all-reduce;
the full model (verify, the end of a run) costs one all-reduce per sharded tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from shardwise.checkpoint.boxes import Box, flat_segments, intersect
from shardwise.checkpoint.manager import Piece
from shardwise.checkpoint.rng import torch_rng_name
from shardwise.collectives.api import Comm
from shardwise.config import TrainConfig
from shardwise.engine.axis import Axis
from shardwise.engine.base import Engine
from shardwise.engine.loss import AutoLoss, CausalLMLoss, Loss, TokenLoss
from shardwise.engine.state import Span, StateReader
from shardwise.engine.update import sq_sum
from shardwise.errors import ConfigError, NotBuiltError
from shardwise.mesh import Mesh
from shardwise.models.adapters import adapter_for
from shardwise.tensor_parallel.layers import VocabParallelCausalLMLoss, VocabParallelTokenLoss
from shardwise.tensor_parallel.plans import TensorParallelLayout, apply_tensor_parallel
from shardwise.tensor_parallel.random import RNGStatesTracker
from shardwise.tensor_parallel.shards import Placement, ShardedParam

TENSOR_PARALLEL_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")  # data-parallel engines over tp shards


class TensorParallelAxis(Axis):
    """The tp axis: ``apply`` cuts the model's layers by its plan, then the engine asks it (above)."""

    name = "tp"

    def __init__(self, mesh: Mesh, config: TrainConfig) -> None:
        check_tensor_parallel(config)
        self.mesh, self.parallel, self.seed = mesh, config.parallel, config.seed
        self.layout: TensorParallelLayout | None = None

    @property
    def active(self) -> bool:
        return self.layout is not None

    @property
    def tracker(self) -> RNGStatesTracker | None:
        """The split regions' dropout streams (activation checkpointing replays them), if any."""
        return self.layout.tracker if self.layout is not None else None

    def apply(self, model: nn.Module, device: torch.device | None = None) -> None:
        """Step 1 of ``parallelize``: cut the model's layers over tp by its adapter's plan (a model
        with none, or a subclass overriding its family's forward, is refused by name): parameters
        become local shards, each knowing its global name, shape and box (on ``device``: where a
        model on meta gets the shards' extra buffers). Nothing at tp 1."""
        if self.parallel.tp == 1 or not self.mesh.in_mesh:
            return
        plan = adapter_for(model).tp_plan()
        try:
            layout = apply_tensor_parallel(
                model, self.mesh.comm("tp"), plan, sequence_parallel=self.parallel.sequence_parallel,
                seed=self.seed, device=device,
            )  # fmt: skip
        except ValueError as exc:  # a width tp does not divide: the arithmetic, in one line
            raise ConfigError(f"tensor parallelism: {exc}") from None
        self.layout, self.comm, self.streams = layout, layout.comm, layout.tracker
        self.sharded = {n: s for n, s in layout.params.items() if not s.replicated}
        self.replicated = {n for n in layout.params if n not in self.sharded}
        self.sequence_parallel = set(layout.sequence_parallel_params)
        self.rank = self.mesh.rank  # global: it names this rank's dropout streams in checkpoints

    def loss(self, loss: Loss) -> Loss:
        """The engine's loss over this rank's vocab-cut logits (``tensor_parallel_loss``); as is
        without tp."""
        return tensor_parallel_loss(loss, self.comm) if self.active else loss

    def after_grads(self, engine: Engine) -> None:
        if self.sequence_parallel:
            sum_over(self.comm, engine.held_grads(self.sequence_parallel))

    def norm_share(self, engine: Engine, share: torch.Tensor) -> torch.Tensor:
        if self.comm.rank == 0:  # a replicated parameter counts once, on the first tp rank
            return share
        return share - sq_sum(engine.held_grads(self.replicated), share.device)

    @property
    def reports_loss(self) -> bool:
        return self.comm.rank == 0

    def assemble(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return assemble_all(self.comm, self.sharded, tensors)

    def pieces(self, pieces: list[Piece]) -> list[Piece]:
        return tp_pieces(self.comm.rank, self.sharded, pieces)

    def reader(self, read: StateReader) -> StateReader:
        return BoxReader(read, self.sharded)

    def own_pieces(self) -> list[Piece]:
        states = self.streams.get_states()
        return [Piece.full(torch_rng_name(self.rank, name), state) for name, state in states.items()]

    def read_own(self, read: StateReader) -> Callable[[], None]:
        """The tracker's states when the checkpoint has them (one from a run without tensor
        parallelism leaves the tracker as seeded)."""
        names = {torch_rng_name(self.rank, name): name for name in self.streams.states}
        present = [key for key in names if key in read.shapes]
        saved = read(dict.fromkeys(present)) if present else {}

        def put() -> None:
            states = self.streams.get_states()
            states.update({names[key]: tensor.to(torch.uint8) for key, tensor in saved.items()})
            self.streams.set_states(states)

        return put


def tensor_parallel_loss(loss: Loss, comm: Comm) -> Loss:
    """The built-in losses over vocab-cut logits (no rank gathers the full logits), the default one
    (``AutoLoss``) included; a user's own loss would see a tp-th of the vocabulary, so it is refused."""
    if type(loss) is TokenLoss:
        return VocabParallelTokenLoss(comm, loss.positions)
    if type(loss) is CausalLMLoss:
        return VocabParallelCausalLMLoss(comm, loss.ignore_index)
    if type(loss) is AutoLoss:
        causal = VocabParallelCausalLMLoss(comm, loss.ignore_index)
        return loss.over(causal=causal, tokens=VocabParallelTokenLoss(comm))
    raise ConfigError(
        f"with tensor parallelism the logits are cut by vocabulary, so a loss of your own "
        f"({type(loss).__name__}) would see a tp-th of them; leave loss unset (the default), pass "
        "sw.CausalLMLoss() or sw.TokenLoss(), or set parallel.tp = 1"
    )


def check_tensor_parallel(config: TrainConfig) -> None:
    """What tensor parallelism refuses in the config alone (one line each)."""
    parallel = config.parallel
    if parallel.tp == 1:
        if parallel.sequence_parallel:
            raise ConfigError(
                "parallel.sequence_parallel needs tensor parallelism: set parallel.tp > 1 (--tp)"
            )
        return
    if config.strategy not in TENSOR_PARALLEL_STRATEGIES:
        raise NotBuiltError(
            f"--strategy {config.strategy} with tensor parallelism (parallel.tp = {parallel.tp}) is not "
            f"built yet; use {' or '.join(TENSOR_PARALLEL_STRATEGIES)} on the dp axis, or set parallel.tp = 1"
        )
    if parallel.pp != 1 and parallel.sequence_parallel:
        raise NotBuiltError(
            f"sequence parallelism with a pipeline (pp {parallel.pp}) is not built yet (stages would pass "
            "a tp-th of the sequence); drop --sequence-parallel or set parallel.pp = 1"
        )
    if config.comm.compress:
        raise NotBuiltError(
            f"gradient compression (--compress {config.comm.compress}) with tensor parallelism is not "
            "built yet (each tp rank's error feedback would need its own checkpoint slot); drop one"
        )
    if parallel.sequence_parallel and config.model.seq_len % parallel.tp:
        raise ConfigError(
            f"sequence parallelism cuts the sequence over tp: seq_len {config.model.seq_len} is not "
            f"divisible by tp {parallel.tp}"
        )


def sum_over(comm: Comm, tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` over ``comm`` in one all-reduce, written back in place (under sequence
    parallelism each tp rank's gradient of a norm saw a tp-th of the positions)."""
    if not tensors or comm.world_size == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, label="sequence-parallel grads")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def assemble_all(
    tp: Comm, sharded: Mapping[str, ShardedParam], local: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``local`` with every sharded tensor at its global shape (the same on every tp rank)."""
    out = dict(local)
    for name, record in sharded.items():
        if name not in local:
            continue
        full = local[name].new_zeros(record.global_shape)
        record.put(local[name], full)
        tp.all_reduce(full, label="tp gather")
        out[name] = full
    return out


def _param_of(piece_name: str) -> str | None:
    """The parameter a checkpoint tensor belongs to: ``model/<p>`` or ``optim/<key>/<p>``."""
    kind, _, rest = piece_name.partition("/")
    if kind == "model":
        return rest
    if kind == "optim":
        return rest.partition("/")[2]
    return None


def tp_pieces(tp_rank: int, sharded: Mapping[str, ShardedParam], pieces: list[Piece]) -> list[Piece]:
    """The engine's pieces of local tensors (whole, or a flat range: ZeRO's shard) as boxes of the
    global tensors.

    A sharded parameter's tensors (its value and each optimizer state of its shape) become boxes: the
    flat range cut into row-major boxes (``flat_segments``), each intersected with every placement and
    moved to the global tensor's coordinates. Everything else (replicated parameters, step counts,
    buffers, engine state) is written by the first tp rank only, so every element is written once.
    """
    out = []
    for piece in pieces:
        record = sharded.get(_param_of(piece.name) or "")
        if record is None or piece.global_shape != record.local_shape:
            if tp_rank == 0:
                out.append(piece)
            continue
        if piece.box is not None or piece.start is None or piece.stop is None:
            raise RuntimeError(f"{piece.name}: a tensor-parallel shard is written as a flat range")
        flat = piece.tensor.reshape(-1)
        for local_box, at in flat_segments(record.local_shape, piece.start, piece.stop):
            values = flat[at : at + local_box.volume].reshape(local_box.lengths)
            for placement in record.placements:
                for local_part, global_part in _moved(local_box, placement):
                    part = values[_index(_relative(local_part, local_box))]
                    box = Piece.from_box(piece.name, record.global_shape, global_part.offsets, part.clone())
                    out.append(box)
    return out


def _moved(local_box: Box, placement: Placement) -> list[tuple[Box, Box]]:
    """The part of ``local_box`` a placement holds, and where it sits in the global tensor."""
    common = intersect(local_box, placement.local_box)
    if common is None:
        return []
    shift = [g - lo for g, lo in zip(placement.global_box.offsets, placement.local_box.offsets, strict=True)]
    moved = Box(tuple(o + d for o, d in zip(common.offsets, shift, strict=True)), common.lengths)
    return [(common, moved)]


def _relative(inner: Box, outer: Box) -> Box:
    return Box(tuple(i - o for i, o in zip(inner.offsets, outer.offsets, strict=True)), inner.lengths)


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


class BoxReader:
    """A checkpoint reader that shows the engine its local shapes and reads their boxes."""

    def __init__(self, read: StateReader, sharded: Mapping[str, ShardedParam]) -> None:
        self._read, self._sharded = read, sharded

    def _record(self, name: str, shape: tuple[int, ...]) -> ShardedParam | None:
        record = self._sharded.get(_param_of(name) or "")
        return record if record is not None and shape == record.global_shape else None

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        shapes = dict(self._read.shapes)
        for name, shape in shapes.items():
            if (record := self._record(name, shape)) is not None:
                shapes[name] = record.local_shape
        return shapes

    def __call__(self, requests: Mapping[str, Span]) -> dict[str, torch.Tensor]:
        global_shapes = self._read.shapes
        plain = {n: s for n, s in requests.items() if self._record(n, global_shapes.get(n, ())) is None}
        out = self._read(plain)
        for name in requests.keys() - plain.keys():
            record = self._record(name, global_shapes[name])
            assert record is not None
            out[name] = self._local(name, record, requests[name])
        return out

    def _local(self, name: str, record: ShardedParam, span: Span) -> torch.Tensor:
        """The local tensor (span None) or a flat range ``(a, b)`` of it, read box by box."""
        if isinstance(span, Box):
            raise RuntimeError(f"{name}: a tensor-parallel shard is read whole or as a flat range")
        start, stop = span if span is not None else (0, math.prod(record.local_shape))
        pieces: list[torch.Tensor] = []
        for local_box, _ in flat_segments(record.local_shape, start, stop):
            block: torch.Tensor | None = None
            for placement in record.placements:
                for local_part, global_part in _moved(local_box, placement):
                    part = self._read({name: global_part})[name].reshape(global_part.lengths)
                    if block is None:
                        block = part.new_empty(local_box.lengths)
                    block[_index(_relative(local_part, local_box))] = part
            assert block is not None
            pieces.append(block.reshape(-1))
        flat = torch.cat(pieces)
        return flat if span is not None else flat.reshape(record.local_shape)
