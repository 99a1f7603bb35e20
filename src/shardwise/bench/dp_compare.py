"""``bench dp-compare``: single-process DP, parameter server and all-reduce DP on one model and batch.

Each row reports the mean step time, the exchanges (communication calls) per step and the bytes sent and
received per step by every rank, measured by ``Comm`` (single-process DP: by the engine's own copy count),
beside what theory says for a model of M bytes:

- parameter server, one server and W workers: each worker sends M (gradient) and receives M (weights);
  the server receives W x M and sends W x M: it moves the weights twice per worker.
- ring all-reduce over n ranks: each rank sends and receives 2(n-1)/n x M. Comm counts native gloo calls
  with that ring formula (an estimate, see collectives.api), so this row checks the accounting, not gloo.
- single-process DP over n replicas: replicate (n-1) x M, reduce (n-1) x M, plus the scattered batch and
  the gathered outputs, all through device 0 in one process.

The model is a tiny next-token model defined here until the lead switches the bench to shardwise.models.
Step times on a shared CPU are noisy; read them as orders of magnitude.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from shardwise.collectives.api import Comm, CommStats
from shardwise.config import OptimizerConfig, PSConfig
from shardwise.data_parallel.param_server import ParamServerEngine
from shardwise.data_parallel.single_process import SingleProcessDPEngine
from shardwise.device import HOST
from shardwise.engine.base import Batch
from shardwise.engine.optim import attach_optimizers, optimizer_factory
from shardwise.testing.harness import run_on_ranks

OPTIM = OptimizerConfig(name="sgd", lr=0.1, momentum=0.0)


class TinyLM(nn.Module):
    """Embedding -> tanh(linear) -> vocabulary logits at every position."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> (batch, seq, vocab)
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def tiny_model(vocab: int, dim: int, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(vocab, dim)


def markov_batches(vocab: int, batch: int, seq_len: int, count: int, seed: int) -> list[Batch]:
    """Sequences from a fixed, peaked Markov chain (learnable; loss floor above zero)."""
    chain = torch.Generator().manual_seed(1234)
    transition = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=chain, device=HOST), dim=1)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.long, device=HOST)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen, device=HOST)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(transition[tokens[:, t]], 1, generator=gen).squeeze(1)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def share(batch: Batch, part: int, parts: int) -> Batch:
    """This rank's rows of ``batch`` (contiguous, as even as possible)."""
    inputs, targets = batch
    rows = torch.arange(inputs.size(0), device=inputs.device).tensor_split(parts)[part]
    return inputs[rows], targets[rows]


def _per_step(stats: list[CommStats]) -> dict[str, float]:
    n = max(len(stats), 1)
    return {
        "exchanges": sum(s.calls for s in stats) / n,
        "bytes_sent": sum(s.bytes_sent for s in stats) / n,
        "bytes_received": sum(s.bytes_received for s in stats) / n,
    }


def drive_ps(engine: ParamServerEngine, batches: list[Batch], rank: int, world_size: int) -> None:
    """Run one rank of a one-server job: the server serves, each worker trains on its share."""
    if engine.is_server:
        engine.serve()
        return
    for batch in batches:
        engine.forward_backward([share(batch, rank - 1, world_size - 1)], batch[1].numel())
        engine.optimizer_step()


def _ps_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    model = tiny_model(spec["vocab"], spec["dim"])
    engine = ParamServerEngine(model, Comm(), PSConfig(servers=1), spec["steps"])
    attach_optimizers(engine, optimizer_factory(OPTIM))
    batches = markov_batches(spec["vocab"], spec["batch"], spec["seq_len"], spec["steps"], seed=5)
    start = time.perf_counter()
    drive_ps(engine, batches, rank, world_size)
    elapsed = (time.perf_counter() - start) / spec["steps"]
    return {
        "role": "server" if engine.is_server else "worker",
        "step_s": elapsed,
        **_per_step(engine.step_comm),
    }


