"""Benchmark our tensor parallelism against DTensor's ``parallelize_module``: tokens/s, tensor bytes, and
the collectives each transformer block costs.

Both sides train the same built-in GPT (``models/gpt.py``, untied head, dropout 0, fp32) on ``nproc``
ranks of one tp axis over gloo: forward, backward and AdamW, the same token batch on every tp rank.
Ours: ``parallelize`` with ``parallel.tp = nproc`` (``gpt_plan``: Megatron's column/row layers, the
fused ``qkv`` cut head-wise, vocab-parallel embedding, head and cross-entropy; Shoeybi et al., 2019;
with ``--sequence-parallel`` Korthikanti et al., 2022). Theirs: ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` (embedding rowwise, head colwise into ``loss_parallel``) and,
in the sequence-parallel rows, ``SequenceParallel`` norms and ``PrepareModuleInput`` gathers, as
torchtitan does.

DTensor cannot cut a fused q/k/v projection head-wise: ``ColwiseParallel`` gives each rank one
contiguous block of the output rows (``Shard(0)``), which for ``qkv`` is all of q and part of k on rank
0, not its heads' q, k and v. So DTensor's side runs a copy of the model whose attention has separate
``q``, ``k``, ``v`` projections holding the very rows of ``qkv`` (same values, same arithmetic, one
matmul split in three), the closest honest equivalent; the head is untied on both sides because
DTensor would distribute a tied matrix twice.

Each measurement is a fresh spawn of ``nproc`` ranks; ours and DTensor's runs alternate and figures
are medians over ``repeats``. Peak memory is tensor bytes (``TensorBytes``: live floating-point
storages from building the model through two steps; DTensor's local shards counted), not RSS.
Collectives per block come from our tp ``Comm``'s ``CommStats`` over one step of the model less the
same step of a one-block copy, divided by the blocks between them, so the embedding, head, loss and
per-step all-reduces cancel; beside it, Megatron's count: 4 all-reduces of ``b*s*h`` per block (2
forward, 2 backward) without sequence parallelism, 4 all-gathers and 4 reduce-scatters with it, the
same bytes either way.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from shardwise.device import HOST
from shardwise.models import GPT_KIND, PRESETS
from shardwise.models.adapters import BlockList, adapter_for
from shardwise.testing.harness import run_on_ranks
from shardwise.testing.memory import TensorBytes

ROWS = {"tp": False, "tp+sp": True}  # row label -> sequence parallelism
MEMORY_STEPS = 2  # optimizer state exists from the first step on; the second is steady


def megatron_per_block(
    sequence_parallel: bool, tokens: int, hidden: int, tp: int, elem_bytes: int = 4
) -> dict:
    """Megatron's collectives per transformer block per training step, and the bytes each rank sends
    (``Comm``'s accounting for gloo's native collectives: an all-reduce of S sends 2(n-1)/n S, an
    all-gather or reduce-scatter of S in total (n-1)/n S). ``tokens``: batch x sequence on one tp rank.

    With sequence parallelism the block's replicated parameters (two norms' weights and biases, the two
    row layers' biases: 6 x hidden values) get partial gradients, summed over tp after backward in one
    all-reduce per step for all blocks (Megatron's ``finalize_model_grads``): no op per block, but its
    bytes grow with each block, so they are counted here beside the activations'."""
    size = tokens * hidden * elem_bytes  # one activation, b*s*h
    if sequence_parallel:  # f and g become all-gather / reduce-scatter pairs: 2 + 2 forward, 2 + 2 backward
        ops = {"all_gather": 4, "reduce_scatter": 4}
        activations = 8 * (tp - 1) * size // tp
        grads = 2 * (tp - 1) * 6 * hidden * elem_bytes // tp
    else:  # 2 all-reduces forward (after attn.proj, mlp.proj), 2 backward (before qkv, mlp.fc)
        ops = {"all_reduce": 4}
        activations, grads = 4 * 2 * (tp - 1) * size // tp, 0
    return {
        "ops": ops,
        "activation_bytes_sent": activations,
        "sequence_parallel_grad_bytes_sent": grads,
        "bytes_sent": activations + grads,
    }


def per_block(full: dict, fewer: dict, blocks_full: int, blocks_fewer: int) -> dict:
    """Ops and bytes of one block: (a step of ``blocks_full`` blocks less one of ``blocks_fewer``) over
    the blocks between them; what lies outside the blocks cancels."""
    between = blocks_full - blocks_fewer
    if between < 1:
        raise ValueError(
            f"need more blocks in the full model ({blocks_full}) than the fewer ({blocks_fewer})"
        )
    names = sorted(set(full["ops"]) | set(fewer["ops"]))
    ops = {op: (full["ops"].get(op, 0) - fewer["ops"].get(op, 0)) / between for op in names}
    ops = {op: int(n) if float(n).is_integer() else n for op, n in ops.items() if n}
    sent = (full["bytes_sent"] - fewer["bytes_sent"]) / between
    return {"ops": ops, "bytes_sent": int(sent) if float(sent).is_integer() else sent}


def collectives_entry(measured: dict, megatron: dict) -> dict:
    """Measured per block beside Megatron's, and whether ops and bytes both match."""
    same = measured["ops"] == megatron["ops"] and measured["bytes_sent"] == megatron["bytes_sent"]
    return {"measured": measured, "megatron": megatron, "matches_megatron": same}


def ratios(ours: dict, theirs: dict) -> dict:
    """``speed_ratio`` (ours / DTensor tokens/s; > 1 favours ours) and ``memory_ratio`` (ours / DTensor
    peak tensor bytes of the fullest rank; < 1 favours ours)."""
    return {
        "speed_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "memory_ratio": max(ours["peak_tensor_bytes_per_rank"]) / max(theirs["peak_tensor_bytes_per_rank"]),
    }


def summarize(reps: list[list[dict]], tokens: int) -> dict:
    """Medians over repeats; a step takes as long as its slowest rank."""
    step_s = statistics.median(max(r["step_s"] for r in rep) for rep in reps)
    ranks = range(len(reps[0]))
    return {
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "peak_at": reps[0][0].get("peak_at", ""),  # the operator after which rank 0's peak was seen
        "peak_tensor_bytes_per_rank": [
            int(statistics.median(rep[r]["peak_bytes"] for rep in reps)) for r in ranks
        ],
    }


class LocalTensorBytes(TensorBytes):
    """``TensorBytes`` that also counts DTensor outputs, by their local shards (a DTensor is a wrapper
    with no storage of its own; the mode sees the DTensor op, not the local ops inside it)."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, DTensor):
                tensor = tensor._local_tensor
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.is_meta:
                storage = tensor.untyped_storage()
                known = self._live.get(storage._cdata)
                if known is None or known() is None:
                    self._live[storage._cdata] = weakref.ref(storage)
        now = self.live
        if now > self.peak:
            self.peak, self.peak_at = now, str(func)
        return out


class SplitQKVAttention(nn.Module):
    """The GPT's attention with ``qkv`` as three projections (its rows, unchanged), for DTensor; the
    attention between them is the block's own (its seam, ``attn.attention``)."""

    def __init__(self, attn: Any) -> None:
        super().__init__()
        self.head_dim, self.dropout, self.attention = attn.head_dim, attn.dropout, attn.attention
        width = attn.proj.in_features
        self.q, self.k, self.v = (nn.Linear(width, width, dtype=attn.qkv.weight.dtype) for _ in range(3))
        with torch.no_grad():
            for i, layer in enumerate((self.q, self.k, self.v)):
                layer.weight.copy_(attn.qkv.weight[i * width : (i + 1) * width])
                layer.bias.copy_(attn.qkv.bias[i * width : (i + 1) * width])
        self.proj, self.resid_dropout = attn.proj, attn.resid_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, d_model)
        batch, seq, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (batch, seq, d_model / tp) each
        heads = q.size(-1) // self.head_dim  # this rank's heads
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim)))


