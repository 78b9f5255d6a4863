"""The Megatron model (TP=1, PP=1) computes exactly the reference GPT's function and gradients,
dense and mixture-of-experts: SiameseNorm (both variants, and the component study's ablations)
and the single-stream baselines (Post-Norm, HybridNorm, Mix-LN)."""

import dataclasses

import pytest
import torch

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_siamese.models import build_gpt_chunks
from reference_model import gpt as reference_gpt
from megatron_siamese.reference.functional import dual_norm
from reference_model.gpt import (
    ReferenceGPT,
    ReferenceGPTConfig,
    megatron_to_reference_names,
)
from reference_model import single_stream_layer as reference_single_stream_layer
from megatron_siamese.reference.functional import SINGLE_STREAM_SCHEMES
from reference_model.moe import ReferenceMoE, ReferenceRouter
from reference_model.single_stream import ReferenceSingleStreamGPT
from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, config_overrides, microbatches
from megatron_siamese.runtime.gpt import packed_sequence_params, transformer_config
from megatron_siamese.runtime.layout import Layout

FP32 = dict(rtol=1e-5, atol=1e-6)
FP64 = dict(rtol=1e-10, atol=1e-12)


def assert_close_fp32(actual, expected, name=""):
    """fp32 agreement: rtol 1e-5, atol 1e-6 scaled to the tensor's magnitude when above 1
    (rounding error grows with the values summed, not with each element); fp64's for doubles."""
    tolerance = FP64 if expected.dtype == torch.float64 else FP32
    atol = tolerance["atol"] * max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual, expected, rtol=tolerance["rtol"], atol=atol,
                               msg=lambda m: f"{name}: {m}" if name else m)

# The layer's three ways to its function: torch's norms, the fused ops per sublayer, and a GPT
# block's two sublayers joined by the boundary ops (entry_norm, residual_dual_norm).
PATHS = {"pytorch": dict(fused_ops=False), "fused": dict(fused_ops=True, boundary_ops=False),
         "joined": dict(fused_ops=True, boundary_ops=True)}

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


def build_pair(case: ModelCase, reference_changes=None, dtype=torch.float32, **config_changes):
    """The seeded Megatron model (TP=1) and the reference holding its weights; ``config_changes``
    go into the TransformerConfig, ``reference_changes`` into the reference's config only.
    ``dtype=torch.float64``: both in double (learned positions then: RoPE's angles are fp32)."""
    config = transformer_config(case, Layout(), **config_overrides(case), **config_changes, params_dtype=dtype)
    (model,) = build_seeded_chunks(case, config)
    model.to(dtype)
    reference_config = ReferenceGPTConfig.from_megatron(
        config,
        case.vocab_size,
        case.seq_length,
        position_embedding_type=case.position_embedding_type,
        share_embeddings_and_output_weights=case.share_embeddings_and_output_weights,
        variant="hybrid" if case.norm == "siamese-hybrid" else "standard",
        value_layernorm=case.norm == "hybridnorm",
        **(reference_changes or {}),
    )
    reference = (ReferenceSingleStreamGPT(reference_config, case.norm, config.mix_ln_alpha, config.hybridnorm_star)
                 if case.norm in SINGLE_STREAM_SCHEMES else ReferenceGPT(reference_config))
    reference.to(dtype).load_megatron_state_dict(model.state_dict())
    return model, reference