def _allreduce_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Our all-reduce DP engine (buckets overlapped with backward) on the same model and batches."""
    from shardwise.config import DDPConfig
    from shardwise.data_parallel.ddp import DDPEngine

    comm = Comm()
    engine = DDPEngine(tiny_model(spec["vocab"], spec["dim"]), comm, DDPConfig())
    attach_optimizers(engine, optimizer_factory(OPTIM))
    batches = markov_batches(spec["vocab"], spec["batch"], spec["seq_len"], spec["steps"], seed=5)
    stats, start = [], time.perf_counter()
    for batch in batches:
        before = comm.stats.snapshot()
        engine.forward_backward([share(batch, rank, world_size)], batch[1].numel())
        stats.append(comm.stats.since(before))
        engine.optimizer_step()
    engine.close()
    return {"role": "rank", "step_s": (time.perf_counter() - start) / spec["steps"], **_per_step(stats)}


def _single_process(nproc: int, spec: dict[str, Any]) -> dict[str, Any]:
    model = tiny_model(spec["vocab"], spec["dim"])
    engine = attach_optimizers(SingleProcessDPEngine(model, nproc), optimizer_factory(OPTIM))
    batches = markov_batches(spec["vocab"], spec["batch"], spec["seq_len"], spec["steps"], seed=5)
    copies, moved, start = 0, 0, time.perf_counter()
    for batch in batches:
        engine.forward_backward([batch], batch[1].numel())
        copies, moved = copies + engine.copies, moved + engine.bytes_copied
        engine.optimizer_step()
    steps = spec["steps"]
    return {"role": "process", "step_s": (time.perf_counter() - start) / steps, "exchanges": copies / steps,
            "bytes_sent": moved / steps, "bytes_received": moved / steps}  # fmt: skip


def _row(strategy: str, ranks: list[dict[str, Any]], theory: list[float], note: str) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "step_time_s": max(r["step_s"] for r in ranks),
        "exchanges_per_step": [r["exchanges"] for r in ranks],
        "roles": [r["role"] for r in ranks],
        "bytes_sent_per_step": [r["bytes_sent"] for r in ranks],
        "bytes_received_per_step": [r["bytes_received"] for r in ranks],
        "theory_bytes_sent_per_step": theory,
        "theory": note,
    }


def run_dp_compare(
    nproc: int,
    steps: int = 5,
    global_batch: int = 16,
    seq_len: int = 16,
    vocab: int = 64,
    dim: int = 64,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """The three data-parallel designs on the same model and global batch; a JSON-ready dict."""
    if nproc < 2:
        raise ValueError(f"dp-compare needs at least 2 processes (one server and one worker), got {nproc}")
    spec = {"steps": steps, "batch": global_batch, "seq_len": seq_len, "vocab": vocab, "dim": dim}
    m = float(sum(p.numel() * p.element_size() for p in tiny_model(vocab, dim).parameters()))
    workers, n = nproc - 1, nproc
    batch_bytes = global_batch * seq_len * 8 + global_batch * seq_len * vocab * 4  # tokens in, logits out
    single = _single_process(nproc, spec)
    ps = run_on_ranks(_ps_rank, nproc, spec, timeout_s=timeout_s)
    ring = run_on_ranks(_allreduce_rank, nproc, spec, timeout_s=timeout_s)
    return {
        "nproc": nproc,
        "steps": steps,
        "global_batch": global_batch,
        "model_bytes": int(m),
        "rows": [
            _row(
                "single_process",
                [single],
                [2 * (n - 1) * m + batch_bytes],
                f"replicate (n-1)M + reduce (n-1)M + batch scatter/gather ({n} replicas, one process)",
            ),
            _row(
                "parameter_server",
                ps,
                [workers * m] + [m] * workers,
                f"server sends and receives W*M (W={workers}); each worker sends M and receives M",
            ),
            _row(
                "allreduce",
                ring,
                [2 * (n - 1) / n * m] * n,
                "ring all-reduce: 2(n-1)/n * M per rank (gloo's bytes estimated by that formula)",
            ),
        ],
    }


def render_compare(result: dict[str, Any]) -> None:
    """One line per strategy and rank: bytes sent per step beside theory, exchanges, step time."""
    print(f"data-parallel designs on {result['nproc']} processes, model {result['model_bytes']:,} bytes")
    for row in result["rows"]:
        print(f"  {row['strategy']:16s} step {row['step_time_s'] * 1e3:8.2f} ms   ({row['theory']})")
        for i, (sent, theory) in enumerate(
            zip(row["bytes_sent_per_step"], row["theory_bytes_sent_per_step"], strict=True)
        ):
            print(
                f"    {row['roles'][i]:8s} sent {sent:>12,.0f} B/step   theory {theory:>12,.0f}   "
                f"exchanges {row['exchanges_per_step'][i]}"
            )
