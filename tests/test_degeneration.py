"""Zeroing one branch's norm weights degenerates SiameseNorm, exactly (fp64), into:

* zero X (every PostNorm and NormX) -> stock Pre-Norm. The X stream never reaches a sublayer
  input, so every sublayer sees InputNorm(PreNorm(y)) and the output is FinalNorm(NormY(y)). With
  PreNorm and NormY plain (gamma 1, beta 0) that is InputNorm(Norm(y)), which equals stock
  InputNorm(y) exactly at eps = 0 (a normalized vector normalizes to itself) and up to
  O(eps / variance) otherwise: at the default eps = 1e-5 the seeded embeddings have variance ~0.03,
  each double normalization moves activations by ~eps / (2 * 0.03) ~ 2e-4 relative, and over
  8 sublayers and the merge the fp32 logits (|max| ~ 3) moved by 1.6e-3 when measured, checked
  against 2e-3.
* zero Y (every PreNorm and NormY) -> a Post-Norm X stream (``post_norm_x_stream``);
* zero Y in the first m layers and X in the rest (and NormX) -> Post-Norm layers then Pre-Norm
  layers, Mix-LN's shape (``post_then_pre_norm``), but not Mix-LN's function.

Zero X holds with multi-token prediction too: the MTP layers are Megatron's stock Pre-Norm ones
in both models, fed the decoder's output (FinalNorm(NormY(y)) here, FinalNorm(y) there), so the
degenerate model is Megatron's Pre-Norm GPT with MTP as Megatron-LM builds it, every head's logits,
loss and every gradient.

docs/research.md ("Degenerations") derives the last two. Each test also plants a fault (a norm
left unzeroed, the depth scale dropped, an MTP weight not copied) and sees the comparison fail.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron_siamese.models import build_gpt_chunks, get_pre_norm_block_spec
from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
from megatron_siamese.reference.functional import single_stream_sublayer
from reference_model.gpt import ReferenceGPT, ReferenceGPTConfig, ReferenceNorm, megatron_to_reference_names
from megatron_siamese.runtime.gpt import transformer_config
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.check.sharding import seed_parameters

EXACT = dict(rtol=0.0, atol=1e-12)  # fp64: rounding only


def stock_pre_norm(case, config, spec=None):
    """Megatron's Pre-Norm GPT; with ``mtp_num_layers`` its MTP block as Megatron-LM's GPT builder
    makes it from the decoder's spec."""
    spec = spec or get_gpt_layer_local_spec(normalization=config.normalization)
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    model = GPTModel(
        config,
        spec,
        vocab_size=case.vocab_size,
        max_sequence_length=case.seq_length,
        position_embedding_type=case.position_embedding_type,
        share_embeddings_and_output_weights=case.share_embeddings_and_output_weights,
        mtp_block_spec=mtp_spec,
    )
    seed_parameters([model], case.seed, 0, 1, case.zero_centered_gamma)
    return model.to(config.params_dtype)


def degenerate_siamese_from(stock, case, config):
    """A SiameseNorm model with stock's weights, X-branch norms zero, Y-branch norms plain."""
    (siamese,) = build_gpt_chunks(
        config, case.norm, case.vocab_size, case.seq_length,
        case.position_embedding_type, case.share_embeddings_and_output_weights,
    )
    siamese.to(config.params_dtype)
    shared = stock.state_dict()
    state = siamese.state_dict()
    for name, tensor in state.items():
        if name.endswith("_extra_state"):  # Megatron's per-module extra state, None here
            continue
        if name in shared:  # embeddings, attention (QK-norms too), MLP or router and experts, InputNorms,
            # FinalNorm, the MTP layers
            tensor.copy_(shared[name])
        elif "x_norm." in name:  # PostNorm of every sublayer and NormX of the merge
            tensor.zero_()
        elif "y_norm." in name:  # PreNorm of every sublayer and NormY: gamma 1, beta 0
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            raise AssertionError(f"unexpected SiameseNorm-only parameter {name}")
    siamese.load_state_dict(state)
    return siamese


def fp64(case, **changes):
    """The case's config in fp64 (positions learned: RoPE's angles are fp32 in Megatron)."""
    return dataclasses.replace(case_config(case, Layout()), params_dtype=torch.float64, **changes)


@torch.no_grad()
def logits_of(model, batch):
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"])


def assert_exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=EXACT["rtol"],
                               atol=EXACT["atol"] * float(expected.abs().max()))


