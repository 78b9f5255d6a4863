"""Weights between a whole (one-rank) Megatron GPTModel and the Hugging Face layout, both ways.

Plain torch on state dicts, no Megatron import: the Megatron side is a one-rank GPTModel's ``state_dict()``
(TE's InputNorm names read too), the Hugging Face side ``SiameseNormForCausalLM`` or, for a Pre-Norm model,
transformers' ``LlamaForCausalLM``. A renaming plus the QKV and gated-MLP splits, so a round trip is bit-exact.
The name table: docs/export.md, "Weight names".
"""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

import torch

# per-layer renames (Megatron suffix, Hugging Face suffix) that move a tensor unchanged
_LAYER_NAMES = (
    ("self_attention.linear_proj.", "self_attn.o_proj."),
    ("self_attention.q_layernorm.", "self_attn.q_norm."),
    ("self_attention.k_layernorm.", "self_attn.k_norm."),
    ("mlp.linear_fc2.", "mlp.down_proj."),
    ("input_layernorm.", "input_layernorm."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
    ("attn_y_norm.", "attn_y_norm."),
    ("mlp_x_norm.", "mlp_x_norm."),
    ("mlp_y_norm.", "mlp_y_norm."),
)
_TOP_NAMES = (
    ("embedding.word_embeddings.", "model.embed_tokens."),
    ("embedding.position_embeddings.", "model.embed_positions."),
    ("decoder.final_layernorm.merge.x_norm.", "model.norm_x."),
    ("decoder.final_layernorm.merge.y_norm.", "model.norm_y."),
    ("decoder.final_layernorm.", "model.norm."),
    ("output_layer.", "lm_head."),
)


def _qkv_sizes(config: Mapping) -> Tuple[int, int, int]:
    """(query groups, query heads per group, head dim)."""
    groups = config["num_key_value_heads"]
    return groups, config["num_attention_heads"] // groups, config["head_dim"]


def split_qkv(qkv: torch.Tensor, config: Mapping) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused ``linear_qkv`` weight [(heads + 2 groups) d, h] (or bias) -> q, k, v."""
    groups, per_group, d = _qkv_sizes(config)
    grouped = qkv.reshape(groups, (per_group + 2) * d, *qkv.shape[1:])
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return (q.reshape(groups * per_group * d, *qkv.shape[1:]), k.reshape(groups * d, *qkv.shape[1:]),
            v.reshape(groups * d, *qkv.shape[1:]))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Mapping) -> torch.Tensor:
    groups, per_group, d = _qkv_sizes(config)
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest),
                       v.reshape(groups, d, *rest)], dim=1)
    return fused.reshape(groups * (per_group + 2) * d, *rest)


def _layer_index(name: str) -> Tuple[int, str]:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> (3, ``mlp.linear_fc1.weight``)."""
    index, rest = name[len("decoder.layers."):].split(".", 1)
    return int(index), rest


def _rename(name: str, pairs) -> str:
    for megatron, hf in pairs:
        if name.startswith(megatron):
            return hf + name[len(megatron):]
    raise KeyError(name)


# Transformer Engine's layer fuses each InputNorm into the next linear layer: its names for them
_TE_INPUT_NORMS = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                   ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def local_names(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A Transformer Engine GPTModel's state dict with its InputNorms under the local spec's names."""
    renamed = {}
    for name, tensor in state.items():
        for te, local in _TE_INPUT_NORMS:
            if te in name:
                name = name.replace(te, local)
        renamed[name] = tensor
    return renamed


_MLP_SIDE = ("mlp.", "mlp_x_norm.", "mlp_y_norm.", "pre_mlp_layernorm.")


def hybrid_to_gpt_names(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A ``*-*-...`` HybridModel's state dict under the equivalent GPTModel's names (hybrid layer 2i holds GPT
    layer i's attention side, 2i + 1 its MLP side)."""
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("decoder.layers."):
            index, rest = _layer_index(name)
            if index % 2 != rest.startswith(_MLP_SIDE) and not rest.endswith("_extra_state"):
                raise ValueError(f"{name} is not where a '*-' pattern keeps it")
            name = f"decoder.layers.{index // 2}.{rest}"
        renamed[name.replace("decoder.final_norm.", "decoder.final_layernorm.")] = tensor
    return renamed


def megatron_to_hf(state: Mapping[str, torch.Tensor], config: Mapping, pre_norm: bool = False) -> Dict[str, torch.Tensor]:
    """The Hugging Face state dict of a one-rank GPTModel's ``state`` (``config``: the Hugging Face config);
    refuses any tensor it has no place for."""
    last = f"decoder.layers.{config['num_hidden_layers'] - 1}.output_merge."
    hybrid = config.get("siamese_variant") == "hybrid"
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in local_names(state).items():
        if name.endswith("_extra_state"):
            continue
        if name.startswith(last):  # Megatron-LM --spec: the last layer merges the streams
            name = "decoder.final_layernorm.merge." + name[len(last):]
        if not name.startswith("decoder.layers."):
            out[_rename(name, _TOP_NAMES)] = tensor
            continue
        index, rest = _layer_index(name)
        prefix = f"model.layers.{index}."
        kind = rest.rsplit(".", 1)[-1]  # weight or bias
        if rest.startswith("self_attention.linear_qkv."):
            for part, value in zip(("q", "k", "v"), split_qkv(tensor, config)):
                out[f"{prefix}self_attn.{part}_proj.{kind}"] = value
        elif rest.startswith("mlp.linear_fc1."):
            if config.get("gated_mlp", pre_norm):
                gate, up = tensor.chunk(2, dim=0)
                out[f"{prefix}mlp.gate_proj.{kind}"], out[f"{prefix}mlp.up_proj.{kind}"] = gate, up
            else:
                out[f"{prefix}mlp.up_proj.{kind}"] = tensor
        elif rest.startswith("attn_x_norm."):
            out[prefix + ("attn_x_scale." if hybrid else "attn_x_norm.") + rest[len("attn_x_norm."):]] = tensor
        else:
            out[prefix + _rename(rest, _LAYER_NAMES)] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_to_megatron(state: Mapping[str, torch.Tensor], config: Mapping, pre_norm: bool = False) -> Dict[str, torch.Tensor]:
    """The inverse of ``megatron_to_hf``, under a Python-API GPTModel's names."""
    top = {hf: megatron for megatron, hf in _TOP_NAMES}
    layer = {hf: megatron for megatron, hf in _LAYER_NAMES}
    layer["attn_x_scale."] = layer["attn_x_norm."] = "attn_x_norm."
    out: Dict[str, torch.Tensor] = {}
    pending: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if not name.startswith("model.layers."):
            out[_rename(name, top.items())] = tensor
            continue
        index_text, rest = name[len("model.layers."):].split(".", 1)
        index, kind = int(index_text), rest.rsplit(".", 1)[-1]
        prefix = f"decoder.layers.{index}."
        if rest.split(".")[1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") and not (
                rest.startswith("mlp.up_proj") and not config.get("gated_mlp", pre_norm)):
            group = "self_attention.linear_qkv" if rest.startswith("self_attn.") else "mlp.linear_fc1"
            pending.setdefault((index, f"{group}.{kind}"), {})[rest.split(".")[1]] = tensor
        elif rest.startswith("mlp.up_proj."):
            out[f"{prefix}mlp.linear_fc1.{kind}"] = tensor
        else:
            out[prefix + _rename(rest, layer.items())] = tensor
    for (index, name), parts in pending.items():
        if name.startswith("self_attention"):
            fused = fuse_qkv(parts["q_proj"], parts["k_proj"], parts["v_proj"], config)
        else:
            fused = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=0)
        out[f"decoder.layers.{index}.{name}"] = fused
    return out
