"""SiameseNorm's switch on top of Megatron's TransformerConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

FUSED_OPS_ENV = "MEGATRON_SIAMESE_FUSED_OPS"


@dataclass
class SiameseTransformerConfig(TransformerConfig):
    """TransformerConfig plus SiameseNorm options (a plain TransformerConfig works too)."""

    siamese_fused_ops: Optional[bool] = None
    """Use the fused dual-norm / dual-residual ops of the C++/CUDA extension: None picks them
    wherever the extension provides kernels for the tensors' device, True insists (and fails
    with the reason when it cannot), False always runs the PyTorch composition. Without this
    field (a plain TransformerConfig, e.g. from Megatron-LM) MEGATRON_SIAMESE_FUSED_OPS=1/0
    decides."""


def fused_ops_requested(config: TransformerConfig) -> Optional[bool]:
    """True / False when forced (config field, else environment), None for automatic."""
    requested = getattr(config, "siamese_fused_ops", None)
    if requested is not None:
        return bool(requested)
    value = os.environ.get(FUSED_OPS_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{FUSED_OPS_ENV} must be 1, 0 or auto, got {value!r}")
