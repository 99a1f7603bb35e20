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
    "model.preset": "odd",  # parameter sizes that divide no world size
    "model.freeze": "wpe",  # a frozen parameter must stay equal and untouched (the built-in GPT's)
    "data.global_batch": "12",
    "eval_every": "0",
    "run_dir": "runs/verify",
}


def verify_defaults(kind: str) -> dict[str, str]:
    """The defaults for ``model.kind``: only the built-in GPT has ``wpe`` to freeze."""
    if kind == "gpt":
        return VERIFY_DEFAULTS
    return {k: v for k, v in VERIFY_DEFAULTS.items() if k != "model.freeze"}


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
        losses = [trainer.step(step, after_backward=keep_first).loss for step in range(config.steps)]
        params = trainer.engine.full_parameters()
    finally:
        trainer.engine.close()
    if not trainer.engine.role.reports:
        return None
    return {"losses": losses, "grads": grads, "params": params}


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
    from shardwise.data.corpus import load_corpus
    from shardwise.data.sampler import DataSampler
    from shardwise.engine.base import predicted_tokens
    from shardwise.engine.loss import logits_of, loss_sum
    from shardwise.engine.optim import build_optimizer, named
    from shardwise.models import build_model
    from shardwise.train.loop import seed_everything, torch_dtype

    seed_everything(config.seed)
    model = build_model(config.model, torch_dtype(config.dtype))
    optimizer = build_optimizer(named(model), config.optim)
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
    losses, grads = [], {}
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
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def compare_runs(reference: dict[str, Any], candidate: dict[str, Any], tolerance: float) -> dict[str, Any]:
    losses = [abs(a - b) for a, b in zip(reference["losses"], candidate["losses"], strict=True)]
    grad = compare_tensors(reference["grads"], candidate["grads"])
    param = compare_tensors(reference["params"], candidate["params"])
    max_loss = max(losses)
    return {
        "max_loss_diff": max_loss,
        "max_grad_diff": grad.max_diff,
        "worst_grad": grad.where,
        "max_param_diff": param.max_diff,
        "worst_param": param.where,
        "tolerance": tolerance,
        "ok": max(max_loss, grad.max_diff, param.max_diff) <= tolerance,
        "losses": candidate["losses"],
        "reference_losses": reference["losses"],
    }


def run_verify(config: TrainConfig, nproc: int) -> dict[str, Any]:
    config = preflight(config, nproc)
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
