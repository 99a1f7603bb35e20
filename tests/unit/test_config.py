from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any

import pytest

from shardwise.config import (
    MIN_CORPUS_BYTES,
    RULE,
    VAL_FRACTION,
    ConfigError,
    DataConfig,
    ParallelConfig,
    Range,
    TrainConfig,
    load_config,
)

BOOL = re.escape("bool (true/false, yes/no or 1/0)")


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
        (
            {"data.weights": "1,-1"},
            2,
            r"data.weights entries must each be a finite number >= 0, got \[1.0, -1.0\]",
        ),
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


# -- every value checked before a rank starts ---------------------------------------------------------

BAD_VALUES = [
    ("optim.lr", "inf", "optim.lr must be a finite number > 0, got inf"),
    ("optim.lr", "nan", "optim.lr must be a finite number > 0, got nan"),
    ("optim.lr", "0", "optim.lr must be a finite number > 0, got 0.0"),
    ("optim.beta1", "1", r"optim.beta1 must be a finite number in \[0, 1\), got 1.0"),
    ("optim.beta2", "-0.1", r"optim.beta2 must be a finite number in \[0, 1\), got -0.1"),
    ("optim.weight_decay", "-1", "optim.weight_decay must be a finite number >= 0, got -1.0"),
    ("optim.momentum", "1.5", r"optim.momentum must be a finite number in \[0, 1\), got 1.5"),
    ("model.dropout", "1", r"model.dropout must be a finite number in \[0, 1\), got 1.0"),
    ("model.seq_len", "0", "model.seq_len must be an integer >= 1, got 0"),
    ("data.global_batch", "0", "data.global_batch must be an integer >= 1, got 0"),
    ("data.micro_batches", "0", "data.micro_batches must be an integer >= 1, got 0"),
    ("data.weights", "nan", r"data.weights entries must each be a finite number >= 0, got \[nan\]"),
    ("ddp.bucket_mb", "nan", "ddp.bucket_mb must be a finite number > 0, got nan"),
    ("ddp.bucket_mb", "0", "ddp.bucket_mb must be a finite number > 0, got 0.0"),
    ("ddp.first_bucket_mb", "-1", "ddp.first_bucket_mb must be a finite number > 0, got -1.0"),
    ("zero.bucket_mb", "inf", "zero.bucket_mb must be a finite number > 0, got inf"),
    ("ps.max_staleness", "-1", "ps.max_staleness must be an integer >= 0, got -1"),
    ("ps.servers", "0", "ps.servers must be an integer >= 1, got 0"),
    ("checkpoint.every", "-3", "checkpoint.every must be an integer >= 0, got -3"),
    ("checkpoint.keep", "-1", "checkpoint.keep must be an integer >= 0, got -1"),
    ("eval_every", "-1", "eval_every must be an integer >= 0, got -1"),
    ("max_restarts", "-1", "max_restarts must be an integer >= 0, got -1"),
    ("timeout_s", "0", "timeout_s must be a finite number >= 1, got 0.0"),
    ("timeout_s", "inf", "timeout_s must be a finite number >= 1, got inf"),
    ("seed", "-1", r"seed must be an integer in \[0, 4294967295\], got -1"),
    ("parallel.dp", "0", "parallel.dp must be an integer >= 1, or -1 for what the world leaves, got 0"),
    ("run_dir", "", "run_dir must be a folder path, got ''"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_VALUES)
def test_each_bad_value_is_named_with_its_range(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_config(None, {key: value}).validate(1)


def _leaves(config: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, field, type) of every value field, tables walked."""
    hints = typing.get_type_hints(type(config))
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out += _leaves(value, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f, hints[f.name]))
    return out


NUMBERS = [(key, f) for key, f, hint in _leaves(TrainConfig()) if hint in (int, float, tuple[float, ...])]


def test_every_number_declares_its_range() -> None:
    missing = [key for key, f in NUMBERS if not isinstance(f.metadata.get(RULE), Range)]
    assert not missing, f"numeric config fields without a declared Range: {missing}"


@pytest.mark.parametrize("key", [key for key, f, hint in _leaves(TrainConfig()) if hint is float])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_takes_nan_or_inf(key: str, value: str) -> None:
    rule = dict(NUMBERS)[key].metadata[RULE]
    if float(value) in rule.also:  # declared meaningful (optim.clip_grad_norm = inf: never clip)
        load_config(None, {key: value}).validate(1)
        return
    with pytest.raises(ConfigError, match=f"^{re.escape(key)} must be a finite number"):
        load_config(None, {key: value}).validate(1)


def test_the_defaults_pass_and_the_corpus_constants_agree() -> None:
    from shardwise.data import corpus

    assert TrainConfig().validate(1).parallel.dp == 1
    assert (MIN_CORPUS_BYTES, VAL_FRACTION) == (corpus.MIN_BYTES, corpus.VAL_FRACTION)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"model": "gpt"},
            r"^model is a table, not a value \(got 'gpt'\); set its keys, e.g. --set model.kind=gpt",
        ),
        (
            {"data": "32"},
            r"^data is a table, not a value \(got '32'\); set its keys, e.g. --set data.global_batch=16",
        ),
        ({"model.": "gpt"}, r"^model is a table"),
        ({"checkpoint": "x"}, r"--set checkpoint.every=0"),
    ],
)
def test_a_table_given_a_plain_value_says_so(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_table_of_the_wrong_type_is_refused_by_validate() -> None:
    config = dataclasses.replace(TrainConfig(), data=32)  # built in code, not through set_key
    with pytest.raises(ConfigError, match=r"^data is a table, not a value \(got 32\)"):
        config.validate(1)
    with pytest.raises(ConfigError, match=r"^steps must be an integer, got '3'"):
        dataclasses.replace(TrainConfig(), steps="3").validate(1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('model = "gpt"\n', r"^model is a table, not a value \(got 'gpt'\); set its keys"),
        ("[optim]\nlr = nan\n", "^optim.lr must be a finite number > 0, got nan$"),
        ("[model]\nseq_len = 0\n", "^model.seq_len must be an integer >= 1, got 0$"),
        ("[ddp]\nbucket_mb = nan\n", "^ddp.bucket_mb must be a finite number > 0, got nan$"),
        ("steps = true\n", "^steps expects int, got True$"),
        ("steps = 2.5\n", "^steps expects int, got 2.5$"),
        ("steps = inf\n", "^steps expects int, got inf$"),
        ("run_dir = 5\n", "^run_dir expects str, got 5$"),
        ("[ddp]\nbroadcast_buffers = 1\n", "^ddp.broadcast_buffers expects " + BOOL + ", got 1$"),
        ("[data]\nweights = 3\n", "^data.weights expects a comma-separated list of float, got 3$"),
        ("[steps]\nx = 1\n", r"^unknown config table \[steps\]"),
    ],
)
def test_toml_values_are_checked_like_flags(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path).validate(1)


def test_a_config_that_is_no_toml_file_is_one_line(tmp_path) -> None:
    binary = tmp_path / "bin.toml"
    binary.write_bytes(bytes(range(256)))
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = \n[[\n")
    cases = {
        tmp_path: "is a folder; give a TOML file",
        binary: r"is not a text file \(byte 128 is not UTF-8\)",
        tmp_path / "missing.toml": "does not exist",
        broken: "is not valid TOML: ",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=f"^--config {re.escape(str(path))} {message}") as info:
            load_config(path)
        assert "\n" not in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_config_is_one_line(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("steps = 3\n")
    path.chmod(0)
    with pytest.raises(ConfigError, match=r"cannot be read: Permission denied$"):
        load_config(path)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"data.weights": "0,0"}, 2, "must be >= 0 with a positive sum"),
        (
            {"model.seq_len": "1000", "data.corpus_bytes": "4096"},
            1,
            r"raise data.corpus_bytes to at least 10010",
        ),
        ({"data.corpus_bytes": "100"}, 1, "data.corpus_bytes must be an integer >= 1024, got 100"),
    ],
)
def test_values_that_only_fail_together(overrides: dict[str, str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides).validate(world)


def test_settings_of_another_strategy_are_refused_through_the_api_and_toml(tmp_path) -> None:
    """The one table (``STRATEGY_KEYS``) is checked by ``validate``: a dataclass built in Python and a
    TOML file are refused as the flags are, every ignored setting named in one line."""
    from shardwise.config import DiLoCoConfig, PSConfig, ZeroConfig

    config = TrainConfig(
        strategy="ddp", ps=PSConfig(servers=2, mode="async"), diloco=DiLoCoConfig(sync_every=4)
    )
    with pytest.raises(ConfigError) as info:
        config.validate(2)
    assert str(info.value) == (
        "ddp does not read ps.servers = 2 (ps only), ps.mode = 'async' (ps only), diloco.sync_every = 4 "
        "(diloco only): remove them or choose the strategy they belong to"
    )
    path = tmp_path / "run.toml"
    path.write_text('strategy = "zero3"\n[zero]\nbucket_mb = 4.0\n')
    with pytest.raises(ConfigError, match=r"^zero3 does not read zero.bucket_mb = 4.0 \(zero1/zero2 only\)"):
        load_config(path).validate(2)
    # what the strategy reads passes, and a setting left at its default is never refused
    TrainConfig(strategy="ps", ps=PSConfig(servers=2, mode="async")).validate(3)
    TrainConfig(strategy="zero3", zero=ZeroConfig(prefetch=True, offload="cpu")).validate(2)
    load_config(None, {"strategy": "diloco", "ps.servers": "1"}).validate(2)


def test_every_strategy_key_names_a_field_and_strategy() -> None:
    from shardwise.config import STRATEGIES, STRATEGY_KEYS

    for key, strategies in STRATEGY_KEYS.items():
        node: Any = TrainConfig()
        for part in key.split("."):
            node = getattr(node, part)  # an AttributeError names a key that no longer exists
        assert set(strategies) <= set(STRATEGIES), key


def test_virtual_stages_default_to_the_schedules_own() -> None:
    from shardwise.config import ParallelConfig

    own = {s: ParallelConfig(pp=2, schedule=s).stages_per_rank for s in ("1f1b", "gpipe", "zb")}
    assert own == {"1f1b": 1, "gpipe": 1, "zb": 1}
    for schedule in ("interleaved", "interleaved-zb", "zbv", "dualpipev"):
        assert ParallelConfig(pp=2, schedule=schedule).stages_per_rank == 2
    assert ParallelConfig(pp=2, schedule="interleaved", virtual_stages=3).stages_per_rank == 3
    assert ParallelConfig(pp=2, schedule="zbv", virtual_stages=1).stages_per_rank == 1  # refused later


def test_micro_batches_stop_at_the_rows_of_the_rank_with_the_most() -> None:
    """Up to the most rows a rank has a step (global batch x its share): a rank with fewer, or none,
    runs empty micro-batches as before; one more is refused with the arithmetic, through the API too."""
    TrainConfig(data=DataConfig(global_batch=16, micro_batches=8)).validate(2)  # 8 rows each
    TrainConfig(data=DataConfig(global_batch=16, micro_batches=16, weights=(1.0, 0.0))).validate(2)
    TrainConfig(data=DataConfig(global_batch=15, micro_batches=8)).validate(2)  # 8 + 7
    for data, message in [
        (DataConfig(global_batch=16, micro_batches=9), r"data.global_batch\(16\) / dp\(2\) = 8 rows"),
        (
            DataConfig(global_batch=16, micro_batches=17, weights=(1.0, 0.0)),
            r"x the share of dp rank 0 \(1 of data.weights \[1.0, 0.0\]\) = 16 rows",
        ),
    ]:
        with pytest.raises(ConfigError, match=rf"^data.micro_batches\({data.micro_batches}\) is .*{message}"):
            TrainConfig(data=data).validate(2)


def test_comma_lists_refuse_empty_items_and_read_an_empty_string_as_none() -> None:
    assert load_config(None, {"model.freeze": ""}).model.freeze == ()
    assert load_config(None, {"parallel.pp_split": "blocks.1, blocks.2"}).parallel.pp_split == (
        "blocks.1",
        "blocks.2",
    )
    for value in (",", "blocks.1,", ",,"):
        with pytest.raises(ConfigError, match=r"^parallel.pp_split has an empty item in"):
            load_config(None, {"parallel.pp_split": value})


@pytest.mark.parametrize(
    ("overrides", "world", "described"),
    [
        ({}, 2, "dp2 x pp1 x tp1"),
        ({"data.micro_batches": "2"}, 2, "dp2 x pp1 x tp1, 2 micro-batches"),
        (
            {"strategy": "zero3", "parallel.dp_replicate": "2"},
            4,
            "dp4 x pp1 x tp1, hybrid sharding: zero3 over 2 ranks x 2 replicas",
        ),
        (
            {"parallel.pp": "2", "parallel.schedule": "interleaved", "parallel.pp_split": "a,b,c"},
            4,
            "dp2 x pp2 x tp1, interleaved schedule, 2 stages per rank, split at a,b,c, 1 micro-batch",
        ),
        (
            {"parallel.tp": "2", "parallel.sequence_parallel": "1", "parallel.activation_checkpointing": "1"},
            2,
            "dp1 x pp1 x tp2, sequence parallel, activation checkpointing",
        ),
    ],
)
def test_the_layout_in_words_names_what_shapes_a_step(
    overrides: dict[str, str], world: int, described: str
) -> None:
    from shardwise.config import describe_layout

    config = load_config(None, overrides).validate(world)
    assert describe_layout(config, config.dims(world)) == described
