"""Where a pipeline posts its messages (``pipeline/tied.py``): on a thread of their own over gloo, at
once on the compute thread over NCCL; a message posted at once is waited for as one handed over."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import torch

from shardwise.collectives.comm_thread import CommThread
from shardwise.pipeline.tied import TAG, Posted, posting_thread


class _Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


def test_the_posting_thread_is_gloos_alone() -> None:
    assert isinstance(posting_thread(SimpleNamespace(device_type="cpu", cuda_over_gloo=False)), CommThread)
    assert isinstance(posting_thread(SimpleNamespace(device_type="cuda", cuda_over_gloo=True)), CommThread)
    assert posting_thread(SimpleNamespace(device_type="cuda", cuda_over_gloo=False)) is None


def test_a_message_is_posted_at_once_without_a_thread_and_on_the_thread_with_one() -> None:
    calls: list[tuple[Any, ...]] = []
    work = _Work()

    def post(tensor: torch.Tensor, peer: int, tag: int) -> _Work:
        calls.append((threading.current_thread().name, peer, tag))
        return work

    tensor = torch.zeros(2)
    at_once = Posted(None, post, tensor, 3)
    assert calls == [(threading.current_thread().name, 3, TAG)] and not work.waited
    assert at_once.wait() and work.waited

    calls.clear()
    handed = Posted(CommThread(), post, tensor, 1)
    assert handed.wait()
    assert calls == [("shardwise-comm", 1, TAG)]