def _config(settings: dict, world_size: int) -> Any:
    from shardwise.config import load_config

    return load_config(
        None,
        {
            "model.preset": settings["preset"],
            "model.seq_len": settings["seq_len"],
            "model.dropout": 0.0,
            "model.tie_weights": False,
            "parallel.tp": world_size,
            "parallel.sequence_parallel": settings["sequence_parallel"],
            "data.global_batch": settings["batch"],
            "steps": settings["steps"],
        },
    )


def _blocks(model: nn.Module) -> BlockList:
    found = adapter_for(model).block_list()
    assert found is not None
    return found


def _model(config: Any, blocks: int | None = None) -> nn.Module:
    from shardwise.models import build_model

    torch.manual_seed(0)
    model = build_model(config.model)
    found = _blocks(model)
    if blocks is not None:  # a shorter copy: only the blocks differ (the GPT's forward runs them all)
        setattr(model, found.path, nn.ModuleList(found.blocks[:blocks]))
    return model


def _ours(config: Any, mesh: Any, blocks: int | None = None) -> Callable[[torch.Tensor, torch.Tensor], None]:
    from shardwise.parallelism import parallelize

    engine = parallelize(_model(config, blocks), mesh, config)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.train_step([(x, y)])

    return step


def _dtensor_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    rows_out = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=rows_out),
        "head": ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:  # positions (seq, d_model): this rank's slice forward, all-gather backward
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
    found = _blocks(model)
    for i in range(len(found.container)):
        block = f"{found.path}.{i}"
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"{block}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"{block}.{name}"] = RowwiseParallel(output_layouts=rows_out)
        if sp:
            for name in ("ln_1", "ln_2"):
                plan[f"{block}.{name}"] = SequenceParallel()
            for name in (f"{block}.attn", f"{block}.mlp"):
                plan[name] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
    return plan


