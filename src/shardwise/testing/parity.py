"""Compare a distributed run with single-process training: losses, gradients, parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParityReport:
    """The largest absolute difference found, and where."""

    max_diff: float
    where: str


def compare_tensors(
    reference: Mapping[str, torch.Tensor], candidate: Mapping[str, torch.Tensor]
) -> ParityReport:
    """Largest element-wise difference between two name -> tensor maps with the same keys and shapes."""
    if set(reference) != set(candidate):
        missing = sorted(set(reference) ^ set(candidate))
        raise AssertionError(f"the two sides name different tensors: {missing}")
    worst = ParityReport(0.0, "")
    for name, ref in reference.items():
        got = candidate[name]
        if ref.shape != got.shape:
            raise AssertionError(f"{name}: shape {tuple(got.shape)} differs from {tuple(ref.shape)}")
        if ref.numel() == 0:
            continue
        diff = (ref.detach().double().cpu() - got.detach().double().cpu()).abs().max().item()
        if diff != diff:  # NaN
            return ParityReport(float("inf"), f"{name} (NaN)")
        if diff > worst.max_diff or not worst.where:
            worst = ParityReport(diff, name)
    return worst


def assert_parity(
    reference: Mapping[str, torch.Tensor] | Sequence[float],
    candidate: Mapping[str, torch.Tensor] | Sequence[float],
    atol: float,
    what: str = "parameters",
) -> ParityReport:
    """Raise ``AssertionError`` naming the worst tensor when the two sides differ by more than ``atol``.

    Either two name -> tensor maps (parameters, gradients) or two sequences (per-step losses).
    """
    if isinstance(reference, Mapping) and isinstance(candidate, Mapping):
        report = compare_tensors(reference, candidate)
    else:
        ref, got = list(reference), list(candidate)
        if len(ref) != len(got):
            raise AssertionError(f"{what}: {len(got)} values against {len(ref)} in the reference")
        diffs = [abs(float(a) - float(b)) for a, b in zip(ref, got, strict=True)]  # type: ignore[arg-type]
        worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else 0
        report = ParityReport(max(diffs, default=0.0), f"step {worst}")
    if not report.max_diff <= atol:
        raise AssertionError(
            f"{what} differ by {report.max_diff:.3e} at {report.where} (tolerance {atol:.1e})"
        )
    return report
