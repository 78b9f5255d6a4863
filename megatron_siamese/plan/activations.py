"""What one microbatch's forward keeps for backward, per model chunk, stock and SiameseNorm.

Counted per rank as Megatron's modules keep it, as storages: a view keeps its whole storage (V, and
Q and K unless RoPE makes new ones, keep the QKV projection's output whole). ``T = s b / cp`` tokens,
``Ts = T / tp`` under sequence parallelism. SiameseNorm changes only the norms' and residuals' share,
by path (pytorch, apart, joined); attention, MLP and head are stock modules on ``h``-wide inputs.
Recompute (``recompute.py``): a sublayer's backward brings back what it dropped, and the peak adds
the larger of the two sublayers' working sets once.
Full story, term by term: docs/scale.md, "Where it comes from" and "Where SiameseNorm adds".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from megatron_siamese.plan.placement import Chunk
from megatron_siamese.plan.recompute import checkpointed_groups, layer_recompute
from megatron_siamese.plan.shapes import Shape
from megatron_siamese.runtime.layout import Layout

STOCK = "stock"
PATHS = ("pytorch", "apart", "joined")  # SiameseNorm's
STAT = 4  # fp32 statistic a token
IDS = 8  # int64 token id


@dataclass(frozen=True)
class Implementation:
    """How the layers compute, which decides what they keep."""

    bytes: int  # activation element
    attention: str = "unfused"  # "unfused" (probabilities kept) or "flash"
    fused_activation: bool = False  # the MLP's activation keeps its input only
    # Megatron's masked-softmax kernel (masked_softmax_fusion): 16-bit probabilities kept once; else
    # torch's softmax keeps its fp32 output beside the 16-bit copy the next matmul keeps
    softmax_fusion: bool = False
    rope_fusion: bool = False  # fused RoPE (apply_rope_fusion): no cosines and sines kept per layer
    # torch's norms' statistics (the stock norms, the final norm and merge, SiameseNorm's PyTorch path):
    # fp32 on CUDA; torch's CPU LayerNorm keeps them in its weights' dtype. The fused ops keep fp32.
    norm_stat_bytes: int = 4
    # torch's dropout mask (the embedding's, the attention's, stock's bias-dropout-add): CUDA's native
    # dropout keeps a bool mask, the CPU's its scaled noise in the activation dtype. SiameseNorm's
    # own hidden-dropout mask is bool everywhere (stream_arithmetic.dropout_mask).
    dropout_mask_bytes: int = 1
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0


@dataclass(frozen=True)
class Tokens:
    """A microbatch's tokens on one rank."""

    whole: int  # T = s b / cp
    sharded: int  # T / tp under sequence parallelism, else T
    seq: int  # s / cp


