"""The Transformer Engine spec without Transformer Engine: imports, clear errors, checkpoint names.

The TE spec's numerics (TE vs local outputs, FP8 training) need a GPU: bench/gpu/.
"""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_siamese import specs, te
from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
from megatron_siamese.core_attention import LocalCoreAttention
from megatron_siamese.layer import SiameseTransformerLayer
from megatron_siamese.models import build_gpt_chunks
from megatron_siamese.norms import ChannelScale, QKNormPerConfig, TorchNorm
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.support import UnsupportedConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from te_stand_ins import LayerNormColumnParallelLinear, stood_in  # noqa: E402

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
    stock = get_gpt_layer_local_spec(qk_layernorm=True).submodules
    ours = specs.siamese_layer_spec
    assert ours.module is SiameseTransformerLayer
    siamese = ours.submodules
    # Megatron's attention, MLP, bias-dropout and checkpoint key map, as Megatron builds them ...
    replaced = {"input_layernorm", "pre_mlp_layernorm", "self_attention"}
    for field in dataclasses.fields(stock):
        if field.name not in replaced:
            assert described(getattr(siamese, field.name)) == described(getattr(stock, field.name)), field.name
    # ... its attention with QK-norm decided when a layer is built (the config's qk_layernorm), and
    # the package's core attention (MLA's head sizes, context parallelism) in Megatron's local one's slot
    attention = dataclasses.replace(stock.self_attention, submodules=dataclasses.replace(
        stock.self_attention.submodules, q_layernorm=QKNormPerConfig.spec(TorchNorm),
        k_layernorm=QKNormPerConfig.spec(TorchNorm), core_attention=LocalCoreAttention))
    assert stock.self_attention.submodules.core_attention in LocalCoreAttention.__mro__
    assert described(siamese.self_attention) == described(attention)
    assert siamese.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    # ... our norms in every norm slot (SP-capable), the merge on the last layer for --spec
    for slot in ["input_layernorm", "pre_mlp_layernorm", "attn_x_norm", "attn_y_norm", "mlp_x_norm", "mlp_y_norm"]:
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


# -- the TE specs' wiring, with Transformer Engine's modules stood in for by Megatron's local ones --


@pytest.fixture
def te_stand_ins():
    """Megatron's TE layer spec as TE shapes it, built of Megatron's local modules (bench/te_stand_ins.py)."""
    with stood_in() as te_extension:
        yield te_extension


def _logits_and_grads(model, case):
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    model(*args, labels=batch["labels"]).mean().backward()
    with torch.no_grad():
        return model(*args), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("norm, plant", [("siamese", None), ("siamese-hybrid", None), ("siamese", "te-norms-again"),
                                         ("siamese-hybrid", "te-norms-again")],
                         ids=["standard", "hybrid", "standard-planted-te-norms-again", "hybrid-planted-te-norms-again"])
