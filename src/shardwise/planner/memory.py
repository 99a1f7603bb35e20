"""Memory per rank, by component, for a model, a layout and a run: arithmetic only, nothing is built.

No communication: this is the planner's bookkeeping (``shardwise plan``). For Ψ trainable parameters,
N data-parallel ranks, K optimizer states per parameter (AdamW 2, SGD with momentum 1, plain SGD 0):

**Model states** per rank and the planner's inputs: ``planner/layout.py``; **activations** per block and
micro-batch: ``planner/activations.py``. Here they are put together with the rest:

**Communication buffers**: DDP's gradients *are* its buckets (views), so nothing extra (and on a dp
group of one there are no buckets: each gradient appears as backward frees the activations it needed,
so with one micro-batch the two do not add up); ZeRO-1 under
mixed precision casts every bucket to fp32 for the reduction (4Ψ, all held at the end of backward);
ZeRO-2 holds up to three fp32 buckets of ``bucket_mb`` in backward (one collecting, two reducing);
ZeRO-3 holds the root unit (embeddings, final norm, head) gathered all step, one or two gathered blocks
in backward (two with prefetch) with one fp32 flat gradient buffer of a block, and the root's gradients
at the end. Mixed-precision DDP also keeps autocast's low-precision copy of every weight from forward
to backward. Over several micro-batches (``_accumulated_grads``) stage 2 holds full gradients under
``no_sync`` until the last one reduces them, stage 3 on a pipeline adds each unit's gradient into a full
flat buffer (one reduce-scatter a step), and stage 3 in the plain loop keeps its shard all step; a
pipeline reduces after its last backward, so ZeRO's reduce buffers come at the step. Adam on the CPU
steps one tensor at a time and makes two temporaries of it (``_optimizer_temporaries``: a parameter
for DDP, a bucket's or unit's shard for ZeRO).

**Phases.** Not everything is alive at once: the peak is the largest of five phases: the build (the
model is made on the meta device and each rank materialises only its part: ``_build_bytes``), the
end of forward (every
activation, the logits peak at the loss), backward (activations, the buffers gradients fill), the step's
reductions (ZeRO-2/3's gradient shards and stage 1's fp32 slice, which arrive as the activations go,
and the buffers they came through) and the update (the optimizer's temporaries, once those buffers
are freed).
Measured with a dispatch mode (tensor bytes, not RSS) by ``shardwise plan --preset large --check``, the
large GPT peaks within 0.94-1.09 of this on 2 ranks and 0.98-1.07 on 4, for DDP and ZeRO-1/2/3 with and
without checkpointing, on dp, tp 2 and a 2-stage 1F1B (``benchmarks/results/plan_check-large*.json``).

A framework overhead (``Calibration.overhead_bytes``: the allocator, the runtime, measured once in one
process without a strategy) is added as one constant, never fitted on the layout being checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.config import ConfigError
from shardwise.planner.activations import (
    block_activations,
    logits_peak_bytes,
)
from shardwise.planner.calibration import Calibration
from shardwise.planner.layout import (
    Layout,
    ModelStates,
    Training,
    model_states,
    zero_stage,
)
from shardwise.planner.model import ModelShape
from shardwise.planner.pipeline import RankShare, head_kept_per_token, kept_per_token, pair_peak, rank_shares

# -- the estimate -----------------------------------------------------------------------------------


# the end of forward (at the loss), backward, the step's reductions, the optimizer's update
ALWAYS = ("forward", "backward", "step", "update")
PHASES = ("build", *ALWAYS)  # build: each rank materialises its part of the model (made on meta)
STEP = ("step", "update")  # from the end of backward through the update


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by component; ``device`` is what must fit, ``host`` what offload moved out.

    Each component is alive in some of the step's phases (``phases``; absent: all of them), and the
    peak (``total``) is the largest phase: activations are gone when ZeRO's gradient shards arrive,
    and the logits are gone before the first gradient bucket fills.
    """

    layout: Layout
    device: dict[str, float]
    host: dict[str, float] = field(default_factory=dict)
    micro_batch: int = 1  # sequences per micro-batch per rank
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    pp_rank: int | None = None  # on a pipeline: the rank estimated (the worst)

    def in_phase(self, phase: str) -> float:
        return sum(v for k, v in self.device.items() if phase in self.phases.get(k, ALWAYS))

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.in_phase)

    @property
    def total(self) -> float:
        """The peak: the phase that holds the most."""
        return self.in_phase(self.peak_phase)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def largest(self, count: int = 3) -> list[tuple[str, float]]:
        """The largest components alive at the peak."""
        phase = self.peak_phase
        alive = [(k, v) for k, v in self.device.items() if v > 0 and phase in self.phases.get(k, ALWAYS)]
        return sorted(alive, key=lambda kv: -kv[1])[:count]


