"""Norm modules that honour Megatron-Core's norm contract.

Megatron builds every norm as ``build_module(spec, config=..., hidden_size=..., eps=...)``.
``TorchNorm`` follows ``config.normalization`` (LayerNorm or RMSNorm) and
``config.layernorm_zero_centered_gamma``, accepts (and ignores) the fused-kernel knobs
``persist_layer_norm`` / ``memory_efficient_layer_norm`` instead of asserting on them, and
tags its parameters with ``sequence_parallel`` so that ``finalize_model_grads``
all-reduces their gradients over the tensor-parallel group under sequence parallelism
(each TP rank sees a different slice of the sequence, so each holds a partial gradient).

The forward runs PyTorch's fused ``layer_norm`` / ``rms_norm`` kernels, which compute in
fp32 for 16-bit inputs and keep only the input and per-token statistics for backward (the
plain composition in ``reference.functional.normalize`` is the oracle they are tested
against, and would keep several [T, h] intermediates).
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
    """The hybrid variant's learnable per-channel scale c1 on the X stream (ones at init).

    Used in a stream-norm slot, it marks that the residual keeps the unscaled input
    (``residual_is_input``): the sublayer sees ``c1 * x`` but the X stream continues from x.
    """

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
    """A ``q_layernorm`` / ``k_layernorm`` slot (multi-latent attention's ``q_layernorm`` /
    ``kv_layernorm``) that follows ``config.qk_layernorm``: ``norm`` with
    QK-norm (so its parameters keep Megatron's names, ``q_layernorm.weight``), else Megatron's
    ``IdentityOp`` (no parameters, as in Megatron's specs without QK-norm).

    For layer spec objects made before any config exists (Megatron-LM's ``--spec`` imports a
    module-level ``ModuleSpec``); Megatron's spec functions decide this from their
    ``qk_layernorm`` argument instead. The SiameseNorm layer resolves the slots from its config
    before it builds attention (``resolved``): megatron-core 0.19's SelfAttention refuses any
    QK-norm module in a spec without ``qk_layernorm`` and calls the class it is given directly.
    Built as a module anyway (0.16's ``build_module``), it returns the chosen one.
    """

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
