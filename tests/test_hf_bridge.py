"""Megatron-Bridge (megatron-bridge 0.6.2, Python 3.12) loads an exported SiameseNorm directory into
a SiameseNorm GPTModel through our registered bridge (megatron_siamese/hf/bridge.py) with the same
weights as our own import (convert.hf_to_megatron); a wrong mapping (the two streams' norms
swapped) is caught. Skipped when megatron.bridge does not import: it imports Transformer Engine
unconditionally (docs/evaluate.md, "Megatron-Bridge", says how this was run on CPU)."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
try:
    from megatron_siamese.hf import bridge as bridge_module
except ImportError as error:  # no megatron-bridge, or (on CPU) no Transformer Engine for it to import
    pytest.skip(f"megatron.bridge does not import here: {error}", allow_module_level=True)

from megatron_siamese.check.case import ModelCase  # noqa: E402
from megatron_siamese.check.step import build_seeded_chunks  # noqa: E402
from megatron_siamese.hf import convert  # noqa: E402
from megatron_siamese.hf.export import read_hf_config, read_hf_weights, write_directory  # noqa: E402
from megatron_siamese.runtime.gpt import transformer_config  # noqa: E402
from megatron_siamese.runtime.layout import Layout  # noqa: E402

CASES = {
    "rmsnorm-swiglu-no-bias": ModelCase(norm="siamese", normalization="RMSNorm", add_bias_linear=False, vocab_size=320),
    "layernorm-swiglu-bias-qk-norm": ModelCase(norm="siamese", qk_layernorm=True, vocab_size=320),
}


def build(case):
    (model,) = build_seeded_chunks(case, transformer_config(case, Layout()))
    return model.eval()


def weights(model) -> dict:
    return {name: tensor for name, tensor in model.state_dict().items() if not name.endswith("_extra_state")}


@pytest.mark.parametrize("name", CASES)
def test_bridge_loads_what_our_import_loads(megatron_single_rank, tmp_path, name, monkeypatch):
    from megatron.bridge import AutoBridge

    case = CASES[name]
    source = build(case)
    write_directory(source, case.norm, str(tmp_path))
    ours = convert.hf_to_megatron(read_hf_weights(str(tmp_path)), read_hf_config(str(tmp_path)))

    target = build(dataclasses.replace(case, seed=case.seed + 1))  # other weights until loaded
    assert any(not torch.equal(weights(target)[key], tensor) for key, tensor in ours.items())
    bridge = AutoBridge.from_hf_pretrained(str(tmp_path), trust_remote_code=True)
    bridge.load_hf_weights([target])
    loaded = weights(target)
    assert sorted(loaded) == sorted(ours)
    for key, tensor in ours.items():
        assert torch.equal(loaded[key], tensor), key
    assert all(torch.equal(loaded[key], tensor) for key, tensor in weights(source).items())

    # a mapping that swaps the two streams' attention norms is caught
    swapped = [m for m in bridge_module.siamese_mappings() if "attn_x_norm" not in m.megatron_param
               and "attn_y_norm" not in m.megatron_param]
    for kind in bridge_module.KINDS:
        swapped += [bridge_module._mapping(f"decoder.layers.*.attn_x_norm.{kind}", f"model.layers.*.attn_y_norm.{kind}"),
                    bridge_module._mapping(f"decoder.layers.*.attn_y_norm.{kind}", f"model.layers.*.attn_x_norm.{kind}")]
    monkeypatch.setattr(bridge_module.SiameseNormBridge, "mapping_registry",
                        lambda self: bridge_module.MegatronMappingRegistry(*swapped))
    wrong = build(dataclasses.replace(case, seed=case.seed + 1))
    AutoBridge.from_hf_pretrained(str(tmp_path), trust_remote_code=True).load_hf_weights([wrong])
    assert not torch.equal(weights(wrong)["decoder.layers.0.attn_x_norm.weight"],
                           ours["decoder.layers.0.attn_x_norm.weight"])