def _dtensor(config: Any, world_size: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from shardwise.engine.optim import build_optimizer, named

    model = _model(config)
    for name, attn in adapter_for(model).attention_modules():
        path, _, child = name.rpartition(".")
        setattr(model.get_submodule(path), child, SplitQKVAttention(attn))
    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(model, mesh, _dtensor_plan(model, config.parallel.sequence_parallel))
    optimizer = build_optimizer(named(model), config.optim)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        logits = model(x)  # DTensor (batch, seq, vocab), cut by vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _batch(settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens on every tp rank (they share one batch)."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (settings["batch"], settings["seq_len"] + 1), generator=gen, device=HOST)
    return data[:, :-1], data[:, 1:]


def _counts(
    comm: Any, step: Callable[[torch.Tensor, torch.Tensor], None], x: torch.Tensor, y: torch.Tensor
) -> dict:
    step(x, y)  # the first step makes the optimizer state; count a steady one
    before = comm.stats.snapshot()
    step(x, y)
    spent = comm.stats.since(before)
    return {"ops": dict(spent.ops), "bytes_sent": spent.bytes_sent}


def _bench_rank(rank: int, world_size: int, impl: str, settings: dict) -> dict:
    from shardwise.mesh import build_mesh

    config = _config(settings, world_size)
    x, y = _batch(settings)
    mesh = build_mesh(config) if impl == "ours" else None

    def build() -> Callable[[torch.Tensor, torch.Tensor], None]:
        return _ours(config, mesh) if impl == "ours" else _dtensor(config, world_size)

    with LocalTensorBytes() as counted:  # the model is built inside: its weights count
        step = build()
        for _ in range(MEMORY_STEPS):
            step(x, y)
    peak, peak_at = counted.peak, counted.peak_at
    del step, counted
    gc.collect()
    step = build()
    times = []
    for _ in range(settings["steps"] + 1):  # the first step (allocation, optimizer state) is not timed
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"step_s": statistics.median(times[1:]), "peak_bytes": peak, "peak_at": peak_at}
    if impl == "ours":
        comm = mesh.comm("tp")  # type: ignore[union-attr]
        out["full"] = _counts(comm, step, x, y)
        out["one_block"] = _counts(comm, _ours(config, mesh, blocks=1), x, y)
        out["blocks"] = len(_blocks(_model(config)).container)
    return out


def configurations(sequence_parallel: bool) -> dict[str, str]:
    """How each side is configured, in words (recorded in the report)."""
    common = "GPT untied head, dropout 0, AdamW(foreach=False), fp32, gloo"
    sp = ", sequence parallel" if sequence_parallel else ""
    return {
        "ours": f"parallelize(tp=nproc{sp}): gpt_plan (fused qkv cut head-wise), vocab-parallel loss; "
        + common,
        "dtensor": (
            "parallelize_module: wte RowwiseParallel, q/k/v and mlp.fc ColwiseParallel, attn.proj and "
            "mlp.proj RowwiseParallel, head ColwiseParallel into loss_parallel"
            + (
                "; SequenceParallel norms, PrepareModuleInput gathers, wpe sliced"
                if sequence_parallel
                else ""
            )
            + f"; {common}"
        ),
        "qkv": (
            "DTensor cannot cut a fused qkv head-wise (ColwiseParallel's Shard(0) gives rank 0 all of q); "
            "its side runs the same weights with separate q/k/v projections"
        ),
    }


