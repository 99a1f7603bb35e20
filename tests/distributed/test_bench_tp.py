"""``shardwise bench tp`` end to end on 2 ranks with tiny settings: the report's keys, and that our
collectives per block, measured from ``CommStats`` over a step, are Megatron's count (ops and bytes)
with and without sequence parallelism. No timing is asserted."""

from __future__ import annotations

import pytest

from shardwise.testing import run_on_ranks

from .cli_helpers import last_json, shardwise

pytestmark = pytest.mark.slow


def test_bench_tp_reports_both_sides_and_megatrons_count() -> None:
    args = ["--nproc", "2", "--steps", "1", "--repeats", "1", "--preset", "tiny", "--global-batch", "2"]
    result = shardwise("bench", "tp", *args, "--seq-len", "16", "--json", timeout_s=400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result)
    assert {"nproc", "preset", "steps", "repeats", "load_avg_1m", "rows"} <= set(report)
    assert set(report["rows"]) == {"tp", "tp+sp"}
    for name, row in report["rows"].items():
        for side in ("ours", "dtensor"):
            assert set(row[side]) == {"tokens_per_s", "step_s", "peak_at", "peak_tensor_bytes_per_rank"}
            assert len(row[side]["peak_tensor_bytes_per_rank"]) == 2
            assert all(b > 0 for b in row[side]["peak_tensor_bytes_per_rank"])
        assert row["speed_ratio"] > 0 and row["memory_ratio"] > 0
        blocks = row["collectives_per_block"]
        assert blocks["matches_megatron"], (name, blocks)
        assert blocks["measured"]["ops"] == blocks["megatron"]["ops"]
        assert blocks["measured"]["bytes_sent"] == blocks["megatron"]["bytes_sent"]
    assert report["rows"]["tp"]["collectives_per_block"]["measured"]["ops"] == {"all_reduce": 4}
    sp = report["rows"]["tp+sp"]["collectives_per_block"]["measured"]["ops"]
    assert sp == {"all_gather": 4, "reduce_scatter": 4}


def _dtensor_side_against_one_process(rank: int, world_size: int, sequence_parallel: bool) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from shardwise.bench import tp

    settings = {
        "preset": "tiny",
        "seq_len": 16,
        "batch": 2,
        "steps": 1,
        "sequence_parallel": sequence_parallel,
    }
    config = tp._config(settings, world_size)
    x, y = tp._batch(settings)
    plain = tp._model(config).double()
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten(), reduction="sum").backward()
    model = tp._model(config).double()
    for block in model.blocks:
        block.attn = tp.SplitQKVAttention(block.attn)
    parallelize_module(
        model, init_device_mesh("cpu", (world_size,)), tp._dtensor_plan(model, sequence_parallel)
    )
    with loss_parallel():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
        loss.backward()
    whole = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if ".attn." in name and name.rsplit(".", 2)[-2] in "qkv":  # q/k/v: rows of the fused qkv
            part = "qkv".index(name.rsplit(".", 2)[-2])
            fused = whole[name.replace(f"attn.{'qkv'[part]}.", "attn.qkv.")].grad
            width = grad.shape[0]
            expected = fused[part * width : (part + 1) * width]
        else:
            expected = whole[name].grad
        assert torch.allclose(grad, expected, rtol=0, atol=1e-10), name


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_dtensor_side_trains_the_same_model(sequence_parallel: bool) -> None:
    """The comparison is fair only if DTensor's side (split q/k/v, its plan) computes our model's
    gradients: float64, every parameter against one process."""
    run_on_ranks(_dtensor_side_against_one_process, 2, sequence_parallel, timeout_s=200)