def micro_batch_size(training: Training, layout: Layout) -> int:
    """Sequences per micro-batch on one rank; a one-line error when the batch does not divide."""
    share = layout.dp * layout.micro_batches
    if training.global_batch % share:
        raise ConfigError(
            f"global_batch({training.global_batch}) is not divisible by dp({layout.dp}) x "
            f"micro_batches({layout.micro_batches}) = {share}"
        )
    return training.global_batch // share


def _stage_psi(model: ModelShape, layout: Layout, share: RankShare) -> tuple[float, float, float]:
    """(Ψ, block, root) parameters one rank's data-parallel layer manages: its stages' blocks and the
    part of the root it holds (the embeddings on the first stage, the final norm and an untied head
    on the last), each divided by tp (norms, replicated, counted whole would be a rounding error)."""
    block = model.block_params / layout.tp
    embeddings = (model.vocab + model.positions) * model.d_model
    held = (embeddings if share.first else 0) + (model.root_params - embeddings if share.last else 0)
    root = held / layout.tp
    return share.blocks * block + root, block, root


Parts = dict[str, tuple[float, tuple[str, ...]]]  # component -> (bytes, phases it is alive in)


def _comm_buffers(model: ModelShape, training: Training, layout: Layout, share: RankShare) -> Parts:
    psi, block, root = _stage_psi(model, layout, share)
    stage, cb, mb = zero_stage(layout.strategy), training.compute_bytes, training.master_bytes
    out: Parts = {}
    if stage == 0 and training.mixed:  # low-precision casts saved from forward until backward
        out["autocast_weights"] = (psi * cb, ("forward", "backward"))
    if layout.strategy == "ps":  # a worker's flat gradient pushed and the weights pulled
        out["ps_messages"] = (2 * psi * training.param_bytes, ("step",))
    if stage == 1 and training.mixed:
        # every bucket is cast to fp32 for its reduction as it completes, and all are held to the end
        # of backward, as the activations go: together at the step
        out["reduce_buffers"] = (psi * mb, ("step",))
    # a pipeline reduces once, in finish_grads after its last backward: the buffers come at the step
    reducing = ("step",) if layout.pp > 1 else ("backward",)
    if stage == 2:  # one bucket collecting, two reducing (a bucket's parameters are in no other)
        out["reduce_buffers"] = (min(3 * layout.bucket_mb * 2**20, psi * mb), reducing)
    if stage == 3:
        units = 2 if layout.prefetch else 1
        out["gathered_root"] = (root * cb, ALWAYS)
        out["gathered_blocks"] = (units * block * cb, ("backward",))  # forward frees each as it goes
        out["reduce_buffers"] = (block * mb, reducing)
        # the root's gradients stay as .grad until its last (the embedding's) arrives, then go flat
        out["root_grads"] = (root * (cb + mb), ("step",))
    return out


def _activations(
    model: ModelShape, training: Training, layout: Layout, micro_batch: int, share: RankShare
) -> Parts:
    tokens = micro_batch * training.seq_len
    cb = training.compute_bytes
    replicated = zero_stage(layout.strategy) == 0
    residual = 4 if training.mixed and replicated else cb  # autocast keeps the residual stream fp32
    acts = block_activations(model, tokens, cb, residual, layout.tp, layout.sequence_parallel)
    seq = layout.tp if layout.sequence_parallel else 1
    # a (stage, micro-batch) pair: one stage's blocks; from I to W, what the W pass reads
    blocks = share.blocks / share.stages
    saved = acts.checkpointed if layout.activation_checkpointing else acts.full
    kept = blocks * tokens * kept_per_token(model, cb, layout.tp, layout.sequence_parallel)
    if share.last and not share.tied_copy:  # a head reading a tied copy gets its dW in I (pipeline/deferred)
        kept += tokens * head_kept_per_token(model, cb, layout.tp)
    pairs = pair_peak(share, layout.pp, layout.schedule, layout.micro_batches, blocks * saved, kept)
    out: Parts = {}
    head = 0.0
    if share.last:
        # the final norm's input (and, RMSNorm, its normalised copy) and the head's input
        head = tokens * model.d_model * (residual + cb + (0 if model.layer_norm else cb)) / seq
        logits = logits_peak_bytes(tokens, model.vocab, cb, training.master_bytes, layout.tp)
        out["logits"] = (logits, ("forward",))
    out["activations"] = (pairs + head, ("forward", "backward"))
    if layout.activation_checkpointing:  # inputs kept; backward rebuilds one block at a time
        out["recomputed_block"] = (acts.full, ("backward",))  # the rebuilt block: alive again
    return out


