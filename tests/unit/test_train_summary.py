"""The train command's text summary: the pipeline's stages in a few characters."""

from __future__ import annotations

from shardwise.commands.train import stage_blocks


def test_each_stage_is_its_first_and_last_block() -> None:
    assert stage_blocks([[0, 1, 2], [3, 4]]) == "0-2 | 3-4"
    assert stage_blocks([[0], [1, 2], [3]]) == "0 | 1-2 | 3"
