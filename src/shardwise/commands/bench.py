"""``shardwise bench KIND``: ours against PyTorch's built-in, interleaved runs, medians, JSON out."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from shardwise.commands.output import write_json as _write
from shardwise.commands.parser import SHOW_DEFAULT
from shardwise.pipeline.schedules import SCHEDULES


def _kind(kinds: Any, name: str, help: str, run: Callable[[argparse.Namespace], int], nproc: int) -> Any:
    """A ``bench`` sub-command with the flags every benchmark has."""
    parser = kinds.add_parser(name, help=help)
    parser.add_argument("--nproc", type=int, default=nproc, help=f"ranks (default {nproc})")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.set_defaults(run=run)
    return parser


def add_bench_parser(sub: Any, run: Callable[[argparse.Namespace], int]) -> None:
    bench = sub.add_parser("bench", help="benchmarks against PyTorch's built-ins")
    kinds = bench.add_subparsers(dest="kind", required=True)
    ddp = _kind(kinds, "ddp", "our all-reduce DP against torch DistributedDataParallel", run, nproc=2)
    ddp.add_argument(
        "--steps", type=int, default=20, help="steps per launch, the first 3 warm up" + SHOW_DEFAULT
    )
    ddp.add_argument(
        "--rounds", type=int, default=3, help="interleaved runs of each implementation" + SHOW_DEFAULT
    )
    # the 10.8M-parameter GPT: large enough that gradient traffic matters, as it does where DDP is used
    ddp.add_argument("--preset", default="base", help="the gpt preset" + SHOW_DEFAULT)
    ddp.add_argument("--global-batch", type=int, default=8, help="sequences per step" + SHOW_DEFAULT)
    ddp.add_argument(
        "--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB" + SHOW_DEFAULT
    )
    ddp.add_argument(
        "--watchdog", action="store_true", help="also our DDP without the hang watchdog: its cost"
    )
    comm = _kind(kinds, "comm", "collectives: native and each algorithm, nccl-tests style", run, nproc=2)
    comm.add_argument(
        "--profile", help="where to save the measured cost-model profile (default: where `auto` looks)"
    )
    comm.add_argument(
        "--calibrate",
        action="store_true",
        help="only measure the cost model's step costs, save and show them",
    )
    comm.add_argument(
        "--ops", help="comma-separated: all_reduce,broadcast,reduce,all_gather,reduce_scatter (default: all)"
    )
    comm.add_argument("--max-mb", type=float, default=256.0, help="largest message (default 256 MB)")
    zero = _kind(kinds, "zero", "ZeRO stages against ZeroRedundancyOptimizer and FSDP2", run, nproc=2)
    zero.add_argument("--steps", type=int, default=5, help="steps per run" + SHOW_DEFAULT)
    zero.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs of each side; medians" + SHOW_DEFAULT
    )
    zero.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages" + SHOW_DEFAULT)
    zero.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size in MB" + SHOW_DEFAULT)
    zero.add_argument("--offload-stage", type=int, help="instead: peak RSS with and without disk offload")
    tp = _kind(kinds, "tp", "tensor parallelism against DTensor's parallelize_module", run, nproc=2)
    tp.add_argument("--steps", type=int, default=5, help="steps per run" + SHOW_DEFAULT)
    tp.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs of each side; medians" + SHOW_DEFAULT
    )
    tp.add_argument(
        "--preset", default="small", help="a gpt preset whose heads and widths nproc divides" + SHOW_DEFAULT
    )
    tp.add_argument("--global-batch", type=int, default=8, help="sequences per step" + SHOW_DEFAULT)
    tp.add_argument("--seq-len", type=int, default=64, help="tokens per sequence" + SHOW_DEFAULT)
    tp.add_argument(
        "--rows", default="tp,tp+sp", help="comma-separated: tp, tp+sp (sequence parallel)" + SHOW_DEFAULT
    )
    compare = _kind(kinds, "dp-compare", "single-process DP, parameter server, all-reduce DP", run, nproc=3)
    compare.add_argument("--steps", type=int, default=5, help="steps per run" + SHOW_DEFAULT)
    compare.add_argument("--global-batch", type=int, default=16, help="sequences per step" + SHOW_DEFAULT)
    ps_async = _kind(kinds, "ps-async", "asynchronous against synchronous parameter server", run, nproc=3)
    ps_async.add_argument("--steps", type=int, default=150, help="steps per run" + SHOW_DEFAULT)
    ps_async.add_argument(
        "--seeds", type=int, default=3, help="runs per mode; means are compared" + SHOW_DEFAULT
    )
    ps_async.add_argument("--preset", default="small", help="the gpt preset" + SHOW_DEFAULT)
    compress = _kind(kinds, "compress", "each gradient codec and DiLoCo against no compression", run, nproc=2)
    compress.add_argument("--steps", type=int, help="steps per run (default 600; with --link 300)")
    compress.add_argument("--seeds", type=int, help="runs per row; means are compared (default 3)")
    compress.add_argument("--preset", default="small", help="the gpt preset" + SHOW_DEFAULT)
    compress.add_argument("--rows", help="comma-separated row labels (default: all), e.g. fp16,topk:0.01")
    compress.add_argument("--no-torch", action="store_true", help="skip torch DDP and its powerSGD_hook")
    compress.add_argument(
        "--link",
        metavar="RATE",
        help="instead: two hosts (network namespaces, one rank each) over a veth pair shaped to RATE "
        "(e.g. 1Gbit = 1Gb/s = 125MB/s; case decides the unit, b or bit: bits, B: bytes, as `plan --link` "
        "reads it; unlike tc, where gbps means bytes: tc is handed the rate in bits): the training time "
        "each row needs to reach the uncompressed run's held-out loss; one seed; needs root and iproute2",
    )
    compress.add_argument("--global-batch", type=int, help="with --link: the global batch (default 4)")
    compress.add_argument(
        "--eval-every", type=int, default=10, help="with --link: steps between evaluations" + SHOW_DEFAULT
    )
    compress.add_argument(
        "--step-factor",
        type=float,
        default=2.0,
        help="with --link: rows may train this many times --steps" + SHOW_DEFAULT,
    )
    compress.add_argument("--seed", type=int, help="with --link: the seed of every run (default 0)")
    pipe = _kind(kinds, "pipeline", "pipeline schedules against torch.distributed.pipelining", run, nproc=2)
    pipe.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step" + SHOW_DEFAULT)
    pipe.add_argument(
        "--steps", type=int, default=40, help="steps per launch, the first 5 warm up" + SHOW_DEFAULT
    )
    pipe.add_argument(
        "--rounds", type=int, default=3, help="rounds; a ratio is the median of theirs" + SHOW_DEFAULT
    )
    pipe.add_argument(
        "--launches",
        type=int,
        default=5,
        help="launches of each schedule per round, the sides' steps alternating" + SHOW_DEFAULT,
    )
    pipe.add_argument("--preset", default="small", help="the gpt preset" + SHOW_DEFAULT)
    pipe.add_argument("--global-batch", type=int, default=8, help="sequences per step" + SHOW_DEFAULT)
    pipe.add_argument("--schedules", help=f"comma-separated: {', '.join(SCHEDULES)} (default: all)")
    pipe.add_argument("--timeout", type=float, default=180.0, help="seconds a launch may take" + SHOW_DEFAULT)
    pipe.add_argument("--trace", metavar="DIR", help="write DIR/<schedule>/trace.json and simulated.json")
    ckpt = _kind(
        kinds, "ckpt", "checkpoint save/load MB/s against torch.distributed.checkpoint", run, nproc=2
    )
    ckpt.add_argument(
        "--size-mb", type=float, default=64.0, help="total state, split over the ranks" + SHOW_DEFAULT
    )
    ckpt.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats; medians reported" + SHOW_DEFAULT
    )
    ckpt.add_argument("--dir", help="where to write (default: a temporary folder)")
    from shardwise.commands.bench_gpu import add_gpu_parser

    add_gpu_parser(kinds, run)


def bench_command(args: argparse.Namespace) -> int:
    if args.kind == "gpu":
        from shardwise.commands.bench_gpu import bench_gpu_command

        return bench_gpu_command(args)
    if args.kind == "ddp":
        from shardwise.bench.ddp import render_ddp, run_ddp_bench

        render: Callable[[dict[str, Any]], None] = render_ddp

        result = run_ddp_bench(
            nproc=args.nproc,
            steps=args.steps,
            rounds=args.rounds,
            preset=args.preset,
            global_batch=args.global_batch,
            bucket_mb=args.bucket_mb,
            watchdog=args.watchdog,
        )
    elif args.kind == "comm":
        from shardwise.collectives.bench import (
            format_calibration,
            format_table,
            run_calibration,
            run_comm_bench,
        )
        from shardwise.collectives.cost import DEFAULT_PROFILE_PATH

        profile = args.profile or str(DEFAULT_PROFILE_PATH)
        if args.calibrate:
            result = run_calibration(args.nproc, profile)
            render = lambda r: print(format_calibration(r))  # noqa: E731
        else:
            sizes = [4096 * 4**i for i in range(12) if 4096 * 4**i <= args.max_mb * 2**20]
            ops = args.ops.split(",") if args.ops else None
            result = run_comm_bench(args.nproc, sizes, profile, ops)
            render = lambda r: print(format_table(r))  # noqa: E731
    elif args.kind == "zero":
        from shardwise.bench.zero import render_zero, run_offload_bench, run_zero_bench

        if args.offload_stage:
            result = run_offload_bench(args.nproc, args.offload_stage)
        else:
            stages = tuple(int(s) for s in args.stages.split(","))
            result = run_zero_bench(args.nproc, args.steps, args.repeats, stages, bucket_mb=args.bucket_mb)
        render = render_zero
    elif args.kind == "tp":
        from shardwise.bench.tp import check_tp_settings, render_tp, run_tp_bench

        rows = tuple(args.rows.split(","))
        check_tp_settings(args.nproc, args.preset, args.seq_len, rows)
        result = run_tp_bench(
            args.nproc, args.steps, args.repeats, args.preset, args.global_batch, args.seq_len, rows
        )
        render = render_tp
    elif args.kind == "dp-compare":
        from shardwise.bench.dp_compare import render_compare, run_dp_compare

        result = run_dp_compare(nproc=args.nproc, steps=args.steps, global_batch=args.global_batch)
        render = render_compare
    elif args.kind == "ps-async":
        from shardwise.bench.ps_async import bench_async_vs_sync, render_ps_async

        result = bench_async_vs_sync(args.nproc, args.steps, args.seeds, args.preset)
        render = render_ps_async
    elif args.kind == "compress" and args.link:
        return _compress_link(args)
    elif args.kind == "compress" and args.seed is not None:
        from shardwise.config import ConfigError

        raise ConfigError("--seed chooses a --link run's seed; without --link, --seeds N runs seeds 0..N-1")
    elif args.kind == "compress":
        from shardwise.bench.compress import STEPS, render_compress, run_compress_bench

        labels = args.rows.split(",") if args.rows else None
        with_torch = not args.no_torch
        steps = STEPS if args.steps is None else args.steps
        seeds = 3 if args.seeds is None else args.seeds
        save = (lambda partial: _write(args.out, partial)) if args.out else None
        result = run_compress_bench(args.nproc, steps, seeds, args.preset, labels, with_torch, partial=save)
        render = render_compress
    elif args.kind == "pipeline":
        from shardwise.bench.pipeline import render_pipeline, run_pipeline_bench

        result = run_pipeline_bench(
            nproc=args.nproc, microbatches=args.micro_batches, steps=args.steps, rounds=args.rounds,
            launches=args.launches, preset=args.preset, global_batch=args.global_batch,
            schedules=args.schedules.split(",") if args.schedules else None, timeout_s=args.timeout,
            trace_dir=args.trace,
        )  # fmt: skip
        render = render_pipeline
    elif args.kind == "ckpt":
        from shardwise.checkpoint.bench import run_ckpt_bench

        result = run_ckpt_bench(nproc=args.nproc, size_mb=args.size_mb, repeats=args.repeats, dir=args.dir)
        render = render_ckpt
    else:  # pragma: no cover - argparse restricts the choices
        raise ValueError(args.kind)
    return _save_and_emit(args, result, render)


def _save_and_emit(
    args: argparse.Namespace, result: dict[str, Any], render: Callable[[dict[str, Any]], None]
) -> int:
    from shardwise.commands.output import emit

    if args.out:
        _write(args.out, result)
    emit(result, args.json, render)
    return 0


def _compress_link(args: argparse.Namespace) -> int:
    """``bench compress --link RATE``: exit 2 with one line where namespaces cannot be made."""
    import sys

    from shardwise.bench.compress_link import LINK_BATCH, LINK_STEPS, render_link, run_link_bench
    from shardwise.bench.netns import netns_unavailable
    from shardwise.planner.units import parse_rate

    parse_rate(args.link, "--link")  # a rate it cannot read is refused before anything is set up
    problem = netns_unavailable()
    if problem is None and args.seeds not in (None, 1):
        problem = "--link runs one seed (--seeds 1; choose it with --seed)"
    if problem is None and args.nproc != 2:
        problem = "--link runs two hosts of one rank each (--nproc 2)"
    if problem:
        print(f"shardwise bench compress: error: --link: {problem}", file=sys.stderr)
        return 2
    result = run_link_bench(
        rate=args.link,
        steps=LINK_STEPS if args.steps is None else args.steps,
        preset=args.preset,
        labels=args.rows.split(",") if args.rows else None,
        global_batch=args.global_batch or LINK_BATCH,
        eval_every=args.eval_every,
        step_factor=args.step_factor,
        seed=args.seed or 0,
    )
    return _save_and_emit(args, result, render_link)


def render_ckpt(result: dict[str, Any]) -> None:
    save, load, raw = result["save_mb_s"], result["load_mb_s"], result["raw_write_mb_s"]
    print(
        f"checkpoint, {result['nproc']} ranks, {result['bytes'] / 1e6:.1f} MB, "
        f"median of {result['repeats']}: "
        f"save {save['shardwise']:.0f} MB/s (DCP {save['dcp']:.0f}, raw disk {raw:.0f}), "
        f"load {load['shardwise']:.0f} MB/s (DCP {load['dcp']:.0f}); ours/DCP save speed "
        f"{result['speed_ratio']:.2f}x"
    )
