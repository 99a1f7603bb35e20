"""Each rank's initial values: one source, matched to the whole model, read only where the rank holds.

``parallelize`` opens the source before any split (``weight_source``): a ``WeightSource`` given by the
caller, the files of ``model.init_from`` (Hugging Face safetensors or a shardwise checkpoint, matched
by name and shape to the model as built), or, for a model with tensors on the meta device, its
recorded random initialisation (:mod:`shardwise.models.init_replay`). Tensor parallelism and the
pipeline split then run on the meta device, and ``held_weights`` gives the data-parallel engine this
rank's view (:class:`~shardwise.checkpoint.source.HeldWeights`: each tp shard as boxes of its global
tensor): DDP, the parameter server and DiLoCo read whole local tensors, ZeRO-1/2 read each bucket into
its flat buffer and ZeRO-3 its shards. No communication: every rank reads its own part.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardwise.checkpoint.pretrained import open_weights
from shardwise.checkpoint.source import META, HeldWeights, NoValues, WeightSource
from shardwise.config import TrainConfig
from shardwise.mesh import Mesh
from shardwise.models.init_replay import RandomInit, record_initialisation
from shardwise.pipeline.runtime import PipelineRunner
from shardwise.tensor_parallel import TensorParallelLayout


@contextmanager
def weight_source(
    model: nn.Module, mesh: Mesh, config: TrainConfig, given: WeightSource | None = None
) -> Iterator[WeightSource | None]:
    """Where the model's values come from, matched to the whole model before any split: ``given``,
    else the files of ``model.init_from`` (safetensors or a shardwise checkpoint), else, for a model
    with tensors on the meta device, its recorded initialisation (``models.init_replay``); None: the
    model keeps the values it was built with. Open while the ranks read their parts; its notes said
    once."""
    source: WeightSource
    if given is not None:
        source = given
    elif config.model.init_from:
        source = open_weights(config.model.init_from, model)
    else:  # a model passed in built keeps its values, even one build_model made
        meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        record = record_initialisation(model) if meta else None
        if record is None:
            yield None
            return
        source = RandomInit(record)
    try:
        if mesh.rank == 0:
            for note in source.notes():
                print(f"shardwise: {note}", file=sys.stderr, flush=True)
        yield source
    finally:
        source.close()


def held_weights(
    source: WeightSource,
    model: nn.Module,
    layout: TensorParallelLayout | None,
    runner: PipelineRunner | None,
    device: torch.device,
    overwrite: bool,
) -> HeldWeights:
    """What this rank reads of ``source``: its tensors as tp and the pipeline left them (each tp shard
    a set of boxes of its global tensor), and a pipeline's last-stage copy of a tied weight (read under
    its owner's name), materialised on ``device`` (a ``NoValues`` source: left on meta); the copy is
    filled here, the rest by the data-parallel engine."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    tied = runner.split.tied if runner is not None else None
    if tied is not None and tied.copy.is_meta:
        tensors.append((tied.owner_name, tied.copy))
    placements = {n: shard.placements for n, shard in layout.params.items()} if layout is not None else {}
    device = META if isinstance(source, NoValues) else device
    held = HeldWeights.of(source, tensors, placements, device, overwrite=overwrite)
    if tied is not None and tied.copy.is_meta:
        held.fill(tied.owner_name, tied.copy)
    return held
