"""The reference's one norm module (LayerNorm or RMSNorm per its config), used by every part."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from reference_model.config import ReferenceGPTConfig
from megatron_siamese.reference.functional import normalize


class ReferenceNorm(nn.Module):
    def __init__(self, config: ReferenceGPTConfig, hidden_size: Optional[int] = None):
        super().__init__()
        size = hidden_size or config.hidden_size
        self.config = config
        gamma_init = 0.0 if config.layernorm_zero_centered_gamma else 1.0
        self.weight = nn.Parameter(torch.full((size,), gamma_init))
        self.bias = nn.Parameter(torch.zeros(size)) if config.normalization == "LayerNorm" else None

    def forward(self, x: Tensor) -> Tensor:
        return normalize(
            x,
            self.weight,
            self.bias,
            normalization=self.config.normalization,
            eps=self.config.layernorm_epsilon,
            zero_centered_gamma=self.config.layernorm_zero_centered_gamma,
        )
