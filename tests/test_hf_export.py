"""Export to Hugging Face Transformers and back, in one process (megatron_siamese/hf/).

The exported directory, loaded with ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` and no network, computes the one-rank Megatron model's logits (fp32,
1e-5 relative) for LayerNorm and RMSNorm, SwiGLU and GELU, RoPE and learned positions, tied and
untied embeddings, biases, GQA, zero-centred gamma, the hybrid variant and the Megatron-LM
layer-spec model; planted bugs (no depth scale, swapped merge norms) are caught; the weight
conversion round-trips bit for bit; ``generate()`` with its KV cache decodes what a no-cache
greedy loop decodes; the tokenizer reproduces ByteTokenizer's ids; a Pre-Norm model exports as
transformers' own LlamaForCausalLM, and what Llama cannot compute is refused naming the setting.
Checkpoints saved under TP/PP layouts and the two commands: tests/test_hf_commands.py.
"""

import contextlib
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_siamese.check.case import ModelCase  # noqa: E402
from megatron_siamese.check.step import build_seeded_chunks  # noqa: E402
from megatron_siamese.hf import convert  # noqa: E402
from megatron_siamese.hf.architecture import ExportError  # noqa: E402
from megatron_siamese.hf.export import load_exported, verify, write_directory  # noqa: E402
from megatron_siamese.runtime.gpt import transformer_config  # noqa: E402
from megatron_siamese.runtime.layout import Layout  # noqa: E402

VOCAB = 320  # the byte-level GPT's padded vocabulary (training/args.py)
RTOL = 1e-5

CASES = {
    "rmsnorm-swiglu-rope-tied": ModelCase(normalization="RMSNorm", add_bias_linear=False, vocab_size=VOCAB),
    "layernorm-gelu-learned-untied-bias-qk-norm": ModelCase(
        gated_linear_unit=False, position_embedding_type="learned_absolute", share_embeddings_and_output_weights=False,
        qk_layernorm=True, vocab_size=VOCAB),
    "hybrid-rmsnorm-zero-centred-mha": ModelCase(norm="siamese-hybrid", normalization="RMSNorm", zero_centered_gamma=True,
                                                 num_query_groups=None, add_bias_linear=False, vocab_size=VOCAB),
    "hybrid-layernorm-gelu-learned": ModelCase(norm="siamese-hybrid", gated_linear_unit=False,
                                               position_embedding_type="learned_absolute", vocab_size=VOCAB),
    "layer-spec-layernorm": ModelCase(norm="siamese-layer", vocab_size=VOCAB),
}
LLAMA_CASE = ModelCase(norm="pre", normalization="RMSNorm", add_bias_linear=False, vocab_size=VOCAB,
                       share_embeddings_and_output_weights=False)


def megatron_model(case):
    config = transformer_config(case, Layout())
    (model,) = build_seeded_chunks(case, config)
    return model.eval()


def tokens(case, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 258, (batch, case.seq_length), generator=generator)  # bytes, EOD, padding


def megatron_logits(model, ids):
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        return model(ids, torch.arange(s).expand_as(ids), causal)


def relative_error(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def exported(megatron_module_rank, tmp_path_factory):
    """{case name: (Megatron model, exported directory)}, each exported once for the module."""
    out = {}
    for name, case in {**CASES, "llama": LLAMA_CASE}.items():
        model = megatron_model(case)
        directory = str(tmp_path_factory.mktemp(name))
        write_directory(model, case.norm, directory)
        out[name] = (case, model, directory)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_exported_logits_equal_megatron(exported, name):
    case, model, directory = exported[name]
    hf = load_exported(directory)
    assert type(hf).__name__ == "SiameseNormForCausalLM"
    ids = tokens(case)
    assert relative_error(hf(ids).logits, megatron_logits(model, ids)) < RTOL


def test_the_comparison_catches_a_dropped_depth_scale_and_swapped_merge_norms(exported, tmp_path):
    case, model, directory = exported["rmsnorm-swiglu-rope-tied"]
    ids = tokens(case)
    expected = megatron_logits(model, ids)
    hf = load_exported(directory)
    for layer in hf.model.layers:
        layer.depth_scale = 1.0  # export "without c = sqrt(2L)"
    assert relative_error(hf(ids).logits, expected) > 1e-3
    hf = load_exported(directory)
    with torch.no_grad():  # NormX and NormY swapped at export
        x, y = hf.model.norm_x.weight.clone(), hf.model.norm_y.weight.clone()
        hf.model.norm_x.weight.copy_(y)
        hf.model.norm_y.weight.copy_(x)
    assert not torch.equal(x, y)
    assert relative_error(hf(ids).logits, expected) > 1e-3


def test_exported_model_equals_the_reference_gpt(exported):
    from reference_model.gpt import ReferenceGPT, ReferenceGPTConfig

    case, model, directory = exported["hybrid-layernorm-gelu-learned"]
    reference = ReferenceGPT(ReferenceGPTConfig.from_megatron(
        model.config, VOCAB, case.seq_length, position_embedding_type=case.position_embedding_type,
        share_embeddings_and_output_weights=case.share_embeddings_and_output_weights, variant="hybrid"))
    reference.load_megatron_state_dict(model.state_dict())
    ids = tokens(case)
    with torch.no_grad():
        assert relative_error(load_exported(directory)(ids).logits, reference(ids)) < RTOL


@pytest.mark.parametrize("name", sorted(CASES) + ["llama"])
def test_conversion_round_trips_bit_for_bit(exported, name):
    case, model, directory = exported[name]
    with open(os.path.join(directory, "config.json")) as source:
        config = json.load(source)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(directory, "model.safetensors"))
    back = convert.hf_to_megatron(saved, config, pre_norm=name == "llama")
    original = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if case.norm == "siamese-layer":  # the layer spec keeps the merge in its last layer
        last = f"decoder.layers.{case.num_layers - 1}.output_merge."
        original = {(("decoder.final_layernorm.merge." + k[len(last):]) if k.startswith(last) else k): v
                    for k, v in original.items()}
    assert back.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(back[key], value), key


