"""``shardwise plan --dry-run``: one rank of a job of up to 1,024 ranks, run here on no memory.

This process joins torch's fake process group (``fake``: every collective and send returns at once,
nothing moves) as one rank of the target world, builds the model on the meta device as training
does, and runs the real ``parallelize`` (tensor parallelism, the pipeline split, the data-parallel
engine) with a weights source that gives no values (``NoValues``), so every parameter, gradient,
optimizer state and flat buffer is a meta tensor: sizes without storage. Then one training step
(forward, backward, the gradient exchange, the update) and the next step's forward and backward on
meta batches, so that everything the rank keeps is alive at once (the optimizer's state appears at
its first update; ZeRO frees its gradient shards at each update). What the rank holds is counted by
storage (a view counts once) and by component, beside the planner's model-state components for the
same layout and the same pipeline rank (``planner.layout.model_states`` through ``estimate_ranks``).

The rank run is the first rank of the heaviest pipeline stage (the most parameters: its blocks and
the end it holds). Reads of values that do not exist (a loss, a norm, a
non-finite flag) are answered by ``MetaReads``: 0 for a number, True for a truth (finite), zeros for
a small copy to the host. Every tensor the library makes is on its parameters' or batch's device
(meta here: the engine's ``device``), or on the host for bookkeeping, which stays real. No real
communication.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.checkpoint.source import META, NoValues
from shardwise.config import ConfigError, TrainConfig
from shardwise.device import HOST
from shardwise.mesh import build_mesh
from shardwise.planner.layout import Layout, Training
from shardwise.planner.memory import estimate_ranks
from shardwise.planner.model import ModelShape

MAX_DEVICES = 1024
SMALL = 4096  # elements: a meta tensor this small copied to the host becomes zeros there
STATE_PARTS = ("params", "master_params", "grads", "optimizer_state")


class MetaReads(TorchFunctionMode):
    """Answers reads of meta tensors' values (module docstring)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if isinstance(target, torch.Tensor) and target.is_meta:
            if name == "__bool__":
                return True
            if name == "__float__" or (name == "item" and target.is_floating_point()):
                return 0.0
            if name in ("item", "__int__", "__index__"):
                return 0
            if name == "tolist":
                return torch.zeros(target.shape, device=HOST).tolist()
            if _to_host(name, args, kwargs) and target.numel() <= SMALL:
                given = [a for a in args if isinstance(a, torch.dtype)]
                dtype = kwargs.get("dtype") or (given[0] if given else target.dtype)
                return torch.zeros(target.shape, dtype=dtype, device=HOST)
        return func(*args, **kwargs)


def _to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name == "cpu":
        return True
    if name != "to":
        return False
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, str | torch.device) and torch.device(t).type == "cpu" for t in targets)


def join_fake_group(rank: int, world: int) -> None:
    """This process as rank ``rank`` of a fake group of ``world`` ranks (no communication at all)."""
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the "fake" backend

    if not 1 <= world <= MAX_DEVICES:
        raise ConfigError(f"--dry-run runs one rank of 1 to {MAX_DEVICES} devices; got --devices {world}")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)


