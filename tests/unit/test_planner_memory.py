"""The planner's memory arithmetic: parameter counts, model states, activations, buffers, layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.config import ConfigError, ModelConfig
from shardwise.models import build_model, count_parameters
from shardwise.models.adapters import hf_shape, preset_shape
from shardwise.planner.activations import block_activations, korthikanti_layer_bytes
from shardwise.planner.calibration import Calibration
from shardwise.planner.layout import Layout, Training, model_states, zero_formula
from shardwise.planner.memory import estimate_memory
from shardwise.planner.model import ModelShape

PSI = 1_000_000


@pytest.mark.parametrize("preset", ["tiny", "odd", "small", "large"])
@pytest.mark.parametrize("tie", [True, False])
def test_preset_shape_counts_what_the_built_model_holds(preset: str, tie: bool) -> None:
    cfg = ModelConfig(kind="gpt", preset=preset, seq_len=32, tie_weights=tie)
    with torch.device("meta"):
        model = build_model(cfg, meta=True)
    assert preset_shape(preset, 32, tie).params == count_parameters(model)


def test_hf_llama_shape_counts_what_transformers_builds() -> None:
    transformers = pytest.importorskip("transformers")
    shape = hf_shape("hf:tiny-llama")
    config = transformers.AutoConfig.from_pretrained(
        str(Path(__file__).parents[2] / "src/shardwise/models/configs/tiny-llama.json")
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape.params == count_parameters(model)
    assert shape.gated_mlp and shape.kv_heads == 2 and not shape.layer_norm


def test_llama3_8b_from_its_config_has_8_03b_parameters(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf_shape(f"hf:{tmp_path}").params == 8_030_261_248  # Meta's published 8.03B


def test_an_unreadable_config_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        hf_shape(f"hf:{tmp_path}")
    with pytest.raises(ConfigError, match="known presets"):
        preset_shape("huge", 64)


def test_model_states_fp32_and_mixed_by_stage() -> None:
    n = 4
    assert model_states(PSI, "ddp", n, "fp32", 2).total == 16 * PSI  # 4 + 4 + 8
    assert model_states(PSI, "zero1", n, "fp32", 2).total == 8 * PSI + 8 * PSI / n
    assert model_states(PSI, "zero2", n, "fp32", 2).total == 4 * PSI + 12 * PSI / n
    assert model_states(PSI, "zero3", n, "fp32", 2).total == 16 * PSI / n
    assert model_states(PSI, "ddp", n, "bf16", 2).total == 16 * PSI  # fp32 parameters under autocast
    assert model_states(PSI, "zero1", n, "bf16", 2).total == 4 * PSI + 16 * PSI / n
    assert model_states(PSI, "zero2", n, "bf16", 2).total == 2 * PSI + 16 * PSI / n
    assert model_states(PSI, "zero3", n, "bf16", 2).total == 16 * PSI / n  # no bf16 shard is kept
    assert model_states(PSI, "zero2", n, "fp32", 0).optimizer_state == 0  # plain SGD
    assert model_states(PSI, "ddp", n, "fp32", 1, param_bytes=8).total == 24 * PSI  # float64, momentum


def test_zero_formula_moved_keeps_its_fp32_figures() -> None:
    for stage, expected in ((1, 8 * PSI + 8 * PSI / 4), (2, 4 * PSI + 12 * PSI / 4), (3, 16 * PSI / 4)):
        assert zero_formula(PSI, stage, 4, "fp32", 4, 2)["model_state"] == expected
    assert zero_formula(PSI, 3, 4, "fp32", 4, 2, frozen_bytes=10)["params"] == 4 * PSI / 4 + 10
    from shardwise.zero.memory import zero_formula as reexported

    assert reexported is zero_formula


def test_our_block_at_16_bits_is_korthikantis_34_sbh_without_masks_and_attention_matrix() -> None:
    s, b, h, a = 128, 4, 256, 8
    shape = ModelShape(n_layer=1, d_model=h, n_head=a, vocab=256)
    ours = block_activations(shape, s * b, compute_bytes=2, residual_bytes=2).full
    extras = s * b * (2 * 2 * 4 + 4 * a)  # fp32 norm statistics and the attention's log-sum-exp
    assert ours == (34 - 2) * s * b * h + extras  # no dropout: no 1-byte masks after attention and MLP
    assert korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    # tensor parallelism: 10 whole + 24/t split; sequence parallelism splits all
    assert korthikanti_layer_bytes(s, b, h, a, tp=4) == s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4))
    assert (
        korthikanti_layer_bytes(s, b, h, a, tp=4, sequence_parallel=True)
        == s * b * h * (34 + 5 * a * s / h) / 4
    )
    assert korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * s * b * h
    # ours under tp: norm and matmul inputs stay whole (8 sbh: Korthikanti's 10 less the masks), the rest
    # splits (24 sbh, as there)
    tp4 = block_activations(shape, s * b, 2, 2, tp=4).full
    assert tp4 == s * b * h * (8 + 24 / 4) + s * b * (16 + 4 * a / 4)
    sp4 = block_activations(shape, s * b, 2, 2, tp=4, sequence_parallel=True).full
    assert sp4 == pytest.approx(32 * s * b * h / 4 + s * b * (16 + 4 * a) / 4)


def _estimate(layout: Layout, precision: str = "fp32", batch: int = 8) -> dict[str, float]:
    shape = preset_shape("large", 64)
    return estimate_memory(shape, Training(batch, 64, precision), layout).device


def test_checkpointing_keeps_one_input_per_block_and_rebuilds_one_block() -> None:
    shape = preset_shape("large", 64)
    tokens = 8 * 64
    acts = block_activations(shape, tokens, 4, 4)
    plain, ckpt = _estimate(Layout("ddp")), _estimate(Layout("ddp", activation_checkpointing=True))
    head = tokens * shape.d_model * 8
    assert plain["activations"] == shape.n_layer * acts.full + head
    assert ckpt["activations"] == shape.n_layer * tokens * shape.d_model * 4 + head
    assert ckpt["recomputed_block"] == acts.full and ckpt["logits"] == plain["logits"]
    assert plain["logits"] == tokens * 256 * 16  # logits, log-softmax and both gradients, fp32


def test_micro_batches_divide_the_activations_not_the_model_states() -> None:
    one, four = _estimate(Layout("zero2", dp=2)), _estimate(Layout("zero2", dp=2, micro_batches=4))
    assert four["activations"] == pytest.approx(one["activations"] / 4)
    assert four["grads"] == one["grads"]
    with pytest.raises(ConfigError, match=r"dp\(2\) x micro_batches\(3\) = 6"):
        _estimate(Layout("zero2", dp=2, micro_batches=3))


def test_buffers_by_strategy() -> None:
    shape = preset_shape("large", 64)
    psi = shape.params
    assert "reduce_buffers" not in _estimate(Layout("ddp", dp=2))  # the gradients are the buckets
    assert _estimate(Layout("ddp", dp=2), "bf16")["autocast_weights"] == 2 * psi
    assert _estimate(Layout("zero1", dp=2), "bf16")["reduce_buffers"] == 4 * psi
    assert _estimate(Layout("zero2", dp=2, bucket_mb=1))["reduce_buffers"] == 3 * 2**20
    assert _estimate(Layout("zero2", dp=2, bucket_mb=1000))["reduce_buffers"] == 4 * psi  # one bucket
    z3 = _estimate(Layout("zero3", dp=2))
    assert (
        z3["gathered_root"] == 4 * shape.root_params and z3["gathered_blocks"] == 2 * 4 * shape.block_params
    )
    no_prefetch = _estimate(Layout("zero3", dp=2, prefetch=False))
    assert no_prefetch["gathered_blocks"] == 4 * shape.block_params


def test_the_peak_is_the_fullest_phase() -> None:
    """Activations are gone when ZeRO-2/3's gradient shards arrive; the logits before buckets fill."""
    shape = preset_shape("large", 64)
    z2 = estimate_memory(shape, Training(8, 64), Layout("zero2", dp=2))
    always = z2.device["params"] + z2.device["optimizer_state"]
    assert z2.in_phase("forward") == always + z2.device["activations"] + z2.device["logits"]
    assert z2.in_phase("backward") == always + z2.device["activations"] + z2.device["reduce_buffers"]
    assert z2.in_phase("step") == always + z2.device["grads"]  # the reductions, then the update's temporaries
    assert z2.in_phase("update") == always + z2.device["grads"] + z2.device["optimizer_temporaries"]
    assert z2.total == max(z2.in_phase(p) for p in ("build", "forward", "backward", "step", "update"))
    assert z2.total < sum(z2.device.values())
    assert z2.peak_phase == "backward"
    assert {name for name, _ in z2.largest(10)} == {
        "params",
        "optimizer_state",
        "activations",
        "reduce_buffers",
    }


