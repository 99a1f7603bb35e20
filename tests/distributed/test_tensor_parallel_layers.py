"""Tensor-parallel layers at tp=2 against the unsplit modules, in float64.

Each layer's output and its input and parameter gradients (the ranks' shards assembled by their boxes)
equal the plain module's to 1e-12; the vocab-parallel cross-entropy equals ``F.cross_entropy(sum)``;
the built-in GPT with ``gpt_plan`` applied (with and without sequence parallelism) follows the plain
model for a few SGD steps; the collectives per block are Megatron's; dropout masks are equal across tp
ranks in replicated regions and independent in split ones; a head count tp does not divide is refused.
All cases of one kind run in one spawn (each spawn costs seconds).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.collectives.api import Comm
from shardwise.models.adapters.gpt import gpt_plan
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from shardwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    qkv_sections,
)
from shardwise.tensor_parallel.random import TP_STATE
from shardwise.tensor_parallel.shards import ShardedParam, assemble, split_dim, split_sections
from shardwise.testing import run_on_ranks

ATOL = 1e-12
TP = 2
BATCH, SEQ, HIDDEN = 3, 4, 8


def _all(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return float((a - b).detach().abs().max())


def _param_diffs(layer: nn.Module, reference: nn.Module, what: str) -> dict[str, float]:
    """Each parameter's value and gradient, assembled from the ranks' boxes, against the reference's."""
    out = {}
    shards: dict[str, ShardedParam] = layer.shards  # type: ignore[assignment]
    for local_name, shard in shards.items():
        param = getattr(layer, local_name)
        records = _all((shard, param.detach(), param.grad))
        full_ref = getattr(reference, local_name)
        value = assemble([r[0] for r in records], [r[1] for r in records])
        grad = assemble([r[0] for r in records], [r[2] for r in records])
        out[f"{what} {local_name}"] = max(_diff(value, full_ref.detach()), _diff(grad, full_ref.grad))
    return out


