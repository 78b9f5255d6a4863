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


@pytest.mark.parametrize("zero_centered", [False, True])
def test_stream_norms_initialize_again_after_a_meta_device_build(megatron_single_rank, zero_centered):
    """Megatron's meta-device initialization builds modules without storage, then calls each one's
    reset_parameters: every norm module of ours must give its init values back."""
    from megatron_siamese.norms import ChannelScale

    config = config_with(layernorm_zero_centered_gamma=zero_centered)
    for norm_class in (TorchNorm, ChannelScale):
        built = norm_class(config=config, hidden_size=16)
        with torch.device("meta"):
            deferred = norm_class(config=config, hidden_size=16)
        deferred.to_empty(device="cpu")
        deferred.reset_parameters()
        for (name, expected), (_, got) in zip(built.named_parameters(), deferred.named_parameters()):
            assert torch.equal(got, expected), f"{norm_class.__name__}.{name}"


def test_a_blocks_extracted_layer_output_merges_to_what_the_final_norm_normalizes(megatron_single_rank):
    """``TransformerBlock.forward(extract_layer_indices=...)`` (0.19) hands out the layers' packed
    streams; ``final_layernorm.merged`` makes one the [s, b, h] residual: for the last layer,
    FinalNorm of it is the block's output."""
    import inspect

    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_siamese.check.step import ModelCase, build_seeded_chunks, case_config, microbatches
    from megatron_siamese.norms import TorchNorm
    from megatron_siamese.runtime.layout import Layout

    if "extract_layer_indices" not in inspect.signature(TransformerBlock.forward).parameters:
        pytest.skip("this megatron-core's TransformerBlock has no extract_layer_indices (0.19 has)")
    case = ModelCase(num_layers=2)
    (model,) = build_seeded_chunks(case, case_config(case, Layout()))
    batch = microbatches(case)[0]
    hidden = model.embedding(batch["tokens"], batch["position_ids"])
    output, (first, last) = model.decoder(hidden, batch["attention_mask"], extract_layer_indices={0, 1})
    h = model.config.hidden_size
    assert first.shape[-1] == last.shape[-1] == 2 * h  # the packed streams, as the layers return them
    final = model.decoder.final_layernorm
    assert final.merged(last).shape == output.shape
    torch.testing.assert_close(TorchNorm.forward(final, final.merged(last)), output, rtol=0, atol=0)
    assert not torch.allclose(TorchNorm.forward(final, final.merged(first)), output)


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