def test_offload_moves_masters_and_moments_to_the_host() -> None:
    shape = preset_shape("large", 64)
    train = Training(8, 64, "bf16")
    on = estimate_memory(shape, train, Layout("zero3", dp=4, offload="cpu"))
    off = estimate_memory(shape, train, Layout("zero3", dp=4))
    assert on.device["master_params"] == on.device["optimizer_state"] == 0
    assert on.host_total == off.device["master_params"] + off.device["optimizer_state"]
    # and Adam's two temporaries of a unit's shard go with the step, to the host
    temporaries = off.device["optimizer_temporaries"]
    assert (
        temporaries == 2 * 4 * max(shape.block_params, shape.root_params) / 4
        and "optimizer_temporaries" not in on.device
    )
    assert off.in_phase("update") - on.in_phase("update") == pytest.approx(on.host_total + temporaries)
    with pytest.raises(ConfigError, match="not to ddp"):
        Layout("ddp", offload="cpu")


def test_overhead_is_one_constant_and_ps_workers_keep_no_optimizer() -> None:
    shape = preset_shape("large", 64)
    train = Training(8, 64)
    base = estimate_memory(shape, train, Layout("ddp"))
    more = estimate_memory(shape, train, Layout("ddp"), Calibration(overhead_bytes=1e8))
    assert more.total - base.total == 1e8
    ps = estimate_memory(shape, train, Layout("ps", dp=2)).device
    assert ps["optimizer_state"] == 0 and ps["ps_messages"] == 8 * shape.params