def _seq_slice(t: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
    share = t.size(dim) // TP
    return t.narrow(dim, rank * share, share)


def _column_case(rank: int, comm: Comm, sp: bool, qkv: bool) -> dict[str, float]:
    torch.manual_seed(1)
    width = 3 * HIDDEN if qkv else 2 * HIDDEN + 2
    full = nn.Linear(HIDDEN, width).double()
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(BATCH, SEQ, width, dtype=torch.float64)
    ref = full(x)
    (ref * w_out).sum().backward()

    sections = qkv_sections(width, 4, 4, TP)[0] if qkv else None
    names = ("q width", "k width", "v width") if qkv else ("output width",)
    layer = ColumnParallelLinear(
        full, comm, "fc", sections=sections, section_names=names, sequence_parallel=sp
    )
    out_cut = split_sections("out", ref.shape, 2, sections or (width,), TP, rank, names)
    x_local = (_seq_slice(x, rank) if sp else x).detach().clone().requires_grad_(True)
    y = layer(x_local)
    (y * out_cut.take(w_out)).sum().backward()
    x_ref_grad = _seq_slice(x.grad, rank) if sp else x.grad  # type: ignore[arg-type]
    tag = f"column{'-qkv' if qkv else ''}{'-sp' if sp else ''}"
    return {
        f"{tag} output": _diff(y, out_cut.take(ref.detach())),
        f"{tag} input grad": _diff(x_local.grad, x_ref_grad),  # type: ignore[arg-type]
        **_param_diffs(layer, full, tag),
    }


def _row_case(rank: int, comm: Comm, sp: bool) -> dict[str, float]:
    torch.manual_seed(2)
    full = nn.Linear(2 * HIDDEN, HIDDEN).double()
    x = torch.randn(BATCH, SEQ, 2 * HIDDEN, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    ref = full(x)
    (ref * w_out).sum().backward()

    layer = RowParallelLinear(full, comm, "proj", sequence_parallel=sp)
    in_cut = split_dim("in", x.shape, 2, TP, rank, "input width")
    x_local = in_cut.take(x.detach()).requires_grad_(True)
    y = layer(x_local)
    expected, w_local = (_seq_slice(ref, rank), _seq_slice(w_out, rank)) if sp else (ref, w_out)
    (y * w_local).sum().backward()
    if sp:  # the bias saw this rank's positions only: sum over tp, as reduce_sequence_parallel_grads does
        comm.all_reduce(layer.bias.grad)  # type: ignore[union-attr, arg-type]
    tag = f"row{'-sp' if sp else ''}"
    return {
        f"{tag} output": _diff(y, expected.detach()),
        f"{tag} input grad": _diff(x_local.grad, in_cut.take(x.grad)),  # type: ignore[arg-type]
        **_param_diffs(layer, full, tag),
    }


def _embedding_case(rank: int, comm: Comm, sp: bool) -> dict[str, float]:
    torch.manual_seed(3)
    full = nn.Embedding(10, HIDDEN).double()
    idx = torch.randint(0, 10, (BATCH, SEQ))
    w_out = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    ref = full(idx)
    (ref * w_out).sum().backward()
    layer = VocabParallelEmbedding(full, comm, "wte", sequence_parallel=sp)
    y = layer(idx)
    expected, w_local = (_seq_slice(ref, rank), _seq_slice(w_out, rank)) if sp else (ref, w_out)
    (y * w_local).sum().backward()
    tag = f"embedding{'-sp' if sp else ''}"
    return {f"{tag} output": _diff(y, expected.detach()), **_param_diffs(layer, full, tag)}


def _cross_entropy_case(rank: int, comm: Comm) -> dict[str, float]:
    torch.manual_seed(4)
    vocab = 10
    logits = torch.randn(BATCH, SEQ, vocab, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, vocab, (BATCH, SEQ))
    target[0, 1] = -100  # ignored: no loss, no gradient
    ref = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="sum")
    ref.backward()
    cut = split_dim("logits", logits.shape, 2, TP, rank, "vocab_size")
    local = cut.take(logits.detach()).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, comm)
    loss.backward()
    return {
        "cross-entropy loss": abs(float(loss) - float(ref)),
        "cross-entropy grad": _diff(local.grad, cut.take(logits.grad)),  # type: ignore[arg-type]
    }


def _layers(rank: int, world_size: int) -> dict[str, float]:
    comm = Comm(name="tp")
    out: dict[str, float] = {}
    for sp in (False, True):
        out |= _column_case(rank, comm, sp, qkv=False)
        out |= _column_case(rank, comm, sp, qkv=True)
        out |= _row_case(rank, comm, sp)
        out |= _embedding_case(rank, comm, sp)
    out |= _cross_entropy_case(rank, comm)
    return out


@pytest.mark.slow
def test_layers_equal_the_unsplit_modules() -> None:
    for rank, diffs in enumerate(run_on_ranks(_layers, TP, timeout_s=240)):
        worst = max(diffs, key=diffs.__getitem__)
        assert diffs[worst] <= ATOL, f"rank {rank}: {worst} differs by {diffs[worst]:.3g}"
        assert len(diffs) == 30, sorted(diffs)  # every case reported


# -- the whole built-in GPT -----------------------------------------------------------------------
GPT_CONFIG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=4, d_model=16)
STEPS, LR, GPT_BATCH = 3, 0.5, 4


def _gpt_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, GPT_CONFIG.vocab_size, (STEPS, GPT_BATCH, GPT_CONFIG.seq_len + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _plain_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CONFIG).double()


def _reference() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = _plain_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for inputs, targets in _gpt_batches():
        opt.zero_grad()
        loss = F.cross_entropy(
            model(inputs).reshape(-1, GPT_CONFIG.vocab_size), targets.reshape(-1), reduction="sum"
        )
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
    return losses, grads


