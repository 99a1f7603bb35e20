"""Test helpers shipped with shardwise, so users can check their own models the same way we do."""

from shardwise.testing.harness import RankFailure, run_on_ranks
from shardwise.testing.parity import ParityReport, assert_parity, compare_tensors

__all__ = ["ParityReport", "RankFailure", "assert_parity", "compare_tensors", "run_on_ranks"]
