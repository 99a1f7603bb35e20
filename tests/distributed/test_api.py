"""The public API with a user's own model, loss, data, optimizer and scheduler, against one process.

Dict batches with padding and masked labels, uneven shares (data weights) and micro-batches: the
global count of counted labels makes N ranks equal one process on the whole batch, in float64.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.config import ModelConfig
from shardwise.data.dataset import DatasetSampler, global_indices
from shardwise.engine.loss import CausalLMLoss, TokenLoss, run_model
from shardwise.engine.optim import named
from shardwise.models import build_model
from shardwise.testing import assert_parity, run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
VOCAB, LENGTH, STEPS = 11, 9, 4


class TinyLM(nn.Module):
    """A causal LM of our own that returns a dict, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.mix = nn.Linear(12, 6)
        self.head = nn.Linear(6, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
        x = self.embed(input_ids)  # (batch, seq, 6)
        previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # causal: t sees t-1
        hidden = torch.tanh(self.mix(torch.cat([x, previous], dim=-1)))
        return {"logits": self.head(hidden)}


def _model() -> nn.Module:
    torch.manual_seed(3)
    return TinyLM().double()


def _dataset() -> list[dict[str, torch.Tensor]]:
    """Sequences of several lengths, right-padded; padding and a 'prompt' token carry label -100."""
    g = torch.Generator().manual_seed(5)
    items = []
    for i in range(40):
        length = 3 + i % (LENGTH - 2)
        ids = torch.zeros(LENGTH, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        labels = ids.clone()
        labels[length:] = -100
        labels[0] = -100
        items.append({"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels})
    return items


def _grouped(named_params: Any) -> torch.optim.Optimizer:
    """A user's factory: no weight decay on biases."""
    params = list(named_params)
    decay = [p for n, p in params if not n.endswith("bias")]
    no_decay = [p for n, p in params if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=0.05, foreach=False)


def _plain(named_params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in named_params], lr=0.05, weight_decay=0.1, foreach=False)


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def _config(strategy: str, run_dir: str, weights: str, **extra: str) -> sw.TrainConfig:
    overrides = {
        "strategy": strategy,
        "steps": str(STEPS),
        "data.global_batch": "10",
        "data.micro_batches": "2",
        "data.weights": weights,
        "eval_every": "0",
        "run_dir": run_dir,
        **extra,
    }
    return sw.load_config(overrides=overrides)


def _reference(factory: Any) -> dict[str, torch.Tensor]:
    model, data, loss = _model(), _dataset(), CausalLMLoss()
    optimizer = factory(named(model) if factory is _plain else list(model.named_parameters()))
    scheduler = _warmup(optimizer)
    sampler = DatasetSampler(data, 10, 0, [10], 0)
    for step in range(STEPS):
        batch = sampler.global_batch(step)
        (loss(model(batch["input_ids"]), batch) / loss.count(batch)).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank(rank: int, world_size: int, config: sw.TrainConfig, grouped: bool) -> dict | None:
    factory = _grouped if grouped else _plain
    trainer = sw.Trainer.build(
        config, model=_model(), dataset=_dataset(), optimizer=factory, scheduler=_warmup
    )
    summary = trainer.fit(show_progress=False)
    params = trainer.engine.full_parameters() if trainer.engine.role.steps else None
    return {"summary": summary, "params": params}


@pytest.mark.parametrize(
    ("strategy", "world", "weights", "grouped"),
    [
        ("ddp", 2, "0.2,0.8", True),
        ("zero1", 2, "0.3,0.7", False),
        ("zero2", 3, "0.1,0.5,0.4", False),
        ("ps", 3, "0.35,0.65", True),
    ],
)
def test_own_model_loss_data_optimizer_scheduler_match_one_process(
    tmp_path: Path, strategy: str, world: int, weights: str, grouped: bool
) -> None:
    config = _config(strategy, str(tmp_path), weights)
    results = run_on_ranks(_rank, world, config, grouped, timeout_s=240)
    reference = _reference(_grouped if grouped else _plain)
    candidate = next(r["params"] for r in results if r["params"] is not None)
    assert_parity(reference, candidate, 1e-12)
    summary = next(r["summary"] for r in results if r["summary"])
    assert summary["steps"] == STEPS and summary["final_loss"] < summary["initial_loss"]


def _own_stream(rank: int, world_size: int, config: sw.TrainConfig) -> dict | None:
    """Each rank iterates its own batches: rank 0 takes 2 sequences per step, rank 1 takes 8."""
    data, per_step = _dataset(), (2, 8)
    starts = [sum(per_step[:rank]) + step * sum(per_step) for step in range(STEPS)]
    mine = [data[s % len(data) : s % len(data) + per_step[rank]] for s in starts]
    batches = [{k: torch.stack([item[k] for item in chunk]) for k in chunk[0]} for chunk in mine]
    trainer = sw.Trainer.build(config, model=_model(), batches=batches, optimizer=_plain)
    trainer.fit(show_progress=False)
    return {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}


def test_a_per_rank_stream_of_batches_matches_one_process(tmp_path: Path) -> None:
    config = _config("ddp", str(tmp_path), "")
    params = run_on_ranks(_own_stream, 2, config, timeout_s=180)[0]
    model, data, loss = _model(), _dataset(), CausalLMLoss()
    optimizer = _plain(named(model))
    for step in range(STEPS):
        rows = [data[(step * 10 + i) % len(data)] for i in range(10)]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        (loss(model(batch["input_ids"]), batch) / loss.count(batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_parity({n: p.detach() for n, p in model.named_parameters()}, params, 1e-12)


def _zero_with_groups(rank: int, world_size: int, config: sw.TrainConfig) -> str:
    try:
        sw.Trainer.build(config, model=_model(), dataset=_dataset(), optimizer=_grouped)
    except sw.ConfigError as err:
        return str(err)
    return "accepted"


def test_zero_refuses_param_groups_it_cannot_keep_apart(tmp_path: Path) -> None:
    config = _config("zero2", str(tmp_path), "")
    message = run_on_ranks(_zero_with_groups, 2, config, timeout_s=120)[0]
    assert "2 param groups cannot be kept apart" in message


# -- the sampler of a user's dataset: pure, sharded, resumable ------------------------------------------
def test_dataset_stream_covers_each_epoch_once_and_shards_concatenate() -> None:
    size, batch = 7, 3
    stream = [i for step in range(7) for i in global_indices(1, step, batch, size)]
    for epoch in range(3):
        assert sorted(stream[epoch * size : (epoch + 1) * size]) == list(range(size))
    data = [torch.tensor([float(i)]) for i in range(size)]
    shards = [DatasetSampler(data, batch, 1, [1, 0, 2], r) for r in range(3)]
    for step in range(5):
        rows = [mb for s in shards for mb in s.local_micro_batches(step, 1)]
        assert torch.equal(torch.cat(rows), DatasetSampler(data, batch, 1, [3], 0).global_batch(step))


def test_dataset_sampler_resumes_mid_epoch() -> None:
    data = [torch.tensor([float(i)]) for i in range(10)]
    first = DatasetSampler(data, 4, 2, [4], 0)
    for step in range(3):
        first.local_micro_batches(step, 2)
    resumed = DatasetSampler(data, 4, 2, [4], 0)
    resumed.load_state_dict(first.state_dict())
    assert resumed.step == 3
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.local_micro_batches(3, 2), resumed.local_micro_batches(3, 2), strict=True)
    )


def test_empty_share_is_a_zero_row_batch_of_the_same_structure() -> None:
    sampler = DatasetSampler(_dataset(), 3, 0, [3, 0], 1)
    (empty,) = sampler.local_micro_batches(0, 1, keep_empty=True)
    assert set(empty) == {"input_ids", "attention_mask", "labels"}
    assert all(t.shape == (0, LENGTH) for t in empty.values())


# -- the shipped example, as a user runs it ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("runner", ["launcher", "torchrun"])
@pytest.mark.parametrize("example", ["own_model_ddp.py", "hf_gpt2_zero3.py"])
def test_examples_train(tmp_path: Path, runner: str, example: str) -> None:
    script = ROOT / "examples" / example
    command = [sys.executable, str(script)]
    if runner == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = (float(v) for v in result.stdout.split("loss ")[-1].split(" -> "))
    assert last < 0.6 * first


# -- bad input through Trainer.build / fit: one line naming the fix, on every rank ----------------------
class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).squeeze(-1)  # (rows,)


class _ReturnsNothing(_Regression):
    def forward(self, x: torch.Tensor) -> None:  # type: ignore[override]
        self.linear(x)


def _squared(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return ((out - batch[1]) ** 2).sum()


def _squared_mean(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, batch[1])


def _bad_input_cases(rank: int, world_size: int, run_dir: str) -> dict[str, str]:
    """Each bad input on its own Trainer; what each rank was told (every rank fails the same way)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, generator=g), torch.randn((), generator=g)) for _ in range(16)]
    mismatched = [(torch.randn(4, 3), torch.randn(3)) for _ in range(2)]  # 4 inputs, 3 targets
    cases: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
        "both": ({}, {"dataset": data, "batches": mismatched}),
        "mismatched": ({}, {"batches": mismatched}),
        "mismatched_micro": ({"data.micro_batches": "2"}, {"batches": mismatched}),
        "short": ({"data.global_batch": "32"}, {"dataset": data}),
        "mean": ({}, {"dataset": data, "loss": _squared_mean}),
        "frozen": ({}, {"dataset": data, "model": _Regression().requires_grad_(False)}),
        "forward_none": ({}, {"dataset": data, "model": _ReturnsNothing()}),
        "optimizer_none": ({}, {"dataset": data, "optimizer": lambda named: None}),
        "scheduler_none": ({}, {"dataset": data, "scheduler": lambda optimizer: None}),
    }
    told = {}
    for name, (overrides, kwargs) in cases.items():
        base = {"steps": "2", "data.global_batch": "8", "eval_every": "0", "run_dir": run_dir}
        config = sw.load_config(overrides={**base, **overrides})
        kwargs = {"model": _Regression(), "loss": _squared, **kwargs}
        try:
            sw.Trainer.build(config, **kwargs).fit(show_progress=False)
        except (sw.ConfigError, ValueError) as err:  # LossError is a ValueError
            told[name] = f"{type(err).__name__}: {err}"
        else:
            told[name] = "trained"
    return told


def test_bad_input_through_the_api_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    told = run_on_ranks(_bad_input_cases, 2, str(tmp_path), timeout_s=180)
    assert told[0] == told[1]
    expected = {
        "both": "ConfigError: Trainer.build got both dataset= and batches=",
        "mismatched": "ConfigError: the batch of step 0 has tensors with different numbers of rows",
        "mismatched_micro": "ConfigError: the batch of step 0 has tensors with different numbers of rows",
        "short": "ConfigError: the dataset has 16 samples, fewer than data.global_batch (32)",
        "mean": 'LossError: the loss is a mean (reduction="mean" (MseLoss))',
        "frozen": "ConfigError: the model has no trainable parameters",
        "forward_none": "LossError: _ReturnsNothing.forward returned None",
        "optimizer_none": "ConfigError: the optimizer factory returned NoneType",
        "scheduler_none": "ConfigError: the scheduler factory returned NoneType",
    }
    for name, start in expected.items():
        assert told[0][name].startswith(start), (name, told[0][name])
        assert "\n" not in told[0][name], (name, told[0][name])


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.hidden, self.head = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(x)))  # (rows, classes)


def _labelled() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    return [(torch.randn(5, generator=g, dtype=torch.float64), torch.tensor(i % 3)) for i in range(30)]


def _classify(rank: int, world_size: int, config: sw.TrainConfig) -> dict | None:
    trainer = sw.Trainer.build(config, model=_Classifier().double(), dataset=_labelled(), optimizer=_plain)
    trainer.fit(show_progress=False)
    return {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}


def test_the_default_loss_on_class_labels_matches_one_process(tmp_path: Path) -> None:
    config = _config("ddp", str(tmp_path), "0.3,0.7")
    params = run_on_ranks(_classify, 2, config, timeout_s=180)[0]
    model, data = _Classifier().double(), _labelled()
    optimizer = _plain(named(model))
    sampler = DatasetSampler(data, 10, 0, [10], 0)
    for step in range(STEPS):
        inputs, labels = sampler.global_batch(step)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()  # the mean over the batch
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_parity({n: p.detach() for n, p in model.named_parameters()}, params, 1e-12)


# -- tensor parallelism through Trainer.build: the default loss (AutoLoss) over vocab-cut logits --------
def _tp_model(kind: str) -> nn.Module:
    torch.manual_seed(7)
    return build_model(ModelConfig(kind=kind, preset="tiny", seq_len=16), torch.float64)


def _tp_data(kind: str, width: int) -> list[Any]:
    """GPT-2: left-padded dict rows (attention mask, padding labelled -100); the built-in GPT:
    (inputs, targets) token rows."""
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(1, 256, (24, width + 1), generator=g)
    if kind == "gpt":
        return [(row[:-1], row[1:]) for row in tokens]
    items = []
    for i, row in enumerate(tokens):
        ids = row[:width].clone()
        pad = i % 4  # 0-3 padding positions on the left
        ids[:pad] = 0
        mask = (torch.arange(width) >= pad).long()
        items.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return items


def _tp_config(run_dir: str, **extra: str) -> sw.TrainConfig:
    overrides = {"parallel.tp": "2", "steps": "3", "data.global_batch": "8", "data.micro_batches": "2"}
    return sw.load_config(overrides={**overrides, "eval_every": "0", "run_dir": run_dir, **extra})


TP_KINDS = ("hf:tiny-gpt2", "gpt")


def _tp_default_loss(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    """Each model trained at tp 2 with loss=None (its full parameters), then sequence parallelism on a
    batch 9 positions wide (what each rank was told)."""
    out: dict[str, Any] = {}
    for kind in TP_KINDS:
        trainer = sw.Trainer.build(
            _tp_config(run_dir), model=_tp_model(kind), dataset=_tp_data(kind, 8), optimizer=_plain
        )
        trainer.fit(show_progress=False)
        out[kind] = trainer.engine.full_parameters()
    sp = _tp_config(run_dir, **{"parallel.sequence_parallel": "true"})
    try:
        sw.Trainer.build(sp, model=_tp_model("gpt"), dataset=_tp_data("gpt", 9)).fit(show_progress=False)
    except sw.ConfigError as err:
        out["odd width"] = str(err)
    return out


def test_tp_with_the_default_loss_matches_one_process(tmp_path: Path) -> None:
    """Issue 27: tp through Trainer.build refused the default loss; it now picks the vocab-parallel
    kind of each loss (causal-LM on GPT-2's masked dict batches, tokens on the GPT's pairs)."""
    results = run_on_ranks(_tp_default_loss, 2, str(tmp_path), timeout_s=240)
    for kind in TP_KINDS:
        model, data = _tp_model(kind), _tp_data(kind, 8)
        loss = CausalLMLoss() if kind != "gpt" else TokenLoss()
        optimizer = _plain(named(model))
        sampler = DatasetSampler(data, 8, 0, [8], 0)
        for step in range(3):
            batch = sampler.global_batch(step)
            (loss(run_model(model, batch), batch) / loss.count(batch)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        expected = {n: p.detach() for n, p in model.named_parameters()}
        for rank in (0, 1):  # tp sums partial products in another order: verify's tp tolerance
            assert_parity(expected, results[rank][kind], 1e-10)
    told = results[0]["odd width"]
    assert told == results[1]["odd width"] and "\n" not in told
    assert told.startswith("sequence parallelism cuts the sequence over tp: a batch of sequence length 9 is")


def _built_apart(rank: int, world_size: int, run_dir: str, layout: dict[str, str]) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + rank)  # every rank builds other values; rank 0's must win
    model = build_model(ModelConfig(kind="gpt", preset="tiny", seq_len=16), torch.float64)
    config = _tp_config(run_dir, **{"parallel.tp": "1", **layout}).validate(world_size)
    engine = sw.parallelize(model, sw.build_mesh(config), config)
    return engine.full_parameters()


@pytest.mark.parametrize("layout", [{"parallel.tp": "2"}, {"parallel.pp": "2"}], ids=["tp2", "pp2"])
def test_a_model_built_apart_on_each_rank_starts_from_rank_0s_values(tmp_path: Path, layout: dict) -> None:
    """A ``model=`` passed in built under tp or pp: every part is cut from rank 0's values (a stage's
    blocks, a replicated norm and each tp shard alike), as data parallelism alone gives."""
    torch.manual_seed(100)
    expected = build_model(ModelConfig(kind="gpt", preset="tiny", seq_len=16), torch.float64).state_dict()
    for got in run_on_ranks(_built_apart, 2, str(tmp_path), layout, timeout_s=120):
        assert got.keys() <= expected.keys() and len(got) > 4
        for name, tensor in got.items():
            assert torch.equal(tensor, expected[name]), name


# -- failures through sw.launch: the rank's own exception, one line ------------------------------------
def _main_with_a_bad_config(run_dir: str) -> None:
    config = sw.load_config(overrides={"steps": "1", "parallel.dp": "3", "run_dir": run_dir})
    sw.Trainer.build(config).fit(show_progress=False)


def _main_that_diverges(run_dir: str) -> None:
    overrides = {"steps": "3", "model.kind": "mlp", "optim.lr": "1e30", "eval_every": "0", "run_dir": run_dir}
    sw.Trainer.build(sw.load_config(overrides=overrides)).fit(show_progress=False)


def _main_with_sequence_parallel_on_an_odd_width(run_dir: str) -> None:
    config = _tp_config(run_dir, **{"parallel.sequence_parallel": "true", "steps": "1"})
    sw.Trainer.build(config, model=_tp_model("gpt"), dataset=_tp_data("gpt", 9)).fit(show_progress=False)


def _main_that_pipelines_its_own_model(run_dir: str) -> None:
    config = sw.load_config(overrides={"steps": "1", "parallel.pp": "2", "run_dir": run_dir})
    sw.Trainer.build(config, model=_Classifier().double(), dataset=_labelled()).fit(show_progress=False)


@pytest.mark.parametrize(
    ("main", "start"),
    [
        (_main_with_a_bad_config, "dp(3) x pp(1) x tp(1) = 3, but the world has 2 ranks; start 3"),
        (_main_that_pipelines_its_own_model, "a _Classifier cannot be split into pipeline stages"),  # a kind
        (
            _main_with_sequence_parallel_on_an_odd_width,  # raised inside the forward, on every tp rank
            "sequence parallelism cuts the sequence over tp: a batch of sequence length 9 is not divisible",
        ),
    ],
    ids=["config", "split", "sequence-parallel-width"],
)
def test_launch_raises_a_ranks_config_error_as_itself_in_one_line(
    tmp_path: Path, main: Callable[[str], None], start: str
) -> None:
    with pytest.raises(sw.ConfigError) as raised:
        sw.launch(main, 2, str(tmp_path))
    assert str(raised.value).startswith(start) and "\n" not in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def _joined() -> tuple[bool, int, str]:
    import torch.distributed as dist

    return dist.is_initialized(), dist.get_world_size(), str(dist.get_backend())


def test_launch_joins_every_rank_to_the_process_group() -> None:
    """A hand-written loop under ``sw.launch`` may call ``sw.build_mesh`` at once: the rank has joined
    (a wrapper's attributes once replaced the joining wrapper, and it never joined)."""
    assert sw.launch(_joined, 2) == [(True, 2, "gloo"), (True, 2, "gloo")]


def test_fit_raises_on_a_nan_and_launch_passes_it_on(tmp_path: Path) -> None:
    with pytest.raises(sw.NonFiniteStop) as raised:
        sw.launch(_main_that_diverges, 2, str(tmp_path))
    assert raised.value.step == 1 and "\n" not in str(raised.value)
    assert str(raised.value).startswith("step 1: the loss")


def _frozen_head(rank: int, world_size: int, config: sw.TrainConfig) -> dict[str, bool]:
    model = _Classifier().double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sw.Trainer.build(config, model=model, dataset=_labelled()).fit(show_progress=False)
    return {n: torch.equal(before[n], p.detach()) for n, p in model.named_parameters()}


def test_model_freeze_applies_to_a_model_of_ones_own(tmp_path: Path) -> None:
    config = _config("ddp", str(tmp_path), "", **{"model.freeze": "head"})
    unchanged = run_on_ranks(_frozen_head, 2, config, timeout_s=120)[0]
    assert unchanged == {"hidden.weight": False, "hidden.bias": False, "head.weight": True, "head.bias": True}
