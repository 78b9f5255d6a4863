"""Multi-latent attention (DeepSeek's MLA: Megatron's MLASelfAttention in every SiameseNorm block)
and multi-token prediction (DeepSeek-V3's MTP: Megatron's stock MultiTokenPredictionBlock after
the merging final norm): the Megatron model (TP=1, PP=1, fp32) computes the reference's
(tests/reference_model/mla.py, tests/reference_model/mtp.py) per-microbatch losses, each MTP depth's loss, the logits
(where Megatron gives them) and every gradient of a step through Megatron's schedule, for both
SiameseNorm schemes; and the comparison catches planted bugs in the reference."""

import dataclasses
import math

import pytest
import torch

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron_siamese.check.step import ModelCase, microbatches
from reference_model import mla as reference_mla
from reference_model import mtp as reference_mtp
from reference_model import rope as reference_rope
from reference_model.gpt import ReferenceGPT, ReferenceGPTConfig, megatron_to_reference_names
from reference_model.mla import ReferenceMLA
from reference_model.moe import ReferenceMoE
from megatron_siamese.runtime.gpt import forward_step, transformer_config
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.support import UnsupportedConfigError

from test_reference_equivalence import MOE, PATHS, RECOMPUTE, Differences, build_pair
from test_reference_equivalence import differences as fp64_differences

SCHEMES = ["siamese", "siamese-layer"]
# MLA the size of the tiny model; MLA has no GQA: one key/value head per query head
MLA = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
           num_query_groups=None)

VARIANTS = {  # name -> (ModelCase, TransformerConfig settings ModelCase has no field for)
    "mla-direct-q-rope": (ModelCase(**MLA, rope_type="rope"), {}),
    "mla-lora-q-latent-norms-rope-rmsnorm": (
        ModelCase(**MLA, q_lora_rank=16, qk_layernorm=True, rope_type="rope", normalization="RMSNorm"), {}),
    "mla-lora-q-latent-norms-yarn-scaled": (
        ModelCase(**MLA, q_lora_rank=16, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0), {}),
    # Megatron's default RoPE for MLA (yarn), DeepSeek-V3's factor, an mscale_all_dim that changes the
    # softmax scale, a correction range inside the head; learned positions too, untied head
    "mla-direct-q-default-yarn-mscale-learned-untied": (
        ModelCase(**MLA, rotary_scaling_factor=40.0, position_embedding_type="learned_absolute",
                  share_embeddings_and_output_weights=False),
        dict(mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=64)),
    "mtp-1": (ModelCase(mtp_num_layers=1, mtp_loss_scaling_factor=0.3), {}),
    "mtp-2-learned-untied-gelu": (
        ModelCase(mtp_num_layers=2, mtp_loss_scaling_factor=0.5, position_embedding_type="learned_absolute",
                  share_embeddings_and_output_weights=False, gated_linear_unit=False), {}),
    "mla-mtp-2-moe-shared-expert": (
        dataclasses.replace(MOE, **MLA, q_lora_rank=16, qk_layernorm=True, rope_type="yarn",
                            rotary_scaling_factor=4.0, mtp_num_layers=2, mtp_loss_scaling_factor=0.25,
                            moe_shared_expert_intermediate_size=48),
        {}),
}


def pair(variant, scheme, reference_changes=None):
    case, config_changes = VARIANTS[variant]
    case = dataclasses.replace(case, norm=scheme, num_microbatches=2)
    model, reference = build_pair(case, reference_changes, **config_changes)
    return model, reference, microbatches(case)


