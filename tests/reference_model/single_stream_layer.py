"""One single-stream block of the reference baselines (Post-Norm, HybridNorm, Mix-LN): its norms
where ``functional.norm_placement`` puts them; also the block inside a reference MTP layer."""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from reference_model.attention import self_attention
from reference_model.config import ReferenceGPTConfig
from megatron_siamese.reference.functional import single_stream_sublayer
from reference_model.mlp import ReferenceMLP
from reference_model.moe import ReferenceMoE
from reference_model.norm import ReferenceNorm


class ReferenceSingleStreamLayer(nn.Module):
    def __init__(self, config: ReferenceGPTConfig, placement, moe: bool = False):
        super().__init__()
        self.config = config

        def norm(present: bool) -> Optional[ReferenceNorm]:
            return ReferenceNorm(config) if present else None

        self.input_layernorm = norm(placement.attention_input)
        self.self_attention = self_attention(config)  # standard or multi-latent
        self.post_attn_norm = norm(placement.after_attention)
        self.pre_mlp_layernorm = norm(placement.mlp_input)
        self.mlp = ReferenceMoE(config) if moe else ReferenceMLP(config)
        self.post_mlp_norm = norm(placement.after_mlp)

    def _dropout(self, t: Tensor) -> Tensor:
        return F.dropout(t, self.config.hidden_dropout, self.training)

    def forward(self, x: Tensor, rope) -> Tensor:
        """[b, s, h] -> [b, s, h]."""
        x = single_stream_sublayer(x, self.input_layernorm, lambda normed: self.self_attention(normed, rope),
                                   self.post_attn_norm, self._dropout)
        return single_stream_sublayer(x, self.pre_mlp_layernorm, self.mlp, self.post_mlp_norm, self._dropout)