def test_te_spec_computes_the_local_spec_with_te_modules_stood_in(megatron_single_rank, te_stand_ins, norm, plant):
    """The TE GPT, loaded with the local GPT's weights, computes the local GPT's logits and every
    gradient: its InputNorms are ours (inside the fused ops) and feed TE's plain linears
    (TEColumnParallelLinear for linear_qkv and linear_fc1, not the LayerNorm-fused ones Megatron's
    TE spec builds), the hybrid variant's attention has none (X is scaled by c1, queries and keys
    are normalized). Planted: TE's LayerNorm-fused linears normalizing the normalized input again
    (the earlier TE spec's second norm pass) compute something else."""
    if plant:
        te_stand_ins.TEColumnParallelLinear = LayerNormColumnParallelLinear
    case = ModelCase(norm=norm, num_layers=2, fused_ops=False)
    (local,) = build_seeded_chunks(case, case_config(case, Layout()))
    te_case = dataclasses.replace(case, transformer_impl="transformer_engine")
    (te_model,) = build_seeded_chunks(te_case, case_config(te_case, Layout()))
    layer, hybrid = te_model.decoder.layers[0], norm == "siamese-hybrid"
    assert type(layer.input_layernorm) is (IdentityOp if hybrid else TorchNorm)
    assert type(layer.pre_mlp_layernorm) is TorchNorm
    assert type(layer.attn_x_norm) is (ChannelScale if hybrid else TorchNorm)
    assert isinstance(layer.self_attention.q_layernorm, TorchNorm) == hybrid
    if not plant:
        assert type(layer.self_attention.linear_qkv) is ColumnParallelLinear
        assert type(layer.mlp.linear_fc1) is ColumnParallelLinear

    missing, unexpected = te_model.load_state_dict(local.state_dict(), strict=False)
    assert not unexpected and [name for name in missing if not name.endswith("_extra_state")] == (
        [f"decoder.layers.{i}.{linear}.layer_norm_{p}" for i in range(2)
         for linear in ("self_attention.linear_qkv", "mlp.linear_fc1") for p in ("weight", "bias")]
        if plant else [])
    (logits, grads), (te_logits, te_grads) = _logits_and_grads(local, case), _logits_and_grads(te_model, case)
    if plant:
        assert not torch.allclose(te_logits, logits, rtol=1e-3, atol=1e-3)
        return
    torch.testing.assert_close(te_logits, logits, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(te_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(te_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_te_spec_checkpoints_keep_the_fused_linears_names_and_load_local_ones(megatron_single_rank, te_stand_ins,
                                                                            tmp_path):
    """The TE spec stores its InputNorms under the names TE's LayerNorm-fused linears gave them
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), as every earlier TE
    checkpoint and the local spec do: a local GPT's dist checkpoint loads into the TE GPT."""
    from megatron.core import dist_checkpointing

    case = ModelCase(num_layers=2, fused_ops=False)
    (local,) = build_seeded_chunks(case, case_config(case, Layout()))
    te_case = dataclasses.replace(case, transformer_impl="transformer_engine", seed=case.seed + 1)
    (te_model,) = build_seeded_chunks(te_case, case_config(te_case, Layout()))
    sharded = te_model.sharded_state_dict()
    keys = {value.key for value in sharded.values() if hasattr(value, "key")}
    assert {f"decoder.layers.{name}" for name in ("self_attention.linear_qkv.layer_norm_weight",
                                                  "mlp.linear_fc1.layer_norm_weight")} <= keys
    assert not any("input_layernorm" in key or "pre_mlp_layernorm" in key for key in keys)
    dist_checkpointing.save(local.sharded_state_dict(), str(tmp_path))
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    with torch.no_grad():
        expected = local(*args)
        assert not torch.allclose(te_model(*args), expected)  # differently seeded until it loads
        te_model.load_state_dict(dist_checkpointing.load(sharded, str(tmp_path)), strict=False)
        torch.testing.assert_close(te_model(*args), expected, rtol=1e-6, atol=1e-6)


def test_qk_norm_checkpoints_interchange_between_the_gpt_entry_points(megatron_single_rank, tmp_path):
    """--norm siamese-layer --qk-layernorm (Megatron-LM's spec object) saves QK-norm under Megatron's
    names (self_attention.q_layernorm / k_layernorm), and the Python API's model loads it."""
    from megatron.core import dist_checkpointing

    def built(norm, seed):
        case = ModelCase(norm=norm, num_layers=2, seed=seed)
        (model,) = build_seeded_chunks(case, dataclasses.replace(case_config(case, Layout()), qk_layernorm=True))
        return model, case

    layer_spec_model, case = built("siamese-layer", seed=1)
    sharded = layer_spec_model.sharded_state_dict()
    keys = {value.key for value in sharded.values() if hasattr(value, "key")}
    assert {"decoder.layers.self_attention.q_layernorm.weight", "decoder.layers.self_attention.k_layernorm.weight"} <= keys
    dist_checkpointing.save(sharded, str(tmp_path))
    api_model, _ = built("siamese", seed=2)
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    with torch.no_grad():
        expected = layer_spec_model(*args)
        assert not torch.allclose(api_model(*args), expected)  # differently seeded until it loads
        api_model.load_state_dict(dist_checkpointing.load(api_model.sharded_state_dict(), str(tmp_path)))
        torch.testing.assert_close(api_model(*args), expected, rtol=1e-6, atol=1e-6)


# -- every scheme follows transformer_impl, or refuses it ---------------------------------------


@pytest.mark.parametrize("spec_object", ["siamese_layer_spec", "siamese_moe_layer_spec", "siamese_hybrid_layer_spec"])
def test_a_local_spec_object_refuses_a_transformer_engine_config(megatron_single_rank, spec_object):
    """Megatron-LM's --spec objects exist before any config: one of local modules given a config
    that asks for Transformer Engine (whose FP8 and GEMMs it would ignore) names the TE object."""
    config = case_config(ModelCase(), Layout())
    te_config = dataclasses.replace(config, transformer_impl="transformer_engine",
                                    qk_layernorm=spec_object == "siamese_hybrid_layer_spec",
                                    num_moe_experts=4 if spec_object == "siamese_moe_layer_spec" else None)
    with pytest.raises(UnsupportedConfigError, match=r"this layer spec builds Megatron's local modules, but the config "
                                                     r"asks for transformer_impl='transformer_engine'.*siamese_te_layer_spec"):
        build_module(getattr(specs, spec_object), config=te_config, layer_number=1)


def test_the_te_spec_object_refuses_a_local_config(megatron_single_rank, te_stand_ins):
    config = case_config(ModelCase(), Layout())
    with pytest.raises(UnsupportedConfigError, match=r"builds Megatron's transformer_engine modules, but the config "
                                                     r"asks for transformer_impl='local'.*siamese_layer_spec"):
        build_module(specs.get_siamese_layer_te_spec(merge_at_output=True), config=config, layer_number=1)


def test_the_pre_norm_baseline_follows_transformer_impl_and_post_norm_refuses_it(megatron_single_rank, te_stand_ins):
    """--norm pre builds Megatron's own TE block when the config asks for TE (so --compare runs
    every scheme on the same kernels and precision); the single-stream baselines, local only, refuse."""
    from megatron_siamese.models import get_pre_norm_block_spec
    from megatron_siamese.single_stream import get_single_stream_block_spec

    te_config = dataclasses.replace(case_config(ModelCase(norm="pre"), Layout()), transformer_impl="transformer_engine")
    block = get_pre_norm_block_spec(te_config)
    assert block.layer_specs[0].submodules.self_attention.submodules.linear_qkv is LayerNormColumnParallelLinear
    assert block.layer_norm is te_stand_ins.TENorm
    local = get_pre_norm_block_spec(case_config(ModelCase(norm="pre"), Layout()))
    assert local.layer_norm is TorchNorm and local.layer_specs[0].submodules.input_layernorm is TorchNorm
    for scheme in ("post", "hybridnorm", "mixln"):
        with pytest.raises(UnsupportedConfigError, match=f"the {scheme} baseline cannot build this layer:\n- the "
                                                         "baseline is built of Megatron's local modules, but "
                                                         "transformer_impl='transformer_engine'"):
            get_single_stream_block_spec(te_config, scheme=scheme)
