"""The layer's contract with Megatron: construction, stream packing, norms, recompute, errors."""

import dataclasses

import pytest
import torch

from megatron.core.transformer.spec_utils import build_module

from megatron_siamese import TorchNorm, UnsupportedConfigError
from megatron_siamese.models import build_gpt_chunks
from megatron_siamese.reference.functional import normalize
from megatron_siamese.specs import get_siamese_layer_local_spec
from megatron_siamese.check.step import ModelCase, case_config, microbatches
from megatron_siamese.runtime.layout import Layout

CASE = ModelCase(num_layers=2)


def config_with(**changes):
    return dataclasses.replace(case_config(CASE, Layout()), **changes)


def build_layer(config, layer_number=1):
    return build_module(get_siamese_layer_local_spec(), config=config, layer_number=layer_number)


def attention_mask():
    return microbatches(CASE)[0]["attention_mask"]


def test_first_layer_expands_and_outputs_are_packed_and_viewless(megatron_single_rank):
    layer = build_layer(config_with())
    hidden = torch.randn(CASE.seq_length, 2, CASE.hidden_size, requires_grad=True)
    output, _ = layer(hidden_states=hidden, attention_mask=attention_mask())
    assert output.shape == (CASE.seq_length, 2, 2 * CASE.hidden_size)
    assert output._base is None  # Megatron's pipeline schedules free stage outputs in place


def test_later_layer_rejects_single_stream_input(megatron_single_rank):
    layer = build_layer(config_with(), layer_number=2)
    hidden = torch.randn(CASE.seq_length, 2, CASE.hidden_size)
    with pytest.raises(ValueError, match="SiameseP2PCommunicator"):
        layer(hidden_states=hidden, attention_mask=attention_mask())


def test_depth_scale_uses_global_layer_number(megatron_single_rank):
    assert build_layer(config_with(), layer_number=2).depth_scale == pytest.approx(2.0)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_norm_contract(megatron_single_rank, normalization, zero_centered, sequence_parallel):
    config = config_with(
        normalization=normalization,
        layernorm_zero_centered_gamma=zero_centered,
        tensor_model_parallel_size=2 if sequence_parallel else 1,
        sequence_parallel=sequence_parallel,
        persist_layer_norm=True,  # Megatron-LM's default: accepted, not asserted on
    )
    norm = build_module(TorchNorm, config=config, hidden_size=16, eps=1e-6)
    assert (norm.bias is not None) == (normalization == "LayerNorm")
    assert torch.all(norm.weight == (0.0 if zero_centered else 1.0))
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())
    with torch.no_grad():  # exercise gamma and beta, not just their init
        norm.weight.add_(torch.randn(16))
        if norm.bias is not None:
            norm.bias.add_(torch.randn(16))
    x = torch.randn(3, 16) * 4 + 2
    for dtype, tolerance in ((torch.float32, dict(rtol=1e-5, atol=1e-5)),
                             (torch.bfloat16, dict(rtol=1.6e-2, atol=1e-5))):
        expected = normalize(x.to(dtype), norm.weight.to(dtype),
                             None if norm.bias is None else norm.bias.to(dtype),
                             normalization=normalization, eps=1e-6, zero_centered_gamma=zero_centered)
        torch.testing.assert_close(norm.to(dtype)(x.to(dtype)), expected, **tolerance)


# the config asks for TP2 + SP while this process runs TP1: Megatron's linears say they drop SP
@pytest.mark.filterwarnings("ignore:`sequence_parallel` is set to `True`:UserWarning")
def test_every_norm_parameter_is_flagged_for_sequence_parallel(megatron_single_rank):
    config = config_with(tensor_model_parallel_size=2, sequence_parallel=True)
    (model,) = build_gpt_chunks(config, "siamese", CASE.vocab_size, CASE.seq_length)
    norm_params = [n for n, p in model.named_parameters() if "norm" in n]
    assert len(norm_params) == CASE.num_layers * 12 + 6
    unflagged = [n for n, p in model.named_parameters()
                 if "norm" in n and not getattr(p, "sequence_parallel", False)]
    assert unflagged == []


def saved_activation_bytes(config):
    """Bytes of activation storage the layers keep for backward after one forward."""
    torch.manual_seed(0)
    (model,) = build_gpt_chunks(config, "siamese", CASE.vocab_size, CASE.seq_length)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    batch = microbatches(CASE)[0]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                     labels=batch["labels"]).sum()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    total = sum(size for ptr, size in storages.items() if ptr not in params)
    loss.backward()  # the recomputation runs and completes
    return total


# one [s, b, h] fp32 activation
SUBLAYER_BYTES = CASE.seq_length * CASE.micro_batch_size * CASE.hidden_size * 4


