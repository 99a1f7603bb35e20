"""The run's observers around the loop: the hang watchdog, and the trace when ``--trace`` is on
(written every few seconds while the run goes, ``observe.trace.LiveTrace``, and once more at the end).

Communication: with tracing, one world barrier at the start (every rank's clock origin) and one at the
end (every rank's trace file written before rank 0 merges them); the watchdog talks only to the job's
store (``observe.watchdog``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from shardwise.observe.monitor import MONITOR
from shardwise.observe.trace import LiveTrace, merge, trace_blocks, write_rank
from shardwise.observe.watchdog import Watchdog


@contextmanager
def observing(trainer: Any, blocks: nn.ModuleList | nn.Sequential | None) -> Iterator[None]:
    """Watch for hangs and (``config.trace``) record spans while the body runs; ``blocks``: the
    model's block list, whose forward and backward become spans of their own."""
    config, world = trainer.config, trainer.world_comm
    MONITOR.tracing = config.trace
    if config.trace:
        MONITOR.spans.clear()
        world.barrier(label="trace clock")
    origin = time.monotonic()
    watchdog = None
    if config.hang_timeout_s != 0 and world.world_size > 1:
        store = dist.distributed_c10d._get_default_store()
        watchdog = Watchdog(store, world.rank, world.world_size, config.hang_timeout_s).start()
    handles = trace_blocks(blocks, MONITOR) if config.trace and blocks is not None else []
    run_dir = Path(config.run_dir)
    live = LiveTrace(run_dir, world.rank, world.world_size, MONITOR, origin).start() if config.trace else None
    completed = False
    try:
        yield
        completed = True
    finally:
        if live is not None:
            live.stop()
        if watchdog is not None:
            watchdog.stop()
        for handle in handles:
            handle.remove()
        MONITOR.set_phase("idle")
        if config.trace and completed:
            _write_trace(run_dir, world, origin)
        MONITOR.tracing = False


def _write_trace(run_dir: Path, world: Any, origin: float) -> None:
    write_rank(run_dir, world.rank, MONITOR, origin)
    world.barrier(label="trace files")
    if world.rank == 0:
        merge(run_dir, world.world_size)
