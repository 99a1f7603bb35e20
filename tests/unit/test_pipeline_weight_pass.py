"""The zero-bubble split of backward, in one process, on stages of Hugging Face GPT-2 (Conv1D) and Llama
(RMSNorm, nn.Linear) built from their configs with random weights, float64, with and without activation
checkpointing: the I pass walks the stage's autograd graph once and keeps each linear layer's (input,
output gradient); the W pass runs no node of that graph (a weight without gradient hooks gets its
gradient as its accumulator would give it, one with hooks through that accumulator, its hooks seeing it)
and recomputes no block; every parameter's gradient equals a full backward's of the whole model, bit
for bit."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.activation_checkpointing import checkpoint_forward
from shardwise.engine.linear import WeightGradStore, apply_weight_grads, linear
from shardwise.pipeline.deferred import defer_stage_weight_grads, defer_weight_grads, is_conv1d
from shardwise.pipeline.schedules import stage_placement
from shardwise.pipeline.split import Split, split_model


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from shardwise.models.hf import SHIPPED_DIR

    config = transformers.AutoConfig.from_pretrained(str(SHIPPED_DIR / f"{name}.json"))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _graph(root: Any) -> list[Any]:
    """Every autograd node reachable from ``root`` (the stage's graph, before backward frees it)."""
    seen: dict[int, Any] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen.values())


class _Watch:
    """Counts, per phase, each graph node's runs (node pre-hooks) and the forwards of the modules inside
    the blocks (a checkpointed block's recomputation calls its forward directly, its modules' hooks run)."""

    def __init__(self) -> None:
        self.phase = "F"
        self.nodes: Counter[tuple[str, int]] = Counter()
        self.blocks: Counter[str] = Counter()
        self.names: dict[int, str] = {}

    def nodes_of(self, root: Any) -> list[Any]:
        nodes = _graph(root)
        for node in nodes:
            self.names[id(node)] = type(node).__name__
            node.register_prehook(self._counter(id(node)))
        return nodes

    def _counter(self, key: int) -> Any:
        return lambda _grads: self.nodes.update([(self.phase, key)])

    def blocks_of(self, model: nn.Module, split: Split) -> None:
        blocks: Any = next(iter(split.stages.values())).adapter.blocks()
        for block in blocks.values():
            for module in list(block.modules())[1:]:
                module.register_forward_pre_hook(lambda *_: self.blocks.update([self.phase]))

    def ran(self, phase: str, accumulators: bool) -> dict[int, int]:
        """Node id -> runs in ``phase``: the gradient accumulators, or every other node."""
        is_acc = {key: self.names[key] == "AccumulateGrad" for key in self.names}
        return {key: n for (p, key), n in self.nodes.items() if p == phase and is_acc[key] == accumulators}


