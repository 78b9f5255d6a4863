"""A GPT's sizes and its parameter tensors, as Megatron-Core builds them (plain arithmetic).

Every parameter tensor, stock Pre-Norm or SiameseNorm, with how ranks split it (``Parameter.local_numel``), as
Megatron's local and TE specs build them (the same tensors under other names). docs/scale.md, "Where it comes from".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_siamese.runtime.layout import Layout

PRE_NORM = "pre"  # the stock scheme's name (--norm pre): its layers have no stream norms
SIAMESE_SCHEMES = ("siamese", "siamese-layer")  # the schemes the plan models (the standard variant)


@dataclass(frozen=True)
class Shape:
    """The sizes of a GPT, as the plan reads them."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value head groups
    head_dim: int
    ffn: int  # the dense MLP's width
    vocab: int  # padded
    seq: int
    glu: bool  # gated MLP: linear_fc1 is 2 x ffn wide
    layer_norm: bool  # LayerNorm (weight and bias, 2 statistics a token); else RMSNorm (weight, 1)
    biases: bool
    qk_norm: bool
    tied: bool  # embeddings and output layer share one weight
    learned_positions: bool
    rope: bool
    experts: Optional[int] = None
    topk: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    moe_layers: Tuple[bool, ...] = ()  # per layer: an MoE layer
    positions: int = 0  # rows of the learned position table (Megatron-LM's --max-position-embeddings; 0: seq)

    @property
    def norm_statistics(self) -> int:
        """fp32 statistics a norm keeps per token: mean and rstd, or rstd."""
        return 2 if self.layer_norm else 1

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


def shape_of(settings, vocab: int, positions: Optional[int] = None) -> Shape:
    """The ``Shape`` of ``settings`` (runtime.settings.ModelSettings) with a padded vocabulary (and a learned
    position table of ``positions`` rows: its sequence's by default)."""
    from megatron_siamese.runtime.settings import moe_layer_freq

    moe: Tuple[bool, ...] = ()
    if settings.num_moe_experts:
        pattern = moe_layer_freq(settings.moe_layer_freq)
        if isinstance(pattern, int):  # every N-th layer from the first, as Megatron reads it
            moe = tuple(layer % pattern == 0 for layer in range(settings.num_layers))
        else:
            moe = tuple(bool(flag) for flag in pattern)
    heads = settings.num_attention_heads
    return Shape(
        layers=settings.num_layers, hidden=settings.hidden_size, heads=heads,
        groups=settings.num_query_groups or heads, head_dim=settings.hidden_size // heads,
        ffn=settings.mlp_width, vocab=vocab, seq=settings.seq_length, glu=settings.gated_linear_unit,
        layer_norm=settings.normalization == "LayerNorm", biases=settings.add_bias_linear,
        qk_norm=settings.qk_layernorm, tied=settings.share_embeddings_and_output_weights,
        learned_positions=settings.position_embedding_type == "learned_absolute",
        rope=settings.position_embedding_type == "rope",
        experts=settings.num_moe_experts, topk=settings.moe_router_topk if settings.num_moe_experts else 0,
        expert_ffn=settings.expert_width if settings.num_moe_experts else 0,
        shared_expert_ffn=settings.moe_shared_expert_intermediate_size or 0, moe_layers=moe,
        positions=positions or settings.seq_length)


