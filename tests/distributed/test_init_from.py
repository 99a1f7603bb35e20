"""``--init-from``: pretrained weights loaded straight into each rank's shards.

A tiny Hugging Face model with random weights is saved with ``save_pretrained`` (nothing downloaded),
then loaded under ZeRO-3 and DDP on 2 ranks: the first loss equals the loss of the same weights
loaded by transformers' own ``from_pretrained`` in one process, and under ZeRO-3 no rank holds more
floating-point tensor bytes during ``Trainer.build`` than its share of the parameters plus the
largest unit (counted by ``shardwise.testing.memory.TensorBytes``, not RSS).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.config import TrainConfig, load_config
from shardwise.models import build_model
from shardwise.testing import run_on_ranks
from shardwise.testing.memory import TensorBytes

from .cli_helpers import in_process, last_json, refusal, shardwise

pytest.importorskip("transformers")

SLACK = 64 * 1024  # buffers, gradient-usage flags and the reader's row buffers: small, fixed


def save_random(kind: str, folder: Path, seed: int = 1, **save: Any) -> Path:
    """A model of ``kind`` with random weights, saved by transformers as a user would have it."""
    torch.manual_seed(seed)
    build_model(load_config(None, {"model.kind": kind}).model).save_pretrained(str(folder), **save)
    return folder


def _config(kind: str, folder: Path | None, strategy: str, dtype: str = "float64") -> TrainConfig:
    return load_config(
        None,
        {
            "model.kind": kind,
            "model.init_from": str(folder or ""),
            "strategy": strategy,
            "dtype": dtype,
            "steps": "1",
            "data.global_batch": "4",
            "model.seq_len": "32",
            "eval_every": "0",
            "run_dir": "runs/test-init-from",
        },
    )


def reference_loss(folder: Path, config: TrainConfig) -> float:
    """The first step's loss of one process, with the weights loaded by transformers itself."""
    from transformers import AutoModelForCausalLM

    from shardwise.data.corpus import load_corpus
    from shardwise.data.sampler import DataSampler
    from shardwise.engine.loss import logits_of, loss_sum
    from shardwise.models import predicted_tokens

    dtype = torch.float64 if config.dtype == "float64" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    batch, seq = config.data.global_batch, config.model.seq_len
    corpus = load_corpus(config.data.corpus_bytes)
    inputs, targets = DataSampler(corpus.train, seq, batch, config.seed, [batch], 0).global_batch(0)
    with torch.no_grad():
        loss = loss_sum(logits_of(model(inputs)), targets) / predicted_tokens(config.model.kind, batch, seq)
    return float(loss)


def _build_and_step(rank: int, world_size: int, config: TrainConfig, whole: bool = False) -> dict[str, Any]:
    """Build under the byte counter, then one step; the rank's peak beside its share and units.
    ``whole``: the model is built whole first (as a user's own model is) and passed in."""
    from shardwise.train.loop import Trainer, seed_everything, torch_dtype

    with TensorBytes() as counted:
        seed_everything(config.seed)
        model = build_model(config.model, torch_dtype(config.dtype)) if whole else None
        trainer = Trainer.build(config, model=model)
    engine = trainer.engine
    groups = getattr(engine, "groups", [])
    out = {
        "peak": counted.peak,
        "peak_at": counted.peak_at,
        "model_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        "share": sum(g.master.numel() * g.master.element_size() for g in groups),
        "largest_unit": max((g.full.numel() * g.full.element_size() for g in groups), default=0),
        "loss": trainer.step(0).loss,
    }
    engine.close()
    return out


@pytest.mark.slow
def test_zero3_and_ddp_start_from_saved_weights_within_a_share_plus_one_unit(tmp_path: Path) -> None:
    kind = "hf:tiny-gpt2"  # a tied head: lm_head.weight is not in the file, transformer.wte.weight is
    folder = save_random(kind, tmp_path / "gpt2")
    zero3, ddp = _config(kind, folder, "zero3"), _config(kind, folder, "ddp")
    without = _config(kind, None, "zero3")
    expected = reference_loss(folder, zero3)
    for config in (zero3, ddp):
        for rank, got in enumerate(run_on_ranks(_build_and_step, 2, config, timeout_s=240)):
            assert abs(got["loss"] - expected) <= 1e-12, (config.strategy, rank, got["loss"], expected)
            if config.strategy == "zero3":
                bound = got["share"] + got["largest_unit"] + SLACK
                print(
                    f"zero3 rank {rank}: peak {got['peak']} B <= share {got['share']} + unit "
                    f"{got['largest_unit']} + slack {SLACK} = {bound} (whole model {got['model_bytes']})"
                )
                assert got["peak"] <= bound, got
                assert bound < got["model_bytes"], got  # the claim says something: less than the model
            else:  # every DDP rank holds the whole model, and the counter sees it
                assert got["peak"] >= got["model_bytes"], got
    # from random weights ZeRO-3 draws only its shards too (the model built on meta, its init replayed)
    for got in run_on_ranks(_build_and_step, 2, without, timeout_s=240):
        assert got["peak"] <= got["share"] + got["largest_unit"] + SLACK, got
    # the counter catches a rank that holds the whole model: a model passed in built whole
    for got in run_on_ranks(_build_and_step, 2, without, True, timeout_s=240):
        assert got["peak"] >= got["model_bytes"] > got["share"] + got["largest_unit"], got