def megatron_step(model, batches, monkeypatch):
    """Megatron's schedule over ``batches`` (forward and backward): each microbatch's loss, and
    each MTP depth's loss L_k per microbatch as GPTModel hands it to MTPLossAutoScaler (there
    ``mtp_loss_scaling_factor / D * mask * CE / num_tokens``: summed and unscaled here)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    attached = []
    attach = MTPLossAutoScaler.apply

    def recording(hidden, mtp_loss):
        attached.append(mtp_loss.detach().sum())
        return attach(hidden, mtp_loss)

    monkeypatch.setattr(MTPLossAutoScaler, "apply", recording)
    moe_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=model,
            num_microbatches=len(batches), seq_length=batches[0]["tokens"].shape[1],
            micro_batch_size=batches[0]["tokens"].shape[0])
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = None if moe_scale is None else moe_scale.clone()
    depths = model.config.mtp_num_layers or 0
    assert len(attached) == depths * len(batches), "an MTP loss per depth and microbatch"
    scale = model.config.mtp_loss_scaling_factor / depths if depths else 1.0
    mtp = [[attached[i * depths + k] / scale for k in range(depths)] for i in range(len(batches))]
    return [o["loss"] for o in out], mtp


def differences(model, reference, batches, monkeypatch):
    """{what: why} for what differs between the Megatron model and the reference over a step:
    ``loss[i]`` (microbatch i's), ``mtp[i][k]`` (its depth k + 1 loss), ``logits`` (the first
    microbatch's; only without MTP: megatron-core 0.16's GPTModel cannot run MTP without labels)
    and every gradient (empty: they agree)."""
    found = Differences()
    first = batches[0]
    if not model.config.mtp_num_layers:
        found.compare("logits", model(first["tokens"], first["position_ids"], first["attention_mask"]),
                      reference(first["tokens"], first["position_ids"]))
    losses, mtp = megatron_step(model, batches, monkeypatch)
    with torch.no_grad():
        expected = [reference.losses(b["tokens"], b["labels"], b["position_ids"]) for b in batches]
    for i, (main, depth_losses) in enumerate(expected):
        found.compare(f"loss[{i}]", losses[i], main.mean())
        assert len(mtp[i]) == len(depth_losses)
        for k, depth_loss in enumerate(depth_losses):
            found.compare(f"mtp[{i}][{k}]", mtp[i][k], depth_loss)
    found.gradients(model, reference, batches)
    return found


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mla_and_mtp_match_the_reference(megatron_single_rank, monkeypatch, variant, scheme):
    """Two microbatches through Megatron's schedule: losses, MTP losses, logits, every gradient."""
    model, reference, batches = pair(variant, scheme)
    config = model.config
    attention = model.decoder.layers[0].self_attention
    assert (type(attention).__name__ == "LocalMLASelfAttention") == bool(config.multi_latent_attention)
    assert isinstance(reference.decoder.layers[0].self_attention, ReferenceMLA) == bool(config.multi_latent_attention)
    if config.multi_latent_attention:
        assert hasattr(attention, "linear_q_proj") == (config.q_lora_rank is None)
        assert (getattr(attention, "kv_layernorm", None) is not None
                and type(attention.kv_layernorm).__name__ == "TorchNorm") == config.qk_layernorm
        assert config.rope_type == (VARIANTS[variant][0].rope_type or "yarn")
    assert (getattr(model, "mtp", None) is not None) == bool(config.mtp_num_layers)
    if config.mtp_num_layers:
        assert len(model.mtp.layers) == len(reference.mtp.layers) == config.mtp_num_layers
        assert config.mtp_loss_scaling_factor != 0.1  # not Megatron's default: the scale is tested
        mtp_layer = [m for n, m in model.mtp.layers[0].named_children() if n in ("transformer_layer", "mtp_model_layer")]
        assert isinstance(mtp_layer[0].mlp, MoELayer) == isinstance(
            reference.mtp.layers[0].transformer_layer.mlp, ReferenceMoE) == bool(config.num_moe_experts)
    found = differences(model, reference, batches, monkeypatch)
    assert not found, "differs from the reference:\n" + "\n".join(f"{k}: {v}" for k, v in found.items())


MLA_ONLY = sorted(name for name in VARIANTS if name.startswith("mla-") and "mtp" not in name)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("variant", MLA_ONLY)
def test_mla_matches_the_reference_in_fp64(megatron_single_rank, variant, scheme):
    """In double (RoPE's angles fp32 on both sides, as Megatron computes them), to fp64's
    tolerance: the logits and every gradient of the mean cross-entropy (the equivalence tests'
    fp64 comparison; Megatron's own loss would round to fp32)."""
    case, config_changes = VARIANTS[variant]
    case = dataclasses.replace(case, norm=scheme)
    model, reference = build_pair(case, dtype=torch.float64, **config_changes)
    found = fp64_differences(model, reference, microbatches(case)[:1])
    assert not found, "differs from the reference:\n" + "\n".join(f"{k}: {v}" for k, v in found.items())


