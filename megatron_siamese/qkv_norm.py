"""HybridNorm's QKV-norm: Megatron's ``SelfAttention`` normalizing values per head too (docs/research.md).

Under TP a per-head norm's weight gradient is a partial sum on every rank. Megatron sums the QK-norm's
in ``finalize_model_grads`` by parameter name (``q_layernorm`` / ``k_layernorm``) but has no such rule
for a value norm, so ``ValueNorm`` sums its own in the backward (``copy_to_tensor_model_parallel_region``
on its weights) and is not tagged ``sequence_parallel`` (which would sum it once more under SP).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

from torch import Tensor

from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_siamese.norms import TorchNorm


class ValueNorm(TorchNorm):
    """A per-head norm whose weight gradients are complete on every tensor-parallel rank."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(config=config, hidden_size=hidden_size, eps=eps, **unused)
        for param in self.parameters():
            param.sequence_parallel = False  # summed in the backward already

    def forward(self, x: Tensor) -> Tensor:
        # a Parameter passed through an autograd Function comes back as a view; the Parameter stays a leaf
        bias = None if self.bias is None else copy_to_tensor_model_parallel_region(self.bias)
        return self.normalized(x, copy_to_tensor_model_parallel_region(self.weight), bias)


@dataclass
class QKVNormSelfAttentionSubmodules(SelfAttentionSubmodules):
    v_layernorm: Union[ModuleSpec, type] = IdentityOp


class QKVNormSelfAttention(SelfAttention):
    """Megatron's self-attention with queries, keys and values normalized per head."""

    def __init__(self, config: TransformerConfig, submodules: QKVNormSelfAttentionSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.v_layernorm = build_module(submodules.v_layernorm, config=self.config,
                                        hidden_size=self.hidden_size_per_attention_head, eps=self.config.layernorm_epsilon)

    def get_query_key_value_tensors(self, *args, **kwargs):
        tensors = super().get_query_key_value_tensors(*args, **kwargs)
        if len(tensors) == 2:  # (mixed_qkv, split sizes): never with QK-norm, which this attention has
            raise NotImplementedError("QKV-norm needs the query, key and value split (split_qkv=True)")
        query, key, value, *gate = tensors  # (query, key, value[, gate])
        return (query, key, self.v_layernorm(value), *gate)


def with_value_norm(attention: ModuleSpec) -> ModuleSpec:
    """A self-attention spec (with QK-norm) as ``QKVNormSelfAttention`` with a ``ValueNorm``."""
    submodules = QKVNormSelfAttentionSubmodules(**vars(attention.submodules), v_layernorm=ValueNorm)
    return dataclasses.replace(attention, module=QKVNormSelfAttention, submodules=submodules)