def test_generate_with_kv_cache_equals_greedy_without(exported):
    case, _, directory = exported["rmsnorm-swiglu-rope-tied"]
    hf = load_exported(directory)
    prompt = tokens(case, batch=1)[:, :5]
    cached = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, min_new_tokens=8)
    sequence = prompt
    with torch.no_grad():
        for _ in range(8):
            step = hf(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, step], dim=1)
    assert torch.equal(cached, sequence)


def test_tokenizer_round_trips_byte_tokenizer_ids(exported):
    from transformers import AutoTokenizer

    from megatron_siamese.data.corpus import ByteTokenizer

    _, _, directory = exported["rmsnorm-swiglu-rope-tied"]
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ours = ByteTokenizer()
    for text in ("In the beginning God created the heaven and the earth.", " naïve café — 日本語 🙂\t\r\n"):
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.tokenize(text)
        assert tokenizer.decode(ids) == text == ours.detokenize(ids)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (ours.eod, ours.pad)


def test_pre_norm_exports_as_stock_llama(exported):
    case, model, directory = exported["llama"]
    assert not os.path.exists(os.path.join(directory, "modeling_siamese.py"))
    hf = load_exported(directory)
    assert isinstance(hf, transformers.LlamaForCausalLM)
    ids = tokens(case)
    assert relative_error(hf(ids).logits, megatron_logits(model, ids)) < RTOL


@pytest.mark.parametrize("change, named", [
    (dict(normalization="LayerNorm", add_bias_linear=False), "--normalization LayerNorm"),
    (dict(add_bias_linear=True), "--add-bias-linear"),
    (dict(qk_layernorm=True), "--qk-layernorm"),
])
def test_pre_norm_without_a_stock_equivalent_is_refused(megatron_single_rank, tmp_path, change, named):
    import dataclasses

    case = dataclasses.replace(LLAMA_CASE, **change)
    with pytest.raises(ExportError, match=named):
        write_directory(megatron_model(case), "pre", str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("change, named", [
    (dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
          num_query_groups=None), r"^--multi-latent-attention \(multi-latent attention\) has no export yet"),
    (dict(mtp_num_layers=1), r"^--mtp-num-layers \(multi-token prediction\) has no export yet"),
], ids=["mla", "mtp"])
def test_a_built_mla_or_mtp_model_is_refused_by_name(megatron_single_rank, tmp_path, change, named):
    """``write_directory`` on a model built here (the Python API's route, past ``exportable``)."""
    import dataclasses

    case = dataclasses.replace(CASES["rmsnorm-swiglu-rope-tied"], **change)
    with pytest.raises(ExportError, match=named):
        write_directory(megatron_model(case), case.norm, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_batched_left_padded_generate_equals_one_prompt_at_a_time(exported):
    """What lm-eval's batched generation does: prompts of different lengths, left-padded with an
    attention mask, decode as each prompt alone (positions count from the first real token)."""
    _, _, directory = exported["layernorm-gelu-learned-untied-bias-qk-norm"]
    hf = load_exported(directory)
    prompts = [list(b"In the b"), list(b"And")]  # + 6 new tokens within the 16 learned positions
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[257] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    for row, prompt in enumerate(prompts):
        alone = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert batched[row, width:].tolist() == alone[0, len(prompt):].tolist()
    # the mask is what makes it so: attending to the padding changes the padded prompt's decode
    unmasked = hf.generate(ids, attention_mask=torch.ones_like(mask), max_new_tokens=6, do_sample=False,
                           min_new_tokens=6)
    assert unmasked[1, width:].tolist() != batched[1, width:].tolist()


@contextlib.contextmanager
def nothing_warned():
    """Fails the test if the block emits a Python warning or logs a record at WARNING or above.

    Transformers' deprecation notices mostly go through its own logger (``logger.warning_once``,
    printed as ``[transformers] ...``), not through ``warnings``. That logger does not propagate to
    the root logger outside CI (so pytest's caplog alone would not see it), may have been quietened
    by other code, and ``warning_once`` is cached per process (a notice an earlier test triggered
    would stay silent here): so a handler is attached to it directly, its level is at most WARNING
    for the block and the once-caches are cleared first. Every warning is recorded ("always")
    rather than raised, so that none is swallowed by an ``except`` inside the library and all of
    them are named."""
    import logging
    import warnings

    from transformers.utils import logging as transformers_logging

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record not in records:  # seen twice when the library's logger propagates (CI=1)
                records.append(record)

    handler = Collect(logging.WARNING)
    library = transformers_logging.get_logger()  # the library's root logger, "transformers"
    loggers = (library, logging.getLogger())  # and any other library logging through the root
    level = library.level
    library.setLevel(min(library.getEffectiveLevel(), logging.WARNING))
    transformers_logging.warning_once.cache_clear()
    transformers_logging.info_once.cache_clear()
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        library.setLevel(level)
    problems = [f"warning {w.category.__name__} at {w.filename}:{w.lineno}: {w.message}" for w in caught]
    problems += [f"logged {r.levelname} by {r.name} at {r.pathname}:{r.lineno}: {r.getMessage()}" for r in records]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("call", ["as-reviewed", "left-padded-batch"])
def test_exported_model_loads_and_generates_without_a_warning(exported, call):
    """What a user runs on an export (from_pretrained with remote code, then generate) warns and
    logs nothing: the modeling file speaks the installed transformers' current cache API
    (``past_key_values`` into forward and back in the output), so no deprecation notice, and no
    other notice either. The call as reported in review (no attention mask, default generation
    settings) and lm-eval's (a left-padded batch with its mask). That they decode what greedy
    decoding without the cache decodes: the tests above."""
    from transformers import AutoModelForCausalLM

    name = "rmsnorm-swiglu-rope-tied" if call == "as-reviewed" else "layernorm-gelu-learned-untied-bias-qk-norm"
    case, _, directory = exported[name]
    if call == "as-reviewed":
        kwargs = dict(inputs=tokens(case, batch=1)[:, :5])
    else:
        prompts = [list(b"In the b"), list(b"And")]
        width = max(len(p) for p in prompts)
        kwargs = dict(inputs=torch.tensor([[257] * (width - len(p)) + p for p in prompts]),
                      attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]))
    with nothing_warned():
        hf = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, local_files_only=True)
        hf.generate(**kwargs, max_new_tokens=4)