@dataclass(frozen=True)
class Parameter:
    """One parameter tensor of the model (whole), and how ranks split it: ``split`` "tp", "expert" (``count``
    experts over EP, each over expert TP) or "" (whole). ``tp_reduced``: its gradient summed over TP under SP."""

    name: str
    numel: int
    split: str = ""
    count: int = 1
    tp_reduced: bool = False
    qk_norm: bool = False
    fp32: bool = False  # kept in fp32 whatever the model's dtype (the MoE router)
    shared_embedding: bool = False

    @property
    def expert(self) -> bool:
        return self.split == "expert"

    def local_numel(self, layout: Layout) -> int:
        """Elements of this tensor on one rank of ``layout``."""
        if self.split == "tp":
            return self.numel // layout.tp
        if self.split == "expert":
            return (self.count // layout.ep) * (self.numel // layout.expert_tp)
        return self.numel * self.count


def _norms(prefix: str, shape: Shape, names: Tuple[str, ...], size: Optional[int] = None) -> List[Parameter]:
    """Norm parameters: weight (and bias for LayerNorm) of each named norm, whole on every TP rank."""
    width = size or shape.hidden
    kinds = ("weight", "bias") if shape.layer_norm else ("weight",)
    return [Parameter(f"{prefix}{name}.{kind}", width, tp_reduced=True) for name in names for kind in kinds]


def _linear(name: str, rows: int, cols: int, shape: Shape, split_rows: bool, split: str = "tp",
            count: int = 1) -> List[Parameter]:
    """A column-parallel (``split_rows``) or row-parallel linear: its weight split, and its bias:
    split with a column-parallel weight, whole (and summed over TP under SP) with a row-parallel one."""
    found = [Parameter(f"{name}.weight", rows * cols, split=split, count=count)]
    if shape.biases:
        found.append(Parameter(f"{name}.bias", rows, split=split if split_rows else "", count=count,
                               tp_reduced=not split_rows and split == "tp"))
    return found


def _mlp(prefix: str, shape: Shape, width: int, split: str = "tp", count: int = 1) -> List[Parameter]:
    fc1_rows = width * (2 if shape.glu else 1)
    return (_linear(f"{prefix}.linear_fc1", fc1_rows, shape.hidden, shape, True, split, count)
            + _linear(f"{prefix}.linear_fc2", shape.hidden, width, shape, False, split, count))


def layer_parameters(shape: Shape, scheme: str, layer: int) -> List[Parameter]:
    """The parameter tensors of decoder layer ``layer`` (0-based, global) under ``scheme``."""
    h, d = shape.hidden, shape.head_dim
    qkv_rows = (shape.heads + 2 * shape.groups) * d
    found = _norms("", shape, ("input_layernorm",))
    found += _linear("self_attention.linear_qkv", qkv_rows, h, shape, True)
    if shape.qk_norm:
        found += [Parameter(p.name, p.numel, qk_norm=True, tp_reduced=True)
                  for p in _norms("self_attention.", shape, ("q_layernorm", "k_layernorm"), d)]
    found += _linear("self_attention.linear_proj", h, shape.heads * d, shape, False)
    found += _norms("", shape, ("pre_mlp_layernorm",))
    if shape.is_moe(layer):
        found.append(Parameter("mlp.router.weight", shape.experts * h, fp32=True, tp_reduced=True))
        found += _mlp("mlp.experts", shape, shape.expert_ffn, split="expert", count=shape.experts)
        if shape.shared_expert_ffn:
            found += _mlp("mlp.shared_experts", shape, shape.shared_expert_ffn)
    else:
        found += _mlp("mlp", shape, shape.ffn)
    if scheme != PRE_NORM:
        found += _norms("", shape, ("attn_x_norm", "attn_y_norm", "mlp_x_norm", "mlp_y_norm"))
        if scheme == "siamese-layer" and layer == shape.layers - 1:  # the merge lives in the last layer
            found += _norms("output_merge.", shape, ("x_norm", "y_norm"))
    return found


def embedding_parameters(shape: Shape, pipeline: int) -> List[Parameter]:
    """The first stage's embeddings; the word embedding's is one shared with a head elsewhere
    when tied over several pipeline stages (Megatron DDP buckets it alone then)."""
    found = [Parameter("embedding.word_embeddings.weight", shape.vocab * shape.hidden, split="tp",
                       shared_embedding=shape.tied and pipeline > 1)]
    if shape.learned_positions:
        found.append(Parameter("embedding.position_embeddings.weight", (shape.positions or shape.seq) * shape.hidden))
    return found


def head_parameters(shape: Shape, scheme: str, pipeline: int) -> List[Parameter]:
    """The last stage's final norm (and SiameseNorm's merge norms) and output layer (none when tied on one stage)."""
    merge = ("final_layernorm", "final_layernorm.merge.x_norm", "final_layernorm.merge.y_norm")
    found = _norms("decoder.", shape, merge if scheme == "siamese" else merge[:1])
    if not shape.tied or pipeline > 1:
        found.append(Parameter("output_layer.weight", shape.vocab * shape.hidden, split="tp",
                               shared_embedding=shape.tied))
    return found
