"""Comparing one layout's step against the single-rank reference step.

fp32: every element within ``atol * max(1, max|b|) + rtol * |b|`` (atol scaled up with the magnitudes
summed). bf16: a layout's other summation order alone moves reduction-heavy gradients by a few
percent, so each tensor is judged against the fp32 reference within ``noise_factor`` times the worst
error the bf16 single-rank run shows for that quantity (quantity-wide: a per-tensor floor is fragile).
The reported error is the worst normwise relative error ``max|a - b| / max|b|``.
docs/parallelism.md, "The correctness matrix".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_siamese.check.step import StepResult


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    noise_factor: Optional[float] = None  # judge against the same-dtype single-rank error

    def describe(self) -> str:
        if self.noise_factor is None:
            return (f"|a-b| <= {self.atol:g} * max(1, max|ref|) + {self.rtol:g} * |ref| per element, "
                    "ref = the single-rank run")
        return (f"max|a-b| / max|ref| <= {self.noise_factor:g} x the worst such error of the "
                f"same-dtype single-rank run (per quantity) + {self.atol:g} * max(1, max|ref|), "
                "ref = the fp32 single-rank run")


TOLERANCES = {
    "fp32": Tolerance(rtol=1e-5, atol=1e-6),
    "bf16": Tolerance(rtol=0.0, atol=1e-5, noise_factor=2.0),
    # FP8 GEMMs (Transformer Engine, GPUs): bf16's rule, the FP8 single-rank run as the noise
    "fp8": Tolerance(rtol=0.0, atol=1e-5, noise_factor=2.0),
}


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


def _relative_error(a, b) -> float:
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    scale = float(b.abs().max()) if b.numel() else 0.0
    difference = float((a - b).abs().max()) if b.numel() else 0.0
    return difference / scale if scale > 0 else difference


def _check(actual: Dict, expected: Dict, tolerance: Tolerance, noise: Optional[Dict] = None) -> QuantityCheck:
    check = QuantityCheck()
    noise_floor = (
        max((_relative_error(noise[k], expected[k]) for k in expected if k in noise), default=0.0)
        if noise is not None else 0.0
    )
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
        atol = tolerance.atol * max(1.0, scale)
        if noise is None:
            ok = torch.allclose(a, b, rtol=tolerance.rtol, atol=atol)
        else:
            ok = float((a - b).abs().max()) <= tolerance.noise_factor * noise_floor * scale + atol
        if not ok:
            check.failures.append(f"{name}: relative error {error:.2e}")
    return check


def compare(
    result: StepResult,
    reference: StepResult,
    tolerance: Tolerance,
    same_dtype_single: Optional[StepResult] = None,
) -> Comparison:
    """``result`` against ``reference``; with a noise-judged tolerance, ``same_dtype_single``
    is the single-rank run in the result's dtype and ``reference`` the fp32 one."""
    if (tolerance.noise_factor is None) != (same_dtype_single is None):
        raise ValueError("a noise-judged tolerance needs the same-dtype single-rank run, and only it")
    noise = same_dtype_single
    return Comparison(
        losses=_check(result.losses, reference.losses, tolerance, noise and noise.losses),
        grads=_check(result.grads, reference.grads, tolerance, noise and noise.grads),
        params=_check(result.params, reference.params, tolerance, noise and noise.params),
    )


