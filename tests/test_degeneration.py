"""Zeroing the X branch's norms (every PostNorm and NormX) turns SiameseNorm into stock Pre-Norm.

With PostNorm = 0 the X stream never reaches a sublayer input, so every sublayer sees
InputNorm(PreNorm(y)) and the output is FinalNorm(NormY(y)). With PreNorm and NormY set to
plain normalization (gamma 1, beta 0) that is InputNorm(Norm(y)), which equals stock
InputNorm(y) up to the norm epsilon (normalizing an already-normalized vector changes it
by O(eps / variance)), so the exact comparison uses a tiny epsilon. At the default
eps = 1e-5 the seeded embeddings have variance ~0.03, so each double normalization moves
activations by ~eps / (2 * 0.03) ~ 2e-4 relative; over 8 sublayers and the merge the
logits (|max| ~ 3) moved by 1.6e-3 when measured, checked against 2e-3.
"""

import dataclasses

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

from megatron_siamese.models import build_gpt_chunks
from megatron_siamese.check.step import ModelCase, case_config, microbatches
from megatron_siamese.runtime.gpt import transformer_config
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.check.sharding import seed_parameters

def stock_pre_norm(case, config, spec=None):
    model = GPTModel(
        config,
        spec or get_gpt_layer_local_spec(normalization=config.normalization),
        vocab_size=case.vocab_size,
        max_sequence_length=case.seq_length,
        position_embedding_type=case.position_embedding_type,
        share_embeddings_and_output_weights=case.share_embeddings_and_output_weights,
    )
    seed_parameters([model], case.seed, 0, 1, case.zero_centered_gamma)
    return model


def degenerate_siamese_from(stock, case, config):
    """A SiameseNorm model with stock's weights, X-branch norms zero, Y-branch norms plain."""
    (siamese,) = build_gpt_chunks(
        config, case.norm, case.vocab_size, case.seq_length,
        case.position_embedding_type, case.share_embeddings_and_output_weights,
    )
    shared = stock.state_dict()
    state = siamese.state_dict()
    for name, tensor in state.items():
        if name.endswith("_extra_state"):  # Megatron's per-module extra state, None here
            continue
        if name in shared:  # embeddings, attention (QK-norms too), MLP or router and experts, InputNorms, FinalNorm
            tensor.copy_(shared[name])
        elif "x_norm." in name:  # PostNorm of every sublayer and NormX of the merge
            tensor.zero_()
        elif "y_norm." in name:  # PreNorm of every sublayer and NormY: gamma 1, beta 0
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            raise AssertionError(f"unexpected SiameseNorm-only parameter {name}")
    siamese.load_state_dict(state)
    return siamese


@pytest.mark.parametrize("norm", ["siamese", "siamese-layer"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("eps,tolerance", [(1e-12, dict(rtol=1e-5, atol=1e-5)),
                                           (1e-5, dict(rtol=2e-3, atol=2e-3))])
def test_zero_x_branch_is_stock_pre_norm(megatron_single_rank, norm, normalization, eps, tolerance):
    case = ModelCase(norm=norm, normalization=normalization)
    config = dataclasses.replace(case_config(case, Layout()), layernorm_epsilon=eps)
    stock = stock_pre_norm(case, config)
    siamese = degenerate_siamese_from(stock, case, config)
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    expected = stock(*args)
    torch.testing.assert_close(siamese(*args), expected, **tolerance)
    # and the comparison has teeth: the undegenerate model is far from Pre-Norm
    seed_parameters([siamese], case.seed, 0, 1, case.zero_centered_gamma)
    assert (siamese(*args) - expected).abs().max() > 100 * tolerance["atol"]


@pytest.mark.parametrize("changes", [
    dict(qk_layernorm=True),
    dict(num_moe_experts=4, moe_layer_freq="[0,1,1,0]", moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32),
    dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=1, moe_router_pre_softmax=True, qk_layernorm=True),
], ids=["qk-layernorm", "moe-mixed-layers-shared-expert", "moe-top1-qk-layernorm"])
def test_zero_x_branch_is_stock_pre_norm_with_qk_norm_and_experts(megatron_single_rank, changes):
    """Megatron's own decoder block (QK-norm, MoE layers where moe_layer_freq puts them) is what
    the degenerate SiameseNorm block computes: the router, like the experts, sees InputNorm(y)."""
    settings = {name: value for name, value in changes.items() if name in ModelCase.__dataclass_fields__}
    case = ModelCase(normalization="RMSNorm", add_bias_linear=False, **settings)
    config = transformer_config(case, Layout(), layernorm_epsilon=1e-12,
                                **{name: value for name, value in changes.items() if name not in settings})
    stock = stock_pre_norm(case, config, get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                                    normalization=config.normalization))
    siamese = degenerate_siamese_from(stock, case, config)
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    expected = stock(*args)
    torch.testing.assert_close(siamese(*args), expected, rtol=1e-5, atol=1e-5)
    seed_parameters([siamese], case.seed, 0, 1, case.zero_centered_gamma)
    assert (siamese(*args) - expected).abs().max() > 1e-3
