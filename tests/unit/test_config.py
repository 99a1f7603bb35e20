from __future__ import annotations

import pytest

from shardwise.config import ConfigError, ParallelConfig, TrainConfig, load_config


def test_mesh_arithmetic_is_spelled_out() -> None:
    with pytest.raises(ConfigError, match=r"dp\(3\) x pp\(1\) x tp\(2\) = 6, but the world has 4 ranks"):
        ParallelConfig(dp=3, tp=2).resolve(4)
    assert ParallelConfig(tp=2).resolve(4).dp == 2
    with pytest.raises(ConfigError, match="does not divide"):
        ParallelConfig(tp=3).resolve(4)


def test_overrides_are_typed() -> None:
    config = load_config(None, {"data.weights": ".25,.25,.10,.40", "ddp.bucket_mb": "4", "steps": "7"})
    assert config.data.weights == (0.25, 0.25, 0.10, 0.40)
    assert config.ddp.bucket_mb == 4.0 and config.steps == 7
    assert load_config(None, {"ddp.find_unused_parameters": "true"}).ddp.find_unused_parameters


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"steps": "many"}, 2, "steps expects int, got 'many'"),
        ({"nope": "1"}, 2, "unknown config key 'nope'"),
        ({"strategy": "magic"}, 2, "strategy must be one of"),
        ({"data.weights": "1,1,1"}, 2, "data.weights has 3 entries but there are 2 data-parallel ranks"),
        ({"data.weights": "1,-1"}, 2, "must be >= 0"),
        ({"data.global_batch": "2"}, 4, r"global_batch\(2\) is smaller than the 4"),
        ({"strategy": "ps", "ps.servers": "2"}, 2, "2 ranks - 2 servers = 0 workers"),
        ({"on_nonfinite": "ignore"}, 1, "on_nonfinite must be one of stop, skip; got 'ignore'"),
    ],
)
def test_bad_configs_name_the_problem(overrides: dict[str, str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides).validate(world)


def test_toml_file(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('strategy = "ddp"\nsteps = 3\n[data]\nglobal_batch = 8\n[model]\npreset = "tiny"\n')
    config = load_config(path, {"steps": "4"})
    assert (config.steps, config.data.global_batch, config.model.preset) == (4, 8, "tiny")
    path.write_text("[nosuch]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown config table \[nosuch\]"):
        load_config(path)
    assert isinstance(TrainConfig().validate(1), TrainConfig)
