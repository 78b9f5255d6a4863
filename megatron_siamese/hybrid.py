"""SiameseNorm in Megatron-Core's HybridModel (megatron-core >= 0.19): one pattern symbol, one sublayer.

Every ``*``, ``-``, ``E``, ``M`` and ``G`` layer is one SiameseNorm sublayer and the stack's final norm merges
the streams. The depth scale counts sublayers in pairs, so ``*-*-...`` computes exactly the SiameseNorm GPTModel
and loads its checkpoints. Two stack specs: local modules (``*``, ``-``, ``E``; CPU too) and Transformer Engine
(``M`` and ``G`` too; GPUs only). ``D``, ``+`` and MTP are refused.
Megatron-LM: ``pretrain_hybrid.py --spec megatron_siamese.hybrid siamese_hybrid_stack_spec``.
Full story: docs/design.md, "Two model classes: GPTModel and HybridModel".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from torch import Tensor

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

try:
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
except ImportError as error:  # megatron-core < 0.18 has no HybridModel
    from megatron_siamese.versions import installed_megatron_core

    raise ImportError(
        "SiameseNorm's HybridModel support needs megatron-core >= 0.19 (installed: "
        f"{installed_megatron_core()}); GPTModel works on every supported release."
    ) from error

import megatron_siamese.te as te
from megatron_siamese import device
from megatron_siamese.merge import SiameseFinalNorm
from megatron_siamese.norms import TorchNorm
from megatron_siamese.siamese_sublayer import SiameseSublayerMixin
from megatron_siamese.specs import local_stock_layer, siamese_layer_from
from megatron_siamese.support import UnsupportedConfigError, check_supported


class RefusedLayer(MegatronModule):
    """Stands in a stack slot SiameseNorm cannot fill: building it says why and what to change."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any):
        raise UnsupportedConfigError(f"SiameseNorm cannot build this hybrid layer: {reason}")


def _refused(reason: str) -> ModuleSpec:
    return ModuleSpec(module=RefusedLayer, params={"reason": reason})


_DSA = _refused("DeepSeek sparse attention ('D') is not supported; use '*' attention layers.")
_MLA = _refused("multi-latent attention ('+') is not supported; use '*' attention layers.")


def _gpu_kernels_missing(symbol: str) -> Optional[str]:
    """Why the GPU kernels of a Mamba ('M') or GDN ('G') layer cannot run here, or None."""
    if symbol == Symbols.MAMBA:
        from megatron.core.ssm import mamba_mixer

        package = None if mamba_mixer.HAVE_MAMBA_SSM else "mamba_ssm and causal_conv1d (pip install mamba-ssm causal-conv1d)"
    else:
        from megatron.core.ssm import gated_delta_net

        package = None if gated_delta_net.HAVE_FLA else "FLA (pip install flash-linear-attention)"
    kind = "Mamba ('M')" if symbol == Symbols.MAMBA else "gated delta net ('G')"
    if package:
        return f"{kind} layers need the GPU kernels of {package}, which are not installed"
    if not device.uses_cuda():
        return f"{kind} layers run on GPU kernels and this machine has no CUDA device"
    return None


# -- the stack ---------------------------------------------------------------------------


class SiameseHybridStack(HybridStack):
    """Megatron's HybridStack with ``SiameseFinalNorm`` in place of its hard-coded TE final norm."""

    def __init__(self, config: TransformerConfig, submodules: HybridStackSubmodules,
                 layer_type_list: Optional[List[str]] = None, post_layer_norm: bool = True,
                 post_process: bool = True, **kwargs: Any):
        if config.mtp_num_layers:  # HybridModel builds its MTP block from this spec, which has none
            raise UnsupportedConfigError(
                "SiameseNorm cannot build this hybrid stack: multi-token prediction is built for GPTModel "
                "(stock MTP layers after the SiameseNorm decoder, docs/design.md), not HybridModel: leave out "
                "mtp_num_layers (--mtp-num-layers) and the pattern's '/...' part, or train a GPTModel.")
        slots = {Symbols.MAMBA: submodules.mamba_layer, Symbols.GDN: submodules.gdn_layer}
        for symbol in sorted(set(layer_type_list or ()) & set(slots)):
            if getattr(slots[symbol], "module", None) is RefusedLayer:
                continue  # this spec refuses the layer itself, saying which spec has it
            reason = _gpu_kernels_missing(symbol)
            if reason:
                raise UnsupportedConfigError(
                    f"SiameseNorm cannot build this hybrid stack: {reason}. Run it on a GPU machine "
                    "with them, or use a pattern of '*' and '-' layers."
                )
        super().__init__(config, submodules, layer_type_list=layer_type_list, post_layer_norm=False,
                         post_process=post_process, **kwargs)
        if post_process and post_layer_norm:
            self.final_norm = SiameseFinalNorm(
                config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon
            )
            self.post_layer_norm = True


