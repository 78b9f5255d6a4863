"""The Transformer Engine spec without Transformer Engine: imports, clear errors, checkpoint names.

The TE spec's numerics (TE vs local outputs, FP8 training) need a GPU: bench/gpu/.
"""

import dataclasses
import functools

import pytest

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_siamese import specs, te
from megatron_siamese.check.step import ModelCase, case_config
from megatron_siamese.layer import SiameseTransformerLayer
from megatron_siamese.models import build_gpt_chunks
from megatron_siamese.norms import TorchNorm
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.support import UnsupportedConfigError

needs_no_te = pytest.mark.skipif(te.unavailable_reason() is None, reason="Transformer Engine is installed here")


def described(spec):
    """A spec tree as comparable values (Megatron builds fresh objects on every call; newer
    versions give the MLP as a ``functools.partial``)."""
    if isinstance(spec, functools.partial):
        return (spec.func, spec.args, {k: described(v) for k, v in spec.keywords.items()})
    if isinstance(spec, ModuleSpec):
        return (spec.module, spec.params, described(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return {f.name: described(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    return spec


def test_local_spec_is_megatrons_with_the_layer_and_norm_slots_replaced():
    stock = get_gpt_layer_local_spec().submodules
    ours = specs.siamese_layer_spec
    assert ours.module is SiameseTransformerLayer
    siamese = ours.submodules
    # Megatron's attention, MLP, bias-dropout and checkpoint key map, as Megatron builds them ...
    replaced = {"input_layernorm", "pre_mlp_layernorm"}
    for field in dataclasses.fields(stock):
        if field.name not in replaced:
            assert described(getattr(siamese, field.name)) == described(getattr(stock, field.name)), field.name
    assert siamese.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    # ... our norms in every norm slot (SP-capable), the merge on the last layer for --spec
    for slot in sorted(replaced) + ["attn_x_norm", "attn_y_norm", "mlp_x_norm", "mlp_y_norm"]:
        assert getattr(siamese, slot) is TorchNorm, slot
    assert siamese.output_merge is not None


@needs_no_te
def test_te_layer_spec_imports_everywhere_and_refuses_to_build_without_te(megatron_single_rank):
    # Megatron-LM imports `siamese_te_layer_spec` by name: it must exist without TE ...
    assert issubclass(specs.siamese_te_layer_spec.module, SiameseTransformerLayer)
    config = case_config(ModelCase(), Layout())
    # ... and building it says what to change
    with pytest.raises(UnsupportedConfigError, match="Transformer Engine spec.*siamese_layer_spec"):
        build_module(specs.siamese_te_layer_spec, config=config, layer_number=1)
    with pytest.raises(UnsupportedConfigError, match="Transformer Engine spec.*siamese_layer_spec"):
        specs.get_siamese_layer_te_spec()


@needs_no_te
def test_block_spec_for_transformer_engine_says_what_to_change(megatron_single_rank):
    config = dataclasses.replace(case_config(ModelCase(), Layout()), transformer_impl="transformer_engine")
    with pytest.raises(RuntimeError, match="transformer_impl='local'"):
        specs.get_siamese_block_spec(config)
    local = specs.get_siamese_block_spec(config, use_transformer_engine=False)
    assert local.layer_specs[0].submodules.input_layernorm is TorchNorm


def test_local_checkpoint_names_are_the_te_names(megatron_single_rank):
    """The local spec saves its InputNorms under TE's fused LayerNorm-Linear names."""
    config = case_config(ModelCase(num_layers=2), Layout())
    (model,) = build_gpt_chunks(config, "siamese", 128, 16)
    # the keys dist_checkpointing stores are the ShardedTensors' own, not the dict's
    keys = {sharded.key for sharded in model.sharded_state_dict().values() if hasattr(sharded, "key")}
    for name in ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
                 "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias"):
        assert f"decoder.layers.{name}" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    # the stream norms keep their own names in both specs
    assert "decoder.layers.attn_x_norm.weight" in keys and "decoder.layers.mlp_y_norm.weight" in keys


@pytest.mark.parametrize("norm", ["siamese", "siamese-layer"])
def test_both_gpt_entry_points_store_the_merge_norms_under_one_name(megatron_single_rank, norm):
    """Megatron-LM's layer spec merges in the last layer, the Python API in the final norm:
    both store the merge norms as decoder.layers.output_merge.*, so checkpoints interchange."""
    config = case_config(ModelCase(num_layers=2), Layout())
    (model,) = build_gpt_chunks(config, norm, 128, 16)
    keys = {sharded.key for sharded in model.sharded_state_dict().values() if hasattr(sharded, "key")}
    merge = {k for k in keys if "merge" in k}
    assert merge == {"decoder.layers.output_merge.x_norm.weight", "decoder.layers.output_merge.x_norm.bias",
                     "decoder.layers.output_merge.y_norm.weight", "decoder.layers.output_merge.y_norm.bias"}
    assert "decoder.final_layernorm.weight" in keys