def megatron_backward(model, batches):
    """Megatron's own schedule over ``batches``: it scales each microbatch's loss by
    1 / len(batches) and sets MoEAuxLossAutoScaler's scale to match (the router losses); that
    process-wide scale is put back afterwards, for tests that call a model directly."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_siamese.runtime.gpt import forward_step

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    scale = None if scale is None else scale.clone()
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=model, num_microbatches=len(batches),
            seq_length=batches[0]["tokens"].shape[1], micro_batch_size=batches[0]["tokens"].shape[0],
        )
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


def fp64_backward(model, batches):
    """The mean cross-entropy over ``batches`` differentiated in fp64 (Megatron's own loss computes
    in fp32: a double model's gradients through it carry fp32 rounding); dense models only (no
    router losses)."""
    import torch.nn.functional as F

    losses = [F.cross_entropy(model(b["tokens"], b["position_ids"], b["attention_mask"]).flatten(0, 1),
                              b["labels"].flatten()) for b in batches]
    (sum(losses) / len(batches)).backward()


class Differences(dict):
    """{what: why} of what differs between a Megatron model and the reference (empty: they agree)."""

    def compare(self, name, actual, expected):
        try:
            assert_close_fp32(actual, expected, name)
        except AssertionError as error:
            self[name] = " ".join(str(error).split())

    def gradients(self, model, reference, batches, objective=None):
        """The reference's step over ``batches`` (``objective`` of each, default the reference's
        own, averaged) and every gradient compared with the Megatron model's, which has taken its
        step already."""
        objective = objective or (lambda b: reference.objective(b["tokens"], b["labels"], b["position_ids"]))
        (sum(objective(b) for b in batches) / len(batches)).backward()
        grads = megatron_to_reference_names({name: p.grad for name, p in model.named_parameters()},
                                            len(model.decoder.layers))
        reference_grads = {name: p.grad for name, p in reference.named_parameters()}
        assert grads.keys() == reference_grads.keys()
        for name, grad in grads.items():
            if grad is None or grad.abs().max() == 0 or reference_grads[name] is None:
                self[name] = "got no gradient"
            else:
                self.compare(name, grad, reference_grads[name])


def differences(model, reference, batches):
    """What differs in the logits of the first microbatch and every gradient of the step over
    ``batches``. The step is Megatron's schedule, or ``fp64_backward`` for a double model."""
    found = Differences()
    first = batches[0]
    found.compare("logits", model(first["tokens"], first["position_ids"], first["attention_mask"]),
                  reference(first["tokens"], first["position_ids"]))
    (fp64_backward if model.config.params_dtype == torch.float64 else megatron_backward)(model, batches)
    found.gradients(model, reference, batches)
    return found


def assert_matches_reference(model, reference, batches):
    found = differences(model, reference, batches)
    assert not found, "differs from the reference:\n" + "\n".join(f"{k}: {v}" for k, v in found.items())


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_match_reference(megatron_single_rank, variant, path):
    case = dataclasses.replace(VARIANTS[variant], **PATHS[path])
    model, reference = build_pair(case)
    assert_matches_reference(model, reference, microbatches(case)[:1])


def documents(batch):
    """A packed batch's documents: (tokens, labels, positions) of each, ``[1, n]``."""
    bounds = batch["cu_seqlens"].tolist()
    return [tuple(batch[key][:, start:end] for key in ("tokens", "labels", "position_ids"))
            for start, end in zip(bounds[:-1], bounds[1:])]


def packed_differences(model, reference, batches):
    """A packed (THD) batch through the Megatron model against the reference run on each of its
    documents alone: the first batch's logits, and every gradient of the mean token loss."""
    found = Differences()
    first = batches[0]
    found.compare("logits", model(first["tokens"], first["position_ids"], None,
                                  packed_seq_params=packed_sequence_params(first["cu_seqlens"])),
                  torch.cat([reference(tokens, positions) for tokens, _, positions in documents(first)], dim=1))
    megatron_backward(model, batches)

    def objective(batch):  # the batch's mean token loss from its documents' means
        total = batch["tokens"].numel()
        return sum(reference.objective(tokens, labels, positions) * tokens.numel() / total
                   for tokens, labels, positions in documents(batch))

    found.gradients(model, reference, batches, objective)
    return found


PACKED = {"rope-gqa": ModelCase(packed_sequences=True),
          "learned-mha-rmsnorm": ModelCase(packed_sequences=True, position_embedding_type="learned_absolute",
                                           num_query_groups=4, normalization="RMSNorm"),
          "hybrid": ModelCase(packed_sequences=True, norm="siamese-hybrid")}


@pytest.mark.parametrize("variant", sorted(PACKED))
def test_packed_documents_each_match_the_reference_run_alone(megatron_single_rank, variant):
    """THD: a microbatch's two samples of three documents each, one packed row (PackedSeqParams);
    the local attention masks by document, RoPE (or learned positions) restarts per document."""
    model, reference = build_pair(PACKED[variant])
    found = packed_differences(model, reference, microbatches(PACKED[variant])[:2])
    assert not found, found


def test_packed_documents_that_see_each_other_are_caught(megatron_single_rank, monkeypatch):
    from megatron_siamese import context_parallel, core_attention

    causal_only = lambda queries, keys, bounds: context_parallel.document_mask(queries, keys, bounds[[0, -1]])
    monkeypatch.setattr(core_attention, "document_mask", causal_only)
    model, reference = build_pair(PACKED["rope-gqa"])
    found = packed_differences(model, reference, microbatches(PACKED["rope-gqa"])[:1])
    assert "logits" in found and len(found) > 5


