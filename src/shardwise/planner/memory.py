"""Memory per rank, by component, for a model, a layout and a run: arithmetic only, nothing is built.

No communication: this is the planner's bookkeeping (``shardwise plan``). For Ψ trainable parameters,
N data-parallel ranks, K optimizer states per parameter (AdamW 2, SGD with momentum 1, plain SGD 0):

**Model states** (``model_states``), as *this* implementation keeps them. fp32 training (``pb`` bytes
per value, 8 for float64): parameters pbΨ, gradients pbΨ, optimizer state K·pbΨ, and the master *is* the
parameter. Mixed precision (bf16/fp16): DDP and the parameter server keep fp32 parameters and compute
under autocast (the same bytes as fp32, plus the cast weights, below); ZeRO keeps 2Ψ compute copies, an
fp32 master shard 4Ψ/N and fp32 moments 4KΨ/N. Stage 1 keeps the full gradients (2Ψ) and the reduced
fp32 slice (4Ψ/N); stages 2-3 only an fp32 gradient shard 4Ψ/N; stage 3 keeps no compute copy at all
(a unit is cast from the master when gathered). ZeRO's CPU offload moves masters and moments to host
memory. Rajbhandari et al. (SC 2020, "ZeRO", section 5) count the same states with fp16 gradients and
an fp16 parameter shard (``zero_paper_bytes``: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N for K = 12).

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

**Activations** per block and micro-batch of b sequences of s tokens, width h, a heads, tp degree t.
Korthikanti et al. (MLSys 2023, "Reducing Activation Recomputation in Large Transformer Models")
count sbh(34 + 5as/h) bytes per layer at 16 bits (``korthikanti_layer_bytes``; with tensor parallelism
sbh(10 + 24/t + 5as/(ht)), with sequence parallelism too sbh(34 + 5as/h)/t). Our block saves, per token:
the two norm inputs (2h, in the residual stream's dtype: fp32 under autocast), the QKV input (h), the
queries, keys and values (h + 2·kv), the attention output (h: the projection's input is a view of it),
the MLP input (h) and the MLP's inner activations (2f, or 4f gated), in the compute dtype; plus fp32
norm statistics (4 values) and the attention's log-sum-exp (a values): fused attention keeps no s x s
matrix and our blocks have no dropout, so the 5as²b term and the two 1-byte masks are gone. At 16
bits, multi-head, f = 4h this is 32·sbh (Korthikanti's 34 less the masks) plus the small fp32 terms.
Hugging Face's RMSNorm (Llama) keeps its normalised input too: h more per norm. A test measures the
saved bytes of our GPT and of a Llama with a dispatch mode and finds these counts within 1%. Under
tensor parallelism the head-split and MLP tensors divide by t, and with sequence parallelism everything
does. With activation checkpointing a block keeps only its input, and backward rebuilds one block at a
time. Outside the blocks: the final
norm's and the head's inputs, and the logits peak at the loss (the logits, their fp32 log-softmax, and
the gradients of each). With pipeline parallelism (Narayanan et al.,
SC 2021) every rank is estimated with its own share and the largest reported (``planner/pipeline.py``):
its blocks as the split balances them, the embeddings on the first stage, the head, the logits and a
tied embedding's copy on the last, and its own micro-batches in flight from the pipeline's validator
(``pipeline.validate.peak_activations``: a (stage, micro-batch) pair holds the stage's saved tensors
from F to B or I, and from a zero-bubble I to its W each linear layer's input and output gradient;
each pair 1/v of a rank's blocks with v virtual stages); 1F1B gives min(m, pp) on the first stage.

A framework overhead (``Calibration.overhead_bytes``: the allocator, the runtime, measured once in one
process without a strategy) is added as one constant, never fitted on the layout being checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardwise.config import ConfigError
from shardwise.dims import ParallelDims
from shardwise.planner.calibration import Calibration
from shardwise.planner.model import ModelShape
from shardwise.planner.pipeline import RankShare, head_kept_per_token, kept_per_token, pair_peak, rank_shares

STRATEGIES = ("ddp", "ps", "zero1", "zero2", "zero3")
OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")
GB = 1e9  # the ZeRO paper's gigabyte: 7.5e9 parameters x 16 bytes = 120 GB
GiB = 2**30  # DeepSpeed's estimators print GiB as "GB"


def zero_stage(strategy: str) -> int:
    """0 for the replicated strategies (ddp, ps), else the ZeRO stage."""
    return int(strategy[-1]) if strategy.startswith("zero") else 0


def optimizer_states(optimizer: str, momentum: float = 0.9) -> int:
    """Parameter-sized tensors the optimizer keeps: Adam(W) two moments, SGD a momentum buffer or none."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    if optimizer == "sgd":
        return 1 if momentum > 0 else 0
    return 2


