"""Parameter-server checkpoints: each server writes and reads the parameters it serves.

Names follow ``Engine.state_pieces``. Server ``s`` writes ``model/<name>`` and ``optim/<key>/<name>``
for the parameters assigned to it (whole tensors: a server holds whole parameters), and element ``s``
of ``ps/version`` (one int64 per server: the updates it has applied); the first worker writes the
frozen parameters and the buffers (workers run the forward, so theirs are the live ones); the other
workers write nothing of the model. On load, a server reads its own parameters, their optimizer state
and its version (saved by as many servers; otherwise the highest, so staleness never goes backwards);
a worker reads the whole model (it computes with every parameter) and no optimizer state. With
``comm.compress`` every worker also writes and reads its push error feedback (``engine.codec_state``);
the pull residuals are not saved: on resume the servers' weights travel uncompressed, so the worker
copies equal them and pulls start afresh. No communication: every rank reads and writes files only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardwise.checkpoint.manager import Piece
from shardwise.compression import CodecState
from shardwise.device import HOST
from shardwise.engine.codec_state import codec_pieces, layout_of, read_codec_states, restore_codec_states
from shardwise.engine.full_state import load_named_state
from shardwise.engine.state import StateReader

if TYPE_CHECKING:
    from shardwise.data_parallel.param_server import ParamServerEngine


def _served(engine: ParamServerEngine) -> dict[str, torch.nn.Parameter]:
    names = engine.assignment[engine.comm.rank] if engine.is_server else []
    params = dict(engine.model.named_parameters())
    return {n: params[n] for n in names}


def _worker_tensors(engine: ParamServerEngine) -> dict[str, torch.Tensor]:
    """What the first worker writes: frozen parameters and buffers."""
    out = {f"model/{n}": p.detach() for n, p in engine.model.named_parameters() if not p.requires_grad}
    out.update({f"model/{n}": b.detach() for n, b in engine.model.named_buffers()})
    return out


VERSION = "ps/version"


def ps_state_pieces(engine: ParamServerEngine) -> list[Piece]:
    """This rank's pieces: its served parameters and their optimizer state, or (first worker) the rest."""
    if not engine.is_server:
        first_worker = engine.comm.rank == engine.workers[0]
        out = [Piece.full(n, t) for n, t in _worker_tensors(engine).items()] if first_worker else []
        return out + codec_pieces(_push_states(engine), _layout(engine), engine.comm.rank)
    served = _served(engine)
    out = [Piece.full(f"model/{n}", p.detach()) for n, p in served.items()]
    s, servers = engine.comm.rank, len(engine.servers)
    version = torch.tensor([engine.version], dtype=torch.int64, device=HOST)
    out.append(Piece(VERSION, (servers,), s, s + 1, version))
    for optimizer in engine.optimizers:
        for name, param in served.items():
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value):
                    out.append(Piece.full(f"optim/{key}/{name}", value.detach()))
    return out


def load_ps_state(engine: ParamServerEngine, read: StateReader) -> None:
    """A server reads what it serves (with optimizer state); a worker reads the whole model."""
    if engine.is_server:
        served = _served(engine)
        optimizer = engine.optimizers[0] if engine.optimizers else None
        versions = read({VERSION: None})[VERSION] if VERSION in read.shapes else None
        load_named_state({f"model/{n}": p for n, p in served.items()}, served, optimizer, read)
        if versions is not None:
            same = versions.numel() == len(engine.servers)
            engine.version = int(versions[engine.comm.rank] if same else versions.max())
        return
    local: dict[str, torch.Tensor] = {f"model/{n}": p for n, p in engine.model.named_parameters()}
    local.update({f"model/{n}": b for n, b in engine.model.named_buffers()})
    codec = read_codec_states(_push_states(engine), _layout(engine), engine.comm.rank, read)
    load_named_state(local, {}, None, read)
    restore_codec_states(_push_states(engine), codec)


def _push_states(engine: ParamServerEngine) -> list[CodecState]:
    """A worker's push error feedback, one per server (``comm.compress``; none without it)."""
    if engine.codec is None or engine.is_server:
        return []
    return [engine.codec.push_state(s) for s in engine.servers]


def _layout(engine: ParamServerEngine) -> str:
    return layout_of(engine.name, engine.comm, engine.codec.compressor if engine.codec else None)
