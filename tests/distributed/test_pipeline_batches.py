"""Dict batches under a pipeline equal one process: every stage reads the micro-batch's mask, positions and
segment ids as the whole model's forward reads them (float64, 3 steps: the losses, the first step's
gradients and the final parameters, <= 1e-10).

Hugging Face GPT-2 and Llama (the shipped tiny configs) on left-padded batches (attention mask), GPT-2
with ``token_type_ids``, Llama with explicit ``position_ids`` of packed rows (and once with
``use_cache`` on, where transformers does not look for packed rows), at pp 2 (1F1B and ZBV) and
dp 2 x pp 2. A subclass whose forward differs (of GPT-2 and of the built-in GPT) is refused in one
line under a pipeline and under tp; one that keeps its parent's forward trains exactly. One launched
world per world size runs every case; each one-process reference is computed once per case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.data.dataset import DatasetSampler
from shardwise.engine.optim import build_optimizer, named
from shardwise.engine.schedule import lr_multiplier
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.hf import SHIPPED_DIR
from shardwise.testing import assert_parity, run_on_ranks

transformers = pytest.importorskip("transformers")

TOL = 1e-10
STEPS, BATCH, LENGTH, SIZE = 3, 8, 12, 16

# name -> (shipped config, its overrides, the batches' kind, the model's class)
CASES: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "gpt2-left-padded": ("tiny-gpt2", {}, "left-padded", "plain"),
    "gpt2-token-types": ("tiny-gpt2", {}, "token-types", "plain"),
    "llama-left-padded": ("tiny-llama", {}, "left-padded", "plain"),
    "llama-packed": ("tiny-llama", {}, "packed", "plain"),
    "llama-packed-use-cache": ("tiny-llama", {"use_cache": True}, "packed", "plain"),
    "gpt2-subclass-own-forward-kept": ("tiny-gpt2", {}, "left-padded", "kept"),
}
PP2 = {"parallel.pp": "2", "data.micro_batches": "4"}
LAYOUTS: dict[int, dict[str, dict[str, str]]] = {
    2: {
        "pp2-1f1b": {**PP2, "parallel.schedule": "1f1b"},
        "pp2-zbv": {**PP2, "parallel.schedule": "zbv", "parallel.virtual_stages": "2"},
    },
    4: {"dp2-pp2-1f1b": {**PP2, "parallel.schedule": "1f1b"}},
}
DP2_PP2_EXTRA = {  # two more at dp 2 x pp 2: the V schedule with ZeRO on the dp axis
    "dp2-pp2-zbv-zero1": {
        **PP2, "parallel.schedule": "zbv", "parallel.virtual_stages": "2", "strategy": "zero1",
    },
}  # fmt: skip


class KeptGPT2(transformers.GPT2LMHeadModel):  # a subclass of one's own that keeps GPT-2's forward
    def describe(self) -> str:
        return "a user's GPT-2"


class ScaledGPT2(transformers.GPT2LMHeadModel):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


class ScaledGPT(GPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * 0.5


def _model(case: str) -> torch.nn.Module:
    name, overrides, _, kind = CASES[case]
    config = transformers.AutoConfig.from_pretrained(str(SHIPPED_DIR / f"{name}.json"), **overrides)
    torch.manual_seed(0)
    if kind == "kept":
        return KeptGPT2(config).double()
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _sample(kind: str, index: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + index)
    ids = torch.randint(1, 256, (LENGTH,), generator=g)
    labels = ids.clone()
    if kind == "left-padded":  # 0 to 5 pads on the left: masked, and carrying no loss
        pads = index % 6
        ids[:pads], labels[:pads] = 0, -100
        return {"input_ids": ids, "attention_mask": (torch.arange(LENGTH) >= pads).long(), "labels": labels}
    if kind == "token-types":  # two segments, cut at a different place in each row
        cut = 2 + index % (LENGTH - 3)
        return {"input_ids": ids, "token_type_ids": (torch.arange(LENGTH) >= cut).long(), "labels": labels}
    # packed: 2 or 3 sequences in a row, positions restarting at each; a sequence's first token is not
    # predicted from the one before
    cuts = sorted({3 + index % 4, 7 + index % 3} if index % 2 else {4 + index % 5})
    positions, start = torch.arange(LENGTH), 0
    for cut in [*cuts, LENGTH]:
        positions[start:cut] -= start
        labels[start] = -100
        start = cut
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _dataset(case: str) -> list[dict[str, torch.Tensor]]:
    return [_sample(CASES[case][2], i) for i in range(SIZE)]


def _config(root: str, layout: dict[str, str]) -> sw.TrainConfig:
    overrides = {
        "dtype": "float64", "steps": str(STEPS), "data.global_batch": str(BATCH), "eval_every": "0",
        "run_dir": root, "optim.lr": "0.01", **layout,
    }  # fmt: skip
    return sw.load_config(overrides=overrides)


def _train(config: sw.TrainConfig, case: str) -> dict[str, Any] | None:
    trainer = sw.Trainer.build(config, model=_model(case), dataset=_dataset(case))
    grads: dict[str, torch.Tensor] = {}

    def keep_first(step: int) -> None:
        if step == 0:
            grads.update(trainer.engine.full_gradients())

    records = [trainer.step(step, after_backward=keep_first) for step in range(STEPS)]
    params = trainer.engine.full_parameters()
    trainer.engine.close()
    if not trainer.engine.role.reports:
        return None
    return {"losses": [r.loss for r in records], "grads": grads, "params": params}


def _refusal(config: sw.TrainConfig, model: torch.nn.Module) -> str:
    try:
        sw.Trainer.build(config, model=model, dataset=_dataset("gpt2-left-padded"))
    except sw.ConfigError as err:
        return str(err)
    return "accepted"


def _world(rank: int, world_size: int, root: str, runs: list[tuple[str, str]]) -> dict[str, Any]:
    layouts = {**LAYOUTS[world_size], **(DP2_PP2_EXTRA if world_size == 4 else {})}
    out: dict[str, Any] = {
        f"{case}/{layout}": _train(_config(f"{root}/{case}-{layout}", layouts[layout]), case)
        for case, layout in runs
    }
    if world_size == 2:  # a forward of one's own, under a pipeline and under tp
        pp2, tp2 = LAYOUTS[2]["pp2-1f1b"], {"parallel.tp": "2"}
        gpt = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=LENGTH)
        for name, layout in (("pp2", pp2), ("tp2", tp2)):
            config = _config(f"{root}/refused-{name}", layout)
            out[f"refused/gpt2-{name}"] = _refusal(config, ScaledGPT2(_model("gpt2-left-padded").config))
            out[f"refused/gpt-{name}"] = _refusal(config, ScaledGPT(gpt))
        out["refused/key"] = _refusal_of_a_key(_config(f"{root}/refused-key", pp2))
    return out


def _refusal_of_a_key(config: sw.TrainConfig) -> str:
    """A key the stages do not read (a tokenizer's ``special_tokens_mask``): refused, never dropped."""
    extra = {"special_tokens_mask": torch.zeros(LENGTH, dtype=torch.long)}
    data = [{**item, **extra} for item in _dataset("gpt2-left-padded")]
    trainer = sw.Trainer.build(config, model=_model("gpt2-left-padded"), dataset=data)
    try:
        trainer.step(0)
    except sw.ConfigError as err:
        return str(err)
    finally:
        trainer.engine.close()
    return "accepted"


def _reference(case: str, config: sw.TrainConfig) -> dict[str, Any]:
    """Plain PyTorch in one process: the model's own forward on the whole batch, the summed causal-LM
    cross-entropy over the counted labels, divided by their number."""
    model = _model(case)
    optimizer = build_optimizer(named(model), config.optim)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config.optim, config.steps))
    sampler = DatasetSampler(_dataset(case), BATCH, config.seed, [BATCH], 0)
    losses, grads = [], {}
    for step in range(STEPS):
        batch = sampler.global_batch(step)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        labels = batch["labels"][:, 1:]
        scores = logits[:, :-1].reshape(-1, logits.size(-1))
        summed = F.cross_entropy(scores, labels.reshape(-1), reduction="sum")
        loss = summed / (labels != -100).sum()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _check(results: dict[str, Any], runs: list[tuple[str, str]], root: Path) -> None:
    references: dict[str, dict[str, Any]] = {}
    for case, layout in runs:
        got = results[f"{case}/{layout}"]
        if case not in references:  # the same global batches and update whatever the layout
            references[case] = _reference(case, _config(str(root / "ref"), {}))
        want = references[case]
        where = f"{case} at {layout}"
        assert_parity(want["losses"], got["losses"], TOL, what=f"losses ({where})")
        assert_parity(want["grads"], got["grads"], TOL, what=f"first-step gradients ({where})")
        assert_parity(want["params"], got["params"], TOL, what=f"final parameters ({where})")