def far(actual, expected) -> bool:
    """Far outside fp64 rounding: what a planted fault must do to the logits."""
    return float((actual - expected).abs().max()) > 1e6 * EXACT["atol"] * float(expected.abs().max())


@pytest.mark.parametrize("norm", ["siamese", "siamese-layer"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_x_branch_is_stock_pre_norm_exactly(megatron_single_rank, norm, normalization):
    """fp64, eps = 0: the degenerate SiameseNorm model is Megatron's own Pre-Norm GPT; with the
    merge's NormX left unzeroed (the planted fault) it is not."""
    case = ModelCase(norm=norm, normalization=normalization, position_embedding_type="learned_absolute")
    config = fp64(case, layernorm_epsilon=0.0)
    stock = stock_pre_norm(case, config)
    siamese = degenerate_siamese_from(stock, case, config)
    batch = microbatches(case)[0]
    expected = logits_of(stock, batch)
    assert_exact(logits_of(siamese, batch), expected)
    merge = siamese.decoder.final_layernorm.merge if norm == "siamese" else siamese.decoder.layers[-1].output_merge
    with torch.no_grad():
        merge.x_norm.weight.fill_(1.0)
    assert far(logits_of(siamese, batch), expected)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_x_branch_at_the_default_eps_is_pre_norm_up_to_the_double_normalization(megatron_single_rank,
                                                                                         normalization):
    case = ModelCase(normalization=normalization)
    config = case_config(case, Layout())  # fp32, eps 1e-5
    stock = stock_pre_norm(case, config)
    siamese = degenerate_siamese_from(stock, case, config)
    batch = microbatches(case)[0]
    expected = logits_of(stock, batch)
    torch.testing.assert_close(logits_of(siamese, batch), expected, rtol=2e-3, atol=2e-3)
    # and the comparison has teeth: the undegenerate model is far from Pre-Norm
    seed_parameters([siamese], case.seed, 0, 1, case.zero_centered_gamma)
    assert (logits_of(siamese, batch) - expected).abs().max() > 0.2


@pytest.mark.parametrize("changes", [
    dict(qk_layernorm=True),
    dict(num_moe_experts=4, moe_layer_freq="[0,1,1,0]", moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32),
    dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=1, moe_router_pre_softmax=True, qk_layernorm=True),
], ids=["qk-layernorm", "moe-mixed-layers-shared-expert", "moe-top1-qk-layernorm"])
def test_zero_x_branch_is_stock_pre_norm_with_qk_norm_and_experts(megatron_single_rank, changes):
    """Megatron's own decoder block (QK-norm, MoE layers where moe_layer_freq puts them) is what
    the degenerate SiameseNorm block computes: the router, like the experts, sees InputNorm(y)."""
    settings = {name: value for name, value in changes.items() if name in ModelCase.__dataclass_fields__}
    case = ModelCase(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="learned_absolute",
                     **settings)
    config = transformer_config(case, Layout(), layernorm_epsilon=0.0, params_dtype=torch.float64,
                                **{name: value for name, value in changes.items() if name not in settings})
    stock = stock_pre_norm(case, config, get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                                    normalization=config.normalization))
    siamese = degenerate_siamese_from(stock, case, config)
    batch = microbatches(case)[0]
    expected = logits_of(stock, batch)
    assert_exact(logits_of(siamese, batch), expected)
    seed_parameters([siamese], case.seed, 0, 1, case.zero_centered_gamma)
    assert far(logits_of(siamese, batch), expected)


# -- zero X with multi-token prediction ---------------------------------------------------------

# MLA the size of the tiny model (no GQA: a key/value head per query head), latent norms and a
# query latent, plain RoPE
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=8, num_query_groups=None, qk_layernorm=True, rope_type="rope")
MTP_CASES = {
    "mtp-1-layernorm": dict(mtp_num_layers=1),
    "mtp-2-rmsnorm-untied": dict(mtp_num_layers=2, normalization="RMSNorm", share_embeddings_and_output_weights=False),
    "mla-mtp-2-rmsnorm": dict(MLA, mtp_num_layers=2, normalization="RMSNorm"),
}
# Megatron's cross-entropy casts the logits to fp32: its losses agree to fp32's rounding
FP32_LOSS = dict(rtol=0.0, atol=4 * torch.finfo(torch.float32).eps)