def check_tp_settings(nproc: int, preset: str, seq_len: int, rows: tuple[str, ...]) -> None:
    """Refuse, in one line, settings the bench cannot run (before any rank starts)."""
    from shardwise.config import ConfigError

    if unknown := [row for row in rows if row not in ROWS]:
        raise ConfigError(f"unknown --rows {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if nproc < 2:
        raise ConfigError(f"--nproc {nproc}: tensor parallelism needs at least 2 ranks")
    sizes = PRESETS[GPT_KIND].get(preset)
    if sizes is None:
        raise ConfigError(f"unknown gpt preset {preset!r}; known presets: {', '.join(PRESETS[GPT_KIND])}")
    width = sizes.get("d_ff", 4 * sizes["d_model"])
    for name, value in (("n_head", sizes["n_head"]), ("d_model", sizes["d_model"]), ("d_ff", width)):
        if value % nproc:
            raise ConfigError(
                f"gpt preset {preset!r}: {name} {value} is not divisible by tp {nproc}; pick another"
            )
    if sizes["n_layer"] < 2:
        raise ConfigError(f"gpt preset {preset!r} has one block; collectives per block need two or more")
    if "tp+sp" in rows and seq_len % nproc:
        raise ConfigError(
            f"--seq-len {seq_len} is not divisible by tp {nproc} (sequence parallelism cuts it)"
        )


def run_tp_bench(
    nproc: int = 2,
    steps: int = 5,
    repeats: int = 3,
    preset: str = "small",
    batch: int = 8,
    seq_len: int = 64,
    rows: tuple[str, ...] = tuple(ROWS),
    timeout_s: float = 600.0,
) -> dict:
    """Per row (``tp``, ``tp+sp``): ours and DTensor's tokens/s and peak tensor bytes per rank, their
    ratios, and our collectives per block beside Megatron's."""
    load_before = os.getloadavg()
    runs: dict[tuple[str, str], list[list[dict]]] = {}
    for repeat in range(repeats):
        for row in rows:
            settings = {"preset": preset, "seq_len": seq_len, "batch": batch, "steps": steps}
            settings["sequence_parallel"] = ROWS[row]
            for impl in ("ours", "dtensor") if repeat % 2 == 0 else ("dtensor", "ours"):
                result = run_on_ranks(_bench_rank, nproc, impl, settings, timeout_s=timeout_s)
                runs.setdefault((row, impl), []).append(result)
    report: dict[str, Any] = {"nproc": nproc, "preset": preset, "batch": batch, "seq_len": seq_len}
    report.update(steps=steps, repeats=repeats, memory_steps=MEMORY_STEPS)
    report["load_avg_1m"] = {"before": load_before[0], "after": os.getloadavg()[0]}  # timings are noisy
    report["rows"] = {row: _row(row, runs, nproc, preset, batch, seq_len) for row in rows}
    return report


def _row(row: str, runs: dict, nproc: int, preset: str, batch: int, seq_len: int) -> dict:
    tokens = batch * seq_len  # every tp rank trains the same batch: the job's tokens per step
    entry: dict[str, Any] = {"sequence_parallel": ROWS[row], "configured": configurations(ROWS[row])}
    entry["ours"], entry["dtensor"] = (summarize(runs[(row, impl)], tokens) for impl in ("ours", "dtensor"))
    entry.update(ratios(entry["ours"], entry["dtensor"]))
    first = runs[(row, "ours")][0][0]
    measured = per_block(first["full"], first["one_block"], first["blocks"], 1)
    megatron = megatron_per_block(ROWS[row], tokens, PRESETS[GPT_KIND][preset]["d_model"], nproc)
    entry["collectives_per_block"] = collectives_entry(measured, megatron)
    return entry


def render_tp(result: dict) -> None:
    """One line per row, for people; ``--json`` gives everything."""
    print(f"tensor parallel on {result['nproc']} ranks, gpt {result['preset']}, batch {result['batch']}")
    for name, entry in result["rows"].items():
        blocks = entry["collectives_per_block"]
        print(
            f"  {name:6s} speed ratio {entry['speed_ratio']:.3f}  memory ratio {entry['memory_ratio']:.3f}  "
            f"per block {blocks['measured']['ops']} (Megatron {blocks['megatron']['ops']}, "
            f"{'matches' if blocks['matches_megatron'] else 'DIFFERS'})"
        )