# -- the Mamba sublayer ------------------------------------------------------------------


@dataclass
class SiameseMambaLayerSubmodules:
    """Megatron's MambaLayerSubmodules (``norm``: the InputNorm) plus the stream norms."""

    norm: Union[ModuleSpec, type] = IdentityOp
    mixer: Union[ModuleSpec, type] = IdentityOp
    x_norm: Union[ModuleSpec, type] = TorchNorm  # PostNorm of the X stream
    y_norm: Union[ModuleSpec, type] = TorchNorm  # PreNorm of the Y stream
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


class SiameseMambaLayer(SiameseSublayerMixin, MegatronModule):
    """A Mamba-2 mixer as one SiameseNorm sublayer."""

    def __init__(self, config: TransformerConfig, submodules: SiameseMambaLayerSubmodules, layer_number: int = 1,
                 pg_collection=None, pp_layer_offset: int = 0, name: Optional[str] = None):
        check_supported(config)
        if not getattr(config, "siamese_input_norm", True):
            raise UnsupportedConfigError(
                "siamese_input_norm=False (the ablation without InputNorm) is not implemented for Mamba layers ('M'): "
                "Transformer Engine fuses their InputNorm into the mixer's in_proj. Use a pattern without 'M', or "
                "leave siamese_input_norm at True.")
        super().__init__(config=config)
        self.layer_number = layer_number  # global: HybridStack numbers its layers itself
        self.hidden_dropout = config.hidden_dropout
        self.submodules_config = submodules

        def build_norm(spec):
            return build_module(spec, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

        self.norm = build_norm(submodules.norm)
        self.x_norm = build_norm(submodules.x_norm)
        self.y_norm = build_norm(submodules.y_norm)
        self.mixer = build_module(submodules.mixer, config, d_model=config.hidden_size, layer_number=layer_number,
                                  pg_collection=pg_collection, pp_layer_offset=pp_layer_offset, name=name)
        self._init_siamese((self.x_norm, self.y_norm), sublayers_per_layer=1)

    def mamba_state_shapes_per_request(self):
        """The mixer's state shapes per request, which Megatron's dynamic engine sizes its Mamba cache by."""
        return self.mixer.mamba_state_shapes_per_request()

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None, inference_context=None,
                rotary_pos_emb: Optional[Tensor] = None, *, inference_params=None, packed_seq_params=None):
        def mixer(normed: Tensor):
            return self.mixer(normed, inference_context=inference_context or inference_params,
                              packed_seq_params=packed_seq_params)

        return self._siamese_sublayer(hidden_states, self.x_norm, self.y_norm, self.norm, mixer)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.dist_checkpointing.utils import apply_prefix_mapping

        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        keys_map = {f"{prefix}{k}": f"{prefix}{v}" for k, v in self.submodules_config.sharded_state_dict_keys_map.items()}
        if keys_map:
            apply_prefix_mapping(sharded, keys_map)
        return sharded


# -- specs -------------------------------------------------------------------------------