RECOMPUTE = {"layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
             "layernorm-mlp": dict(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"]),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_recompute_keeps_the_references_function(megatron_single_rank, path, recompute):
    """Selective ("layernorm": the stream norms', or the entry and boundary ops' outputs freed
    and recomputed before their consumers' backward; "mlp") and full recompute, through
    Megatron's schedule, on each path: the reference's logits and every gradient."""
    case = dataclasses.replace(VARIANTS["layernorm-swiglu-rope-tied"], **PATHS[path])
    model, reference = build_pair(case, **RECOMPUTE[recompute])
    assert_matches_reference(model, reference, microbatches(case)[:1])


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_standard_variant_with_qk_layernorm_matches_reference(megatron_single_rank, normalization, path):
    """Qwen3 / OLMo 2 style QK-norm: a per-head norm of queries and keys before RoPE."""
    case = ModelCase(normalization=normalization, **PATHS[path])
    model, reference = build_pair(case, qk_layernorm=True)
    assert model.decoder.layers[0].self_attention.q_layernorm.weight.shape == (case.hidden_size // 4,)
    assert_matches_reference(model, reference, microbatches(case)[:1])


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "moe"])
def test_the_spec_objects_follow_qk_layernorm(megatron_single_rank, experts):
    """Megatron-LM's --spec objects (siamese_layer_spec, siamese_moe_layer_spec) exist before any
    config: QK-norm comes exactly where the config has qk_layernorm, and then the model computes
    the reference's QK-normed function; a reference without QK-norm (the planted bug) differs."""
    base = MOE if experts else ModelCase(normalization="RMSNorm")
    case = dataclasses.replace(base, norm="siamese-layer")
    (plain,) = build_seeded_chunks(case, case_config(case, Layout()))
    assert isinstance(plain.decoder.layers[0].self_attention.q_layernorm, (IdentityOp, type(None)))  # None: 0.19
    assert not any("layernorm" in name for name, _ in plain.decoder.layers[0].self_attention.named_parameters())
    model, reference = build_pair(case, qk_layernorm=True)
    assert isinstance(model.decoder.layers[0].mlp, MoELayer) == experts
    assert model.decoder.layers[0].self_attention.k_layernorm.weight.shape == (case.hidden_size // 4,)
    batches = microbatches(case)
    assert_matches_reference(model, reference, batches)
    for layer in reference.decoder.layers:  # planted: the reference forgets to normalize the queries
        layer.self_attention.q_layernorm.forward = lambda queries: queries
    assert "logits" in differences(model, reference, batches)


# the fused ops each path runs per layer and forward: (attention side, MLP side)
FUSED_CALLS = {"fused": {"hybrid_dual_norm": 1, "dual_norm": 1, "layer_entry": 0, "residual_dual_norm": 0},
               "joined": {"hybrid_dual_norm": 0, "dual_norm": 0, "layer_entry": 1, "residual_dual_norm": 1}}


@pytest.mark.parametrize("path", sorted(FUSED_CALLS))
@pytest.mark.parametrize("variant", ["hybrid-layernorm", "hybrid-rmsnorm-gelu-learned"])
def test_hybrid_fused_and_pytorch_paths_agree(megatron_single_rank, monkeypatch, variant, path):
    """The hybrid variant on the fused ops runs hybrid_dual_norm for every attention sublayer
    and dual_norm for every MLP one, or, joined, one entry op (the hybrid's) and one boundary op
    per layer, and computes the PyTorch path's logits and gradients."""
    from megatron_siamese.ops import fused as fused_ops

    calls = dict.fromkeys(FUSED_CALLS[path], 0)
    hybrid_entries = []
    for name in calls:
        op = getattr(fused_ops, name)

        def counted(*args, _op=op, _name=name, **kwargs):
            calls[_name] += 1
            if _name == "layer_entry":
                hybrid_entries.append(kwargs.get("hybrid"))
            return _op(*args, **kwargs)

        monkeypatch.setattr(fused_ops, name, counted)

    def logits_and_grads(changes):
        case = dataclasses.replace(VARIANTS[variant], **changes)
        (model,) = build_seeded_chunks(case, case_config(case, Layout()))
        batch = microbatches(case)[0]
        args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
        logits = model(*args)
        model(*args, labels=batch["labels"]).mean().backward()
        return logits.detach(), {name: p.grad for name, p in model.named_parameters()}, case

    logits, grads, case = logits_and_grads(PATHS["pytorch"])
    assert not any(calls.values())
    fused_logits, fused_grads, _ = logits_and_grads(PATHS[path])
    assert calls == {name: 2 * n * case.num_layers for name, n in FUSED_CALLS[path].items()}  # 2 forwards
    assert all(hybrid_entries)  # the hybrid's entry op: c1 * x + PreNorm(y)
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


@pytest.mark.parametrize("path", ["pytorch", "fused"])
def test_dropout_mask_is_shared_by_both_streams(megatron_single_rank, path):
    """With dropout on, y' - y must equal c * (x' - u): the same z reached both streams."""
    case = dataclasses.replace(ModelCase(), num_layers=1, **PATHS[path])
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


def test_joined_sublayers_drop_out_as_the_sublayers_apart(megatron_single_rank):
    """The boundary ops take the masks the layer draws, in the same order: with dropout on, the
    joined layer's output and gradients are the fused path's apart, whose masks are shared by
    both streams (above); a different draw would differ."""
    def run(path, seed):
        case = dataclasses.replace(ModelCase(), num_layers=1, **PATHS[path])
        config = dataclasses.replace(case_config(case, Layout()), hidden_dropout=0.5)
        (model,) = build_seeded_chunks(case, config)
        layer = model.decoder.layers[0]
        layer.train()
        x = torch.randn(case.seq_length, 2, case.hidden_size, generator=torch.Generator().manual_seed(0))
        x.requires_grad_(True)
        torch.manual_seed(seed)
        out, _ = layer(x, attention_mask=microbatches(case)[0]["attention_mask"])
        out.square().sum().backward()
        return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]

    joined, apart, other_draw = run("joined", 7), run("fused", 7), run("joined", 8)
    for a, b in zip(joined, apart):
        assert_close_fp32(a, b)
    assert not torch.allclose(joined[0], other_draw[0])


# -- mixture of experts: Megatron's MoELayer as the MLP sublayer ---------------------------------

# every layer MoE and no z-loss unless a variant says so (the check's case mixes them by default)
MOE = ModelCase(num_layers=3, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, add_bias_linear=False,
                moe_aux_loss_coeff=1e-2, moe_layer_freq="1", moe_z_loss_coeff=None, num_microbatches=2)
MOE_VARIANTS = {  # (ModelCase, TransformerConfig settings ModelCase has no field for)
    "top2-aux-layernorm-alltoall": (MOE, {}),
    "top2-aux-z-rmsnorm-allgather": (
        dataclasses.replace(MOE, normalization="RMSNorm", moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="allgather"),
        {}),
    "top1-pre-softmax-scaled-mixed-layers": (dataclasses.replace(MOE, moe_router_topk=1, moe_layer_freq="[0,1,1]"),
                                      dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.0)),
    "shared-gated-expert-qk-layernorm-fp64-router-every-2nd": (
        dataclasses.replace(MOE, moe_layer_freq="2", moe_shared_expert_intermediate_size=48, moe_ffn_hidden_size=32),
        dict(moe_shared_expert_gate=True, qk_layernorm=True, moe_router_dtype="fp64")),
    "gelu-seq-aux-zero-centred-learned": (
        dataclasses.replace(MOE, gated_linear_unit=False, normalization="RMSNorm",
                            zero_centered_gamma=True, moe_router_load_balancing_type="seq_aux_loss",
                            position_embedding_type="learned_absolute"),
        {}),
}


