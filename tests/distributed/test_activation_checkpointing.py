"""Activation checkpointing (``--activation-checkpointing``): blocks recompute in backward, results unchanged.

Parity against one process goes through ``shardwise verify``'s path (float64, 2 steps: losses,
gradients, final parameters; the command lines read by the CLI's parser and run in one launched world,
see ``verify_worlds``), for DDP, for ZeRO-3, whose gather and release hooks sit around each checkpointed
block, and for the zero-bubble pipeline schedules. The unit checks show the setting is not ignored: each
block's layers run twice per training step (forward, then the recomputation) and once in evaluation,
and names are unchanged.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.activation_checkpointing import apply_activation_checkpointing
from shardwise.config import ConfigError, load_config
from shardwise.models import build_model

from .cli_helpers import last_json, shardwise
from .verify_worlds import check_cases


def _gpt_and_config(on: bool):
    overrides = {"parallel.activation_checkpointing": str(on).lower(), "model.dropout": "0.1"}
    config = load_config(None, overrides)  # dropout: the recomputation must draw the same masks
    torch.manual_seed(0)
    return build_model(config.model, torch.float64), config


def _runs_per_step(on: bool, train: bool = True) -> int:
    model, config = _gpt_and_config(on)
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, config)
    assert [n for n, _ in model.named_parameters()] == names  # checkpointing renames nothing
    calls = []
    first_block = next(m for n, m in model.named_modules() if n.endswith(".0") or n == "blocks.0")
    leaf = next(m for m in first_block.modules() if isinstance(m, torch.nn.Linear))
    leaf.register_forward_hook(lambda *_: calls.append(1))
    inputs = torch.randint(0, 16, (2, config.model.seq_len))
    with torch.set_grad_enabled(train):
        out = model(inputs)
        if train:
            out.float().sum().backward()
    return len(calls)


def test_blocks_recompute_in_backward_and_not_in_evaluation() -> None:
    assert _runs_per_step(False) == 1
    assert _runs_per_step(True) == 2  # forward, then the recomputation in backward
    assert _runs_per_step(True, train=False) == 1


def test_same_gradients_with_and_without() -> None:
    grads = []
    for on in (False, True):
        model, config = _gpt_and_config(on)
        apply_activation_checkpointing(model, config)
        generator = torch.Generator().manual_seed(1)
        inputs = torch.randint(0, 16, (2, config.model.seq_len), generator=generator)
        model(inputs).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-12)


def test_a_model_without_blocks_is_refused() -> None:
    config = load_config(None, {"parallel.activation_checkpointing": "true"})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="no ModuleList/Sequential of blocks"):
        apply_activation_checkpointing(model, config)


VERIFY = {
    "ddp": ["--strategy", "ddp"],
    "zero3": ["--strategy", "zero3"],
    # the zero-bubble I pass recomputes each block once and keeps what W reads; W recomputes nothing
    "pp2-zb": ["--pp", "2", "--schedule", "zb", "--micro-batches", "4"],
    "pp2-zbv": ["--pp", "2", "--schedule", "zbv", "--virtual-stages", "2", "--micro-batches", "4"],
}


@pytest.mark.slow
def test_verify_with_activation_checkpointing() -> None:
    """``shardwise verify --activation-checkpointing <case> --nproc 2 --steps 2``'s path, every case in
    one world of 2 ranks: each measure within 1e-10 of one process (a failing case named)."""
    cases = {
        name: ["--activation-checkpointing", *args, "--nproc", "2", "--steps", "2"]
        for name, args in VERIFY.items()
    }
    check_cases(cases, 2, 1e-10)


@pytest.mark.slow
def test_tensor_parallel_dropout_masks_repeat_in_the_recomputation(tmp_path) -> None:
    """Under tp the split regions draw dropout masks from the tracker's per-rank state; the
    recomputation must draw the same ones (their states set back), so a float64 run with dropout
    ends exactly where the same run without checkpointing does."""
    summaries = []
    for extra in ([], ["--activation-checkpointing"]):
        args = ["train", "--tp", "2", "--nproc", "2", "--set", "model.dropout=0.1", "--dtype", "float64"]
        args += ["--steps", "3", "--preset", "odd-deep", "--eval-every", "0", "--run-dir", str(tmp_path)]
        result = shardwise(*args, *extra, "--json", timeout_s=280)
        assert result.returncode == 0, result.stderr[-3000:]
        summaries.append(last_json(result))
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"]
    assert summaries[0]["final_param_digest"] == summaries[1]["final_param_digest"]
