"""SiameseNorm in Megatron-Bridge (``megatron-bridge`` 0.6.2): a bridge registered by the exported
architecture's class name, so ``AutoBridge`` loads an exported directory's weights into a SiameseNorm
GPTModel, split over its TP/PP ranks by Bridge's mappings of convert.py's names.

    import megatron_siamese.hf.bridge  # registers the bridge
    bridge = AutoBridge.from_hf_pretrained(directory, trust_remote_code=True)
    bridge.load_hf_weights([model])   # model: a SiameseNorm GPTModel (Python API), any TP/PP

Only the Python-API model (``--norm siamese``): for the hybrid variant, the ``--spec`` model or a model
built from the config, use ``megatron-siamese import-hf`` (docs/evaluate.md, "Megatron-Bridge").
"""

from __future__ import annotations

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    GatedMLPMapping,
    QKVMapping,
    ReplicatedMapping,
)
from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_siamese.hf import convert
from megatron_siamese.hf.architecture import SIAMESE_ARCHITECTURE

KINDS = ("weight", "bias")


def _mapping(megatron: str, hf: str):
    # norms (ours and Megatron's) are whole on every TP rank; linear layers and embeddings split
    # as their Megatron modules say (Bridge reads the module type)
    return (ReplicatedMapping if "norm" in megatron else AutoMapping)(megatron_param=megatron, hf_param=hf)


def siamese_mappings() -> list:
    """Bridge's parameter mappings for a Python-API SiameseNorm GPTModel."""
    mappings = [_mapping(megatron + kind, hf + kind) for megatron, hf in convert._TOP_NAMES for kind in KINDS]
    for megatron, hf in (*convert._LAYER_NAMES, ("attn_x_norm.", "attn_x_norm.")):
        mappings += [_mapping(f"decoder.layers.*.{megatron}{kind}", f"model.layers.*.{hf}{kind}") for kind in KINDS]
    for kind in KINDS:
        mappings.append(QKVMapping(megatron_param=f"decoder.layers.*.self_attention.linear_qkv.{kind}",
                                   q=f"model.layers.*.self_attn.q_proj.{kind}",
                                   k=f"model.layers.*.self_attn.k_proj.{kind}",
                                   v=f"model.layers.*.self_attn.v_proj.{kind}"))
        mappings.append(GatedMLPMapping(megatron_param=f"decoder.layers.*.mlp.linear_fc1.{kind}",
                                        gate=f"model.layers.*.mlp.gate_proj.{kind}",
                                        up=f"model.layers.*.mlp.up_proj.{kind}"))
    return mappings


@MegatronModelBridge.register_bridge(source=SIAMESE_ARCHITECTURE, target=GPTModel)
class SiameseNormBridge(MegatronModelBridge):
    """Hugging Face ``SiameseNormForCausalLM`` (this package's export) <-> a SiameseNorm GPTModel."""

    def provider_bridge(self, hf_pretrained):
        raise NotImplementedError("build the SiameseNorm GPTModel with megatron_siamese (or megatron-siamese "
                                  "import-hf), then bridge.load_hf_weights([model])")

    def mapping_registry(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*siamese_mappings())