def _accumulated_grads(psi: float, training: Training, layout: Layout, states: ModelStates) -> Parts:
    """Stages 2-3 over several micro-batches: what holds the gradients between them. Stage 2 under
    ``no_sync`` keeps full gradients until the last micro-batch reduces them; stage 3 on a pipeline
    adds each unit's gradient into a full flat buffer (one reduce-scatter a step, FSDP's ``no_sync``);
    stage 3 in the plain loop reduce-scatters every micro-batch into the shard, which then lives all
    step. None with one micro-batch (the shard appears at the end of backward)."""
    stage = zero_stage(layout.strategy)
    if stage < 2 or layout.micro_batches == 1:
        return {}
    if stage == 3 and layout.pp == 1:
        return {"grads": (states.grads, ALWAYS)}
    dtype = training.compute_bytes if stage == 2 and training.mixed else training.master_bytes
    return {"accumulated_grads": (psi * dtype, ("forward", "backward"))}


INIT_CHUNK_ELEMENTS = 2**20  # one chunk of the replayed initialisation (models.init_replay), in float32


def _largest_tensor(model: ModelShape, layout: Layout, share: RankShare) -> float:
    """Elements of the largest parameter a rank holds: an MLP matrix or the fused qkv of its blocks,
    the embedding on the first stage or an untied head on the last."""
    h = model.d_model
    matrices = [h * model.ff, 3 * h * h] if share.blocks else []
    if share.first or (share.last and not model.tie_weights):  # the embedding, or an untied head
        matrices.append(model.vocab * h)
    _, _, root = _stage_psi(model, layout, share)
    return max(matrices, default=root * layout.tp) / layout.tp


def _build_bytes(
    model: ModelShape, training: Training, layout: Layout, share: RankShare, states: ModelStates
) -> float:
    """The build's peak. The model is made on the meta device and each rank materialises only what
    it holds (its stage, its tp shards), one chunk of the replayed initialisation alive at a time:
    DDP (and the parameter server, DiLoCo) its parameters whole, then its gradient buckets on a dp
    group of more than one (rank 0's values broadcast through one flat copy first); ZeRO-1/2 read
    each bucket straight into its flat buffer (under mixed precision a bucket's run-dtype copy is
    alive while its compute copy and master shard are made), then stage 1 its flat gradients; ZeRO-3
    its master shards, beside one unit's flat buffer for the instant its parameters become views."""
    psi, block, root = _stage_psi(model, layout, share)
    stage, pb, cb = zero_stage(layout.strategy), training.param_bytes, training.compute_bytes
    largest = _largest_tensor(model, layout, share)
    chunk = 4 * min(INIT_CHUNK_ELEMENTS, largest)
    if stage == 0:
        copies = 2 if layout.dp > 1 or layout.strategy != "ddp" else 1  # + buckets (or ps's flat message)
        return copies * pb * psi + (chunk if copies == 1 else 0.0)
    kept = states.params + states.master
    if stage == 3:
        unit = max(block, root)
        return kept + max(cb * unit - training.master_bytes * unit / layout.dp, 0.0) + chunk
    bucket = min(max(layout.bucket_mb * 2**20 / training.master_bytes, largest), psi)  # one tensor at least
    flattening = kept + (bucket * pb if training.mixed else 0.0) + chunk
    full_grads = (cb if training.mixed else pb) * psi  # stage 1's, made once every bucket is flat
    return max(flattening, kept + full_grads) if stage == 1 else flattening


def _optimizer_temporaries(model: ModelShape, training: Training, layout: Layout, share: RankShare) -> float:
    """Adam on the CPU steps one tensor at a time (torch's single-tensor path) and builds its
    denominator from two temporaries of that tensor's size (the second moment's square root, then
    its quotient by the bias correction): two copies of the largest tensor stepped. That is a
    parameter for DDP; a bucket's shard for ZeRO-1/2 (a group of about ``bucket_mb``, one parameter
    at least); a unit's shard for ZeRO-3 (a block, or the root). SGD makes none. (On a GPU torch's
    multi-tensor path makes them for a whole group at once: not modelled.)"""
    if training.optimizer not in ("adam", "adamw"):
        return 0.0
    psi, block, root = _stage_psi(model, layout, share)
    largest = _largest_tensor(model, layout, share)
    stage = zero_stage(layout.strategy)
    if stage in (1, 2):
        bucket = layout.bucket_mb * 2**20 / training.master_bytes
        largest = min(max(bucket, largest), psi) / layout.dp
    elif stage == 3:
        largest = max(block, root) / layout.dp
    return 2 * training.master_bytes * largest