def tokens_of(shape: Shape, layout: Layout, micro_batch: int) -> Tokens:
    whole = shape.seq * micro_batch // layout.cp
    return Tokens(whole, whole // layout.tp if layout.sp else whole, shape.seq // layout.cp)


@dataclass(frozen=True)
class LayerActivations:
    """One layer's kept bytes: its input (the residual streams it receives) and the rest, and what
    its recomputation brings back at once in backward."""

    input: float
    rest: float
    recomputed: float = 0.0

    @property
    def total(self) -> float:
        return self.input + self.rest


def _norm(shape: Shape, tokens: Tokens, impl: Implementation, width: int = 0) -> float:
    """A torch norm module's input (``width`` wide, 0 if counted elsewhere) and its statistics."""
    return tokens.sharded * (width * impl.bytes + impl.norm_stat_bytes * shape.norm_statistics)


@dataclass(frozen=True)
class AttentionKept:
    """The attention sublayer past its normalized input: what it keeps (``plain``), what it keeps
    under selective "core_attn" recompute (``checkpointed``: the checkpoint's Q, K and V), and
    what that recompute brings back at once in backward (``recomputed``)."""

    plain: float
    checkpointed: float
    recomputed: float


def _attention(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation) -> AttentionKept:
    """Q, K and V as stored, the output, RoPE's cosines and sines unless fused, and the core attention's share:
    flash its fp32 log-sum-exp; the local one the probabilities, dropout, and under GQA / CP K and V repeated."""
    heads, groups = shape.heads // layout.tp, max(shape.groups // layout.tp, 1)
    d, b, per_head = shape.head_dim, impl.bytes, tokens.whole * heads
    gqa = groups < heads
    # Q and K are new tensors after RoPE (Q also after GQA's reshape); V, and Q and K when not new,
    # are views that keep the QKV projection's output whole
    stored = (heads if shape.rope or gqa else 0) + (groups if shape.rope else 0) + heads + 2 * groups
    rest = tokens.whole * heads * d * b  # the output
    if shape.rope and not impl.rope_fusion:
        rest += 4 * tokens.seq * d * b  # cosines and sines for Q and K
    checkpointed = rest + tokens.whole * stored * d * b
    if impl.attention == "flash":
        return AttentionKept(checkpointed + per_head * STAT, checkpointed, per_head * STAT)
    scores = per_head * tokens.seq * layout.cp
    core = scores * (b + (0 if impl.softmax_fusion or b == STAT else STAT))
    if impl.attention_dropout > 0:  # its mask, and its output the next matmul keeps
        core += scores * (impl.dropout_mask_bytes + b)
    if layout.cp > 1:  # the local context-parallel attention's mask over the gathered keys, made by each layer
        core += tokens.whole * tokens.seq * layout.cp  # a bool per sample, query and key
    if not gqa and layout.cp == 1:
        return AttentionKept(checkpointed + core, checkpointed, core)
    # K and V new tensors of the whole sequence: repeated to every head (GQA), all-gathered over CP
    # (the local CP attention: the QKV projection's output then kept only by a Q that is a view of it)
    q = heads if gqa or shape.rope else heads + 2 * groups
    kv = tokens.whole * layout.cp * 2 * (heads if gqa else groups) * d * b
    return AttentionKept(rest + tokens.whole * q * d * b + kv + core, checkpointed, core + kv)


def _mlp_internals(shape: Shape, rows: int, width: int, impl: Implementation) -> float:
    """An MLP's activation and ``linear_fc2`` input for ``rows`` tokens of local width ``width``."""
    if not shape.glu:
        return 2 * rows * width * impl.bytes
    return (3 if impl.fused_activation else 5) * rows * width * impl.bytes


def _router(shape: Shape, tokens: int) -> float:
    """The router and the token permutation for ``tokens`` tokens (the top-k indices and weights kept thrice)."""
    experts, topk = shape.experts, shape.topk
    return tokens * (experts * (3 * STAT + 1) + STAT + topk * (3 * IDS + STAT)) + experts * IDS


def _experts(shape: Shape, routed: int, width: int, impl: Implementation) -> float:
    """The experts' MLP over ``routed`` token copies, the routing weight applied to the activation."""
    internals = (4 if impl.fused_activation else 6) if shape.glu else 3
    return routed * (shape.hidden * impl.bytes + STAT + internals * width * impl.bytes)


def _mlp(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation, layer: int) -> Tuple[float, float]:
    """The MLP sublayer past its normalized input (kept by ``linear_fc1`` or the router): the
    dense MLP or an MoE layer's router and routed experts, and its shared expert (0 if none)."""
    if not shape.is_moe(layer):
        return _mlp_internals(shape, tokens.whole, shape.ffn // layout.tp, impl), 0.0
    routed = tokens.sharded * shape.topk * layout.expert_tp  # token copies this rank's experts compute
    experts = _router(shape, tokens.sharded) + _experts(shape, routed, shape.expert_ffn // layout.expert_tp, impl)
    shared = 0.0
    if shape.shared_expert_ffn:
        shared = _mlp_internals(shape, tokens.whole, shape.shared_expert_ffn // layout.tp, impl)
    return experts, shared


def _streams(shape: Shape, tokens: Tokens, impl: Implementation, variant: str, first: bool) -> LayerActivations:
    """The norms' and residuals' share of one layer: its input, and (as ``rest``) the rest."""
    h, t, b, stats = shape.hidden, tokens.sharded, impl.bytes, shape.norm_statistics
    torch_stats = impl.norm_stat_bytes * stats  # a torch norm's statistics a token
    entry = (1 if first else 2) * h  # the layer input's width: the embedding at the first layer
    if variant == STOCK:
        return LayerActivations(t * h * b, 2 * t * torch_stats + t * h * b)  # both norms' inputs
    if variant == "joined":
        return LayerActivations(t * entry * b, t * h * b + t * STAT * 14)  # z, statistics
    if variant == "apart":
        return LayerActivations(t * entry * b, t * 2 * h * b + 2 * t * STAT * 6)  # the MLP's packed input
    return LayerActivations(t * entry * b, t * 2 * h * b + 2 * t * h * b + 2 * 3 * t * torch_stats)


def _streams_without_norm_outputs(shape: Shape, tokens: Tokens, impl: Implementation, variant: str,
                                  rest: float) -> Tuple[float, float]:
    """Under selective "layernorm": what the norms and residuals keep past the layer input, and what one
    sublayer's norms keep when run again in backward (the joined ops keep theirs throughout)."""
    t, h, b = tokens.sharded, shape.hidden, impl.bytes
    torch_stats = t * impl.norm_stat_bytes * shape.norm_statistics
    return {STOCK: (t * h * b, torch_stats), "joined": (rest, 0.0), "apart": (t * 2 * h * b, t * STAT * 6),
            "pytorch": (t * 2 * h * b, t * h * b + 3 * torch_stats)}[variant]


def layer_activations(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation, variant: str,
                      layer: int, index_in_chunk: int = 0) -> LayerActivations:
    """Bytes one layer keeps for one microbatch, and what its selective recomputation brings back at once
    (full recompute is ``chunk_activations``'s)."""
    streams = _streams(shape, tokens, impl, variant, first=layer == 0)
    t, h, b = tokens.sharded, shape.hidden, impl.bytes
    attention = _attention(shape, layout, tokens, impl)
    mlp, shared = _mlp(shape, layout, tokens, impl, layer)
    # one dropout mask per sublayer: torch's for stock, SiameseNorm's own bool one
    masks = 2 * t * h * (impl.dropout_mask_bytes if variant == STOCK else 1) if impl.hidden_dropout > 0 else 0
    normalized = 2 * t * h * b  # what linear_qkv and linear_fc1 (or the router) keep
    rest = streams.rest + normalized + attention.plain + mlp + shared + masks
    again = layer_recompute(layout.recompute, shape.is_moe(layer), index_in_chunk)
    mlp_phase = attention_phase = 0.0  # what the backward of each sublayer brings back at once
    if again.norms:
        kept, norms = _streams_without_norm_outputs(shape, tokens, impl, variant, streams.rest)
        rest += kept - streams.rest - normalized
        mlp_phase += t * h * b + norms
        attention_phase += t * h * b + norms
    if again.core_attention:
        rest += attention.checkpointed - attention.plain
        attention_phase += attention.recomputed
    if again.mlp:
        rest -= mlp
        mlp_phase += mlp
    if again.shared_expert:
        rest -= shared
        mlp_phase += shared
    return LayerActivations(streams.input, rest, max(mlp_phase, attention_phase))


def embedding_activations(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation) -> float:
    """The first chunk's embedding: token ids (and positions), the dropout mask."""
    kept = tokens.whole * IDS * (2 if shape.learned_positions else 1)
    if impl.hidden_dropout > 0:
        kept += tokens.sharded * shape.hidden * impl.dropout_mask_bytes
    return kept


def head_activations(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation, variant: str) -> float:
    """The last chunk's final norm (and SiameseNorm's merge), output layer and cross entropy."""
    t, h, b = tokens.sharded, shape.hidden, impl.bytes
    kept = _norm(shape, tokens, impl, h) + t * h * b  # final norm, output layer's input
    if variant != STOCK:  # the packed streams into the merge, its two norms' statistics
        kept += t * 2 * h * b + 2 * t * impl.norm_stat_bytes * shape.norm_statistics
    vocab = shape.vocab // layout.tp
    kept += tokens.whole * (vocab * STAT + 1 + IDS + STAT)  # probabilities, mask, targets; the loss mask
    return kept


@dataclass(frozen=True)
class ChunkActivations:
    """What one chunk keeps per microbatch in flight, and what it holds once on top."""

    kept: float  # activations, the received input streams excluded
    received: float  # the input streams received from the previous stage (0 on the first chunk)
    sent: float  # the output streams it sends on (0 on the last chunk)
    # what a layer's recomputation adds at once in backward, past what its microbatch's later layers
    # and head have freed by then
    working: float


def chunk_activations(chunk: Chunk, shape: Shape, layout: Layout, impl: Implementation, variant: str,
                      micro_batch: int) -> ChunkActivations:
    tokens = tokens_of(shape, layout, micro_batch)
    layers = [layer_activations(shape, layout, tokens, impl, variant, layer, index)
              for index, layer in enumerate(chunk.layers)]
    for group in checkpointed_groups(layout.recompute, len(layers)):
        # full recompute: a group keeps its first layer's input; its backward brings back all of it
        whole = sum(layers[i].total for i in group) - layers[group[0]].input
        for i in group:
            layers[i] = LayerActivations(layers[i].input if i == group[0] else 0.0, 0.0, 0.0)
        layers[group[0]] = LayerActivations(layers[group[0]].input, 0.0, whole)
    kept = sum(layer.total for layer in layers)
    head = head_activations(shape, layout, tokens, impl, variant) if chunk.last else 0.0
    # a layer's recomputation runs in its backward, once the layers after it and the head have freed
    # what this microbatch kept: it adds to the peak only what exceeds that
    working, freed = 0.0, head
    for layer in reversed(layers):
        working = max(working, layer.recomputed - freed)
        freed += layer.total
    received = 0.0 if chunk.first else layers[0].input
    kept -= received
    if chunk.first:
        kept += embedding_activations(shape, layout, tokens, impl)
    kept += head
    width = shape.hidden * (1 if variant == STOCK else 2)
    sent = 0.0 if chunk.last else tokens.sharded * width * impl.bytes
    return ChunkActivations(kept, received, sent, working)