def stock_pre_norm_with_mtp(case, config):
    """Megatron's Pre-Norm GPT with MTP as Megatron-LM builds it; with MLA from the layers the
    package builds stock baselines of (``specs.local_stock_layer``: Megatron's local core attention
    takes no MLA head sizes), the MTP block still Megatron's."""
    return stock_pre_norm(case, config, get_pre_norm_block_spec(config) if config.multi_latent_attention else None)


def heads_and_losses(model, batch, monkeypatch):
    """A forward with labels: every output-layer call (the main logits, then each MTP depth's,
    [s, b, v]), Megatron's per-token main loss [b, s] and each depth's MTP loss as GPTModel hands
    it to MTPLossAutoScaler (scaled per token: mtp_loss_scaling_factor / D * mask * CE / num_tokens)."""
    heads, mtp_losses = [], []
    attach = MTPLossAutoScaler.apply

    def recording(hidden, mtp_loss):
        mtp_losses.append(mtp_loss)
        return attach(hidden, mtp_loss)

    monkeypatch.setattr(MTPLossAutoScaler, "apply", recording)
    hook = model.output_layer.register_forward_hook(lambda module, inputs, output: heads.append(output[0]))
    try:
        loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                     loss_mask=batch["loss_mask"])
    finally:
        hook.remove()
        monkeypatch.setattr(MTPLossAutoScaler, "apply", attach)
    assert len(heads) == len(mtp_losses) + 1 == model.config.mtp_num_layers + 1
    return heads[-1:] + heads[:-1], loss, mtp_losses  # Megatron calls the main head last


def fp64_objective(heads, labels, config):
    """The training objective in fp64 from the heads' logits: the main cross-entropy plus
    mtp_loss_scaling_factor times the depths' mean, depth k predicting the token k further."""
    main, *depths = heads
    targets = labels.t()  # [s, b], as the logits
    total = F.cross_entropy(main.flatten(0, 1), targets.flatten())
    for k, logits in enumerate(depths, start=1):
        total = total + config.mtp_loss_scaling_factor / len(depths) * F.cross_entropy(
            logits[:-k].flatten(0, 1), targets[k:].flatten())
    return total


def shared_gradients(stock, siamese, objectives):
    """Each weight's gradient in both models (the stock model's names: SiameseNorm's stream norms are its own)."""
    for model, objective in zip((stock, siamese), objectives):
        model.zero_grad(set_to_none=True)
        objective.backward()
    ours = dict(siamese.named_parameters())
    return {name: (ours[name].grad, param.grad) for name, param in stock.named_parameters()}


