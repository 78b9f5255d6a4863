"""Multi-token prediction (DeepSeek-V3's MTP) in plain PyTorch: the oracle for Megatron's stock
``MultiTokenPredictionBlock`` after the decoder (``megatron/core/transformer/
multi_token_prediction.py``; the losses in ``GPTModel._postprocess``, megatron-core 0.16.1, or
``process_mtp_loss``, 0.19.2), on one rank.

With D = ``mtp_num_layers``, h_0 the decoder's output (SiameseNorm's merged, final-normed
streams), ids_0 / pos_0 / labels_0 / mask_0 the microbatch's tokens, positions, labels and loss
mask (all ones when GPTModel is called without one), for k = 1..D:

    ids_k = roll(ids_{k-1}),  pos_k = roll(pos_{k-1})     # roll: shift left by one, last position 0
    e_k = Embedding(ids_k, pos_k)                          # the model's (shared) embedding
    h_k = final_layernorm_k(Layer_k(eh_proj_k([enorm_k(e_k) | hnorm_k(h_{k-1})])))
    logits_k = h_k W_out^T                                 # the shared output head
    labels_k = roll(labels_{k-1}),  mask_k = roll(mask_{k-1})
    L_k = sum(mask_k * CE(logits_k, labels_k)) / max(sum(mask_k), 1)

``Layer_k`` is a stock Pre-Norm transformer layer (``input_layernorm``, ``self_attention``,
``pre_mlp_layernorm``, ``mlp``), standard or multi-latent attention and a dense or MoE MLP as
the decoder's last layer (Megatron builds it from that layer's spec); the standard attention's
RoPE is the decoder's (positions 0..s-1, not rolled), MLA builds its own. Megatron's backward
sees ``mtp_loss_scaling_factor / D * L_k`` per depth through ``MTPLossAutoScaler``, whose
gradient scale the schedule sets to the main loss's (1 / num_microbatches): the objective of
a microbatch adds ``mtp_loss_scaling_factor / D * sum_k L_k`` (``ReferenceGPT.objective``).

Parameter names mirror Megatron's: ``mtp.layers.K.enorm``, ``hnorm``, ``eh_proj``,
``final_layernorm`` and the layer under ``mtp.layers.K.transformer_layer.`` (megatron-core
0.16's name; 0.19 calls it ``mtp_model_layer``, which ``megatron_to_reference_names`` renames).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor, nn

from megatron_siamese.reference.functional import PRE_NORM
from reference_model.moe import moe_layers
from reference_model.norm import ReferenceNorm
from reference_model.single_stream_layer import ReferenceSingleStreamLayer


def roll_left(t: Tensor) -> Tensor:
    """Megatron's ``roll_tensor(t, shifts=-1, dims=-1)`` on one context-parallel rank: the last
    dimension shifted left by one, the position rolled in from the front zeroed."""
    rolled = torch.roll(t, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled


class ReferenceMTPLayer(nn.Module):
    def __init__(self, config, moe: bool):
        super().__init__()
        self.config = config
        self.enorm = ReferenceNorm(config)
        self.hnorm = ReferenceNorm(config)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.transformer_layer = ReferenceSingleStreamLayer(config, PRE_NORM, moe)
        self.final_layernorm = ReferenceNorm(config)

    def forward(self, hidden: Tensor, embedded: Tensor, rope) -> Tensor:
        """The previous depth's output and this depth's embedding [b, s, h] -> [b, s, h]."""
        combined = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.final_layernorm(self.transformer_layer(combined, rope))


class ReferenceMTPBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        # each layer as the decoder's last: an MoE layer where that one is
        last_is_moe = bool(config.num_moe_experts) and moe_layers(config.num_layers, config.moe_layer_freq)[-1]
        self.layers = nn.ModuleList(ReferenceMTPLayer(config, last_is_moe) for _ in range(config.mtp_num_layers))

    def forward(self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor, embed, rope) -> List[Tensor]:
        """The decoder's output [b, s, h] -> each depth's output [b, s, h]; ``embed(ids, positions)``
        is the model's embedding (with its dropout)."""
        outputs = []
        for layer in self.layers:
            input_ids, position_ids = roll_left(input_ids), roll_left(position_ids)
            hidden = layer(hidden, embed(input_ids, position_ids), rope)
            outputs.append(hidden)
        return outputs


def rolled_targets(labels: Tensor, loss_mask: Tensor, depth: int) -> Tuple[Tensor, Tensor]:
    """The labels and loss mask depth ``depth`` (1-based) is scored on: each rolled ``depth`` times."""
    for _ in range(depth):
        labels, loss_mask = roll_left(labels), roll_left(loss_mask)
    return labels, loss_mask
