"""Benchmark ZeRO stages 1-3 against PyTorch's own: tokens/s and peak memory per rank.

Counterparts: stage 1 = DDP + ``ZeroRedundancyOptimizer``; stage 2 = FSDP2 ``fully_shard`` with
``reshard_after_forward=False``; stage 3 = ``fully_shard`` with ``reshard_after_forward=True`` (each
block, then the root). Every run is a fresh spawn of ``nproc`` ranks, so peak RSS (``ru_maxrss``)
belongs to that run alone; ours and PyTorch's runs alternate and each figure is the median over
``repeats``. Communication is whatever each side does (ours through ``Comm``). Also reported: our
per-rank model-state bytes against :func:`shardwise.zero.memory.zero_formula`.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config import OptimizerConfig, ZeroConfig
from shardwise.device import HOST
from shardwise.engine.loss import loss_sum
from shardwise.engine.optim import attach_optimizers, optimizer_factory
from shardwise.testing.harness import run_on_ranks

TORCH_NAMES = {1: "ddp+ZeroRedundancyOptimizer", 2: "fsdp2(reshard=False)", 3: "fsdp2(reshard=True)"}


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, dim)
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class BenchGPT(nn.Module):
    """A plain GPT (wte, wpe, blocks, ln_f, head tied to wte) for the benchmark."""

    def __init__(self, vocab: int, dim: int, layers: int, seq_len: int, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def configurations(stage: int, bucket_mb: float) -> dict[str, str]:
    """How each side is configured for ``stage``, in words (recorded in the bench report)."""
    optim = "AdamW(lr=1e-4, foreach=False)"
    ours = f"zero{stage}, {optim}, fp32, gloo"
    if stage in (1, 2):
        ours += f", bucket_mb={bucket_mb}"
    else:
        ours += ", one unit per block + root (embeddings, final norm), prefetch"
    torch_side = {
        1: f"DistributedDataParallel(bucket_cap_mb={bucket_mb}) + ZeroRedundancyOptimizer({optim})",
        2: f"fully_shard(each block, then root; reshard_after_forward=False) + {optim}",
        3: f"fully_shard(each block, then root; reshard_after_forward=True) + {optim}",
    }[stage]
    return {"ours": ours, "torch": torch_side + ", fp32, gloo"}


def _torch_step_fn(model: nn.Module, stage: int, world_size: int, lr: float, bucket_mb: float = 25.0) -> Any:
    if stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)  # the same bucket size as ours
        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr, foreach=False
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3)
        fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)

    def step(x: torch.Tensor, y: torch.Tensor, global_tokens: int) -> None:
        loss = loss_sum(model(x), y) / global_tokens
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _return_freed_memory() -> None:
    """Make glibc serve buffers of 64 KiB and more with mmap, so freed tensors leave the RSS at once and
    peak RSS follows live tensors rather than heap fragmentation; applied to both sides alike."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # -3: M_MMAP_THRESHOLD