def _gpt_tp(rank: int, world_size: int, sp: bool) -> dict[str, Any]:
    comm = Comm(name="tp")
    model = _plain_gpt()
    layout = apply_tensor_parallel(model, comm, gpt_plan(GPT_CONFIG.n_head), sequence_parallel=sp)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, per_block = [], [], []
    for inputs, targets in _gpt_batches():
        opt.zero_grad()
        before = comm.stats.snapshot()
        logits = model(inputs)  # (batch, seq, vocab / tp)
        loss = vocab_parallel_cross_entropy(logits, targets, comm)
        forward = comm.stats.since(before)
        loss.backward()
        backward = _minus(comm.stats.since(before), forward)
        layout.reduce_sequence_parallel_grads(model)
        losses.append(float(loss.detach()))
        step_grads = {}
        for name, param in model.named_parameters():
            records = _all((layout.params[name], param.grad))
            step_grads[name] = assemble([r[0] for r in records], [r[1] for r in records])
        grads.append(step_grads)
        per_block.append((forward.ops, backward))
        opt.step()
    local_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "grads": grads,
        "ops": per_block,
        "shapes": local_shapes,
        "sp": layout.sequence_parallel_params,
    }


def _minus(total: Any, first: Any) -> dict[str, int]:
    return {op: n - first.ops.get(op, 0) for op, n in total.ops.items() if n != first.ops.get(op, 0)}


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_gpt_with_plan_follows_the_plain_model(sp: bool) -> None:
    ref_losses, ref_grads = _reference()
    results = run_on_ranks(_gpt_tp, TP, sp, timeout_s=240)
    for rank, got in enumerate(results):
        for step, (a, b) in enumerate(zip(ref_losses, got["losses"], strict=True)):
            assert abs(a - b) <= 1e-10, f"rank {rank} step {step}: loss {b} vs {a}"
        for step, (ref, grads) in enumerate(zip(ref_grads, got["grads"], strict=True)):
            assert set(ref) == set(grads)
            for name in ref:
                diff = _diff(grads[name], ref[name])
                assert diff <= 1e-10, f"rank {rank} step {step}: {name} grad differs by {diff:.3g}"
    shapes = results[0]["shapes"]
    assert shapes["blocks.0.attn.qkv.weight"] == (3 * 16 // TP, 16)  # each rank: its heads' q, k, v
    assert shapes["blocks.0.mlp.proj.weight"] == (16, 64 // TP)
    assert shapes["wte.weight"] == (16 // TP, 16)  # the head is tied to it: one Parameter
    blocks = GPT_CONFIG.n_layer
    # Megatron's count: per block 2 all-reduces forward and 2 backward; outside the blocks the embedding
    # adds one forward, the vocab-parallel cross-entropy three (of one number per token) forward and the
    # column-parallel head one backward. With sequence parallelism each becomes an all-gather plus a
    # reduce-scatter.
    forward, backward = results[0]["ops"][0]
    if not sp:
        assert forward == {"all_reduce": 2 * blocks + 1 + 3}, forward
        assert backward == {"all_reduce": 2 * blocks + 1}, backward
    else:
        # forward: 2 all-gathers per block and one before the head; 2 reduce-scatters per block and one
        # after the embedding; backward the conjugates, plus the position embedding's all-gather.
        assert forward == {"all_gather": 2 * blocks + 1, "reduce_scatter": 2 * blocks + 1, "all_reduce": 3}
        assert backward == {"reduce_scatter": 2 * blocks + 1, "all_gather": 2 * blocks + 1 + 1}, backward
        assert "blocks.0.ln_1.weight" in results[0]["sp"] and "blocks.0.attn.proj.bias" in results[0]["sp"]


# -- dropout and refusals -------------------------------------------------------------------------
DROPOUT_CONFIG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=4, d_model=16, dropout=0.5)
SEED = 5


def _dropout_case(rank: int, comm: Comm, sp: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(DROPOUT_CONFIG).double().train()
    layout = apply_tensor_parallel(model, comm, gpt_plan(DROPOUT_CONFIG.n_head), sp, seed=SEED)
    seen: dict[str, Any] = {}

    def keep(name: str) -> Any:
        return lambda _m, args, output: seen.__setitem__(name, (output == 0) & (args[0] != 0))

    model.drop.register_forward_hook(keep("drop mask"))
    model.blocks[0].attn.resid_dropout.register_forward_hook(keep("resid mask"))
    # a draw inside the attention core (after qkv, before proj): from the per-rank stream
    model.blocks[0].attn.qkv.register_forward_hook(lambda *_: seen.__setitem__("core draw", torch.rand(4)))
    model.blocks[1].register_forward_hook(lambda _m, _a, output: seen.__setitem__("stream", output.detach()))
    idx = torch.randint(0, DROPOUT_CONFIG.vocab_size, (2, DROPOUT_CONFIG.seq_len))
    model(idx).sum().backward()
    first = torch.rand(4, generator=torch.Generator().manual_seed(SEED + 2718 + rank))
    seen["core draw is the tp stream's first"] = torch.equal(seen["core draw"], first)
    seen["default state"] = torch.get_rng_state()
    seen["tp state"] = layout.tracker.states[TP_STATE]
    return seen


def _dropout(rank: int, world_size: int) -> dict[str, Any]:
    comm = Comm(name="tp")
    out: dict[str, Any] = {f"sp={sp}": _dropout_case(rank, comm, sp) for sp in (False, True)}
    refusals = []
    for attempt in (_odd_heads, _odd_kv_heads):
        try:
            attempt(comm)
        except ValueError as exc:
            refusals.append(str(exc))
    out["refusals"] = refusals
    return out


def _odd_heads(comm: Comm) -> None:
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=3, d_model=12))
    apply_tensor_parallel(model, comm, gpt_plan(3))


def _odd_kv_heads(comm: Comm) -> None:
    qkv_sections(6 * 4, n_head=4, n_kv_head=1, tp=comm.world_size)


@pytest.mark.slow
def test_dropout_masks_and_refusals() -> None:
    r0, r1 = run_on_ranks(_dropout, TP, timeout_s=240)
    plain, sp = "sp=False", "sp=True"
    # replicated regions: equal masks, so the residual stream stays identical across tp ranks
    assert torch.equal(r0[plain]["drop mask"], r1[plain]["drop mask"])
    assert torch.equal(r0[plain]["resid mask"], r1[plain]["resid mask"])
    assert r0[plain]["drop mask"].any() and not r0[plain]["drop mask"].all()
    assert torch.equal(r0[plain]["stream"], r1[plain]["stream"])
    # split regions: independent draws, from the per-rank state; the shared stream is never touched there
    for case in (plain, sp):
        assert not torch.equal(r0[case]["core draw"], r1[case]["core draw"])
        assert torch.equal(r0[case]["default state"], r1[case]["default state"])
        assert not torch.equal(r0[case]["tp state"], r1[case]["tp state"])
    # without sequence parallelism the attention core is the first user of the per-rank stream
    assert r0[plain]["core draw is the tp stream's first"] and r1[plain]["core draw is the tp stream's first"]
    # with sequence parallelism the residual dropouts act on each rank's positions: independent masks
    assert r0[sp]["drop mask"].shape == (2, DROPOUT_CONFIG.seq_len // TP, 16)
    assert not torch.equal(r0[sp]["drop mask"], r1[sp]["drop mask"])
    assert not torch.equal(r0[sp]["resid mask"], r1[sp]["resid mask"])
    assert r0["refusals"] == [
        "n_head 3 is not divisible by tp 2; each rank must hold whole heads",
        "n_kv_head 1 is not divisible by tp 2; with grouped-query attention each rank must hold whole "
        "key/value heads",
    ]


# -- Hugging Face GPT-2 and Llama -----------------------------------------------------------------
HF_STEPS, HF_BATCH, HF_SEQ = 2, 2, 8


def _hf_model(name: str) -> nn.Module:
    import transformers

    from shardwise.models.hf import SHIPPED_DIR

    config = transformers.AutoConfig.from_pretrained(str(SHIPPED_DIR / f"{name}.json"), local_files_only=True)
    config.num_hidden_layers = 2  # GPT-2 reads n_layer through this alias too
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _hf_plan(name: str, model: nn.Module) -> Any:
    from shardwise.models.adapters import adapter_for

    plan = adapter_for(model).tp_plan()
    assert plan.name == {"tiny-gpt2": "hf-gpt2", "tiny-llama": "hf-llama"}[name]
    return plan


def _hf_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (HF_BATCH, HF_SEQ), generator=g) for _ in range(HF_STEPS)]