def _without_qk_norm(layer: ModuleSpec) -> ModuleSpec:
    """Megatron's hybrid attention leaves q/k_layernorm None; name the absence IdentityOp."""
    attention = layer.submodules.self_attention
    if getattr(attention.submodules, "q_layernorm", IdentityOp) is not None:
        return layer
    submodules = dataclasses.replace(attention.submodules, q_layernorm=IdentityOp, k_layernorm=IdentityOp)
    slots = dict(vars(layer.submodules), self_attention=dataclasses.replace(attention, submodules=submodules))
    return dataclasses.replace(layer, submodules=type(layer.submodules)(**slots))


def get_siamese_hybrid_stack_spec() -> ModuleSpec:
    """Local modules: '*' and '-' layers split out of Megatron's local GPT layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # the package's local core attention (context parallelism too), as every local GPT layer has it
    stock = local_stock_layer(get_gpt_layer_local_spec())
    stock_moe = get_gpt_layer_local_spec(num_experts=1)  # only "MoE or not" is read: the config sizes it
    norms = dict(input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm)
    needs_te = "use siamese_hybrid_te_stack_spec (Transformer Engine) on a GPU machine"
    return ModuleSpec(
        module=SiameseHybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=siamese_layer_from(stock, False, with_mlp=False, **norms),
            mlp_layer=siamese_layer_from(stock, False, with_attention=False, **norms),
            mamba_layer=_refused(f"Mamba layers ('M') run on GPU kernels: {needs_te}."),
            gdn_layer=_refused(f"gated delta net layers ('G') run on GPU kernels: {needs_te}."),
            moe_layer=siamese_layer_from(stock_moe, False, with_attention=False, **norms),
            dsa_layer=_DSA, mla_layer=_MLA,
        ),
    )


class TransformerEngineUnavailableStack(SiameseHybridStack):
    """Stands in for the TE stack spec where Transformer Engine cannot be imported."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise UnsupportedConfigError(
            f"the SiameseNorm Transformer Engine hybrid stack needs Transformer Engine, but "
            f"{te.unavailable_reason()}. Use siamese_hybrid_stack_spec (local modules) or install it."
        )


def _te_layer(stock: ModuleSpec, **sublayers) -> ModuleSpec:
    """A TE stack layer as a SiameseNorm layer, its InputNorm ours feeding TE's plain linear."""
    from megatron_siamese.specs import te_input_norm_slots

    return siamese_layer_from(stock, False, **sublayers, built_for="transformer_engine", **te_input_norm_slots(stock))


def get_siamese_hybrid_te_stack_spec() -> ModuleSpec:
    """Megatron's TE ``hybrid_stack_spec`` with SiameseNorm layers; the Mamba and GDN mixers keep the InputNorm
    TE fuses into their ``in_proj`` (docs/transformer-engine.md)."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    stock = hybrid_stack_spec.submodules
    mamba = stock.mamba_layer.submodules
    return ModuleSpec(
        module=SiameseHybridStack if te.unavailable_reason() is None else TransformerEngineUnavailableStack,
        submodules=HybridStackSubmodules(
            attention_layer=_te_layer(_without_qk_norm(stock.attention_layer), with_mlp=False),
            mlp_layer=_te_layer(stock.mlp_layer, with_attention=False),
            gdn_layer=siamese_layer_from(stock.gdn_layer, False, with_mlp=False, built_for="transformer_engine"),
            mamba_layer=ModuleSpec(
                module=SiameseMambaLayer,
                submodules=SiameseMambaLayerSubmodules(
                    norm=mamba.norm, mixer=mamba.mixer, sharded_state_dict_keys_map=dict(mamba.sharded_state_dict_keys_map)
                ),
            ),
            moe_layer=_te_layer(stock.moe_layer, with_attention=False),
            dsa_layer=_DSA, mla_layer=_MLA,
        ),
    )


# For Megatron-LM: pretrain_hybrid.py --spec megatron_siamese.hybrid siamese_hybrid_stack_spec
siamese_hybrid_stack_spec = get_siamese_hybrid_stack_spec()
# ... and on Transformer Engine (GPUs; Mamba and GDN layers)
siamese_hybrid_te_stack_spec = get_siamese_hybrid_te_stack_spec()
