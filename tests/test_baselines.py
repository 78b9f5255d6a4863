"""The single-stream baselines on Megatron's TransformerLayer (single_stream.py): where each
scheme puts its norms, Post-Norm's hand computation, Mix-LN at alpha 0 as Megatron's own Pre-Norm
layer, HybridNorm's value norm, and what the baselines refuse. (Their reference comparisons are in
test_reference_equivalence.py, their parallel layouts in test_check.py.)"""

import re

import pytest
import torch

from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
from megatron_siamese.reference.functional import (
    HYBRID_NORM,
    POST_NORM,
    PRE_NORM,
    mix_ln_post_layers,
    norm_placement,
)
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.support import UnsupportedConfigError


@pytest.mark.stack_independent
def test_each_scheme_places_its_norms_by_the_global_layer_number():
    assert [mix_ln_post_layers(layers, alpha) for layers, alpha in
            [(8, 0.25), (4, 0.25), (3, 0.25), (10, 0.3), (100, 0.29), (12, 0.0), (12, 1.0)]] == [2, 1, 0, 3, 29, 0, 12]
    assert [norm_placement("mixln", n, 8) for n in range(1, 9)] == [POST_NORM] * 2 + [PRE_NORM] * 6
    assert [norm_placement("mixln", n, 4, mix_ln_alpha=0.5) for n in range(1, 5)] == [POST_NORM] * 2 + [PRE_NORM] * 2
    assert [norm_placement("hybridnorm", n, 3) for n in range(1, 4)] == [HYBRID_NORM] * 3
    assert [norm_placement("hybridnorm", n, 3, hybridnorm_star=True) for n in range(1, 4)] == [PRE_NORM] + [HYBRID_NORM] * 2
    assert {norm_placement("post", n, 3) for n in range(1, 4)} == {POST_NORM}
    with pytest.raises(ValueError, match="alpha must lie in"):
        mix_ln_post_layers(4, 1.5)
    with pytest.raises(ValueError, match="1-based and global"):
        norm_placement("mixln", 0, 4)


def test_post_norm_layer_normalizes_after_each_residual_add(megatron_single_rank):
    """The original Transformer's x = Norm(x + Sublayer(x)), every sublayer, by hand."""
    case = ModelCase(norm="post", position_embedding_type="learned_absolute")
    (model,) = build_seeded_chunks(case, case_config(case, Layout()))
    batch = microbatches(case)[0]
    mask = batch["attention_mask"]
    x = model.embedding(batch["tokens"], batch["position_ids"])
    expected = x
    for layer in model.decoder.layers:
        attention, attention_bias = layer.self_attention(expected, mask)
        expected = layer.post_attn_norm(expected + attention + attention_bias)
        mlp, mlp_bias = layer.mlp(expected)
        expected = layer.post_mlp_norm(expected + mlp + mlp_bias)
    hidden = model.decoder(x, mask)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    # the stream leaving the block is the last LayerNorm's output: undoing its affine leaves
    # every token with mean 0 and variance 1 (the block's own final norm is identity)
    norm = model.decoder.layers[-1].post_mlp_norm
    standardized = (hidden - norm.bias) / norm.weight
    torch.testing.assert_close(standardized.mean(-1), torch.zeros(hidden.shape[:-1]), rtol=0, atol=1e-4)
    torch.testing.assert_close(standardized.var(-1, unbiased=False), torch.ones(hidden.shape[:-1]),
                               rtol=0, atol=1e-3)


def test_mix_ln_at_alpha_zero_is_megatrons_own_pre_norm_layer(megatron_single_rank):
    """Every layer Pre-Norm: the baseline's own hooks compute what Megatron's stock layer does, the
    same parameters (names included), logits and gradients."""
    def logits_and_grads(norm, **changes):
        case = ModelCase(norm=norm, **changes)
        (model,) = build_seeded_chunks(case, case_config(case, Layout()))
        batch = microbatches(case)[0]
        logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        logits.square().mean().backward()
        return logits.detach(), {name: p.grad for name, p in model.named_parameters()}

    pre_logits, pre_grads = logits_and_grads("pre")
    mixln_logits, mixln_grads = logits_and_grads("mixln", mix_ln_alpha=0.0)
    torch.testing.assert_close(mixln_logits, pre_logits, rtol=0, atol=0)
    assert mixln_grads.keys() == pre_grads.keys()
    for name, grad in pre_grads.items():
        torch.testing.assert_close(mixln_grads[name], grad, rtol=0, atol=0, msg=name)


def test_the_value_norm_sums_its_gradient_in_the_backward_and_stays_a_leaf(megatron_single_rank):
    """Its weights pass copy_to_tensor_model_parallel_region (an all-reduce in the backward under
    TP): the Parameters themselves stay leaves with gradients. (Not summed twice under SP: the
    check's tp2-sp layouts.)"""
    case = ModelCase(norm="hybridnorm")
    (model,) = build_seeded_chunks(case, case_config(case, Layout()))
    batch = microbatches(case)[0]
    model(batch["tokens"], batch["position_ids"], batch["attention_mask"]).sum().backward()
    norms = [layer.self_attention.v_layernorm for layer in model.decoder.layers]
    assert all(p.grad_fn is None and p.grad is not None and p.grad.abs().max() > 0
               for norm in norms for p in norm.parameters())


@pytest.mark.parametrize("scheme", ["post", "hybridnorm", "mixln"])
@pytest.mark.parametrize("changes, says", [
    (dict(fine_grained_activation_offloading=True), "fine_grained_activation_offloading offloads the stock hooks'"),
    (dict(cuda_graph_impl="local"), "CUDA graphs (cuda_graph_impl='local') have not captured"),
    (dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm would move"),
], ids=["offloading", "cuda-graphs", "post-layernorm-residual"])
def test_the_baselines_refuse_what_their_own_hooks_do_not_do(megatron_single_rank, scheme, changes, says):
    from megatron_siamese.single_stream import get_single_stream_block_spec

    case = ModelCase(norm=scheme)
    config = case_config(case, Layout())
    for name, value in changes.items():  # after construction: Megatron checks some of them itself
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=rf"the {scheme} baseline cannot build this layer:\n- "
                                                     + re.escape(says)):
        get_single_stream_block_spec(config, scheme=scheme)