def _bench_rank(
    rank: int, world_size: int, impl: str, stage: int, shape: dict, steps: int, bucket_mb: float
) -> dict:
    from shardwise.collectives.api import Comm
    from shardwise.zero import build_zero_engine
    from shardwise.zero.memory import model_state_bytes, peak_rss_bytes, zero_formula

    _return_freed_memory()
    baseline = peak_rss_bytes()
    torch.manual_seed(0)
    model = BenchGPT(shape["vocab"], shape["dim"], shape["layers"], shape["seq_len"])
    psi = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(rank)
    size = (shape["batch"], shape["seq_len"] + 1)
    data = torch.randint(0, shape["vocab"], size, generator=gen, device=HOST)
    x, y = data[:, :-1], data[:, 1:]
    global_tokens = y.numel() * world_size
    out: dict[str, Any] = {"psi": psi}
    if impl == "ours":
        comm = Comm()
        factory = optimizer_factory(OptimizerConfig(name="adamw", lr=1e-4))
        engine = attach_optimizers(
            build_zero_engine(model, comm, stage, ZeroConfig(bucket_mb=bucket_mb)), factory
        )

        calls = [0]

        def step(x: torch.Tensor, y: torch.Tensor, global_tokens: int) -> None:
            engine.forward_backward([(x, y)], global_tokens)
            if calls[0] == 1:  # optimizer state exists from the first step on
                out["model_state"] = model_state_bytes(engine)
                out["formula"] = zero_formula(psi, stage, world_size, "fp32", 4, 2)
            engine.optimizer_step()
            calls[0] += 1

    else:
        step = _torch_step_fn(model, stage, world_size, lr=1e-4, bucket_mb=bucket_mb)
    times = []
    for _ in range(steps + 1):  # the first step (allocation, state creation) is not timed
        start = time.perf_counter()
        step(x, y, global_tokens)
        times.append(time.perf_counter() - start)
    out.update(step_s=statistics.median(times[1:]), peak_rss=peak_rss_bytes(), baseline_rss=baseline)
    return out


def _summarize(reps: list[list[dict]], tokens: int) -> dict:
    """Medians over repeats; a step takes as long as its slowest rank."""
    step_s = statistics.median(max(r["step_s"] for r in rep) for rep in reps)
    ranks = range(len(reps[0]))
    return {
        "tokens_per_s": tokens / step_s,
        "peak_rss_per_rank": [statistics.median(rep[r]["peak_rss"] for rep in reps) for r in ranks],
        "baseline_rss_per_rank": [statistics.median(rep[r]["baseline_rss"] for rep in reps) for r in ranks],
    }