def moe_pair(variant, path="pytorch", reference_changes=None):
    case, config_changes = MOE_VARIANTS[variant]
    case = dataclasses.replace(case, **PATHS[path])
    return (*build_pair(case, reference_changes, **config_changes), microbatches(case))


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_moe_logits_and_gradients_match_reference(megatron_single_rank, variant, path):
    """Router, experts, shared expert, norms and embeddings, over two microbatches through
    Megatron's schedule: the aux and z losses reach the gradients as the reference's objective
    has them, scaled like the main loss."""
    model, reference, batches = moe_pair(variant, path)
    moe = [isinstance(layer.mlp, ReferenceMoE) for layer in reference.decoder.layers]
    assert moe == [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers] and any(moe)
    assert_matches_reference(model, reference, batches)


def test_moe_with_biases_matches_reference_in_logits(megatron_single_rank):
    """Router and expert biases (each expert adds its fc2 bias scaled by the routing probability).
    Only without autograd: with it, stock Megatron's SequentialMLP experts fail on their biases
    (megatron-core 0.16.1 and 0.19.2 add the bias in place to a custom Function's output view);
    once that is fixed this fails, and the biased case joins MOE_VARIANTS."""
    case = dataclasses.replace(MOE, add_bias_linear=True, gated_linear_unit=False)
    model, reference = build_pair(case)
    batch = microbatches(case)[0]
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    with torch.no_grad():
        assert_close_fp32(model(*args), reference(batch["tokens"], batch["position_ids"]), "logits")
    assert model.decoder.layers[0].mlp.router.bias is not None
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        model(*args)