def test_transformer_engine_names_convert_like_the_local_ones(exported):
    """A GPU checkpoint of the Transformer Engine spec keeps each InputNorm inside the next linear
    layer (``linear_qkv.layer_norm_weight``): exported to the same tensors."""
    _, model, directory = exported["layernorm-gelu-learned-untied-bias-qk-norm"]
    with open(os.path.join(directory, "config.json")) as source:
        config = json.load(source)
    local = model.state_dict()
    te = {name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
              .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"): value for name, value in local.items()}
    assert te.keys() != local.keys()
    expected, actual = convert.megatron_to_hf(local, config), convert.megatron_to_hf(te, config)
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)


def test_bf16_checkpoints_export_in_bf16_and_verify(megatron_single_rank, tmp_path):
    """bf16 weights stay bf16; the export's own check runs the Megatron model as the trainer does
    (Float16Module) and accepts bf16 rounding, and only that: a misplaced weight fails it."""
    import dataclasses

    case = dataclasses.replace(CASES["hybrid-layernorm-gelu-learned"], dtype="bf16", fused_ops=False)
    model = megatron_model(case)
    directory = str(tmp_path)
    write_directory(model, case.norm, directory)
    assert load_exported(directory).dtype == torch.bfloat16
    assert verify(model, directory) < 5e-2
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(directory, "model.safetensors"))
    weights["model.norm_x.weight"], weights["model.norm_y.weight"] = weights["model.norm_y.weight"], weights[
        "model.norm_x.weight"]
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="differ from the checkpoint's"):
        verify(model, directory)


def _has_hybrid_model() -> bool:
    from megatron_siamese.versions import installed_megatron_core, release

    return release(installed_megatron_core()) >= (0, 19, 0)


@pytest.mark.skipif(not _has_hybrid_model(), reason="HybridModel needs megatron-core >= 0.19 (the 0.19 leg runs this)")
def test_star_dash_hybrid_model_exports_as_the_gpt_it_equals(megatron_single_rank, tmp_path):
    import dataclasses

    from megatron_siamese.hf.export import exportable
    from megatron_siamese.runtime.settings import ModelSettings

    case = dataclasses.replace(CASES["rmsnorm-swiglu-rope-tied"], model="hybrid", num_layers=2)  # '*-*-'
    model = megatron_model(case)
    config = write_directory(model, case.norm, str(tmp_path))
    assert config["num_hidden_layers"] == 2
    ids = tokens(case)
    assert relative_error(load_exported(str(tmp_path))(ids).logits, megatron_logits(model, ids)) < RTOL
    assert "'*-*M'" in exportable(ModelSettings(model="hybrid", hybrid_layer_pattern="*-*M"))