@pytest.mark.parametrize("norm", ["siamese", "siamese-layer"])
@pytest.mark.parametrize("changes", list(MTP_CASES.values()), ids=list(MTP_CASES))
def test_zero_x_branch_is_stock_pre_norm_with_mtp_exactly(megatron_single_rank, monkeypatch, norm, changes):
    """fp64, eps = 0: the main and every MTP depth's logits, Megatron's per-token losses and every
    gradient of the training objective are the stock Pre-Norm + MTP GPT's. Planted faults: the
    MTP input detached from the decoder moves the decoder's gradients only, an MTP layer's weight
    not copied its depth's logits only, the merge's NormX left unzeroed every head's."""
    case = ModelCase(norm=norm, position_embedding_type="learned_absolute", mtp_loss_scaling_factor=0.3, **changes)
    config = fp64(case, layernorm_epsilon=0.0)
    stock = stock_pre_norm_with_mtp(case, config)
    siamese = degenerate_siamese_from(stock, case, config)
    assert len(siamese.mtp.layers) == len(stock.mtp.layers) == case.mtp_num_layers
    if case.multi_latent_attention:
        for model in (stock, siamese):
            assert type(model.decoder.layers[0].self_attention).__name__ == "LocalMLASelfAttention"
    batch = microbatches(case)[0]
    # gradients of the fp64 objective only: Megatron's own (fp32) MTP losses, whose gradient
    # MTPLossAutoScaler attaches in backward, scaled to nothing
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.0, dtype=torch.float64))

    def objective(heads):
        return fp64_objective(heads, batch["labels"], config)

    expected, expected_loss, expected_mtp = heads_and_losses(stock, batch, monkeypatch)
    heads, loss, mtp_losses = heads_and_losses(siamese, batch, monkeypatch)
    for head, expected_head in zip(heads, expected):
        assert_exact(head.detach(), expected_head.detach())
    for actual, wanted in zip([loss, *mtp_losses], [expected_loss, *expected_mtp]):
        torch.testing.assert_close(actual.detach(), wanted.detach(), rtol=FP32_LOSS["rtol"],
                                   atol=FP32_LOSS["atol"] * float(wanted.detach().abs().max()))
    gradients = shared_gradients(stock, siamese, [objective(expected), objective(heads)])
    for name, (grad, expected_grad) in gradients.items():
        assert expected_grad is not None and expected_grad.abs().max() > 0, f"{name} got no gradient"
        assert grad is not None, f"{name}: no gradient in the SiameseNorm model"
        assert_exact(grad, expected_grad)

    # planted: the first MTP layer's input from the decoder detached: the same logits, but the
    # decoder no longer learns from the MTP losses
    hook = siamese.mtp.layers[0].hnorm.register_forward_pre_hook(lambda module, args: (args[0].detach(),))
    heads = heads_and_losses(siamese, batch, monkeypatch)[0]
    hook.remove()
    expected = heads_and_losses(stock, batch, monkeypatch)[0]  # a graph to differentiate again
    for head, expected_head in zip(heads, expected):
        assert_exact(head.detach(), expected_head.detach())
    gradients = shared_gradients(stock, siamese, [objective(expected), objective(heads)])
    assert far(*gradients["decoder.layers.0.mlp.linear_fc2.weight"])

    with torch.no_grad():
        # planted: the last MTP layer's input projection left as built (not copied)
        projection = siamese.mtp.layers[-1].eh_proj.weight
        copied = projection.clone()
        projection.copy_(0.02 * torch.randn(projection.shape, generator=torch.Generator().manual_seed(7),
                                            dtype=projection.dtype))
        heads = heads_and_losses(siamese, batch, monkeypatch)[0]
        for head, expected_head in zip(heads[:-1], expected[:-1]):  # the heads before it still agree
            assert_exact(head, expected_head.detach())
        assert far(heads[-1], expected[-1].detach())
        projection.copy_(copied)
        # planted: the merge's NormX left unzeroed (X reaches the main head and every MTP layer's input)
        merge = siamese.decoder.final_layernorm.merge if norm == "siamese" else siamese.decoder.layers[-1].output_merge
        merge.x_norm.weight.fill_(1.0)
        heads = heads_and_losses(siamese, batch, monkeypatch)[0]
        assert all(far(head, expected_head.detach()) for head, expected_head in zip(heads, expected))


# -- zero Y: the X stream alone ------------------------------------------------------------


def siamese_pair(case, config):
    """The seeded fp64 Megatron SiameseNorm model and a reference whose modules the expected
    functions below are built of (loaded from the model after its norms are zeroed: ``reload``)."""
    (model,) = build_seeded_chunks(case, config)
    model.to(torch.float64)
    reference = ReferenceGPT(ReferenceGPTConfig.from_megatron(
        config, case.vocab_size, case.seq_length, position_embedding_type=case.position_embedding_type,
        share_embeddings_and_output_weights=case.share_embeddings_and_output_weights)).to(torch.float64)
    return model, reference


def reload(reference, model):
    reference.load_megatron_state_dict(model.state_dict())


def zero(*norms):
    with torch.no_grad():
        for norm in norms:
            for param in norm.parameters():
                param.zero_()


def sublayers(reference, rope=None):
    """Per sublayer, in order: (PostNorm, PreNorm, InputNorm or None, the sublayer as (out, bias), c)."""
    found = []
    for layer in reference.decoder.layers:
        attention = (lambda normed, _a=layer.self_attention: _a(normed, rope))
        found.append((layer.attn_x_norm, layer.attn_y_norm, layer.input_layernorm, attention, layer.depth_scale))
        found.append((layer.mlp_x_norm, layer.mlp_y_norm, layer.pre_mlp_layernorm, layer.mlp, layer.depth_scale))
    return found


def scaled(sublayer, factor):
    """The sublayer with its output and bias times ``factor`` (the residual branch z / c)."""
    def call(normed):
        out, bias = sublayer(normed)
        return out * factor, None if bias is None else bias * factor
    return call


def head(reference, hidden):
    final = reference.decoder.final_layernorm
    out = ReferenceNorm.forward(final, hidden)  # FinalNorm itself (its forward merges first)
    weight = reference.embedding.word_embeddings.weight if reference.output_layer is None else reference.output_layer.weight
    return out @ weight.t()