def _hf_run(name: str, comm: Comm | None, sp: bool) -> dict[str, Any]:
    """Losses, per-step gradients (assembled from the ranks' boxes under tp) and the step-0 op counts."""
    from shardwise.tensor_parallel.layers import VocabParallelCausalLMLoss

    model = _hf_model(name)
    layout = apply_tensor_parallel(model, comm, _hf_plan(name, model), sp) if comm is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, ops = [], [], []
    for ids in _hf_batches():
        opt.zero_grad()
        batch = {"input_ids": ids}
        if comm is None:
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1), reduction="sum")
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        else:
            assert layout is not None
            before = comm.stats.snapshot()
            loss = VocabParallelCausalLMLoss(comm)(model(input_ids=ids), batch)
            forward = comm.stats.since(before)
            loss.backward()
            ops.append((forward.ops, _minus(comm.stats.since(before), forward)))
            layout.reduce_sequence_parallel_grads(model)
            step = {}
            for n, p in model.named_parameters():
                records = _all((layout.params[n], p.grad))
                step[n] = assemble([r[0] for r in records], [r[1] for r in records])
            grads.append(step)
        losses.append(float(loss.detach()))
        opt.step()
    return {"losses": losses, "grads": grads, "ops": ops}


def _hf_tp(rank: int, world_size: int) -> dict[str, Any]:
    comm = Comm(name="tp")
    return {
        (name, sp): _hf_run(name, comm, sp) for name in ("tiny-gpt2", "tiny-llama") for sp in (False, True)
    }


