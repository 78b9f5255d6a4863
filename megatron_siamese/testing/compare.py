"""Comparing one layout's step against the single-rank reference step.

Each quantity (per-microbatch losses, every gradient, every parameter after the step)
passes when every element satisfies ``|a - b| <= atol * max(1, max|b|) + rtol * |b|``
(``torch.testing.assert_close`` with the absolute tolerance scaled up for tensors whose
values exceed 1, since rounding error grows with the magnitudes summed). The reported
error is the worst normwise relative error ``max|a - b| / max|b|`` over the quantity's
tensors, which reads the same whatever the tensor's scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from megatron_siamese.testing.gpt_run import StepResult


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# fp32: what reordering sums across ranks costs. bf16: Transformer Engine's own
# distributed numerics tests (tests/pytorch/distributed) allow rtol 1.6e-2, atol 1e-5.
TOLERANCES = {"fp32": Tolerance(rtol=1e-5, atol=1e-6), "bf16": Tolerance(rtol=1.6e-2, atol=1e-5)}


@dataclass
class QuantityCheck:
    worst_error: float = 0.0
    worst_name: str = ""
    failures: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class Comparison:
    losses: QuantityCheck
    grads: QuantityCheck
    params: QuantityCheck

    @property
    def passed(self) -> bool:
        return self.losses.passed and self.grads.passed and self.params.passed


def _check(actual: Dict, expected: Dict, tolerance: Tolerance) -> QuantityCheck:
    check = QuantityCheck()
    missing = sorted(set(expected) ^ set(actual))
    if missing:
        check.failures.append(f"present on one side only: {missing[:5]}")
    for name in sorted(set(expected) & set(actual), key=str):
        a, b = torch.as_tensor(actual[name]).float(), torch.as_tensor(expected[name]).float()
        if a.shape != b.shape:
            check.failures.append(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            continue
        scale = float(b.abs().max()) if b.numel() else 0.0
        error = float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max())
        if error > check.worst_error or not check.worst_name:
            check.worst_error, check.worst_name = error, str(name)
        if not torch.allclose(a, b, rtol=tolerance.rtol, atol=tolerance.atol * max(1.0, scale)):
            check.failures.append(f"{name}: relative error {error:.2e}")
    return check


def compare(result: StepResult, reference: StepResult, tolerance: Tolerance) -> Comparison:
    return Comparison(
        losses=_check(result.losses, reference.losses, tolerance),
        grads=_check(result.grads, reference.grads, tolerance),
        params=_check(result.params, reference.params, tolerance),
    )


def replica_disagreements(result: StepResult, prefix: str = "grad:") -> List[Tuple[str, float]]:
    """Replicated tensors whose copies on different ranks are not bitwise equal."""
    return [(k, v) for k, v in sorted(result.replica_spread.items()) if k.startswith(prefix) and v != 0.0]