RUNS = {**{f"path-{path}": (PATHS[path], {}) for path in PATHS},
        **{f"recompute-{name}": ({}, changes) for name, changes in RECOMPUTE.items()},
        "recompute-mla-up-proj": ({}, dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]))}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_mla_mtp_moe_on_each_path_and_recompute(megatron_single_rank, monkeypatch, run):
    """MLA, two MTP layers and MoE with a shared expert on each way the SiameseNorm layer runs
    (torch's norms, the fused ops, the boundary ops) and under selective (the stream norms, the
    MLP, MLA's up projections) and full recompute (the MTP layers' too): the same function."""
    path, recompute = RUNS[run]
    case, config_changes = VARIANTS["mla-mtp-2-moe-shared-expert"]
    case = dataclasses.replace(case, num_microbatches=2, **path)
    model, reference = build_pair(case, **config_changes, **recompute)
    found = differences(model, reference, microbatches(case), monkeypatch)
    assert not found, "differs from the reference:\n" + "\n".join(f"{k}: {v}" for k, v in found.items())


@pytest.mark.parametrize("variant, changes, says", [
    ("mtp-1", dict(calculate_per_token_loss=True), "calculate_per_token_loss=True"),
    ("mla-direct-q-rope", dict(cache_mla_latents=True), "cache_mla_latents=True"),
])
def test_the_reference_refuses_settings_it_has_no_math_for(variant, changes, says):
    case = VARIANTS[variant][0]
    config = transformer_config(case, Layout(), **changes)
    with pytest.raises(ValueError, match=f"no reference for {says}"):
        ReferenceGPTConfig.from_megatron(config, case.vocab_size, case.seq_length)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_direct_queries_with_qk_layernorm_normalize_the_kv_latent_only_or_are_refused(
        megatron_single_rank, monkeypatch, scheme):
    """Without q_lora_rank there is no query latent: 0.16 normalizes the key/value latent alone
    (the reference's math); 0.19 would normalize the query projection's input in a fused TE
    norm+linear the local modules lack, and is refused by name."""
    case = dataclasses.replace(VARIANTS["mla-direct-q-rope"][0], qk_layernorm=True, norm=scheme, num_microbatches=2)
    try:
        import megatron.core.transformer.mla_qk_norm_config  # noqa: F401  (0.19's resolver)
    except ImportError:
        model, reference = build_pair(case)
        attention = model.decoder.layers[0].self_attention
        assert type(attention.kv_layernorm).__name__ == "TorchNorm"
        assert not any("q_layernorm" in name for name, _ in model.named_parameters())
        found = differences(model, reference, microbatches(case), monkeypatch)
        assert not found, "differs from the reference:\n" + "\n".join(f"{k}: {v}" for k, v in found.items())
    else:
        with pytest.raises(UnsupportedConfigError, match="qk_layernorm and without q_lora_rank.*--q-lora-rank"):
            build_pair(case)


def test_reference_names_cover_megatron_mtp_layers_on_both_versions():
    """megatron-core 0.16 names an MTP layer's transformer layer ``transformer_layer``, 0.19
    ``mtp_model_layer``: both are the reference's ``transformer_layer``."""
    weight = torch.zeros(1)
    for slot in ("transformer_layer", "mtp_model_layer"):
        renamed = megatron_to_reference_names({f"mtp.layers.1.{slot}.self_attention.linear_proj.bias": weight,
                                               f"mtp.layers.1.{slot}.mlp.linear_fc2.bias": weight}, 2)
        assert sorted(renamed) == ["mtp.layers.1.transformer_layer.mlp.fc2_bias",
                                   "mtp.layers.1.transformer_layer.self_attention.proj_bias"]