@dataclass(frozen=True)
class Training:
    """What a step computes: the batch, the precision and the optimizer."""

    global_batch: int  # sequences per optimizer step, summed over the data-parallel ranks
    seq_len: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.9  # sgd only; 0: no momentum buffer
    param_bytes: int = 4  # the model's dtype in fp32 mode (8 for float64)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        optimizer_states(self.optimizer, self.momentum)
        if self.global_batch < 1 or self.seq_len < 1:
            raise ConfigError(
                f"global_batch and seq_len must be >= 1; got {self.global_batch}, {self.seq_len}"
            )

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def compute_bytes(self) -> int:
        return 2 if self.mixed else self.param_bytes

    @property
    def master_bytes(self) -> int:
        return max(4, self.param_bytes) if self.mixed else self.param_bytes

    @property
    def states(self) -> int:
        return optimizer_states(self.optimizer, self.momentum)


@dataclass(frozen=True)
class Layout:
    """How the job is laid out over the devices: the data-parallel strategy and the mesh degrees (read
    as the job's own axis table, ``dims``: the same ``ParallelDims`` the config and the mesh use)."""

    strategy: str = "ddp"
    dp: int = 1
    pp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    micro_batches: int = 1  # gradient accumulation: each rank's share is split this many ways
    activation_checkpointing: bool = False
    offload: str = "none"  # none | cpu: ZeRO's masters and optimizer state in host memory
    bucket_mb: float = 25.0
    prefetch: bool = True  # ZeRO-3 gathers the next block while this one runs
    ps_servers: int = 1
    schedule: str = "1f1b"  # the pipeline schedule (pipeline.schedules), when pp > 1
    virtual_stages: int = 1  # stages per pipeline rank (interleaved and V schedules)
    dims: ParallelDims = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}")
        for name in ("dp", "pp", "tp", "micro_batches", "ps_servers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"layout {name} must be >= 1, got {getattr(self, name)}")
        servers = self.ps_servers if self.strategy == "ps" else 0
        object.__setattr__(self, "dims", ParallelDims(self.dp, self.pp, self.tp, servers))
        if not 0 < self.bucket_mb < math.inf:
            raise ConfigError(f"bucket_mb must be a finite number > 0, got {self.bucket_mb}")
        if self.offload not in ("none", "cpu"):
            raise ConfigError(f"the planner models offload none or cpu; got {self.offload!r}")
        if self.offload != "none" and not self.strategy.startswith("zero"):
            raise ConfigError(f"offload applies to zero1/zero2/zero3, not to {self.strategy}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence parallelism needs tp > 1")
        if self.pp > 1:
            from shardwise.pipeline.schedules import ScheduleConfigError, check

            try:
                check(self.schedule, self.pp, self.virtual_stages, self.micro_batches)
            except ScheduleConfigError as e:
                raise ConfigError(f"layout: {e}") from None

    @property
    def devices(self) -> int:
        """The devices that train (a parameter server's stand beside them)."""
        return self.dims.trainers

    def name(self) -> str:
        mesh = (
            f"dp{self.dp}"
            + (f"-pp{self.pp}" if self.pp > 1 else "")
            + (f"-tp{self.tp}" if self.tp > 1 else "")
        )
        parts = [self.strategy, mesh, f"mb{self.micro_batches}"]
        if self.pp > 1 and (self.schedule, self.virtual_stages) != ("1f1b", 1):
            parts.append(self.schedule + (f"-v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.offload != "none":
            parts.append(f"offload-{self.offload}")
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)


@dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's parameters, fp32 masters, gradients and optimizer moments."""

    params: float
    master: float
    grads: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.params + self.master + self.grads + self.optimizer_state


def model_states(
    psi: float, strategy: str, dp: int, precision: str = "fp32", states: int = 2, param_bytes: int = 4
) -> ModelStates:
    """Model-state bytes per rank as this implementation keeps them (see the module docstring)."""
    stage, n = zero_stage(strategy), dp
    mixed = precision != "fp32"
    full = param_bytes * psi  # one full fp32 (or float64) copy
    if stage == 0:  # replicated; under mixed precision the parameters stay fp32 (autocast)
        return ModelStates(full, 0.0, full, states * full)
    master_bytes = max(4, param_bytes) if mixed else param_bytes
    state = states * master_bytes * psi / n
    if not mixed:  # the master is the parameter (or, in stage 3, the parameter shard)
        params = full / n if stage == 3 else full
        return ModelStates(params, 0.0, full if stage == 1 else full / n, state)
    params = 0.0 if stage == 3 else 2 * psi
    shard = master_bytes * psi / n
    grads = 2 * psi + shard if stage == 1 else shard
    return ModelStates(params, shard, grads, state)


def zero_paper_bytes(psi: float, stage: int, dp: int, k: int = 12) -> dict[str, float]:
    """Rajbhandari et al. (2020), section 5: fp16 parameters and gradients, K bytes of optimizer state
    per parameter (mixed-precision Adam: fp32 master, momentum, variance: K = 12); stage 0 is DP."""
    n = dp
    params = 2 * psi / (n if stage >= 3 else 1)
    grads = 2 * psi / (n if stage >= 2 else 1)
    state = k * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer_state": state, "model_state": params + grads + state}


def zero_formula(
    psi: int,
    stage: int,
    world_size: int,
    precision: str = "fp32",
    param_bytes: int = 4,
    states_per_param: int = 2,
    frozen_bytes: int = 0,
) -> dict[str, float]:
    """Model-state bytes per rank for ZeRO ``stage``, masters counted with the optimizer state (as
    ``shardwise.zero.memory.model_state_bytes`` reports live tensors beside it). Frozen parameters
    are not sharded and are added whole."""
    ms = model_states(psi, f"zero{stage}", world_size, precision, states_per_param, param_bytes)
    params = ms.params + frozen_bytes
    state = ms.master + ms.optimizer_state
    return {
        "params": params,
        "grads": ms.grads,
        "optimizer_state": state,
        "model_state": params + ms.grads + state,
    }


# -- activations ------------------------------------------------------------------------------------


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Korthikanti et al. (2023), table 2: activation bytes of one transformer layer at 16 bits.

    ``recompute``: ``none``; ``selective`` (the attention core recomputed); ``full`` (the layer's input
    alone is kept, 2sbh).
    """
    if recompute == "full":
        return 2 * s * b * h
    if recompute == "selective":  # the attention core (the 5as/h term) is recomputed
        return 34 * s * b * h / tp if sequence_parallel else s * b * h * (10 + 24 / tp)
    attention = 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 + attention) / tp
    return s * b * h * (10 + 24 / tp + attention / tp)


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block saves for backward for one micro-batch, and what it keeps under checkpointing."""

    full: float  # everything autograd saves
    checkpointed: float  # the block's input alone


def block_activations(
    model: ModelShape,
    tokens: int,
    compute_bytes: int,
    residual_bytes: int,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> BlockActivations:
    """Our block's saved tensors for ``tokens`` tokens (see the module docstring for the list)."""
    h, t = model.d_model, tp
    split = t  # tensors split by heads or by the MLP's width
    seq = t if sequence_parallel else 1  # tensors that are whole under tp, sharded along s under sp
    mlp_inner = (4 if model.gated_mlp else 2) * model.ff
    residual = 2 * h * residual_bytes / seq  # the two norms' inputs
    # Hugging Face's RMSNorm also saves the normalised input, cast back, for its weight's product
    rms = 0 if model.layer_norm else 2 * h * compute_bytes / seq
    whole = 2 * h * compute_bytes / seq  # the QKV and MLP inputs
    heads = (h + 2 * model.kv_width + h + mlp_inner) * compute_bytes / split
    fp32 = (2 * 2 * 4) / seq + 4 * model.n_head / split  # norm statistics, attention log-sum-exp
    per_token = residual + rms + whole + heads + fp32
    return BlockActivations(tokens * per_token, tokens * h * residual_bytes / seq)


def logits_peak_bytes(tokens: int, vocab: int, compute_bytes: int, loss_bytes: int, tp: int = 1) -> float:
    """At the loss's backward: the logits, their log-softmax (fp32, or float64 for a float64 model), its
    gradient and the logits' gradient (cast back to the compute dtype under mixed precision)."""
    per_token = (
        vocab / tp * (3 * loss_bytes + compute_bytes + (compute_bytes if compute_bytes < loss_bytes else 0))
    )
    return tokens * per_token


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
