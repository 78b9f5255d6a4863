"""What SiameseNorm does not support yet, refused at construction with what to change."""

from __future__ import annotations

from typing import List

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig


class UnsupportedConfigError(ValueError):
    """A configuration SiameseNorm cannot honour; the message says what to change."""


def _problems(config: TransformerConfig) -> List[str]:
    problems = []
    if config.mtp_num_layers:
        problems.append(
            "multi-token prediction (mtp_num_layers / --mtp-num-layers) is not supported: "
            "its MTP layers expect a single [s, b, h] stream. Set mtp_num_layers=None."
        )
    if getattr(config, "enable_mhc_connections", False):
        problems.append(
            "Megatron's hyper-connections (enable_mhc_connections / --enable-mhc-connections) "
            "replace the residual stream that SiameseNorm splits in two. Disable them."
        )
    if config.inference_fuse_tp_communication:
        problems.append(
            "inference_fuse_tp_communication fuses the residual add and the next layer's norm "
            "into the TP reduce-scatter, which has no SiameseNorm form. Set it to False."
        )
    if config.num_moe_experts:
        problems.append(
            "mixture-of-experts layers (num_moe_experts) are not supported yet. "
            "Use a dense MLP (num_moe_experts=None)."
        )
    if config.heterogeneous_block_specs:
        problems.append(
            "heterogeneous_block_specs is not supported: every SiameseNorm layer must have the "
            "same structure. Set it to False."
        )
    if config.fine_grained_activation_offloading:
        problems.append(
            "fine_grained_activation_offloading offloads the single-stream norm inputs. "
            "Set it to False."
        )
    if config.multi_latent_attention or config.experimental_attention_variant is not None:
        problems.append(
            "only standard self-attention is supported: set multi_latent_attention=False and "
            "experimental_attention_variant=None."
        )
    if config.fp32_residual_connection:
        problems.append(
            "fp32_residual_connection keeps Megatron's single residual stream in fp32; SiameseNorm's "
            "two streams stay in the activation dtype. Set it to False."
        )
    if getattr(config, "mlp_chunks_for_training", 1) > 1 or getattr(config, "mlp_chunks_for_prefill", 1) > 1:
        problems.append(
            "mlp_chunks_for_training / mlp_chunks_for_prefill (chunked MLP) are not implemented by "
            "SiameseNorm layers yet. Set them to 1."
        )
    if config.apply_residual_connection_post_layernorm:
        problems.append(
            "apply_residual_connection_post_layernorm conflicts with SiameseNorm's own residual "
            "streams. Set it to False."
        )
    return problems


def _spec_problems(config: TransformerConfig, submodules) -> List[str]:
    problems = []
    if getattr(submodules, "cross_attention", IdentityOp) is not IdentityOp:
        problems.append("cross-attention is not supported: SiameseNorm layers are decoder-only.")
    attention = getattr(getattr(submodules, "self_attention", None), "submodules", None)
    # Megatron's specs name an absent QK-norm IdentityOp, some (the hybrid stack's) None
    has_qk_norm = attention is not None and getattr(attention, "q_layernorm", None) not in (None, IdentityOp)
    if config.qk_layernorm and not has_qk_norm:
        problems.append(
            "qk_layernorm is set but this SiameseNorm spec has no QK-norm (only the hybrid "
            "variant does). Set qk_layernorm=False, or use the hybrid variant."
        )
    if has_qk_norm and not config.qk_layernorm:
        problems.append(
            "the hybrid variant normalizes queries and keys, and Megatron sums their norm "
            "gradients over TP only with qk_layernorm: set qk_layernorm=True (--qk-layernorm)."
        )
    return problems


def check_supported(config: TransformerConfig, submodules=None) -> None:
    """Raise UnsupportedConfigError listing every unsupported setting in ``config``."""
    problems = _problems(config)
    if submodules is not None:
        problems += _spec_problems(config, submodules)
    if problems:
        raise UnsupportedConfigError(
            "SiameseNorm cannot build this layer:\n- " + "\n- ".join(problems)
        )
