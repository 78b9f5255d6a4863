"""The Transformer Engine spec without Transformer Engine: imports, clear errors, checkpoint names.

The TE spec's numerics (TE vs local outputs, FP8 training) need a GPU: bench/gpu/validate.sh.
"""

import dataclasses

import pytest

from megatron.core.transformer.spec_utils import build_module

from megatron_siamese import specs
from megatron_siamese.gpt import build_gpt_chunks
from megatron_siamese.support import UnsupportedConfigError
from megatron_siamese.testing.gpt_run import ModelCase, transformer_config
from megatron_siamese.testing.layouts import Layout

needs_no_te = pytest.mark.skipif(
    specs.transformer_engine_error() is None, reason="Transformer Engine is installed here"
)


def test_package_and_local_spec_import_without_transformer_engine():
    assert specs.siamese_layer_spec.submodules.input_layernorm is not None
    # the TE spec object exists (Megatron-LM's --spec imports it) but names TE lazily
    assert all(isinstance(s.module, tuple) for s in (
        specs.siamese_te_layer_spec.submodules.self_attention.submodules.linear_qkv,
        specs.siamese_te_layer_spec.submodules.mlp.submodules.linear_fc1))


@needs_no_te
def test_block_spec_for_transformer_engine_says_what_to_change(megatron_single_rank):
    config = dataclasses.replace(transformer_config(ModelCase(), Layout()), transformer_impl="transformer_engine")
    with pytest.raises(RuntimeError, match="transformer_impl='local'"):
        specs.get_siamese_block_spec(config)
    local = specs.get_siamese_block_spec(config, use_transformer_engine=False)
    assert local.layer_specs[0].submodules.input_layernorm is not None


@needs_no_te
def test_building_the_te_layer_without_te_is_refused(megatron_single_rank):
    config = transformer_config(ModelCase(), Layout())
    with pytest.raises(UnsupportedConfigError, match="Transformer Engine spec.*siamese_layer_spec"):
        build_module(specs.siamese_te_layer_spec, config=config, layer_number=1)


def test_local_checkpoint_names_are_the_te_names(megatron_single_rank):
    """The local spec saves its InputNorms under TE's fused LayerNorm-Linear names."""
    config = transformer_config(ModelCase(num_layers=2), Layout())
    (model,) = build_gpt_chunks(config, "siamese", 128, 16)
    # the keys dist_checkpointing stores are the ShardedTensors' own, not the dict's
    keys = {sharded.key for sharded in model.sharded_state_dict().values() if hasattr(sharded, "key")}
    for name in ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
                 "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias"):
        assert f"decoder.layers.{name}" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    # the stream norms keep their own names in both specs
    assert "decoder.layers.attn_x_norm.weight" in keys and "decoder.layers.mlp_y_norm.weight" in keys