def _stage(name: str, rank: int, checkpointed: bool) -> tuple[nn.Module, Split, WeightGradStore, int]:
    model = _hf(name)
    split = split_model(model, stage_placement("zb", 2, 1), rank)
    store = WeightGradStore()
    deferred = defer_stage_weight_grads(split, store)  # as the runtime does: not a tied copy's head
    if checkpointed:
        blocks: Any = next(iter(split.stages.values())).adapter.blocks()
        for block in blocks.values():
            checkpoint_forward(block)
    return model, split, store, deferred


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_the_w_pass_walks_no_graph_and_every_gradient_equals_a_full_backward(
    name: str, checkpointed: bool
) -> None:
    ids = torch.randint(1, 256, (3, 10), generator=torch.Generator().manual_seed(2))
    reference = _hf(name)
    logits = reference(input_ids=ids).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=logits.dtype)
    (logits * weights).sum().backward()
    want = {n: p.grad for n, p in reference.named_parameters()}

    (first, a, store_a, deferred_a), (last, b, store_b, deferred_b) = (
        _stage(name, rank, checkpointed) for rank in (0, 1)
    )
    # every linear layer the stage holds, but a head that reads the tied embedding's copy
    alone = split_model(_hf(name), stage_placement("zb", 2, 1), 1).stages[1].adapter.model
    every_b = defer_weight_grads(alone, WeightGradStore())
    assert deferred_a >= 4 and deferred_b == every_b - (1 if b.tied is not None else 0)
    watch = _Watch()
    watch.blocks_of(first, a)
    watch.blocks_of(last, b)
    given = a.inputs(ids)
    hidden = a.stages[0](ids, given)
    x = hidden.detach().requires_grad_(True)
    loss = (b.stages[1](x, given) * weights).sum()
    graph = watch.nodes_of(loss.grad_fn) + watch.nodes_of(hidden.grad_fn)

    watch.phase = "I"  # the last stage's I, then the first's from the gradient it sent
    with store_b.collect() as kept_b:
        loss.backward()
    assert x.grad is not None
    with store_a.collect() as kept_a:
        hidden.backward(x.grad)
    # the copy's gradient is whole after I (the W pass adds nothing to it): it can leave then
    copy_after_i = b.tied.copy.grad.clone() if b.tied is not None and b.tied.copy.grad is not None else None
    watch.phase = "W"
    apply_weight_grads(kept_b)
    apply_weight_grads(kept_a)

    # I: one walk of the graph; W: no node of it (these weights have no hooks: not even an accumulator)
    walked = [n for n in graph if type(n).__name__ != "AccumulateGrad"]
    assert watch.ran("I", accumulators=False) == {id(n): 1 for n in walked}
    assert watch.ran("W", accumulators=False) == {} and watch.ran("W", accumulators=True) == {}
    kept_weights = {id(r.weight) for r in kept_a + kept_b}
    assert len(kept_a + kept_b) == deferred_a + deferred_b and len(kept_weights) == deferred_a + deferred_b
    # the modules inside the blocks: recomputed in I when checkpointed (up to the last tensor backward
    # reads: torch stops the recomputation there), never in W
    assert watch.blocks["W"] == 0 and watch.blocks["F"] > 0
    assert 0 < watch.blocks["I"] <= watch.blocks["F"] if checkpointed else watch.blocks["I"] == 0

    got = {n: p.grad for model in (first, last) for n, p in model.named_parameters()}
    if b.tied is not None:  # GPT-2's head reads the last stage's copy of the first stage's embedding
        assert copy_after_i is not None and torch.equal(b.tied.copy.grad, copy_after_i)
        got[b.tied.owner_name] = got[b.tied.owner_name] + b.tied.copy.grad
    assert sorted(got) == sorted(want)
    for n, grad in want.items():
        assert torch.equal(got[n], grad), n


def test_a_w_pass_over_two_micro_batches_equals_backward_and_a_hooked_weight_s_hooks_see_it() -> None:
    """Two micro-batches' W passes accumulate as two backwards do, bit for bit; a weight with a gradient
    hook (DDP's buckets, ZeRO-3's, a user's) gets each through its own accumulator, which runs once per
    W pass with its hooks, while the weight without hooks gets it with no node run."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 4, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    reference = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    for x in xs:
        reference(x).square().sum().backward()
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    model.load_state_dict(reference.state_dict())
    store = WeightGradStore()
    assert defer_weight_grads(model, store) == 2
    hooked = model[2].weight
    phase = ["I"]
    seen: list[tuple[str, torch.Tensor | None]] = []  # (phase, the gradient the hook saw)
    hooked.register_post_accumulate_grad_hook(lambda w: seen.append((phase[0], w.grad)))
    runs: Counter[str] = Counter()  # the hooked weight's accumulator, per phase
    accumulator = hooked.view_as(hooked).grad_fn.next_functions[0][0]
    accumulator.register_prehook(lambda _: runs.update(phase))
    for x in xs:
        phase[0] = "I"
        with store.collect() as kept:
            model(x).square().sum().backward()
        phase[0] = "W"
        apply_weight_grads(kept)
    assert runs["W"] == 2 and [p for p, _ in seen].count("W") == 2
    assert seen[-1][0] == "W" and torch.equal(seen[-1][1], reference[2].weight.grad)
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and torch.equal(got.grad, want.grad), name


def test_a_w_gradient_takes_the_layout_of_a_weight_stored_transposed() -> None:
    """A weight whose strides are not the matmul's (stored transposed) gets its W gradient in its own
    layout, as autograd's accumulator lays a first gradient out, with a full backward's values."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = nn.Parameter(torch.randn(4, 5, generator=g, dtype=torch.float64).t())  # (5, 4), strides (1, 5)
    (want,) = torch.autograd.grad(nn.functional.linear(x, weight).square().sum(), [weight])
    store = WeightGradStore()
    with store.collect() as kept:
        linear(x, weight, None, False, store).square().sum().backward()
    assert weight.grad is None and len(kept) == 1
    apply_weight_grads(kept)
    assert weight.grad is not None and weight.grad.stride() == weight.stride() == want.stride()
    assert torch.equal(weight.grad, want)


