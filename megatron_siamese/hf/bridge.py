"""SiameseNorm in Megatron-Bridge (``megatron-bridge`` 0.6.2, Python 3.12): a bridge registered by
the exported architecture's class name (remote code, ``auto_map``), so Megatron-Bridge's
``AutoBridge`` loads an exported directory's weights into a SiameseNorm GPTModel this package
builds, sharded over its TP/PP ranks by Bridge's own parameter mappings.

    import megatron_siamese.hf.bridge  # registers the bridge
    bridge = AutoBridge.from_hf_pretrained(directory, trust_remote_code=True)
    bridge.load_hf_weights([model])   # model: a SiameseNorm GPTModel (Python API), any TP/PP

The names are convert.py's (the one place the Megatron <-> Hugging Face names live); Bridge's
mappings add the tensor-parallel split of each. Covered: the Python-API SiameseNorm model
(``--norm siamese``: merge norms under ``decoder.final_layernorm.merge``); not covered: the
hybrid variant (its ``attn_x_norm`` is named ``attn_x_scale`` on the Hugging Face side), the
Megatron-LM ``--spec`` model (its merge norms sit in the last layer) and building a model from a
Hugging Face config (``provider_bridge``): use ``megatron-siamese import-hf`` for those.
Megatron-Bridge imports Transformer Engine unconditionally (docs/evaluate.md, "Megatron-Bridge").
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