# (TransformerConfig settings, as the constructor takes them, the refusal's one problem as the error
# lists it, whole, as a user reads it: entries alike in shape, one per setting); a setting this stack's
# TransformerConfig lacks is refused whenever a newer one sets it
UNSUPPORTED = {
    "expert-parallel overlap": (dict(num_moe_experts=2, overlap_moe_expert_parallel_comm=True, bf16=True,
                                     params_dtype=torch.bfloat16, moe_token_dispatcher_type="alltoall",
                                     expert_model_parallel_size=2),
                                "overlap_moe_expert_parallel_comm runs each layer's submodules from Megatron's own "
                                "schedule plan, around the layer's own forward (the two streams, or the baselines' "
                                "norm placement). Set it to False."),
    "qk layernorm": (dict(qk_layernorm=True), "qk_layernorm is set but this SiameseNorm layer spec has no QK-norm."),
    "qk l2 norm": (dict(qk_l2_norm=True), "qk_l2_norm (Llama 4's parameter-free L2 QK-norm) is not supported: "
                   "SiameseNorm's specs put a learned norm in the QK-norm slots. Set qk_l2_norm=False "
                   "(qk_layernorm=True for QK-norm)."),
    "heterogeneous blocks": (dict(heterogeneous_block_specs=True), "heterogeneous_block_specs is not supported: every "
                             "SiameseNorm layer must have the same structure. Set it to False."),
    "activation offloading": (dict(fine_grained_activation_offloading=True, offload_modules=["core_attn"]),
                              "fine_grained_activation_offloading offloads the single-stream norm inputs."),
    # a spec built for standard attention given a config that asks for MLA (the spec functions and the
    # module-level objects follow the config; this spec was built without it)
    "multi-latent attention": (dict(multi_latent_attention=True), "this SiameseNorm layer spec builds standard "
                               "attention but the config asks for multi-latent attention"),
    # Megatron main's hyper-connections flag (absent from 0.16.1 and 0.19.2) is refused whenever set
    "hyper-connections": (dict(enable_mhc_connections=True), "Megatron's hyper-connections (enable_mhc_connections / "
                          "--enable-mhc-connections) replace the residual stream that SiameseNorm splits in two. "
                          "Disable them."),
    "fp32 residual": (dict(fp32_residual_connection=True), "fp32_residual_connection keeps Megatron's single residual "
                      "stream in fp32; SiameseNorm's two streams stay in the activation dtype. Set it to False."),
    "post-layernorm residual": (dict(apply_residual_connection_post_layernorm=True),
                                "apply_residual_connection_post_layernorm conflicts with SiameseNorm's own residual"),
    # megatron-core >= 0.19's chunked MLP (absent from 0.16.1) is refused whenever set
    "chunked mlp": (dict(mlp_chunks_for_training=2), "mlp_chunks_for_training / mlp_chunks_for_prefill (chunked MLP) "
                    "are not implemented by SiameseNorm layers yet. Set them to 1."),
    "FP8 on local modules": (dict(fp8="hybrid"), "fp8='hybrid' needs Transformer Engine's modules, but "
                             "transformer_impl='local' builds Megatron's own"),
    "inference-optimized layers": (dict(transformer_impl="inference_optimized", normalization="RMSNorm",
                                        add_bias_linear=False),
                                   "transformer_impl='inference_optimized' builds Megatron's inference_optimized layers"),
    "fused TP inference": (dict(transformer_impl="inference_optimized", normalization="RMSNorm", add_bias_linear=False,
                                inference_fuse_tp_communication=True),
                           "inference_fuse_tp_communication fuses the residual add and the next layer's norm into the "
                           "TP reduce-scatter, which has no SiameseNorm form. Set it to False."),
    "fused residual RMSNorm": (dict(fused_residual_rmsnorm=True, normalization="RMSNorm"),
                               "fused_residual_rmsnorm fuses stock Megatron's single-stream residual add"),
    "MoE router graphs (scope)": (dict(num_moe_experts=2, cuda_graph_impl="local", cuda_graph_scope=["moe_router"]),
                                  "cuda_graph_scope moe_router / moe_preprocess capture half an MoE layer"),
    "MoE router graphs (modules)": (dict(num_moe_experts=2, cuda_graph_impl="local", cuda_graph_modules=["moe_router"]),
                                    "cuda_graph_scope moe_router / moe_preprocess capture half an MoE layer"),
    "TE graphs of the MLP alone": (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp"]),
                                   "Transformer Engine CUDA graphs of the MLP without attention"),
    "TE graphs of the MoE MLP alone": (dict(num_moe_experts=2, cuda_graph_impl="transformer_engine",
                                            cuda_graph_scope=["moe"], moe_expert_capacity_factor=1.0,
                                            moe_pad_expert_input_to_capacity=True),
                                       "Transformer Engine CUDA graphs of the MLP without attention"),
    "standalone MTP stage": (dict(mtp_num_layers=1, mtp_standalone=True),
                             "multi-token prediction on a pipeline stage before the last"),
    "Kitchen on the TE spec": (dict(use_kitchen=True, transformer_impl="transformer_engine"),
                               "use_kitchen builds Kitchen's LayerNorm-fused linears"),
}
# a refusal may come with the one for the setting a case needs besides (inference_fuse_tp_communication
# needs the inference-optimized layers, which are refused too)
ALSO = {"fused TP inference": "transformer_impl='inference_optimized' builds",
        # the local spec this test builds, given a Transformer Engine config, says so too
        "Kitchen on the TE spec": "this layer spec builds Megatron's local modules"}