@pytest.mark.parametrize("changes, says", [
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
    (dict(moe_router_load_balancing_type="global_aux_loss"), "moe_router_load_balancing_type='global_aux_loss'"),
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor=1.0"),
])
def test_the_reference_refuses_moe_settings_it_has_no_math_for(changes, says):
    config = transformer_config(MOE, Layout(), **changes)
    with pytest.raises(ValueError, match=f"no reference for {says}"):
        ReferenceGPTConfig.from_megatron(config, MOE.vocab_size, MOE.seq_length)


def _router_sees_the_input_before_input_norm(monkeypatch):
    """The reference's router is fed PostNorm(x) + PreNorm(y), the experts still the normalized input."""
    seen = {}

    def recording_dual_norm(streams, hidden, x_w, x_b, y_w, y_b, in_w, in_b, *rest):
        seen["un-normalized"] = dual_norm(streams, hidden, x_w, x_b, y_w, y_b, None, None, *rest)[1]
        return dual_norm(streams, hidden, x_w, x_b, y_w, y_b, in_w, in_b, *rest)

    route = ReferenceRouter.forward
    monkeypatch.setattr(reference_gpt, "dual_norm", recording_dual_norm)
    monkeypatch.setattr(ReferenceRouter, "forward", lambda self, x: route(self, seen["un-normalized"].reshape(x.shape)))
    return {}


