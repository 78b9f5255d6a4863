"""Which Hugging Face architecture a Megatron GPTModel is, and its config.json (docs/export.md).

A SiameseNorm model becomes ``SiameseNormForCausalLM`` (modeling_siamese.py, shipped with the weights);
a Pre-Norm model transformers' ``LlamaForCausalLM`` only when its settings are exactly Llama's, else it
is refused naming the setting. Duck-typed on Megatron's GPTModel: no Megatron import.
"""

from __future__ import annotations

from typing import Dict, List

import torch.nn.functional as F

SIAMESE_ARCHITECTURE = "SiameseNormForCausalLM"
LLAMA_ARCHITECTURE = "LlamaForCausalLM"
MODELING_FILE = "modeling_siamese.py"
AUTO_MAP = {"AutoConfig": "modeling_siamese.SiameseNormConfig",
            "AutoModelForCausalLM": "modeling_siamese.SiameseNormForCausalLM"}


class ExportError(ValueError):
    """A model that cannot be exported as asked; the message says which setting and what to do."""


MLA_REFUSED = ("--multi-latent-attention (multi-latent attention) has no export yet (the exported modeling file "
               "computes standard attention): export a model trained without it, or run this one with "
               "megatron-siamese generate")
MTP_REFUSED = ("--mtp-num-layers (multi-token prediction) has no export yet (the exported model has no MTP heads): "
               "export a model trained without it, or run this one with megatron-siamese generate, which leaves the "
               "MTP heads out")


def _activation(config) -> str:
    activation = {F.silu: "silu", F.gelu: "gelu"}.get(config.activation_func)
    if activation is None:
        raise ExportError(f"activation {getattr(config.activation_func, '__name__', config.activation_func)} "
                          "has no export (silu or gelu)")
    return activation


def _unexportable(model) -> List[str]:
    """Settings neither architecture computes (their exact math is not in modeling_siamese.py)."""
    config = model.config
    problems = []
    if config.num_moe_experts:
        problems.append("--num-experts (mixture of experts) has no export yet: export a dense model")
    if model.position_embedding_type not in ("rope", "learned_absolute"):
        problems.append(f"position embedding {model.position_embedding_type!r} has no export (rope or learned_absolute)")
    if getattr(config, "multi_latent_attention", False):  # first: MLA keeps its RoPE, GPTModel has no rotary_pos_emb
        problems.append(MLA_REFUSED)
    elif model.position_embedding_type == "rope" and (getattr(model, "rotary_scaling", False)
                                                       or getattr(model.rotary_pos_emb, "seq_len_interpolation_factor",
                                                                  None)):
        problems.append("RoPE scaling / sequence-length interpolation has no export")
    if getattr(config, "mtp_num_layers", None):  # its heads' weights have no names in the modeling file
        problems.append(MTP_REFUSED)
    return problems


def rotary(model):
    """(base, percent) of the model's RoPE: GPTModel keeps them; HybridModel only its
    RotaryEmbedding's ``inv_freq``, from which they are read back (and checked to reproduce it)."""
    if hasattr(model, "rotary_base"):
        return float(model.rotary_base), float(model.rotary_percent)
    import torch

    inv_freq = model.rotary_pos_emb.inv_freq.detach().float().cpu()
    dim, head = 2 * len(inv_freq), model.config.kv_channels
    base = float(round(float(1.0 / inv_freq[1]) ** (dim / 2))) if len(inv_freq) > 1 else 10000.0
    if not torch.allclose(1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), inv_freq, rtol=1e-6):
        raise ExportError("cannot read this model's RoPE base back from its frequencies")
    return base, (1.0 if dim == head else dim / head)


def common_fields(model) -> Dict[str, object]:
    """The config.json fields both architectures share, read off the built GPTModel."""
    config = model.config
    fields = dict(
        vocab_size=model.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        max_position_embeddings=model.max_sequence_length,
        hidden_act=_activation(config),
        tie_word_embeddings=bool(model.share_embeddings_and_output_weights),
        torch_dtype="float32",
        bos_token_id=256, eos_token_id=256, pad_token_id=257,  # ByteTokenizer's end of document and padding
    )
    return fields


def siamese_config(model, variant: str) -> Dict[str, object]:
    """config.json of SiameseNormForCausalLM for a SiameseNorm GPTModel (``variant``: standard or hybrid)."""
    problems = _unexportable(model)
    if problems:
        raise ExportError(problems[0])
    config = model.config
    rope = model.position_embedding_type == "rope"
    return dict(
        architectures=[SIAMESE_ARCHITECTURE],
        model_type="megatron_siamese",
        auto_map=dict(AUTO_MAP),
        **common_fields(model),
        normalization=config.normalization,
        norm_eps=config.layernorm_epsilon,
        zero_centered_gamma=bool(config.layernorm_zero_centered_gamma),
        gated_mlp=bool(config.gated_linear_unit),
        add_bias_linear=bool(config.add_bias_linear),
        add_qkv_bias=bool(config.add_qkv_bias),
        position_embedding_type=model.position_embedding_type,
        rope_theta=rotary(model)[0] if rope else 10000.0,
        rotary_percent=rotary(model)[1] if rope else 1.0,
        rotary_interleaved=bool(config.rotary_interleaved),
        siamese_variant=variant,
        qk_layernorm=bool(config.qk_layernorm),
    )