PATHS = {"pytorch": dict(siamese_fused_ops=False), "apart": dict(siamese_fused_ops=True, siamese_boundary_ops=False),
         "joined": dict(siamese_fused_ops=True, siamese_boundary_ops=True)}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_selective_recompute_keeps_fewer_activations(megatron_single_rank, path):
    plain = config_with(**PATHS[path])
    baseline = saved_activation_bytes(plain)
    norms = saved_activation_bytes(
        config_with(**PATHS[path], recompute_granularity="selective", recompute_modules=["layernorm"])
    )
    both = saved_activation_bytes(
        config_with(**PATHS[path], recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])
    )
    # "layernorm" drops InputNorm's output per sublayer (joined: the entry and boundary ops'), and on
    # the PyTorch path also its input u + PreNorm(y), which the fused ops never keep
    freed_per_sublayer = 2 if path == "pytorch" else 1
    assert baseline - norms >= freed_per_sublayer * SUBLAYER_BYTES * 2 * CASE.num_layers
    assert both < norms


def test_fused_ops_keep_fewer_activations_than_pytorch(megatron_single_rank):
    torch_path = saved_activation_bytes(config_with(siamese_fused_ops=False))
    fused_path = saved_activation_bytes(config_with(**PATHS["apart"]))
    assert torch_path - fused_path >= SUBLAYER_BYTES * 2 * CASE.num_layers


def test_joined_sublayers_keep_one_activation_less_per_layer(megatron_single_rank):
    """Apart, each sublayer's dual_norm keeps its packed [s, b, 2h] input; joined, a layer keeps
    its input once (for both ops) and the first sublayer's output z: one [s, b, h] activation less
    per layer, for 8 bytes of statistics more per token (6 + 8 fp32 instead of 2 x 6)."""
    apart = saved_activation_bytes(config_with(**PATHS["apart"]))
    joined = saved_activation_bytes(config_with(**PATHS["joined"]))
    tokens = CASE.seq_length * CASE.micro_batch_size
    assert apart - joined == CASE.num_layers * (SUBLAYER_BYTES - 8 * tokens)


UNSUPPORTED = {  # (settings, the refusal's one problem, as the error lists it)
    "multi-token prediction": (dict(mtp_num_layers=1), "multi-token prediction (mtp_num_layers / "
                               "--mtp-num-layers) is not supported: its MTP layers expect a single [s, b, h] stream. "
                               "Set mtp_num_layers=None."),
    "fused TP inference": (dict(inference_fuse_tp_communication=True), "inference_fuse_tp_communication fuses the "
                           "residual add and the next layer's norm into the TP reduce-scatter, which has no SiameseNorm "
                           "form. Set it to False."),
    "expert-parallel overlap": (dict(num_moe_experts=2, overlap_moe_expert_parallel_comm=True),
                                "overlap_moe_expert_parallel_comm runs each layer's submodules from Megatron's own "
                                "schedule plan, around the layer's forward that carries the two streams. Set it to "
                                "False."),
    "qk layernorm": (dict(qk_layernorm=True), "qk_layernorm is set but this SiameseNorm layer spec has no QK-norm."),
    "qk l2 norm": (dict(qk_l2_norm=True), "qk_l2_norm (Llama 4's parameter-free L2 QK-norm) is not supported: "
                   "SiameseNorm's specs put a learned norm in the QK-norm slots. Set qk_l2_norm=False "
                   "(qk_layernorm=True for QK-norm)."),
    "heterogeneous blocks": (dict(heterogeneous_block_specs=True), "heterogeneous_block_specs is not supported: every "
                             "SiameseNorm layer must have the same structure. Set it to False."),
    # Megatron main's hyper-connections flag (absent from 0.16.1) is refused whenever set
    "hyper-connections": (dict(enable_mhc_connections=True), "Megatron's hyper-connections (enable_mhc_connections / "
                          "--enable-mhc-connections) replace the residual stream that SiameseNorm splits in two. "
                          "Disable them."),
    "fp32 residual": (dict(fp32_residual_connection=True), "fp32_residual_connection keeps Megatron's single residual "
                      "stream in fp32; SiameseNorm's two streams stay in the activation dtype. Set it to False."),
    # megatron-core >= 0.19's chunked MLP (absent from 0.16.1) is refused whenever set
    "chunked mlp": (dict(mlp_chunks_for_training=2), "mlp_chunks_for_training / mlp_chunks_for_prefill (chunked MLP) "
                    "are not implemented by SiameseNorm layers yet. Set them to 1."),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_configuration_is_refused_at_construction(megatron_single_rank, name):
    config = config_with()
    settings, problem = UNSUPPORTED[name]
    for key, value in settings.items():
        # set after construction: TransformerConfig's own checks would need TE for some
        setattr(config, key, value)
    with pytest.raises(UnsupportedConfigError) as refused:
        build_layer(config)
    lines = str(refused.value).splitlines()
    assert lines[0] == "SiameseNorm cannot build this layer:"
    assert [line.startswith("- ") for line in lines[1:]] == [True], lines  # this one problem, and only it
    assert lines[1].startswith(f"- {problem}"), lines[1]