def _unique_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` not seen yet (meta storages have sizes, not data)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def held_bytes(engine: Any) -> dict[str, int]:
    """What the rank holds, by component: parameters (ZeRO's compute buffers included, gathered ones
    empty), fp32 masters apart from them, gradients (and ZeRO's flat gradient buffers and shards),
    optimizer state, buffers. Each storage counted once, in that order."""
    seen: set[int] = set()
    params = list(engine.model.parameters())
    groups = getattr(engine, "groups", [])
    out = {
        "params": _unique_bytes([*params, *(g.full for g in groups)], seen),
        "master_params": _unique_bytes([g.master for g in groups], seen),
        "grads": _unique_bytes(
            [p.grad for p in params]
            + [t for g in groups for t in (g.flat_grad, g.grad_shard, g._incoming)],
            seen,
        ),
        "optimizer_state": _unique_bytes(_optimizer_tensors(engine), seen),
        "buffers": _unique_bytes(engine.model.buffers(), seen),
    }
    return out


def _optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    states = [state for opt in engine.optimizers for state in opt.state.values()]
    return [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]


def heaviest_rank(model: nn.Module, config: TrainConfig, world: int) -> int:
    """The first rank (dp 0, tp 0) of the pipeline rank whose stages hold the most parameters."""
    parallel = config.parallel
    if parallel.pp == 1:
        return 0
    from shardwise.models.adapters import pipeline_adapter
    from shardwise.pipeline.schedules import stage_placement
    from shardwise.pipeline.split import end_size, plan_stages

    adapter = pipeline_adapter(model)
    stages = parallel.pp * parallel.stages_per_rank
    assignment = plan_stages(model, stages, parallel.pp_split)
    blocks = list(adapter.blocks())
    per_stage = [float(sum(p.numel() for i in run for p in blocks[i].parameters())) for run in assignment]
    per_stage[0] += end_size(model, adapter.first_modules)
    per_stage[-1] += end_size(model, adapter.last_modules)
    placement = stage_placement(parallel.schedule, parallel.pp, parallel.stages_per_rank)
    per_rank = [sum(n for s, n in enumerate(per_stage) if placement[s] == r) for r in range(parallel.pp)]
    pp_rank = max(range(parallel.pp), key=lambda r: (per_rank[r], -r))
    return pp_rank * parallel.tp


def dry_run(
    config: TrainConfig, world: int, make: Callable[[], nn.Module], shape: ModelShape, layout: Layout
) -> dict[str, Any]:
    """Run one rank of ``layout`` on ``world`` fake ranks (see the module docstring) and compare what it
    holds with the planner's model state for the same layout."""
    begun = time.perf_counter()
    torch.manual_seed(config.seed)
    model = make()  # on meta, as training builds it
    rank = heaviest_rank(model, config, world)
    join_fake_group(rank, world)
    try:
        config = config.validate(world)
        mesh = build_mesh(config)
        from shardwise.parallelism import parallelize

        names = [n for n, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
        with MetaReads():
            engine = parallelize(model, mesh, config, weights=NoValues(names))
            batches = _meta_batches(config, shape.vocab, mesh.dims.dp)
            count = float(engine.global_count(batches))
            engine.forward_backward(batches, count)
            engine.optimizer_step()  # the optimizer's state appears at its first update (no values on
            # meta to agree are finite: the step's non-finite agreement is not run)
            engine.forward_backward(batches, count)  # gradients again
        held = held_bytes(engine)
    finally:
        dist.destroy_process_group()
    training = Training(config.data.global_batch, config.model.seq_len, config.precision, config.optim.name)
    # the planner's estimate for the rank run here (its pipeline rank's share), not for its worst rank
    planned = estimate_ranks(shape, training, layout)[rank // config.parallel.tp].device
    planner = {part: planned.get(part, 0.0) for part in STATE_PARTS}
    planner["grads"] += planned.get("grad_shard", 0.0)  # ZeRO-1's fp32 slice beside its full gradients
    state = sum(held[part] for part in STATE_PARTS)
    return {
        "layout": layout.name(),
        "devices": world,
        "rank": rank,
        "model": shape.describe(),
        "held_bytes": held,
        "held_model_state_bytes": state,
        "planner_model_state": planner,
        "planner_model_state_bytes": sum(planner.values()),
        "ratio": state / sum(planner.values()) if sum(planner.values()) else math.nan,
        "seconds": time.perf_counter() - begun,
    }


def _meta_batches(config: TrainConfig, vocab: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of token ids, on meta: (inputs, targets) of the configured length."""
    micro = config.data.micro_batches
    rows = config.data.global_batch // (dp * micro)
    if rows < 1:
        raise ConfigError(
            f"--global-batch {config.data.global_batch} is less than dp({dp}) x micro-batches({micro}); "
            "raise it so that every rank gets a sequence"
        )
    ids = torch.empty((rows, config.model.seq_len + 1), dtype=torch.int64, device=META)
    return [(ids[:, :-1], ids[:, 1:]) for _ in range(micro)]
