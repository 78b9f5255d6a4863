"""The single-stream baselines in plain PyTorch: Post-Norm, HybridNorm and Mix-LN (the oracle for
``megatron_siamese.single_stream``).

One residual stream; each block's norms sit where ``functional.norm_placement`` puts them for the
scheme and the block's global number (``functional.single_stream_sublayer``). The embedding,
attention (with HybridNorm's value norm: ``ReferenceGPTConfig.value_layernorm``), dense and MoE
MLPs, the output head and the loss are the SiameseNorm reference's (``tests/reference_model/gpt.py``), and
module names mirror Megatron's GPTModel built with the baselines' block spec
(``decoder.layers.N.input_layernorm``, ``post_attn_norm``, ``pre_mlp_layernorm``, ``post_mlp_norm``,
``self_attention.v_layernorm``, ``decoder.final_layernorm``; an absent norm has no parameters),
so a TP=1 Megatron state dict loads with ``load_megatron_state_dict``.
"""

from __future__ import annotations

from torch import Tensor, nn

from megatron_siamese.reference.functional import (
    MIX_LN_ALPHA,
    has_final_norm,
    norm_placement,
)
from reference_model.gpt import (
    ReferenceGPT,
    ReferenceGPTConfig,
    ReferenceNorm,
)
from reference_model.moe import moe_layers
from reference_model.single_stream_layer import ReferenceSingleStreamLayer


class ReferenceSingleStreamDecoder(nn.Module):
    def __init__(self, config: ReferenceGPTConfig, scheme: str, mix_ln_alpha: float, hybridnorm_star: bool):
        super().__init__()
        pattern = (moe_layers(config.num_layers, config.moe_layer_freq) if config.num_moe_experts
                   else [False] * config.num_layers)
        self.layers = nn.ModuleList(
            ReferenceSingleStreamLayer(
                config, norm_placement(scheme, i + 1, config.num_layers, mix_ln_alpha, hybridnorm_star), moe)
            for i, moe in enumerate(pattern))
        self.final_layernorm = ReferenceNorm(config) if has_final_norm(scheme) else None


class ReferenceSingleStreamGPT(ReferenceGPT):
    """Embedding, N single-stream blocks of ``scheme`` ("post", "hybridnorm" or "mixln"), the final
    norm where the scheme has one, and the output head. HybridNorm's attention normalizes queries,
    keys and values per head: its config needs ``qk_layernorm`` and ``value_layernorm``."""

    def __init__(self, config: ReferenceGPTConfig, scheme: str, mix_ln_alpha: float = MIX_LN_ALPHA,
                 hybridnorm_star: bool = False):
        if scheme == "hybridnorm" and not (config.qk_layernorm and config.value_layernorm):
            raise ValueError("HybridNorm normalizes queries, keys and values: set qk_layernorm and value_layernorm")
        self.scheme, self.mix_ln_alpha, self.hybridnorm_star = scheme, mix_ln_alpha, hybridnorm_star
        super().__init__(config)

    def _decoder(self, config: ReferenceGPTConfig) -> nn.Module:
        return ReferenceSingleStreamDecoder(config, self.scheme, self.mix_ln_alpha, self.hybridnorm_star)

    def _decode(self, hidden: Tensor, rope) -> Tensor:
        for layer in self.decoder.layers:
            hidden = layer(hidden, rope)
        final = self.decoder.final_layernorm
        return hidden if final is None else final(hidden)
