"""The train loop's one-line notices on stderr (``train.loop._announce``): what a user would miss."""

from __future__ import annotations

import pytest

from shardwise.config import load_config
from shardwise.train.loop import _announce


@pytest.mark.parametrize(
    ("pp", "micro_batches", "said"), [(2, 1, "50%"), (4, 2, "60%"), (2, 2, None), (1, 1, None)]
)
def test_a_pipeline_with_fewer_micro_batches_than_stages_is_said(
    capsys: pytest.CaptureFixture[str], pp: int, micro_batches: int, said: str | None
) -> None:
    overrides = {"parallel.pp": str(pp), "data.micro_batches": str(micro_batches), "data.global_batch": "8"}
    _announce(load_config(None, overrides), None, 0, 0)
    err = capsys.readouterr().err
    if said is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and f"bubble (p-1)/(m+p-1) = {said}" in err
        assert f"--micro-batches {4 * pp}, say" in err