@pytest.mark.slow
def test_hf_gpt2_and_llama_with_plans_follow_the_plain_models() -> None:
    pytest.importorskip("transformers")
    results = run_on_ranks(_hf_tp, TP, timeout_s=240)
    for name in ("tiny-gpt2", "tiny-llama"):
        ref = _hf_run(name, None, False)
        for sp in (False, True):
            for rank, per_rank in enumerate(results):
                got = per_rank[(name, sp)]
                where = f"{name} sp={sp} rank {rank}"
                for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
                    assert abs(a - b) <= 1e-10, f"{where} step {step}: loss {b} vs {a}"
                for step, (want, have) in enumerate(zip(ref["grads"], got["grads"], strict=True)):
                    assert set(want) == set(have)
                    for param in want:
                        diff = _diff(have[param], want[param])
                        assert diff <= 1e-10, f"{where} step {step}: {param} grad differs by {diff:.3g}"
        # Megatron's count per block without sequence parallelism: 2 all-reduces each way (Llama's
        # q/k/v and gate/up share one f each); plus the embedding's forward one, the cross-entropy's 3
        # and the head's backward one.
        forward, backward = results[0][(name, False)]["ops"][0]
        assert forward == {"all_reduce": 2 * 2 + 1 + 3}, (name, forward)
        assert backward == {"all_reduce": 2 * 2 + 1}, (name, backward)
