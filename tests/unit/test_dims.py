"""The axis table (``shardwise.dims``): degrees, rank layout and the groups named for their use."""

from __future__ import annotations

import pytest

from shardwise.config import ConfigError, ParallelConfig, load_config
from shardwise.dims import GROUPS, ParallelDims
from shardwise.parallelism import NotBuiltError, check


def _old_hybrid_groups(dp: int, pp: int, tp: int, replicate: int) -> tuple[list[list[int]], list[list[int]]]:
    """The hand-built hybrid groups the mesh had before the table (kept here as the reference)."""
    ranks = [[[(d * pp + p) * tp + t for t in range(tp)] for p in range(pp)] for d in range(dp)]
    shard = dp // replicate
    shards, replicas = [], []
    for p in range(pp):
        for t in range(tp):
            column = [ranks[d][p][t] for d in range(dp)]
            shards += [column[r * shard : (r + 1) * shard] for r in range(replicate)]
            replicas += [column[s::shard] for s in range(shard)]
    return shards, replicas


def test_the_layout_is_dp_pp_tp_row_major_with_tp_fastest() -> None:
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert dims.rank_groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert dims.rank_groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert dims.rank_groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert dims.rank_groups("norm") == [tuple(range(8))]
    assert dims.label == "dp2 x pp2 x tp2"


@pytest.mark.parametrize(
    ("dp", "pp", "tp", "replicate"), [(4, 1, 1, 2), (4, 2, 2, 2), (6, 1, 2, 3), (4, 1, 1, 4)]
)
def test_hybrid_groups_are_the_ones_built_by_hand_before(dp: int, pp: int, tp: int, replicate: int) -> None:
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, dp_replicate=replicate)
    shards, replicas = _old_hybrid_groups(dp, pp, tp, replicate)
    assert sorted(dims.rank_groups("dp_shard")) == sorted(map(tuple, shards))
    assert sorted(dims.rank_groups("dp_replicate")) == sorted(map(tuple, replicas))
    assert dims.rank_groups("dp") == ParallelDims(dp=dp, pp=pp, tp=tp).rank_groups("dp")


def test_servers_stand_outside_the_mesh() -> None:
    dims = ParallelDims(dp=3, servers=2)
    assert dims.coordinates(1) is None
    assert dims.rank_groups("dp") == [(2, 3, 4)]
    assert dims.world_size == 5 and dims.trainers == 3


def test_groups_named_for_their_use() -> None:
    dims = ParallelDims(dp=4, pp=2, cp=2, ep=4)
    batch = dims.rank_groups("batch")  # dp x cp: tokens counted, loss summed
    assert batch == dims.rank_groups("dense_grads") and all(len(g) == 8 for g in batch)
    assert all(len(g) == 4 for g in dims.rank_groups("ep"))  # carved from dp_shard x cp
    experts = dims.rank_groups("expert_grads")  # the ranks of dp x cp that hold the same experts
    assert all(len(g) == 8 // 4 for g in experts)
    for ep_group in dims.rank_groups("ep"):  # an expert group and an expert-gradient group share one rank
        assert all(len(set(ep_group) & set(e)) <= 1 for e in experts)
    for name in GROUPS:  # every group name covers the mesh once
        ranks = [r for g in dims.rank_groups(name) for r in g]
        assert sorted(ranks) == list(range(dims.trainers)), name
    assert dims.sizes()["norm"] == 16


def test_arithmetic_in_the_errors() -> None:
    with pytest.raises(ConfigError, match=r"parallel.dp_replicate = 3 does not divide dp = 4"):
        ParallelDims(dp=4, dp_replicate=3)
    with pytest.raises(ConfigError, match=r"parallel.ep = 3 does not divide dp_shard\(4\) x cp\(1\) = 4"):
        ParallelDims(dp=4, ep=3)
    with pytest.raises(ConfigError, match=r"cp\(2\) x pp\(1\) x tp\(2\) = 4 does not divide the world of 6"):
        ParallelDims.build(ParallelConfig(cp=2, tp=2), 6)
    assert ParallelDims.build(ParallelConfig(cp=2), 8).dp == 4


@pytest.mark.parametrize(("key", "what"), [("cp", "context"), ("ep", "expert")])
def test_cp_and_ep_are_in_the_table_and_refused_until_built(key: str, what: str) -> None:
    config = load_config(None, {f"parallel.{key}": "2"})
    assert config.validate(4).dims(4).degrees[key] == 2
    with pytest.raises(NotBuiltError, match=rf"^{what} parallelism \(--{key} 2\) is not built yet"):
        check(config)
