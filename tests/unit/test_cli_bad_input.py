"""Every bad input found by trying the command line as a new user and as an attacker would.

Each one: exit code 2, exactly one line on stderr naming the key, and no rank started (no
``<run-dir>/pids`` folder: every rank writes its pid there first). ``cli.main`` runs in this process,
as ``python -m shardwise`` would run it; tests/distributed/test_bad_input.py runs a few for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.cli import main

BAD_INPUTS = [
    # values that used to train to the end on NaN, or never train, and exit 0
    (["--lr", "inf"], "optim.lr must be a finite number > 0, got inf"),
    (["--global-batch", "0", "--data-weights", "1"], "data.global_batch must be an integer >= 1, got 0"),
    (["--nproc", "2", "--data-weights", "0,0"], "data.weights must be >= 0 with a positive sum"),
    (["--strategy", "ps", "--nproc", "2", "--ps-mode", "async", "--max-staleness", "-1"], "ps.max_staleness"),
    (["--checkpoint-every", "-3"], "checkpoint.every must be an integer >= 0, got -3"),
    # a preset beside a model it cannot size (it was ignored without a word)
    (["--model", "hf:tiny-gpt2"], "--preset tiny sizes the built-in models (gpt, mlp); model.kind 'hf:tiny"),
    # a table set to a plain value
    (
        ["--set", "model=gpt"],
        "model is a table, not a value (got 'gpt'); set its keys, e.g. --set model.kind=gpt",
    ),
    (["--set", "data=32"], "data is a table, not a value (got '32'); set its keys"),
    (["--config", "{table_toml}"], "model is a table, not a value (got 'gpt')"),
    # failures that came after the work
    (["--checkpoint-dir", "{file}/sub"], "checkpoint.dir = '{file}/sub' cannot be written: Not a directory"),
    (["--max-restarts", "-1"], "max_restarts must be an integer >= 0, got -1"),
    # tracebacks
    (["--config", "{tmp}"], "--config {tmp} is a folder; give a TOML file"),
    (["--config", "{binary}"], "--config {binary} is not a text file"),
    (["--config", "{nan_toml}"], "optim.lr must be a finite number > 0, got nan"),
    (["--seq-len", "0"], "model.seq_len must be an integer >= 1, got 0"),
    (["--bucket-mb", "nan"], "ddp.bucket_mb must be a finite number > 0, got nan"),
    (["--run-dir", "{file}"], "run_dir = '{file}' is a file, not a folder"),
    (
        ["--strategy", "zero1", "--offload", "disk", "--set", "zero.offload_dir={file}/sub"],
        "zero.offload_dir = '{file}/sub' cannot be written",
    ),
    (["--timeout-s", "0"], "timeout_s must be a finite number >= 1, got 0.0"),
    # axes in the table that are not built yet
    (["--nproc", "2", "--cp", "2"], "context parallelism (--cp 2) is not built yet; set parallel.cp = 1"),
    (["--nproc", "2", "--ep", "2"], "expert parallelism (--ep 2) is not built yet; set parallel.ep = 1"),
    # the rest of the ranges
    (["--set", "checkpoint.keep=-1"], "checkpoint.keep must be an integer >= 0, got -1"),
    (["--strategy", "ps", "--servers", "0"], "ps.servers must be an integer >= 1, got 0"),
    (["--micro-batches", "0"], "data.micro_batches must be an integer >= 1, got 0"),
    (["--eval-every", "-1"], "eval_every must be an integer >= 0, got -1"),
    (["--strategy", "zero2", "--set", "zero.bucket_mb=0"], "zero.bucket_mb must be a finite number > 0"),
    (["--set", "optim.beta1=1"], "optim.beta1 must be a finite number in [0, 1), got 1.0"),
    (["--set", "optim.beta2=nan"], "optim.beta2 must be a finite number in [0, 1), got nan"),
    (["--set", "optim.weight_decay=-1"], "optim.weight_decay must be a finite number >= 0, got -1.0"),
    (
        ["--optimizer", "sgd", "--set", "optim.momentum=-0.5"],
        "optim.momentum must be a finite number in [0, 1)",
    ),
    (["--set", "model.dropout=1"], "model.dropout must be a finite number in [0, 1), got 1.0"),
    # settings of another strategy, which used to train as if they were not there and exit 0
    (
        ["--nproc", "2", "--strategy", "ddp", "--servers", "2", "--steps", "2"],
        "ddp does not read ps.servers = 2 (ps only): remove it or choose the strategy it belongs to",
    ),
    (
        ["--strategy", "ddp", "--servers", "2", "--ps-mode", "async", "--sync-every", "4"],
        "ddp does not read ps.servers = 2 (ps only), ps.mode = 'async' (ps only), diloco.sync_every = 4 "
        "(diloco only): remove them",
    ),
    (["--offload", "cpu"], "ddp does not read zero.offload = 'cpu' (zero1/zero2/zero3 only)"),
    (["--strategy", "zero1", "--find-unused-parameters"], "zero1 does not read ddp.find_unused_parameters"),
    (["--strategy", "zero3", "--set", "zero.bucket_mb=3"], "zero3 does not read zero.bucket_mb = 3.0"),
    (["--strategy", "ps", "--bucket-mb", "8"], "ps does not read ddp.bucket_mb = 8.0 (ddp only)"),
    (["--strategy", "zero2", "--set", "zero.unit=blocks"], "zero2 does not read zero.unit = 'blocks'"),
    (["--strategy", "diloco", "--max-staleness", "2"], "diloco does not read ps.max_staleness = 2"),
    (
        ["--strategy", "zero1", "--set", "zero.offload_dir={tmp}"],
        "zero.offload_dir = '{tmp}' applies to zero.offload = 'disk', not 'none'",
    ),
    # one key given twice: the later one used to win silently
    (["--steps", "3", "--set", "steps=2"], "--steps 3 and --set steps=2 both set steps, to different values"),
    (["--set", "optim.lr=0.1", "--set", "optim.lr=0.2"], "--set optim.lr=0.1 and --set optim.lr=0.2 both"),
    (["--trace", "--set", "trace=false"], "--trace and --set trace=false both set trace"),
    # inputs that used to hang, or fail inside every rank
    (["--config", "/dev/zero"], "--config /dev/zero is not a regular file; give a TOML file"),
    (["--config", "{big_toml}"], "--config {big_toml} is over 1048576 bytes"),
    (
        ["--algorithm", "auto", "--set", "comm.profile={tmp}/none.json"],
        "comm.profile {tmp}/none.json does not exist",
    ),
    (
        ["--algorithm", "auto", "--set", "comm.profile={file}"],
        "comm.profile {file} is not a cost profile (Expecting",
    ),
    (["--algorithm", "auto", "--set", "comm.profile={tmp}"], "comm.profile {tmp} is not a regular file"),
    (
        ["--set", "comm.profile={file}"],
        "comm.profile = '{file}' applies to comm.algorithm = 'auto', not 'native'",
    ),
    (
        ["--seq-len", "200000"],
        "model.seq_len(200000) is longer than the built-in gpt's context of 2048 positions",
    ),
    (
        ["--global-batch", "16", "--set", "eval_batches=1000000000"],
        "eval_batches(1000000000) x data.global_batch(16) = 16000000000 held-out windows, but the held-out "
        "10% of data.corpus_bytes(4000000) = 400000 tokens has 400000 - model.seq_len(64) = 399936 distinct "
        "windows; lower eval_batches to at most 24996",
    ),
    # issue 27: a schedule without a pipeline was ignored, an empty split name read as the default split,
    # and micro-batches far past the rows a rank has hung building action lists (or were OOM-killed)
    (
        ["--schedule", "interleaved"],
        "parallel.schedule = 'interleaved' orders a pipeline's micro-batches, but there is no pipeline",
    ),
    (["--nproc", "2", "--pp", "2", "--pp-split", ",,"], "parallel.pp_split has an empty item in ',,'"),
    (["--set", "model.freeze=wte,,wpe"], "model.freeze has an empty item in 'wte,,wpe' (item 2 of 3)"),
    (
        ["--nproc", "2", "--pp", "2", "--global-batch", "16", "--micro-batches", "100000000"],
        "data.micro_batches(100000000) is more than the rows a rank has a step: data.global_batch(16) / "
        "dp(1) = 16 rows on the rank with the most, so at most 16 micro-batches",
    ),
    (
        ["--nproc", "2", "--strategy", "zero3", "--global-batch", "16", "--micro-batches", "100000"],
        "data.global_batch(16) / dp(2) = 8 rows on the rank with the most",
    ),
    (
        ["--nproc", "2", "--global-batch", "15", "--micro-batches", "9"],
        "data.global_batch(15) / dp(2) = 8 rows (rounded up) on the rank with the most",
    ),
    (
        ["--nproc", "2", "--global-batch", "16", "--data-weights", "3,1", "--micro-batches", "13"],
        "data.global_batch(16) x the share of dp rank 0 (0.75 of data.weights [3.0, 1.0]) = 12 rows",
    ),
]


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, str]:
    file = tmp_path / "file"
    file.write_text("x")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)))
    table_toml = tmp_path / "table.toml"
    table_toml.write_text('model = "gpt"\n')
    nan_toml = tmp_path / "nan.toml"
    nan_toml.write_text("[optim]\nlr = nan\n")
    big_toml = tmp_path / "big.toml"
    big_toml.write_text("# " + "x" * (1 << 20) + "\n")
    names = {
        "file": file,
        "binary": binary,
        "table_toml": table_toml,
        "nan_toml": nan_toml,
        "big_toml": big_toml,
        "tmp": tmp_path,
    }
    return {name: str(path) for name, path in names.items()}


@pytest.mark.parametrize("command", ["train", "verify"])
@pytest.mark.parametrize(("args", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_before_any_rank(
    tmp_path: Path, inputs: dict[str, str], capsys, command: str, args: list[str], message: str
) -> None:
    if command == "verify" and {"--run-dir", "--checkpoint-dir"} & set(args):
        pytest.skip("verify writes no run folder or checkpoints, so it does not try them")
    run_dir = tmp_path / "run"
    argv = [command, "--preset", "tiny", "--steps", "2", "--run-dir", str(run_dir), *args]
    code = main([a.format(**inputs) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"shardwise {command}: error: ")
    assert message.format(**inputs) in lines[0], err
    assert not (run_dir / "pids").exists()  # every rank writes its pid there first: none started


# flags argparse refuses: one line from the (sub-)command itself, with the flag meant where one is close
BAD_FLAGS = [
    (
        ["train", "--nproc", "2", "--pp", "2", "--shedule", "zb", "--steps", "2"],
        "shardwise train: error: unknown flag --shedule: did you mean --schedule?",
    ),
    (
        ["verify", "--nproc", "2", "--pp", "2", "--shedule", "zb", "--steps", "2"],
        "shardwise verify: error: unknown flag --shedule: did you mean --schedule?",
    ),
    # prefixes of a flag used to run as the flag (argparse's allow_abbrev)
    (
        ["train", "--schedul", "zb"],
        "shardwise train: error: unknown flag --schedul: did you mean --schedule?",
    ),
    (
        ["verify", "--sched=zb"],
        "shardwise verify: error: unknown flag --sched: did you mean --schedule or --seed?",
    ),
    (
        ["train", "--virtual-stage", "2"],
        "shardwise train: error: unknown flag --virtual-stage: did you mean --virtual-stages?",
    ),
    (
        ["bench", "pipeline", "--step", "3"],
        "shardwise bench pipeline: error: unknown flag --step: did you mean --steps?",
    ),
    (["plan", "--prese", "tiny"], "shardwise plan: error: unknown flag --prese: did you mean --preset?"),
    (
        ["ckpt", "inspect", "x", "--no-verif"],
        "shardwise ckpt inspect: error: unknown flag --no-verif: did you mean --no-verify?",
    ),
    (["plot", "x", "--outt", "y"], "shardwise plot: error: unknown flag --outt: did you mean --out?"),
    # nothing close
    (
        ["train", "--zzzzzz", "1"],
        "shardwise train: error: unknown flag --zzzzzz (see shardwise train --help)",
    ),
    # a flag without its value, a missing or extra positional
    (
        ["train", "--pp"],
        "shardwise train: error: argument --pp: expected one argument (see shardwise train --help)",
    ),
    (
        ["bench", "pipeline", "--rounds"],
        "shardwise bench pipeline: error: argument --rounds: expected one argument "
        "(see shardwise bench pipeline --help)",
    ),
    (
        ["ckpt", "inspect"],
        "shardwise ckpt inspect: error: the following arguments are required: dir "
        "(see shardwise ckpt inspect --help)",
    ),
    (
        ["ckpt", "inspect", "a", "b"],
        "shardwise ckpt inspect: error: unexpected argument 'b' (see shardwise ckpt inspect --help)",
    ),
]


@pytest.mark.parametrize(("argv", "line"), BAD_FLAGS)
def test_bad_flag_is_one_line_from_the_command_exit_2(capsys, argv: list[str], line: str) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    captured = capsys.readouterr()
    assert exit.value.code == 2
    assert captured.err.splitlines() == [line], captured.err
    assert captured.out == ""


def test_bench_pipeline_help_shows_defaults_and_schedules(capsys, monkeypatch) -> None:
    from shardwise.pipeline.schedules import SCHEDULES

    monkeypatch.setenv("COLUMNS", "200")  # no help text wrapped (at a hyphen, say)
    with pytest.raises(SystemExit) as exit:
        main(["bench", "pipeline", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # a long flag's help starts on the next line
    for wanted in (
        "--steps STEPS steps per launch, the first 5 warm up (default 40)",
        "--rounds ROUNDS rounds; a ratio is the median of theirs (default 3)",
        "--launches LAUNCHES launches of each schedule per round, the sides' steps alternating (default 5)",
        "--micro-batches MICRO_BATCHES micro-batches per step (default 4)",
        "--preset PRESET the gpt preset (default small)",
        "--global-batch GLOBAL_BATCH sequences per step (default 8)",
        f"--schedules SCHEDULES comma-separated: {', '.join(SCHEDULES)} (default: all)",
    ):
        assert wanted in text, text
