"""Time per optimizer step: compute from FLOPs, communication from the collectives' cost model, overlap.

No communication: arithmetic over :mod:`shardwise.collectives.cost` (the alpha-beta model every
algorithm's prediction comes from). For one rank of a layout, per step:

**Compute.** A training token costs 6 FLOPs per matmul weight (2 forward, 4 backward; Kaplan et al.
2020) plus attention, 12·s·h per layer (4·s·h forward for the scores and the weighted sum; Narayanan et
al., SC 2021, eq. 3: 72·l·h² + 12·s·l·h + 6·V·h per token). Activation checkpointing runs each block's
forward again in backward (Narayanan et al.'s factor 4 instead of 3, on the blocks), costed at the
checkpointed model's own measured rate where there is one (``Calibration.checkpointed_flops_per_s``).
On this CPU checkpointing added 6-22% to the compute (the probes' best and median), not 33%: likely
because the first forward keeps no graph and the replay runs beside its backward, its activations in
cache. Each rank computes its tokens (global batch x s / dp) over its share of the blocks (1/pp) and
of every matmul (1/tp), at ``Calibration.flops_per_s``; forward is a third of it, backward the rest.

**Bytes per step, per strategy** (Ψ the rank's parameters, N = dp, fp32 gradients here even under mixed
precision, ``cb`` the compute dtype's bytes):

- DDP: one all-reduce of 4Ψ, in buckets (the first 1 MB, then ``bucket_mb``), during the last
  micro-batch's backward (earlier ones accumulate under ``no_sync``);
- ZeRO-1/2: a reduce-scatter of each fp32 bucket in backward, and an all-gather of each updated bucket
  (cb bytes a value) overlapping the optimizer step of the next;
- ZeRO-3: every micro-batch all-gathers each block in forward and again in backward (cb·Ψ each) and
  reduce-scatters its gradients (4Ψ; on a pipeline once a step, from a full buffer per unit); the root
  unit (embeddings, head) is gathered once per step;
- the parameter server: each worker pushes its gradient and pulls the weights, every server receiving
  from all workers in turn (its link is the bottleneck);
- tensor parallelism (Megatron, Shoeybi et al. 2019): 2 all-reduces of the activations per block in
  forward and 2 in backward (and the recomputed forward's first again under checkpointing), exposed, and
  one each for the vocabulary-cut embedding (its output) and head (its input's gradient); pipeline
  parallelism: point-to-point sends between stages (and a tied embedding's gradient summed between the
  first and last stage before the dp exchange, exposed) and the bubble of its schedule, from the pipeline's
  own simulator ((pp - 1) / m of the compute for 1F1B, Narayanan et al. 2021).

**Overlap.** Bucketed reductions run while backward goes on, so only what outlasts backward is
exposed, and never less than the last bucket (launched when backward ends). ZeRO-3 with prefetch hides
its gathers behind the compute likewise, all but the first; without prefetch every gather waits. The
all-gathers of stages 1-2 overlap the optimizer step. The optimizer step itself is bound by memory
bandwidth (it reads and writes the master, the moments and the gradient); under CPU offload it runs on
the host, and gradient and parameter shards cross the host link.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from shardwise.collectives.cost import CostProfile, predict
from shardwise.planner.calibration import Calibration
from shardwise.planner.layout import Layout, Training, zero_stage
from shardwise.planner.model import ModelShape

FIRST_BUCKET_BYTES = 2**20  # DDPConfig.first_bucket_mb


def matmul_weights(model: ModelShape) -> int:
    """Weights that multiply every token: the blocks' matrices and the head (the embedding is a lookup)."""
    h, f, kv = model.d_model, model.ff, model.kv_width
    block = 2 * h * h + 2 * h * kv + (3 if model.gated_mlp else 2) * h * f
    return model.n_layer * block + model.vocab * h


