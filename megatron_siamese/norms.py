"""Norm modules that honour Megatron-Core's norm contract.

Megatron builds every norm as ``build_module(spec, config=..., hidden_size=..., eps=...)``.
``Norm`` follows ``config.normalization`` (LayerNorm or RMSNorm) and
``config.layernorm_zero_centered_gamma``, accepts (and ignores) the fused-kernel knobs
``persist_layer_norm`` / ``memory_efficient_layer_norm`` instead of asserting on them, and
tags its parameters with ``sequence_parallel`` so that ``finalize_model_grads``
all-reduces their gradients over the tensor-parallel group under sequence parallelism
(each TP rank sees a different slice of the sequence, so each holds a partial gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_siamese.reference.functional import NORMALIZATIONS, normalize


class Norm(MegatronModule):
    """LayerNorm or RMSNorm over the last dimension, per ``config.normalization``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config=config)
        if config.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"SiameseNorm supports normalization in {NORMALIZATIONS}; "
                f"got config.normalization={config.normalization!r}. Set it to one of those."
            )
        self.normalization = config.normalization
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        # Created on the default device, like Megatron's FusedLayerNorm; the model is moved
        # to the GPU as a whole afterwards.
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{type(self).__name__} expects a last dimension of {self.hidden_size}, "
                f"got input of shape {tuple(x.shape)}"
            )
        return normalize(
            x,
            self.weight,
            self.bias,
            normalization=self.normalization,
            eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma,
        )

    def extra_repr(self) -> str:
        return f"{self.normalization}({self.hidden_size}, eps={self.eps})"
