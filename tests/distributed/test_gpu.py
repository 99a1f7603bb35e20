"""The checks that need a GPU (``shardwise bench gpu``'s parts, made small). Where there is no CUDA
they are skipped, and the skip says so; ``shardwise bench gpu`` then skips in one line (tested here).
On a machine with one GPU: world size 1 on CUDA equals the CPU one-process run, ranks sharing the GPU
(CUDA tensors over gloo) equal one process, and the overhead measurement against plain PyTorch runs
(its figures go to benchmarks/results, never into an assertion)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardwise.commands.bench_gpu import _verify_config
from shardwise.device import CUDA_BACKEND_ENV

from .cli_helpers import in_process, shardwise

NO_CUDA = "no CUDA on this machine: the GPU checks need a GPU (run `shardwise bench gpu` on one)"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@needs_cuda
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_world_size_1_on_cuda_equals_the_cpu_one_process_run(strategy: str) -> None:
    from shardwise.commands.verify import run_verify

    report = run_verify(_verify_config({"strategy": strategy}), 1)
    assert report["ok"], report
    assert report["max_param_diff"] <= 1e-10


@needs_cuda
@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [
        (2, {"strategy": "ddp"}),
        (2, {"strategy": "zero2"}),
        (2, {"strategy": "zero3"}),
        (2, {"strategy": "ddp", "parallel.tp": "2"}),
        (2, {"strategy": "ddp", "parallel.pp": "2", "data.micro_batches": "4"}),
        (4, {"strategy": "zero1"}),
    ],
    ids=["ddp-2", "zero2-2", "zero3-2", "tp2", "pp2", "zero1-4"],
)
def test_ranks_sharing_the_gpu_over_gloo_equal_one_process(
    nproc: int, overrides: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardwise.commands.verify import run_verify

    monkeypatch.setitem(os.environ, CUDA_BACKEND_ENV, "gloo")
    report = run_verify(_verify_config(overrides), nproc)
    assert report["ok"], report


@needs_cuda
def test_the_overhead_measurement_runs_and_writes_its_result(tmp_path: Path) -> None:
    args = ["bench", "gpu", "--parts", "overhead", "--steps", "8", "--rounds", "1", "--preset", "tiny"]
    result = shardwise(*args, "--out-dir", str(tmp_path), timeout_s=600)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "gpu-overhead.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the line is for those without")
def test_bench_gpu_without_cuda_skips_in_one_line(tmp_path: Path) -> None:
    result = shardwise("bench", "gpu", "--out-dir", str(tmp_path))
    assert result.returncode == 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardwise bench gpu: skipped: this machine has no CUDA")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--parts", "nonsense"], "--parts: unknown nonsense; choose from world1, shared, overhead"),
        (["--parts", ","], "--parts: none given"),
        (["--rounds", "0"], "--steps and --rounds must be at least 1"),
    ],
)
def test_bench_gpu_refuses_bad_arguments_with_or_without_cuda(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = in_process(["bench", "gpu", *argv, "--out-dir", str(tmp_path)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0], err
    assert not list(tmp_path.iterdir())


def test_the_overhead_worker_times_each_side_s_host_phases_here_too() -> None:
    """The overhead's per-phase host times (what says where our extra time goes on a GPU) come from
    the same worker on the CPU: each side's step, its forward and backward, its update, the rest."""
    from shardwise.bench.gpu_overhead import WARMUP_STEPS, overhead_worker
    from shardwise.config import load_config
    from shardwise.launcher import launch_local

    overrides = {"device": "cpu", "model.preset": "tiny", "steps": str(WARMUP_STEPS + 3)}
    config = load_config(None, {**overrides, "data.global_batch": "4", "model.seq_len": "16"})
    for side in ("shardwise", "torch"):
        row = launch_local(overhead_worker, (side, config), 1)[0]
        host = row["host_ms"]
        assert set(host) == {"step", "forward_backward", "update", "rest"}, (side, host)
        assert 0 < host["forward_backward"] <= host["step"] and 0 < host["update"] <= host["step"], host
        assert host["rest"] >= 0, host
        assert row["tokens_per_s"] > 0