def llama_config(model) -> Dict[str, object]:
    """config.json of transformers' LlamaForCausalLM for a Pre-Norm GPTModel, or ExportError naming
    the first setting Llama does not compute."""
    config = model.config
    problems = _unexportable(model) + [problem for wrong, problem in (
        (config.normalization != "RMSNorm", "--normalization LayerNorm: Llama has RMSNorm only"),
        (not config.gated_linear_unit, "--no-swiglu: Llama's MLP is SwiGLU"),
        (model.position_embedding_type != "rope", "--position-embedding-type learned_absolute: Llama has RoPE only"),
        (model.position_embedding_type == "rope" and rotary(model)[1] != 1.0,
         "rotary percent < 1: Llama rotates the whole head"),
        (config.rotary_interleaved, "interleaved RoPE: Llama rotates halves"),
        (config.add_bias_linear or config.add_qkv_bias, "--add-bias-linear: Llama's linear layers have no biases"),
        (config.layernorm_zero_centered_gamma, "--apply-layernorm-1p: Llama's norms store gamma itself"),
        (config.qk_layernorm, "--qk-layernorm: Llama has no QK-norm"),
    ) if wrong]
    if problems:
        raise ExportError(f"this Pre-Norm model has no exact stock Transformers class: {problems[0]}")
    return dict(
        architectures=[LLAMA_ARCHITECTURE],
        model_type="llama",
        **common_fields(model),
        rms_norm_eps=config.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": rotary(model)[0]},
        rope_theta=rotary(model)[0],
        attention_bias=False,
        mlp_bias=False,
    )


# -- back: a Hugging Face config.json as this package's model settings ---------------------

_DEFAULT_EPS, _DEFAULT_ROPE_BASE = 1e-5, 10000.0  # what runtime/gpt.py builds (Megatron's defaults)
# this package's setting names and DeepSeek's config.json names for them
_MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank")
_MTP_FIELDS = ("mtp_num_layers", "num_nextn_predict_layers")


def settings_fields(hf: Dict[str, object], tokens: int) -> Dict[str, object]:
    """ModelSettings fields (runtime/settings.py) of the config.json dict ``hf``, or ExportError naming the
    first field this package's GPT cannot build exactly; ``tokens``: the byte tokenizer's ids, which
    the (padded) vocabulary must hold."""
    model_type = hf.get("model_type")
    if model_type not in ("megatron_siamese", "llama"):
        raise ExportError(f"model_type {model_type!r} is not one this package imports (megatron_siamese, or llama "
                          "for a Pre-Norm model)")
    llama = model_type == "llama"
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    rope = hf.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_BASE)))
    gated = True if llama else bool(hf.get("gated_mlp", True))
    wrong = [problem for bad, problem in (
        (int(hf["vocab_size"]) < tokens,
         f"vocab_size {hf['vocab_size']}: the byte-level tokenizer's {tokens} ids do not fit in it"),
        ((hf.get("head_dim") or hidden // heads) != hidden // heads,
         f"head_dim {hf.get('head_dim')}: this package's GPT has hidden_size / heads = {hidden // heads}"),
        (float(hf.get("rms_norm_eps" if llama else "norm_eps", _DEFAULT_EPS)) != _DEFAULT_EPS,
         f"norm epsilon {hf.get('rms_norm_eps' if llama else 'norm_eps')}: megatron-siamese builds {_DEFAULT_EPS}"),
        (hf.get("hidden_act") != ("silu" if gated else "gelu"),
         f"hidden_act {hf.get('hidden_act')!r}: megatron-siamese pairs SwiGLU with silu and a plain MLP with gelu"),
        (rope_theta != _DEFAULT_ROPE_BASE, f"rope_theta {rope_theta}: megatron-siamese builds {_DEFAULT_ROPE_BASE}"),
        (float(hf.get("rotary_percent", 1.0)) != 1.0, "rotary_percent < 1: megatron-siamese rotates the whole head"),
        (bool(hf.get("rotary_interleaved", False)), "rotary_interleaved: megatron-siamese rotates halves"),
        (bool(hf.get("add_qkv_bias", False)) and not bool(hf.get("add_bias_linear", False)),
         "add_qkv_bias without add_bias_linear: megatron-siamese has no such switch"),
        (llama and (hf.get("attention_bias") or hf.get("mlp_bias")), "Llama biases: megatron-siamese's Pre-Norm has none"),
        (llama and rope.get("rope_type", "default") != "default", f"rope_type {rope.get('rope_type')!r}"),
        # fields export never writes (it refuses these models): the import would build without them
        (any(hf.get(name) for name in _MLA_FIELDS),
         f"{', '.join(name for name in _MLA_FIELDS if hf.get(name))}: multi-latent attention has no import (the "
         "modeling file computes standard attention)"),
        (any(hf.get(name) for name in _MTP_FIELDS),
         f"{', '.join(name for name in _MTP_FIELDS if hf.get(name))}: multi-token prediction layers have no import"),
    ) if bad]
    if wrong:
        raise ExportError(f"cannot import this {model_type} model exactly: {wrong[0]}")
    fields = dict(
        model="gpt",
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        seq_length=int(hf["max_position_embeddings"]),
        gated_linear_unit=gated,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )
    if llama:
        return dict(fields, norm="pre", normalization="RMSNorm", position_embedding_type="rope")
    return dict(
        fields,
        norm="siamese-hybrid" if hf.get("siamese_variant") == "hybrid" else "siamese",
        normalization=hf["normalization"],
        position_embedding_type=hf["position_embedding_type"],
        add_bias_linear=bool(hf.get("add_bias_linear", False)),
        qk_layernorm=bool(hf.get("qk_layernorm", False)),
        zero_centered_gamma=bool(hf.get("zero_centered_gamma", False)),
    )
