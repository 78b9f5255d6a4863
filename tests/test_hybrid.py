"""SiameseNorm in Megatron's HybridModel (megatron-core >= 0.19): one pattern symbol, one sublayer.

A ``*-*-...`` stack computes exactly the SiameseNorm GPTModel with the same weights; a GPT
checkpoint loads into it through Megatron's own translation; what cannot run is refused.
"""

import dataclasses
import re

import pytest
import torch

from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
from megatron_siamese.reference.functional import depth_scale, gpt_equivalent_block
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.support import UnsupportedConfigError
from megatron_siamese.versions import installed_megatron_core, release

HAS_HYBRID = release(installed_megatron_core()) >= (0, 19, 0)
needs_hybrid = pytest.mark.skipif(
    not HAS_HYBRID, reason="HybridModel needs megatron-core >= 0.19; the 0.19 leg of the suite runs this"
)

CASE = ModelCase(num_layers=3)
HYBRID = dataclasses.replace(CASE, model="hybrid")  # pattern "*-*-*-"


def test_depth_rule_counts_sublayers_in_pairs():
    gpt = [depth_scale(gpt_equivalent_block(layer, 2)) for layer in (1, 2, 3)]
    hybrid = [depth_scale(gpt_equivalent_block(layer, 1)) for layer in range(1, 7)]
    assert hybrid == [gpt[0], gpt[0], gpt[1], gpt[1], gpt[2], gpt[2]]
    with pytest.raises(ValueError, match="one or two sublayers"):
        gpt_equivalent_block(1, 3)


@pytest.mark.skipif(HAS_HYBRID, reason="this megatron-core has HybridModel")
def test_hybrid_model_on_older_megatron_core_is_refused_by_name():
    with pytest.raises(ImportError, match=r"HybridModel support needs megatron-core >= 0\.19 \(installed: 0\.16"):
        import megatron_siamese.hybrid  # noqa: F401


