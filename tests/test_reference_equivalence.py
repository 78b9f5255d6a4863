"""The Megatron model (TP=1, PP=1) computes exactly the reference GPT's function and gradients."""

import dataclasses

import pytest
import torch

from megatron_siamese.models import build_gpt_chunks
from megatron_siamese.reference.gpt import (
    ReferenceGPT,
    ReferenceGPTConfig,
    megatron_to_reference_names,
)
from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
from megatron_siamese.runtime.layout import Layout

FP32 = dict(rtol=1e-5, atol=1e-6)


def assert_close_fp32(actual, expected, name=""):
    """fp32 agreement: rtol 1e-5, atol 1e-6 scaled to the tensor's magnitude when above 1
    (rounding error grows with the values summed, not with each element)."""
    atol = FP32["atol"] * max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, rtol=FP32["rtol"], atol=atol,
                               msg=lambda m: f"{name}: {m}" if name else m)

VARIANTS = {
    "layernorm-swiglu-rope-tied": ModelCase(),
    "rmsnorm-swiglu-rope-tied": ModelCase(normalization="RMSNorm"),
    "layernorm-gelu-learned-untied": ModelCase(
        gated_linear_unit=False,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False,
    ),
    "rmsnorm-zero-centred-nobias-mha": ModelCase(
        normalization="RMSNorm",
        zero_centered_gamma=True,
        add_bias_linear=False,
        num_query_groups=4,
    ),
    "layer-spec-layernorm": ModelCase(norm="siamese-layer"),
    "hybrid-layernorm": ModelCase(norm="siamese-hybrid"),
    "hybrid-rmsnorm-gelu-learned": ModelCase(
        norm="siamese-hybrid", normalization="RMSNorm", gated_linear_unit=False,
        position_embedding_type="learned_absolute",
    ),
    "layer-spec-rmsnorm-gelu": ModelCase(
        norm="siamese-layer", normalization="RMSNorm", gated_linear_unit=False
    ),
}


def build_pair(case: ModelCase):
    config = case_config(case, Layout())
    (model,) = build_seeded_chunks(case, config)
    reference = ReferenceGPT(
        ReferenceGPTConfig.from_megatron(
            config,
            case.vocab_size,
            case.seq_length,
            position_embedding_type=case.position_embedding_type,
            share_embeddings_and_output_weights=case.share_embeddings_and_output_weights,
            variant="hybrid" if case.norm == "siamese-hybrid" else "standard",
        )
    )
    reference.load_megatron_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("fused", [False, True], ids=["pytorch", "fused"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_match_reference(megatron_single_rank, variant, fused):
    case = dataclasses.replace(VARIANTS[variant], fused_ops=fused)
    model, reference = build_pair(case)
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])

    logits = model(*args)
    expected = reference(batch["tokens"], batch["position_ids"])
    assert_close_fp32(logits, expected, "logits")

    model(*args, labels=batch["labels"]).mean().backward()
    reference.loss(batch["tokens"], batch["labels"], batch["position_ids"]).mean().backward()
    grads = megatron_to_reference_names(
        {name: p.grad for name, p in model.named_parameters()}, case.num_layers
    )
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().max() > 0, f"{name} got no gradient"
        assert_close_fp32(grad, reference_grads[name], name)


@pytest.mark.parametrize("variant", ["hybrid-layernorm", "hybrid-rmsnorm-gelu-learned"])
def test_hybrid_fused_and_pytorch_paths_agree(megatron_single_rank, monkeypatch, variant):
    """The hybrid variant on the fused ops runs hybrid_dual_norm for every attention sublayer
    (and dual_norm for every MLP one) and computes the PyTorch path's logits and gradients."""
    from megatron_siamese.ops import fused as fused_ops

    calls = {"dual_norm": 0, "hybrid_dual_norm": 0}
    for name in calls:
        op = getattr(fused_ops, name)

        def counted(*args, _op=op, _name=name):
            calls[_name] += 1
            return _op(*args)

        monkeypatch.setattr(fused_ops, name, counted)

    def logits_and_grads(fused):
        case = dataclasses.replace(VARIANTS[variant], fused_ops=fused)
        (model,) = build_seeded_chunks(case, case_config(case, Layout()))
        batch = microbatches(case)[0]
        args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
        logits = model(*args)
        model(*args, labels=batch["labels"]).mean().backward()
        return logits.detach(), {name: p.grad for name, p in model.named_parameters()}, case

    logits, grads, case = logits_and_grads(fused=False)
    assert calls == {"dual_norm": 0, "hybrid_dual_norm": 0}
    fused_logits, fused_grads, _ = logits_and_grads(fused=True)
    assert calls == {"dual_norm": 2 * case.num_layers, "hybrid_dual_norm": 2 * case.num_layers}  # 2 forwards
    assert_close_fp32(fused_logits, logits, "logits")
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert_close_fp32(fused_grads[name], grad, name)
    channel_scales = [name for name in grads if "attn_x_norm" in name]  # c1 of every layer
    assert len(channel_scales) == case.num_layers and all(fused_grads[name].abs().max() > 0 for name in channel_scales)


def test_reference_depth_scale_uses_one_based_layer_number():
    config = ReferenceGPTConfig(vocab_size=8, max_sequence_length=4, num_layers=3,
                                hidden_size=8, num_attention_heads=2)
    scales = [layer.depth_scale for layer in ReferenceGPT(config).decoder.layers]
    assert scales == pytest.approx([2 ** 0.5, 4 ** 0.5, 6 ** 0.5])


@pytest.mark.parametrize("fused", [False, True], ids=["pytorch", "fused"])
def test_dropout_mask_is_shared_by_both_streams(megatron_single_rank, fused):
    """With dropout on, y' - y must equal c * (x' - u): the same z reached both streams."""
    case = dataclasses.replace(ModelCase(), num_layers=1, fused_ops=fused)
    config = dataclasses.replace(case_config(case, Layout()), hidden_dropout=0.5)
    (model,) = build_gpt_chunks(config, "siamese", case.vocab_size, case.seq_length)
    layer = model.decoder.layers[0]
    layer.train()
    x = torch.randn(case.seq_length, 2, case.hidden_size)
    packed, _ = layer._forward_attention(x, attention_mask=microbatches(case)[0]["attention_mask"])
    x_new, y_new = packed.split(case.hidden_size, dim=-1)
    u = layer.attn_x_norm(x)
    z = y_new - x
    assert (z == 0).float().mean() > 0.2, "dropout did not drop anything"
    assert_close_fp32(x_new, u + z / layer.depth_scale)