def run_zero_bench(
    nproc: int,
    steps: int = 5,
    repeats: int = 3,
    stages: tuple[int, ...] = (1, 2, 3),
    shape: dict | None = None,
    bucket_mb: float = 4.0,
    timeout_s: float = 600.0,
) -> dict:
    """Per stage: tokens/s and peak RSS per rank for ours and PyTorch's, their ratios, and our
    model-state bytes beside the formula. ``speed_ratio`` > 1 and ``memory_ratio`` < 1 favour ours.
    ``bucket_mb`` sizes our gradient buckets (stages 1-2; about one block, as FSDP2 reduces per block)
    and DDP's (``bucket_cap_mb``) in stage 1's counterpart: the same knob gets the same value."""
    shape = shape or {"vocab": 8192, "dim": 384, "layers": 6, "seq_len": 64, "batch": 4}
    runs: dict[tuple[int, str], list[list[dict]]] = {}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for stage in stages:
            for impl in ("ours", "torch"):
                args = (impl, stage, shape, steps, bucket_mb)
                result = run_on_ranks(_bench_rank, nproc, *args, timeout_s=timeout_s)
                runs.setdefault((stage, impl), []).append(result)
    tokens = shape["batch"] * shape["seq_len"] * nproc
    report: dict[str, Any] = {"nproc": nproc, "steps": steps, "repeats": repeats, "shape": shape}
    report["bucket_mb"] = bucket_mb
    report["load_avg_1m"] = {"before": load_before[0], "after": os.getloadavg()[0]}  # timings are noisy
    report["stages"] = {}
    for stage in stages:
        entry: dict[str, Any] = {"torch_counterpart": TORCH_NAMES[stage]}
        entry["configured"] = configurations(stage, bucket_mb)
        for impl in ("ours", "torch"):
            entry[impl] = _summarize(runs[(stage, impl)], tokens)
        ours, theirs = entry["ours"], entry["torch"]
        entry["speed_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        entry["memory_ratio"] = max(ours["peak_rss_per_rank"]) / max(theirs["peak_rss_per_rank"])
        first = runs[(stage, "ours")][0]
        entry["psi"] = first[0]["psi"]
        entry["model_state_per_rank"] = [r["model_state"] for r in first]
        entry["formula_per_rank"] = first[0]["formula"]
        entry["model_state_vs_formula"] = [
            r["model_state"]["model_state"] / r["formula"]["model_state"] for r in first
        ]
        report["stages"][f"zero{stage}"] = entry
    return report


def _offload_rank(rank: int, world_size: int, stage: int, offload: str, folder: str, shape: dict) -> dict:
    from shardwise.collectives.api import Comm
    from shardwise.zero import build_zero_engine
    from shardwise.zero.memory import model_state_bytes, peak_rss_bytes

    _return_freed_memory()
    torch.manual_seed(0)
    model = BenchGPT(shape["vocab"], shape["dim"], shape["layers"], shape["seq_len"])
    factory = optimizer_factory(OptimizerConfig(name="adamw", lr=1e-4))
    config = ZeroConfig(offload=offload, offload_dir=folder)
    engine = attach_optimizers(build_zero_engine(model, Comm(), stage, config), factory)
    data = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq_len"] + 1), device=HOST)
    for _ in range(shape.get("steps", 2)):
        engine.forward_backward([(data[:, :-1], data[:, 1:])], data[:, 1:].numel() * world_size)
        state = model_state_bytes(engine)
        engine.optimizer_step()
    engine.close()
    return {
        "peak_rss": peak_rss_bytes(),
        "model_state": state,
        "psi": sum(p.numel() for p in model.parameters()),
    }


def run_offload_bench(nproc: int, stage: int, shape: dict | None = None, folder: str = "") -> dict:
    """Peak RSS per rank without offload and with disk offload (files under ``folder``, a temporary
    folder when empty), one fresh spawn each, on a GPT of about 100M parameters by default."""
    import tempfile

    shape = shape or {"vocab": 8192, "dim": 768, "layers": 14, "seq_len": 32, "batch": 1, "steps": 2}
    out: dict[str, Any] = {"nproc": nproc, "stage": stage, "shape": shape}
    with tempfile.TemporaryDirectory(prefix="shardwise-offload-", dir=folder or None) as root:
        for offload in ("none", "disk"):
            ranks = run_on_ranks(_offload_rank, nproc, stage, offload, root, shape, timeout_s=600)
            out[offload] = {
                "peak_rss_per_rank": [r["peak_rss"] for r in ranks],
                "model_state": ranks[0]["model_state"],
            }
            out["psi"] = ranks[0]["psi"]
    none, disk = max(out["none"]["peak_rss_per_rank"]), max(out["disk"]["peak_rss_per_rank"])
    out["peak_rss_drop_bytes"] = none - disk
    out["peak_rss_ratio"] = disk / none
    return out


def render_zero(result: dict) -> None:
    """A table per stage (or the offload comparison), for people; ``--json`` gives everything."""
    if "stages" not in result:
        print(f"ZeRO-{result['stage']} on {result['nproc']} ranks, {result['psi'] / 1e6:.1f}M parameters")
        for offload in ("none", "disk"):
            peaks = [round(p / 2**20) for p in result[offload]["peak_rss_per_rank"]]
            print(f"  offload {offload:5s} peak RSS per rank (MB): {peaks}")
        print(
            f"  disk offload lowers peak RSS by {result['peak_rss_drop_bytes'] / 2**20:.0f} MB "
            f"(x{result['peak_rss_ratio']:.2f})"
        )
        return
    print(f"ZeRO on {result['nproc']} ranks, model {result['shape']}, buckets {result['bucket_mb']} MB")
    for name, entry in result["stages"].items():
        print(
            f"  {name}  vs {entry['torch_counterpart']:45s} speed ratio {entry['speed_ratio']:.3f}  "
            f"memory ratio {entry['memory_ratio']:.3f}  model state / formula "
            f"{[round(x, 3) for x in entry['model_state_vs_formula']]}"
        )
