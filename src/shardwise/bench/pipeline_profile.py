"""The pipeline bench's stage profile: the simulator's costs, measured apart from the runs they predict.

On the bench's own processes, one repeat after each of their measured steps and the rest after them
(``pipeline_sides.paired_worker``: the costs are timed over the same minutes as the steps, whatever
this machine's speed, which swings up to 1.5x from minute to minute, did meanwhile; fresh processes,
``profile_costs``, where there are none), one per pipeline rank as the run has them (each with a
run's thread count, competing for the same cores and memory), every rank times the F, B, I and W of the
stages the schedule places on it, each alone, computed as the runtime computes them: F the stage and,
on the last, the loss; B its backward; I the same backward with the stage's linear layers keeping
their weight gradients (``engine/linear.py``); W those kept gradients computed. Repeats are
interleaved with barriers so the ranks compute together; medians. Then the messages, posted as the
runtime posts them (through ``Comm``, on the compute thread), each rank computing its
first stage's forward before it sends: ``send``, what posting one activation takes its sender while
both ranks compute and exchange (gloo's work to post it, and to send it where the peer already
waits); ``transfer``, per trip of a relay (one rank
computes and sends on while the other waits in its receive) half the round trip less both computes
and both posts, the median over trips. A bare ping-pong with nothing computed between gave 0.1 ms
and no sender's cost, where an action in a run started 0.3-0.5 ms after the remote one it waited
for (``benchmarks/pipeline_sim_check.py`` feeds the simulator each step's own action times, to see
how near it comes to the step's measured bubble). The bench feeds the simulator this ``send`` and a
``transfer`` priced from the run's own warm-up steps (``pipeline_handoff``: the relay's median missed
the hand-offs' tail); this one is reported beside it (``profiled_ms.transfer_relay``). Never timed
on the steps it is compared with.
Communication: barriers, the relay and the exchange between ranks 0 and 1, one send of rank 1's
timings to rank 0, over gloo.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from shardwise.collectives.p2p import Work
from shardwise.config import TrainConfig
from shardwise.device import HOST
from shardwise.pipeline.adapt import measured_costs
from shardwise.pipeline.schedules import SCHEDULES, stage_placement
from shardwise.pipeline.simulate import Costs
from shardwise.pipeline.split import Split
from shardwise.pipeline.tied import TAG
from shardwise.testing.harness import RankFailure, run_on_ranks

HAND_OFFS = 30
# each stage's F, B, I and W: medians (zbv's simulated bubble was 0.15-0.23 over runs at 10, 0.19-0.21 at 40)
PROFILE_REPEATS = 40


def launch(
    worker: Callable[..., Any], nproc: int, args: tuple[Any, ...], timeout_s: float
) -> tuple[list[Any] | None, str | None]:
    """``worker(rank, nproc, *args)`` on ``nproc`` fresh processes with a deadline: (results, None), or
    (None, what went wrong) when a rank hung past ``timeout_s`` or failed; never hangs itself."""
    try:
        return run_on_ranks(worker, nproc, *args, timeout_s=timeout_s), None
    except RankFailure as failure:
        if failure.rank is None:
            return None, f"timeout after {timeout_s:g} s"
        return None, f"failed on rank {failure.rank}: {str(failure).strip().splitlines()[-1]}"


def bench_data(config: TrainConfig) -> tuple[Any, int]:
    """Every pp rank draws the same batches (dp = 1); returns the sampler and tokens per step."""
    from shardwise.data.corpus import load_corpus
    from shardwise.data.sampler import DataSampler

    corpus = load_corpus(config.data.corpus_bytes)
    batch = config.data.global_batch
    sampler = DataSampler(corpus.train, config.model.seq_len, batch, config.seed, [batch], 0)
    return sampler, batch * config.model.seq_len


class StageModule(nn.Module):
    """One of our split's stages as the module torch's ``PipelineStage`` wants: exactly the stage's
    parameters registered (its blocks and the ends it owns), ``forward`` the stage itself."""

    def __init__(self, stage: Any, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.stage = stage  # a plain callable (not a module): its adapter holds the whole model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)


def stage_modules(model: nn.Module, placement: Sequence[int], rank: int) -> dict[int, StageModule]:
    """The stages ``placement`` puts on ``rank``, split from ``model`` as the runtime splits it."""
    return split_stage_modules(model, placement, rank)[0]


def split_stage_modules(
    model: nn.Module, placement: Sequence[int], rank: int
) -> tuple[dict[int, StageModule], Split]:
    """``stage_modules`` and the split they came from (its tied weight's two ends)."""
    from shardwise.pipeline.split import _get, split_model

    split = split_model(model, placement, rank)
    adapter = next(iter(split.stages.values())).adapter
    modules = {}
    for index, stage in split.stages.items():
        blocks: Any = adapter.blocks()  # the ModuleDict the split left, keyed by block index
        parts: list[nn.Module] = [blocks[str(i)] for i in stage.blocks]
        paths = (adapter.first_modules if stage.first else ()) + (adapter.last_modules if stage.last else ())
        parts += [m for p in paths if (m := _get(model, p)) is not None]
        modules[index] = StageModule(stage, parts)
    return modules, split


def _copy_head(model: nn.Module, placement: Sequence[int]) -> list[nn.Module]:
    """The head that reads the tied weight's copy where the runtime has one (the pipeline's two ends
    on two ranks), whose dW the runtime keeps in I; none elsewhere."""
    from shardwise.models.adapters import pipeline_adapter
    from shardwise.pipeline.split import tied_user

    pair = pipeline_adapter(model).tied_pair()
    return [] if pair is None or placement[0] == placement[-1] else [tied_user(model, pair)]


def profile_worker(rank: int, world: int, config: TrainConfig, threads: int, repeats: int) -> dict[str, Any]:
    """This rank's stage profile (``StageProfile``) run alone: ``repeats`` timed repeats after one
    that warms up, then the messages."""
    profile = StageProfile(rank, world, config, threads)
    for _ in range(repeats + 1):
        profile.repeat()
    return profile.result()


class StageProfile:
    """One rank's stage profile, a repeat at a time: alone (``profile_worker``), or between a bench
    launch's measured steps (``pipeline_sides.paired_worker``), so that its costs are timed over the
    same minutes as the steps they are compared with, whatever the machine's speed did meanwhile.
    Each ``repeat`` (every rank together, after a barrier) times F, B and, for a split schedule, the
    split F, I and W of each stage the schedule places on this rank; its first repeat warms up."""

    def __init__(self, rank: int, world: int, config: TrainConfig, threads: int) -> None:
        from shardwise.engine.linear import WeightGradStore
        from shardwise.models import build_model
        from shardwise.pipeline.deferred import defer_weight_grads
        from shardwise.train.loop import seed_everything

        torch.set_num_threads(threads)
        config = config.validate(world)
        seed_everything(config.seed)
        name = config.parallel.schedule
        placement = stage_placement(name, world, config.parallel.stages_per_rank)
        model = build_model(config.model)
        self.modules = stage_modules(
            model, [0] * len(placement), 0
        )  # every stage here; this rank times its own
        self.store, self.split = WeightGradStore(), SCHEDULES[name].splits_backward
        if self.split:  # as the runtime defers (``defer_stage_weight_grads``), here on one rank
            defer_weight_grads(model, self.store, _copy_head(model, placement))
        sampler, _ = bench_data(config)
        ids, self.targets = sampler.local_micro_batches(0, config.data.micro_batches)[0]
        self.inputs: list[torch.Tensor] = [ids]
        with torch.no_grad():  # each stage's input: the micro-batch through the stages before it
            for index in range(len(placement) - 1):
                self.inputs.append(self.modules[index](self.inputs[-1]))
        self.rank, self.last = rank, len(placement) - 1
        self.mine = [s for s, r in enumerate(placement) if r == rank]
        self.timing: dict[int, dict[str, list[float]]] = {
            s: {k: [] for k in ("F", "B", "Fs", "I", "W")} for s in self.mine
        }
        self.repeats = 0

    def repeat(self) -> None:
        """One timed repeat of this rank's stages, every rank together."""
        import torch.distributed as dist

        dist.barrier()
        for s in self.mine:
            target = self.targets if s == self.last else None
            for kind, seconds in _time_stage(
                self.modules[s], self.inputs[s], target, s > 0, self.store, self.split
            ):
                self.timing[s][kind].append(seconds)
        self.repeats += 1

    def result(self) -> dict[str, Any]:
        """Per stage the median seconds of each kind over the repeats but the first
        (``{stage: {"F": s, ...}}``) and, on rank 0, the messages' ``send`` and ``transfer``."""
        costs = {}
        for s, kinds in self.timing.items():
            median = {k: statistics.median(v[1:]) for k, v in kinds.items() if v}
            median.setdefault("Fs", median["F"])  # a schedule without a split: nothing reads Fs, I or W
            costs[s] = {"I": median["B"] / 2, "W": median["B"] / 2, **median}
        first = self.mine[0]

        def work() -> Any:  # this rank's first stage's forward, as in the run
            return self.modules[first](self.inputs[first])

        send, transfer = _messages(self.rank, self.inputs[-1], work)
        return {"costs": costs, "transfer": transfer, "send": send}


def _time_stage(
    module: nn.Module, x: torch.Tensor, targets: torch.Tensor | None, leaf: bool, store: Any, split: bool
) -> list[tuple[str, float]]:
    """One repeat of F, B and (``split``) F, I, W of one stage."""
    from shardwise.engine.linear import apply_weight_grads
    from shardwise.engine.loss import loss_sum

    def forward() -> torch.Tensor:
        y = module(x.detach().requires_grad_(True) if leaf else x)
        return loss_sum(y, targets) if targets is not None else y

    out = []
    store.armed = False  # a micro-batch whose backward is one B: its layers take the plain path
    t0 = time.perf_counter()
    root = forward()
    t1 = time.perf_counter()
    seed = torch.ones_like(root) if targets is not None else torch.randn_like(root)
    t2 = time.perf_counter()
    torch.autograd.backward(root, seed)
    t3 = time.perf_counter()
    out += [("F", t1 - t0), ("B", t3 - t2)]
    if split:  # one whose backward is an I and a W: its F takes the deferring path too ("Fs")
        store.armed = True
        t3 = time.perf_counter()
        root = forward()
        t4 = time.perf_counter()
        with store.collect() as kept:
            torch.autograd.backward(root, seed)
        t5 = time.perf_counter()
        apply_weight_grads(kept)
        out += [("Fs", t4 - t3), ("I", t5 - t4), ("W", time.perf_counter() - t5)]
    return out


class _Poster:
    """Messages between ranks 0 and 1 posted as the runtime posts them (through ``Comm``, on the
    compute thread), with this rank's stage forward as the work between them."""

    def __init__(self, rank: int, activation: torch.Tensor, work: Callable[[], Any]) -> None:
        from shardwise.collectives.api import Comm

        self.comm = Comm(None)
        self.activation, self.buffer, self.peer = activation, torch.empty_like(activation), 1 - rank
        self.work = work

    def receive(self) -> Work:
        return self.comm.irecv(self.buffer, self.peer, TAG)

    def send(self) -> tuple[Work, float]:
        """Post the activation; with the seconds it took this rank."""
        started = time.perf_counter()
        sent = self.comm.isend(self.activation, self.peer, TAG)
        return sent, time.perf_counter() - started

    def compute(self) -> float:
        started = time.perf_counter()
        self.work()
        return time.perf_counter() - started


def _relay(rank: int, poster: _Poster) -> list[list[float]]:
    """``HAND_OFFS + 1`` trips of the relay: one rank computes and sends on while the other waits in
    its receive. Per trip: ``[round trip (rank 0's), this rank's compute, this rank's post]``."""
    trips = []
    for _ in range(HAND_OFFS + 1):
        started = time.perf_counter()
        if rank == 1:
            poster.receive().wait()
        computed = poster.compute()
        sent, posting = poster.send()
        if rank == 0:
            poster.receive().wait()
        sent.wait()
        trips.append([time.perf_counter() - started, computed, posting])
    return trips


def _exchange(poster: _Poster) -> list[float]:
    """``HAND_OFFS + 1`` rounds in which both ranks compute, then send to each other: the seconds
    each post took its sender, as in a steady 1F1B."""
    posts = []
    for _ in range(HAND_OFFS + 1):
        received = poster.receive()
        poster.compute()
        sent, posting = poster.send()
        posts.append(posting)
        received.wait()
        sent.wait()
    return posts


def _messages(rank: int, activation: torch.Tensor, work: Callable[[], Any]) -> tuple[float, float]:
    """``(send, transfer)`` of one activation between ranks 0 and 1 (module docstring); (0, 0) on the
    other ranks. ``send``: the mean of the two ranks' median posts in the exchange; ``transfer``: the
    median over the relay's trips of half the round trip less both computes and both posts (at
    least 0)."""
    import torch.distributed as dist

    trips = torch.zeros(HAND_OFFS + 1, 3, dtype=torch.float64, device=HOST)
    posts = torch.zeros(HAND_OFFS + 1, dtype=torch.float64, device=HOST)
    dist.barrier()
    if rank in (0, 1):
        poster = _Poster(rank, activation, work)
        with torch.no_grad():
            trips = torch.tensor(_relay(rank, poster), dtype=torch.float64, device=HOST)
            posts = torch.tensor(_exchange(poster), dtype=torch.float64, device=HOST)
    theirs = torch.cat([trips.flatten(), posts])
    if rank == 1:
        dist.send(theirs, 0)
    elif rank == 0:
        dist.recv(theirs, 1)
    dist.barrier()
    if rank != 0:
        return 0.0, 0.0
    their_trips, their_posts = theirs[: trips.numel()].view_as(trips), theirs[trips.numel() :]
    hops = (trips[:, 0] - trips[:, 1] - trips[:, 2] - their_trips[:, 1] - their_trips[:, 2]) / 2
    send = (posts[1:].median() + their_posts[1:].median()) / 2
    return float(send), max(0.0, float(hops[1:].median()))


def profile_costs(config: TrainConfig, nproc: int, repeats: int, timeout_s: float) -> Costs:
    """The profile (fresh processes, one per rank) as the simulator's per-stage costs, in seconds."""
    from shardwise.launcher import threads_per_rank

    results, problem = launch(profile_worker, nproc, (config, threads_per_rank(nproc), repeats), timeout_s)
    if results is None:
        raise RuntimeError(f"the stage profile did not finish: {problem}")
    return costs_of(results)


def costs_of(results: Sequence[dict[str, Any]]) -> Costs:
    """Every rank's ``profile_worker`` result (by rank) as the simulator's per-stage costs."""
    merged = {s: kinds for result in results for s, kinds in result["costs"].items()}
    costs = measured_costs([merged[s] for s in sorted(merged)])  # as the runtime's fit reads its own
    return replace(costs, transfer=results[0]["transfer"], send=results[0]["send"])


def median_costs(profiles: Sequence[Costs]) -> Costs:
    """Each cost (per stage) the median over ``profiles`` (one per launch)."""

    def median(values: Sequence[Any]) -> Any:
        if isinstance(values[0], tuple):
            return tuple(statistics.median(stage) for stage in zip(*values, strict=True))
        return statistics.median(values)

    names = [f.name for f in fields(Costs)]
    return Costs(**{name: median([getattr(c, name) for c in profiles]) for name in names})