@pytest.mark.parametrize("transposed", [False, True], ids=["nn.Linear", "Conv1D"])
def test_a_deferred_linear_outside_an_i_pass_is_the_plain_op_and_under_autocast_casts_like_it(
    transposed: bool,
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    weight = nn.Parameter(torch.randn((4, 3) if transposed else (3, 4), generator=g))
    bias = nn.Parameter(torch.randn(3, generator=g))
    def plain_op() -> torch.Tensor:  # as nn.Linear and Conv1D compute themselves
        if transposed:
            return torch.addmm(bias, x.reshape(-1, 4), weight).view(2, 5, 3)
        return nn.functional.linear(x, weight, bias)

    want_out = plain_op()
    want = torch.autograd.grad(want_out.square().sum(), [x, weight, bias])
    out = linear(x, weight, bias, transposed, WeightGradStore())  # no I pass collecting: dW at once
    out.square().sum().backward()  # (the weight is not in the graph: its node's hook accumulates dW)
    torch.testing.assert_close(out, want_out)
    for a, b in zip((x.grad, weight.grad, bias.grad), want, strict=True):
        torch.testing.assert_close(a, b)
    x.grad = bias.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # kept in bf16, accumulated into the fp32 weight
        store = WeightGradStore()
        low = linear(x, weight, bias, transposed, store)
        plain = plain_op()
    assert low.dtype == plain.dtype == torch.bfloat16 and torch.equal(low, plain)
    weight.grad = None
    with store.collect() as kept:
        low.float().sum().backward()
    assert weight.grad is None and kept[0].grad_output.dtype == torch.bfloat16
    apply_weight_grads(kept)
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    (reference,) = torch.autograd.grad(plain.float().sum(), [weight])
    torch.testing.assert_close(weight.grad, reference)


def test_only_plain_linear_layers_conv1d_and_declared_layers_defer() -> None:
    class Own(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(2, 2), Own(2, 2), nn.LayerNorm(2))
    assert defer_weight_grads(model, WeightGradStore()) == 1  # a subclass's own forward is left alone
    assert not is_conv1d(model[0])
    kept = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert defer_weight_grads(kept, WeightGradStore(), plain=[kept[1]]) == 1  # one left plain


def test_a_layer_whose_input_and_bias_need_no_gradient_takes_the_plain_op_and_its_dw_comes_in_i() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)  # no gradient wanted: no node of it runs in I
    weight = nn.Parameter(torch.randn(5, 4, generator=g, dtype=torch.float64))
    store = WeightGradStore()
    with store.collect() as kept:
        linear(x, weight, None, False, store).square().sum().backward()
    (want,) = torch.autograd.grad(nn.functional.linear(x, weight).square().sum(), [weight])
    assert kept == [] and weight.grad is not None and torch.equal(weight.grad, want)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_checkpointed_block_s_linear_inputs_are_not_held_from_the_forward(
    monkeypatch: pytest.MonkeyPatch, checkpointed: bool
) -> None:
    """X is kept as autograd keeps a saved tensor: in a checkpointed block only checkpointing's handle
    is held after the forward, and X comes from the recomputation in I."""
    import gc
    import weakref

    from shardwise.engine import linear as module

    held: list[weakref.ref[torch.Tensor]] = []
    hold = module._hold
    monkeypatch.setattr(module, "_hold", lambda x: (held.append(weakref.ref(x)), hold(x))[1])
    block = nn.Sequential(nn.Tanh(), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).double()
    reference = nn.Sequential(nn.Tanh(), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).double()
    reference.load_state_dict(block.state_dict())
    store = WeightGradStore()
    defer_weight_grads(block, store)
    if checkpointed:
        checkpoint_forward(block)
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    out = block(x)
    gc.collect()
    forward_inputs = [ref() is not None for ref in held[:2]]
    assert forward_inputs == [not checkpointed, not checkpointed]
    with store.collect() as kept:
        out.square().sum().backward()
    apply_weight_grads(kept)
    reference(x.detach()).square().sum().backward()
    assert len(kept) == 2
    for got, want in zip(block.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and torch.equal(got.grad, want.grad)
