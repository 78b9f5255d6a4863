"""A small, complete SiameseNorm GPT in plain PyTorch: the oracle for the Megatron model.

No Megatron import. Dense or mixture-of-experts MLPs (tests/reference_model/moe.py, per ``moe_layer_freq``),
QK-norm in either variant, standard or multi-latent attention (tests/reference_model/mla.py:
``multi_latent_attention``), and multi-token prediction after the decoder (tests/reference_model/mtp.py:
``mtp_num_layers``). Module names mirror Megatron-Core's GPTModel built with
``get_siamese_block_spec`` (``embedding.word_embeddings``, ``decoder.layers.N.
self_attention.linear_qkv``, ``decoder.final_layernorm.merge.x_norm``, ...) so a TP=1
Megatron state dict loads with ``load_megatron_state_dict``. Attention follows Megatron's
layouts: ``linear_qkv`` rows are grouped per query group as [q heads, k, v], GQA repeats
each key/value head over its group, RoPE is Megatron's non-interleaved form, and gated
MLPs split ``linear_fc1`` into [gate, up] halves.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_siamese.reference.functional import (
    channel_scale,
    depth_scale,
    dual_norm,
    dual_residual,
    hybrid_dual_norm,
    merge_streams,
)
from reference_model.mlp import ReferenceMLP
from reference_model.rope import rotary_cos_sin
from reference_model.moe import ReferenceMoE, moe_layers
from reference_model.attention import self_attention
from reference_model.config import ReferenceGPTConfig
from reference_model.norm import ReferenceNorm
from megatron_siamese.streams import split_streams


class ReferenceMerge(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.x_norm = ReferenceNorm(config)
        self.y_norm = ReferenceNorm(config)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return merge_streams(self.x_norm(x), self.y_norm(y))


class ReferenceFinalNorm(ReferenceNorm):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__(config)
        self.merge = ReferenceMerge(config)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(self.merge(x, y))


class ReferenceChannelScale(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return channel_scale(x, self.weight)


class ReferenceSiameseLayer(nn.Module):
    def __init__(self, config: ReferenceGPTConfig, layer_number: int, moe: bool = False):
        super().__init__()
        self.config = config
        self.depth_scale = depth_scale(layer_number, config.depth_scaled)
        hybrid = config.variant == "hybrid"
        self.attn_x_norm = ReferenceChannelScale(config) if hybrid else ReferenceNorm(config)
        self.attn_y_norm = ReferenceNorm(config)
        self.input_layernorm = None if hybrid or not config.input_norm else ReferenceNorm(config)
        self.self_attention = self_attention(config)
        self.mlp_x_norm = ReferenceNorm(config)
        self.mlp_y_norm = ReferenceNorm(config)
        self.pre_mlp_layernorm = ReferenceNorm(config) if config.input_norm else None
        self.mlp = ReferenceMoE(config) if moe else ReferenceMLP(config)

    def _norms(self, streams: Tensor, x_norm, y_norm, input_norm):
        cfg = self.config
        common = (cfg.layernorm_epsilon, cfg.normalization == "RMSNorm", cfg.layernorm_zero_centered_gamma)
        if isinstance(x_norm, ReferenceChannelScale):
            return hybrid_dual_norm(streams, cfg.hidden_size, x_norm.weight, y_norm.weight, y_norm.bias, *common)
        in_weight, in_bias = (None, None) if input_norm is None else (input_norm.weight, input_norm.bias)
        return dual_norm(streams, cfg.hidden_size, x_norm.weight, x_norm.bias, y_norm.weight, y_norm.bias,
                         in_weight, in_bias, *common)

    def _sublayer(self, streams: Tensor, x_norm, y_norm, input_norm, sublayer, *args) -> Tensor:
        base, normed = self._norms(streams, x_norm, y_norm, input_norm)
        out, bias = sublayer(normed, *args)
        p = self.config.hidden_dropout
        mask = (torch.empty_like(out, dtype=torch.bool).bernoulli_(1.0 - p)
                if self.training and p > 0.0 else None)
        return dual_residual(base, out, bias, mask, 1.0 / (1.0 - p), 1.0 / self.depth_scale)

    def forward(self, streams: Tensor, rope) -> Tensor:
        """Packed streams [b, s, 2h] (the embedding [b, s, h] at the first layer) -> [b, s, 2h]."""
        streams = self._sublayer(streams, self.attn_x_norm, self.attn_y_norm, self.input_layernorm,
                                 self.self_attention, rope)
        return self._sublayer(streams, self.mlp_x_norm, self.mlp_y_norm, self.pre_mlp_layernorm, self.mlp)


class ReferenceEmbedding(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.max_sequence_length, config.hidden_size)
            if config.position_embedding_type == "learned_absolute"
            else None
        )

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        return embeddings


class ReferenceDecoder(nn.Module):
    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        pattern = (moe_layers(config.num_layers, config.moe_layer_freq) if config.num_moe_experts
                   else [False] * config.num_layers)
        self.layers = nn.ModuleList(
            ReferenceSiameseLayer(config, layer_number=i + 1, moe=moe) for i, moe in enumerate(pattern)
        )
        self.final_layernorm = ReferenceFinalNorm(config)


class ReferenceGPT(nn.Module):
    """Embedding, N SiameseNorm blocks, the merging final norm and the output head; with
    ``mtp_num_layers``, Megatron's multi-token prediction layers after the final norm
    (tests/reference_model/mtp.py), sharing the embedding and the output head."""

    def __init__(self, config: ReferenceGPTConfig):
        super().__init__()
        self.config = config
        self.embedding = ReferenceEmbedding(config)
        self.decoder = self._decoder(config)
        self.output_layer = (
            None
            if config.share_embeddings_and_output_weights
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        if config.mtp_num_layers:
            from reference_model.mtp import ReferenceMTPBlock  # it builds on this module

            self.mtp = ReferenceMTPBlock(config)
        else:
            self.mtp = None

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """input_ids [b, s] -> logits [b, s, vocab] (the main head's)."""
        hidden, _, _ = self._hidden(input_ids, position_ids)
        return self._logits(hidden)

    def _hidden(self, input_ids: Tensor, position_ids: Optional[Tensor]):
        """(the final norm's output [b, s, h], the RoPE the layers got, the position ids)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids
            )
        hidden = self._embed(input_ids, position_ids)
        # multi-latent attention builds its own RoPE (GPTModel builds none for it)
        rope = (
            rotary_cos_sin(self.config, position_ids)
            if self.config.position_embedding_type == "rope" and not self.config.multi_latent_attention
            else None
        )
        return self._decode(hidden, rope), rope, position_ids

    def _embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.embedding(input_ids, position_ids)
        return F.dropout(hidden, self.config.hidden_dropout, self.training)

    def _logits(self, hidden: Tensor) -> Tensor:
        head = (
            self.embedding.word_embeddings.weight
            if self.output_layer is None
            else self.output_layer.weight
        )
        return hidden @ head.t()

    def _decoder(self, config: ReferenceGPTConfig) -> nn.Module:
        return ReferenceDecoder(config)

    def _decode(self, hidden: Tensor, rope) -> Tensor:
        """The embedding's output [b, s, h] -> the final norm's [b, s, h]."""
        streams = hidden  # x = y = the embedding
        for layer in self.decoder.layers:
            streams = layer(streams, rope)
        return self.decoder.final_layernorm(*split_streams(streams, self.config.hidden_size))

    @staticmethod
    def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(  # in fp32 (Megatron's), fp64 for a double model
            logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1), labels.flatten(),
            reduction="none",
        ).view_as(labels)

    def loss(self, input_ids: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None):
        """Per-token cross-entropy [b, s], like GPTModel called with labels."""
        return self._cross_entropy(self.forward(input_ids, position_ids), labels)

    def losses(self, input_ids: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None,
               loss_mask: Optional[Tensor] = None):
        """(the main head's per-token cross-entropy [b, s], [L_1, ..., L_D]) in one forward:
        L_k the masked mean cross-entropy of MTP depth k against the labels rolled k times, the
        loss mask (ones when None, as GPTModel called without one) rolled alike (tests/reference_model/mtp.py;
        [] without MTP)."""
        hidden, rope, position_ids = self._hidden(input_ids, position_ids)
        main = self._cross_entropy(self._logits(hidden), labels)
        if self.mtp is None:
            return main, []
        from reference_model.mtp import rolled_targets

        mask = torch.ones_like(labels) if loss_mask is None else loss_mask
        depth_losses = []
        for depth, out in enumerate(self.mtp(hidden, input_ids, position_ids, self._embed, rope), start=1):
            depth_labels, depth_mask = rolled_targets(labels, mask, depth)
            per_token = self._cross_entropy(self._logits(out), depth_labels)
            # no token left to score (a sequence no longer than the depth): 0, as megatron-core 0.19
            depth_losses.append((depth_mask * per_token).sum() / depth_mask.sum().clamp(min=1))
        return main, depth_losses

    def router_loss(self) -> Tensor:
        """The MoE layers' aux and z losses of the last training forward (0 without any), the MTP
        layers' included."""
        layers = list(self.decoder.layers)
        if self.mtp is not None:
            layers += [layer.transformer_layer for layer in self.mtp.layers]
        losses = [layer.mlp.router_loss for layer in layers
                  if isinstance(layer.mlp, ReferenceMoE) and layer.mlp.router_loss is not None]
        return sum(losses) if losses else torch.zeros(())

    def objective(self, input_ids: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None,
                  loss_mask: Optional[Tensor] = None) -> Tensor:
        """What Megatron's backward differentiates for one microbatch: the mean cross-entropy
        (masked mean with ``loss_mask``), the router losses, to which MoEAuxLossAutoScaler gives
        the main loss's gradient scale, and ``mtp_loss_scaling_factor / D`` times each MTP
        depth's loss, which MTPLossAutoScaler scales alike (Megatron's schedules scale all by
        1 / num_microbatches: a step's objective is the mean of this over its microbatches)."""
        main, depth_losses = self.losses(input_ids, labels, position_ids, loss_mask)
        main = main.mean() if loss_mask is None else (main * loss_mask).sum() / loss_mask.sum()
        objective = main + self.router_loss()
        if depth_losses:
            objective = objective + self.config.mtp_loss_scaling_factor / len(depth_losses) * sum(depth_losses)
        return objective

    def load_megatron_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a TP=1 Megatron GPTModel state dict (either SiameseNorm spec)."""
        self.load_state_dict(megatron_to_reference_names(state_dict, self.config.num_layers))


def megatron_to_reference_names(state_dict: Mapping[str, Tensor], num_layers: int) -> Dict[str, Tensor]:
    """Rename a Megatron SiameseNorm GPT state dict to the reference's parameter names.

    Megatron returns biases of ``linear_proj`` / ``linear_fc2`` separately (they go through
    bias-dropout), the reference keeps them as ``proj_bias`` / ``fc2_bias`` (an expert's too,
    though its MLP adds it itself, scaled by the token's routing probability); a layer-spec
    model (Megatron-LM ``--spec``) keeps the merge norms in its last layer's
    ``output_merge`` and its FinalNorm as ``decoder.final_layernorm``; an MTP layer's transformer
    layer is ``mtp.layers.K.transformer_layer`` (megatron-core 0.16) or ``mtp_model_layer``
    (0.19), the reference's ``transformer_layer``.
    """
    last = f"decoder.layers.{num_layers - 1}.output_merge."
    renamed = {}
    for name, tensor in state_dict.items():
        if name.endswith("_extra_state"):
            continue
        name = name.replace("self_attention.linear_proj.bias", "self_attention.proj_bias")
        name = name.replace("linear_fc2.bias", "fc2_bias")
        if name.startswith("mtp.layers."):
            name = name.replace(".mtp_model_layer.", ".transformer_layer.", 1)
        if name.startswith(last):
            name = "decoder.final_layernorm.merge." + name[len(last):]
        renamed[name] = tensor
    return renamed