def _extras_matter(case: str) -> float:
    """How far the model's logits move when the batch's extras are dropped (what pp did before)."""
    model, batch = _model(case), DatasetSampler(_dataset(case), BATCH, 0, [BATCH], 0).global_batch(0)
    with torch.no_grad():
        full = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        bare = model(input_ids=batch["input_ids"]).logits
    return float((full - bare).abs().max())


def _merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each key from the rank that reported it (the reporting rank returns the runs, every rank the
    refusals)."""
    keys = {key for r in results for key in r}
    return {key: next(r[key] for r in results if r.get(key) is not None) for key in keys}


@pytest.mark.slow
def test_dict_batches_at_pp2_equal_one_process_and_a_forward_of_ones_own_is_refused(tmp_path: Path) -> None:
    runs = [(case, layout) for case in CASES for layout in LAYOUTS[2]]
    results = _merged(run_on_ranks(_world, 2, str(tmp_path), runs, timeout_s=600))
    _check(results, runs, tmp_path)
    assert min(_extras_matter(case) for case in CASES) > 1e-3  # dropping them could not pass
    why = "a pipeline stage runs the parent's forward piece by piece, so yours would never run"
    tp_why = "tensor parallelism hands the forward logits cut by vocabulary"
    expected = {
        "refused/gpt2-pp2": f"ScaledGPT2.forward overrides GPT2LMHeadModel.forward, and {why}",
        "refused/gpt-pp2": f"ScaledGPT.forward overrides GPT.forward, and {why}",
        "refused/gpt2-tp2": f"ScaledGPT2.forward overrides GPT2LMHeadModel.forward, and {tp_why}",
        "refused/gpt-tp2": f"ScaledGPT.forward overrides GPT.forward, and {tp_why}",
        "refused/key": "batch key 'special_tokens_mask': a pipeline stage of GPT2LMHeadModel reads "
        "input_ids, attention_mask, token_type_ids, position_ids of a dict batch",
    }  # fmt: skip
    for key, message in expected.items():
        assert results[key].startswith(message) and "\n" not in results[key], (key, results[key])


@pytest.mark.slow
def test_dict_batches_at_dp2_pp2_equal_one_process(tmp_path: Path) -> None:
    runs = [(case, "dp2-pp2-1f1b") for case in CASES if case != "gpt2-subclass-own-forward-kept"]
    runs += [("llama-left-padded", "dp2-pp2-zbv-zero1"), ("gpt2-token-types", "dp2-pp2-zbv-zero1")]
    _check(_merged(run_on_ranks(_world, 4, str(tmp_path), runs, timeout_s=600)), runs, tmp_path)
