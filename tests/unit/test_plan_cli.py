"""``shardwise plan``: the ranked table or JSON, and each bad input as one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.config import ConfigError
from shardwise.planner.units import parse_bytes, parse_rate

LLAMA3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
}  # fmt: skip
MACHINE = ["--devices", "8", "--device-memory", "80GB", "--link", "400Gbit"]


def test_sizes_and_rates_read_their_units_and_case_decides() -> None:
    """``B`` is a byte and ``b`` or ``bit`` a bit, whatever the prefix's case (lower-cased, 400Gb/s
    was read as 400 GB/s and 50GBps as 50 Gbit/s)."""
    assert parse_bytes("80GB") == 80e9 and parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("512B") == 512
    assert parse_bytes("80 gB") == 80e9 and parse_bytes("2KiB") == 2048 and parse_bytes("3 bytes") == 3
    for bits in ("400Gbit", "400Gb/s", "400Gbps", "400 gbit", "400gbps", "400Gbits/s"):
        assert parse_rate(bits) == 5e10, bits
    for nbytes in ("50GB/s", "50GBps", "50 GB", "50gB/s", "50GBytes/s"):
        assert parse_rate(nbytes) == 5e10, nbytes
    assert parse_rate("1Gibit") == 2**30 / 8 and parse_rate("100mbit") == 12.5e6
    for bare in ("80", "1.5e9", "80G", "80XB", "1GiiB"):  # no unit, or none we know: refused, not guessed
        with pytest.raises(ConfigError, match="give a number with a unit"):
            parse_bytes(bare)
    for bits in ("512b", "80Gb", "1Gbit"):  # memory is counted in bytes
        with pytest.raises(ConfigError, match=r"is in bits \(b\); memory is counted in bytes"):
            parse_bytes(bits)
    with pytest.raises(ConfigError, match="is a rate; give an amount of memory"):
        parse_bytes("80GB/s")
    for wrong in ("-80GB", "0GB", "1e999GB"):
        with pytest.raises(ConfigError, match="must be a finite amount > 0"):
            parse_bytes(wrong)
    assert parse_bytes("0GB", "--overhead", zero_ok=True) == 0


@pytest.mark.parametrize("link", ["400Gb/s", "50GBps"])
def test_the_link_is_read_in_the_unit_its_case_names(link: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--preset", "large", "--devices", "8", "--device-memory", "80GB", "--link", link]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["machine"]["link_bytes_per_s"] == 5e10
    assert main([*argv, "--top", "3", "--overhead", "1GB"]) == 0
    first = capsys.readouterr().out.splitlines()[0]  # the machine it planned for, the link in both units
    assert "8 devices x 80.0 GB, link 50 GB/s (400 Gbit/s) at 10 us, 1.00 GB overhead per process" in first


def test_llama3_8b_on_eight_h100s_prints_a_ranked_list_with_reasons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    argv = ["plan", "--model", f"hf:{tmp_path}", *MACHINE, "--seq-len", "4096", "--global-batch", "64"]
    assert main([*argv, "--precision", "bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["params"] == 8_030_261_248
    ranked, dropped = result["ranked"], result["dropped"]
    assert ranked and all(row["fits"] and row["reason"] and row["memory_bytes"] <= 80e9 for row in ranked)
    assert [row["rank"] for row in ranked] == list(range(1, len(ranked) + 1))
    assert [row["step_time_s"] for row in ranked] == sorted(row["step_time_s"] for row in ranked)
    assert dropped and all("> 80.0" in row["reason"] for row in dropped)
    assert result["why"].startswith(f"{ranked[0]['layout']} wins: ")
    assert main([*argv, "--precision", "bf16", "--top", "3"]) == 0
    table = capsys.readouterr().out
    assert "wins:" in table and f"... {len(ranked) - 3} more that fit" in table and "dropped" in table
    rows = [line for line in table.splitlines() if line[:3].strip() in ("1", "2", "3")]
    for row, line in zip(ranked[:3], rows, strict=True):  # each row names its largest part at the peak
        name, nbytes = row["memory_largest"]
        assert line.endswith(f"{name} {nbytes / 1e9:.2f} ({row['memory_peak_phase']})"), line
    assert main([*argv, "--precision", "bf16", "--top", "0"]) == 0
    assert f"... {len(ranked)} more that fit" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "large"], "give the target machine: --devices, --device-memory, --link"),
        ([*MACHINE], "give one model: --preset NAME, --model hf:PATH, or --layers L"),
        (["--preset", "large", "--layers", "2", *MACHINE], "(got --preset and --layers...)"),
        (
            ["--layers", "2", "--hidden", "64", *MACHINE],
            "need all of --layers, --hidden, --heads and --vocab",
        ),
        (["--layers", "2", "--hidden", "64", "--heads", "5", "--vocab", "9", *MACHINE], "d_model(64) is not"),
        (["--preset", "huge", *MACHINE], "unknown gpt preset 'huge'"),
        (["--model", "gpt", *MACHINE], "the planner reads hf:PATH configs"),
        (["--model", "hf:/no/such", *MACHINE], "does not exist"),
        (
            ["--preset", "large", "--devices", "2", "--device-memory", "80XB", "--link", "1Gbit"],
            "80GB or 80GiB",
        ),
        # each used to be read wrongly, or reported as something else
        (["--preset", "large", *MACHINE, "--seq-len", "0"], "--seq-len must be an integer >= 1, got 0"),
        (["--preset", "large", *MACHINE, "--top", "-1"], "--top must be an integer >= 0, got -1"),
        (
            ["--layers", "0", "--hidden", "64", "--heads", "4", "--vocab", "9", *MACHINE],
            "--layers must be an integer >= 1, got 0",
        ),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "0", *MACHINE],
            "--vocab must be an integer >= 1, got 0",
        ),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "9", "--ffn", "0", *MACHINE],
            "--ffn must be an integer >= 1, got 0",
        ),
        (
            ["--preset", "large", "--devices", "8", "--device-memory", "-80GB", "--link", "1Gbit"],
            "--device-memory must be a finite amount > 0, got '-80GB'",
        ),
        (["--preset", "large", *MACHINE, "--overhead", "-1GB"], "--overhead must be a finite amount >= 0"),
        (["--preset", "large", *MACHINE, "--overhead", "1Gbit"], "--overhead '1Gbit' is in bits"),
        (
            ["--preset", "large", "--devices", "8", "--device-memory", "80Gb", "--link", "1Gbit"],
            "--device-memory '80Gb' is in bits (b); memory is counted in bytes (B)",
        ),
        (
            ["--preset", "large", "--devices", "8", "--device-memory", "80GB", "--link", "-1Gbit"],
            "--link must be a finite amount > 0",
        ),
        (
            ["--preset", "large", "--devices", "8", "--device-memory", "80GB", "--link", "400G"],
            "--link '400G': give a number with a unit, e.g. 400Gbit, 400Gb/s or 50GB/s",
        ),
        (["--preset", "large", "--devices", "2", "--device-memory", "1e999GB", "--link", "1Gbit"], "finite"),
        (
            ["--preset", "large", "--devices", "0", "--device-memory", "1GB", "--link", "1Gbit"],
            "devices must be",
        ),
        (["--preset", "large", *MACHINE, "--strategies", "zero4"], "--strategies: zero4; choose from"),
        (["--preset", "large", *MACHINE, "--global-batch", "0"], "global_batch and seq_len must be >= 1"),
        (
            ["--preset", "large", *MACHINE, "--global-batch", "5", "--pp", "1", "--tp", "1"],
            "divides global_batch(5)",
        ),
        (["--preset", "large", *MACHINE, "--precision", "fp8"], "precision must be one of"),
        (["--preset", "large", *MACHINE, "--bucket-mb", "nan"], "bucket_mb must be a finite number > 0"),
        (["--preset", "large", *MACHINE, "--flops", "0"], "flops_per_s must be a finite number > 0"),
        (["--preset", "large", *MACHINE, "--link-latency-us", "-1"], "link latency must be >= 0"),
        (["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "9", "--check"], "not sizes by hand"),
        (["--preset", "small", "--check", "--steps", "1"], "--steps >= 2; got 2, 1"),
        (["--preset", "small", "--check", "--nproc", "0"], "--nproc >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise plan: error: ") and message in err[0], err


FIXTURE = Path(__file__).parent.parent / "fixtures" / "llama-3-8b" / "config.json"


def test_the_shipped_llama3_8b_fixture_plans_every_mesh_with_a_reason_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--model", f"hf:{FIXTURE}", *MACHINE, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["params"] == 8_030_261_248  # the published count (embeddings and head untied)
    assert result["training"]["seq_len"] == 4096  # its context (8192), capped: no --seq-len given
    ranked = result["ranked"]
    assert all(row["reason"] for row in ranked)
    assert {row["tp"] for row in ranked} >= {1, 2} and {row["pp"] for row in ranked} >= {1, 2, 4}
    meshes = {(row["dp"], row["pp"], row["tp"]) for row in (*ranked, *result["dropped"])}
    assert len(meshes) == 10  # every dp x pp x tp of 8 devices, tp up to the 8 key-value heads
    assert any(row["activation_checkpointing"] for row in ranked if row["tp"] > 1)
    assert {row["schedule"] for row in ranked if row["pp"] > 1} == {"1f1b", "interleaved"}
    assert "mesh layout" in result["why"]  # the best of each other mesh, and how far behind


def test_the_search_can_be_held_to_given_degrees(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", f"hf:{FIXTURE}", *MACHINE, "--pp", "1", "--tp", "1,2", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [*result["ranked"], *result["dropped"]]
    assert {row["pp"] for row in rows} == {1} and {row["tp"] for row in rows} == {1, 2}
    assert main([*argv[:-1], "--seq-len", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["training"]["seq_len"] == 512
    assert main(["plan", "--model", f"hf:{FIXTURE}", *MACHINE, "--tp", "3"]) == 2
    assert (
        "--tp 3: not a degree this model and machine take; choose from 1, 2, 4, 8" in capsys.readouterr().err
    )
    assert main(["plan", "--model", f"hf:{FIXTURE}", *MACHINE, "--pp", "two"]) == 2
    assert "--pp 'two': give degrees separated by commas" in capsys.readouterr().err


def test_the_first_layout_comes_with_the_train_command_that_runs_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command's flags parse into a config of the same mesh, strategy, schedule and batch."""
    import shlex

    from shardwise.cli import build_parser, config_from_args
    from shardwise.parallelism import check

    assert main(["plan", "--model", f"hf:{FIXTURE}", *MACHINE, "--precision", "bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    first, command = result["ranked"][0], result["run_first"]
    argv = [*shlex.split(command)[1:], "--model", f"hf:{FIXTURE}"]
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    parallel = config.parallel
    assert args.nproc == first["dp"] * first["pp"] * first["tp"] and config.strategy == first["strategy"]
    assert (parallel.pp, parallel.tp, config.data.micro_batches) == (
        first["pp"],
        first["tp"],
        first["micro_batches"],
    )
    assert parallel.activation_checkpointing == first["activation_checkpointing"]
    assert config.data.global_batch == 16 and config.model.seq_len == 4096 and config.precision == "bf16"
    if first["pp"] > 1:
        assert parallel.schedule == first["schedule"]
    check(config)  # the layout is one the library runs, not only one the planner imagines


def test_a_value_that_starts_with_a_dash_reaches_the_commands_own_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """argparse takes ``-80GB`` or ``-1e-3`` for a flag ("expected one argument"); joined to the flag
    before it, the value is checked by the command, which says what is wrong with it."""
    from shardwise.cli import join_dashed_values

    assert join_dashed_values(["plan", "--device-memory", "-80GB", "--top", "-1"]) == [
        "plan", "--device-memory=-80GB", "--top=-1",
    ]  # fmt: skip
    unchanged = [["--", "-1"], ["--set", "-x=1"], ["--link=1Gbit", "-2"], ["plot", "-1"], ["-h"]]
    for argv in unchanged:
        assert join_dashed_values(argv) == argv
    assert main(["train", "--preset", "tiny", "--lr", "-1e-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["shardwise train: error: optim.lr must be a finite number > 0, got -0.001"]