def flops_per_token(model: ModelShape, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs of one token (forward and backward), with checkpointing's second forward."""
    h, blocks = model.d_model, model.n_layer
    head = 2 * model.vocab * h
    block_forward = 2 * (matmul_weights(model) - model.vocab * h) + 4 * seq_len * h * blocks
    return 3 * (block_forward + head) + (block_forward if recompute else 0.0)


@dataclass(frozen=True)
class Collective:
    """``count`` collectives ``op`` of ``nbytes`` over ``ranks``, in ``phase`` (forward, backward, step)."""

    op: str
    nbytes: float
    ranks: int
    phase: str
    count: int = 1

    def seconds(self, profile: CostProfile, algorithm: str, gloo: bool = False) -> float:
        """``gloo``: ZeRO's forms on gloo's native collectives (``zero/group.py``): a reduce-scatter
        runs as an all-reduce, an all-gather as one broadcast of each rank's slice."""
        if self.ranks < 2:  # a group of one sends nothing
            return 0.0
        if self.op == "send":  # point-to-point: one one-way step
            return self.count * profile.one_way(self.nbytes)
        if gloo and self.op == "reduce_scatter":
            return self.count * predict(algorithm, "all_reduce", int(self.nbytes), self.ranks, profile)
        if gloo and self.op == "all_gather":
            slice_bytes = int(self.nbytes / self.ranks)
            return self.count * self.ranks * predict(algorithm, "broadcast", slice_bytes, self.ranks, profile)
        return self.count * predict(algorithm, self.op, int(self.nbytes), self.ranks, profile)

    def sent(self, gloo: bool = False) -> float:
        """Bytes one rank sends, as ``Comm``'s statistics count them: a ring's share of an all-reduce
        (2(n-1)/n of the buffer) or of a reduce-scatter and all-gather ((n-1)/n); gloo's forms of ZeRO's
        collectives (``seconds``): an all-reduce, and one broadcast of this rank's own slice."""
        n, size = self.ranks, self.nbytes
        if n < 2:
            return 0.0
        if self.op == "send":
            return self.count * size
        if self.op == "all_reduce" or (gloo and self.op == "reduce_scatter"):
            return self.count * 2 * (n - 1) / n * size
        if gloo and self.op == "all_gather":
            return self.count * size / n
        return self.count * (n - 1) / n * size


def bucket_sizes(total: float, bucket: float, first: float = 0.0) -> list[float]:
    """``total`` bytes cut into buckets: ``first`` bytes, then ``bucket`` each, the last partial."""
    sizes: list[float] = []
    if first and total > 0:
        sizes.append(min(first, total))
        total -= sizes[0]
    while total > 0:
        sizes.append(min(bucket, total))
        total -= sizes[-1]
    return sizes


def _rank_params(model: ModelShape, layout: Layout) -> tuple[float, float, float]:
    blocks = math.ceil(model.n_layer / layout.pp)
    block, root = model.block_params / layout.tp, model.end_params(layout.pp) / layout.tp
    return blocks * block + root, block, root


def collectives(model: ModelShape, training: Training, layout: Layout) -> list[Collective]:
    """What one rank's data-parallel layer (and tp/pp, where > 1) sends in one step."""
    psi, block, root = _rank_params(model, layout)
    n, m, cb, mb = layout.dp, layout.micro_batches, training.compute_bytes, training.master_bytes
    stage, out = zero_stage(layout.strategy), []
    bucket = layout.bucket_mb * 2**20
    if layout.strategy == "ddp":
        grads = psi * training.param_bytes
        out += [
            Collective("all_reduce", b, n, "backward")
            for b in bucket_sizes(grads, bucket, FIRST_BUCKET_BYTES)
        ]
    elif stage in (1, 2):
        elements = bucket / mb
        for size in bucket_sizes(psi, elements):
            out.append(Collective("reduce_scatter", size * mb, n, "backward"))
            out.append(Collective("all_gather", size * cb, n, "step"))
    elif stage == 3:
        blocks = math.ceil(model.n_layer / layout.pp)
        out.append(Collective("all_gather", root * cb, n, "forward"))
        out.append(Collective("all_gather", block * cb, n, "forward", blocks * m))
        out.append(Collective("all_gather", block * cb, n, "backward", blocks * m))
        # a pipeline adds each unit's gradients into a full buffer and reduces once a step
        reductions = 1 if layout.pp > 1 else m
        out.append(Collective("reduce_scatter", block * mb, n, "backward", blocks * reductions))
        out.append(Collective("reduce_scatter", root * mb, n, "backward", reductions))
    elif layout.strategy == "ps":  # each server takes every worker's push, then sends every pull
        share = psi * training.param_bytes / layout.ps_servers
        out.append(Collective("send", share, 2, "step", 2 * n))
    out += _model_parallel(model, training, layout)
    return out


def _model_parallel(model: ModelShape, training: Training, layout: Layout) -> list[Collective]:
    """Tensor parallelism's activation all-reduces and the pipeline's sends (empty at tp = pp = 1)."""
    tokens = training.global_batch // (layout.dp * layout.micro_batches) * training.seq_len
    activation = tokens * model.d_model * training.compute_bytes
    blocks, m, out = math.ceil(model.n_layer / layout.pp), layout.micro_batches, []
    if layout.tp > 1:
        # the recomputed forward stops once every saved tensor is back (torch's non-reentrant
        # checkpoint): the MLP's output is saved by no one, so only the attention's all-reduce recurs
        forward_count = blocks * m * (3 if layout.activation_checkpointing else 2)
        out.append(Collective("all_reduce", activation, layout.tp, "exposed", forward_count + 2 * blocks * m))
        # the vocab-cut embedding's output in forward, the head's input gradient in backward: a pipeline
        # stage holds one of the two at most (the first stage the embedding, the last the head)
        ends = 2 if layout.pp == 1 else 1
        out.append(Collective("all_reduce", activation, layout.tp, "exposed", ends * m))
    if layout.pp > 1:  # per micro-batch, an activation to the next stage and a gradient to the one before:
        # an end stage sends one of the two, a middle one both
        out.append(Collective("send", activation / layout.tp, 2, "exposed", (1 if layout.pp == 2 else 2) * m))
        if model.tie_weights:  # the first stage's embedding and the last's head are one weight: summed
            # between the two before the dp exchange (``pipeline.runtime``), so nothing hides it: under
            # ZeRO-1/2 too (as a "step" collective it hid behind their update, and a dp group of one,
            # where ZeRO-1/2 do DDP's work, ranked them above DDP)
            tied = model.vocab * model.d_model / layout.tp * training.param_bytes
            out.append(Collective("all_reduce", tied, 2, "exposed"))
    return out


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step on one rank, by part; ``total_s`` is their sum."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float  # every collective, overlapped or not
    exposed_comm_s: float  # what compute does not hide
    bubble_s: float = 0.0
    offload_s: float = 0.0
    comm_bytes: float = 0.0  # bytes this rank's collectives move (their message sizes, summed)
    sent_bytes: float = 0.0  # bytes this rank sends on the wire (``Collective.sent``)
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.exposed_comm_s + self.bubble_s + self.offload_s

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication that compute hides."""
        return 1 - self.exposed_comm_s / self.comm_s if self.comm_s else 1.0


def compute_seconds(
    model: ModelShape, training: Training, layout: Layout, calibration: Calibration
) -> tuple[float, float]:
    """(forward, backward) seconds of one rank's compute in one step: its FLOPs at the calibrated
    rate (under activation checkpointing, the checkpointed rate over FLOPs that count the second
    forward; backward holds the recomputation). Forward is a third of the plain FLOPs."""
    tokens = training.global_batch * training.seq_len / layout.dp
    share = tokens / (layout.pp * layout.tp)
    plain = flops_per_token(model, training.seq_len) * share
    ckpt = layout.activation_checkpointing
    total = flops_per_token(model, training.seq_len, ckpt) * share / calibration.rate(ckpt)
    forward = plain / 3 / calibration.flops_per_s
    return forward, total - forward


def optimizer_passes(training: Training) -> int:
    """Master-sized reads and writes per parameter of one optimizer step, as torch's foreach kernels
    run it. AdamW: decay (read, write), the first moment's lerp (2 reads, a write), the second moment's
    mul and addcmul (2 + 3), its square root, the bias correction and eps (2 each, into a new tensor),
    and the update's addcdiv (3 reads, a write): 20. SGD: the update (3), momentum's mul and add (2 + 3)."""
    if training.optimizer in ("adam", "adamw"):
        return 20
    return 3 + (5 if training.states else 0)


def optimizer_seconds(
    model: ModelShape, training: Training, layout: Layout, calibration: Calibration
) -> tuple[float, float]:
    """(optimizer step, host-link copies) seconds: memory-bound, on the host under offload."""
    psi, _, _ = _rank_params(model, layout)
    stage = zero_stage(layout.strategy)
    if layout.strategy == "ps":
        return 0.0, 0.0  # the servers step while the workers wait on the pull (in its send time)
    held = psi / layout.dp if stage else psi
    mb, cb = training.master_bytes, training.compute_bytes
    touched = held * (optimizer_passes(training) * mb + (cb if training.mixed else 0))
    if layout.offload == "none":
        return touched / calibration.memory_bytes_per_s, 0.0
    gathers = 1 + (2 * layout.micro_batches if stage == 3 else 0)  # stage 3 reads the master per gather
    copies = held * (mb + cb * gathers)  # gradient shard down, parameter shard up
    return touched / calibration.host_bytes_per_s, copies / calibration.host_link_bytes_per_s


def pipeline_bubble_s(layout: Layout, forward: float, backward: float) -> float:
    """Idle seconds a rank's compute leaves in a pipeline step: the pipeline simulator's makespan of
    ``layout.schedule`` (every stage the same forward and backward, a micro-batch's share of the
    rank's), less the rank's own compute. 1F1B and GPipe give (pp - 1) / m of it."""
    if layout.pp == 1:
        return 0.0
    pp, v, m = layout.pp, layout.virtual_stages, layout.micro_batches
    makespan = _makespan(layout.schedule, pp, v, m, forward / (m * v), backward / (m * v))
    return max(0.0, makespan - (forward + backward))


@functools.lru_cache(maxsize=4096)
def _makespan(
    schedule: str, pp: int, virtual: int, micro_batches: int, forward: float, backward: float
) -> float:
    """The simulator's makespan of ``schedule`` with every stage's forward and backward the same
    (cached: a search asks it again for every strategy and offload of one compute)."""
    from shardwise.pipeline.schedules import build, stage_placement
    from shardwise.pipeline.simulate import Costs, simulate

    plan = build(schedule, pp, virtual, micro_batches)
    return simulate(plan, stage_placement(schedule, pp, virtual), Costs.uniform(forward, backward)).makespan


def _exposed(times: list[float], window: float) -> float:
    """Communication left over once ``window`` seconds of compute ran beside it; at least the last."""
    if not times:
        return 0.0
    return max(times[-1], sum(times) - window)


def step_time(
    model: ModelShape,
    training: Training,
    layout: Layout,
    profile: CostProfile,
    calibration: Calibration | None = None,
    algorithm: str = "ring",
    gloo: bool = False,
) -> StepTime:
    """Predicted step time of ``layout`` (see the module docstring for the model); ``gloo``: ZeRO's
    gloo forms of its collectives (see ``Collective.seconds``)."""
    calibration = calibration or Calibration()
    forward, backward = compute_seconds(model, training, layout, calibration)
    optimizer, offload = optimizer_seconds(model, training, layout, calibration)
    todo = collectives(model, training, layout)
    by_phase: dict[str, list[float]] = {}
    for c in todo:
        by_phase.setdefault(c.phase, []).append(c.seconds(profile, algorithm, gloo))
    comm = sum(sum(times) for times in by_phase.values())
    stage = zero_stage(layout.strategy)
    if stage == 3 and not layout.prefetch:  # every gather waits; reductions still overlap
        fwd = sum(by_phase.get("forward", []))
        backward_ops = [(c.op, c.seconds(profile, algorithm, gloo)) for c in todo if c.phase == "backward"]
        gathers = [t for op, t in backward_ops if op == "all_gather"]
        reduces = [t for op, t in backward_ops if op != "all_gather"]
        exposed_backward = sum(gathers) + _exposed(reduces, backward)
    else:
        fwd = _exposed(by_phase.get("forward", []), forward) if stage == 3 else 0.0
        window = backward if stage == 3 else backward / layout.micro_batches  # no_sync before the last
        exposed_backward = _exposed(by_phase.get("backward", []), window)
    step_comm = sum(by_phase.get("step", []))
    # stages 1-2 all-gather each bucket while the next one is stepped: only the excess shows
    exposed_step = max(0.0, step_comm - optimizer) if stage in (1, 2) else step_comm
    exposed = fwd + exposed_backward + exposed_step + sum(by_phase.get("exposed", []))
    bubble = pipeline_bubble_s(layout, forward, backward)
    parts = {phase: sum(times) for phase, times in by_phase.items()}
    return StepTime(
        forward_s=forward,
        backward_s=backward,
        optimizer_s=optimizer,
        comm_s=comm,
        exposed_comm_s=exposed,
        bubble_s=bubble,
        offload_s=offload,
        comm_bytes=sum(c.nbytes * c.count for c in todo),
        sent_bytes=sum(c.sent(gloo) for c in todo),
        parts=parts,
    )