@pytest.mark.filterwarnings("ignore:cuda_graph_scope is deprecated:DeprecationWarning")  # its 0.16 name, on purpose
@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_configuration_is_refused_at_construction(megatron_single_rank, name):
    """Each refused setting through TransformerConfig(...) itself (its __post_init__ may move or
    rewrite a field: megatron-core 0.19 moves cuda_graph_scope into cuda_graph_modules), on the
    spec the trainer builds: the refusal lists that one problem."""
    import dataclasses as dc

    from megatron_siamese.check.step import config_overrides
    from megatron_siamese.config import SiameseTransformerConfig
    from megatron_siamese.runtime.gpt import transformer_config

    settings, problem = UNSUPPORTED[name]
    known = {f.name for f in dc.fields(SiameseTransformerConfig)}
    config = transformer_config(CASE, Layout(), **config_overrides(CASE),
                                **{k: v for k, v in settings.items() if k in known})  # the constructor's own checks
    for key in set(settings) - known:  # not a setting of this megatron-core: refused whenever a newer one sets it
        setattr(config, key, settings[key])
    spec = get_siamese_layer_local_spec(num_experts=config.num_moe_experts or None,
                                        qk_layernorm=config.qk_layernorm and name != "qk layernorm")
    with pytest.raises(UnsupportedConfigError) as refused:
        build_module(spec, config=config, layer_number=1)
    lines = str(refused.value).splitlines()
    assert lines[0] == "SiameseNorm cannot build this layer:"
    problems = [line[2:] for line in lines[1:] if line.startswith("- ")]
    expected = [problem] + ([ALSO[name]] if name in ALSO else [])
    assert len(problems) == len(expected), lines  # these problems, and only them
    for want in expected:
        assert any(found.startswith(want) for found in problems), (want, problems)


def test_a_siamese_layer_inside_a_multi_token_prediction_layer_is_refused(megatron_single_rank):
    """A SiameseNorm model's MTP layers are stock layers (specs.get_mtp_block_spec); Megatron's
    MTP block built from the SiameseNorm layer spec instead is refused by name (0.19 flags the
    layer is_mtp_layer, 0.16 numbers it after the decoder), and the stock one builds."""
    from megatron.core.models.gpt import GPTModel

    from megatron_siamese.specs import get_mtp_block_spec, get_siamese_block_spec

    config = config_with(mtp_num_layers=1)

    def gpt(mtp_block_spec):
        return GPTModel(config, get_siamese_block_spec(config), vocab_size=CASE.vocab_size,
                        max_sequence_length=CASE.seq_length, mtp_block_spec=mtp_block_spec)

    stock = get_mtp_block_spec(config, use_transformer_engine=False)
    model = gpt(stock)
    assert type(model.mtp.layers[0]).__name__ == "MultiTokenPredictionLayer"
    # Megatron's get_gpt_mtp_block_spec takes only TransformerLayer specs: put ours in its slot by hand
    layer = stock.layer_specs[0]
    slot = "transformer_layer" if hasattr(layer.submodules, "transformer_layer") else "mtp_model_layer"
    siamese = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, **{slot: get_siamese_layer_local_spec()}))
    with pytest.raises(UnsupportedConfigError, match="it is a multi-token prediction layer's.*get_mtp_block_spec"):
        gpt(dataclasses.replace(stock, layer_specs=[siamese]))