def estimate_memory(
    model: ModelShape, training: Training, layout: Layout, calibration: Calibration | None = None
) -> MemoryEstimate:
    """Peak bytes on the worst rank (a worker, for the parameter server), by component and phase: on
    a pipeline every rank is estimated with its own share (``planner/pipeline.py``), the largest
    reported (``pp_rank`` says which)."""
    return max(estimate_ranks(model, training, layout, calibration), key=lambda estimate: estimate.total)


def estimate_ranks(
    model: ModelShape, training: Training, layout: Layout, calibration: Calibration | None = None
) -> list[MemoryEstimate]:
    """Every pipeline rank's estimate, in rank order (one, without a pipeline)."""
    shares = rank_shares(model, layout.pp, layout.schedule, layout.virtual_stages)
    return [_estimate_rank(model, training, layout, calibration or Calibration(), s) for s in shares]


def _estimate_rank(
    model: ModelShape, training: Training, layout: Layout, calibration: Calibration, share: RankShare
) -> MemoryEstimate:
    micro_batch = micro_batch_size(training, layout)
    psi, _, _ = _stage_psi(model, layout, share)
    stage = zero_stage(layout.strategy)
    states = model_states(
        psi, layout.strategy, layout.dp, training.precision, training.states, training.param_bytes
    )
    # DDP's buckets and stage 1's flat gradients live all step; stages 2-3's shards arrive at its end;
    # DDP over a dp group of one keeps no buckets: autograd's gradients, from backward to the update
    grad_phases: tuple[str, ...] = ALWAYS
    if stage >= 2:
        grad_phases = STEP
    elif layout.strategy == "ddp" and layout.dp == 1:
        # one micro-batch: each gradient appears as backward frees the activations it needed, so
        # the two peak apart; accumulating (or on a pipeline) they meet
        grad_phases = STEP if layout.micro_batches == 1 else ("backward", *STEP)
    parts: Parts = {
        "params": (states.params, ALWAYS),
        "master_params": (states.master, ALWAYS),
        "grads": (states.grads, grad_phases),
        "optimizer_state": (0.0 if layout.strategy == "ps" else states.optimizer_state, ALWAYS),
    }  # a parameter server's workers keep no optimizer: its servers do (ps_server_bytes)
    if stage == 1 and training.mixed:  # the full bf16 gradients stay; the fp32 slice comes at the end
        full = training.compute_bytes * psi
        parts["grads"], parts["grad_shard"] = (full, ALWAYS), (states.grads - full, STEP)
    parts.update(_accumulated_grads(psi, training, layout, states))
    if layout.offload == "none" and layout.strategy != "ps":
        temporaries = _optimizer_temporaries(model, training, layout, share)
        parts["optimizer_temporaries"] = (temporaries, ("update",))
    host: dict[str, float] = {}
    if layout.offload == "cpu":
        host = {"master_params": states.master, "optimizer_state": states.optimizer_state}
        if stage == 3 and not training.mixed:
            host["params"] = states.params  # the parameter shard is the master
            parts["params"] = (0.0, ALWAYS)
        elif not training.mixed:  # with offload the master no longer aliases the parameters
            host["master_params"] = training.param_bytes * psi / layout.dp
        parts["master_params"] = parts["optimizer_state"] = (0.0, ALWAYS)
    parts.update(_comm_buffers(model, training, layout, share))
    parts.update(_activations(model, training, layout, micro_batch, share))
    if share.tied_copy:  # the head's copy of the first stage's embedding, and its gradient until sent
        copy = training.param_bytes * model.vocab * model.d_model / layout.tp
        parts["tied_copy"], parts["tied_copy_grad"] = (copy, ALWAYS), (copy, ("backward",))
    parts["model_build"] = (_build_bytes(model, training, layout, share, states), ("build",))
    parts["overhead"] = (calibration.overhead_bytes, ALWAYS)
    device = {name: value for name, (value, _) in parts.items()}
    phases = {name: when for name, (_, when) in parts.items()}
    rank = share.rank if layout.pp > 1 else None
    return MemoryEstimate(layout, device, host, micro_batch, phases, rank)


def ps_server_bytes(model: ModelShape, training: Training, layout: Layout) -> float:
    """A parameter server's bytes: its share of the parameters, the optimizer state and the summed
    gradient, plus one incoming message per worker at a time."""
    share = model.params / layout.ps_servers * training.param_bytes
    return share * (1 + training.states + 1 + 1)