def gpt_name_in_hybrid(name: str) -> str:
    """A GPTModel parameter's name in the equivalent ``*-`` HybridModel (GPT layer i: attention
    in hybrid layer 2i, MLP in 2i + 1; the final norm is the stack's ``final_norm``)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
    if match:
        layer, rest = int(match.group(1)), match.group(2)
        mlp_side = rest.startswith(("mlp.", "mlp_x_norm.", "mlp_y_norm.", "pre_mlp_layernorm."))
        return f"decoder.layers.{2 * layer + mlp_side}.{rest}"
    return name.replace("decoder.final_layernorm.", "decoder.final_norm.")


def forward_backward(model, case):
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()  # Megatron's per-layer router statistics are sized by the first model's layers
    batch = microbatches(case)[0]
    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]).mean().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@needs_hybrid
@pytest.mark.parametrize("changes", [dict(fused_ops=False), dict(fused_ops=True),
                                     dict(fused_ops=True, siamese_input_norm=False, siamese_depth_scale=False)],
                         ids=["pytorch", "fused", "fused-ablated"])
def test_star_dash_stack_equals_the_siamese_gpt_bitwise(megatron_single_rank, changes):
    # the GPT's sublayers apart, as a one-sublayer hybrid layer keeps them: the same ops in the
    # same order (joined, the GPT computes the same function with other roundings:
    # test_reference_equivalence); the component study's ablation too (no InputNorm, c = 1)
    gpt_case, hybrid_case = (dataclasses.replace(c, boundary_ops=False, **changes) for c in (CASE, HYBRID))
    (gpt,) = build_seeded_chunks(gpt_case, case_config(gpt_case, Layout()))
    (hybrid,) = build_seeded_chunks(hybrid_case, case_config(hybrid_case, Layout()))
    gpt_state = gpt.state_dict()
    hybrid_state = {gpt_name_in_hybrid(k): v for k, v in gpt_state.items() if not k.endswith("_extra_state")}
    missing, unexpected = hybrid.load_state_dict(hybrid_state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    gpt_logits, gpt_grads = forward_backward(gpt, gpt_case)
    hybrid_logits, hybrid_grads = forward_backward(hybrid, hybrid_case)
    assert torch.equal(hybrid_logits, gpt_logits)
    assert len(gpt_grads) == len(hybrid_grads)
    for name, grad in gpt_grads.items():
        assert torch.equal(hybrid_grads[gpt_name_in_hybrid(name)], grad), name
    # and the comparison has teeth: the hybrid model's own seeded weights compute something else
    (other,) = build_seeded_chunks(hybrid_case, case_config(hybrid_case, Layout()))
    assert not torch.allclose(forward_backward(other, hybrid_case)[0], gpt_logits)


@needs_hybrid
@pytest.mark.parametrize("pattern, moe_layer_freq", [("*E*E", "1"), ("*-*E", "[0,1]")])
def test_moe_layers_equal_the_siamese_gpt_with_the_same_experts(megatron_single_rank, pattern, moe_layer_freq):
    """'E' is the MLP half of a block with Megatron's MoELayer: ``*E*E`` is the all-MoE GPT, a mixed
    ``*-*E`` the GPT whose moe_layer_freq puts experts in its second block only."""
    # no biases: Megatron's expert MLP adds its bias in place into a view autograd forbids changing
    moe = dict(num_layers=2, num_moe_experts=4, moe_router_topk=2, moe_z_loss_coeff=1e-3, add_bias_linear=False)
    gpt_case = dataclasses.replace(CASE, moe_layer_freq=moe_layer_freq, boundary_ops=False, **moe)  # apart, as 'E'
    hybrid_case = dataclasses.replace(CASE, model="hybrid", hybrid_layer_pattern=pattern, **moe)
    (gpt,) = build_seeded_chunks(gpt_case, case_config(gpt_case, Layout()))
    (hybrid,) = build_seeded_chunks(hybrid_case, case_config(hybrid_case, Layout()))
    assert [type(layer.mlp).__name__ for layer in hybrid.decoder.layers][1::2] == [
        type(layer.mlp).__name__ for layer in gpt.decoder.layers]
    hybrid_state = {gpt_name_in_hybrid(k): v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = hybrid.load_state_dict(hybrid_state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    gpt_logits, gpt_grads = forward_backward(gpt, gpt_case)
    hybrid_logits, hybrid_grads = forward_backward(hybrid, hybrid_case)
    assert torch.equal(hybrid_logits, gpt_logits)
    assert any(".mlp.router." in name for name in gpt_grads)
    for name, grad in gpt_grads.items():  # the router's gradient carries the aux and z losses
        assert torch.equal(hybrid_grads[gpt_name_in_hybrid(name)], grad), name


@needs_hybrid
@pytest.mark.parametrize("gpt_spec", ["siamese", "siamese-layer"], ids=["python-api", "megatron-lm-spec"])
def test_gpt_checkpoint_loads_into_the_hybrid_model_through_megatrons_translation(megatron_single_rank, tmp_path,
                                                                                  gpt_spec):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )

    gpt_case = dataclasses.replace(CASE, norm=gpt_spec)
    (gpt,) = build_seeded_chunks(gpt_case, case_config(gpt_case, Layout()))
    dist_checkpointing.save(gpt.sharded_state_dict(), str(tmp_path))
    (hybrid,) = build_seeded_chunks(HYBRID, case_config(HYBRID, Layout()))
    sharded = hybrid.sharded_state_dict()
    retarget_sharded_state_dict_to_gpt_checkpoint(sharded, gpt_compatible_layer_maps("*-" * CASE.num_layers))
    hybrid.load_state_dict(dist_checkpointing.load(sharded, str(tmp_path)))
    assert torch.equal(forward_backward(hybrid, HYBRID)[0], forward_backward(gpt, gpt_case)[0])


@needs_hybrid
@pytest.mark.parametrize("pattern,refusal", [
    ("D-D-", "DeepSeek sparse attention"),
    ("*-M-", "Mamba layers \\('M'\\) run on GPU kernels: use siamese_hybrid_te_stack_spec"),
    ("*-G-", "gated delta net layers \\('G'\\) run on GPU kernels"),
])
def test_layers_siamese_norm_cannot_build_here_are_refused_by_name(megatron_single_rank, pattern, refusal):
    case = dataclasses.replace(HYBRID, hybrid_layer_pattern=pattern)
    with pytest.raises(UnsupportedConfigError, match=refusal):
        build_seeded_chunks(case, case_config(case, Layout()))


@needs_hybrid
def test_multi_token_prediction_in_a_hybrid_model_is_refused_by_name(megatron_single_rank):
    case = dataclasses.replace(HYBRID, hybrid_layer_pattern="*-*-*-/*-", mtp_num_layers=1)
    with pytest.raises(UnsupportedConfigError, match="multi-token prediction is built for GPTModel"):
        build_seeded_chunks(case, case_config(case, Layout()))


@needs_hybrid
def test_te_stack_is_megatrons_hybrid_spec_with_siamese_layers_and_refuses_without_te(megatron_single_rank):
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from megatron_siamese import hybrid, te
    from megatron_siamese.layer import SiameseTransformerLayer
    from megatron_siamese.norms import TorchNorm

    ours, stock = hybrid.siamese_hybrid_te_stack_spec.submodules, hybrid_stack_spec.submodules
    for slot in ("attention_layer", "mlp_layer", "gdn_layer"):
        assert getattr(ours, slot).module is SiameseTransformerLayer
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    # attention and MLP layers: InputNorm ours (run by the fused ops) feeding TE's plain linear
    attention = ours.attention_layer.submodules
    assert attention.input_layernorm is TorchNorm and attention.self_attention.submodules.linear_qkv is TEColumnParallelLinear
    assert ours.mlp_layer.submodules.pre_mlp_layernorm is TorchNorm
    mlp = ours.mlp_layer.submodules.mlp  # a ModuleSpec, or a functools.partial on newer Megatron
    assert (getattr(mlp, "submodules", None) or mlp.keywords["submodules"]).linear_fc1 is TEColumnParallelLinear
    # GDN keeps TE's LayerNorm-fused in_proj, as stock builds it
    assert ours.gdn_layer.submodules.self_attention.submodules == stock.gdn_layer.submodules.self_attention.submodules
    assert ours.gdn_layer.submodules.self_attention.module is stock.gdn_layer.submodules.self_attention.module
    assert ours.attention_layer.submodules.attn_x_norm is TorchNorm and ours.mlp_layer.submodules.mlp_y_norm is TorchNorm
    assert ours.mamba_layer.module is hybrid.SiameseMambaLayer
    assert ours.mamba_layer.submodules.mixer is stock.mamba_layer.submodules.mixer
    if te.unavailable_reason():
        case = dataclasses.replace(HYBRID, transformer_impl="transformer_engine")
        config = dataclasses.replace(case_config(HYBRID, Layout()), transformer_impl="transformer_engine")
        with pytest.raises(UnsupportedConfigError, match="Transformer Engine hybrid stack needs Transformer Engine"):
            build_seeded_chunks(case, config)


@needs_hybrid
def test_only_siamese_norm_builds_a_hybrid_model(megatron_single_rank):
    case = dataclasses.replace(HYBRID, norm="pre")
    with pytest.raises(ValueError, match="SiameseNorm layers only"):
        build_seeded_chunks(case, case_config(case, Layout()))


@needs_hybrid
def test_a_mamba_layer_gives_the_inference_engine_its_state_shapes(megatron_single_rank):
    """Megatron's dynamic inference engine sizes its Mamba state cache by asking the stack's
    first Mamba layer (HybridStack.mamba_state_shapes_per_request): a SiameseNorm Mamba layer
    answers with its mixer's shapes, as MambaLayer does (the mixer stood in: MambaSSM needs a GPU)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_siamese.hybrid import SiameseMambaLayer, SiameseMambaLayerSubmodules

    class Mixer(torch.nn.Module):
        def __init__(self, config, d_model, **kwargs):
            super().__init__()
            self.shapes = ((2 * d_model, 4), (2, 16, d_model))

        def mamba_state_shapes_per_request(self):
            return self.shapes

    config = case_config(HYBRID, Layout())
    layer = build_module(ModuleSpec(module=SiameseMambaLayer, submodules=SiameseMambaLayerSubmodules(mixer=Mixer)),
                         config, layer_number=1)
    assert layer.mamba_state_shapes_per_request() == ((2 * config.hidden_size, 4), (2, 16, config.hidden_size))