PLANTED = {  # bug -> (what it does to the reference, the differences that must show, those that must not)
    "router-sees-un-normalized-input": (_router_sees_the_input_before_input_norm, {"logits"}, set()),
    "aux-loss-coefficient-doubled": (lambda _: dict(moe_aux_loss_coeff=2 * MOE.moe_aux_loss_coeff), set(), {"logits"}),
    "z-loss-left-out": (lambda _: dict(moe_z_loss_coeff=None), set(), {"logits"}),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_moe_comparison_catches_a_planted_bug(megatron_single_rank, monkeypatch, bug):
    """The router losses have no forward value: only the gradients can show a wrong coefficient
    (doubled is also what an aux loss left unscaled by 1 / num_microbatches would give here)."""
    plant, must_show, must_not_show = PLANTED[bug]
    model, reference, batches = moe_pair("top2-aux-z-rmsnorm-allgather", reference_changes=plant(monkeypatch))
    found = differences(model, reference, batches)
    routers = {f"decoder.layers.{i}.mlp.router.weight" for i in range(MOE.num_layers)}
    assert must_show | routers <= found.keys(), sorted(found)
    assert not must_not_show & found.keys(), sorted(found)


# The paper's component study: without InputNorm, without depth scaling, and both on the hybrid
# variant (a HybridNorm-like X stream coupled to a Pre-Norm Y stream, nothing else). In fp64:
# without normalized sublayer inputs fp32 rounding grows to a few 1e-6 of the gradients (the
# PyTorch path's own error against the reference), which says nothing about the function.
ABLATIONS = {
    "no-input-norm": ModelCase(siamese_input_norm=False, position_embedding_type="learned_absolute"),
    "no-depth-scale-rmsnorm": ModelCase(siamese_depth_scale=False, normalization="RMSNorm",
                                        position_embedding_type="learned_absolute"),
    "hybrid-neither": ModelCase(norm="siamese-hybrid", siamese_input_norm=False, siamese_depth_scale=False,
                                position_embedding_type="learned_absolute"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("variant", sorted(ABLATIONS))
def test_the_ablations_match_the_reference_in_fp64(megatron_single_rank, variant, path):
    """On each path (the fused ops and the boundary ops without InputNorm weights), every gradient."""
    case = dataclasses.replace(ABLATIONS[variant], **PATHS[path])
    model, reference = build_pair(case, dtype=torch.float64)
    assert all(type(layer.pre_mlp_layernorm).__name__ == ("TorchNorm" if case.siamese_input_norm else "IdentityOp")
               for layer in model.decoder.layers)
    assert_matches_reference(model, reference, microbatches(case)[:1])


def test_the_ablation_without_depth_scaling_differs_from_the_scaled_reference(megatron_single_rank):
    """The planted bug: a reference that keeps c = sqrt(2 L) where the model dropped it."""
    case = ABLATIONS["no-depth-scale-rmsnorm"]
    model, reference = build_pair(case, reference_changes=dict(depth_scaled=True), dtype=torch.float64)
    assert model.decoder.layers[1].depth_scale == 1.0 and reference.decoder.layers[1].depth_scale == 2.0
    assert "logits" in differences(model, reference, microbatches(case)[:1])


# -- the single-stream baselines: Post-Norm, HybridNorm, Mix-LN ----------------------------------

BASELINES = {
    "post-layernorm-gelu-learned-untied": ModelCase(
        norm="post", gated_linear_unit=False, position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False),
    "hybridnorm-rmsnorm": ModelCase(norm="hybridnorm", normalization="RMSNorm"),
    "hybridnorm-star-layernorm-mha": ModelCase(norm="hybridnorm", hybridnorm_star=True, num_query_groups=4),
    "mixln-half-layernorm": ModelCase(norm="mixln", mix_ln_alpha=0.5),
    "mixln-quarter-rmsnorm-zero-centred-nobias": ModelCase(
        norm="mixln", normalization="RMSNorm", zero_centered_gamma=True, add_bias_linear=False),
}


@pytest.mark.parametrize("variant", sorted(BASELINES))
def test_the_baselines_match_their_reference(megatron_single_rank, variant):
    """Logits and every gradient, each layer's norms where the scheme puts them for its number."""
    case = BASELINES[variant]
    model, reference = build_pair(case)
    placed = [(type(layer.input_layernorm).__name__, type(layer.post_attn_norm).__name__)
              for layer in model.decoder.layers]
    expected = [("TorchNorm" if layer.input_layernorm is not None else "IdentityOp",
                 "TorchNorm" if layer.post_attn_norm is not None else "IdentityOp") for layer in reference.decoder.layers]
    assert placed == expected
    assert_matches_reference(model, reference, microbatches(case)[:1])


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_the_baselines_recompute_keeps_the_references_function(megatron_single_rank, recompute):
    """Mix-LN's Post-Norm and Pre-Norm layers (the input norms recomputed, the norms after the
    residual adds kept) under selective and full recompute, through Megatron's schedule."""
    case = BASELINES["mixln-half-layernorm"]
    model, reference = build_pair(case, **RECOMPUTE[recompute])
    assert_matches_reference(model, reference, microbatches(case)[:1])


def test_the_baselines_with_experts_match_their_reference(megatron_single_rank):
    """HybridNorm* with MoE layers (router on the normalized stream, aux and z losses), two
    microbatches through Megatron's schedule."""
    case, config_changes = MOE_VARIANTS["top2-aux-z-rmsnorm-allgather"]
    case = dataclasses.replace(case, norm="hybridnorm", hybridnorm_star=True)
    model, reference = build_pair(case, **config_changes)
    assert any(isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers)
    assert_matches_reference(model, reference, microbatches(case))


def _values_left_unnormalized(monkeypatch, reference):
    for layer in reference.decoder.layers:
        monkeypatch.setattr(layer.self_attention.v_layernorm, "forward", lambda values: values)


def _residual_from_the_normalized_input(monkeypatch, reference):
    def sublayer(x, input_norm, sublayer, output_norm, dropout=lambda t: t):
        normed = x if input_norm is None else input_norm(x)
        out, bias = sublayer(normed)
        x = normed + dropout(out if bias is None else out + bias)
        return x if output_norm is None else output_norm(x)

    monkeypatch.setattr(reference_single_stream_layer, "single_stream_sublayer", sublayer)


BASELINE_PLANTED = {  # bug in the reference -> the variant it shows in
    "values-unnormalized": (_values_left_unnormalized, "hybridnorm-rmsnorm"),
    # Megatron's apply_residual_connection_post_layernorm: the Pre-Norm layers' residual moved
    "residual-after-the-input-norm": (_residual_from_the_normalized_input, "mixln-half-layernorm"),
}


@pytest.mark.parametrize("bug", sorted(BASELINE_PLANTED))
def test_the_baseline_comparison_catches_a_planted_bug(megatron_single_rank, monkeypatch, bug):
    plant, variant = BASELINE_PLANTED[bug]
    case = BASELINES[variant]
    model, reference = build_pair(case)
    plant(monkeypatch, reference)
    assert "logits" in differences(model, reference, microbatches(case)[:1])
