"""Devices without a GPU: the backend follows the device (CUDA mocked), every tensor factory in the
library names its device, and the device-less check fails where one allocation of a step ignores it."""

from __future__ import annotations

import ast
import linecache
import os
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise import device as devices
from shardwise import launcher
from shardwise.collectives.api import check_algorithm
from shardwise.config import ConfigError
from shardwise.observe.monitor import Monitor
from shardwise.testing.devices import SOURCE_ROOT, DeviceLess


# -- the process group follows the device -------------------------------------------------------------
@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """This machine seen as one with two GPUs; ``set_device`` calls are recorded, none made."""
    chosen: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv(devices.CUDA_BACKEND_ENV, raising=False)
    return chosen


@pytest.fixture
def joined(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``init_process_group``'s arguments, recorded instead of joining (a world of one, no store)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(key, raising=False)
    return calls


@pytest.mark.parametrize("setting", ["auto", "cuda"])
def test_a_cuda_rank_joins_gloo_and_nccl_bound_to_its_gpu(
    setting: str, two_gpus: list[Any], joined: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    launcher.init_distributed(timeout_s=5, device=setting)
    (call,) = joined
    assert call["backend"] == "cpu:gloo,cuda:nccl"
    assert call["device_id"] == torch.device("cuda", 1)
    assert two_gpus == [torch.device("cuda", 1)]  # the GPU set from LOCAL_RANK before joining
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_a_cpu_rank_joins_gloo_alone(joined: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    launcher.init_distributed(timeout_s=5)  # auto, on a machine without CUDA
    (call,) = joined
    assert call["backend"] == "gloo" and "device_id" not in call


def test_cpu_on_a_gpu_machine_joins_gloo_alone(
    two_gpus: list[Any], joined: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    launcher.init_distributed(timeout_s=5, device="cpu")
    assert joined[0]["backend"] == "gloo" and not two_gpus


def test_the_shared_gpu_test_bed_joins_gloo_with_ranks_taking_the_gpus_in_turn(
    two_gpus: list[Any], joined: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(devices.CUDA_BACKEND_ENV, "gloo")
    monkeypatch.setenv("LOCAL_RANK", "3")
    devices.check_device("cuda", 4)  # more ranks than GPUs: allowed here, gloo shares them
    launcher.init_distributed(timeout_s=5, device="cuda")
    assert joined[0]["backend"] == "gloo" and "device_id" not in joined[0]
    assert two_gpus == [torch.device("cuda", 1)]


@pytest.mark.parametrize(
    ("backend", "carrier"), [("cpu:gloo,cuda:nccl", "nccl"), ("gloo", "gloo"), ("nccl", "nccl")]
)
def test_comm_knows_what_carries_cuda_tensors(
    backend: str, carrier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardwise.collectives import api

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert api._cuda_backend(None) == carrier


def test_auto_means_a_gpu_per_local_rank_and_nproc_follows(two_gpus: list[Any]) -> None:
    assert devices.device_type("auto") == "cuda" and devices.default_nproc("auto") == 2
    assert devices.default_nproc("cpu") == 1


def test_no_caller_of_init_distributed_fixes_a_backend() -> None:
    """Every call passes the run's device (or none: auto), never a backend."""
    for path in sorted(SOURCE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(getattr(node, "func", None), "id", None) or getattr(
                getattr(node, "func", None), "attr", None
            )
            if isinstance(node, ast.Call) and name == "init_distributed":
                assert not any(k.arg == "backend" for k in node.keywords), path
                assert len(node.args) <= 2, path


# -- what a machine without CUDA says -----------------------------------------------------------------
def test_cuda_asked_for_without_cuda_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device = cuda, but this machine has no CUDA.*--device cpu"):
        devices.check_device("cuda", 2)


def test_more_ranks_than_gpus_is_one_line(two_gpus: list[Any]) -> None:
    with pytest.raises(ConfigError, match=r"3 local ranks on cuda, but this machine has 2 GPUs"):
        devices.check_device("auto", 3)
    devices.check_device("auto", 2)
    devices.check_device("cpu", 8)


def test_verify_on_cuda_without_cuda_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardwise.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["verify", "--device", "cuda", "--nproc", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("shardwise verify: error: device = cuda, but this machine has no CUDA device")


@pytest.mark.parametrize(
    ("backend", "device", "aside"),
    [("cpu:gloo,cuda:nccl", "cuda", False), ("cpu:gloo,cuda:nccl", "cpu", True), ("gloo", "cuda", True)],
)
def test_a_receive_posted_early_stands_aside_on_gloo_alone(
    backend: str, device: str, aside: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline posts every receive at once, early, where it holds up nothing (gloo), and in
    the one order both ends keep where NCCL's stream would stall behind it (``pipeline/messages.py``)."""
    from shardwise.collectives import api

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(api, "next_tag_slot", lambda group: 0)
    assert api.Comm(None, device_type=device).receives_stand_aside is aside


def test_the_explicit_algorithms_are_refused_on_nccl() -> None:
    for algorithm in ("ring", "tree", "halving_doubling", "naive"):
        with pytest.raises(ConfigError, match=f"comm.algorithm = {algorithm} runs on tagged send/recv"):
            check_algorithm(algorithm, "cuda")
        check_algorithm(algorithm, "cpu")
    check_algorithm("native", "cuda")
    check_algorithm("auto", "cuda")


def test_a_pipeline_over_nccl_is_accepted_its_transfers_ordered(two_gpus: list[Any]) -> None:
    """Its messages are posted in one order at both ends of every pair (``pipeline/messages.py``,
    held for every schedule by ``test_pipeline_messages``), as NCCL pairs them: nothing refused."""
    from shardwise.config import load_config
    from shardwise.parallelism import check

    check(load_config(None, {"parallel.pp": "2", "model.preset": "odd-deep"}))
    check(load_config(None, {"parallel.pp": "2", "model.preset": "odd-deep", "device": "cpu"}))


# -- batches, memory --------------------------------------------------------------------------------
def test_batches_already_on_the_device_are_not_copied() -> None:
    x, y = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    moved = devices.to_device({"input_ids": x, "labels": [y, (y, 3)]}, devices.HOST)
    assert moved["input_ids"] is x and moved["labels"][0] is y and moved["labels"][1] == (y, 3)
    pair = devices.to_device((x, y), torch.device("meta"))
    assert isinstance(pair, tuple) and pair[0].is_meta and pair[1].shape == (2, 3)


def test_memory_on_the_cpu_is_the_resident_set() -> None:
    memory = devices.memory_mb(devices.HOST)
    assert memory["peak_mb"] == memory["peak_rss_mb"] >= memory["rss_mb"] > 0
    assert "max_memory_allocated_mb" not in memory


def test_memory_on_a_gpu_reads_the_allocators_peaks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[Any] = []

    def stats(device: Any) -> dict[str, Any]:
        reads.append(device)
        return {
            "allocated_bytes": {"all": {"current": 1, "peak": 3 * 2**20}, "large_pool": {"peak": 7}},
            "reserved_bytes": {"all": {"current": 2, "peak": 5 * 2**20}},
        }

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    memory = devices.memory_mb(torch.device("cuda", 0))
    assert memory["max_memory_allocated_mb"] == memory["peak_mb"] == 3.0
    assert memory["max_memory_reserved_mb"] == 5.0 and len(reads) == 1
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: {})  # not initialised
    assert devices.memory_mb(torch.device("cuda", 0))["max_memory_allocated_mb"] == 0.0


# -- the watchdog still sees a GPU collective that wait() let go -------------------------------------
class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_a_collective_still_running_on_the_gpu_is_what_the_rank_waits_in() -> None:
    monitor = Monitor()
    call = monitor.issue("dp", "all_reduce", 7, "bucket 2")
    call.issued -= 40  # issued 40 s ago; its wait() returned at once (NCCL)
    work = _Work()
    monitor.in_flight(call, work)
    snapshot = monitor.snapshot()
    assert snapshot["blocked"]["op"] == "all_reduce" and snapshot["blocked"]["seq"] == 7
    assert snapshot["blocked_for_s"] >= 40
    work.done = True
    later, finished = monitor.issue("dp", "all_reduce", 8), _Work()
    finished.done = True
    monitor.in_flight(later, finished)
    assert monitor.snapshot()["blocked"] is None
    assert [c for c, _ in monitor.pending] == [later]  # the completed one was dropped


# -- every tensor factory in the library names its device ---------------------------------------------
FACTORIES = {"arange", "as_tensor", "asarray", "empty", "eye", "full", "linspace", "ones", "rand"}
FACTORIES |= {"randint", "randn", "randperm", "range", "scalar_tensor", "tensor", "zeros"}


def test_every_tensor_factory_in_the_library_names_a_device() -> None:
    """The static half of the check (``DeviceLess`` is the running half): ``torch.<factory>(...)``
    anywhere under src/shardwise passes ``device=`` (its tensors', the batch's, or HOST)."""
    missing = []
    for path in sorted(SOURCE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if (
                isinstance(node, ast.Call)
                and isinstance(func, ast.Attribute)
                and func.attr in FACTORIES
                and isinstance(func.value, ast.Name)
                and func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                missing.append(f"{path.relative_to(SOURCE_ROOT)}:{node.lineno} torch.{func.attr}")
    assert not missing, "\n".join(missing)


# -- the device-less check, and that it fails where a step's allocation ignores the device ------------
@pytest.fixture
def compiled_as() -> Iterator[Any]:
    """``compiled_as(path, source)``: ``source`` run as a module whose code lives at ``path`` (what the
    check looks at), its lines readable there while the test runs (``linecache``, as tracebacks read)."""
    paths: list[str] = []

    def compile_as(path: Path, source: str) -> ModuleType:
        module = ModuleType(f"mutated_{path.stem}")
        module.__file__ = str(path)
        linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
        paths.append(str(path))
        exec(compile(source, str(path), "exec"), module.__dict__)
        return module

    yield compile_as
    for path in paths:
        linecache.cache.pop(path, None)


def test_device_less_redirects_only_the_library_s_own_calls(compiled_as: Any) -> None:
    source = "import torch\ndef make():\n    return torch.zeros(2)\n"
    ours = compiled_as(SOURCE_ROOT / "engine" / "x.py", source)
    with DeviceLess() as found:
        assert ours.make().is_meta
        assert not torch.zeros(2).is_meta  # this test's own call: left alone
        assert not torch.zeros(2, device="cpu").is_meta
    assert found.calls == ["shardwise/engine/x.py:3 in make"]


class _OneParameter:
    """What ``run_passes`` asks of an engine, over one CPU parameter."""

    def __init__(self) -> None:
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.device = self.weight.device

    def no_sync(self) -> Any:
        return nullcontext()

    def compute_loss(self, batch: torch.Tensor) -> torch.Tensor:
        return (self.weight * batch).sum()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


STEP = SOURCE_ROOT / "engine" / "step.py"
ACCUMULATOR = "device=engine.device)  # read once, after the step"


def test_the_step_s_accumulator_on_its_device_passes(compiled_as: Any) -> None:
    engine, batches = _OneParameter(), [torch.ones(3), torch.full((3,), 2.0)]
    with DeviceLess() as found:
        share = compiled_as(STEP, STEP.read_text()).run_passes(engine, batches, 3.0)
    assert not found.calls and float(share) == pytest.approx(3.0)


def test_the_check_fails_when_the_step_s_accumulator_ignores_the_device(compiled_as: Any) -> None:
    """One allocation of the step changed to ignore the device (the loss accumulator made without
    ``device=``): the step fails, and the check names the line."""
    source = STEP.read_text()
    assert source.count(ACCUMULATOR) == 1
    mutated = compiled_as(STEP, source.replace(ACCUMULATOR, ")  # device-less"))
    engine, batches = _OneParameter(), [torch.ones(3), torch.full((3,), 2.0)]
    with DeviceLess() as found, pytest.raises((RuntimeError, NotImplementedError)):
        float(mutated.run_passes(engine, batches, 3.0))
    assert len(found.calls) == 1 and found.calls[0].startswith("shardwise/engine/step.py:")
    assert found.calls[0].endswith("in run_passes")