@pytest.mark.slow
def test_train_tiny_llama_with_zero3_from_a_sharded_folder(tmp_path: Path) -> None:
    """The command a user types, from save_pretrained's several files and their index."""
    folder = save_random("hf:tiny-llama", tmp_path / "llama", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    result = shardwise(
        "train", "--model", "hf:tiny-llama", "--init-from", str(folder), "--strategy", "zero3",
        "--nproc", "2", "--steps", "5", "--run-dir", str(tmp_path / "run"), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result)
    defaults = load_config(None, {"model.kind": "hf:tiny-llama"})  # float32, as the command ran
    assert abs(summary["initial_loss"] - reference_loss(folder, defaults)) <= 1e-5, summary
    assert summary["final_loss"] < summary["initial_loss"], summary
    assert "cast" not in result.stderr  # float32 weights into a float32 run: nothing to say


@pytest.mark.slow
def test_verify_zero3_from_saved_weights_says_the_cast_once(tmp_path: Path) -> None:
    folder = save_random("hf:tiny-gpt2", tmp_path / "gpt2")
    result = shardwise(
        "verify", "--model", "hf:tiny-gpt2", "--init-from", str(folder), "--strategy", "zero3",
        "--nproc", "2", "--seq-len", "32", "--json",
    )  # fmt: skip
    report = last_json(result)
    assert result.returncode == 0 and report["ok"] and report["max_param_diff"] <= 1e-10, report
    assert result.stderr.count("weights cast to the run's dtype (float32 -> float64), exactly") == 1


def test_an_init_from_without_safetensors_is_one_line_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cli.main`` in this process, as ``python -m shardwise`` runs it (exit 2, one line, no pid file)."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "pytorch_model.bin").write_bytes(b"not read")
    line = refusal(
        ["train", "--init-from", str(weights), "--nproc", "2", "--steps", "1"], tmp_path / "run", capsys
    )
    assert "holds no .safetensors file" in line, line


@pytest.mark.slow
def test_a_shardwise_export_is_a_starting_point_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Train, export the checkpoint to one file, load it, or load the checkpoint itself: the parameters
    are the trained ones (the tied head is in the file once, as wte.weight); verify from the checkpoint
    under tp 2 (each rank reading its boxes) equals one process."""
    from shardwise.checkpoint.pretrained import load_pretrained
    from shardwise.train.loop import param_digest

    run = tmp_path / "run"
    result = shardwise(
        "train", "--preset", "tiny", "--strategy", "zero3", "--nproc", "2", "--steps", "2",
        "--checkpoint-every", "2", "--run-dir", str(run), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    exported = tmp_path / "model.safetensors"
    code, err = in_process(["ckpt", "export", str(run), str(exported)], capsys)  # cli.main here: no rank
    assert code == 0, err[-3000:]
    for source in (exported, run / "checkpoints"):  # the export, or the checkpoint itself
        model = build_model(load_config(None, {"model.preset": "tiny"}).model, meta=True)
        load_pretrained(model, str(source))
        assert param_digest(dict(model.named_parameters())) == last_json(result)["final_param_digest"]
    # the checkpoint read box by box into another layout's parts (tp 2), against one process reading it
    result = shardwise(
        "verify", "--preset", "tiny", "--init-from", str(run / "checkpoints"), "--strategy", "zero3",
        "--tp", "2", "--nproc", "2", "--json",
    )  # fmt: skip
    report = last_json(result)
    assert result.returncode == 0 and report["ok"] and report["layout"] == "dp1 x pp1 x tp2", report
    result = shardwise(  # the exported file, each pipeline stage reading its own tensors
        "verify", "--preset", "tiny", "--init-from", str(exported), "--strategy", "zero1", "--pp", "2",
        "--nproc", "2", "--json",
    )  # fmt: skip
    report = last_json(result)
    assert result.returncode == 0 and report["ok"] and report["layout"].startswith("dp1 x pp2 x tp1"), report