def test_pipeline_micro_batches_in_flight_come_from_the_pipelines_validator() -> None:
    """1F1B holds min(m, pp) micro-batches on its first stage, GPipe all m; an interleaved schedule's
    pairs are each 1/v of a rank's blocks. The figures are the validator's (pipeline.validate), per
    rank, and each rank is charged its own: GPipe's first rank holds twice 1F1B's at m = 2 pp."""
    from shardwise.planner.memory import estimate_ranks
    from shardwise.planner.pipeline import pair_peak, rank_shares

    large = preset_shape("large", 64)
    first = rank_shares(large, 4, "1f1b", 1)[0]
    assert pair_peak(first, 4, "1f1b", 8, 1.0, 1.0) == 4
    assert pair_peak(first, 4, "1f1b", 2, 1.0, 1.0) == 2
    assert pair_peak(first, 4, "gpipe", 8, 1.0, 1.0) == 8
    interleaved = rank_shares(large, 2, "interleaved", 2)[0]
    assert interleaved.stages == 2 and pair_peak(interleaved, 2, "interleaved", 4, 1.0, 1.0) == 5
    train = Training(8, 64)
    one_f_one_b = estimate_ranks(large, train, Layout("ddp", pp=4, micro_batches=8))[0].device
    gpipe = estimate_ranks(large, train, Layout("ddp", pp=4, micro_batches=8, schedule="gpipe"))[0].device
    assert gpipe["activations"] == pytest.approx(2 * one_f_one_b["activations"])  # no head on rank 0
    assert Layout("ddp", pp=4, micro_batches=8, schedule="gpipe").name() == "ddp dp1-pp4 mb8 gpipe"
    with pytest.raises(ConfigError, match="zbv holds two stages per rank"):
        Layout("ddp", pp=2, micro_batches=4, schedule="zbv")


def test_each_pipeline_rank_is_charged_its_own_share() -> None:
    """The small preset on 2 stages (5 blocks: 3 on the first, 2 on the last, as the split balances
    them, the head's matrix counted on the last): the first rank holds the embeddings and 2
    micro-batches of 3 blocks, the last 2 blocks, the head, the logits and a copy of the tied
    embedding, one micro-batch in flight under 1F1B and two under ZB-H1 (one of them only what its W
    reads); the first is the heavier. Measured (``TensorBytes``, 3 steps, global batch 8, seq 64;
    each rank's peak, predicted / measured): 1F1B 0.91-1.02 (DDP, ZeRO-1/2/3, with and without
    checkpointing), ZB-H1 0.85-1.14, ZB-V 0.84-0.95 (2 blocks on the last stage before: 0.88-1.02,
    0.86-1.16, 0.81-1.03 by the same measure)."""
    from shardwise.planner.memory import estimate_ranks
    from shardwise.planner.pipeline import rank_shares

    small, train = preset_shape("small", 64), Training(8, 64)
    first, last = rank_shares(small, 2, "1f1b", 1)
    assert (first.blocks, first.first, first.tied_copy) == (3, True, False)
    assert (last.blocks, last.last, last.tied_copy) == (2, True, True)
    ranks = estimate_ranks(small, train, Layout("ddp", pp=2, micro_batches=4))
    assert "logits" not in ranks[0].device and "tied_copy" in ranks[1].device
    assert estimate_memory(small, train, Layout("ddp", pp=2, micro_batches=4)).pp_rank == 0
    zb = estimate_ranks(small, train, Layout("ddp", pp=2, micro_batches=4, schedule="zb"))[1].device
    assert zb["activations"] > ranks[1].device["activations"]  # a W's inputs wait beside a forward