@torch.no_grad()
def post_norm_x_stream(reference, batch):
    """Zero Y, what the model computes: Post-Norm over the normalized embedding,

        v = PostNorm_1(e);  v = PostNorm_{k+1}(v + F_k(InputNorm_k(v)) / c_k)  for every sublayer k,

    the norm after sublayer k being sublayer k+1's PostNorm and after the last one NormX, then
    FinalNorm. (An absent InputNorm, the ablation, makes each step Post-Norm's Norm(v + F(v)/c).)"""
    steps = sublayers(reference)
    after = [post for post, *_ in steps[1:]] + [reference.decoder.final_layernorm.merge.x_norm]
    v = steps[0][0](reference.embedding(batch["tokens"], batch["position_ids"]))
    for (_, _, input_norm, sublayer, c), output_norm in zip(steps, after):
        v = single_stream_sublayer(v, input_norm, scaled(sublayer, 1.0 / c), output_norm)
    return head(reference, v)


@pytest.mark.parametrize("normalization, input_norm", [("LayerNorm", True), ("RMSNorm", False)],
                         ids=["layernorm", "rmsnorm-without-input-norm"])
def test_zero_y_branch_is_a_post_norm_x_stream(megatron_single_rank, normalization, input_norm):
    case = ModelCase(normalization=normalization, position_embedding_type="learned_absolute",
                     siamese_input_norm=input_norm)
    model, reference = siamese_pair(case, fp64(case))
    for layer in model.decoder.layers:
        zero(layer.attn_y_norm, layer.mlp_y_norm)
    zero(model.decoder.final_layernorm.merge.y_norm)
    reload(reference, model)
    batch = microbatches(case)[0]
    expected = post_norm_x_stream(reference, batch)
    assert_exact(logits_of(model, batch), expected)
    # planted: the merge's NormY left as seeded (y leaks into the output), or no depth scale
    with torch.no_grad():
        model.decoder.final_layernorm.merge.y_norm.weight.fill_(1.0)
    assert far(logits_of(model, batch), expected)
    zero(model.decoder.final_layernorm.merge.y_norm)
    for layer in model.decoder.layers:
        layer.depth_scale = 1.0
    assert far(logits_of(model, batch), expected)


# -- zero Y in the first layers, X in the rest: Post-Norm then Pre-Norm ---------------------------


@torch.no_grad()
def post_then_pre_norm(reference, batch, post_layers: int):
    """Zero Y in the first ``post_layers`` layers and X in the rest (and NormX), what the model
    computes: the Post-Norm X stream of ``post_norm_x_stream`` through those layers, whose
    sublayer outputs z also accumulate on the Y stream (y = e + sum z); from there Pre-Norm on y,
    each sublayer's input normalized by InputNorm(PreNorm(y)), without a depth scale; then
    FinalNorm(NormY(y)). Mix-LN's Pre-Norm layers would continue from the Post-Norm layers' output
    instead of e + sum z."""
    steps = sublayers(reference)
    post_steps, pre_steps = steps[:2 * post_layers], steps[2 * post_layers:]
    e = reference.embedding(batch["tokens"], batch["position_ids"])
    x, y = e, e
    for post, _, input_norm, sublayer, c in post_steps:
        u = post(x)
        out, bias = sublayer(u if input_norm is None else input_norm(u))
        z = out if bias is None else out + bias
        x, y = u + z / c, y + z
    for _, pre, input_norm, sublayer, _ in pre_steps:
        y = single_stream_sublayer(y, lambda t, _pre=pre, _in=input_norm: _in(_pre(t)), sublayer, None)
    return head(reference, reference.decoder.final_layernorm.merge.y_norm(y))


def test_zero_y_then_zero_x_is_post_norm_then_pre_norm(megatron_single_rank):
    case = ModelCase(normalization="LayerNorm", position_embedding_type="learned_absolute")
    model, reference = siamese_pair(case, fp64(case))
    post_layers = 2
    for index, layer in enumerate(model.decoder.layers):
        zero(*((layer.attn_y_norm, layer.mlp_y_norm) if index < post_layers else (layer.attn_x_norm, layer.mlp_x_norm)))
    zero(model.decoder.final_layernorm.merge.x_norm)
    reload(reference, model)
    batch = microbatches(case)[0]
    expected = post_then_pre_norm(reference, batch, post_layers)
    assert_exact(logits_of(model, batch), expected)
    # planted: the first Pre-Norm layer's PostNorm left unzeroed (the X stream leaks in there)
    with torch.no_grad():
        model.decoder.layers[post_layers].attn_x_norm.weight.fill_(1.0)
    assert far(logits_of(model, batch), expected)