@pytest.mark.filterwarnings("ignore:cuda_graph_scope is deprecated:DeprecationWarning")
@pytest.mark.parametrize("scope, attention, mlp", [(["attn"], True, False), (["attn", "mlp"], True, True)])
def test_a_partial_cuda_graph_covers_the_stream_norms_of_what_it_captures(megatron_single_rank, scope, attention, mlp):
    """With the distributed optimizer's overlap_param_gather, Megatron re-runs the parameter
    all-gather waits of the modules a partial CUDA graph covers at each replay: the captured
    sublayers' stream norms (and the merge, with the MLP) read parameters too."""
    from megatron_siamese.check.step import config_overrides
    from megatron_siamese.runtime.gpt import transformer_config
    from megatron_siamese.specs import get_siamese_layer_local_spec as local_spec

    config = transformer_config(CASE, Layout(), **config_overrides(CASE), cuda_graph_impl="transformer_engine",
                                cuda_graph_scope=scope)
    layer = build_module(local_spec(merge_at_output=True), config=config, layer_number=CASE.num_layers)
    covered = layer._get_submodules_under_cudagraphs()

    def has(module):
        return any(module is c for c in covered)

    assert has(layer.self_attention) and has(layer.input_layernorm)  # the stock layer's own list
    assert has(layer.attn_x_norm) and has(layer.attn_y_norm)
    assert (has(layer.mlp_x_norm), has(layer.mlp_y_norm), has(layer.output_merge)) == (mlp, mlp, mlp)
    whole = build_module(local_spec(), config=config_with(), layer_number=1)  # no scope: the layer itself
    assert whole._get_submodules_under_cudagraphs() == [whole]


def test_a_packed_batch_reaches_an_moe_layer_per_sample(megatron_single_rank):
    """A packed (THD) batch flattened to [mbs * s, 1, 2h]: as the stock layer of megatron-core
    >= 0.19 does, the MoE MLP sees it as [s, mbs, h], so its per-sequence aux loss counts each
    sample's sequence (megatron-core 0.16 had no such step: there, as stock, nothing changes)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_siamese.specs import get_siamese_layer_local_spec as local_spec

    config = config_with(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, add_bias_linear=False,
                         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
                         moe_token_dispatcher_type="allgather")
    layer = build_module(local_spec(num_experts=4), config=config, layer_number=2)
    assert isinstance(layer.mlp, MoELayer)
    samples, seq, h = 2, 8, CASE.hidden_size
    streams = torch.randn(seq, samples, 2 * h)
    seen = []
    original = layer.mlp.forward

    def recording(hidden_states, *args, **kwargs):
        seen.append(tuple(hidden_states.shape))
        return original(hidden_states, *args, **kwargs)

    layer.mlp.forward = recording
    flat = streams.transpose(0, 1).reshape(samples * seq, 1, 2 * h)  # sample 0's tokens, then sample 1's
    cu = torch.tensor([0, seq, 2 * seq], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq, max_seqlen_kv=seq)
    packed.tokens_per_sample = seq
    out_flat = layer._forward_mlp(flat, packed_seq_params=packed)
    out = layer._forward_mlp(streams)
    stock_unflattens = hasattr(layer, "_maybe_unflatten_for_moe")
    assert seen[0] == ((seq, samples, h) if stock_unflattens else (samples * seq, 1, h))
    assert seen[1] == (seq, samples, h)
    if stock_unflattens:  # the same routing and experts as the unflattened batch, flattened back
        torch.testing.assert_close(out_flat, out.transpose(0, 1).reshape(samples * seq, 1, 2 * h))


def test_autocast_runs_the_pytorch_path_and_refuses_the_fused_ops_when_insisted(megatron_single_rank):
    """enable_autocast: the sublayers run in autocast's dtype and the streams in params_dtype; the
    fused ops take one dtype, so the layer takes the PyTorch path (the same function), and
    insisting on the fused ops is refused at construction with the reason."""
    from megatron_siamese.stream_arithmetic import TorchStreamArithmetic

    layer = build_layer(config_with(enable_autocast=True, siamese_fused_ops=None), layer_number=2)
    assert isinstance(layer.stream_arithmetic.on(torch.device("cpu")), TorchStreamArithmetic)
    streams = torch.randn(CASE.seq_length, 2, 2 * CASE.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = layer(hidden_states=streams, attention_mask=attention_mask())
    assert output.shape == streams.shape
    with pytest.raises(RuntimeError, match="enable_autocast runs the sublayers in autocast's dtype"):
        build_layer(config_with(enable_autocast=True, siamese_fused_ops=True))