def test_a_head_reading_a_tied_copy_keeps_nothing_from_i_to_w() -> None:
    """Under zb the last stage's head keeps its input and the logits' gradient from I to W, but not
    where it reads the tied embedding's copy: that head's dW comes in I (``pipeline/deferred``); under
    1F1B there is no W, so tying changes nothing there."""
    from shardwise.planner.memory import estimate_ranks

    train = Training(8, 64)

    def last(tie: bool, schedule: str) -> float:
        layout = Layout("ddp", pp=2, micro_batches=4, schedule=schedule)
        return estimate_ranks(preset_shape("small", 64, tie), train, layout)[1].device["activations"]

    assert last(False, "zb") > last(True, "zb")
    assert last(False, "1f1b") == last(True, "1f1b")


def test_gradients_held_between_micro_batches_by_stage() -> None:
    """Measured with ``plan --check``'s machinery (base preset, global batch 16, seq 64, 2 ranks;
    predicted / measured peak): zero2 dp2 at 4 micro-batches 1.08, zero3 dp2 at 4 1.00, zero2 on a
    2-stage 1F1B at 4 0.97, zero3 there 1.00; before these terms 0.84, 0.83, 0.96 and 0.90."""
    base, training = preset_shape("base", 64), Training(16, 64)

    def estimate(layout: Layout) -> tuple[dict[str, float], dict[str, tuple[str, ...]]]:
        found = estimate_memory(base, training, layout)
        return found.device, found.phases

    device, phases = estimate(Layout("zero2", dp=2, micro_batches=4))
    assert device["accumulated_grads"] == 4 * base.params  # full, under no_sync
    assert phases["accumulated_grads"] == ("forward", "backward")
    assert phases["reduce_buffers"] == ("backward",)
    device, phases = estimate(Layout("zero3", dp=2, micro_batches=4))
    assert "accumulated_grads" not in device and phases["grads"] == ("forward", "backward", "step", "update")
    device, phases = estimate(Layout("zero3", dp=1, pp=2, micro_batches=4))
    assert device["accumulated_grads"] == device["params"]  # a full flat buffer per unit, at dp 1
    assert phases["reduce_buffers"] == ("step",)  # one reduce-scatter, after the pipeline's last backward
    for strategy in ("zero2", "zero3"):  # one micro-batch: the shard arrives at the step alone
        device, phases = estimate(Layout(strategy, dp=2))
        assert "accumulated_grads" not in device and phases["grads"] == ("step", "update")


# The build's peak tensor bytes per rank (``TensorBytes`` around ``Trainer.build``; the large GPT,
# 2 ranks, seq 64): the model made on meta, each rank reading only what it holds. Measured this session.
BUILD_MEASURED_MB = {
    ("ddp", 2, 1, 1, "fp32"): 795.8,
    ("zero1", 2, 1, 1, "fp32"): 796.6,
    ("zero2", 2, 1, 1, "fp32"): 402.1,
    ("zero3", 2, 1, 1, "fp32"): 217.3,
    ("ddp", 2, 1, 1, "bf16"): 795.8,
    ("zero1", 2, 1, 1, "bf16"): 597.7,
    ("zero2", 2, 1, 1, "bf16"): 413.5,
    ("zero3", 2, 1, 1, "bf16"): 203.1,
    ("ddp", 1, 1, 2, "fp32"): 202.3,
    ("zero3", 1, 1, 2, "fp32"): 203.4,
    ("zero2", 1, 2, 1, "fp32"): 203.6,
    ("zero3", 1, 2, 1, "fp32"): 203.6,
}


def test_the_build_is_what_the_rank_holds_within_10_percent_of_the_measured() -> None:
    """Before the model was built on meta every rank made the whole model first (596.7 MB at
    dp 2 x tp 2); now ZeRO-3 builds its shard plus one unit's instant, tp and pp their part."""
    large = preset_shape("large", 64)
    ratios = {}
    for (strategy, dp, pp, tp, precision), measured in BUILD_MEASURED_MB.items():
        layout = Layout(strategy, dp=dp, pp=pp, tp=tp, micro_batches=2 if pp > 1 else 1)
        predicted = estimate_memory(large, Training(8, 64, precision), layout).device["model_build"]
        ratios[layout.name() + " " + precision] = predicted / (measured * 1e6)
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


def test_zero3_builds_its_shard_not_the_model() -> None:
    """The ZeRO paper's 7.5B on 64 devices: the build is under the rank's model state, not the peak."""
    paper = ModelShape(n_layer=36, d_model=4096, n_head=32, vocab=50257, positions=64)
    found = estimate_memory(paper, Training(64, 64, "bf16", "adam"), Layout("zero3", dp=64))
    state = sum(found.device[k] for k in ("params", "master_params", "grads", "optimizer_state"))
    assert found.device["model_build"] <= 1.1 * state and found.peak_phase != "build"


def _stage_params(shape: ModelShape, tp: int) -> float:
    return (shape.n_layer * shape.block_params + shape.root_params) / tp
