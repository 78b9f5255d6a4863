"""The Post-Norm baseline is the original Transformer's x = Norm(x + Sublayer(x)), every sublayer."""

import torch

from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
from megatron_siamese.runtime.layout import Layout


def test_post_norm_layer_normalizes_after_each_residual_add(megatron_single_rank):
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
