"""Norm modules that honour Megatron-Core's norm contract (``build_module(spec, config=, hidden_size=, eps=)``).

``TorchNorm`` tags its parameters ``sequence_parallel``: under SP each TP rank holds a partial norm gradient, and
``finalize_model_grads`` sums exactly the tagged ones (missing it is silent drift). It runs torch's fused kernels,
which keep only the input and per-token statistics for backward. docs/design.md, "Norms".
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_siamese.reference.functional import NORMALIZATIONS, channel_scale


class TorchNorm(MegatronModule):
    """LayerNorm or RMSNorm over the last dimension, per ``config.normalization``, on torch's
    kernels, usable under sequence parallelism (Megatron's ``WrappedTorchNorm`` refuses it)."""

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
        return self.normalized(x, self.weight, self.bias)

    def normalized(self, x: Tensor, weight: Tensor, bias) -> Tensor:
        """``x`` normalized with these weights (``forward``'s own, or a view of them)."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{type(self).__name__} expects a last dimension of {self.hidden_size}, "
                f"got input of shape {tuple(x.shape)}"
            )
        inp = x
        if self.zero_centered_gamma:
            # gamma = 1 + w must be formed in fp32: in bf16, 1 + w rounds w away
            weight = weight.float() + 1
            bias = None if bias is None else bias.float()
            inp = x.float()
        if self.normalization == "LayerNorm":
            out = F.layer_norm(inp, (self.hidden_size,), weight, bias, self.eps)
        else:
            out = F.rms_norm(inp, (self.hidden_size,), weight, self.eps)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalization}({self.hidden_size}, eps={self.eps})"


class ChannelScale(MegatronModule):
    """The hybrid variant's learnable per-channel scale c1 on the X stream (ones at init); the sublayer sees
    ``c1 * x`` but the X stream continues from x (``residual_is_input``)."""

    residual_is_input = True

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config=config)
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def reset_parameters(self) -> None:
        """Ones again: what Megatron's meta-device initialization calls once the storage is real."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return channel_scale(x, self.weight)


class QKNormPerConfig:
    """A QK-norm slot that follows ``config.qk_layernorm`` (``norm``, else IdentityOp), for spec objects made
    before any config (Megatron-LM's ``--spec``). The layer resolves it before building attention (``resolved``):
    0.19's SelfAttention refuses a QK-norm module without ``qk_layernorm``; 0.16 builds it as a module."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *,
                norm: "ModuleSpec | type", **kwargs):
        if not config.qk_layernorm:
            return IdentityOp()
        return build_module(norm, config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    @staticmethod
    def spec(norm: "ModuleSpec | type") -> ModuleSpec:
        return ModuleSpec(module=QKNormPerConfig, params={"norm": norm})

    @staticmethod
    def is_slot(slot) -> bool:
        """Whether a spec's q/k_layernorm slot is one of these."""
        return getattr(slot, "module", slot) is QKNormPerConfig

    @staticmethod
    def resolved(submodules, config: TransformerConfig):
        """Layer ``submodules`` with these slots replaced by what ``config`` asks for."""
        attention = getattr(submodules, "self_attention", None)
        slots = getattr(attention, "submodules", None)
        if slots is None or not QKNormPerConfig.is_slot(getattr(slots, "q_layernorm", None)):
            return submodules

        def chosen(slot):
            return slot.params["norm"] if config.qk_layernorm else IdentityOp

        key = "kv_layernorm" if hasattr(slots, "kv_layernorm") else "k_layernorm"  # MLA's latent norms
        slots = dataclasses.replace(slots, q_layernorm=chosen(slots.q_layernorm), **{key: chosen(getattr(slots, key))})
        return dataclasses.replace(submodules, self_attention=dataclasses.replace(attention, submodules=slots))