def test_mla_rope_reference_is_megatrons_embedding(megatron_single_rank):
    """The reference's YaRN frequencies and concentration factor are bit for bit Megatron's
    YarnRotaryEmbedding's (and its softmax scale MultiLatentAttention's formula) for a range of
    settings; its RoPE angles RotaryEmbedding's (rotary_percent and rotary_base as MLA passes them)."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as megatron_yarn
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for dim, percent, base in [(4, 1.0, 10000), (16, 0.5, 500)]:
        config = ReferenceGPTConfig(vocab_size=8, max_sequence_length=8, num_layers=1, hidden_size=8,
                                    num_attention_heads=2, multi_latent_attention=True, qk_pos_emb_head_dim=dim,
                                    rope_type="rope", rotary_percent=percent, rotary_base=base)
        emb = RotaryEmbedding(dim, rotary_percent=percent, rotary_base=base, use_cpu_initialization=True)(12).cpu()
        cos, sin = reference_rope.mla_rotary_cos_sin(config, 12)
        torch.testing.assert_close(cos, emb.cos()[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(sin, emb.sin()[:, 0], rtol=0, atol=0)

    for dim, factor, original, mscale, mscale_all_dim in [(4, 4.0, 4096, 1.0, 0.0), (8, 40.0, 64, 1.0, 0.8),
                                                          (16, 1.0, 128, 0.5, 1.0), (64, 40.0, 4096, 1.0, 1.0)]:
        config = ReferenceGPTConfig(vocab_size=8, max_sequence_length=8, num_layers=1, hidden_size=8,
                                    num_attention_heads=2, multi_latent_attention=True, qk_head_dim=8,
                                    qk_pos_emb_head_dim=dim, rope_type="yarn", rotary_scaling_factor=factor,
                                    original_max_position_embeddings=original, mscale=mscale,
                                    mscale_all_dim=mscale_all_dim)
        yarn = megatron_yarn.YarnRotaryEmbedding(dim, scaling_factor=factor, original_max_position_embeddings=original,
                                                 mscale=mscale, mscale_all_dim=mscale_all_dim,
                                                 use_cpu_initialization=True)
        emb, concentration = (t.cpu() if isinstance(t, torch.Tensor) else t for t in yarn.get_emb(12))
        cos, sin = reference_rope.mla_rotary_cos_sin(config, 12)
        torch.testing.assert_close(cos, (emb.cos() * concentration)[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(sin, (emb.sin() * concentration)[:, 0], rtol=0, atol=0)
        attention_mscale = megatron_yarn._yarn_get_mscale(factor, mscale_all_dim)
        assert reference_mla.mla_softmax_scale(config) == attention_mscale ** 2 / math.sqrt(8 + dim)


# -- planted bugs in the reference: each must show ------------------------------------------------


def _rope_on_the_whole_query_head(monkeypatch):
    """RoPE over each query head's every channel (its no-position part too), the keys' right."""
    def rotary(self, q, k_nope, k_pe):
        cfg = self.config
        whole = dataclasses.replace(cfg, qk_pos_emb_head_dim=cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
        query = reference_rope.apply_mla_rotary(q, *reference_rope.mla_rotary_cos_sin(whole, q.shape[1]))
        cos, sin = reference_rope.mla_rotary_cos_sin(cfg, q.shape[1])
        k_pe = reference_rope.apply_mla_rotary(k_pe, cos, sin).expand(-1, -1, cfg.num_attention_heads, -1)
        return query, torch.cat([k_nope, k_pe], dim=-1)

    monkeypatch.setattr(ReferenceMLA, "rotary", rotary)


def _position_part_at_the_front_of_each_head(monkeypatch):
    """Each query head's first p channels taken as its position part (Megatron's are its last)."""
    rotary = ReferenceMLA.rotary

    def swapped(self, q, k_nope, k_pe):
        cfg = self.config
        q_front, q_back = q.split([cfg.qk_pos_emb_head_dim, cfg.qk_head_dim], dim=-1)
        return rotary(self, torch.cat([q_back, q_front], dim=-1), k_nope, k_pe)

    monkeypatch.setattr(ReferenceMLA, "rotary", swapped)


def _plain_rope_order(monkeypatch):
    """RoPE without MLA's even-then-odd channel order: the standard attention's rotation."""
    monkeypatch.setattr(reference_mla, "apply_mla_rotary", reference_rope.apply_rotary)


def _softmax_scale_of_the_no_position_part(monkeypatch):
    monkeypatch.setattr(reference_mla, "mla_softmax_scale", lambda config: 1.0 / math.sqrt(config.qk_head_dim))


def _softmax_scale_without_mscale(monkeypatch):
    monkeypatch.setattr(reference_mla, "mla_softmax_scale",
                        lambda config: 1.0 / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim))


def _yarn_without_concentration(monkeypatch):
    monkeypatch.setattr(reference_rope, "yarn_concentration_factor", lambda *settings: 1.0)


def _mtp_labels_not_rolled(monkeypatch):
    """Each depth scored on the main labels (the loss mask still rolled)."""
    rolled = reference_mtp.rolled_targets
    monkeypatch.setattr(reference_mtp, "rolled_targets",
                        lambda labels, mask, depth: (labels, rolled(labels, mask, depth)[1]))


def _mtp_positions_not_rolled(monkeypatch):
    """Each depth embeds its rolled tokens at the unrolled positions (learned positions show it)."""
    def forward(self, hidden, input_ids, position_ids, embed, rope):
        outputs = []
        for layer in self.layers:
            input_ids = reference_mtp.roll_left(input_ids)
            hidden = layer(hidden, embed(input_ids, position_ids), rope)
            outputs.append(hidden)
        return outputs

    monkeypatch.setattr(reference_mtp.ReferenceMTPBlock, "forward", forward)


def _mtp_router_losses_left_out(monkeypatch):
    """Only the decoder's MoE layers' aux losses (not the MTP layers')."""
    def router_loss(self):
        losses = [layer.mlp.router_loss for layer in self.decoder.layers if layer.mlp.router_loss is not None]
        return sum(losses)

    monkeypatch.setattr(ReferenceGPT, "router_loss", router_loss)


def _no_change(monkeypatch):
    return None


# bug -> (how it is planted, its reference_changes, the variant, what must differ: "forward" = a loss
# or the logits, "mtp" = an MTP depth's loss, "grads" = some gradient; and what must not)
PLANTED = {
    "rope-on-the-whole-query-head": (_rope_on_the_whole_query_head, {}, "mla-direct-q-rope", {"forward"}, set()),
    "position-part-at-the-front": (_position_part_at_the_front_of_each_head, {}, "mla-lora-q-latent-norms-rope-rmsnorm",
                                   {"forward"}, set()),
    "rope-without-mla-channel-order": (_plain_rope_order, {}, "mla-lora-q-latent-norms-yarn-scaled", {"forward"}, set()),
    "softmax-scale-of-the-no-position-part": (_softmax_scale_of_the_no_position_part, {}, "mla-direct-q-rope",
                                              {"forward"}, set()),
    "softmax-scale-without-mscale": (_softmax_scale_without_mscale, {},
                                     "mla-direct-q-default-yarn-mscale-learned-untied", {"forward"}, set()),
    "yarn-without-concentration": (_yarn_without_concentration, {}, "mla-lora-q-latent-norms-yarn-scaled",
                                   {"forward"}, set()),
    "mtp-labels-not-rolled": (_mtp_labels_not_rolled, {}, "mtp-1", {"mtp", "grads"}, {"forward"}),
    "mtp-positions-not-rolled": (_mtp_positions_not_rolled, {}, "mtp-2-learned-untied-gelu", {"mtp", "grads"},
                                 {"forward"}),
    # the objective's mtp_loss_scaling_factor / D dropped: each depth's loss added unscaled
    "mtp-loss-scale-dropped": (_no_change, dict(mtp_loss_scaling_factor=2.0), "mtp-2-learned-untied-gelu", {"grads"},
                               {"forward", "mtp"}),
    "mtp-router-losses-left-out": (_mtp_router_losses_left_out, {}, "mla-mtp-2-moe-shared-expert", {"grads"},
                                   {"forward", "mtp"}),
}


def _kinds(found):
    return {"forward" if name == "logits" or name.startswith("loss[") else "mtp" if name.startswith("mtp[")
            else "grads" for name in found}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_comparison_catches_a_planted_bug(megatron_single_rank, monkeypatch, bug):
    plant, reference_changes, variant, must_show, must_not_show = PLANTED[bug]
    model, reference, batches = pair(variant, "siamese", reference_changes)
    plant(monkeypatch)
    kinds = _kinds(differences(model, reference, batches, monkeypatch))
    assert must_show <= kinds and not must_not_show & kinds, sorted(kinds)
