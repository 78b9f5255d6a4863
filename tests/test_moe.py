"""SiameseNorm layers with Megatron's MoELayer as the MLP sublayer: which layers get experts,
and the MoE settings these layers refuse, with what to change."""

import dataclasses

import pytest
import torch

from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_siamese import specs
from megatron_siamese.config import SiameseTransformerConfig
from megatron_siamese.layer import SiameseTransformerLayer
from megatron_siamese.models import build_gpt_chunks
from megatron_siamese.support import UnsupportedConfigError, check_supported

MOE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=4,
           moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall",
           transformer_impl="local", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
           add_bias_linear=False)


def moe_config(**changes):
    return SiameseTransformerConfig(**{**MOE, **changes})


def expert_layers(model):
    return [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers]


@pytest.mark.parametrize("freq, pattern", [(1, [True] * 4), (2, [True, False, True, False]),
                                           ([0, 1, 1, 0], [False, True, True, False])])
def test_the_block_spec_puts_experts_where_moe_layer_freq_says(megatron_single_rank, freq, pattern):
    model = build_gpt_chunks(moe_config(moe_layer_freq=freq), "siamese", 64, 16)[0]
    assert expert_layers(model) == pattern
    assert all(isinstance(layer, SiameseTransformerLayer) for layer in model.decoder.layers)
    tokens = torch.randint(0, 64, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean()
    loss.backward()
    routers = [layer.mlp.router.weight.grad for layer in model.decoder.layers if isinstance(layer.mlp, MoELayer)]
    assert routers and all(grad is not None and grad.abs().sum() > 0 for grad in routers)


def test_the_megatron_lm_spec_objects_refuse_a_config_whose_experts_they_do_not_build(megatron_single_rank):
    dense = dataclasses.replace(specs.get_siamese_block_spec(moe_config()), layer_specs=[specs.siamese_layer_spec] * 4)
    from megatron.core.models.gpt import GPTModel

    with pytest.raises(UnsupportedConfigError, match="siamese_moe_layer_spec"):
        GPTModel(moe_config(), dense, vocab_size=64, max_sequence_length=16)
    assert expert_layers(build_gpt_chunks(moe_config(), "siamese-layer", 64, 16)[0]) == [True] * 4
    block = dataclasses.replace(specs.get_siamese_block_spec(moe_config()),
                                layer_specs=[specs.siamese_moe_layer_spec] * 4)
    with pytest.raises(UnsupportedConfigError, match="moe_layer_freq=1"):
        GPTModel(moe_config(moe_layer_freq=2), block, vocab_size=64, max_sequence_length=16)
    GPTModel(moe_config(), block, vocab_size=64, max_sequence_length=16)  # every layer MoE: as the spec


@pytest.mark.parametrize("changes, says", [
    (dict(overlap_moe_expert_parallel_comm=True), "overlap_moe_expert_parallel_comm"),
    (dict(moe_grouped_gemm=True), "transformer_impl='transformer_engine'"),
    (dict(moe_permute_fusion=True), "moe_permute_fusion needs a GPU"),
    (dict(moe_token_dispatcher_type="flex"), "'flex'.*needs a GPU"),
    (dict(cuda_graph_scope=["moe_router"]), "moe_router / moe_preprocess"),
])
def test_moe_settings_these_layers_cannot_honour_are_refused_with_what_to_change(changes, says):
    config = moe_config()
    for name, value in changes.items():  # set after construction: Megatron checks some of them itself,
        setattr(config, name, value)     # and some need a GPU or EP before it even gets here
    with pytest.raises(UnsupportedConfigError, match=says):
        check_supported(config)
    check_supported(moe_config())


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_the_stock_baselines_get_the_same_experts_and_qk_norm(megatron_single_rank, norm):
    """Pre-Norm and Post-Norm controls follow the config as Megatron's own decoder block does, so a
    comparison with SiameseNorm changes the residual scheme only."""
    model = build_gpt_chunks(moe_config(moe_layer_freq=2, qk_layernorm=True), norm, 64, 16)[0]
    assert expert_layers(model) == [True, False, True, False]
    assert all(layer.self_attention.q_layernorm is not None and type(layer.self_attention.q_layernorm).__name__
               == "TorchNorm" for layer in model.decoder.layers)
