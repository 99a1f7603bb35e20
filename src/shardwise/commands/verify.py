"""``shardwise verify``: a strategy on N ranks against plain PyTorch in one process.

Both sides start from the same seed, draw the same global batches and run in float64 by default.
The reference is written without any shardwise engine: ``model(x)``, the summed token loss divided by
the global token count, ``backward``, ``optimizer.step``. Reported: the largest difference of the
per-step losses, of the gradient norms and learning rates, of the first step's gradients, of the final
parameters and buffers; the exit code is 1 when any exceeds the tolerance, and the report names it.

DiLoCo is one-process-equivalent only where local SGD is all-reduce data parallelism: H = 1
(``diloco.sync_every``, or every step before ``diloco.start_local_step``), an outer SGD at lr 1 with no
momentum, a linear inner optimizer (SGD) and no clipping. ``verify --strategy diloco`` defaults to those
and refuses other values in one line; its gradient norm is each rank's own (clipping is local, nothing is
communicated between synchronisations), so it is shown but not compared.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardwise.config import ConfigError, TrainConfig, describe_layout
from shardwise.launcher import LaunchError, init_distributed, launch_local
from shardwise.models import GPT_KIND
from shardwise.pipeline.fitting import FIT_STEPS
from shardwise.pipeline.schedules import SCHEDULES
from shardwise.preflight import preflight
from shardwise.testing.parity import compare_tensors

TOLERANCE = 1e-10
VERIFY_DEFAULTS = {
    "dtype": "float64",
    "steps": "5",
    "model.preset": "odd-deep",  # odd widths, 8 blocks (pp 4 x 2 virtual stages), 4 heads
    "model.freeze": "wpe",  # a frozen parameter must stay equal and untouched (the built-in GPT's)
    "data.global_batch": "12",
    "eval_every": "0",
    "run_dir": "runs/verify",
}


# DiLoCo as all-reduce data parallelism (see the module docstring): what verify compares it under
DILOCO_DEFAULTS = {
    "optim.name": "sgd",
    "diloco.sync_every": "1",
    "diloco.outer_lr": "1",
    "diloco.outer_momentum": "0",
}


def verify_defaults(kind: str, strategy: str = "ddp", schedule: str | None = None) -> dict[str, str]:
    """The defaults for ``model.kind``, ``strategy`` and a pipeline's ``schedule``: only the built-in
    GPT has ``wpe`` to freeze; diloco runs as local SGD at H = 1, where it equals one process; a
    schedule that splits backwards runs two steps past its fit (``pipeline/fitting.py``: the fitted
    schedule, the one training keeps, runs from step ``FIT_STEPS`` on)."""
    defaults = dict(VERIFY_DEFAULTS)
    spec = SCHEDULES.get(schedule or "")  # an unknown name is refused by the config's own check
    if spec is not None and spec.splits_backward:
        defaults["steps"] = str(FIT_STEPS + 2)
    if kind != GPT_KIND:  # the deep preset is the GPT's; the MLP keeps its own odd one
        del defaults["model.freeze"]
        defaults["model.preset"] = "odd"
    if strategy == "diloco":
        defaults.update(DILOCO_DEFAULTS)
    return defaults


def check_comparable(config: TrainConfig) -> None:
    """Refuse, in one line, a diloco run that one process could not equal (the module docstring)."""
    if config.strategy != "diloco":
        return
    diloco, optim = config.diloco, config.optim
    gaps = []
    if diloco.start_local_step < config.steps:  # else every step is plain averaging: no outer optimizer
        if diloco.sync_every != 1:
            gaps.append(f"diloco.sync_every = {diloco.sync_every} (not 1)")
        if diloco.outer_lr != 1:
            gaps.append(f"diloco.outer_lr = {diloco.outer_lr} (not 1)")
        if diloco.outer_momentum != 0:
            gaps.append(f"diloco.outer_momentum = {diloco.outer_momentum} (not 0)")
    if optim.name != "sgd":  # the ranks' updates average to the global one only when linear in the gradient
        gaps.append(f"optim.name = {optim.name!r} (not sgd)")
    if 0 < optim.clip_grad_norm < math.inf:
        gaps.append(f"optim.clip_grad_norm = {optim.clip_grad_norm} (each rank clips its own norm)")
    if gaps:
        raise ConfigError(
            f"verify compares diloco with one process only where they are equal (local SGD at H = 1: "
            f"sync_every 1, outer SGD lr 1 without momentum, inner SGD, no clipping); got {', '.join(gaps)}. "
            "Drop those settings, or compare the loss with `shardwise bench compress`"
        )


def collect_run(config: TrainConfig) -> dict[str, Any] | None:
    """On an initialised group: train ``config.steps`` steps; the reporting rank returns the results.

    The gradients are those of the first step, taken after communication and before the update.
    """

    from shardwise.train.loop import Trainer

    trainer = Trainer.build(config, share_gradients=True)
    if trainer.engine.role.serves:
        try:
            trainer.engine.serve()
        finally:
            trainer.engine.close()
        return None
    grads: dict[str, torch.Tensor] = {}

    def keep_first(step: int) -> None:
        if step == 0:
            grads.update(trainer.engine.full_gradients())

    try:
        records = [trainer.step(step, after_backward=keep_first) for step in range(config.steps)]
        params = trainer.engine.full_parameters()
    finally:
        trainer.engine.close()
    if not trainer.engine.role.reports:
        return None
    return {  # on the host, beside the one-process reference (which runs on the CPU)
        "losses": [r.loss for r in records],
        "grad_norms": [r.grad_norm for r in records],
        "lrs": [r.lr for r in records],
        "grads": _on_host(grads),
        "params": _on_host(params),
        "buffers": _on_host({n: b.detach() for n, b in trainer.engine.model.named_buffers()}),
    }


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


def verify_worker(config: TrainConfig) -> dict[str, Any] | None:
    """What every rank runs under the launcher."""
    import torch.distributed as dist

    init_distributed(config.timeout_s, config.device)
    try:
        return collect_run(config)
    finally:
        dist.destroy_process_group()


def reference_run(config: TrainConfig) -> dict[str, Any]:
    """Plain single-process PyTorch on the whole global batch: the answer every strategy must give."""
    from shardwise.checkpoint.pretrained import load_pretrained
    from shardwise.data.corpus import load_corpus
    from shardwise.data.sampler import DataSampler
    from shardwise.engine.loss import logits_of, loss_sum
    from shardwise.engine.optim import build_optimizer, named
    from shardwise.engine.schedule import lr_multiplier
    from shardwise.models import build_model, predicted_tokens
    from shardwise.train.loop import seed_everything, torch_dtype

    seed_everything(config.seed)
    init_from = config.model.init_from  # built as the ranks build it: no values drawn, then loaded
    model = build_model(config.model, torch_dtype(config.dtype), meta=bool(init_from))
    if init_from:
        load_pretrained(model, init_from)
    optimizer = build_optimizer(named(model), config.optim)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config.optim, config.steps))
    trainable = [p for p in model.parameters() if p.requires_grad]
    clip = config.optim.clip_grad_norm if config.optim.clip_grad_norm > 0 else float("inf")
    corpus = load_corpus(config.data.corpus_bytes)
    sampler = DataSampler(
        corpus.train,
        config.model.seq_len,
        config.data.global_batch,
        config.seed,
        [config.data.global_batch],
        0,
    )
    tokens = predicted_tokens(config.model.kind, config.data.global_batch, config.model.seq_len)
    losses, grads, norms, lrs = [], {}, [], []
    for step in range(config.steps):
        inputs, targets = sampler.global_batch(step)
        loss = loss_sum(logits_of(model(inputs)), targets) / tokens
        loss.backward()
        if step == 0:
            grads = {
                n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, clip)))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "grad_norms": norms,
        "lrs": lrs,
        "buffers": buffers,
    }


# measure -> its report key; each is compared against the tolerance (grad norm: where the strategy's
# norm is the global one, see ``LOCAL_NORM``)
MEASURES = {
    "loss": "max_loss_diff",
    "grad norm": "max_grad_norm_diff",
    "lr": "max_lr_diff",
    "grad": "max_grad_diff",
    "param": "max_param_diff",
    "buffer": "max_buffer_diff",
}
LOCAL_NORM = ("diloco",)  # strategies whose reported gradient norm is each rank's own


def compare_runs(
    reference: dict[str, Any], candidate: dict[str, Any], tolerance: float, compare_norm: bool = True
) -> dict[str, Any]:
    """The largest difference of each measure; ``ok`` when every compared one is within ``tolerance``
    (NaN is not), ``failed`` names those that are not. ``compare_norm``: False where the candidate's
    gradient norm is not the global one (shown, not compared)."""
    losses = [abs(a - b) for a, b in zip(reference["losses"], candidate["losses"], strict=True)]
    norms = [abs(a - b) for a, b in zip(reference["grad_norms"], candidate["grad_norms"], strict=True)]
    lrs = [abs(a - b) for a, b in zip(reference["lrs"], candidate["lrs"], strict=True)]
    grad = compare_tensors(reference["grads"], candidate["grads"])
    param = compare_tensors(reference["params"], candidate["params"])
    buffer = compare_tensors(reference.get("buffers", {}), candidate.get("buffers", {}))
    diffs = {
        "loss": max(losses),
        "grad norm": max(norms),
        "lr": max(lrs),
        "grad": grad.max_diff,
        "param": param.max_diff,
        "buffer": buffer.max_diff,  # BatchNorm running statistics, say
    }
    compared = [m for m in diffs if compare_norm or m != "grad norm"]
    failed = [m for m in compared if not diffs[m] <= tolerance]  # NaN is not <=
    return {
        **{MEASURES[m]: value for m, value in diffs.items()},
        "worst_grad": grad.where,
        "worst_param": param.where,
        "tolerance": tolerance,
        "compared": compared,
        "failed": failed,
        "ok": not failed,
        "losses": candidate["losses"],
        "reference_losses": reference["losses"],
        "grad_norm": candidate["grad_norms"],
        "reference_grad_norm": reference["grad_norms"],
        "lr": candidate["lrs"],
    }


def run_verify(config: TrainConfig, nproc: int) -> dict[str, Any]:
    config = preflight(config, nproc, writes_run_files=False)  # verify writes no run folder
    check_comparable(config)
    results = launch_local(verify_worker, (config,), nproc)
    candidate = next(r for r in results.values() if r is not None)
    compare_norm = config.strategy not in LOCAL_NORM
    report = compare_runs(reference_run(config), candidate, TOLERANCE, compare_norm)
    return {
        "strategy": config.strategy,
        "layout": describe_layout(config, config.dims(nproc)),
        **_pipeline_fields(config),
        "nproc": nproc,
        "steps": config.steps,
        "dtype": config.dtype,
        **report,
    }


def _pipeline_fields(config: TrainConfig) -> dict[str, Any]:
    """With a pipeline: the schedule it ran, its stages per rank, the micro-batches and named split."""
    parallel = config.parallel
    if parallel.pp == 1:
        return {}
    return {
        "schedule": parallel.schedule,
        "virtual_stages": parallel.stages_per_rank,
        "micro_batches": config.data.micro_batches,
        "pp_split": list(parallel.pp_split),
    }


def verify_command(config: TrainConfig, nproc: int, as_json: bool) -> int:
    from shardwise.commands.output import emit

    try:
        report = run_verify(config, nproc)
    except LaunchError as exc:
        return exc.report("verify")
    emit(report, as_json, _render)
    return 0 if report["ok"] else 1


def _render(report: dict[str, Any]) -> None:
    """Every measure, each marked within or over the tolerance; the verdict names those over it."""
    failed = report.get("failed", [])
    verdict = f"FAILED ({', '.join(failed)} over the tolerance)" if failed else "OK"
    lines = [
        f"{verdict}: {report['strategy']} on {report['nproc']} ranks ({report['layout']}) "
        "vs one process, "
        f"{report['steps']} steps in {report['dtype']}"
    ]
    where = {"grad": report["worst_grad"], "param": report["worst_param"]}
    for measure, key in MEASURES.items():
        mark = "  <- over" if measure in failed else ""
        if measure not in report.get("compared", MEASURES):
            mark = f"  (not compared: {report['strategy']} clips each rank's own norm; none is global)"
        at = f" ({where[measure]})" if where.get(measure) else ""
        lines.append(f"  max {measure + ' diff':<15}{report[key]:.3e}{at}{mark}")
    lines.append(f"  {'tolerance':<19}{report['tolerance']:.0e}")
    print("\n".join(lines))
