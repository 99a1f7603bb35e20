"""dp-compare: measured bytes per step per rank against the theory written beside them."""

from __future__ import annotations

import pytest

from shardwise.bench.dp_compare import run_dp_compare, tiny_model
from shardwise.data_parallel.ps_messages import PUSH_EXTRA, REPLY_EXTRA


@pytest.mark.slow  # two spawns of three ranks
def test_measured_bytes_match_theory() -> None:
    report = run_dp_compare(3, steps=2, global_batch=6, seq_len=4, vocab=16, dim=8, timeout_s=60)
    rows = {r["strategy"]: r for r in report["rows"]}
    single = rows["single_process"]
    assert single["bytes_sent_per_step"] == single["theory_bytes_sent_per_step"]
    ps = rows["parameter_server"]
    assert ps["roles"] == ["server", "worker", "worker"]
    # the only difference from theory is the few header slots (float32) carried by each message, and
    # a push's used flag per parameter
    push_extra = (PUSH_EXTRA + len(list(tiny_model(16, 8).parameters()))) * 4
    header_out = [2 * REPLY_EXTRA * 4, push_extra, push_extra]
    for got, theory, header in zip(
        ps["bytes_sent_per_step"], ps["theory_bytes_sent_per_step"], header_out, strict=True
    ):
        assert got - theory == header
    assert ps["exchanges_per_step"] == [4.0, 2.0, 2.0]
    ring = rows["allreduce"]
    for got, theory in zip(ring["bytes_sent_per_step"], ring["theory_bytes_sent_per_step"], strict=True):
        assert abs(got - theory) < 1.0
