"""The single-stream baselines on Megatron's TransformerLayer (single_stream.py): each scheme's
layers against its block written out by hand from the papers (and placement bugs planted to show
the comparison fails), Mix-LN at alpha 0 as Megatron's own Pre-Norm layer, HybridNorm's value
norm, and what the baselines refuse. (Their reference comparisons are in
test_reference_equivalence.py, their parallel layouts in test_check.py.)"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
from megatron_siamese.reference import functional
from megatron_siamese.reference.functional import mix_ln_post_layers, norm_placement
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.support import UnsupportedConfigError


@pytest.mark.stack_independent
def test_mix_ln_counts_floor_alpha_l_post_norm_layers():
    """The share's floor, with the product's binary error rounded away (0.3 * 10 is 3, not 2)."""
    assert [mix_ln_post_layers(layers, alpha) for layers, alpha in
            [(8, 0.25), (4, 0.25), (3, 0.25), (3, 0.5), (10, 0.3), (100, 0.29), (12, 0.0), (12, 1.0)]] == \
        [2, 1, 0, 1, 3, 29, 0, 12]
    with pytest.raises(ValueError, match="alpha must lie in"):
        mix_ln_post_layers(4, 1.5)
    with pytest.raises(ValueError, match="1-based and global"):
        norm_placement("mixln", 0, 4)


# -- each layer against its scheme's block, written out by hand ------------------------------
#
# The forms below are the papers' blocks (and their authors' code), with the layer's own weights
# read by name; nothing of them comes from norm_placement or the reference. For a layer input x
# (LN_slot: LayerNorm with that slot's weight and bias; Attn: causal multi-head attention with
# its projection biases; MLP: the layer's MLP, output bias included):
#
#   Post-Norm (Vaswani et al.):   h = LN_post_attn(x + Attn(x));       out = LN_post_mlp(h + MLP(h))
#   Pre-Norm:                     h = x + Attn(LN_input(x));           out = h + MLP(LN_pre_mlp(h))
#   HybridNorm (Zhuo et al. 2025, arXiv 2503.04598; authors' OLMo code: attn_norm False, ffn_norm
#   and ffn_residual_after_norm True, use_query/key/value_norm):
#                                 h = LN_post_attn(x + AttnQKV(x));    out = h + MLP(h)
#     AttnQKV: queries, keys and values each normalized per head (one head-width LayerNorm each,
#     shared by the heads) before the scores; no norm on the attention's input
#   HybridNorm*'s first layer (the authors' {0: {attn_norm: True, ffn_residual: False}}):
#                                 h = x + AttnQKV(LN_input(x));        out = h + MLP(LN_pre_mlp(h))
#   Mix-LN (Li et al. 2024, arXiv 2412.13795; authors' code: layer_index < POST_NUM is Post-LN):
#     Post-Norm in layers 1..floor(alpha L), Pre-Norm in the rest
#
# and the block ends in LN_final(out) for HybridNorm and Mix-LN, in out itself for Post-Norm.
# Positions are learned (no RoPE to write out).


class AbsentNorm(Exception):
    """The form needs a norm the layer does not have."""


def _layer_norm(module, t, what: str):
    """LayerNorm over the last dimension with ``module``'s weight and bias (the case's eps)."""
    weight = getattr(module, "weight", None)
    if weight is None:
        raise AbsentNorm(f"no {what}")
    return F.layer_norm(t, (t.shape[-1],), weight, module.bias, module.config.layernorm_epsilon)


def _norm(layer, slot: str, t):
    return _layer_norm(getattr(layer, slot), t, slot)


def _attention(layer, x, mask, qkv_norm: bool):
    """Megatron's fused QKV layout per query group [q heads of the group | k | v], by hand."""
    attention = layer.self_attention
    config = attention.config
    heads, groups, width = config.num_attention_heads, config.num_query_groups, config.kv_channels
    s, b, _ = x.shape
    qkv = F.linear(x, attention.linear_qkv.weight, attention.linear_qkv.bias)
    query, key, value = qkv.view(s, b, groups, (heads // groups + 2) * width).split(
        [heads // groups * width, width, width], dim=-1)
    query = query.reshape(s, b, heads, width)
    if qkv_norm:
        query = _layer_norm(attention.q_layernorm, query, "query norm")
        key = _layer_norm(attention.k_layernorm, key, "key norm")
        value = _layer_norm(attention.v_layernorm, value, "value norm")
    key, value = (t.repeat_interleave(heads // groups, dim=2) for t in (key, value))
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) / math.sqrt(width)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    context = torch.einsum("bnst,tbnd->sbnd", probs, value).reshape(s, b, heads * width)
    return F.linear(context, attention.linear_proj.weight, attention.linear_proj.bias)


def _mlp(layer, t):
    out, bias = layer.mlp(t)
    return out if bias is None else out + bias


def post_norm(layer, x, mask):
    h = _norm(layer, "post_attn_norm", x + _attention(layer, x, mask, qkv_norm=False))
    return _norm(layer, "post_mlp_norm", h + _mlp(layer, h))


def pre_norm(layer, x, mask, qkv_norm: bool = False):
    h = x + _attention(layer, _norm(layer, "input_layernorm", x), mask, qkv_norm)
    return h + _mlp(layer, _norm(layer, "pre_mlp_layernorm", h))


def hybrid_norm(layer, x, mask):
    h = _norm(layer, "post_attn_norm", x + _attention(layer, x, mask, qkv_norm=True))
    return h + _mlp(layer, h)


def hybrid_norm_star_first(layer, x, mask):
    return pre_norm(layer, x, mask, qkv_norm=True)


POST, PRE, HYBRID, HYBRID_FIRST = post_norm, pre_norm, hybrid_norm, hybrid_norm_star_first

# name -> (case, each layer's form, whether the block ends in a final norm)
HAND_FORMS = {
    "post": (dict(norm="post", num_layers=2), [POST] * 2, False),
    "hybridnorm": (dict(norm="hybridnorm", num_layers=3), [HYBRID] * 3, True),
    "hybridnorm-star": (dict(norm="hybridnorm", num_layers=3, hybridnorm_star=True), [HYBRID_FIRST, HYBRID, HYBRID],
                        True),
    # floor(0.25 * 4) = 1: the boundary between layers 1 and 2
    "mixln-4-quarter": (dict(norm="mixln", num_layers=4, mix_ln_alpha=0.25), [POST] + [PRE] * 3, True),
    # floor(0.5 * 4) = 2
    "mixln-4-half": (dict(norm="mixln", num_layers=4, mix_ln_alpha=0.5), [POST] * 2 + [PRE] * 2, True),
    # floor(0.5 * 3) = 1 (not 2: a floor, not a rounding)
    "mixln-3-half": (dict(norm="mixln", num_layers=3, mix_ln_alpha=0.5), [POST] + [PRE] * 2, True),
}
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _built(name):
    changes, forms, final_norm = HAND_FORMS[name]
    case = ModelCase(position_embedding_type="learned_absolute", **changes)
    (model,) = build_seeded_chunks(case, case_config(case, Layout()))
    assert len(model.decoder.layers) == len(forms)
    batch = microbatches(case)[0]
    return model, model.embedding(batch["tokens"], batch["position_ids"]), batch["attention_mask"], forms, final_norm


def layers_unlike_their_form(model, x, mask, forms) -> dict:
    """Layer index -> how it differs from its hand-written form, each layer and its form given the
    same input (the previous layer's own output)."""
    unlike = {}
    with torch.no_grad():
        for index, (layer, form) in enumerate(zip(model.decoder.layers, forms)):
            actual, _ = layer(x, attention_mask=mask)
            try:
                expected = form(layer, x, mask)
            except AbsentNorm as absent:
                unlike[index] = f"{form.__name__}: {absent}"
            else:
                if not torch.allclose(actual, expected, **TOLERANCE):
                    unlike[index] = f"{form.__name__}: off by {(actual - expected).abs().max().item():.3g}"
            x = actual
    return unlike


@pytest.mark.parametrize("name", sorted(HAND_FORMS))
def test_each_layer_computes_its_schemes_block_by_hand(megatron_single_rank, name):
    """Every layer of the model, Mix-LN's last Post-Norm layer and first Pre-Norm layer included,
    and HybridNorm*'s first layer against its later ones; then the whole block (its final norm)."""
    model, x, mask, forms, final_norm = _built(name)
    assert layers_unlike_their_form(model, x, mask, forms) == {}
    with torch.no_grad():
        expected = x
        for layer, form in zip(model.decoder.layers, forms):
            expected = form(layer, expected, mask)
        if final_norm:
            expected = _layer_norm(model.decoder.final_layernorm, expected, "final norm")
        hidden = model.decoder(x, mask)
    torch.testing.assert_close(hidden, expected, **TOLERANCE)


def _shift_mix_ln_boundary(by):
    def plant(monkeypatch):
        real = functional.mix_ln_post_layers
        monkeypatch.setattr(functional, "mix_ln_post_layers", lambda layers, alpha: real(layers, alpha) + by)
    return plant


def _hybrid_norm_on_the_ffn_side(monkeypatch):
    """The other reading of "Post-Norm in the FFN": Norm(h + FFN(h)), the attention's add unnormalized."""
    monkeypatch.setattr(functional, "HYBRID_NORM", functional.NormPlacement(
        attention_input=False, after_attention=False, mlp_input=False, after_mlp=True))


def _hybrid_norm_star_on_the_second_layer(monkeypatch):
    """A 0-based index taken for the 1-based layer number: HybridNorm*'s Pre-Norm layer is the second."""
    from megatron_siamese import single_stream

    real = single_stream.norm_placement
    monkeypatch.setattr(single_stream, "norm_placement", lambda scheme, number, *rest: real(
        scheme, {1: 2, 2: 1}.get(number, number), *rest))


def _post_norm_without_its_ffn_norm(monkeypatch):
    monkeypatch.setattr(functional, "POST_NORM", functional.NormPlacement(
        attention_input=False, after_attention=True, mlp_input=False, after_mlp=False))


PLANTED = {  # bug in the layers' placement -> (hand forms it shows in, the layers that differ)
    "mixln-boundary-one-later": (_shift_mix_ln_boundary(+1), "mixln-4-half", [2]),
    "mixln-boundary-one-earlier": (_shift_mix_ln_boundary(-1), "mixln-4-half", [1]),
    "hybridnorm-norm-after-the-ffn": (_hybrid_norm_on_the_ffn_side, "hybridnorm", [0, 1, 2]),
    "hybridnorm-star-second-layer": (_hybrid_norm_star_on_the_second_layer, "hybridnorm-star", [0, 1]),
    "post-no-ffn-norm": (_post_norm_without_its_ffn_norm, "post", [0, 1]),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_hand_written_forms_catch_a_planted_placement_bug(megatron_single_rank, monkeypatch, bug):
    plant, name, unlike = PLANTED[bug]
    plant(monkeypatch)
    model, x, mask, forms, _ = _built(name)
    assert sorted(layers_unlike_their_form(model, x, mask, forms)) == unlike


def test_post_norm_leaves_the_block_normalized(megatron_single_rank):
    """The stream leaving the block is the last LayerNorm's output: undoing its affine leaves every
    token with mean 0 and variance 1 (the block's own final norm is identity)."""
    model, x, mask, _, _ = _built("post")
    with torch.no_grad():
        hidden = model.decoder(x, mask)
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
