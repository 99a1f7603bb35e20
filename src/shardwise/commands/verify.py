"""``shardwise verify``: a strategy on N ranks against plain PyTorch in one process.

Both sides start from the same seed, draw the same global batches and run in float64 by default.
The reference is written without any shardwise engine: ``model(x)``, the summed token loss divided by
the global token count, ``backward``, ``optimizer.step``. Reported: the largest difference of the
per-step losses, of the first step's gradients and of the final parameters; the exit code is 1 when
any exceeds the tolerance.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.config import TrainConfig
from shardwise.launch import LaunchError, init_distributed, launch_local
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


def verify_defaults(kind: str) -> dict[str, str]:
    """The defaults for ``model.kind``: only the built-in GPT has ``wpe`` to freeze and the deep preset
    (the MLP keeps its own odd one)."""
    if kind == "gpt":
        return VERIFY_DEFAULTS
    others = {k: v for k, v in VERIFY_DEFAULTS.items() if k != "model.freeze"}
    return {**others, "model.preset": "odd"}


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
    return {
        "losses": [r.loss for r in records],
        "grad_norms": [r.grad_norm for r in records],
        "lrs": [r.lr for r in records],
        "grads": grads,
        "params": params,
        "buffers": {n: b.detach().clone() for n, b in trainer.engine.model.named_buffers()},
    }


def verify_worker(config: TrainConfig) -> dict[str, Any] | None:
    """What every rank runs under the launcher."""
    import torch.distributed as dist

    init_distributed(config.timeout_s)
    try:
        return collect_run(config)
    finally:
        dist.destroy_process_group()


def reference_run(config: TrainConfig) -> dict[str, Any]:
    """Plain single-process PyTorch on the whole global batch: the answer every strategy must give."""
    from shardwise.checkpoint.pretrained import load_pretrained
    from shardwise.data.corpus import load_corpus
    from shardwise.data.sampler import DataSampler
    from shardwise.engine.base import predicted_tokens
    from shardwise.engine.loss import logits_of, loss_sum
    from shardwise.engine.optim import build_optimizer, named
    from shardwise.engine.schedule import lr_multiplier
    from shardwise.models import build_model
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


def compare_runs(reference: dict[str, Any], candidate: dict[str, Any], tolerance: float) -> dict[str, Any]:
    losses = [abs(a - b) for a, b in zip(reference["losses"], candidate["losses"], strict=True)]
    norms = [abs(a - b) for a, b in zip(reference["grad_norms"], candidate["grad_norms"], strict=True)]
    lrs = [abs(a - b) for a, b in zip(reference["lrs"], candidate["lrs"], strict=True)]
    grad = compare_tensors(reference["grads"], candidate["grads"])
    param = compare_tensors(reference["params"], candidate["params"])
    buffer = compare_tensors(reference.get("buffers", {}), candidate.get("buffers", {}))
    max_loss = max(losses)
    worst = max(max_loss, max(norms), max(lrs), grad.max_diff, param.max_diff, buffer.max_diff)
    return {
        "max_loss_diff": max_loss,
        "max_grad_norm_diff": max(norms),
        "max_lr_diff": max(lrs),
        "max_grad_diff": grad.max_diff,
        "worst_grad": grad.where,
        "max_param_diff": param.max_diff,
        "worst_param": param.where,
        "max_buffer_diff": buffer.max_diff,  # BatchNorm running statistics, say
        "tolerance": tolerance,
        "ok": worst <= tolerance,  # NaN anywhere is not ok
        "losses": candidate["losses"],
        "reference_losses": reference["losses"],
        "grad_norm": candidate["grad_norms"],
        "reference_grad_norm": reference["grad_norms"],
        "lr": candidate["lrs"],
    }


def run_verify(config: TrainConfig, nproc: int) -> dict[str, Any]:
    config = preflight(config, nproc, writes_run_files=False)  # verify writes no run folder
    results = launch_local(verify_worker, (config,), nproc)
    candidate = next(r for r in results.values() if r is not None)
    report = compare_runs(reference_run(config), candidate, TOLERANCE)
    return {
        "strategy": config.strategy,
        "nproc": nproc,
        "steps": config.steps,
        "dtype": config.dtype,
        **report,
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
    verdict = "OK" if report["ok"] else "FAILED"
    print(
        f"{verdict}: {report['strategy']} on {report['nproc']} ranks vs one process, "
        f"{report['steps']} steps in {report['dtype']}\n  max loss diff  {report['max_loss_diff']:.3e}\n"
        f"  max grad diff  {report['max_grad_diff']:.3e} ({report['worst_grad']})\n"
        f"  max param diff {report['max_param_diff']:.3e} ({report['worst_param']})\n"
        f"  tolerance      {report['tolerance']:.0e}"
    )
